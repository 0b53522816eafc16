"""Event-loop stalls of heavy single operations on one standalone node (issue 33).

Starts a ``brokerha node`` (SQLite store with its operation log, paging past
``--queue-max-memory``), and runs each operation on its own queue:

- ``purge N`` / ``delete N``: fill a durable queue with N persistent 1 KiB
  messages (confirmed, with the load generator), then queue.purge or
  queue.delete it;
- ``tx N``: tx.select, N persistent 512 B publishes, tx.commit;
- ``message S``: one persistent message of S bytes (confirmed);
- ``restart N``: fill N, stop the node (SIGTERM), start it again on the same
  data directory: how long until it serves, and its loop lag once it does.

For each it prints the node's event-loop lag during the operation (the
delta of ``brokerha_event_loop_lag_seconds`` between two scrapes of
``/metrics``: p99 and max as bucket bounds, and the exact figure of every
"event loop stalled" WARNING over 100 ms), the operation's time as its client
saw it, and the count the reply reported. The node runs its hot modules as
they are installed (compiled or not); set ``BROKERHA_PURE_PYTHON=1`` to
compare against a run from source.

Usage::

    .venv/bin/python benchmarks/deep_queue_ops.py                     # the issue's sizes
    .venv/bin/python benchmarks/deep_queue_ops.py --ops purge:200000 tx:20000
    .venv/bin/python benchmarks/deep_queue_ops.py --quick             # 200k purge/delete, 20k TX
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loadgen
import loadgen  # noqa: E402
from pamqp import commands  # noqa: E402

from brokerha.cluster.ports import ADMIN_OFFSET  # noqa: E402
from brokerha.testing import NodeProcess, free_base_port  # noqa: E402

CHANNEL = loadgen.CHANNEL
MiB = 1024 * 1024
STALL = re.compile(r"event loop stalled ([\d.]+)s \(running: (.*)\)$")
GC_PAUSE = re.compile(r"cyclic GC \(generation (\d)\) paused the node ([\d.]+)s")
FULL = ["message:52428800", "tx:20000", "tx:100000", "purge:200000", "delete:200000",
        "purge:1000000", "delete:1000000", "restart:1000000"]
QUICK = ["message:52428800", "tx:20000", "purge:200000", "delete:200000", "restart:200000"]


# -- the node's loop lag ---------------------------------------------------------------


@dataclass
class Lag:
    buckets: list[tuple[float, float]]  # (le, cumulative count)
    max_gauge: float


def scrape(admin: str) -> Lag:
    with urllib.request.urlopen(admin + "/metrics", timeout=10) as response:
        return parse_lag(response.read().decode())


def parse_lag(text: str) -> Lag:
    """The loop-lag histogram and max gauge of a node's ``/metrics`` text."""
    buckets: list[tuple[float, float]] = []
    max_gauge = 0.0
    for line in text.splitlines():
        if line.startswith("brokerha_event_loop_lag_seconds_bucket{le="):
            le = line.split('"')[1]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
        elif line.startswith("brokerha_event_loop_lag_max_seconds "):
            max_gauge = float(line.split()[-1])
    return Lag(buckets, max_gauge)


def lag_between(before: Lag, after: Lag) -> tuple[str, str]:
    """(p99, max) between two scrapes: bucket bounds ("<=0.025"), or the max gauge if it grew."""
    old = dict(before.buckets)
    delta = [(le, n - old.get(le, 0.0)) for le, n in after.buckets]
    total = delta[-1][1] if delta else 0
    if total <= 0:
        return "-", "-"
    p99 = next(le for le, n in delta if n >= 0.99 * total)
    top = next(le for le, n in delta if n >= total)
    if after.max_gauge > before.max_gauge:
        return _bound(min(p99, after.max_gauge)), f"{after.max_gauge:.3f}"
    return _bound(p99), _bound(top)


def _bound(le: float) -> str:
    return ">10" if le == float("inf") else f"<={le:.3g}"


# -- clients (the load generator) --------------------------------------------------------


async def _connect(url: str) -> loadgen.LoadConnection:
    return await loadgen.connect(loadgen.BrokerAddress.parse(url))


