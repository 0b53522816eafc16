"""HA under heavy work (issue 33): does one big user operation, or a catch-up, cost the primary its role?

The stall suite, one operation at a time, each on a fresh 3-node cluster with
the shipped timing (``brokerha.testing.LocalCluster`` with no timing keys:
``ElectionTiming()``'s heartbeat 0.1 s, lease 0.4 s, election 0.6 s):

- ``message 50MiB``: one persistent 50 MiB message, confirmed;
- ``tx N``: one TX of N persistent 512 B messages (20,000 and 100,000);
- ``purge+delete N``: a queue of N confirmed 512 B messages purged, then deleted
  (200,000 and 1,000,000); only purge and delete are measured;
- ``expiry of a tx N``: one TX of N persistent 512 B messages to a queue with an
  ``x-message-ttl`` of 8 s (100,000; full suite only): they expire together, after the
  commit; measured from then until the queue is empty;
- ``max-length 0 on N``: a queue of N confirmed 512 B messages, then a policy of
  ``max-length`` 0 on it (``set_policy``; 1,000,000, full suite only): the trim, dead
  letters of ``maxlen`` dropped from the head, measured until the queue is empty;
- ``catch-up N``: a backup stopped (SIGTERM) while N x 1 KiB are confirmed,
  then restarted (300,000 and 2,000,000): time from the restart to the
  backup's own status saying ``ready`` (caught up), MB/s of message bodies,
  the primary's peak RSS above its RSS just before the restart.

For each operation: **elections** (the highest epoch in the nodes' status
after the cluster settled, minus the one before), the primary's **event loop
lag** during the operation (p99: the bucket of ``brokerha_event_loop_lag_seconds``
that holds the 99th percentile of the histogram's delta over the operation;
max: ``brokerha_event_loop_lag_max_seconds`` when it grew during the
operation, else the highest bucket the delta reached), the **"event loop
stalled" WARNING lines** every node logged during it (they name the function
that ran), and **client errors**: the operating client's (a closed connection,
a lost commit) and a probe's -- a pika publisher with confirms, one message
every 20 ms on its own queue, over every URL (``tests/failover/clients.py``'s
``ConfirmedPublisher``) -- whose reconnects and longest gap between two
confirms are given too.

Next to it, in the same run (``--no-rabbitmq`` skips it), after brokerha's
operations of the round (RabbitMQ's idle VMs would take CPU from brokerha
otherwise), one 3-node RabbitMQ cluster (``ha_cluster.RabbitCluster``) with
quorum queues does the same: its "elections" are the queues' Raft term changes
(``rabbitmq-queues quorum_status``; a leader that moved is noted), its
catch-up a member's ``stop_app`` / ``start_app`` and the time until that
member's log and commit index reach the leader's commit index (polled with
the CLI, about a second per poll), its RSS the leader's Erlang VM; no loop lag
there.

Publishing uses the project's load generator (``loadgen.py``: pre-encoded
frames, the message number in the first 12 bytes of each body), over
``--connections`` connections, each at most ``--window`` unconfirmed; the
time it took, and the elections and stalls while filling, are printed as the
row's ``setup``. A fill that loses its connections (the primary stopped
serving) goes on after a second until its count is confirmed or a time bound
passes; MB/s counts the messages actually confirmed. ``--quick`` runs the
CI-sized suite (TX 20,000, purge 200,000, catch-up 150,000: the sizes of
``tests/failover/test_heavy_work.py``, which runs this code); ``--only NAME``
one operation; ``--held N`` has a consumer hold N deliveries unacknowledged (prefetch N)
across each purge, as a worker pool does; ``--burners N`` runs N ``yes > /dev/null`` beside the clusters;
``--rounds R`` repeats the suite; ``--shares N`` (root) runs all of it in one cgroup of
cpu.shares N, so that a shared box's other work yields to it as if the machine were quiet;
not with ``--burners``: burners kept inside it starve the kernel's threads outside it
(``SHARES_WITH_BURNERS``), and outside it they would yield to the cluster 16:1, so neither
is a quiet machine with burners. Each operation's notes give the CPU used in it by the
burners, by the cluster and its clients and by everything else on the machine ("others":
a run beside other work shows there), how long the primary held publishers by flow
control, and how long each node's threads waited for a core. Every process started here
is stopped here by its PID, also on an error, Ctrl-C or SIGTERM.

Examples::

    .venv/bin/python benchmarks/ha_heavy_work.py --quick --no-rabbitmq
    .venv/bin/python benchmarks/ha_heavy_work.py --burners 2 --rounds 3
    .venv/bin/python benchmarks/ha_heavy_work.py --only "tx 20000" --only "catch-up 300000"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))      # loadgen, ha_cluster, ...
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.*

import loadgen  # noqa: E402
from cgroups import process_tree, weighted  # noqa: E402
from deep_queue_ops import Lag, lag_between, parse_lag  # noqa: E402
from ha_cluster import RabbitCluster  # noqa: E402
from pamqp import commands  # noqa: E402
from rabbitmq_ref import RABBITMQCTL, available  # noqa: E402

from brokerha.cluster.election import ElectionTiming  # noqa: E402
from brokerha.testing import LocalCluster, get  # noqa: E402
from tests.failover.clients import ConfirmedPublisher, connect_any  # noqa: E402

CHANNEL = loadgen.CHANNEL
ID_DIGITS = 12            # a message's number, at the start of its body
QUEUE = "heavy"
PROBE_QUEUE = "heavy-probe"
PROBE_PAUSE = 0.02
QUORUM = (("x-queue-type", "quorum"),)
MiB = 1024 * 1024


# -- the suite ----------------------------------------------------------------------


Arguments = tuple[tuple[str, "str | int"], ...]  # a queue's x-arguments, as pairs


@dataclass(frozen=True)
class Operation:
    kind: str    # message | tx | purge | catchup | expiry | trim
    count: int   # messages (bytes for ``message``)
    size: int    # body bytes
    held: int = 0  # purge: deliveries a consumer holds unacknowledged across it (--held)

    @property
    def name(self) -> str:
        if self.kind == "message":
            return f"message {self.size // MiB}MiB"
        held = f" ({self.held} held)" if self.held else ""
        return ({"tx": "tx", "purge": "purge+delete", "catchup": "catch-up",
                 "expiry": "expiry of a tx", "trim": "max-length 0 on"}[self.kind]
                + f" {self.count}{held}")


FULL = [Operation("message", 1, 50 * MiB), Operation("tx", 20_000, 512),
        Operation("tx", 100_000, 512), Operation("purge", 200_000, 512),
        Operation("purge", 1_000_000, 512), Operation("catchup", 300_000, 1024),
        Operation("catchup", 2_000_000, 1024), Operation("expiry", 100_000, 512),
        Operation("trim", 1_000_000, 512)]
QUICK = [Operation("message", 1, 50 * MiB), Operation("tx", 20_000, 512),
         Operation("purge", 200_000, 512), Operation("catchup", 150_000, 1024)]


# -- publishing with the load generator ----------------------------------------------


@dataclass
class Published:
    """What a publishing client got: confirms (or the commit), its error if any."""

    count: int = 0
    confirmed_ids: set[int] = field(default_factory=set)
    nacked: int = 0
    seconds: float = 0.0
    commit_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class Frames:
    """basic.publish + header + body of a numbered message, encoded once, renumbered in place."""

    def __init__(self, queue: str, size: int, frame_max: int) -> None:
        self.numbered = ID_DIGITS <= size <= frame_max - 8  # one body frame: the id is patchable
        body = b"0" * ID_DIGITS + b"x" * (size - ID_DIGITS) if self.numbered else b"x" * size
        self.one = loadgen.encode_publish(CHANNEL, queue, body, persistent=True, frame_max=frame_max)
        self.at = len(self.one) - 1 - size  # where the body starts (before the end byte)

    def batch(self, first: int, n: int) -> bytearray:
        out = bytearray(self.one * n)
        if self.numbered:
            step = len(self.one)
            for i in range(n):
                out[i * step + self.at:i * step + self.at + ID_DIGITS] = b"%012d" % (first + i)
        return out


def message_id(body: bytes) -> int:
    return int(body[:ID_DIGITS])


async def _declare(conn: loadgen.LoadConnection, queue: str,
                   arguments: Arguments) -> int:
    ok = await conn.rpc(CHANNEL, commands.Queue.Declare(
        queue=queue, durable=True, arguments=dict(arguments) or None), commands.Queue.DeclareOk)
    return int(ok.message_count)


async def _publish_one(url: str, queue: str, first: int, count: int, size: int, *, tx: bool,
                       window: int, arguments: Arguments, out: Published) -> None:
    """``count`` numbered messages from ``first`` on one connection (one TX, or confirms)."""
    conn = None
    try:
        conn = await loadgen.connect(loadgen.BrokerAddress.parse(url))
        await _declare(conn, queue, arguments)
        if tx:
            await conn.rpc(CHANNEL, commands.Tx.Select(), commands.Tx.SelectOk)
        else:
            await conn.rpc(CHANNEL, commands.Confirm.Select(), commands.Confirm.SelectOk)
        frames = Frames(queue, size, conn.frame_max)
        confirms = loadgen.ConfirmWait(conn)  # nothing read for 30 s: a TimeoutError
        batch = max(1, min(500, window // 4, (4 * MiB) // max(1, size)))
        sent = 0
        while sent < count:
            n = min(batch, count - sent)
            if not tx:
                await confirms.until(sent + n - window)
            conn.write(frames.batch(first + sent, n))
            sent += n
            await conn.drain()
        if tx:
            started = time.perf_counter()
            await conn.rpc(CHANNEL, commands.Tx.Commit(), commands.Tx.CommitOk)
            out.commit_seconds = time.perf_counter() - started
            out.confirmed_ids.update(range(first, first + count))
        else:
            await confirms.until(count)
    except (loadgen.AMQPError, OSError, TimeoutError) as exc:
        out.errors.append(f"{'commit' if tx else 'publish'}: {exc}")
    finally:
        if conn is not None:
            if not tx:
                tracker = conn.confirms
                out.nacked += tracker.nacked
                if not tracker.nacked:  # which were nacked is not tracked: count none then
                    out.confirmed_ids.update(range(first, first + tracker.upto))
                    out.confirmed_ids.update(first + t - 1 for t in tracker.sparse)
            await conn.close()


def publish(urls: Sequence[str], queue: str, count: int, size: int, *, tx: bool = False,
            connections: int = 1, window: int = 2000,
            arguments: Arguments = (), first: int = 0) -> Published:
    """Publish ``count`` persistent numbered messages over ``connections`` (split evenly).

    With ``tx`` one connection sends them all as one transaction. ``urls[i %
    len(urls)]`` is connection i's entry point (a brokerha backup relays).
    """
    out = Published(count=count)
    conns = 1 if tx else max(1, min(connections, count))
    share = [count // conns + (i < count % conns) for i in range(conns)]
    starts = [first + sum(share[:i]) for i in range(conns)]

    async def run() -> None:
        await asyncio.gather(*(_publish_one(urls[i % len(urls)], queue, starts[i], share[i], size,
                                            tx=tx, window=window, arguments=arguments, out=out)
                               for i in range(conns)))

    started = time.perf_counter()
    asyncio.run(run())
    out.seconds = time.perf_counter() - started
    return out


def fill(urls: Sequence[str], queue: str, count: int, size: int, *, connections: int = 1,
         window: int = 2000, arguments: Arguments = (),
         timeout: float | None = None) -> Published:
    """Publish until ``count`` messages were confirmed, resuming after a closed connection.

    The numbers go on from the highest one sent, so ``confirmed_ids`` names each
    confirmed message once; ``errors`` keeps what interrupted the publishing.
    Gives up after ``timeout`` s (default: 120 s plus 1 s per 1,000 messages).
    """
    out = Published(count=count)
    started = time.perf_counter()
    deadline = started + (120 + count / 1000 if timeout is None else timeout)
    first = 0
    while time.perf_counter() < deadline:
        missing = count - len(out.confirmed_ids)
        if missing <= 0:
            break
        part = publish(urls, queue, missing, size, connections=connections, window=window,
                       arguments=arguments, first=first)
        first += missing
        out.confirmed_ids |= part.confirmed_ids
        out.nacked += part.nacked
        out.errors += part.errors
        if part.errors:
            time.sleep(1.0)  # a new primary, or the same one serving again
    out.seconds = time.perf_counter() - started
    return out


def queue_op(url: str, method: commands.Frame, reply: type) -> tuple[float, str | None]:
    """One queue method (purge, delete) on a fresh connection: (seconds, error or None)."""
    async def run() -> float:
        conn = await loadgen.connect(loadgen.BrokerAddress.parse(url))
        try:
            started = time.perf_counter()
            await asyncio.wait_for(conn.rpc(CHANNEL, method, reply), 600)
            return time.perf_counter() - started
        finally:
            await conn.close()

    try:
        return asyncio.run(run()), None
    except (loadgen.AMQPError, OSError, TimeoutError) as exc:
        return 0.0, f"{type(method).__name__.lower()}: {exc}"


def declare_queue(urls: Sequence[str], queue: str,
                  arguments: Arguments = ()) -> int:
    """Declare ``queue`` (durable) if it is not there: the messages ready on it."""
    async def run() -> int:
        conn = await loadgen.connect(loadgen.BrokerAddress.parse(urls[0]))
        try:
            return await _declare(conn, queue, arguments)
        finally:
            await conn.close()

    return asyncio.run(run())


def drain_ids(urls: list[str], queue: str, expected: int, idle: float = 3.0,
              timeout: float = 300.0) -> list[int]:
    """Consume (manual acks, in batches) every message of ``queue``: the numbers in their bodies."""
    conn = connect_any(urls, time.monotonic() + 30)
    ch = conn.channel()
    ch.basic_qos(prefetch_count=2000)
    got: list[int] = []
    last: list[int] = [0]

    def on_message(_ch: object, method: object, _props: object, body: bytes) -> None:
        got.append(message_id(body))
        if len(got) % 500 == 0 or len(got) >= expected:
            ch.basic_ack(method.delivery_tag, multiple=True)  # type: ignore[attr-defined]
            last[0] = 0
        else:
            last[0] = method.delivery_tag  # type: ignore[attr-defined]

    ch.basic_consume(queue, on_message)
    deadline = time.monotonic() + timeout
    quiet_since = time.monotonic()
    seen = 0
    while time.monotonic() < deadline and time.monotonic() - quiet_since < idle:
        conn.process_data_events(time_limit=0.2)
        if len(got) != seen:
            seen, quiet_since = len(got), time.monotonic()
    if last[0]:
        ch.basic_ack(last[0], multiple=True)
    conn.close()
    return got


# -- what the primary shows: /metrics, its log, its RSS --------------------------------

STALL = re.compile(r"^(\S+ \S+) WARNING \[(\S+)\] \S+: event loop stalled ([\d.]+)s \(running: (.*)\)$")
ELECTION = re.compile(r"^(\S+ \S+) WARNING \[(\S+)\] \S+: (node \S+ (?:stands for election|"
                      r"elected primary|deposed|is primary|\(primary, epoch \d+\): heartbeat).*)$")
GC_PAUSE = re.compile(r"^(\S+ \S+) WARNING \[(\S+)\] \S+: cyclic GC \(generation (\d)\) "
                      r"paused the node ([\d.]+)s")
LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"


def scrape_lag(cluster: LocalCluster, name: str) -> Lag | None:
    try:
        return parse_lag(get(cluster.admin_url(name) + "/metrics", 3).decode())
    except (OSError, ValueError):
        return None


def lag_figures(before: Lag | None, after: Lag | None) -> tuple[str, str]:
    """(p99, max) of the loop lag between two scrapes, as text ("<=0.025" for a bucket bound)."""
    if before is None or after is None or not after.buckets:
        return "-", "-"
    return lag_between(before, after)


def stall_lines(cluster: LocalCluster, since: float, until: float) -> list[str]:
    """The "event loop stalled" WARNINGs every running node logged in [since, until] (wall clock)."""
    found = []
    for node in cluster.nodes.values():
        for line in list(node.log):
            m = STALL.match(line)
            if m and since <= datetime.strptime(m.group(1), LOG_TIME).timestamp() <= until:
                found.append(f"{m.group(1)[11:]} [{m.group(2)}] stalled {m.group(3)}s "
                             f"(running: {m.group(4)})")
            e = ELECTION.match(line)
            if e and since <= datetime.strptime(e.group(1), LOG_TIME).timestamp() <= until:
                found.append(f"{e.group(1)[11:]} [{e.group(2)}] {e.group(3)[:160]}")
            g = GC_PAUSE.match(line)
            if g and since <= datetime.strptime(g.group(1), LOG_TIME).timestamp() <= until:
                found.append(f"{g.group(1)[11:]} [{g.group(2)}] GC generation {g.group(3)} "
                             f"paused {g.group(4)}s")
    return sorted(found)


def stat_fields(path: Path) -> list[str]:
    """The fields of a ``/proc/.../stat`` after the command's name (which may hold spaces
    and parentheses): index 0 is the state, 7 minor faults, 11 and 12 user and system
    ticks."""
    return path.read_text().rsplit(")", 1)[1].split()


def tasks_of(pid: int) -> list[Path]:
    """The process's threads' ``/proc/<pid>/task/<tid>`` directories (none once it is gone)."""
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user and system, every thread), from /proc."""
    fields = stat_fields(Path(f"/proc/{pid}/stat"))
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> tuple[float, float]:
    """(the main thread's, the other threads') CPU seconds so far, from /proc (an event
    loop's thread is the process's main thread; the others are the store's, the watchdog)."""
    main = others = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in tasks_of(pid):
        try:
            fields = stat_fields(task / "stat")
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if task.name == str(pid):
            main += cpu
        else:
            others += cpu
    return main, others


