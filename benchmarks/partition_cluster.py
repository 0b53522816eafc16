"""Shared by the declaration benchmarks on a partitioned ``LocalCluster``
(``partition_declarations.py``, ``directory_declarations.py``,
``exclusive_declarations.py``): the fast failure-detection options, the wait for one
serving node per group, and the timed declare / bind / delete of one partition's queues.
Imported as a sibling module, as ``loadgen`` is (the benchmarks run as scripts)."""

from __future__ import annotations

import time

import pika

from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster

FAST: dict[str, float | str | bool] = {
    "heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
    "backup_timeout": 3.0}
METHODS = ("declare", "bind", "delete")


def serving(cluster: LocalCluster, partitions: int, *, every_group: bool) -> dict[int, str]:
    """group -> the node serving it, once each group has exactly one and every node is
    ready in each group it runs (``every_group``: and runs all P + 1); 90 s at most."""
    deadline = time.monotonic() + 90
    while True:
        found: dict[int, list[str]] = {g: [] for g in range(partitions + 1)}
        ready = True
        for name in cluster.names:
            groups = ((cluster.status(name) or {}).get("node", {}).get("groups") or {})
            runs = len(groups) == partitions + 1 if every_group else bool(groups)
            ready = ready and runs and all(v["ready"] for v in groups.values())
            for g, v in groups.items():
                if v["serving"]:
                    found[int(g)].append(name)
        if ready and all(len(v) == 1 for v in found.values()):
            return {g: v[0] for g, v in found.items()}
        if time.monotonic() > deadline:
            raise SystemExit(f"no single leader per group: {found}")
        time.sleep(0.1)


def declarations(url: str, partition: int, partitions: int, kind: str, tag: str,
                 queues: int) -> dict[str, list[float]]:
    """Each method's round trips (seconds) for ``queues`` durable queues of ``partition``
    (named ``kind-tag-i``), one at a time declared, bound to the direct exchange
    ``kind-x`` and deleted."""
    names = [f"{kind}-{tag}-{i}" for i in range(queues * 20)
             if hash_partition("/", f"{kind}-{tag}-{i}", partitions) == partition][:queues]
    exchange = f"{kind}-x"
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.exchange_declare(exchange, "direct", durable=True)
        for name in names:
            for method in METHODS:
                started = time.perf_counter()
                if method == "declare":
                    ch.queue_declare(name, durable=True)
                elif method == "bind":
                    ch.queue_bind(name, exchange, name)
                else:
                    ch.queue_delete(name)
                times[method].append(time.perf_counter() - started)
    finally:
        conn.close()
    return times


def ms(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (seconds) in milliseconds."""
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]