async def _declare(conn: loadgen.LoadConnection, queue: str) -> None:
    await conn.rpc(CHANNEL, commands.Queue.Declare(queue=queue, durable=True),
                   commands.Queue.DeclareOk)


async def _fill_one(url: str, queue: str, count: int, size: int, window: int) -> None:
    conn = await _connect(url)
    try:
        await _declare(conn, queue)
        await conn.rpc(CHANNEL, commands.Confirm.Select(), commands.Confirm.SelectOk)
        one = loadgen.encode_publish(CHANNEL, queue, b"x" * size, persistent=True,
                                     frame_max=conn.frame_max)
        confirms = loadgen.ConfirmWait(conn)
        sent, batch = 0, 250
        while sent < count:
            n = min(batch, count - sent)
            await confirms.until(sent + n - window)
            conn.write(one * n)
            sent += n
            await conn.drain()
        await confirms.until(count)
    finally:
        await conn.close()


def fill(url: str, queue: str, count: int, size: int = 1024, connections: int = 2,
         window: int = 2000) -> float:
    """Publish ``count`` confirmed persistent messages; the seconds it took."""
    share = [count // connections + (i < count % connections) for i in range(connections)]

    async def run() -> None:
        await asyncio.gather(*(_fill_one(url, queue, n, size, window) for n in share if n))

    started = time.perf_counter()
    asyncio.run(run())
    return time.perf_counter() - started


def queue_op(url: str, method: commands.Frame, reply: type) -> tuple[float, int]:
    """(seconds, message_count of the reply) of one queue method on a fresh connection."""
    async def run() -> tuple[float, int]:
        conn = await _connect(url)
        try:
            started = time.perf_counter()
            ok = await asyncio.wait_for(conn.rpc(CHANNEL, method, reply), 600)
            return time.perf_counter() - started, int(getattr(ok, "message_count", 0))
        finally:
            await conn.close()

    return asyncio.run(run())


def tx(url: str, queue: str, count: int, size: int = 512) -> tuple[float, float]:
    """One transaction of ``count`` publishes: (publishing seconds, commit seconds)."""
    async def run() -> tuple[float, float]:
        conn = await _connect(url)
        try:
            await _declare(conn, queue)
            await conn.rpc(CHANNEL, commands.Tx.Select(), commands.Tx.SelectOk)
            one = loadgen.encode_publish(CHANNEL, queue, b"x" * size, persistent=True,
                                         frame_max=conn.frame_max)
            started = time.perf_counter()
            for first in range(0, count, 500):
                conn.write(one * min(500, count - first))
                await conn.drain()
            # a queue.declare (passive) round trip: every publish was read
            await conn.rpc(CHANNEL, commands.Queue.Declare(queue=queue, passive=True),
                           commands.Queue.DeclareOk)
            published = time.perf_counter() - started
            started = time.perf_counter()
            await asyncio.wait_for(conn.rpc(CHANNEL, commands.Tx.Commit(), commands.Tx.CommitOk),
                                   600)
            return published, time.perf_counter() - started
        finally:
            await conn.close()

    return asyncio.run(run())


# -- the suite -----------------------------------------------------------------------------


@dataclass
class Row:
    op: str
    p99: str = "-"
    max: str = "-"
    stalls: list[str] = field(default_factory=list)
    seconds: float = 0.0
    notes: str = ""


class Bench:
    def __init__(self, data: Path, queue_max_memory: str, extra: list[str]) -> None:
        # a port whose admin port (+ ADMIN_OFFSET) is a free port too
        self.node = NodeProcess("deep", port=free_base_port(1), data_dir=data, ready_timeout=600,
                                extra_args=["--queue-max-memory", queue_max_memory, *extra])
        self.seen = 0  # log lines already read

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.node.port + ADMIN_OFFSET}"

    def stalls(self) -> list[str]:
        lines = list(self.node.log)
        new, self.seen = lines[self.seen:], len(lines)
        found = []
        for line in new:
            m = STALL.search(line)
            if m:
                found.append(f"{float(m.group(1)):.3f} s in {m.group(2)}")
            m = GC_PAUSE.search(line)
            if m:
                found.append(f"(GC generation {m.group(1)}: {float(m.group(2)):.3f} s)")
        return found

    def measured(self, row: Row, work: object) -> Row:
        self.stalls()
        before = scrape(self.admin)
        started = time.perf_counter()
        work()  # type: ignore[operator]
        row.seconds = time.perf_counter() - started
        time.sleep(1.0)  # what the operation left to do on the loop, and the last sample
        row.p99, row.max = lag_between(before, scrape(self.admin))
        row.stalls = self.stalls()
        return row


