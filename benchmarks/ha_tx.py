"""HA transactions benchmark: TX commits/s and tx.commit latency with 0, 1 and 2 backups.

Each publisher is the load generator's ``tx`` workload (``loadgen.py``):
tx.select, then over and over 10 persistent 1 KiB publishes to a durable queue
and tx.commit written at once, waiting for commit-ok; a manual-ack consumer
(prefetch 256) on its own connection keeps the queue short. Here each commit
is also timed: latency = from writing the 10 publishes + tx.commit to reading
commit-ok (what an application waits for per transaction). With several
publishers each has its own connections and queue; commits/s are summed and
the latencies pooled.

Configurations, one at a time (start, measure 1 and N publishers, stop), in
this order (reversed on odd rounds):

- ``RabbitMQ classic``: a private single RabbitMQ node, classic durable queue;
- ``brokerha 0 backups``: a standalone brokerha node (no cluster);
- ``brokerha 1 backup``: a 3-node ``LocalCluster`` with one backup stopped
  after all were ready (a 2-node cluster would need both nodes for a
  majority; here the primary and one backup are the majority, and every
  commit waits for that backup's vote and acknowledgement);
- ``brokerha 2 backups``: the primary of a 3-node ``LocalCluster``;
- ``RabbitMQ quorum``: a 3-node RabbitMQ cluster on loopback, the queue
  declared ``x-queue-type: quorum`` (leader on the node the client uses): the
  reference for the replicated configurations (issue 22).

The clusters run with docs/ha.md's default timeouts. Each run also measures
the CPU seconds of every process of the configuration (all its nodes) over
the measured window: CPU per committed message, the figure replication has to
bring down.

Here all nodes share the machine's cores and disk (docs/benchmarks.md, "Three
nodes on one machine"). ``--broker LABEL=URL`` measures brokers that already
run instead, e.g. a cluster with each node on its own machine (the URL of its
primary) next to a RabbitMQ node on a machine like one of them; a label
``RabbitMQ classic`` is the reference of the ratios. Nothing is started or
stopped then, and each run uses its own queues (the load generator's names).

    .venv/bin/python benchmarks/ha_tx.py --duration 5 --publishers 1,8
    .venv/bin/python benchmarks/ha_tx.py --no-rabbitmq --rounds 3
    .venv/bin/python benchmarks/ha_tx.py --rounds 3 \
        --broker "RabbitMQ classic=amqp://bench:secret@mq1:5672/%2F" \
        --broker "brokerha 2 backups=amqp://bench:secret@ha1:5672/%2F"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import loadgen
from amqp_throughput import tree_cpu_times
from ha_cluster import HA_DEFAULTS, RabbitCluster, Terminated, _raise_on_sigterm, wait_all_ready
from loadgen import (
    CHANNEL,
    WORKLOADS,
    BrokerAddress,
    LoadRun,
    Settings,
    Workload,
    _sleep_or_fail,
    commands,
    encode_method,
    encode_publish,
)
from rabbitmq_ref import RabbitMQRef, available

from brokerha.testing import LocalCluster, NodeProcess

TX = WORKLOADS["tx"]  # 10 persistent 1 KiB publishes + tx.commit, durable queue
TX_QUORUM = replace(TX, queue_arguments=(("x-queue-type", "quorum"),))
CONFIGS = ["RabbitMQ classic", "brokerha 0 backups", "brokerha 1 backup", "brokerha 2 backups",
           "RabbitMQ quorum"]
CPU = Callable[[], float]  # CPU seconds of every process of a configuration so far


class TimedTxRun(LoadRun):
    """The ``tx`` workload with each commit's latency recorded as (start, seconds)."""

    def __init__(self, url: str, workload: Workload = TX) -> None:
        super().__init__(BrokerAddress.parse(url), workload, Settings())
        self.latencies: list[tuple[float, float]] = []

    async def publish_loop(self) -> None:
        pub, w, s = self.pub, self.workload, self.settings
        assert pub is not None
        one = encode_publish(CHANNEL, self.queue, b"x" * s.body_size, persistent=True,
                             frame_max=pub.frame_max)
        batch = memoryview(one * w.tx_size + encode_method(CHANNEL, commands.Tx.Commit()))
        while not self.stopping:
            if self._allowance() < w.tx_size:
                self._progress.clear()
                await self._progress.wait()
                continue
            started = time.perf_counter()
            pub.write(batch)
            self.published += w.tx_size
            await pub.expect(CHANNEL, commands.Tx.CommitOk)
            self.latencies.append((started, time.perf_counter() - started))
            self.commits += 1
            await pub.drain()


