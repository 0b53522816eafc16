"""What the queue directory costs a declaration (issue 35, ``partition/directory.py``).

With N > NR + 1 a queue's declare, bind and delete answer only once the queue directory
(in the metadata log) holds what they changed -- on the partition's leader too, whose
own clients' methods then go through its declaration host. Two real clusters
(``LocalCluster``), one after the other, each P = 4 and NR = 2 (every partition on
three nodes): *directory*, four nodes (each node outside one partition: the directory
kept), and the reference *none*, three nodes (every node a cell of every partition: no
directory). A pika ``BlockingConnection`` on a partition's leader declares ``--queues``
durable queues of that partition, one at a time, binds each to a direct exchange and
deletes it, ``--rounds`` times; on four nodes also from the node outside that
partition (*outside*). Printed: each method's p50 and p95 round trip per round, then
the medians of the rounds' p50 and the ratios directory / none, with the machine's
load. The client runs on the same cores as the nodes (2 shared cores here): the
figures are relative, the clusters run one after the other.

    .venv/bin/python benchmarks/directory_declarations.py --queues 150 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics

from partition_cluster import FAST, METHODS, declarations, ms, serving

from brokerha.testing import LocalCluster

P = 4
OPTIONS: dict[str, float | str | bool] = {**FAST, "partitions": P, "partition_replicas": 2,
                                          "partition_groups": True}


def cells(cluster: LocalCluster, node: str) -> dict[int, list[str]]:
    status = (cluster.status(node) or {}).get("node", {}).get("partitions") or {}
    return {p: [c[0] for c in row] for p, row in enumerate(status.get("rows") or [])}


def run(nodes: int, queues: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """The rounds' p50 per client place and method."""
    out: dict[str, dict[str, list[float]]] = {}
    with LocalCluster(nodes, options=OPTIONS) as cluster:
        leaders = serving(cluster, P, every_group=False)
        table = cells(cluster, leaders[0])
        # a partition whose leader does not lead the metadata group, and (four nodes) the
        # node outside it, if it leads a group (one leading none relays to the coordinator)
        partition = next((p for p in range(P) if leaders[p + 1] != leaders[0]), 0)
        leader = leaders[partition + 1]
        places = {"leader": leader}
        outside = [n for n in cluster.names if n not in table.get(partition, cluster.names)]
        if outside and outside[0] in leaders.values():
            places["outside"] = outside[0]
        print(f"{nodes} nodes: partition {partition} led by {leader}, cells "
              f"{table.get(partition)}, metadata group led by {leaders[0]}; clients on "
              f"{places}; load {os.getloadavg()[0]:.1f}")
        for r in range(rounds):
            for place, node in places.items():
                times = declarations(cluster.url(node), partition, P, "dd", f"{nodes}{place}{r}",
                                     queues)
                for m in METHODS:
                    out.setdefault(place, {}).setdefault(m, []).append(ms(times[m], 0.5))
                print(f"  round {r} {place:7} on {node}: " + ", ".join(
                    f"{m} p50 {ms(times[m], 0.5):.2f} p95 {ms(times[m], 0.95):.2f} ms"
                    for m in METHODS) + f" (load {os.getloadavg()[0]:.1f})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    directory = run(4, args.queues, args.rounds)
    none = run(3, args.queues, args.rounds)
    for m in METHODS:
        ref = statistics.median(none["leader"][m])
        line = f"{m}: on the leader without a directory {ref:.2f} ms, with it " \
               f"{statistics.median(directory['leader'][m]):.2f} ms " \
               f"({statistics.median(directory['leader'][m]) / ref:.2f}x)"
        if "outside" in directory:
            out = statistics.median(directory["outside"][m])
            line += f", from the node outside {out:.2f} ms ({out / ref:.2f}x)"
        print(line + f"; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