def run_op(bench: Bench, kind: str, n: int, index: int) -> Row:
    url = bench.node.url
    queue = f"deep-{index}"
    row = Row(f"{kind} {n:,}")
    if kind in ("purge", "delete"):
        seconds = fill(url, queue, n)
        bench.stalls()
        row.notes = f"fill {seconds:.1f} s ({n / seconds:,.0f}/s); "
        if kind == "purge":
            method, reply = commands.Queue.Purge(queue=queue), commands.Queue.PurgeOk
        else:
            method, reply = commands.Queue.Delete(queue=queue), commands.Queue.DeleteOk
        got: dict[str, tuple[float, int]] = {}
        bench.measured(row, lambda: got.setdefault("r", queue_op(url, method, reply)))
        took, count = got["r"]
        row.notes += f"{kind}-ok after {took:.3f} s, count {count:,}"
    elif kind == "tx":
        got2: dict[str, tuple[float, float]] = {}
        bench.measured(row, lambda: got2.setdefault("r", tx(url, queue, n)))
        published, commit = got2["r"]
        row.notes = (f"publishing {published:.2f} s ({published / n * 1e6:.1f} µs/msg), "
                     f"commit {commit:.3f} s ({commit / n * 1e6:.1f} µs/msg)")
    elif kind == "message":
        bench.measured(row, lambda: fill(url, queue, 1, size=n, connections=1))
        row.op = f"message {n / MiB:g} MiB"
    elif kind == "restart":
        seconds = fill(url, queue, n)
        row.notes = f"fill {seconds:.1f} s; "
        bench.stalls()
        bench.node.stop(120)
        old = bench.node
        bench.node = NodeProcess(old.name, port=old.port, data_dir=old.data_dir,
                                 ready_timeout=old.ready_timeout, extra_args=old.extra_args)
        bench.seen = 0
        started = time.perf_counter()
        bench.node.start()
        ready = time.perf_counter() - started
        row.notes += f"serving {ready:.1f} s after the start"
        time.sleep(3.0)  # the node's loop from its start (the monitor starts once recovered)
        row.seconds = ready
        row.p99, row.max = lag_between(Lag([], 0.0), scrape(bench.admin))
        row.stalls = bench.stalls()
    else:
        raise ValueError(f"unknown operation {kind!r}")
    return row


def table(rows: Sequence[Row]) -> str:
    out = ["| operation | loop lag p99 | max | stalls > 100 ms (exact, where) | client time (s) | notes |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        stalls = "; ".join(r.stalls[:4]) + (f" (+{len(r.stalls) - 4})" if len(r.stalls) > 4 else "")
        out.append(f"| {r.op} | {r.p99} | {r.max} | {stalls or 'none'} | {r.seconds:.2f} | {r.notes} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="*", help="operations as kind:N (purge, delete, tx, "
                        "message (bytes), restart)")
    parser.add_argument("--quick", action="store_true", help=f"{' '.join(QUICK)}")
    parser.add_argument("--queue-max-memory", default="64MiB",
                        help="the node's --queue-max-memory (bodies past it are paged out)")
    parser.add_argument("--node-arg", action="append", default=[],
                        help="another argument for brokerha node (repeatable)")
    args = parser.parse_args(argv)
    ops = args.ops or (QUICK if args.quick else FULL)
    with tempfile.TemporaryDirectory(prefix="deep-queue-ops-") as tmp:
        rows = []
        for index, spec in enumerate(ops):
            kind, _, n = spec.partition(":")
            bench = Bench(Path(tmp) / f"op{index}", args.queue_max_memory, args.node_arg)
            bench.node.start()
            try:
                row = run_op(bench, kind, int(n), index)
            finally:
                bench.node.stop(120)
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
