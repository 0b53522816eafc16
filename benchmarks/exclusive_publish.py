"""What a publish to another node's exclusive queue costs (issue 35, docs/ha.md "Exclusive
queues on a partitioned cluster": the reply of an RPC whose caller is on another node).

One real cluster (``LocalCluster``), three nodes, P = 9 (the tests' layout). A pika
``BlockingConnection`` on node A holds an exclusive queue; per round ``--messages``
confirmed publishes (one at a time, 1 KiB, the default exchange), timed publish to
confirm: (1) *local*: from a second connection on A to the exclusive queue; (2)
*owner lane*: from node B to it (its stand-in there, forwarded to A, confirmed once A
took it); (3) *reference*: from B to a plain queue of a partition A leads (the same
link, forwarded to its leader). Each queue is drained after its round. Printed: each
kind's p50 and p95 per round, the medians of the rounds' p50, and the ratios, with the
machine's load (``os.getloadavg``). Client and nodes share the 2 cores: the figures are
relative.

    .venv/bin/python benchmarks/exclusive_publish.py --messages 500 --rounds 3
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
BODY = b"r" * 1024


def timed(url: str, queue: str, messages: int) -> list[float]:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        times = []
        for _ in range(messages):
            started = time.perf_counter()
            ch.basic_publish("", queue, BODY, mandatory=True)  # raises if returned or nacked
            times.append(time.perf_counter() - started)
        return times
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {}
    with LocalCluster(3, options=OPTIONS) as cluster:
        lead = serving(cluster, P, every_group=True)
        a = next(n for n in cluster.names if any(g and v == n for g, v in lead.items()))
        b = next(n for n in cluster.names if n != a)
        led = {g - 1 for g, n in lead.items() if g and n == a}
        plain = next(n for n in (f"xp-plain-{i}" for i in range(1000))
                     if hash_partition("/", n, P) in led)
        holder = pika.BlockingConnection(pika.URLParameters(cluster.url(a)))
        hch = holder.channel()
        exclusive = hch.queue_declare("", exclusive=True).method.queue
        hch.queue_declare(plain)
        time.sleep(0.5)  # (the owner entry is durable by the declare-ok; B's copy applies it)
        kinds = (("local", cluster.url(a), exclusive), ("owner lane", cluster.url(b), exclusive),
                 ("reference", cluster.url(b), plain))
        try:
            for r in range(args.rounds):
                parts = []
                for kind, url, queue in kinds:
                    times = timed(url, queue, args.messages)
                    hch.queue_purge(queue)
                    medians.setdefault(kind, []).append(ms(times, 0.5))
                    parts.append(f"{kind} p50 {ms(times, 0.5):.2f} ms p95 "
                                 f"{ms(times, 0.95):.2f} ms")
                print(f"round {r} (A={a}, B={b}): {', '.join(parts)}; "
                      f"load {os.getloadavg()[0]:.1f}")
            hch.queue_delete(plain)
        finally:
            holder.close()
    m = {k: statistics.median(v) for k, v in medians.items()}
    print(f"confirmed publish p50: local {m['local']:.2f} ms, owner lane "
          f"{m['owner lane']:.2f} ms, reference (B to a queue A leads) {m['reference']:.2f} "
          f"ms; owner lane / reference x{m['owner lane'] / m['reference']:.2f}, / local "
          f"x{m['owner lane'] / m['local']:.2f}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
