"""TX commits on a node running partition groups: local vs across partitions (issue 35
stage 4, ``partition/transactions.py``), against the same TX on an unpartitioned cluster.

Two clusters of three real nodes (``LocalCluster``), one after the other: an
unpartitioned one (*reference*: a client on the primary commits transactions of
``--size``-byte persistent messages, ``--messages`` per transaction, to one durable
queue) and one with ``[cluster] partition_groups = true``, P = 3, where a client on A
(the metadata group's leader) commits the same transactions, in alternating phases:

- *local*: to a queue of a partition A leads (today's local TX, answered through that
  group's gate: ``GroupClients.tx_commit``);
- *cross*: the messages split between queues of the two partitions A does not lead
  (A's coordinator: prepare on both leaders, the decision, the other's commit);
- *cross+own*: split between A's partition and one it does not lead (A's own branch
  through its own rules, in process).

``--commits`` commits per phase, ``--rounds`` phases of each. Printed: commits a
second per phase, the medians, and each ratio to the reference; the machine's load
(``uptime``) before and after. One pika ``BlockingConnection``: a commit's rate is one
over its latency. The nodes and the client share the machine's cores.

    .venv/bin/python benchmarks/partition_tx.py --commits 200 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pika

from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster

FAST: dict[str, float | str | bool] = {
    "heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
    "backup_timeout": 3.0}
GROUPS = {**FAST, "partitions": 3, "partition_groups": True}


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def name_in(partition: int, prefix: str) -> str:
    return next(f"{prefix}-{i}" for i in range(1000)
                if hash_partition("/", f"{prefix}-{i}", 3) == partition)


def serving(cluster: LocalCluster) -> dict[int, str]:
    """group -> the node serving it, once each group has one and every node is ready."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found: dict[int, str] = {}
        ready = True
        for name in cluster.names:
            groups = ((cluster.status(name) or {}).get("node", {}).get("groups") or {})
            ready = ready and len(groups) == 4 and all(g["ready"] for g in groups.values())
            for g, v in groups.items():
                if v["serving"]:
                    found[int(g)] = name
        if len(found) == 4 and ready:
            return found
        time.sleep(0.1)
    raise TimeoutError("the groups have no leaders")


def declare(url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_declare(queue, durable=True)
    finally:
        conn.close()


def commits(url: str, queues: list[str], commits: int, messages: int, size: int) -> float:
    """Commits a second: ``commits`` transactions of ``messages`` each, spread over
    ``queues`` in turn."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.tx_select()
        body = b"x" * size
        props = pika.BasicProperties(delivery_mode=2)
        started = time.monotonic()
        for _ in range(commits):
            for m in range(messages):
                ch.basic_publish("", queues[m % len(queues)], body, props)
            ch.tx_commit()
        return commits / (time.monotonic() - started)
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commits", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=2)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    print(f"before: {load()}")
    results: dict[str, list[float]] = {"reference": [], "local": [], "cross": [],
                                       "cross+own": []}
    with LocalCluster(3, options=FAST) as cluster:
        primary = cluster.wait_primary()
        declare(cluster.url(primary), "ref")
        for _ in range(args.rounds):
            rate = commits(cluster.url(primary), ["ref"], args.commits, args.messages,
                           args.size)
            results["reference"].append(rate)
            print(f"reference (unpartitioned, client on the primary {primary}): "
                  f"{rate:.0f} commits/s; {load()}")
    with LocalCluster(3, options=GROUPS) as cluster:
        leaders = serving(cluster)
        a = leaders[0]
        own = [g - 1 for g in (1, 2, 3) if leaders[g] == a]
        others = [g - 1 for g in (1, 2, 3) if leaders[g] != a]
        print(f"leaders {leaders}; client on {a}, which leads partitions {own}")
        queues = {p: name_in(p, f"tx{p}") for p in range(3)}
        for p, queue in queues.items():
            declare(cluster.url(leaders[p + 1]), queue)
        phases: dict[str, list[str]] = {}
        if own:
            phases["local"] = [queues[own[0]]]
            if others:
                phases["cross+own"] = [queues[own[0]], queues[others[0]]]
        if len(others) >= 2:
            phases["cross"] = [queues[others[0]], queues[others[1]]]
        for _ in range(args.rounds):
            for phase, targets in phases.items():
                rate = commits(cluster.url(a), targets, args.commits, args.messages,
                               args.size)
                results[phase].append(rate)
                print(f"{phase}: {rate:.0f} commits/s; {load()}")
        status = (cluster.status(a) or {})["node"].get("transactions")
        print(f"A's coordinator: {status}")
    reference = statistics.median(results["reference"])
    print(f"after: {load()}")
    print(f"medians ({args.rounds} rounds of {args.commits} commits of {args.messages} "
          f"messages of {args.size} bytes):")
    for phase, rates in results.items():
        if rates:
            median = statistics.median(rates)
            print(f"  {phase:10s} {median:7.0f} commits/s  {median / reference:5.2f} x the "
                  "reference")


if __name__ == "__main__":
    main()
