"""Three real nodes running partition groups (issue 35): the options, the ctl calls,
the groups' leaders read from the nodes' status, queue names of a given partition,
and a windowed publisher with confirms -- shared by the partition groups',
forwarding, balance and check-replicas tests; and the four-node layout (P4 = 4, NR = 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import pika
import pytest

from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster
from tests.failover.test_failover import FAST

OPTIONS: dict[str, float | str | bool] = {**FAST, "partitions": 3, "partition_groups": True}
GROUPS = ["0", "1", "2", "3"]  # the metadata group and partitions 0..2


def ctl(cluster: LocalCluster, name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           cluster.url(name), *args], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def promote(cluster: LocalCluster, name: str, target: str, partition: int) -> bool:
    done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           cluster.url(name), "promote", target, "--partition", str(partition)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 or "409" in done.stderr or "ready" in done.stderr, done.stderr
    return done.returncode == 0


def ctl_status(cluster: LocalCluster, name: str) -> dict[str, Any]:
    return dict(json.loads(ctl(cluster, name, "status", "--json")))


def led(cluster: LocalCluster, names: list[str]) -> dict[str, list[str]]:
    """Per group, the nodes among ``names`` that serve it now (their own status)."""
    out: dict[str, list[str]] = {g: [] for g in GROUPS}
    for name in names:
        status = cluster.status(name)
        for group, g in ((status or {}).get("node", {}).get("groups") or {}).items():
            if g["serving"]:
                out[group].append(name)
    return out


def leader(cluster: LocalCluster, names: list[str], group: str) -> str | None:
    """The first of ``names`` that serves ``group`` now (its own status), or None."""
    return next(iter(led(cluster, names)[group]), None)


def ready_everywhere(cluster: LocalCluster, names: list[str]) -> bool:
    for name in names:
        groups = (cluster.status(name) or {}).get("node", {}).get("groups") or {}
        if sorted(groups) != GROUPS or not all(g["ready"] for g in groups.values()):
            return False
    return True


def until(what: str, check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.05)


def one_leader_each(cluster: LocalCluster, names: list[str]) -> dict[str, str] | None:
    serving = led(cluster, names)
    if all(len(nodes) == 1 for nodes in serving.values()):
        return {g: nodes[0] for g, nodes in serving.items()}
    return None


class Layout(NamedTuple):
    """Three nodes each leading one partition: A the metadata primary, B and C the two
    others (sorted); ``leaders`` group -> node, ``partitions`` node -> its partitions."""

    leaders: dict[str, str]
    a: str
    b: str
    c: str
    partitions: dict[str, list[int]]


def one_partition_each(cluster: LocalCluster) -> Layout:
    """Once every group has one serving primary and every node is ready in every group:
    the layout (the test is skipped when the leaders are not one partition a node)."""
    names = cluster.names
    leaders = until("one serving primary per group", lambda: one_leader_each(cluster, names))
    until("every node ready in every group", lambda: ready_everywhere(cluster, names))
    by_node: dict[str, list[int]] = {}
    for p in range(3):
        by_node.setdefault(leaders[str(p + 1)], []).append(p)
    if len(by_node) < 3:
        pytest.skip(f"the partitions' leaders are not one a node: {leaders}")
    a = leaders["0"]
    b, c = sorted(n for n in names if n != a)
    return Layout(leaders, a, b, c, by_node)


def name_in(partition: int, prefix: str) -> str:
    """A queue name of ``prefix`` hashing into ``partition`` (P = 3, vhost /)."""
    return next(f"{prefix}-{i}" for i in range(1000)
                if hash_partition("/", f"{prefix}-{i}", 3) == partition)


def connect(cluster: LocalCluster, node: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(cluster.url(node)))


def passive(cluster: LocalCluster, node: str, queue: str) -> str:
    """A passive declare of ``queue`` on ``node``: "ok", or the channel's close as
    "CODE TEXT" (405 for another connection's exclusive queue, 404 for none)."""
    conn = connect(cluster, node)
    try:
        conn.channel().queue_declare(queue, passive=True)
        return "ok"
    except pika.exceptions.ChannelClosedByBroker as exc:
        return f"{exc.reply_code} {exc.reply_text}"
    finally:
        if conn.is_open:
            conn.close()


def depth(cluster: LocalCluster, node: str, queue: str) -> int:
    """The queue's message count as ``node`` answers a passive declare."""
    return counts(cluster, node, queue)[0]


def consumers_on(cluster: LocalCluster, node: str, queue: str) -> int:
    """The queue's consumer count as ``node`` answers a passive declare."""
    return counts(cluster, node, queue)[1]


def counts(cluster: LocalCluster, node: str, queue: str) -> tuple[int, int]:
    conn = connect(cluster, node)
    try:
        ok = conn.channel().queue_declare(queue, passive=True).method
        return int(ok.message_count), int(ok.consumer_count)
    finally:
        conn.close()


def props(i: int) -> pika.BasicProperties:
    return pika.BasicProperties(delivery_mode=2, message_id=str(i))


class StreamPublisher(threading.Thread):
    """A pika ``SelectConnection`` publishing with confirms, up to ``window`` unconfirmed
    (``BlockingChannel`` waits for each ack): message i (its ``message_id``) to the
    queue ``queue_of(i)``; ``acked`` and ``nacked`` ids, ``closed`` the reason the
    connection or channel was closed by anything but ``finish``."""

    def __init__(self, url: str, queue_of: Any, window: int = 64) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.queue_of = queue_of
        self.window = window
        self.acked: list[int] = []
        self.nacked: list[int] = []
        self.closed: BaseException | str | None = None
        self.outstanding: dict[int, int] = {}  # delivery tag -> id
        self.next_id = 0
        self.stopping = threading.Event()
        self.done = threading.Event()
        self._finishing = False

    def run(self) -> None:
        self.conn = pika.SelectConnection(
            pika.URLParameters(self.url), on_open_callback=self._opened,
            on_open_error_callback=self._failed, on_close_callback=self._conn_closed)
        self.conn.ioloop.start()
        self.done.set()

    def _failed(self, _conn: Any, exc: BaseException) -> None:
        self.closed = exc
        self.conn.ioloop.stop()

    def _conn_closed(self, _conn: Any, reason: BaseException) -> None:
        if not self._finishing:
            self.closed = reason
        self.conn.ioloop.stop()

    def _opened(self, conn: Any) -> None:
        conn.channel(on_open_callback=self._channel)

    def _channel(self, ch: Any) -> None:
        self.ch = ch
        ch.add_on_close_callback(self._channel_closed)
        ch.confirm_delivery(self._confirm, callback=lambda _frame: self._pump())
        self.conn.ioloop.call_later(0.05, self._watch)

    def _channel_closed(self, _ch: Any, reason: BaseException) -> None:
        if not self._finishing:
            self.closed = reason
            if self.conn.is_open:
                self.conn.close()

    def _confirm(self, frame: Any) -> None:
        method = frame.method
        ack = isinstance(method, pika.spec.Basic.Ack)
        tags = [t for t in self.outstanding if t <= method.delivery_tag] if method.multiple \
            else [method.delivery_tag]
        for tag in tags:
            (self.acked if ack else self.nacked).append(self.outstanding.pop(tag))
        self._pump()

    def _pump(self) -> None:
        while not self.stopping.is_set() and len(self.outstanding) < self.window:
            i = self.next_id
            self.next_id += 1
            self.outstanding[i + 1] = i  # delivery tags count from 1 after confirm.select
            self.ch.basic_publish("", self.queue_of(i), b"x", props(i))

    def _watch(self) -> None:
        if self.stopping.is_set() and not self.outstanding:
            self._finishing = True
            self.conn.close()
            return
        self.conn.ioloop.call_later(0.05, self._watch)

    def finish(self, timeout: float = 20.0) -> None:
        """Stop publishing; wait until every publish is answered (or the connection gone)."""
        self.stopping.set()
        self.done.wait(timeout)


def drained(cluster: LocalCluster, node: str, queue: str) -> list[tuple[Any, bytes]]:
    """Every message in ``queue`` on ``node``, in order, taken: (properties, body)."""
    conn = connect(cluster, node)
    try:
        ch = conn.channel()
        got = []
        while True:
            method, properties, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                return got
            got.append((properties, body))
    finally:
        conn.close()


def drain_ids(cluster: LocalCluster, node: str, queue: str) -> list[str]:
    """The message ids in ``queue`` on ``node``, in order (taken)."""
    return [str(properties.message_id) for properties, _ in drained(cluster, node, queue)]


# -- four nodes, P4 = 4 partitions, NR = 2: each partition on three nodes, each node outside
# one (the drain's, the queue directory's, the stand-ins' and the management get's tests)

P4 = 4
FOUR_OPTIONS: dict[str, float | str | bool] = {**OPTIONS, "partitions": P4,
                                               "partition_replicas": 2}


def groups_of(cluster: LocalCluster, name: str) -> dict[str, Any]:
    return dict(((cluster.status(name) or {}).get("node") or {}).get("groups") or {})


def leaders(cluster: LocalCluster, names: list[str]) -> dict[str, tuple[str, int]] | None:
    """Group -> (its one serving leader, epoch), once every group has exactly one (P4)."""
    serving: dict[str, list[tuple[str, int]]] = {}
    for name in names:
        for group, g in groups_of(cluster, name).items():
            if g["serving"]:
                serving.setdefault(group, []).append((name, int(g["epoch"])))
    if len(serving) != P4 + 1 or any(len(v) != 1 for v in serving.values()):
        return None
    return {g: v[0] for g, v in serving.items()}


def settled(cluster: LocalCluster, names: list[str]) -> bool:
    """Every node ready in each group it runs, and every cell's group running."""
    for name in names:
        groups = groups_of(cluster, name)
        if not groups or not all(g["ready"] for g in groups.values()):
            return False
    return leaders(cluster, names) is not None


def settled_leaders(cluster: LocalCluster, timeout: float = 60) -> dict[str, tuple[str, int]]:
    """``leaders`` of the whole cluster once it is ``settled``."""
    until("one serving leader per group, every node ready",
          lambda: settled(cluster, cluster.names), timeout=timeout)
    lead = leaders(cluster, cluster.names)
    assert lead is not None
    return lead


def table(cluster: LocalCluster, name: str) -> dict[str, Any]:
    """``ctl partitions --json`` asked of ``name``."""
    return dict(json.loads(ctl(cluster, name, "partitions", "--json")))


def cells_of(cluster: LocalCluster, node: str) -> dict[int, list[str]]:
    """Partition -> the nodes holding a cell of it (``table``)."""
    rows = table(cluster, node)["rows"]
    return {r["partition"]: [c[0] for c in r["cells"]] for r in rows}


def queue_in(partition: int, prefix: str) -> str:
    """A queue name of ``prefix`` hashing into ``partition`` (P4, vhost /)."""
    return next(f"{prefix}-{i}" for i in range(1000)
                if hash_partition("/", f"{prefix}-{i}", P4) == partition)


class Outside(NamedTuple):
    """A settled four-node cluster's ``leaders`` and ``cells``, and X: a node outside
    partition p's cells that leads some group (a node leading none relays its clients to
    the metadata primary), with p's leader."""

    lead: dict[str, tuple[str, int]]
    cells: dict[int, list[str]]
    x: str
    p: int
    leader: str


def outside_a_partition(cluster: LocalCluster) -> Outside:
    lead = settled_leaders(cluster)
    cells = cells_of(cluster, lead["0"][0])
    leading = {v[0] for v in lead.values()}
    x, p = next((n, q) for q in range(P4) for n in cluster.names
                if n not in cells[q] and n in leading)
    return Outside(lead, cells, x, p, lead[str(p + 1)][0])


class DeclaringStreams:
    """A client on each of ``nodes`` declaring in a loop -- ``declare(channel, node, i)``,
    i = 1, 2, ... per node -- until ``stop``: a connection refused is tried again 0.1 s
    later; one closed by an error is noted in ``closed`` and opened again (the
    coordinator-killed tests: every declare answered ok must stay true)."""

    def __init__(self, cluster: LocalCluster, nodes: list[str],
                 declare: Callable[[Any, str, int], None]) -> None:
        self.cluster = cluster
        self.declare = declare
        self.closed: list[str] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._stream, args=(n,), daemon=True)
                        for n in nodes]
        for t in self.threads:
            t.start()

    def _stream(self, node: str) -> None:
        i = 0
        while not self.stopping.is_set():
            try:
                conn = connect(self.cluster, node)
            except pika.exceptions.AMQPError:
                time.sleep(0.1)
                continue
            try:
                ch = conn.channel()
                while not self.stopping.is_set():
                    i += 1
                    self.declare(ch, node, i)
            except pika.exceptions.AMQPError as exc:
                self.closed.append(f"{node}: {exc!r}")
            finally:
                if conn.is_open:
                    try:
                        conn.close()
                    except pika.exceptions.AMQPError:
                        pass

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=30)
