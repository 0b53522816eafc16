"""Durable store benchmark: group commit through a real node, and raw store writes.

Two parts, for SQLite synchronous=FULL, SQLite synchronous=NORMAL and (when a
throw-away PostgreSQL can be started: Docker or initdb) PostgreSQL:

- ``store``: the SQLStore alone on an event loop, 1 KiB persistent messages
  written in batches of 1, 10, 100, 1000 messages (one unit and one commit per
  batch, waiting for each); messages/s.
- ``node``: a ``brokerha node`` with that store (and with ``--store memory``
  as the no-durability reference), driven by ``loadgen.py``:
  ``confirm`` (persistent publishes with confirms, a consumer acking) and
  ``tx`` (10 persistent publishes per tx.commit); plus the latency of one
  confirmed publish at a time with pika (p50/p99).

Usage::

    .venv/bin/python benchmarks/store_group_commit.py                 # everything (~1.5 min)
    .venv/bin/python benchmarks/store_group_commit.py --parts store --backends sqlite-full
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import loadgen
import pika

from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry
from brokerha.store.sql import SQLStore
from brokerha.testing import NodeProcess
from brokerha.testing_postgres import create_database, throwaway_server

BATCH_SIZES = (1, 10, 100, 1000)
BODY = b"x" * 1024
BACKENDS = ("memory", "sqlite-full", "sqlite-normal", "postgresql")


@dataclass(frozen=True)
class Backend:
    name: str
    url: str
    synchronous: str = "full"

    @property
    def durable(self) -> bool:
        return self.url != "memory"

    def node_args(self) -> list[str]:
        if not self.durable:
            return ["--store", "memory"]
        return ["--store", self.url, "--store-synchronous", self.synchronous]


# -- raw store writes ------------------------------------------------------------------------

def _persistent_message() -> Entry:
    from pamqp import commands

    from brokerha.broker.content import build_header
    from brokerha.broker.message import Message

    header = build_header(len(BODY), commands.Basic.Properties(delivery_mode=2))
    return Entry(0, Message("", "q", header, BODY), None)


def store_rate(backend: Backend, batch: int, seconds: float, max_rows: int = 60_000) -> float:
    """Messages/s written by the store in commits of ``batch`` messages."""
    loop = asyncio.new_event_loop()
    store = SQLStore(backend.url, synchronous=backend.synchronous)
    queue = Broker(store=store).add_vhost("/").declare_queue(
        f"bench{batch}", owner=None, durable=True)
    template = _persistent_message()
    store.start(loop)
    position, written = 0, 0

    async def one_batch() -> None:
        nonlocal position
        for _ in range(batch):
            position += 1
            store.enqueued(queue, Entry(position, template.message, None))
        done = loop.create_future()
        store.after_sync(lambda: done.set_result(None))
        await done

    async def run() -> float:
        nonlocal written
        await one_batch()  # the queue row and a warm connection
        start = time.perf_counter()
        while time.perf_counter() - start < seconds and written < max_rows:
            await one_batch()
            written += batch
        return written / (time.perf_counter() - start)

    try:
        return loop.run_until_complete(run())
    finally:
        store.close()
        loop.close()


# -- through a node ----------------------------------------------------------------------------

def confirm_latency_ms(url: str, seconds: float) -> tuple[float, float]:
    """p50 and p99 of one persistent publish + confirm at a time (pika)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("latency", durable=True)
    props = pika.BasicProperties(delivery_mode=2)
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        ch.basic_publish("", "latency", BODY, props)
        samples.append((time.perf_counter() - t0) * 1000)
    conn.close()
    q = statistics.quantiles(samples, n=100)
    return q[49], q[98]


def node_figures(backend: Backend, duration: float, warmup: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="brokerha-bench-") as data, \
            NodeProcess("bench", data_dir=data, extra_args=backend.node_args()) as node:
        confirm = asyncio.run(loadgen.run_workload(node.url, "confirm", duration, warmup))
        tx = asyncio.run(loadgen.run_workload(node.url, "tx", duration, warmup))
        p50, p99 = confirm_latency_ms(node.url, min(duration, 3.0))
    return {"confirm_msgs_s": confirm.msgs_per_s, "tx_commits_s": tx.commits_per_s,
            "tx_msgs_s": tx.msgs_per_s, "latency_p50_ms": p50, "latency_p99_ms": p99}


# -- backends ----------------------------------------------------------------------------------

@contextlib.contextmanager
def backends(names: list[str], workdir: Path) -> Iterator[list[Backend]]:
    """The requested backends; PostgreSQL is skipped (with a note) when it cannot start."""
    found = [Backend("memory", "memory")] if "memory" in names else []
    for name in names:
        if name.startswith("sqlite-"):
            found.append(Backend(name, f"sqlite:///{workdir / name}.db", name.split("-")[1]))
    if "postgresql" not in names:
        yield found
        return
    try:
        server = throwaway_server()
        url = server.__enter__()
    except (LookupError, ImportError, RuntimeError) as exc:
        print(f"note: PostgreSQL skipped: {exc}", file=sys.stderr)
        yield found
        return
    try:
        yield [*found, Backend("postgresql", url)]
    finally:
        server.__exit__(None, None, None)


def fresh(backend: Backend, tag: str, workdir: Path) -> Backend:
    """The same backend on an empty database."""
    if not backend.durable:
        return backend
    if backend.url.startswith("sqlite"):
        return Backend(backend.name, f"sqlite:///{workdir / f'{backend.name}-{tag}.db'}",
                       backend.synchronous)
    return Backend(backend.name, create_database(backend.url, f"bench_{tag}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=["store", "node"], default=["store", "node"])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    parser.add_argument("--warmup", type=float, default=1.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="brokerha-bench-") as tmp, \
            backends(args.backends, Path(tmp)) as chosen:
        workdir = Path(tmp)
        if "store" in args.parts:
            print("store writes, 1 KiB messages, msgs/s by messages per commit")
            print(f"| backend | {' | '.join(map(str, BATCH_SIZES))} |")
            for b in (b for b in chosen if b.durable):
                rates = [store_rate(fresh(b, f"s{n}", workdir), n, args.duration / 2)
                         for n in BATCH_SIZES]
                print(f"| {b.name} | {' | '.join(f'{r:,.0f}' for r in rates)} |", flush=True)
        if "node" in args.parts:
            print("through a node (loadgen confirm / tx of 10; pika latency of one confirm)")
            print("| backend | confirm msgs/s | tx commits/s | tx msgs/s | confirm p50 ms | p99 ms |")
            for b in chosen:
                f = node_figures(fresh(b, "node", workdir), args.duration, args.warmup)
                print(f"| {b.name} | {f['confirm_msgs_s']:,.0f} | {f['tx_commits_s']:,.0f} | "
                      f"{f['tx_msgs_s']:,.0f} | {f['latency_p50_ms']:.2f} | "
                      f"{f['latency_p99_ms']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
