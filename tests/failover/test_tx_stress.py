"""TX stress through repeated primary SIGKILLs: transactional publishers AND consumers, numbered.

Three real nodes (short timeouts). While the primary is SIGKILLed again and
again (each killed node restarted and ready before the next kill):

- publishers send numbered messages (``P:n:tx-id``) in transactions of random
  size 1-10 (or a fixed size), each named with ``x-tx-id``. A commit whose
  connection dropped is asked about with ``tx-outcome``; when it did not
  commit, the next transaction resends the same numbers under a new id, so
  each publisher's committed sequence is 0..N-1 with no gap (Qpid's numbered
  traffic);
- consumers (``basic_get`` or ``basic_consume``) take 1-10 messages, ack them
  and publish a receipt (to a second queue, named with ``x-tx-id``) in one
  transaction, then ``tx.commit``; a lost connection loses the un-committed
  acks and the messages come back (redelivery allowed);
- with fixed-size transactions and no consumers, a second connection polls
  the queue depth (``queue.declare`` passive) and must only ever see
  multiples of the transaction size, also on each new primary.

Afterwards every node is stopped and its store read back. On each node: every
committed message (commit-ok, or ``tx-outcome`` said ``committed``) was
consumed by exactly one committed consumer transaction or is still queued,
exactly once; no message of a rolled-back, unknown or lost transaction was
ever delivered or stored; every committed consumer transaction's receipt is
stored exactly once and no other; each in-doubt transaction's effects agree
with its ``tx-outcome`` answer.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pika
import pytest

from brokerha.testing import LocalCluster
from tests.failover.clients import RETRYABLE, connect_any, stop_all_and_read
from tests.failover.test_failover import FAST, wait_all_ready
from tests.failover.test_tx_failover import ask_outcome

QUEUE = "ha-tx-stress"
RECEIPTS = "ha-tx-receipts"
pytestmark = pytest.mark.timeout(600)


@dataclass
class TxRecord:
    tx_id: str
    items: list[str] = field(default_factory=list)  # "P:n" keys published, or acked
    state: str = "open"  # open -> committing -> committed | in-doubt | lost
    outcome: str | None = None  # tx-outcome's answer, for in-doubt (and lost) ones

    @property
    def committed(self) -> bool:
        return self.state == "committed" or (self.state == "in-doubt"
                                             and self.outcome == "committed")


def declare(ch: pika.adapters.blocking_connection.BlockingChannel) -> None:
    ch.queue_declare(QUEUE, durable=True)
    ch.queue_declare(RECEIPTS, durable=True)


class TxWorker(threading.Thread):
    """A reconnecting loop of transactions; subclasses do one transaction at a time."""

    def __init__(self, urls: list[str], name: str, seed: int, size: int | None) -> None:
        super().__init__(daemon=True, name=name)
        self.urls, self.label, self.size = urls, name, size
        self.rng = random.Random(seed)
        self.txs: list[TxRecord] = []
        self.reconnects = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.attempt = 0

    @property
    def commits(self) -> int:
        return sum(1 for t in self.txs if t.state == "committed")

    def new_tx(self) -> TxRecord:
        self.attempt += 1
        rec = TxRecord(f"{self.label}-{self.attempt}")
        self.txs.append(rec)
        return rec

    def tx_size(self) -> int:
        return self.size or self.rng.randint(1, 10)

    def resolve(self, conn: pika.BlockingConnection) -> None:
        """Ask the (new) primary about every commit that was in flight when a connection dropped."""
        for rec in self.txs:
            if rec.state == "in-doubt" and rec.outcome is None:
                rec.outcome = ask_outcome(conn, rec.tx_id, timeout=30)
                self.resolved(rec)

    def resolved(self, rec: TxRecord) -> None:
        """Hook: an in-doubt transaction's outcome is known."""

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                conn = connect_any(self.urls, time.monotonic() + 30)
                try:
                    self.resolve(conn)
                    ch = conn.channel()
                    declare(ch)
                    ch.tx_select()
                    self.session(conn, ch)
                    conn.close()
                except RETRYABLE:
                    self.reconnects += 1
                    for rec in self.txs[-1:]:
                        if rec.state == "committing":
                            rec.state = "in-doubt"
                        elif rec.state == "open":
                            rec.state = "lost"
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001 - the connection is gone anyway
                        pass
        except BaseException as exc:  # reported to the test
            self.error = exc

    def session(self, conn: pika.BlockingConnection,
                ch: pika.adapters.blocking_connection.BlockingChannel) -> None:
        raise NotImplementedError

    def commit(self, ch: pika.adapters.blocking_connection.BlockingChannel, rec: TxRecord) -> None:
        rec.state = "committing"
        ch.tx_commit()
        rec.state = "committed"


