"""What naming an exclusive queue's owner in the queue directory costs its declare (issue
35 task I, docs/ha.md "Exclusive queues on a partitioned cluster").

On a partitioned cluster an exclusive queue's declare-ok waits for the owner's entry to
be durable in the metadata group (so another node answers 405 from then on). One real
cluster (``LocalCluster``), three nodes, P = 9 (the tests' layout), a pika
``BlockingConnection`` on a node that is NOT the metadata group's leader (the entry
crosses a link) and on the leader; per round ``--queues`` declares, one at a time, of
client-named **exclusive** queues, then as the reference in the same run the same
number of non-durable, non-exclusive queues named into partitions that node leads
(answered by its own partition: no directory), each deleted after. Printed: each
kind's p50 and p95 per round, the medians of the rounds' p50 and the ratio
exclusive / reference, with the machine's load (``os.getloadavg``). Client and nodes
share the 2 cores: the figures are relative.

    .venv/bin/python benchmarks/exclusive_declarations.py --queues 200 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pika
from partition_cluster import FAST, ms, serving

from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster

P = 9
OPTIONS: dict[str, float | str | bool] = {**FAST, "partitions": P, "partition_groups": True}


def phase(url: str, led: set[int], tag: str, queues: int) -> dict[str, list[float]]:
    own = [n for n in (f"xd-{tag}-r{i}" for i in range(queues * 40))
           if hash_partition("/", n, P) in led][:queues]
    times: dict[str, list[float]] = {"exclusive": [], "reference": []}
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for i in range(queues):
            started = time.perf_counter()
            ch.queue_declare(f"xd-{tag}-x{i}", exclusive=True)
            times["exclusive"].append(time.perf_counter() - started)
            ch.queue_delete(f"xd-{tag}-x{i}")
        for name in own:
            started = time.perf_counter()
            ch.queue_declare(name)
            times["reference"].append(time.perf_counter() - started)
            ch.queue_delete(name)
    finally:
        conn.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {}
    with LocalCluster(3, options=OPTIONS) as cluster:
        lead = serving(cluster, P, every_group=True)
        meta = lead[0]
        for where, node in (("not the metadata leader", next(
                n for n in cluster.names if n != meta)), ("the metadata leader", meta)):
            led = {g - 1 for g, n in lead.items() if g and n == node}
            for r in range(args.rounds):
                times = phase(cluster.url(node), led, f"{node}{r}", args.queues)
                load = os.getloadavg()[0]
                line = ", ".join(f"{k} p50 {ms(v, 0.5):.2f} ms p95 {ms(v, 0.95):.2f} ms"
                                 for k, v in times.items())
                print(f"{node} ({where}) round {r}: {line}; load {load:.1f}")
                for k, v in times.items():
                    medians.setdefault(f"{where}/{k}", []).append(ms(v, 0.5))
        for where in ("not the metadata leader", "the metadata leader"):
            ex = statistics.median(medians[f"{where}/exclusive"])
            ref = statistics.median(medians[f"{where}/reference"])
            print(f"{where}: exclusive declare p50 {ex:.2f} ms vs reference "
                  f"{ref:.2f} ms: x{ex / ref:.1f}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