def sched_times(pid: int) -> tuple[float, float, float]:
    """(the main thread's seconds waiting for a core, every thread's, every thread's
    running) so far, from ``/proc/<pid>/task/*/schedstat`` (run and run-queue wait, ns):
    a node beside CPU burners that is slow because it waits for a core, not because it
    works, shows it here."""
    main_wait = wait = run = 0.0
    for task in tasks_of(pid):
        try:
            ran, waited = (int(v) / 1e9 for v in (task / "schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue
        run, wait = run + ran, wait + waited
        if task.name == str(pid):
            main_wait = waited
    return main_wait, wait, run


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds so far: the machine's (every core, busy), this benchmark's processes'
    (itself, the nodes, the clients, the burners: the tree under it), the burners'."""

    machine: float
    ours: float
    burners: float

    @staticmethod
    def now(root: int | None = None) -> CpuSplit:
        tick = os.sysconf("SC_CLK_TCK")
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        machine = (sum(fields) - fields[3] - fields[4]) / tick  # all but idle and iowait
        ours = burners = 0  # in ticks: a sum of floats could make ours < burners by 1e-14
        for pid in process_tree(os.getpid() if root is None else root):
            try:
                text = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # gone meanwhile
            stat = text.rsplit(")", 1)[1].split()
            cpu = sum(int(v) for v in stat[11:15])  # its own and its waited-for children's
            ours += cpu
            if text[text.index("(") + 1:text.rindex(")")] == "yes":
                burners += cpu
        return CpuSplit(machine, ours / tick, burners / tick)

    def note(self, before: CpuSplit, seconds: float) -> str:
        """What a window used: the burners, the rest of this benchmark, and everything else
        on the machine (other sessions' work, the kernel's threads): a run beside other
        work shows it here."""
        ours, burners = self.ours - before.ours, self.burners - before.burners
        others = max(0.0, self.machine - before.machine - ours)
        return (f"CPU in it (s, {seconds:.2f} s x {os.cpu_count()} cores): burners {burners:.2f}, "
                f"cluster and clients {ours - burners:.2f}, others {others:.2f}")


FLOW_HELD = "brokerha_publisher_flow_held_seconds_total "
FLOW_HOLDS = "brokerha_publisher_flow_holds_total "


def scrape_flow(cluster: LocalCluster, name: str) -> tuple[float, float]:
    """(seconds publishers were held by flow control, holds) so far on ``name``: an HA
    primary holds every publisher while a backup holding a copy lags ``flow_lag``."""
    try:
        return parse_flow(get(cluster.admin_url(name) + "/metrics", 3).decode())
    except (OSError, ValueError):
        return 0.0, 0.0


def parse_flow(text: str) -> tuple[float, float]:
    """(held seconds, holds) from a node's ``/metrics`` text (0 where absent)."""
    held = holds = 0.0
    for line in text.splitlines():
        if line.startswith(FLOW_HELD):
            held = float(line.split()[-1])
        elif line.startswith(FLOW_HOLDS):
            holds = float(line.split()[-1])
    return held, holds


def loop_kernel(pid: int) -> tuple[float, int]:
    """The main thread's system CPU seconds and minor page faults so far, from /proc: a
    catching-up backup's loop clears a fresh page for every ~3 messages it holds, and on
    a VM whose free memory the host took back that clearing was most of the loop's CPU
    (issue 33, docs/benchmarks.md "The 2 GB catch-up's cost was the kernel's")."""
    try:
        fields = stat_fields(Path(f"/proc/{pid}/task/{pid}/stat"))
    except OSError:
        return 0.0, 0
    return int(fields[12]) / os.sysconf("SC_CLK_TCK"), int(fields[7])


PROFILE_DIR = os.environ.get("HA_HEAVY_PROFILE")  # perf record the catch-up's two nodes here
# py-spy (``record --native``, every thread, collapsed stacks) on them instead: its path
PYSPY = os.environ.get("HA_HEAVY_PYSPY")


def start_profile(pid: int, name: str) -> subprocess.Popen[bytes] | None:
    """``perf record -g`` on ``pid`` (every thread) until stopped (``HA_HEAVY_PROFILE``);
    with ``HA_HEAVY_PYSPY`` (py-spy's path), ``py-spy record --native`` in raw (collapsed)
    format, one line per stack with its thread."""
    if not PROFILE_DIR:
        return None
    Path(PROFILE_DIR).mkdir(parents=True, exist_ok=True)
    if PYSPY:
        out = Path(PROFILE_DIR) / f"{name}-{int(time.time())}.txt"
        return subprocess.Popen([PYSPY, "record", "--native", "--threads", "-r", "250",
                                 "--format", "raw", "-p", str(pid), "-o", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = Path(PROFILE_DIR) / f"{name}-{int(time.time())}.data"
    return subprocess.Popen(["perf", "record", "-F", "499", "-g", "-p", str(pid), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def vm_rss(pid: int) -> int:
    """Resident set size of a process in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def beam_of(pid: int) -> int:
    """The Erlang VM (``beam.smp``) started under ``pid`` (rabbitmq-server is a shell script)."""
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            if Path(f"/proc/{p}/comm").read_text().strip().startswith("beam"):
                return p
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return pid


class RssSampler(threading.Thread):
    """Samples a process's RSS every 50 ms until stopped; ``peak`` is the largest seen."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak = pid, vm_rss(pid)
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(0.05):
            self.peak = max(self.peak, vm_rss(self.pid))

    def finish(self) -> int:
        self.stop_event.set()
        self.join(5)
        return self.peak


# -- the probe: a confirming pika client beside the operation --------------------------


class Probe:
    """``ConfirmedPublisher`` on its own queue: gaps between confirms and reconnects per window.

    A publisher that gave up (pika raised what it does not retry, e.g. a handshake
    timeout while a node stalled) counts as a client error of the window it died
    in; ``mark`` starts a new one for the next window.
    """

    def __init__(self, urls: list[str], arguments: Arguments = ()) -> None:
        self.urls, self.arguments = urls, arguments
        self.pub = self._publisher()

    def _publisher(self) -> ConfirmedPublisher:
        def declare(ch: object) -> None:
            ch.queue_declare(PROBE_QUEUE, durable=True,  # type: ignore[attr-defined]
                             arguments=dict(self.arguments) or None)

        pub = ConfirmedPublisher(self.urls, PROBE_QUEUE, declare=declare, limit=10**9,
                                 pause=PROBE_PAUSE)
        pub.start()
        deadline = time.monotonic() + 30
        while len(pub.confirmed) < 20 and pub.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return pub

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pub.stop_event.set()
        self.pub.join(30)

    def mark(self) -> tuple[float, int]:
        if not self.pub.is_alive():
            self.pub = self._publisher()
        return time.monotonic(), self.pub.reconnects

    def since(self, mark: tuple[float, int]) -> tuple[int, float, float]:
        """(reconnects, p99 gap between confirms, longest gap) since ``mark`` (gaps in s)."""
        t0, reconnects = mark
        times = [t0, *(t for t in list(self.pub.confirmed_at) if t > t0), time.monotonic()]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return self.pub.reconnects - reconnects, _p99(gaps), max(gaps)

    def error(self) -> str | None:
        return repr(self.pub.error) if self.pub.error is not None else None


def _p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


# -- one operation on a brokerha cluster --------------------------------------------------


@dataclass
class Outcome:
    """One operation's figures (one row of a table)."""

    broker: str
    op: str
    primary: str = ""
    seconds: float = 0.0
    elections: int | None = None
    lag_p99: str = "-"
    lag_max: str = "-"
    stalls: list[str] = field(default_factory=list)
    setup_stalls: list[str] = field(default_factory=list)
    client_errors: list[str] = field(default_factory=list)
    probe_reconnects: int = 0
    probe_gap_p99: float = 0.0
    probe_gap_max: float = 0.0
    probe_gap_p99_before: float = 0.0
    setup: str = ""
    mb_s: float | None = None
    rss_mib: float | None = None
    notes: list[str] = field(default_factory=list)


def cluster_epoch(cluster: LocalCluster) -> int:
    epochs = [st["node"].get("epoch") or 0 for name in cluster.names
              if cluster.is_running(name) and (st := cluster.status(name))]
    return max(epochs, default=0)


def settle(cluster: LocalCluster, timeout: float = 120.0, quiet: float = 2.0) -> str:
    """Until one primary serves, every running backup is ready, and the epoch held ``quiet`` s."""
    deadline = time.monotonic() + timeout
    while True:
        primary = cluster.wait_primary(max(1.0, deadline - time.monotonic()))
        for name in cluster.names:
            if name != primary and cluster.is_running(name):
                cluster.wait_ready(name, max(1.0, deadline - time.monotonic()))
        epoch = cluster_epoch(cluster)
        time.sleep(quiet)
        if cluster_epoch(cluster) == epoch and cluster.primary() == primary:
            return primary
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not settle within {timeout} s")


@contextmanager
def measured(cluster: LocalCluster, probe: Probe, out: Outcome) -> Iterator[str]:
    """Around one operation: epochs, the primary's loop lag and every node's stall lines."""
    primary = out.primary = settle(cluster)
    epoch = cluster_epoch(cluster)
    probe.mark()  # a probe that gave up starts again
    out.probe_gap_p99_before = probe.since((time.monotonic() - 2.0, 0))[1]
    lag_before = scrape_lag(cluster, primary)
    backups = [n for n in cluster.names if n != primary and cluster.is_running(n)]
    backups_before = {n: scrape_lag(cluster, n) for n in backups}
    pids = {n: cluster.nodes[n].proc.pid for n in cluster.names  # type: ignore[union-attr]
            if cluster.is_running(n)}
    sched_before = {n: sched_times(pid) for n, pid in pids.items()}
    flow_before = scrape_flow(cluster, primary)
    cpu_before = CpuSplit.now()
    mark, wall = probe.mark(), time.time()
    started = time.perf_counter()
    yield primary
    out.seconds = time.perf_counter() - started
    out.notes.append(CpuSplit.now().note(cpu_before, out.seconds))
    flow_after = scrape_flow(cluster, primary)
    out.notes.append(f"publishers held by flow {flow_after[0] - flow_before[0]:.2f} s "
                     f"({flow_after[1] - flow_before[1]:.0f} holds)")
    waits = []
    for n, pid in pids.items():
        after = sched_times(pid)
        waits.append(f"{n}{'*' if n == primary else ''} {after[0] - sched_before[n][0]:.2f} / "
                     f"{after[1] - sched_before[n][1]:.2f} (ran {after[2] - sched_before[n][2]:.2f})")
    out.notes.append("waited for a core, loop / all threads (s): " + ", ".join(waits)
                     + f"; {datetime.fromtimestamp(wall):%H:%M:%S.%f}"[:-4]
                     + f"-{datetime.now():%H:%M:%S.%f}"[:-4])
    out.lag_p99, out.lag_max = lag_figures(lag_before, scrape_lag(cluster, primary))
    # the backups' loop lag too: applying what the primary sends is their heavy work
    figures = [(n, lag_figures(backups_before[n], scrape_lag(cluster, n))) for n in backups
               if cluster.is_running(n)]
    if figures:
        out.notes.append("backups' loop lag p99 / max " + ", ".join(
            f"{n} {p99} / {top}" for n, (p99, top) in figures))
    out.probe_reconnects, out.probe_gap_p99, out.probe_gap_max = probe.since(mark)
    out.stalls = stall_lines(cluster, wall - 0.5, time.time() + 0.5)
    try:
        settle(cluster)
    except TimeoutError as exc:
        out.notes.append(str(exc))
    out.elections = cluster_epoch(cluster) - epoch
    if (error := probe.error()) is not None:
        out.client_errors.append(f"probe: {error}")


def run_brokerha(op: Operation, *, connections: int, window: int,
                 say: Callable[[str], None]) -> Outcome:
    """One operation on a fresh 3-node cluster (stopped afterwards)."""
    with LocalCluster(3) as cluster:
        return run_on(cluster, op, connections=connections, window=window, say=say)[0]


def run_on(cluster: LocalCluster, op: Operation, *, connections: int = 2, window: int = 2000,
           say: Callable[[str], None] = print) -> tuple[Outcome, Published]:
    """One operation on a running cluster, beside the probe: its figures, and what was
    published (the TX, or the queue filled before a purge or a catch-up)."""
    out = Outcome("brokerha", op.name)
    primary = settle(cluster)
    with Probe(cluster.urls) as probe:
        if op.kind in ("message", "tx"):
            with measured(cluster, probe, out) as primary:
                pub = publish([cluster.url(primary)], QUEUE, op.count, op.size, tx=op.kind == "tx")
            out.client_errors += pub.errors
            if op.kind == "tx":
                out.notes.append(f"commit {pub.commit_seconds:.2f} s of {pub.seconds:.2f} s")
        elif op.kind == "expiry":
            pub = publish([cluster.url(primary)], QUEUE, op.count, op.size, tx=True,
                          arguments=EXPIRING)
            out.client_errors += pub.errors
            with measured(cluster, probe, out) as primary:
                wait_empty(cluster.urls, out, EXPIRING)
        elif op.kind == "trim":
            pub = fill_brokerha(cluster, op, out, connections=connections, window=window, say=say)
            with measured(cluster, probe, out) as primary:
                ctl = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                                      cluster.url(primary), "set_policy", *TRIM_POLICY],
                                     capture_output=True, text=True, timeout=60)
                if ctl.returncode:
                    out.client_errors.append(f"set_policy: {ctl.stdout}{ctl.stderr}".strip())
                wait_empty(cluster.urls, out, ())
        elif op.kind == "purge":
            pub = fill_brokerha(cluster, op, out, connections=connections, window=window, say=say)
            with holding(cluster.url(primary), op.held, out), \
                    measured(cluster, probe, out) as primary:
                purge_delete(cluster.url(primary), out)
        else:
            pub = catch_up_brokerha(cluster, probe, op, out, connections=connections,
                                    window=window, say=say)
    return out, pub


def fill_brokerha(cluster: LocalCluster, op: Operation, out: Outcome, *, connections: int,
                  window: int, say: Callable[[str], None]) -> Published:
    """``fill`` through the running nodes; elections and stalls while filling go to ``setup``."""
    epoch, wall = cluster_epoch(cluster), time.time()
    urls = [cluster.url(n) for n in cluster.names if cluster.is_running(n)]
    filled = fill(urls, QUEUE, op.count, op.size, connections=connections, window=window)
    settle(cluster)
    stalls = stall_lines(cluster, wall, time.time())
    out.setup = (f"setup: {_published(filled)}, {cluster_epoch(cluster) - epoch} elections, "
                 f"{len(stalls)} stalls")
    say(f"    {out.setup}" + "".join(f"\n      {line}" for line in stalls[:20]))
    out.setup_stalls = stalls
    return filled


def catch_up_brokerha(cluster: LocalCluster, probe: Probe, op: Operation, out: Outcome, *,
                      connections: int, window: int, say: Callable[[str], None],
                      ready_timeout: float = 600.0) -> Published:
    """Stop a backup, publish ``op.count`` confirmed, restart it and time its catch-up."""
    primary = settle(cluster)
    backup = next(n for n in cluster.names if n != primary)
    cluster.nodes[backup].stop()
    filled = fill_brokerha(cluster, op, out, connections=connections, window=window, say=say)
    with measured(cluster, probe, out) as primary:
        pid = cluster.nodes[primary].proc.pid  # type: ignore[union-attr]
        steady = vm_rss(pid)
        rss = RssSampler(pid)
        rss.start()
        primary_cpu = cpu_seconds(pid)
        primary_threads = thread_cpu(pid)
        load = os.getloadavg()[0]
        started = time.perf_counter()
        cluster.start_node(backup)
        booted = time.perf_counter() - started
        backup_pid = cluster.nodes[backup].proc.pid  # type: ignore[union-attr]
        # the backup's CPU once its process is up (its imports and recovery done):
        # what the catch-up itself cost it
        up_cpu = thread_cpu(backup_pid)
        up_kernel = loop_kernel(backup_pid)
        profiles = [start_profile(backup_pid, "backup"), start_profile(pid, "primary")]
        try:
            cluster.wait_ready(backup, ready_timeout)
            caught_up = time.perf_counter() - started
            for proc in profiles:
                stop_profile(proc)
            out.mb_s = len(filled.confirmed_ids) * op.size / 1e6 / caught_up
            n = max(1, len(filled.confirmed_ids))
            b_loop, b_other = thread_cpu(backup_pid)
            b_loop, b_other = b_loop - up_cpu[0], b_other - up_cpu[1]
            b_sys, b_faults = loop_kernel(backup_pid)
            b_sys, b_faults = b_sys - up_kernel[0], b_faults - up_kernel[1]
            p_loop, p_other = thread_cpu(pid)
            p_loop, p_other = p_loop - primary_threads[0], p_other - primary_threads[1]
            out.notes.append(f"CPU to ready: backup {cpu_seconds(backup_pid):.2f} s (its start "
                             f"included), primary {cpu_seconds(pid) - primary_cpu:.2f} s")
            out.notes.append(
                f"CPU per message once the backup was up: backup loop {b_loop / n * 1e6:.2f} "
                f"(in the kernel {b_sys / n * 1e6:.2f}, {b_faults / n:.2f} page faults) + "
                f"other threads {b_other / n * 1e6:.2f} us, primary loop "
                f"{p_loop / n * 1e6:.2f} + other threads {p_other / n * 1e6:.2f} us; "
                f"load {load:.1f} -> {os.getloadavg()[0]:.1f}")
            guarded = wait_guarded(cluster, primary, backup, ready_timeout)
            out.notes.append(f"process up {booted:.1f} s, ready {caught_up:.1f} s, the primary "
                             f"counts it ready {guarded - started:.1f} s")
        except TimeoutError:
            out.notes.append(f"{backup} not ready within {ready_timeout:.0f} s")
        finally:
            for proc in profiles:
                stop_profile(proc)
        out.rss_mib = (rss.finish() - steady) / MiB
    return filled


@contextmanager
def holding(url: str, count: int, out: Outcome) -> Iterator[list[int]]:
    """A consumer holding ``count`` deliveries of ``QUEUE`` unacknowledged (prefetch
    ``count``) while the block runs, as a worker pool does when an operator purges: the
    purge leaves those (on brokerha a ``pr`` event of the purged ranges, not a dequeue
    per message, docs/ha.md). Yields their numbers; nothing held if ``count`` is 0."""
    if not count:
        yield []
        return
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=count)
        got: list[int] = []
        ch.basic_consume(QUEUE, lambda _c, _m, _p, body: got.append(message_id(body)))
        deadline = time.monotonic() + 60
        while len(got) < count and time.monotonic() < deadline:
            conn.process_data_events(0.1)
        out.notes.append(f"{len(got)} deliveries held unacknowledged")
        yield got
    finally:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - its queue deleted, or the node gone: closed anyway
            pass


# the expiry operation's queue: its messages expire together, EXPIRY_TTL_MS after the TX's
# commit (past measured()'s settling, which waits for the epoch to hold 2 s)
EXPIRY_TTL_MS = 8000
EXPIRING: Arguments = (("x-message-ttl", EXPIRY_TTL_MS),)


# the trim operation's policy (rabbitmqctl's and ``brokerha ctl``'s set_policy arguments)
TRIM_POLICY = ("--apply-to", "queues", "heavy-trim", f"^{QUEUE}$", '{"max-length": 0}')


def wait_empty(urls: Sequence[str], out: Outcome, arguments: Arguments,
               timeout: float = 120.0) -> None:
    """Until ``QUEUE`` is empty (its messages expired or trimmed), polling its count."""
    started = time.perf_counter()
    deadline = time.monotonic() + timeout
    left = -1
    while time.monotonic() < deadline:
        try:
            left = declare_queue(urls, QUEUE, arguments)
        except (loadgen.AMQPError, OSError) as exc:
            out.client_errors.append(f"declare: {exc}")
            left = -1
        if left == 0:
            break
        time.sleep(0.2)
    out.notes.append(f"empty in {time.perf_counter() - started:.2f} s"
                     if left == 0 else f"{left} messages left after {timeout:.0f} s")


def purge_delete(url: str, out: Outcome) -> None:
    """Purge ``QUEUE``, then delete it, each on a fresh connection."""
    purge_s, error = queue_op(url, commands.Queue.Purge(queue=QUEUE), commands.Queue.PurgeOk)
    delete_s, error2 = queue_op(url, commands.Queue.Delete(queue=QUEUE), commands.Queue.DeleteOk)
    out.client_errors += [e for e in (error, error2) if e]
    out.notes.append(f"purge {purge_s:.2f} s, delete {delete_s:.2f} s")


def wait_guarded(cluster: LocalCluster, primary: str, backup: str, timeout: float) -> float:
    """Until ``primary``'s status counts ``backup`` ready (it acknowledged the catch-up's marker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = cluster.status(primary) or {}
        replication = st.get("replication") or st.get("node", {}).get("replication") or {}
        if (replication.get("backups", {}).get(backup) or {}).get("ready"):
            return time.perf_counter()
        time.sleep(cluster.poll_interval)
    raise TimeoutError(f"{primary} did not count {backup} ready within {timeout} s")


def _published(p: Published) -> str:
    rate = len(p.confirmed_ids) / p.seconds if p.seconds else 0
    errors = f", errors: {'; '.join(p.errors)[:200]}" if p.errors else ""
    return f"{len(p.confirmed_ids):,} confirmed in {p.seconds:.1f} s ({rate:,.0f}/s){errors}"


# -- the same on a RabbitMQ quorum queue -------------------------------------------------


def quorum_members(rabbits: RabbitCluster, queue: str) -> list[dict[str, object]]:
    """``rabbitmq-queues quorum_status``'s rows (node, raft state, commit index, term)."""
    queues = Path(str(RABBITMQCTL)).with_name("rabbitmq-queues")
    for node in rabbits.running():
        try:
            done = subprocess.run([str(queues), "-n", node.nodename, "quorum_status", queue,
                                   "--formatter", "json"], env=node.env(), capture_output=True,
                                  text=True, timeout=30)
        except subprocess.TimeoutExpired:
            continue
        if done.returncode == 0:
            try:
                return list(json.loads(done.stdout))
            except ValueError:
                continue
    return []


def quorum_terms(rabbits: RabbitCluster) -> dict[str, int]:
    """The Raft term of the measured queue and of the probe's (absent: a queue not there)."""
    terms = {}
    for queue in (QUEUE, PROBE_QUEUE):
        known = [_int(r.get("Term")) for r in quorum_members(rabbits, queue)]
        if any(t is not None for t in known):
            terms[queue] = max(t for t in known if t is not None)
    return terms


def quorum_leader(rabbits: RabbitCluster) -> str | None:
    """The measured queue's leader (the probe's when it is gone)."""
    for queue in (QUEUE, PROBE_QUEUE):
        for row in quorum_members(rabbits, queue):
            if row.get("Raft State") == "leader":
                return str(row["Node Name"]).split("@")[0]
    return None


def _int(value: object) -> int | None:
    """A number of quorum_status's table ("" for a member that is down)."""
    try:
        return int(str(value))
    except ValueError:
        return None


@contextmanager
def measured_quorum(rabbits: RabbitCluster, probe: Probe, out: Outcome) -> Iterator[None]:
    """Around one operation on the quorum queues: their terms (leader changes), the probe."""
    terms, leader = quorum_terms(rabbits), quorum_leader(rabbits)
    probe.mark()  # a probe that gave up starts again
    out.probe_gap_p99_before = probe.since((time.monotonic() - 2.0, 0))[1]
    mark = probe.mark()
    started = time.perf_counter()
    yield
    out.seconds = time.perf_counter() - started
    out.probe_reconnects, out.probe_gap_p99, out.probe_gap_max = probe.since(mark)
    time.sleep(2.0)  # an election the operation caused shows by then
    after = quorum_terms(rabbits)
    changes = [after[q] - terms[q] for q in terms if q in after]
    out.elections = max(changes) if changes else None
    if (now := quorum_leader(rabbits)) != leader:
        out.notes.append(f"leader {leader} -> {now}")
    if (error := probe.error()) is not None:
        out.client_errors.append(f"probe: {error}")


def fill_rabbitmq(urls: Sequence[str], op: Operation, out: Outcome, *, connections: int,
                  window: int, say: Callable[[str], None]) -> None:
    """``fill`` the quorum queue before a purge or a trim; the fill goes to ``setup``."""
    filled = fill(urls, QUEUE, op.count, op.size, connections=connections, window=window,
                  arguments=QUORUM)
    out.setup = f"setup: {_published(filled)}"
    say(f"    {out.setup}")


def run_rabbitmq(op: Operation, rabbits: RabbitCluster, *, connections: int, window: int,
                 say: Callable[[str], None]) -> Outcome:
    """One operation on a running RabbitMQ cluster's quorum queue (deleted afterwards)."""
    out = Outcome("RabbitMQ quorum", op.name)
    urls = rabbits.urls
    try:
        with Probe(urls, QUORUM) as probe:
            # its term is read before the operation
            declare_queue(urls, QUEUE, QUORUM + EXPIRING if op.kind == "expiry" else QUORUM)
            if op.kind in ("message", "tx"):
                with measured_quorum(rabbits, probe, out):
                    pub = publish(urls[:1], QUEUE, op.count, op.size, tx=op.kind == "tx",
                                  arguments=QUORUM)
                out.client_errors += pub.errors
                if op.kind == "tx":
                    out.notes.append(f"commit {pub.commit_seconds:.2f} s of {pub.seconds:.2f} s")
            elif op.kind == "expiry":
                pub = publish(urls[:1], QUEUE, op.count, op.size, tx=True,
                              arguments=QUORUM + EXPIRING)
                out.client_errors += pub.errors
                with measured_quorum(rabbits, probe, out):
                    wait_empty(urls, out, QUORUM + EXPIRING)
            elif op.kind == "trim":
                fill_rabbitmq(urls, op, out, connections=connections, window=window, say=say)
                with measured_quorum(rabbits, probe, out):
                    rabbits.nodes[0].check("set_policy", *TRIM_POLICY)
                    wait_empty(urls, out, QUORUM)
                rabbits.nodes[0].check("clear_policy", TRIM_POLICY[2])
            elif op.kind == "purge":
                fill_rabbitmq(urls, op, out, connections=connections, window=window, say=say)
                with holding(urls[0], op.held, out), measured_quorum(rabbits, probe, out):
                    purge_delete(urls[0], out)
            else:
                catch_up_rabbitmq(rabbits, probe, op, out, connections=connections,
                                  window=window, say=say)
    finally:
        for queue in (QUEUE, PROBE_QUEUE):
            queue_op(rabbits.urls[0], commands.Queue.Delete(queue=queue), commands.Queue.DeleteOk)
    return out


def in_sync(rabbits: RabbitCluster, member: str) -> str | None:
    """The member's and the leader's indexes once the member (a follower) holds and has
    committed everything the leader committed; None before."""
    rows = {str(r["Node Name"]): r for r in quorum_members(rabbits, QUEUE)}
    lead = next((r for r in rows.values() if r.get("Raft State") == "leader"), None)
    mine = rows.get(member)
    if lead is None or mine is None or mine.get("Raft State") != "follower":
        return None
    committed = _int(lead.get("Commit Index"))
    log, commit = _int(mine.get("Log Index")), _int(mine.get("Commit Index"))
    if committed is None or log is None or commit is None or min(log, commit) < committed:
        return None
    return f"log {log}, commit {commit}, leader's commit {committed}"


def catch_up_rabbitmq(rabbits: RabbitCluster, probe: Probe, op: Operation, out: Outcome, *,
                      connections: int, window: int, say: Callable[[str], None],
                      sync_timeout: float = 600.0) -> None:
    """Stop a follower's app, publish, start it: time until its commit index reaches the leader's."""
    leader = next((str(r["Node Name"]) for r in quorum_members(rabbits, QUEUE)
                   if r.get("Raft State") == "leader"), rabbits.nodes[0].nodename)
    follower = next(n for n in rabbits.nodes if n.nodename != leader)
    follower.check("stop_app")
    leader_node = rabbits.node_named(leader)
    filled = fill([leader_node.url], QUEUE, op.count, op.size, connections=connections,
                  window=window, arguments=QUORUM)
    out.setup = f"setup: {_published(filled)}"
    say(f"    published with {follower.nodename} stopped: {out.setup}")
    with measured_quorum(rabbits, probe, out):
        pid = beam_of(leader_node.pid or 0)
        steady = vm_rss(pid)
        rss = RssSampler(pid)
        rss.start()
        started = time.perf_counter()
        follower.check("start_app")
        deadline = time.monotonic() + sync_timeout
        while time.monotonic() < deadline:
            if (indexes := in_sync(rabbits, follower.nodename)) is not None:
                caught_up = time.perf_counter() - started
                out.mb_s = len(filled.confirmed_ids) * op.size / 1e6 / caught_up
                out.notes.append(f"member in sync {caught_up:.1f} s ({indexes})")
                break
            time.sleep(0.2)
        else:
            out.notes.append(f"member not in sync within {sync_timeout:.0f} s")
        out.rss_mib = (rss.finish() - steady) / MiB


# -- tables ---------------------------------------------------------------------------------


def format_table(op: str, rows: Sequence[Outcome]) -> str:
    head = ["broker", "elections (RabbitMQ: term changes)", "loop lag p99 / max (s)", "client errors",
            "probe: reconnects, gap p99 / max (s)", "op time (s)", "catch-up MB/s",
            "peak RSS over steady (MiB)", "notes"]
    lines = [f"### {op}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        errors = "; ".join(r.client_errors)[:300] or "none"
        lines.append(
            f"| {r.broker} | {'?' if r.elections is None else r.elections} | "
            f"{r.lag_p99} / {r.lag_max} | {errors} | {r.probe_reconnects}, "
            f"{r.probe_gap_p99:.3f} / {r.probe_gap_max:.3f} (before {r.probe_gap_p99_before:.3f}) | "
            f"{r.seconds:.2f} | {'-' if r.mb_s is None else f'{r.mb_s:.1f}'} | "
            f"{'-' if r.rss_mib is None else f'{r.rss_mib:.0f}'} | "
            f"{'; '.join(filter(None, [r.setup, *r.notes]))} |")
    for r in rows:
        for what, stalls in (("during it", r.stalls), ("while filling its queue", r.setup_stalls)):
            if stalls:
                lines += ["", f"{r.broker}: event loop stalls logged {what} (primary {r.primary}):",
                          "", "```", *stalls[:40],
                          *([f"... {len(stalls) - 40} more"] if len(stalls) > 40 else []), "```"]
    return "\n".join(lines)


def summary(results: Sequence[Outcome]) -> str:
    ours = [r for r in results if r.broker == "brokerha"]
    theirs = [r for r in results if r.broker != "brokerha"]
    elections = sum(r.elections or 0 for r in ours)
    unknown = sum(r.elections is None for r in ours)
    closed = sum(bool(r.client_errors) or r.probe_reconnects > 0 for r in ours)
    stalls = sum(1 for r in ours for s in r.stalls if "stalled " in s)
    worst = max((float(s.split("stalled ")[1].split("s ")[0]) for r in ours for s in r.stalls
                 if "stalled " in s), default=0.0)
    rates = [r.mb_s for r in ours if r.mb_s]
    text = (f"SUMMARY brokerha: {len(ours)} operations, {elections} elections"
            f"{f' ({unknown} unknown)' if unknown else ''}, {closed} with a client closed or "
            f"an error, {stalls} loop stalls > 100 ms (longest {worst:.2f} s)"
            + (f", catch-up {min(rates):.1f}-{max(rates):.1f} MB/s" if rates else ""))
    if theirs:
        rq = [r.mb_s for r in theirs if r.mb_s]
        text += (f"; RabbitMQ quorum: {sum(r.elections or 0 for r in theirs)} term changes, "
                 f"{sum(bool(r.client_errors) or r.probe_reconnects > 0 for r in theirs)} with a "
                 f"client closed or an error"
                 + (f", resync {min(rq):.1f}-{max(rq):.1f} MB/s" if rq else ""))
    return text


# -- CPU burners, main --------------------------------------------------------------------


@contextmanager
def burners(n: int) -> Iterator[list[int]]:
    """``n`` × ``yes > /dev/null``, stopped by their PIDs."""
    procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI-sized: TX 20k, purge 200k, catch-up 150k")
    p.add_argument("--only", action="append", default=[],
                   help='run only this operation (its name in the table, e.g. "tx 20000"); repeatable')
    p.add_argument("--burners", type=int, default=0, help="CPU burners (yes > /dev/null) beside")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--held", type=int, default=0, metavar="N",
                   help="purges: a consumer holds N deliveries unacknowledged across them "
                        "(a worker pool's prefetch; default 0)")
    p.add_argument("--no-rabbitmq", action="store_true")
    p.add_argument("--no-brokerha", action="store_true")
    p.add_argument("--connections", type=int, default=2, help="publishing connections for fills")
    p.add_argument("--window", type=int, default=2000, help="unconfirmed messages per connection")
    p.add_argument("--markdown", type=Path, help="also write the tables to this file")
    p.add_argument("--shares", type=int, default=0, metavar="N",
                   help="run everything started here (nodes, clients, burners) in one cgroup of "
                        "cpu.shares N (root; e.g. 16384): other work on a shared box then yields "
                        "to it, as on a quiet machine (benchmarks/cgroups.py); 0: not done; "
                        "not with --burners")
    args = p.parse_args(argv)
    if args.held < 0:
        p.error("--held takes a count of deliveries, 0 or more")
    if args.shares and args.burners:
        p.error(SHARES_WITH_BURNERS)
    return args


# why --shares and --burners do not go together (docs/benchmarks.md, issue 33, eleventh session)
SHARES_WITH_BURNERS = (
    "--shares with --burners is not a quiet machine with burners: the burners keep the "
    "weighted cgroup busy on every core, so the kernel's own threads outside it (the "
    "workers that finish a write's I/O for fsync, softirq, writeback) get 1/17 of a core "
    "and every fsync and loopback packet waits on them: operations of 1 s took 4-7 s and "
    "a fill stalled 30 s. Run --burners without --shares, under the lock, on a quiet box; "
    "each row's notes give the CPU that others used meanwhile.")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    suite = [replace(op, held=args.held) if op.kind == "purge" else op
             for op in (QUICK if args.quick else FULL)]
    suite = [op for op in suite if not args.only or op.name in args.only]
    rabbitmq = not args.no_rabbitmq and available()
    if not args.no_rabbitmq and not rabbitmq:
        print("RabbitMQ is not installed (scripts/ensure-rabbitmq): brokerha only", flush=True)
    timing = ElectionTiming()
    head = (f"# HA under heavy work: {'quick' if args.quick else 'full'} suite, {args.rounds} "
            f"round(s), {args.burners} CPU burner(s), timing heartbeat {timing.heartbeat_interval} s"
            f" / lease {timing.lease_timeout} s / election {timing.election_timeout} s, "
            f"{f'cpu.shares {args.shares}, ' if args.shares else ''}"
            f"{datetime.now().isoformat(timespec='seconds')}")
    print(head, flush=True)

    def say(text: str) -> None:
        print(text, flush=True)

    results: list[Outcome] = []
    tables = [head, ""]
    options = {"connections": args.connections, "window": args.window, "say": say}
    with weighted(args.shares), burners(args.burners):
        for r in range(args.rounds):
            rows: dict[str, list[Outcome]] = {op.name: [] for op in suite}
            if not args.no_brokerha:  # first, alone: RabbitMQ's idle VMs would take CPU too
                for op in suite:
                    say(f"round {r + 1}: brokerha: {op.name} ...")
                    rows[op.name].append(_guarded("brokerha", op,
                                                  lambda op=op: run_brokerha(op, **options)))
                    say(format_table(op.name, rows[op.name][-1:]) + "\n")
            if rabbitmq:
                rabbits = RabbitCluster(3)
                rabbits.start()
                try:
                    for op in suite:
                        say(f"round {r + 1}: RabbitMQ quorum: {op.name} ...")
                        rows[op.name].append(_guarded(
                            "RabbitMQ quorum", op,
                            lambda op=op, rq=rabbits: run_rabbitmq(op, rq, **options)))
                        say(format_table(op.name, rows[op.name][-1:]) + "\n")
                finally:
                    rabbits.stop()
            for op in suite:
                tables += [format_table(f"{op.name} (round {r + 1})", rows[op.name]), ""]
                results += rows[op.name]
    print("\n".join(tables), flush=True)
    line = summary(results)
    print(line, flush=True)
    if args.markdown:
        args.markdown.write_text("\n".join([*tables, line, ""]))
    return 0


def _guarded(broker: str, op: Operation, run: Callable[[], Outcome]) -> Outcome:
    """One operation's row; a failure to start or to settle is a row that says so."""
    try:
        return run()
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
        return Outcome(broker, op.name, notes=[f"failed: {str(exc)[:300]}"])


if __name__ == "__main__":
    sys.exit(main())