class NumberedTxPublisher(TxWorker):
    """Transactions of numbered messages; a transaction that did not commit is resent."""

    def __init__(self, urls: list[str], name: str, seed: int, size: int | None) -> None:
        super().__init__(urls, name, seed, size)
        self.next_n = 0

    def resolved(self, rec: TxRecord) -> None:
        if rec.outcome == "committed":  # only the last transaction can be in doubt
            self.next_n = max(self.next_n, int(rec.items[-1].split(":")[1]) + 1)

    def session(self, conn: pika.BlockingConnection,
                ch: pika.adapters.blocking_connection.BlockingChannel) -> None:
        while not self.stop_event.is_set():
            rec = self.new_tx()
            rec.items = [f"{self.label}:{n}" for n in range(self.next_n, self.next_n + self.tx_size())]
            for key in rec.items:
                ch.basic_publish("", QUEUE, f"{key}:{rec.tx_id}".encode(),
                                 pika.BasicProperties(delivery_mode=2,
                                                      headers={"x-tx-id": rec.tx_id}))
            self.commit(ch, rec)
            self.next_n += len(rec.items)


class TxConsumer(TxWorker):
    """Takes up to N messages, acks them and publishes a receipt, all in one transaction."""

    def __init__(self, urls: list[str], name: str, seed: int, size: int | None,
                 mode: str) -> None:
        super().__init__(urls, name, seed, size)
        self.mode = mode  # "get" (basic_get) or "consume" (basic_consume, prefetch 20)
        self.deliveries: list[bytes] = []  # every body ever delivered, committed or not

    def session(self, conn: pika.BlockingConnection,
                ch: pika.adapters.blocking_connection.BlockingChannel) -> None:
        stream = None
        if self.mode == "consume":
            ch.basic_qos(prefetch_count=20)
            stream = ch.consume(QUEUE, inactivity_timeout=0.1)
        while not self.stop_event.is_set():
            want, got = self.tx_size(), []
            idle_until = time.monotonic() + 0.3
            while len(got) < want and time.monotonic() < idle_until:
                if stream is not None:
                    method, _, body = next(stream)
                else:
                    method, _, body = ch.basic_get(QUEUE)
                    if method is None:
                        time.sleep(0.01)
                if method is not None:
                    self.deliveries.append(body)
                    got.append((method.delivery_tag, body))
            if not got:
                continue
            rec = self.new_tx()
            rec.items = [":".join(b.decode().split(":")[:2]) for _, b in got]
            if stream is not None:
                ch.basic_ack(got[-1][0], multiple=True)
            else:
                for tag, _ in got:
                    ch.basic_ack(tag)
            ch.basic_publish("", RECEIPTS, json.dumps({"tx": rec.tx_id, "acked": rec.items}).encode(),
                             pika.BasicProperties(delivery_mode=2, headers={"x-tx-id": rec.tx_id}))
            self.commit(ch, rec)