@dataclass
class TxResult:
    commits_per_s: float
    latencies_ms: list[float] = field(default_factory=list)
    cpu_us_per_msg: float | None = None  # all the configuration's processes, per message

    def pct(self, q: float) -> float | None:
        if not self.latencies_ms:
            return None
        values = sorted(self.latencies_ms)
        return values[min(len(values) - 1, int(q * len(values)))]


async def timed_tx(url: str, workload: Workload, duration: float,
                   warmup: float) -> tuple[int, float, list[float]]:
    """One publisher: (commits in the window, window seconds, latencies in ms in the window)."""
    run = TimedTxRun(url, workload)
    publisher: asyncio.Task[None] | None = None
    try:
        await run.setup()
        publisher = asyncio.create_task(run.publish_loop())
        await _sleep_or_fail(run, publisher, warmup)
        first, t0 = run.commits, time.perf_counter()
        await _sleep_or_fail(run, publisher, duration)
        last, t1 = run.commits, time.perf_counter()
    finally:
        run.stopping = True
        if publisher is not None:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
        await run.teardown()
    window = [1e3 * lat for start, lat in run.latencies if t0 <= start and start + lat <= t1]
    return last - first, t1 - t0, window


async def parallel(url: str, workload: Workload, publishers: int, duration: float,
                   warmup: float, cpu: CPU | None = None) -> TxResult:
    async def cpu_window() -> tuple[float, float] | None:
        """(CPU seconds, wall seconds) over the publishers' measured window."""
        if cpu is None:
            return None
        await asyncio.sleep(warmup)
        c0, t0 = cpu(), time.perf_counter()
        await asyncio.sleep(duration)
        return cpu() - c0, time.perf_counter() - t0

    window, *runs = await asyncio.gather(
        cpu_window(), *(timed_tx(url, workload, duration, warmup) for _ in range(publishers)))
    rate = sum(c / d for c, d, _ in runs)
    per_msg = None
    if window is not None and rate:
        per_msg = 1e6 * window[0] / (rate * TX.tx_size * window[1])
    return TxResult(rate, [x for _, _, lat in runs for x in lat], per_msg)


def processes_cpu(pids: Sequence[int]) -> CPU:
    return lambda: sum(sum(tree_cpu_times(pid)) for pid in pids)


@contextmanager
def started(config: str, external: dict[str, str]) -> Iterator[tuple[str, Workload, CPU | None]]:
    """Start one configuration (or take a running one of ``external``); yield the serving
    URL, the workload (its queue's arguments) and the CPU seconds of all its processes."""
    t0 = time.monotonic()
    if config in external:
        yield external[config], TX_QUORUM if config == "RabbitMQ quorum" else TX, None
    elif config == "RabbitMQ classic":
        ref = RabbitMQRef()
        with ref as url:
            assert ref.server is not None
            print(f"  ({config}: started in {time.monotonic() - t0:.0f} s)", flush=True)
            yield url, TX, processes_cpu([ref.server.pid])
    elif config == "RabbitMQ quorum":
        rabbits = RabbitCluster()
        with rabbits as urls:
            print(f"  ({config}: 3-node cluster formed in {time.monotonic() - t0:.0f} s)",
                  flush=True)
            yield urls[0], TX_QUORUM, rabbits.cpu
    elif config == "brokerha 0 backups":
        with NodeProcess("ha-tx-solo") as node:
            assert node.proc is not None
            yield node.url, TX, processes_cpu([node.proc.pid])
    elif config in ("brokerha 1 backup", "brokerha 2 backups"):
        with LocalCluster(3, options=HA_DEFAULTS) as cluster:
            primary = wait_all_ready(cluster)
            if config == "brokerha 1 backup":
                stopped = next(n for n in cluster.names if n != primary)
                cluster.nodes[stopped].stop()
                wait_backups(cluster, primary, 1)
            print(f"  ({config}: primary {primary}, ready in {time.monotonic() - t0:.0f} s)",
                  flush=True)
            pids = [n.proc.pid for n in cluster.nodes.values() if n.proc is not None]
            yield cluster.url(primary), TX, processes_cpu(pids)
    else:
        raise ValueError(config)


