"""Confirmed publishes from a client on a partition's leader vs on another node (issue 35
stage 3: publishes forwarded to the partitions' leaders).

Three real nodes (``LocalCluster``), ``[cluster] partition_groups = true``, P = 3
(NR = 2). One durable queue of the partition led by node L; a client (aiormq, one
channel, publisher confirms, ``--window`` publishes unconfirmed at a time, persistent
messages of ``--size`` bytes) publishes ``--messages`` to it, alternately connected to
L itself (*leader*: enqueued there) and to a node F that leads the metadata group
rather than that partition (*forwarded*: F forwards each message to L,
``partition/forwarding.py``), ``--rounds`` times each in the same cluster. Printed
per phase: confirmed publishes a second and the CPU seconds per message of L and F
(``/proc/<pid>/stat``, user + system), then the medians and the ratio forwarded /
leader. The client runs on the same cores as the nodes (2 shared cores here): the
figures are relative.

    .venv/bin/python benchmarks/forward_confirms.py --messages 5000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import deque

import aiormq
import pika

from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster

OPTIONS: dict[str, float | str | bool] = {
    "heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
    "backup_timeout": 3.0, "partitions": 3, "partition_groups": True}
TICKS = os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def serving(cluster: LocalCluster) -> dict[int, str]:
    """group -> the node serving it (once each group has one)."""
    while True:
        found: dict[int, str] = {}
        for name in cluster.names:
            groups = ((cluster.status(name) or {}).get("node", {}).get("groups") or {})
            for g, v in groups.items():
                if v["serving"]:
                    found[int(g)] = name
        if len(found) == 4:
            return found
        time.sleep(0.1)


async def publish(url: str, queue: str, messages: int, window: int, size: int) -> float:
    """Seconds to publish ``messages`` with at most ``window`` unconfirmed, all acked."""
    conn = await aiormq.connect(url)
    try:
        ch = await conn.channel()
        body = b"x" * size
        props = aiormq.spec.Basic.Properties(delivery_mode=2)
        pending: deque[asyncio.Future[object]] = deque()
        started = time.monotonic()
        for _ in range(messages):
            pending.append(asyncio.ensure_future(
                ch.basic_publish(body, routing_key=queue, properties=props)))
            if len(pending) >= window:
                confirm = await pending.popleft()
                assert isinstance(confirm, aiormq.spec.Basic.Ack), confirm
        for fut in pending:
            confirm = await fut
            assert isinstance(confirm, aiormq.spec.Basic.Ack), confirm
        return time.monotonic() - started
    finally:
        await conn.close()


def purge(cluster: LocalCluster, node: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(node)))
    try:
        conn.channel().queue_purge(queue)
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, float]]] = {"leader": [], "forwarded": []}
    with LocalCluster(3, options=OPTIONS) as cluster:
        cluster.wait_primary(30)
        leaders = serving(cluster)
        forwarder = leaders[0]
        partition = next(g - 1 for g in (1, 2, 3) if leaders[g] != forwarder)
        leader = leaders[partition + 1]
        queue = next(f"bench-{i}" for i in range(1000)
                     if hash_partition("/", f"bench-{i}", 3) == partition)
        conn = pika.BlockingConnection(pika.URLParameters(cluster.url(leader)))
        conn.channel().queue_declare(queue, durable=True)
        conn.close()
        pids = {n: cluster.nodes[n].proc.pid for n in (leader, forwarder)}  # type: ignore[union-attr]
        print(f"queue {queue} of partition {partition} led by {leader}; the forwarding node "
              f"{forwarder}; {args.messages} x {args.size} B, window {args.window}",
              flush=True)
        for rnd in range(args.rounds):
            for phase, node in (("leader", leader), ("forwarded", forwarder)):
                before = {n: cpu(p) for n, p in pids.items()}
                took = asyncio.run(publish(cluster.url(node), queue, args.messages,
                                           args.window, args.size))
                used = {n: cpu(p) - before[n] for n, p in pids.items()}
                rate = args.messages / took
                per_l = used[leader] / args.messages * 1e6
                per_f = used[forwarder] / args.messages * 1e6
                results[phase].append((rate, per_l, per_f))
                print(f"round {rnd} {phase:9}: {rate:7.0f} confirmed/s; CPU per message "
                      f"leader {leader} {per_l:5.1f} us, {forwarder} {per_f:5.1f} us; "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
                purge(cluster, leader, queue)
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)]
           for k, v in results.items()}
    for phase, (rate, per_l, per_f) in med.items():
        print(f"median {phase:9}: {rate:7.0f} confirmed/s, leader {per_l:.1f} us/msg, "
              f"the other node {per_f:.1f} us/msg")
    print(f"forwarded / leader: {med['forwarded'][0] / med['leader'][0]:.2f}x confirmed/s")


if __name__ == "__main__":
    main()
