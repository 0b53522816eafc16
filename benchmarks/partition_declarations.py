"""Declarations on a partition's leader vs from another node (issue 35 stage 3's
declarations from any node, ``partition/declarations.py``).

Three real nodes (``LocalCluster``), ``[cluster] partition_groups = true``, P = 3
(NR = 2). A pika ``BlockingConnection`` declares ``--queues`` durable queues of the
partition led by node L, one at a time, binds each to a direct exchange and deletes
it, alternately connected to L itself (*leader*: applied there) and to a node F that
leads another partition (*remote*: each method asked of L, answered once durable there
and F's copy holds it), ``--rounds`` times each in the same cluster. Printed per
phase: the median and 95th percentile of each method's round trip as the client
sees it, then the medians of the phases and the ratio remote / leader, with the
machine's load. The client runs on the same cores as the nodes (2 shared cores here):
the figures are relative.

    .venv/bin/python benchmarks/partition_declarations.py --queues 200 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from partition_cluster import FAST, METHODS, declarations, ms

from brokerha.testing import LocalCluster

OPTIONS: dict[str, float | str | bool] = {**FAST, "partitions": 3, "partition_groups": True}


def serving(cluster: LocalCluster) -> dict[int, str]:
    """group -> the node serving it (once each group has exactly one)."""
    deadline = time.monotonic() + 60
    while True:
        found: dict[int, list[str]] = {g: [] for g in range(4)}
        for name in cluster.names:
            groups = ((cluster.status(name) or {}).get("node", {}).get("groups") or {})
            for g, v in groups.items():
                if v["serving"]:
                    found[int(g)].append(name)
        if all(len(v) == 1 for v in found.values()):
            return {g: v[0] for g, v in found.items()}
        if time.monotonic() > deadline:
            raise SystemExit(f"no single leader per group: {found}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with LocalCluster(3, options=OPTIONS) as cluster:
        leaders = serving(cluster)
        by_node: dict[str, list[int]] = {}
        for g in (1, 2, 3):
            by_node.setdefault(leaders[g], []).append(g - 1)
        if len(by_node) < 2:
            raise SystemExit(f"one node leads every partition: {leaders}")
        leader, (partition, *_) = next(iter(by_node.items()))
        remote = next(n for n in by_node if n != leader)
        print(f"partition {partition} led by {leader}; remote client on {remote} (leads "
              f"{by_node[remote]}); metadata group led by {leaders[0]}; load "
              f"{os.getloadavg()[0]:.1f}")
        medians: dict[str, dict[str, list[float]]] = {"leader": {m: [] for m in METHODS},
                                                      "remote": {m: [] for m in METHODS}}
        for r in range(args.rounds):
            for kind, node in (("leader", leader), ("remote", remote)):
                times = declarations(cluster.url(node), partition, 3, "bd", f"{kind}{r}",
                                     args.queues)
                medians[kind]["declare"].append(ms(times["declare"], 0.5))
                medians[kind]["bind"].append(ms(times["bind"], 0.5))
                medians[kind]["delete"].append(ms(times["delete"], 0.5))
                print(f"round {r} {kind:6} on {node}: " + ", ".join(
                    f"{m} p50 {ms(times[m], 0.5):.2f} ms p95 {ms(times[m], 0.95):.2f} ms"
                    for m in METHODS) + f" (load {os.getloadavg()[0]:.1f})")
        print("medians of the rounds' p50: " + "; ".join(
            f"{m} leader {statistics.median(medians['leader'][m]):.2f} ms, remote "
            f"{statistics.median(medians['remote'][m]):.2f} ms, ratio "
            f"{statistics.median(medians['remote'][m]) / statistics.median(medians['leader'][m]):.2f}x"
            for m in METHODS) + f"; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
