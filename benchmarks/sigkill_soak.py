"""SIGKILL soak of a 3-node cluster with a deep queue: every committed transaction on the final primary.

Issue 32's "Shows it works": a pika publisher commits transactions (or
confirmed messages) into one durable queue that nothing consumes, so it grows
past ``--min-queue`` messages, while the primary is SIGKILLed ``--kills``
times, about every ``--interval`` seconds, and restarted each time with the
command docs/ha.md gives (``LocalCluster.restart``: ``brokerha node --config
DIR/cluster.toml --name nI --data DIR/nI``). The cluster runs the shipped
election timing (``LocalCluster`` without options, as ``brokerha cluster up``:
heartbeat 0.1 s, lease 0.4 s, election 0.6 s, backup_timeout 5 s). Then the
cluster is given time to settle, every node is stopped cleanly (backups first)
and every node's SQLite store is read as the TX failover test reads it
(``open_store`` on the data directory).

The publisher (one thread, all three URLs, ``tests/failover/clients.py``'s
``connect_any``, reconnecting on any error):

- ``--mode tx``: ``tx.select``, then transactions of ``--batch`` persistent
  messages and ``tx.commit``; the body of message i of transaction k is
  ``k:i:batch``. A transaction is recorded as committed only once its
  ``tx.commit-ok`` arrived; one whose connection failed while its
  ``tx.commit`` was in flight is recorded as *unanswered* (it may or may not
  have committed); one that failed before its ``tx.commit`` was sent as
  *aborted* (it must be on no node).
- ``--mode confirm``: ``confirm.select``, one persistent message at a time
  (pika's ``BlockingChannel`` waits for each ``basic.ack``), body ``k:0:1``;
  a message is recorded on its ``basic.ack``, one whose ack did not come is
  *unanswered*, a ``basic.nack`` is *nacked*. Each message is one unit of the
  checks (so "partial" cannot occur); ``--batch`` is unused.

Kills: kill i (of K) waits until at least ``--interval`` (jittered +-20 % by
``--seed``) passed since the previous kill and the publisher has committed
``head_start + (min_queue - head_start) * i / K`` messages, so the queue
passes ``--min-queue`` before the last kill (``--head-start``, default 80 %
of it, is what it holds before the first). Each kill: the serving primary
(``LocalCluster.primary``) is SIGKILLed, the time to the next serving primary
is measured (status polled every 50 ms), the killed node is restarted. The
whole kill phase is bounded by ``--max-time``; the settling after it by
``--settle-timeout`` (settled: one serving primary and every other node a
ready backup, unchanged for 2 s). A cluster that never settles is reported
(liveness, issue 33) and the stores are read all the same.

The table: per node, how many committed units it holds whole, how many
partially (must be 0), how many it lacks, duplicates, and units it holds
that were never committed (aborted ones must be absent; unanswered ones may
be either way). The main figure: committed units missing from the **final
primary** (the node serving last when the cluster settled; otherwise the one
whose stored HA position is highest), and committed units on no node.
Exit status 1 when any committed unit is missing from the final primary, any
unit is partial on any node, duplicated, or held though it was never
committed; 2 when the soak fell short (fewer kills than asked or the queue
below ``--min-queue``) without such a violation; 0 otherwise.

Node logs (every line, timestamped, with a marker line at each kill) are in
``DATA/nI/node.log``, the soak's own events in ``DATA/soak.log``; ``DATA`` is
kept on a violation or with ``--keep`` (``--data DIR`` to choose it).

Examples (from the repository root)::

    # issue 32's soak: 15 kills, the queue past 250,000 messages (~5 min here)
    .venv/bin/python benchmarks/sigkill_soak.py --mode tx --kills 15 --min-queue 250000
    # confirm mode publishes ~1,000 messages/s (one in flight): the whole queue first (~8-13 min)
    .venv/bin/python benchmarks/sigkill_soak.py --mode confirm --kills 15 --min-queue 250000 \
        --head-start 250000
    # quick look
    .venv/bin/python benchmarks/sigkill_soak.py --kills 3 --min-queue 20000 --keep

``tests/failover/test_sigkill_soak.py`` runs the same code, bounded, under ``-m slow``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pika
import pika.exceptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.*

from brokerha.ha.core import POSITION_KEY, stored_position  # noqa: E402
from brokerha.store.factory import open_store  # noqa: E402
from brokerha.testing import LocalCluster, NodeProcess  # noqa: E402
from tests.failover.clients import RETRYABLE, connect_any  # noqa: E402

QUEUE = "soak"
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def wall() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


# -- the cluster: LocalCluster, with every node's log kept on disk ------------------------------


class FileLog(deque[str]):
    """NodeProcess's log buffer that also appends every line to a file."""

    def __init__(self, path: Path) -> None:
        super().__init__(maxlen=2000)
        self.path = path

    def append(self, line: str) -> None:
        super().append(line)
        with self.path.open("a") as f:
            f.write(line + "\n")