class DepthPoller(threading.Thread):
    """A second connection: queue depth, over and over, across failovers."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.depths: list[tuple[int, int]] = []  # (connection number, depth)
        self.connections = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                conn = connect_any(self.urls, time.monotonic() + 30)
                self.connections += 1
                try:
                    ch = conn.channel()
                    while not self.stop_event.is_set():
                        depth = ch.queue_declare(QUEUE, durable=True, passive=True).method.message_count
                        self.depths.append((self.connections, depth))
                        time.sleep(0.002)
                    conn.close()
                except RETRYABLE:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001 - the connection is gone anyway
                        pass
        except BaseException as exc:  # reported to the test
            self.error = exc


@dataclass
class Stress:
    publishers: list[NumberedTxPublisher]
    consumers: list[TxConsumer]
    poller: DepthPoller | None
    kills: int = 0

    @property
    def workers(self) -> list[TxWorker]:
        return [*self.publishers, *self.consumers]

    def check_errors(self) -> None:
        for w in self.workers:
            assert w.error is None, (w.label, w.error)
        assert self.poller is None or self.poller.error is None, self.poller.error


def wait_progress(stress: Stress, commits: int, timeout: float = 30.0) -> None:
    """Until every publisher committed ``commits`` more transactions."""
    base = [p.commits for p in stress.publishers]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stress.check_errors()
        if all(p.commits >= b + commits for p, b in zip(stress.publishers, base, strict=True)):
            return
        time.sleep(0.02)
    raise AssertionError(f"no progress within {timeout} s: "
                         f"{[(p.label, p.commits, p.reconnects) for p in stress.publishers]}")


def run_stress(cluster: LocalCluster, *, kills: int, seed: int, publishers: int = 2,
               consumers: tuple[str, ...] = ("get", "consume"), size: int | None = None,
               poll_depth: bool = False) -> Stress:
    rng = random.Random(seed)
    primary = wait_all_ready(cluster)
    conn = connect_any(cluster.urls, time.monotonic() + 10)
    declare(conn.channel())
    conn.close()
    stress = Stress(
        [NumberedTxPublisher(cluster.urls, f"p{i}", seed * 100 + i, size) for i in range(publishers)],
        [TxConsumer(cluster.urls, f"c{i}", seed * 100 + 50 + i, size, mode)
         for i, mode in enumerate(consumers)],
        DepthPoller(cluster.urls) if poll_depth else None)
    for w in stress.workers:
        w.start()
    if stress.poller is not None:
        stress.poller.start()
    for _ in range(kills):
        wait_progress(stress, 10)
        time.sleep(rng.random() * 0.1)
        cluster.kill(primary)
        stress.kills += 1
        new_primary = cluster.wait_primary(30, other_than=primary)
        cluster.restart(primary)
        cluster.wait_ready(primary, 30)
        primary = new_primary
    wait_progress(stress, 5)
    for p in stress.publishers:
        p.stop_event.set()
    for p in stress.publishers:
        p.join(60)
    time.sleep(0.5)  # the consumers take some more
    for w in stress.consumers:
        w.stop_event.set()
    for w in stress.consumers:
        w.join(60)
    if stress.poller is not None:
        stress.poller.stop_event.set()
        stress.poller.join(30)
    stress.check_errors()
    assert not any(w.is_alive() for w in stress.workers), "a client loop did not stop"
    # what is still in doubt (and what was lost before its commit) is asked on a new connection
    conn = connect_any(cluster.urls, time.monotonic() + 30)
    for w in stress.workers:
        for rec in w.txs:
            if rec.state in ("in-doubt", "lost") and rec.outcome is None:
                rec.outcome = ask_outcome(conn, rec.tx_id, timeout=30)
                w.resolved(rec)
    conn.close()
    wait_all_ready(cluster)
    time.sleep(0.5)  # the last acknowledgements
    return stress


def committed_bodies(stress: Stress) -> dict[str, bytes]:
    """key "P:n" -> the one body of it that is committed; checks the numbering has no gap."""
    bodies: dict[str, bytes] = {}
    for p in stress.publishers:
        for rec in p.txs:
            assert rec.state != "open" and rec.state != "committing", (rec, "unfinished")
            if rec.state == "lost":
                assert rec.outcome != "committed", (rec, "committed without tx.commit")
            if rec.state == "in-doubt":
                assert rec.outcome in ("committed", "rolled back", "unknown"), rec
            if rec.committed:
                for key in rec.items:
                    assert key not in bodies, (key, "committed twice by the publisher")
                    bodies[key] = f"{key}:{rec.tx_id}".encode()
        numbers = sorted(int(k.split(":")[1]) for k in bodies if k.startswith(f"{p.label}:"))
        assert numbers == list(range(len(numbers))), (p.label, "publisher's own sequence has a gap")
    return bodies


def check(stress: Stress, stores: dict[str, dict[str, list[bytes]]]) -> dict[str, int]:
    expected = committed_bodies(stress)
    consumer_txs = [rec for c in stress.consumers for rec in c.txs]
    for rec in consumer_txs:
        if rec.state == "lost":
            assert rec.outcome != "committed", (rec, "committed without tx.commit")
        if rec.state == "in-doubt":
            assert rec.outcome in ("committed", "rolled back", "unknown"), rec
    committed_consumer = [rec for rec in consumer_txs if rec.committed]
    consumed = Counter(key for rec in committed_consumer for key in rec.items)
    twice = [k for k, n in consumed.items() if n > 1]
    assert not twice, f"acked in two committed consumer transactions: {twice[:10]}"
    valid = set(expected.values())
    for c in stress.consumers:
        ghosts = [b for b in c.deliveries if b not in valid]
        assert not ghosts, f"{c.label} was delivered uncommitted messages: {ghosts[:10]}"
    for name, queues in stores.items():
        left = Counter(queues[QUEUE])
        ghosts = [b for b in left if b not in valid]
        assert not ghosts, (name, "uncommitted messages stored", ghosts[:10])
        dup = [b for b, n in left.items() if n > 1]
        assert not dup, (name, "stored twice", dup[:10])
        left_keys = {":".join(b.decode().split(":")[:2]) for b in left}
        both = left_keys & set(consumed)
        assert not both, (name, "acked in a committed transaction yet still queued", sorted(both)[:10])
        missing = set(expected) - left_keys - set(consumed)
        assert not missing, (name, "committed but gone (a gap in the numbered sequence)",
                             sorted(missing, key=lambda k: (k.split(":")[0], int(k.split(":")[1])))[:20])
        receipts = Counter(json.loads(b)["tx"] for b in queues[RECEIPTS])
        assert all(n == 1 for n in receipts.values()), (name, "receipt twice", receipts.most_common(3))
        assert set(receipts) == {r.tx_id for r in committed_consumer}, (
            name, "receipts differ from the committed consumer transactions",
            sorted(set(receipts) ^ {r.tx_id for r in committed_consumer})[:10])
    every = [rec for w in stress.workers for rec in w.txs]
    return {"publisher commits": sum(1 for p in stress.publishers for r in p.txs if r.committed),
            "consumer commits": len(committed_consumer),
            "messages committed": len(expected), "consumed": sum(consumed.values()),
            "in doubt": sum(1 for r in every if r.state == "in-doubt"),
            "in doubt committed": sum(1 for r in every if r.state == "in-doubt" and r.committed),
            "lost before commit": sum(1 for r in every if r.state == "lost"),
            "redelivered": sum(len(c.deliveries) for c in stress.consumers) - sum(consumed.values()),
            "reconnects": sum(w.reconnects for w in stress.workers)}


def check_depths(stress: Stress, size: int) -> int:
    assert stress.poller is not None
    depths = stress.poller.depths
    bad = [(conn, d) for conn, d in depths if d % size]
    assert not bad, f"queue depths not multiples of {size}: {bad[:20]}"
    assert stress.poller.connections > stress.kills, "the poller never reconnected"
    return len(depths)


@pytest.fixture()
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options=FAST) as c:
        yield c


def test_tx_publishers_and_consumers_through_primary_kills(cluster: LocalCluster) -> None:
    started = time.monotonic()
    stress = run_stress(cluster, kills=3, seed=11)
    stats = check(stress, stop_all_and_read(cluster, [QUEUE, RECEIPTS]))
    print(f"{stats}; {time.monotonic() - started:.1f} s")
    assert stats["consumer commits"] > 10 and stats["reconnects"] >= 3 * 4


def test_fixed_size_tx_depth_is_a_multiple_of_the_size_through_kills(cluster: LocalCluster) -> None:
    stress = run_stress(cluster, kills=2, seed=12, consumers=(), size=5, poll_depth=True)
    polls = check_depths(stress, 5)
    stats = check(stress, stop_all_and_read(cluster, [QUEUE, RECEIPTS]))
    print(f"{stats}; {polls} depth polls")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [21, 22])
def test_tx_stress_soak(seed: int) -> None:
    with LocalCluster(3, options=FAST) as c:
        stress = run_stress(c, kills=10, seed=seed, publishers=3,
                            consumers=("get", "consume", "get"))
        print(check(stress, stop_all_and_read(c, [QUEUE, RECEIPTS])))


@pytest.mark.slow
def test_fixed_size_tx_depth_soak() -> None:
    with LocalCluster(3, options=FAST) as c:
        stress = run_stress(c, kills=10, seed=23, consumers=(), size=5, poll_depth=True)
        polls = check_depths(stress, 5)
        print(check(stress, stop_all_and_read(c, [QUEUE, RECEIPTS])), f"{polls} depth polls")
