"""Per-partition confirm gaps around a SIGKILL, with partition groups (issue 35 stage 2).

Three real nodes (``LocalCluster``), ``[cluster] partition_groups = true``, P = 3
(NR = 2). One publisher per partition, on that partition's leader (found in the
nodes' ``/api/status`` ``groups``), publishes persistent messages one at a time
with confirms; after 3 s the leader of one partition is SIGKILLed (``--kill
partition-leader``: a node that does not lead the metadata group; ``--kill
metadata-primary``: the node leading the metadata group and its own partition).
The publisher of the killed partition finds the new leader in the survivors'
statuses and connects there. Printed per run and partition: the longest gap
between two confirms from 1 s before the kill to 3 s after it, against the
median gap before the kill. The gap of the killed partition includes the
client's discovery (status polls) and its reconnection; the others' show
whether they paused at all.

    .venv/bin/python benchmarks/groups_failover.py --runs 3 --kill partition-leader
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import pika

from brokerha.partition.group_simulation import queue_names
from brokerha.testing import LocalCluster

OPTIONS: dict[str, float | str | bool] = {
    "heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
    "backup_timeout": 3.0, "partitions": 3, "partition_groups": True}
QUEUES = queue_names(3)  # one name per partition


def leader_of(cluster: LocalCluster, group: int) -> str | None:
    for name in cluster.names:
        if not cluster.is_running(name):
            continue
        status = cluster.status(name) or {}
        g = (status.get("node", {}).get("groups") or {}).get(str(group))
        if g and g["serving"]:
            return name
    return None


def publish(cluster: LocalCluster, partition: int, stop: threading.Event,
            confirmed: list[float]) -> None:
    while not stop.is_set():
        node = leader_of(cluster, partition + 1)
        if node is None:
            time.sleep(0.005)
            continue
        try:
            conn = pika.BlockingConnection(pika.URLParameters(
                cluster.url(node) + "?socket_timeout=2&blocked_connection_timeout=2"))
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(QUEUES[partition], durable=True)
            while not stop.is_set():
                ch.basic_publish("", QUEUES[partition], b"x",
                                 pika.BasicProperties(delivery_mode=2))
                confirmed.append(time.monotonic())
            conn.close()
        except pika.exceptions.AMQPError:
            time.sleep(0.005)


def one_run(kill: str) -> list[tuple[int, bool, float, float]]:
    """Per partition: (partition, killed, longest gap around the kill, median gap before)."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        cluster.wait_primary(30)
        while any(leader_of(cluster, g) is None for g in range(4)):
            time.sleep(0.1)
        metadata = leader_of(cluster, 0)
        victim_p = next(p for p in range(3) if (leader_of(cluster, p + 1) == metadata)
                        == (kill == "metadata-primary"))
        victim = leader_of(cluster, victim_p + 1)
        assert victim is not None
        stop = threading.Event()
        logs: dict[int, list[float]] = {p: [] for p in range(3)}
        threads = [threading.Thread(target=publish, args=(cluster, p, stop, logs[p]))
                   for p in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(3.0)
        killed = time.monotonic()
        cluster.kill(victim)
        time.sleep(4.0)
        stop.set()
        for thread in threads:
            thread.join(10)
    out = []
    for p, times in logs.items():
        pairs = list(zip(times, times[1:], strict=False))
        around = [b - a for a, b in pairs if b > killed - 1 and a < killed + 3]
        before = [b - a for a, b in pairs if b < killed]
        out.append((p, p == victim_p, max(around), statistics.median(before)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kill", choices=["partition-leader", "metadata-primary"],
                        default="partition-leader")
    args = parser.parse_args()
    killed, others = [], []
    for run in range(args.runs):
        for p, was_killed, gap, median in one_run(args.kill):
            (killed if was_killed else others).append(gap)
            print(f"run {run} partition {p} {'killed' if was_killed else 'other '}: longest "
                  f"confirm gap {gap * 1000:.0f} ms (median before {median * 1000:.1f} ms)",
                  flush=True)
    print(f"killed partitions: longest gap {min(killed) * 1000:.0f}-{max(killed) * 1000:.0f} "
          f"ms; the others: {min(others) * 1000:.0f}-{max(others) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