class LoggedNode(NodeProcess):
    def __init__(self, name: str, *, log_path: Path, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.log = FileLog(log_path)


class SoakCluster(LocalCluster):
    """``LocalCluster`` whose nodes keep their whole log in ``DIR/nI/node.log``.

    ``ready_timeout``: a node restarted on a deep store takes longer than the
    default 20 s to log ``ready``.
    """

    def __init__(self, data_dir: Path, ready_timeout: float) -> None:
        super().__init__(3, data_dir=data_dir)
        self.ready_timeout = ready_timeout
        self.events = data_dir / "soak.log"

    def make_node(self, name: str) -> NodeProcess:
        (self.data_dir / name).mkdir(parents=True, exist_ok=True)
        return LoggedNode(name, log_path=self.data_dir / name / "node.log", port=self.port(name),
                          data_dir=self.data_dir / name, ready_timeout=self.ready_timeout,
                          extra_args=["--config", str(self.config), *self.extra_args])

    def note(self, text: str, node: str | None = None) -> None:
        """A line in the soak's event log (and in ``node``'s log, to read beside its lines)."""
        line = f"{wall()} SOAK {text}"
        with self.events.open("a") as f:
            f.write(line + "\n")
        if node is not None:
            with (self.data_dir / node / "node.log").open("a") as f:
                f.write(line + "\n")

    def epoch(self, name: str) -> int | None:
        st = self.status(name)
        return None if st is None else int(st["node"].get("epoch") or 0)


# -- the publisher ---------------------------------------------------------------------------------


class SoakPublisher(threading.Thread):
    """One pika publisher over all URLs; unit ids recorded only once answered."""

    def __init__(self, urls: list[str], mode: str, batch: int) -> None:
        super().__init__(daemon=True, name="soak-publisher")
        self.urls, self.mode = urls, mode
        self.size = batch if mode == "tx" else 1  # messages per unit
        self.committed: list[int] = []        # commit-ok / basic.ack received
        self.answered_at: list[float] = []    # monotonic time of each, same order
        self.unanswered: list[int] = []       # the connection failed while it was in flight
        self.aborted: list[int] = []          # failed before tx.commit was sent
        self.nacked: list[int] = []
        self.reconnects = 0
        self.connect_timeouts = 0
        self.odd_errors: list[str] = []       # errors other than pika's connection/channel ones
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self._next = 0

    @property
    def messages(self) -> int:
        return len(self.committed) * self.size

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                try:
                    conn = connect_any(self.urls, time.monotonic() + 10)
                except TimeoutError:  # no node served for 10 s (an election that drags)
                    self.connect_timeouts += 1
                    continue
                self._session(conn)
        except BaseException as exc:  # reported by the soak
            self.error = exc

    def _session(self, conn: pika.BlockingConnection) -> None:
        unit: int | None = None   # in progress, not sent for commit yet
        flight: int | None = None  # tx.commit / the publish awaiting its ack
        try:
            ch = conn.channel()
            ch.queue_declare(QUEUE, durable=True)
            if self.mode == "tx":
                ch.tx_select()
            else:
                ch.confirm_delivery()
            while not self.stop_event.is_set():
                k, self._next = self._next, self._next + 1
                if self.mode == "tx":
                    unit = k
                    for i in range(self.size):
                        ch.basic_publish("", QUEUE, f"{k}:{i}:{self.size}".encode(), PERSISTENT)
                    unit, flight = None, k
                    ch.tx_commit()
                else:
                    flight = k
                    try:
                        ch.basic_publish("", QUEUE, f"{k}:0:1".encode(), PERSISTENT)
                    except pika.exceptions.NackError:
                        self.nacked.append(k)
                        flight = None
                        continue
                flight = None
                self.committed.append(k)
                self.answered_at.append(time.monotonic())
            conn.close()
        except Exception as exc:  # noqa: BLE001 - any error: reconnect, as an application does
            self.reconnects += 1
            if not isinstance(exc, RETRYABLE):
                self.odd_errors.append(repr(exc))
            if unit is not None:
                self.aborted.append(unit)
            if flight is not None:
                self.unanswered.append(flight)
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - the connection is gone anyway
                pass

    def first_answer_after(self, t: float) -> float | None:
        """Seconds from ``t`` to the first answer after it, if any."""
        i = bisect.bisect_right(self.answered_at, t)
        return self.answered_at[i] - t if i < len(self.answered_at) else None


# -- the soak --------------------------------------------------------------------------------------


@dataclass
class SoakConfig:
    mode: str = "tx"
    kills: int = 15
    interval: float = 3.0
    batch: int = 10
    seed: int = 1
    min_queue: int = 250_000
    head_start: int | None = None   # messages before the first kill; None: 80 % of min_queue
    max_time: float = 1800.0        # the publish-and-kill phase
    failover_timeout: float = 60.0  # waiting for the next primary after one kill
    settle_timeout: float = 300.0
    ready_timeout: float = 120.0    # a restarted node's "ready" line
    data: Path | None = None
    keep: bool = False


@dataclass
class Kill:
    n: int
    node: str
    epoch_before: int | None
    others_ready: str                # the other nodes at the kill: "n2 ready, n3 joining"
    queue_messages: int              # committed messages at the kill
    next_primary: str | None = None
    epoch_after: int | None = None   # the next primary's epoch when it was first seen serving
    to_primary_s: float | None = None  # kill -> another node serving (status, every 50 ms)
    to_commit_s: float | None = None   # kill -> the publisher's next commit-ok / ack
    restart_s: float | None = None     # restart -> "ready" log line of the restarted node
    at: float = 0.0                    # monotonic time of the kill


@dataclass
class NodeCount:
    node: str
    position: tuple[int, int] | None
    messages: int
    whole: int = 0        # committed units held whole
    partial: int = 0      # units of any kind held partially
    missing: int = 0      # committed units it lacks entirely
    duplicates: int = 0   # messages held more than once
    unanswered_held: int = 0
    never_committed: int = 0  # aborted, nacked or never published units held
    exit_code: int | None = None


@dataclass
class SoakResult:
    config: SoakConfig
    started: str
    duration_s: float
    committed: int
    unanswered: int
    aborted: int
    nacked: int
    reconnects: int
    connect_timeouts: int = 0
    odd_errors: list[str] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    epochs_seen: list[int] = field(default_factory=list)  # max epoch seen after each kill
    settled_s: float | None = None
    settle_epochs: tuple[int | None, int | None] = (None, None)
    final_primary: str | None = None
    final_primary_by: str = ""
    nodes: list[NodeCount] = field(default_factory=list)
    missing_on_final: int = 0
    on_no_node: int = 0
    load: tuple[float, float] = (0.0, 0.0)
    data_dir: str = ""
    # ``ctl check-replicas`` once settled (ha/check.py): copies that differ from the final
    # primary's (a violation), and whether every copy was compared
    replicas_differ: int = 0
    replicas_checked: str = "not run"

    @property
    def partial(self) -> int:
        return sum(n.partial for n in self.nodes)

    @property
    def violations(self) -> int:
        return (self.missing_on_final + self.partial + self.replicas_differ
                + sum(n.duplicates + n.never_committed for n in self.nodes))

    @property
    def short(self) -> bool:
        return (len(self.kills) < self.config.kills
                or self.committed * self.unit_size < self.config.min_queue)

    @property
    def unit_size(self) -> int:
        return self.config.batch if self.config.mode == "tx" else 1


def _others(cluster: SoakCluster, primary: str) -> str:
    parts = []
    for name in cluster.names:
        if name == primary:
            continue
        st = cluster.status(name) if cluster.is_running(name) else None
        if st is None:
            parts.append(f"{name} down")
        else:
            node = st["node"]
            parts.append(f"{name} {'ready' if node.get('ready') else node.get('role')}")
    return ", ".join(parts)


class EpochWatch(threading.Thread):
    """The highest epoch any node reports, polled every 0.25 s."""

    def __init__(self, cluster: SoakCluster) -> None:
        super().__init__(daemon=True, name="soak-epochs")
        self.cluster = cluster
        self.highest = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(0.25):
            for name in self.cluster.names:
                if self.cluster.is_running(name):
                    self.highest = max(self.highest, self.cluster.epoch(name) or 0)


def restart(cluster: SoakCluster, name: str, attempts: int = 3) -> float:
    t = time.monotonic()
    for attempt in range(attempts):
        try:
            cluster.restart(name)
            return time.monotonic() - t
        except RuntimeError as exc:  # not ready in time: stopped by NodeProcess.start
            cluster.note(f"restart of {name} failed (attempt {attempt + 1}): "
                         f"{str(exc).splitlines()[0]}", name)
    raise RuntimeError(f"{name} did not restart in {attempts} attempts")


def settle(cluster: SoakCluster, timeout: float, stable: float = 2.0) -> tuple[str | None, float | None]:
    """Until one primary serves and every other node is a ready backup for ``stable`` s."""
    t0 = time.monotonic()
    since: float | None = None
    seen: tuple[str, int | None] | None = None
    while time.monotonic() - t0 < timeout:
        primary = cluster.primary()
        ok = primary is not None and all(
            (st := cluster.status(n)) is not None and st["node"].get("role") == "backup"
            and st["node"].get("ready") for n in cluster.names if n != primary)
        now = time.monotonic()
        if ok and primary is not None:
            key = (primary, cluster.epoch(primary))
            if key != seen:
                seen, since = key, now
            elif since is not None and now - since >= stable:
                return primary, since - t0
        else:
            seen = since = None
        time.sleep(0.1)
    return None, None


def read_stores(cluster: SoakCluster, pub: SoakPublisher, result: SoakResult) -> None:
    committed = set(pub.committed)
    unanswered = set(pub.unanswered)
    size = pub.size
    held_by: dict[str, dict[int, set[int]]] = {}
    for name in cluster.names:
        store = open_store(None, cluster.data_dir / name)
        try:
            raw = store.get_meta(POSITION_KEY)
            position = None if raw is None else stored_position(raw)[:2]
            copies: Counter[tuple[int, int]] = Counter()
            count = 0
            for m in store.load().messages:
                if m.queue != QUEUE:
                    continue
                k, i, _ = (int(x) for x in m.body.decode().split(":"))
                copies[(k, i)] += 1
                count += 1
        finally:
            store.close()
        held: dict[int, set[int]] = {}
        for k, i in copies:
            held.setdefault(k, set()).add(i)
        held_by[name] = held
        nc = NodeCount(name, position, count)
        nc.duplicates = sum(c - 1 for c in copies.values() if c > 1)
        for k, idx in held.items():
            if len(idx) != size:
                nc.partial += 1
            if k in committed:
                nc.whole += len(idx) == size
            elif k in unanswered:
                nc.unanswered_held += 1
            else:
                nc.never_committed += 1
        nc.missing = sum(1 for k in committed if k not in held)
        result.nodes.append(nc)
    final = result.final_primary
    candidates = [] if final is None else [final]
    if final is None:  # never settled: the node that holds the highest position
        top = max(n.position or (-1, -1) for n in result.nodes)
        tied = [n.node for n in result.nodes if (n.position or (-1, -1)) == top]
        candidates, result.final_primary = tied, tied[0]
        result.final_primary_by = "highest stored position" + (
            f", tied with {', '.join(tied[1:])}: each checked" if len(tied) > 1 else "")
    result.missing_on_final = max(
        sum(1 for k in committed if len(held_by[c].get(k, ())) != size) for c in candidates)
    result.on_no_node = sum(1 for k in committed if not any(k in h for h in held_by.values()))


def run_soak(cfg: SoakConfig, out: Any = sys.stdout) -> SoakResult:
    def say(text: str) -> None:
        print(text, file=out, flush=True)

    data = cfg.data or Path(tempfile.mkdtemp(prefix="brokerha-soak-"))
    data.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    head = cfg.head_start if cfg.head_start is not None else int(cfg.min_queue * 0.8)
    result = SoakResult(cfg, wall(), 0.0, 0, 0, 0, 0, 0, data_dir=str(data))
    load0 = os.getloadavg()[0]
    t_start = time.monotonic()
    cluster = SoakCluster(data, cfg.ready_timeout)
    pub = SoakPublisher(cluster.urls, cfg.mode, cfg.batch)
    watch = EpochWatch(cluster)
    try:
        cluster.start()
        primary = cluster.wait_primary(60)
        for name in cluster.names:
            if name != primary:
                cluster.wait_ready(name, 60)
        say(f"{wall()} cluster up in {data} (primary {primary}); publishing ({cfg.mode}), "
            f"head start {head:,} messages, then {cfg.kills} kills to {cfg.min_queue:,}")
        cluster.note(f"start: mode {cfg.mode}, kills {cfg.kills}, min queue {cfg.min_queue}")
        pub.start()
        watch.start()
        deadline = t_start + cfg.max_time
        next_kill = 0.0
        for n in range(1, cfg.kills + 1):
            target = head + (cfg.min_queue - head) * n // cfg.kills
            while time.monotonic() < deadline and (pub.messages < target
                                                   or time.monotonic() < next_kill):
                if pub.error is not None:
                    raise RuntimeError("publisher failed") from pub.error
                time.sleep(0.05)
            if time.monotonic() >= deadline:
                say(f"{wall()} --max-time reached before kill {n}")
                break
            try:
                victim = cluster.wait_primary(max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                say(f"{wall()} no primary before kill {n} within --max-time")
                break
            kill = Kill(n, victim, cluster.epoch(victim), _others(cluster, victim), pub.messages)
            pid = cluster.nodes[victim].proc.pid  # type: ignore[union-attr]
            cluster.note(f"SIGKILL {victim} (pid {pid}), kill {n}, epoch {kill.epoch_before}",
                         victim)
            cluster.kill(victim)  # SIGKILL, then reaped: the times below count from its death
            t_kill = time.monotonic()
            next_kill = t_kill + cfg.interval * rng.uniform(0.8, 1.2)
            try:
                kill.next_primary = cluster.wait_primary(cfg.failover_timeout, other_than=victim)
                kill.to_primary_s = time.monotonic() - t_kill
                kill.epoch_after = cluster.epoch(kill.next_primary)
            except TimeoutError:
                cluster.note(f"no other primary {cfg.failover_timeout:g} s after kill {n}")
            kill.restart_s = restart(cluster, victim)
            cluster.note(f"{victim} restarted ({kill.restart_s:.1f} s to ready)", victim)
            if kill.next_primary is None:  # the restarted node may be the one to win
                try:
                    kill.next_primary = cluster.wait_primary(max(1.0, deadline - time.monotonic()))
                    kill.to_primary_s = time.monotonic() - t_kill
                    kill.epoch_after = cluster.epoch(kill.next_primary)
                except TimeoutError:
                    pass
            kill.at = t_kill
            result.kills.append(kill)
            result.epochs_seen.append(watch.highest)
            say(f"{wall()} kill {n}: {victim} (epoch {kill.epoch_before}; {kill.others_ready}) "
                f"at {kill.queue_messages:,} messages -> {kill.next_primary} epoch "
                f"{kill.epoch_after} after {_s(kill.to_primary_s)}; restarted in "
                f"{_s(kill.restart_s)}; highest epoch so far {watch.highest}")
        # a few commits after the last kill, then the publisher stops
        settle_from = time.monotonic()
        before = len(pub.committed)
        while len(pub.committed) < before + 20 and time.monotonic() - settle_from < 30:
            time.sleep(0.05)
        pub.stop_event.set()
        pub.join(30)
        for k in result.kills:
            k.to_commit_s = pub.first_answer_after(k.at)
        if pub.error is not None:
            raise RuntimeError("publisher failed") from pub.error
        epoch0 = watch.highest
        say(f"{wall()} publisher stopped: {len(pub.committed):,} committed units, "
            f"{pub.messages:,} messages; waiting up to {cfg.settle_timeout:g} s to settle")
        final, result.settled_s = settle(cluster, cfg.settle_timeout)
        if final is not None:
            result.final_primary, result.final_primary_by = final, "serving when settled"
            cluster.note(f"settled: {final} primary, epoch {cluster.epoch(final)}")
        else:
            cluster.note(f"did not settle within {cfg.settle_timeout:g} s")
        time.sleep(0.5)  # the last acknowledgements
        if final is not None:
            check_replicas(cluster, final, result)
            say(f"{wall()} replicas checked: {result.replicas_checked}")
        result.settle_epochs = (epoch0, watch.highest)
        watch.stop_event.set()
        watch.join(5)
        last = final or cluster.primary()
        for name in [n for n in cluster.names if n != last] + ([last] if last else []):
            cluster.nodes[name].stop(timeout=120)
        say(f"{wall()} nodes stopped; reading the stores")
        read_stores(cluster, pub, result)
        for nc in result.nodes:
            proc = cluster.nodes[nc.node].proc
            nc.exit_code = None if proc is None else proc.returncode
    finally:
        pub.stop_event.set()
        watch.stop_event.set()
        cluster.close()
    result.committed, result.unanswered = len(pub.committed), len(pub.unanswered)
    result.aborted, result.nacked, result.reconnects = (len(pub.aborted), len(pub.nacked),
                                                        pub.reconnects)
    result.connect_timeouts, result.odd_errors = pub.connect_timeouts, pub.odd_errors[:20]
    result.duration_s = time.monotonic() - t_start
    result.load = (load0, os.getloadavg()[0])
    if cfg.data is None and not cfg.keep and result.violations == 0:
        shutil.rmtree(data, ignore_errors=True)
        result.data_dir = ""
    return result


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def report(r: SoakResult) -> str:
    cfg = r.config
    unit = "transactions" if cfg.mode == "tx" else "messages"
    lines = [
        f"SIGKILL soak, {cfg.mode} mode, started {r.started} UTC, {r.duration_s:.0f} s; "
        f"{os.cpu_count()} CPUs, load average {r.load[0]:.2f} -> {r.load[1]:.2f}; seed {cfg.seed}",
        f"{len(r.kills)} of {cfg.kills} kills; {r.committed:,} committed {unit} "
        f"({r.committed * r.unit_size:,} messages), {r.unanswered} answered without a reply "
        f"(in flight when the connection failed), {r.aborted} aborted before tx.commit, "
        f"{r.nacked} nacked; {r.reconnects} reconnects, {r.connect_timeouts} times 10 s without "
        f"a node accepting" + (f"; other errors: {r.odd_errors}" if r.odd_errors else ""),
        "",
        "| kill | node | epoch | others at the kill | queue | next primary | epoch after | "
        "to primary | to commit-ok | restart to ready | highest epoch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, hi in zip(r.kills, r.epochs_seen, strict=True):
        lines.append(f"| {k.n} | {k.node} | {k.epoch_before} | {k.others_ready} | "
                     f"{k.queue_messages:,} | {k.next_primary or '-'} | {k.epoch_after} | "
                     f"{_s(k.to_primary_s)} | {_s(k.to_commit_s)} | {_s(k.restart_s)} | {hi} |")
    gaps = sorted(k.to_primary_s for k in r.kills if k.to_primary_s is not None)
    if gaps:
        lines.append(f"\ntime to the next primary: p50 {gaps[len(gaps) // 2]:.2f} s, "
                     f"max {gaps[-1]:.2f} s ({len(gaps)} of {len(r.kills)} kills)")
    e0, e1 = r.settle_epochs
    lines.append("settled: " + (f"in {r.settled_s:.1f} s" if r.settled_s is not None
                                else f"NO, not within {cfg.settle_timeout:g} s")
                 + f" after the publisher stopped (highest epoch {e0} -> {e1})")
    lines += [
        f"final primary: {r.final_primary} ({r.final_primary_by})",
        "",
        f"| node | stored position | messages | committed {unit} whole | partial | "
        f"committed missing | duplicates | unanswered held | never committed held | exit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in r.nodes:
        mark = " (final primary)" if n.node == r.final_primary else ""
        lines.append(f"| {n.node}{mark} | {n.position} | {n.messages:,} | {n.whole:,} | "
                     f"{n.partial} | {n.missing:,} | {n.duplicates} | {n.unanswered_held} | "
                     f"{n.never_committed} | {n.exit_code} |")
    lines += [
        "",
        f"committed {unit} missing from the final primary: {r.missing_on_final}",
        f"committed {unit} on no node: {r.on_no_node}",
        f"partial on any node: {r.partial}",
        f"replicas checked once settled (ctl check-replicas): {r.replicas_checked}",
        "RESULT: " + ("FAIL (see above)" if r.violations else
                      "ok" + (" but SHORT of the asked kills or queue" if r.short else "")),
    ]
    if r.data_dir:
        lines.append(f"data and node logs kept in {r.data_dir}")
    return "\n".join(lines)


def check_replicas(cluster: SoakCluster, primary: str, result: SoakResult) -> None:
    """Every backup's copy against the settled primary's (``ctl check-replicas``'s request)."""
    from brokerha.httpapi.client import CtlError, request

    try:
        answer = request(cluster.admin_url(primary), "/api/check-replicas",
                         body={"timeout": 120}, user="guest", password="guest", timeout=130)
    except CtlError as exc:
        result.replicas_checked = f"failed: {exc}"
        return
    result.replicas_differ = int(answer["differences"])
    differing = [f"{q['name']} on {node}: " + ", ".join(d["what"] for d in v["differences"])
                 for q in answer["queues"] for node, v in q["replicas"].items()
                 if v["differences"]]
    result.replicas_checked = (
        f"{'agree' if answer['agree'] else 'DIFFER: ' + '; '.join(differing)}, "
        f"{'complete' if answer['complete'] else 'NOT complete'}, "
        f"{sum(q['count'] or 0 for q in answer['queues']):,} messages in "
        f"{answer['seconds']:.2f} s")


class Terminated(Exception):
    pass


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    raise Terminated(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["tx", "confirm"], default="tx")
    p.add_argument("--kills", type=int, default=15)
    p.add_argument("--interval", type=float, default=3.0, help="seconds between kills (+-20 %%)")
    p.add_argument("--batch", type=int, default=10, help="persistent messages per transaction")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--min-queue", type=int, default=250_000,
                   help="messages the queue passes before the last kill")
    p.add_argument("--head-start", type=int, default=None,
                   help="messages before the first kill (default 80 %% of --min-queue)")
    p.add_argument("--max-time", type=float, default=1800.0,
                   help="bound of the publish-and-kill phase, seconds")
    p.add_argument("--settle-timeout", type=float, default=300.0)
    p.add_argument("--data", type=Path, help="data directory (kept); default a temporary one")
    p.add_argument("--keep", action="store_true", help="keep the temporary data directory")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the result as JSON")
    args = p.parse_args(argv)
    if args.kills < 1 or args.batch < 1 or args.min_queue < 0:
        p.error("--kills and --batch must be positive, --min-queue not negative")
    cfg = SoakConfig(mode=args.mode, kills=args.kills, interval=args.interval, batch=args.batch,
                     seed=args.seed, min_queue=args.min_queue, head_start=args.head_start,
                     max_time=args.max_time, settle_timeout=args.settle_timeout,
                     data=args.data, keep=args.keep)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        result = run_soak(cfg)
    except (Terminated, KeyboardInterrupt):
        return 143
    print()
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2, default=str))
    if result.violations:
        return 1
    return 2 if result.short else 0


if __name__ == "__main__":
    sys.exit(main())
