"""HA benchmark: confirmed throughput with 0 and 2 backups, and the failover gap.

Part 1 -- confirmed persistent throughput (the load generator's ``confirm``
workload of ``amqp_throughput.py``: 1 KiB bodies, durable queue, publisher
confirms, window 256, manual-ack consumer), one configuration at a time
(start, measure, stop), in this order (reversed on odd rounds):

- ``RabbitMQ classic``: a single private RabbitMQ node, classic durable queue (calibration);
- ``brokerha 0 backups``: a standalone brokerha node;
- ``brokerha 2 backups``: the primary of a 3-node ``LocalCluster`` (every
  confirm waits for both backups, ``[ha] replicate = all``);
- ``RabbitMQ quorum``: a 3-node RabbitMQ cluster on loopback, the queue
  declared with ``x-queue-type: quorum`` (leader on the node the client uses).

Part 2 -- the failover gap: a pika publisher with confirms (one in flight,
resending what was not confirmed after a reconnect) across all URLs of a
3-node cluster; the node it is connected to -- brokerha's primary, RabbitMQ's
quorum-queue leader -- is SIGKILLed K times (restarted and ready again before
the next kill). The gap is the time from the kill to the first confirm of a
message published after the kill (on the new primary / leader). At the end
the queue is drained: every confirmed message must be there.

Part 3 -- the relay's cost (any node is an entry point, docs/ha.md): on one
3-node brokerha cluster, the ``confirm`` workload and the publish-to-confirm
latency (pika, one persistent publish in flight) through the primary's own
address and through a backup's (which relays the connection to the primary),
alternating, same run; the table gives relayed / direct.

The brokerha cluster of part 2 runs with docs/ha.md's default timeouts
(heartbeat_interval 0.2, lease_timeout 1.0, election_timeout 1.5), not the
shortened ones of the tests.

The RabbitMQ cluster: three ``rabbitmq-server`` nodes (``rabbitA-<id>@localhost``
...), each with its own data dir, AMQP and distribution port, one shared
``HOME`` holding one Erlang cookie, one private ``epmd`` on a private port
(this process's child, stopped by PID); nodes 2 and 3 run ``rabbitmqctl
stop_app; join_cluster; start_app``. Everything started here is stopped here
(``rabbitmqctl stop``, then SIGTERM/SIGKILL of the process group), also on an
error, Ctrl-C or SIGTERM.

Examples::

    .venv/bin/python benchmarks/ha_cluster.py --duration 5 --rounds 1 --kills 5
    .venv/bin/python benchmarks/ha_cluster.py --no-rabbitmq --skip-failover
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import loadgen
import pika
import pika.exceptions
from amqp_profile import make_node
from amqp_throughput import tree_cpu_times
from loadgen import WORKLOADS, Result, Workload
from rabbitmq_ref import RABBITMQ_SERVER, RabbitMQRef, _port_open, _stop_process, available
from store_group_commit import confirm_latency_ms

from brokerha.cluster.election import ElectionTiming
from brokerha.node.cluster_config import ClusterConfig
from brokerha.testing import LocalCluster

# docs/ha.md's defaults, passed explicitly so the measurement does not follow a changed default
_TIMING = ElectionTiming()  # docs/ha.md's defaults are these: the nodes run them unchanged
HA_DEFAULTS: dict[str, float | str] = {
    "heartbeat_interval": _TIMING.heartbeat_interval, "lease_timeout": _TIMING.lease_timeout,
    "election_timeout": _TIMING.election_timeout, "backup_timeout": ClusterConfig.backup_timeout}
CONFIRM = WORKLOADS["confirm"]
CONFIRM_QUORUM = replace(CONFIRM, queue_arguments=(("x-queue-type", "quorum"),))
BODY = 1024

CONFIGS = ["RabbitMQ classic", "brokerha 0 backups", "brokerha 2 backups", "RabbitMQ quorum"]


# -- the RabbitMQ cluster -------------------------------------------------------------


class ClusterNode(RabbitMQRef):
    """One node of ``RabbitCluster``: its own dir and ports, the cluster's HOME and epmd."""

    def __init__(self, cluster: RabbitCluster, letter: str) -> None:
        super().__init__(epmd_port=cluster.epmd_port)
        self.cluster = cluster
        self.nodename = f"rabbit{letter}-{cluster.id}@localhost"

    def env(self) -> dict[str, str]:
        return dict(super().env(), HOME=str(self.cluster.home))

    def launch(self) -> None:
        """Start rabbitmq-server on this node's (possibly existing) dir; don't wait."""
        assert self.base is not None
        with open(self.base / "log" / "stdout.log", "ab") as log:
            self.server = subprocess.Popen(
                [str(RABBITMQ_SERVER)], env=self.env(), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def await_started(self, timeout: float = 90.0) -> None:
        assert self.server is not None
        deadline = time.monotonic() + timeout
        self._await_registered(deadline)
        remaining = max(1, int(deadline - time.monotonic()))
        result = self.ctl("await_startup", "--timeout", str(remaining), timeout=remaining + 15)
        if result.returncode != 0 or self.server.poll() is not None:
            raise RuntimeError(f"RabbitMQ node {self.nodename} did not start:\n"
                               f"{result.stdout}{result.stderr}\n{self._log_tail()}")

    def check(self, *args: str, timeout: float = 60.0) -> str:
        result = self.ctl(*args, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"rabbitmqctl -n {self.nodename} {' '.join(args)}: "
                               f"{result.stdout}{result.stderr}")
        return result.stdout

    def kill(self) -> None:
        """SIGKILL the whole process group (the VM and its helpers): a crash."""
        assert self.server is not None
        try:
            os.killpg(self.server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.server.wait(30)

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server is not None and self.server.poll() is None else None


class RabbitCluster:
    """Three RabbitMQ nodes clustered on loopback; ``with RabbitCluster() as urls: ...``."""

    def __init__(self, size: int = 3) -> None:
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.epmd_port = 0
        self.home = Path()
        self.tmp: Path | None = None
        self.epmd: subprocess.Popen[bytes] | None = None
        self.size = size
        self.nodes: list[ClusterNode] = []

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self) -> list[str]:
        from rabbitmq_ref import free_port

        self.tmp = Path(tempfile.mkdtemp(prefix="brokerha-rabbit-cluster-"))
        self.home = self.tmp / "home"
        self.home.mkdir()
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o400)
        self.epmd_port = free_port()
        try:
            self._start_epmd()
            self.nodes = [ClusterNode(self, "ABCDEFG"[i]) for i in range(self.size)]
            for node in self.nodes:
                node._prepare_dir()
                node.launch()
            for node in self.nodes:
                node.await_started()
            first = self.nodes[0].nodename
            for node in self.nodes[1:]:
                node.check("stop_app")
                node.check("join_cluster", first)
                node.check("start_app")
            running = self.nodes[0].check("cluster_status", "--formatter", "json")
            members = json.loads(running).get("running_nodes", [])
            if len(members) != self.size:
                raise RuntimeError(f"cluster formed with {members}, expected {self.size} nodes")
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _start_epmd(self) -> None:
        epmd = shutil.which("epmd")
        assert epmd is not None
        env = dict(os.environ, HOME=str(self.home), ERL_EPMD_PORT=str(self.epmd_port))
        self.epmd = subprocess.Popen(
            [epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + 10
        while not _port_open(self.epmd_port):
            if self.epmd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"epmd did not start on port {self.epmd_port}")
            time.sleep(0.05)

    def running(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.pid is not None]

    def restart(self, node: ClusterNode) -> None:
        node.launch()
        node.await_started()

    def quorum_status(self, queue: str) -> tuple[str | None, int]:
        """(the node name of the queue's leader, how many members are online), via a live node."""
        for node in self.running():
            result = node.ctl("list_queues", "name", "leader", "online", "--formatter", "json",
                              "--quiet", timeout=30)
            if result.returncode != 0:
                continue
            try:
                rows = json.loads(result.stdout)
            except ValueError:
                continue
            for row in rows:
                if row.get("name") == queue:
                    online = row.get("online") or []
                    return row.get("leader") or None, len(online)
        return None, 0

    def node_named(self, nodename: str) -> ClusterNode:
        return next(n for n in self.nodes if n.nodename == nodename)

    def cpu(self) -> float:
        return sum(sum(tree_cpu_times(pid)) for pid in (n.pid for n in self.nodes) if pid)

    def stop(self) -> None:
        try:
            for node in reversed(self.nodes):
                try:
                    node.stop()  # rabbitmqctl stop, then SIGTERM/SIGKILL; removes its dir
                except Exception as exc:  # noqa: BLE001 - stop the others anyway
                    print(f"warning: stopping {node.nodename}: {exc}", file=sys.stderr)
        finally:
            if self.epmd is not None:
                _stop_process(self.epmd, timeout=5, group=True)
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp = None

    def __enter__(self) -> list[str]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- part 3: the relay's cost --------------------------------------------------------

RELAY_PATHS = ("direct (primary)", "relayed (backup)")


def run_relay(duration: float, warmup: float, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Confirmed msgs/s and confirm latency through the primary and through a backup."""
    figures: dict[str, dict[str, list[float]]] = {
        p: {"msgs_per_s": [], "p50_ms": [], "p99_ms": []} for p in RELAY_PATHS}
    with LocalCluster(3, options=HA_DEFAULTS) as cluster:
        primary = wait_all_ready(cluster)
        backup = next(n for n in cluster.names if n != primary)
        urls = dict(zip(RELAY_PATHS, (cluster.url(primary), cluster.url(backup)), strict=True))
        for r in range(rounds):
            for path in (RELAY_PATHS if r % 2 == 0 else tuple(reversed(RELAY_PATHS))):
                result = asyncio.run(loadgen.run_workload(urls[path], CONFIRM, duration, warmup))
                p50, p99 = confirm_latency_ms(urls[path], min(duration, 3.0))
                for key, value in (("msgs_per_s", result.msgs_per_s), ("p50_ms", p50),
                                   ("p99_ms", p99)):
                    figures[path][key].append(value)
                print(f"  {path:18} {result.msgs_per_s:,.0f} msgs/s, confirm p50 {p50:.2f} ms "
                      f"p99 {p99:.2f} ms", flush=True)
    return figures


def format_relay(figures: dict[str, dict[str, list[float]]]) -> str:
    med = {p: {k: statistics.median(v) if v else None for k, v in f.items()}
           for p, f in figures.items()}
    direct, relayed = (med[p] for p in RELAY_PATHS)
    lines = ["| path | confirmed msgs/s | confirm p50 ms | confirm p99 ms |", "|---|---|---|---|"]
    for path in RELAY_PATHS:
        m = med[path]
        lines.append(f"| {path} | {m['msgs_per_s'] or 0:,.0f} | {m['p50_ms'] or 0:.2f} | "
                     f"{m['p99_ms'] or 0:.2f} |")
    lines.append(f"| relayed / direct | {_ratio(relayed['msgs_per_s'], direct['msgs_per_s'])} | "
                 f"{_ratio(relayed['p50_ms'], direct['p50_ms'])} | "
                 f"{_ratio(relayed['p99_ms'], direct['p99_ms'])} |")
    return "\n".join(lines)


# -- part 1: confirmed throughput ---------------------------------------------------


@dataclass
class Measurement:
    config: str
    results: list[Result] = field(default_factory=list)
    cpu_us_per_msg: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def median(self) -> float | None:
        return statistics.median(r.msgs_per_s for r in self.results) if self.results else None

    def cpu(self) -> float | None:
        return statistics.median(self.cpu_us_per_msg) if self.cpu_us_per_msg else None


def measure(config: str, url: str, workload: Workload, cpu: Callable[[], float],
            duration: float, warmup: float, into: Measurement) -> None:
    marks: dict[str, float] = {}

    def on_window(edge: str) -> None:
        marks[edge] = cpu()

    print(f"  {config:20} confirm loadgen ...", end="", flush=True)
    try:
        result = asyncio.run(loadgen.run_workload(url, workload, duration, warmup,
                                                  on_window=on_window))
    except Exception as exc:  # one failing configuration must not stop the others
        if _terminated:
            raise Terminated(143) from exc
        into.errors.append(f"{type(exc).__name__}: {exc}")
        print(f" error: {into.errors[-1]}", flush=True)
        return
    into.results.append(result)
    messages = result.msgs_per_s * result.duration
    if "start" in marks and "end" in marks and messages:
        into.cpu_us_per_msg.append(1e6 * (marks["end"] - marks["start"]) / messages)
    warn = "".join(f" (WARNING: {n} {what})" for n, what in
                   ((result.nacked, "nacked"), (result.returned, "returned")) if n)
    print(f" {result.msgs_per_s:,.0f} msgs/s{warn}", flush=True)


@contextmanager
def started(config: str) -> Iterator[tuple[str, Workload, Callable[[], float]]]:
    """Start one configuration; yield (url, workload, cpu-seconds of all its processes)."""
    t0 = time.monotonic()
    if config == "RabbitMQ classic":
        ref = RabbitMQRef()
        with ref as url:
            assert ref.server is not None
            pid = ref.server.pid
            print(f"  ({config}: started in {time.monotonic() - t0:.0f} s)", flush=True)
            yield url, CONFIRM, lambda: sum(tree_cpu_times(pid))
    elif config == "brokerha 0 backups":
        node = make_node("ha-bench-solo")
        with node:
            assert node.proc is not None
            pid = node.proc.pid
            yield node.url, CONFIRM, lambda: sum(tree_cpu_times(pid))
    elif config == "brokerha 2 backups":
        with LocalCluster(3, options=HA_DEFAULTS) as cluster:
            primary = wait_all_ready(cluster)
            pids = [n.proc.pid for n in cluster.nodes.values() if n.proc is not None]
            print(f"  ({config}: primary {primary}, backups ready in "
                  f"{time.monotonic() - t0:.0f} s)", flush=True)
            elected = _elections(cluster)
            yield cluster.url(primary), CONFIRM, lambda: sum(sum(tree_cpu_times(p)) for p in pids)
            extra = _elections(cluster) - elected
            print(f"  ({config}: {extra} election(s) during the run"
                  f"{'' if not extra else ': the timeouts are too short for this load'})",
                  flush=True)
    elif config == "RabbitMQ quorum":
        rabbits = RabbitCluster()
        with rabbits as urls:
            print(f"  ({config}: 3-node cluster formed in {time.monotonic() - t0:.0f} s)",
                  flush=True)
            yield urls[0], CONFIRM_QUORUM, rabbits.cpu
    else:
        raise ValueError(config)


def _elections(cluster: LocalCluster) -> int:
    """Elections the nodes recorded (status ``failovers``): a loaded cluster should add none."""
    return sum(1 for name in cluster.names
               for event in (cluster.status(name) or {}).get("failovers", [])
               if event.get("event") == "elected")


def run_throughput(configs: Sequence[str], duration: float, warmup: float,
                   rounds: int) -> dict[str, Measurement]:
    table = {c: Measurement(c) for c in configs}
    for r in range(rounds):
        for config in (configs if r % 2 == 0 else list(reversed(configs))):
            if _terminated:
                raise Terminated(143)
            try:
                with started(config) as (url, workload, cpu):
                    measure(config, url, workload, cpu, duration, warmup, table[config])
            except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
                table[config].errors.append(f"could not start: {exc}")
                print(f"  {config}: could not start: {str(exc)[:2000]}", flush=True)
    return table


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "-"


def format_throughput(table: dict[str, Measurement]) -> str:
    head = ["configuration", "queue", "msgs/s (confirmed, delivered)", "CPU µs/msg (all nodes)"]
    queue = {"RabbitMQ classic": "classic durable, 1 node",
             "brokerha 0 backups": "durable, standalone node",
             "brokerha 2 backups": "durable, primary + 2 backups",
             "RabbitMQ quorum": "quorum, 3 nodes"}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, m in table.items():
        rate = m.median()
        cell = f"{rate:,.0f}" if rate is not None else ("error" if m.errors else "-")
        cpu = m.cpu()
        lines.append(f"| {c} | {queue[c]} | {cell} | {'-' if cpu is None else f'{cpu:.1f}'} |")
    med = {c: m.median() for c, m in table.items()}
    lines += ["", "| ratio | value |", "|---|---|",
              f"| brokerha 2 backups / RabbitMQ quorum | "
              f"{_ratio(med.get('brokerha 2 backups'), med.get('RabbitMQ quorum'))} |",
              f"| brokerha 0 backups / RabbitMQ classic | "
              f"{_ratio(med.get('brokerha 0 backups'), med.get('RabbitMQ classic'))} |",
              f"| brokerha 2 backups / brokerha 0 backups | "
              f"{_ratio(med.get('brokerha 2 backups'), med.get('brokerha 0 backups'))} |",
              f"| RabbitMQ quorum / RabbitMQ classic | "
              f"{_ratio(med.get('RabbitMQ quorum'), med.get('RabbitMQ classic'))} |"]
    return "\n".join(lines)


# -- part 2: the failover gap -------------------------------------------------------

RETRYABLE = (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError,
             pika.exceptions.StreamLostError, ConnectionError, OSError)


def _port(url: str) -> int:
    return int(pika.URLParameters(url).port)


def connect_any(urls: Sequence[str], deadline: float) -> tuple[pika.BlockingConnection, str]:
    """The first URL that accepts a connection (brokerha backups refuse), until ``deadline``."""
    last: BaseException | None = None
    while time.monotonic() < deadline:
        for url in urls:
            params = pika.URLParameters(url)
            params.connection_attempts = 1
            params.socket_timeout = 2
            params.blocked_connection_timeout = 30
            try:
                return pika.BlockingConnection(params), url
            except RETRYABLE as exc:
                last = exc
        time.sleep(0.02)
    raise TimeoutError(f"no node accepted a connection: {last}")


class GapPublisher(threading.Thread):
    """Numbered persistent 1 KiB messages with confirms (one in flight), across ``urls``.

    Records (publish started, confirmed, port) per confirm; a message whose
    confirm did not arrive is sent again on the next connection, as pika
    users do (so duplicates are possible). ``switch_to = url`` asks it to
    reconnect to that URL first (RabbitMQ: to sit on the leader's node).
    """

    def __init__(self, urls: list[str], queue: str, arguments: dict[str, str] | None) -> None:
        super().__init__(daemon=True)
        self.urls, self.queue, self.arguments = urls, queue, arguments
        self.confirms: list[tuple[float, float, int]] = []
        self.confirmed: list[int] = []
        self.reconnects = 0
        self.failures: dict[str, int] = {}  # why connections were dropped, by exception type
        self.current_port: int | None = None
        self.switch_to: str | None = None
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the benchmark
            self.error = exc

    def _run(self) -> None:
        n = 0
        urls = list(self.urls)
        while not self.stop_event.is_set():
            conn, url = connect_any(urls, time.monotonic() + 60)
            self.current_port = _port(url)
            try:
                ch = conn.channel()
                ch.queue_declare(self.queue, durable=True, arguments=self.arguments)
                ch.confirm_delivery()
                while not self.stop_event.is_set():
                    if self.switch_to is not None:
                        want, self.switch_to = self.switch_to, None
                        urls = [want] + [u for u in self.urls if u != want]
                        if _port(want) != self.current_port:
                            break
                    body = str(n).encode().ljust(BODY)
                    sent = time.monotonic()
                    ch.basic_publish("", self.queue, body,
                                     pika.BasicProperties(delivery_mode=2, message_id=str(n)))
                    self.confirms.append((sent, time.monotonic(), self.current_port))
                    self.confirmed.append(n)
                    n += 1
                self.current_port = None
                conn.close()
            except RETRYABLE as exc:
                self.current_port = None
                self.reconnects += 1
                kind = type(exc).__name__
                if isinstance(exc, pika.exceptions.ChannelClosed):
                    kind += f" {exc.reply_code}"
                self.failures[kind] = self.failures.get(kind, 0) + 1
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - the connection is gone anyway
                    pass

    def first_confirm_after(self, t: float) -> tuple[float, int] | None:
        """(confirm time, port) of the first message published after ``t``."""
        first = None
        for sent, confirmed, port in reversed(self.confirms[-5000:]):
            if sent <= t:
                break
            first = (confirmed, port)
        return first

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.error is not None:
                raise RuntimeError(f"publisher failed: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout} s")
            time.sleep(0.005)

    def wait_confirms_on(self, port: int, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` more confirms arrived and the publisher is connected to ``port``."""
        base = len(self.confirms)
        self._wait(lambda: self.current_port == port and len(self.confirms) >= base + count,
                   timeout, f"{count} confirms through port {port}")

    def wait_confirm_after(self, t: float, timeout: float = 60.0) -> tuple[float, int]:
        """(confirm time, port) of the first message published after ``t``, waiting for it."""
        self._wait(lambda: self.first_confirm_after(t) is not None, timeout,
                   "confirm after the kill")
        first = self.first_confirm_after(t)
        assert first is not None
        return first


def drain(urls: Sequence[str], queue: str, arguments: dict[str, str] | None) -> list[int]:
    """Every message left on ``queue`` (auto-ack), as ids."""
    conn, _ = connect_any(urls, time.monotonic() + 60)
    try:
        ch = conn.channel()
        depth = ch.queue_declare(queue, durable=True, arguments=arguments).method.message_count
        ch.basic_qos(prefetch_count=1000)
        got: list[int] = []
        for method, _props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=5):
            if method is None:
                break
            got.append(int(body))
            if len(got) >= depth:
                break
        ch.cancel()
        return got
    finally:
        conn.close()


@dataclass
class Failover:
    broker: str
    gaps: list[float] = field(default_factory=list)  # kill -> first confirm after it
    elections: list[float] = field(default_factory=list)  # kill -> new primary / leader seen
    confirmed: int = 0
    drained: int = 0
    duplicates: int = 0
    lost: int = 0
    reconnects: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    confirm_ms_p50: float | None = None  # publish -> confirm, one in flight, whole run
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def summary(self) -> dict[str, object]:
        return {**self.__dict__, "p50": _p50(self.gaps), "max": max(self.gaps, default=None)}


def _p50(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def wait_all_ready(cluster: LocalCluster, timeout: float = 60.0) -> str:
    primary = cluster.wait_primary(timeout)
    for name in cluster.names:
        if name != primary:
            cluster.wait_ready(name, timeout)
    return primary


KILL_ERRORS = (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError)


def _finish(result: Failover, pub: GapPublisher, urls: list[str], queue: str,
            arguments: dict[str, str] | None) -> None:
    pub.stop_event.set()
    pub.join(60)
    if pub.error is not None:
        result.notes.append(f"publisher error: {pub.error!r}")
    got = drain(urls, queue, arguments)
    result.confirmed = len(pub.confirmed)
    result.drained = len(got)
    result.duplicates = len(got) - len(set(got))
    result.lost = len(set(pub.confirmed) - set(got))
    result.reconnects = pub.reconnects
    result.failures = dict(pub.failures)
    latencies = sorted(c - p for p, c, _ in pub.confirms)
    result.confirm_ms_p50 = 1e3 * statistics.median(latencies) if latencies else None


def _print_kill(i: int, gap: float, election: float, port: int) -> None:
    print(f"    kill {i + 1}: new primary/leader seen after {election:.2f} s, first confirm "
          f"after {gap:.3f} s (port {port})", flush=True)


def failover_brokerha(kills: int, hang: bool = False) -> Failover:
    """SIGKILL the primary ``kills`` times; with ``hang``, SIGSTOP it instead (no socket closes).

    A stopped primary is resumed once its successor serves: it finds itself
    deposed and rejoins as a backup. Its clients' sockets stay open, so a
    client on the hung node notices only by its own heartbeat; the publisher
    therefore sits on a backup's address (relayed), whose relay ends when the
    primary changes, and the gap is what a client of any other node sees.
    """
    result = Failover("brokerha, SIGSTOP" if hang else "brokerha")
    queue = f"ha-gap-{uuid.uuid4().hex[:8]}"
    print(f"{result.broker}: 3-node LocalCluster with docs/ha.md's default timeouts "
          f"{HA_DEFAULTS} ...", flush=True)
    with LocalCluster(3, options=HA_DEFAULTS) as cluster:
        primary = wait_all_ready(cluster)
        pub = GapPublisher(cluster.urls, queue, None)
        pub.start()
        try:
            for i in range(kills):
                # any node relays to the primary: sit on the primary itself, so the kill
                # ends the publisher's own connection (as RabbitMQ's leader below)
                seat = next(n for n in cluster.names if n != primary) if hang else primary
                pub.switch_to = cluster.url(seat)
                pub.wait_confirms_on(cluster.port(seat), 200)
                killed_at = time.monotonic()
                if hang:
                    cluster.pause(primary)
                else:
                    cluster.kill(primary)
                try:
                    new = cluster.wait_primary(60, other_than=primary)
                    seen = time.monotonic() - killed_at
                    first = pub.wait_confirm_after(killed_at)
                finally:
                    if hang:
                        cluster.resume(primary)
                result.gaps.append(first[0] - killed_at)
                result.elections.append(seen)
                _print_kill(i, result.gaps[-1], seen, first[1])
                if not hang and first[1] != cluster.port(new):
                    result.notes.append(f"kill {i + 1}: first confirm on port {first[1]}, "
                                        f"the new primary is {new} ({cluster.port(new)})")
                if not hang:
                    cluster.restart(primary)  # comes back as a backup
                cluster.wait_ready(primary, 120)
                primary = new
        except KILL_ERRORS as exc:  # keep the gaps measured so far; still drain and compare
            result.error = f"after {len(result.gaps)} kill(s): {type(exc).__name__}: {exc}"[:3000]
            print(f"  brokerha: {result.error}", flush=True)
        finally:
            _finish(result, pub, cluster.urls, queue, None)
    return result


def failover_rabbitmq(kills: int) -> Failover:
    result = Failover("RabbitMQ quorum")
    queue = f"ha-gap-{uuid.uuid4().hex[:8]}"
    arguments = {"x-queue-type": "quorum"}
    print("RabbitMQ: 3-node cluster, quorum queue ...", flush=True)
    rabbits = RabbitCluster()
    with rabbits as urls:
        by_name = {n.nodename: n for n in rabbits.nodes}
        pub = GapPublisher(urls, queue, arguments)
        pub.start()
        try:
            for i in range(kills):
                deadline = time.monotonic() + 120
                leader, online = rabbits.quorum_status(queue)
                while (leader not in by_name or online < len(rabbits.nodes)) \
                        and time.monotonic() < deadline:
                    time.sleep(0.5)
                    leader, online = rabbits.quorum_status(queue)
                if leader not in by_name or online < len(rabbits.nodes):
                    raise TimeoutError(f"quorum queue not back to {len(rabbits.nodes)} members "
                                       f"online: leader {leader}, {online} online")
                node = by_name[leader]
                pub.switch_to = node.url
                pub.wait_confirms_on(node.port, 200)
                killed_at = time.monotonic()
                node.kill()
                first = pub.wait_confirm_after(killed_at)
                new_leader, _ = rabbits.quorum_status(queue)
                seen = time.monotonic() - killed_at  # an upper bound: rabbitmqctl is slow
                result.gaps.append(first[0] - killed_at)
                result.elections.append(seen)
                _print_kill(i, result.gaps[-1], seen, first[1])
                print(f"      (new leader {new_leader})", flush=True)
                rabbits.restart(node)
        except KILL_ERRORS as exc:  # keep the gaps measured so far; still drain and compare
            result.error = f"after {len(result.gaps)} kill(s): {type(exc).__name__}: {exc}"[:3000]
            print(f"  RabbitMQ: {result.error}", flush=True)
        finally:
            _finish(result, pub, urls, queue, arguments)
    result.notes.append("'new leader seen' is when rabbitmqctl list_queues answered after the "
                        "first confirm: an upper bound, not the election time")
    return result


def format_failover(results: Sequence[Failover]) -> str:
    head = ["broker", "kills", "gap p50 s", "gap max s", "gaps s", "confirmed", "drained",
            "duplicates", "confirmed but lost", "publish→confirm p50 ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if r.error and not r.gaps:
            lines.append(f"| {r.broker} | error (see below) |" + " - |" * (len(head) - 2))
            continue
        p50, top = _p50(r.gaps), max(r.gaps, default=None)
        lines.append(
            f"| {r.broker} | {len(r.gaps)} | {'-' if p50 is None else f'{p50:.2f}'} | "
            f"{'-' if top is None else f'{top:.2f}'} | "
            f"{', '.join(f'{g:.2f}' for g in r.gaps)} | {r.confirmed:,} | {r.drained:,} | "
            f"{r.duplicates:,} | **{r.lost}** | "
            f"{'-' if r.confirm_ms_p50 is None else f'{r.confirm_ms_p50:.1f}'} |")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------


class Terminated(SystemExit):
    """SIGTERM: unwinds through every ``finally``, so everything started is stopped."""


_terminated = False


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    global _terminated
    _terminated = True
    raise Terminated(128 + signum)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run")
    p.add_argument("--rounds", type=int, default=1,
                   help="throughput runs per configuration (each starts it afresh); median shown")
    p.add_argument("--kills", type=int, default=5, help="primary / leader kills per broker")
    p.add_argument("--no-rabbitmq", action="store_true", help="brokerha only")
    p.add_argument("--no-rabbitmq-failover", action="store_true",
                   help="skip RabbitMQ's failover-gap measurement")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-failover", action="store_true")
    p.add_argument("--skip-relay", action="store_true", help="leave out part 3 (relay cost)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write all results as JSON")
    args = p.parse_args(argv)
    if not 0 < args.duration <= 120 or not 1 <= args.rounds <= 10 or not 0 <= args.kills <= 50:
        p.error("keep runs bounded: 0 < --duration <= 120, 1 <= --rounds <= 10, "
                "0 <= --kills <= 50")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    loadgen.selftest()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    rabbit = not args.no_rabbitmq and available()
    if not args.no_rabbitmq and not rabbit:
        print("rabbitmq-server is not installed: brokerha only", flush=True)
    started_at = datetime.now(UTC)
    loads = [os.getloadavg()[0]]
    table: dict[str, Measurement] = {}
    failovers: list[Failover] = []
    t0 = time.monotonic()
    if not args.skip_throughput:
        configs = [c for c in CONFIGS if rabbit or not c.startswith("RabbitMQ")]
        print(f"confirmed throughput: {len(configs)} configurations, one at a time, "
              f"{args.duration:g} s each (+{args.warmup:g} s warm-up), "
              f"{args.rounds} round(s)", flush=True)
        table = run_throughput(configs, args.duration, args.warmup, args.rounds)
        loads.append(os.getloadavg()[0])
    relay: dict[str, dict[str, list[float]]] = {}
    if not args.skip_relay:
        print(f"\nrelay cost: direct and through a backup, {args.duration:g} s each, "
              f"{args.rounds} round(s)", flush=True)
        relay = run_relay(args.duration, args.warmup, args.rounds)
        loads.append(os.getloadavg()[0])
    if not args.skip_failover and args.kills:
        print(f"\nfailover gap: {args.kills} kills per broker", flush=True)
        runs: list[tuple[str, Callable[[int], Failover]]] = [
            ("brokerha", failover_brokerha),
            ("brokerha, SIGSTOP", lambda kills: failover_brokerha(kills, hang=True))]
        if rabbit and not args.no_rabbitmq_failover:
            runs.append(("RabbitMQ quorum", failover_rabbitmq))
        for name, run in runs:
            try:
                failovers.append(run(args.kills))
            except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError,
                    AssertionError) as exc:
                failovers.append(Failover(name, error=f"{type(exc).__name__}: {exc}"[:2000]))
                print(f"  {name}: {failovers[-1].error}", flush=True)
            loads.append(os.getloadavg()[0])
    elapsed = time.monotonic() - t0
    print(f"\nHA benchmark, {started_at:%Y-%m-%d %H:%M} UTC, {elapsed:.0f} s in all; "
          f"{os.cpu_count()} CPUs, load average {min(loads):.2f}-{max(loads):.2f} "
          f"(1-minute, sampled between phases)")
    if table:
        print(f"\nConfirmed persistent throughput (loadgen `confirm`: 1 KiB, window 256, "
              f"manual-ack consumer), median of {args.rounds} run(s) of {args.duration:g} s:\n")
        print(format_throughput(table))
        for c, m in table.items():
            for e in m.errors:
                print(f"error: {c}: {e[:500]}")
    if relay:
        print(f"\nRelay cost (any node is an entry point): loadgen `confirm` and pika "
              f"publish-to-confirm latency, one in flight; median of {args.rounds} run(s):\n")
        print(format_relay(relay))
    if failovers:
        print(f"\nFailover gap: SIGKILL of the node the pika publisher (confirms, one in "
              f"flight) is connected to, {args.kills} times; gap = kill -> first confirm of "
              f"a message published after the kill:\n")
        print(format_failover(failovers))
        for r in failovers:
            if r.elections:
                print(f"{r.broker}: new primary/leader seen after "
                      f"{', '.join(f'{e:.2f}' for e in r.elections)} s; "
                      f"{r.reconnects} reconnects ({r.failures})")
            for note in r.notes:
                print(f"{r.broker}: {note}")
            if r.error:
                print(f"{r.broker}: error: {r.error[:200]} ... {r.error[-600:]}")
    if args.json:
        args.json.write_text(json.dumps({
            "started": started_at.isoformat(), "load_average": loads,
            "throughput": {c: {"msgs_per_s": m.median(), "cpu_us_per_msg": m.cpu(),
                               "results": [r.to_dict() for r in m.results], "errors": m.errors}
                           for c, m in table.items()},
            "failover": [r.summary() for r in failovers], "relay": relay}, indent=2))
    bad = any(m.errors for m in table.values()) or any(r.error or r.lost for r in failovers)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