def wait_backups(cluster: LocalCluster, primary: str, count: int, timeout: float = 30.0) -> None:
    """Until the primary counts exactly ``count`` ready backups (a stopped one has left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = cluster.status(primary)
        node = (st or {}).get("node") or {}
        ready = node.get("replication", {}).get("ready_backups")  # type: ignore[union-attr]
        if ready is not None and len(ready) == count:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{primary} does not have {count} ready backup(s): {cluster.status(primary)}")


def run_all(configs: Sequence[str], counts: Sequence[int], duration: float, warmup: float,
            rounds: int, external: dict[str, str] | None = None,
            ) -> dict[tuple[str, int], list[TxResult]]:
    table: dict[tuple[str, int], list[TxResult]] = {(c, n): [] for c in configs for n in counts}
    for r in range(rounds):
        for config in (configs if r % 2 == 0 else list(reversed(configs))):
            with started(config, external or {}) as (url, workload, cpu):
                for n in counts:
                    res = asyncio.run(parallel(url, workload, n, duration, warmup, cpu))
                    table[(config, n)].append(res)
                    cpu_text = ("" if res.cpu_us_per_msg is None
                                else f", {res.cpu_us_per_msg:.1f} µs CPU/msg")
                    print(f"  {config:20} {n:>2} publisher(s): {res.commits_per_s:8,.0f} commits/s, "
                          f"p50 {res.pct(0.5) or 0:.2f} ms, p99 {res.pct(0.99) or 0:.2f} ms"
                          f"{cpu_text}", flush=True)
    return table


def merged(results: list[TxResult]) -> TxResult:
    """Median commits/s and CPU per message over the rounds, latencies pooled."""
    cpus = [r.cpu_us_per_msg for r in results if r.cpu_us_per_msg is not None]
    return TxResult(statistics.median(r.commits_per_s for r in results),
                    [x for r in results for x in r.latencies_ms],
                    statistics.median(cpus) if cpus else None)


def format_table(table: dict[tuple[str, int], list[TxResult]], counts: Sequence[int]) -> str:
    lines = []
    for n in counts:
        rate = {c: merged(rs).commits_per_s for (c, k), rs in table.items() if k == n and rs}
        classic, quorum = rate.get("RabbitMQ classic"), rate.get("RabbitMQ quorum")
        lines.append(f"\n{n} publisher(s):\n")
        lines.append("| configuration | commits/s | msgs/s | tx.commit p50 ms | p99 ms | "
                     "CPU µs/msg (all nodes) | vs RabbitMQ classic TX | vs RabbitMQ quorum TX |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for (config, count), results in table.items():
            if count != n or not results:
                continue
            m = merged(results)
            cpu = "-" if m.cpu_us_per_msg is None else f"{m.cpu_us_per_msg:.1f}"
            lines.append(f"| {config} | {m.commits_per_s:,.0f} | {10 * m.commits_per_s:,.0f} | "
                         f"{m.pct(0.5) or 0:.2f} | {m.pct(0.99) or 0:.2f} | {cpu} | "
                         f"{_ratio(m.commits_per_s, classic)} | "
                         f"{_ratio(m.commits_per_s, quorum)} |")
    return "\n".join(lines)


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}×" if b else "-"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--publishers", default="1,8", help="comma-separated publisher counts")
    p.add_argument("--rounds", type=int, default=1, help="each configuration started afresh")
    p.add_argument("--no-rabbitmq", action="store_true")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--broker", action="append", default=[], metavar="LABEL=URL",
                   help="measure this running broker instead of starting local ones (repeat; "
                        "LABEL 'RabbitMQ classic' is the ratios' reference)")
    args = p.parse_args(argv)
    external: dict[str, str] = {}
    for item in args.broker:
        label, sep, url = item.partition("=")
        if not sep or not label.strip() or not url.startswith("amqp://"):
            p.error(f"--broker {item!r}: expected LABEL=amqp://user:password@host:port/vhost")
        external[label.strip()] = url
    if not 0 < args.duration <= 120 or not 1 <= args.rounds <= 10:
        p.error("keep runs bounded: 0 < --duration <= 120, 1 <= --rounds <= 10")
    counts = [int(n) for n in args.publishers.split(",")]
    loadgen.selftest()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    if external:
        configs = list(external)
    else:
        rabbit = not args.no_rabbitmq and available()
        configs = [c for c in CONFIGS if rabbit or not c.startswith("RabbitMQ")]
    started_at, loads, t0 = datetime.now(UTC), [os.getloadavg()[0]], time.monotonic()
    try:
        table = run_all(configs, counts, args.duration, args.warmup, args.rounds, external)
    except Terminated:
        return 143
    loads.append(os.getloadavg()[0])
    print(f"\nTX benchmark, {started_at:%Y-%m-%d %H:%M} UTC, {time.monotonic() - t0:.0f} s; "
          f"{os.cpu_count()} CPUs, load average {min(loads):.2f}-{max(loads):.2f}; "
          f"10 persistent 1 KiB messages per transaction, durable queue, "
          f"median of {args.rounds} round(s) of {args.duration:g} s")
    print(format_table(table, counts))
    if args.json:
        args.json.write_text(json.dumps({
            "started": started_at.isoformat(), "load_average": loads,
            "results": [{"config": c, "publishers": n,
                         "commits_per_s": [r.commits_per_s for r in rs],
                         "cpu_us_per_msg": [r.cpu_us_per_msg for r in rs],
                         "p50_ms": merged(rs).pct(0.5), "p99_ms": merged(rs).pct(0.99)}
                        for (c, n), rs in table.items() if rs]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
