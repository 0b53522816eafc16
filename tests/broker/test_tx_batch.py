"""A TX commit enqueues each queue's messages as one batch (issue 33: the commit is one
loop callback, so what it costs per message is what it stalls the loop).

``Transaction.apply`` groups the publishes by queue as they come; at the commit
a ``batchable`` queue takes its messages in one ``enqueue_many`` (entries made in
one loop, one ``enqueued_many`` call to observers that take batches, one extend
of the ready list); the result is what message-by-message enqueues give.
"""

from __future__ import annotations

from pamqp import commands

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header
from brokerha.broker.message import Entry, Message
from brokerha.broker.observers import QueueObserver
from brokerha.broker.queue import Queue
from brokerha.broker.storage import MemoryStore
from tests.clock import Clock


class Singly(QueueObserver):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, bytes]] = []

    def enqueued(self, queue: Queue, entry: Entry) -> None:
        self.seen.append((queue.name, entry.position, entry.message.body))


class Batches(QueueObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []
        self.single: list[int] = []

    def enqueued(self, queue: Queue, entry: Entry) -> None:
        self.single.append(entry.position)

    def enqueued_many(self, queue: Queue, entries: list[Entry]) -> None:
        self.calls.append((queue.name, [e.position for e in entries]))


def msg(body: bytes, rk: str = "q", **props: object) -> Message:
    header = build_header(len(body), commands.Basic.Properties(delivery_mode=2, **props))
    return Message("", rk, header, body)


def setup() -> tuple[Broker, Singly, Batches]:
    broker = Broker("t", store=MemoryStore(), clock=Clock())
    broker.add_vhost("/")
    singly, batches = Singly(), Batches()
    broker.observers.add_queue_observer(singly)
    broker.observers.add_queue_observer(batches)
    return broker, singly, batches


def bodies(q: Queue) -> list[bytes]:
    return [e.message.body for e in q.ready]


def test_each_queue_gets_its_messages_in_order_in_one_batch() -> None:
    broker, singly, batches = setup()
    vhost = broker.vhosts["/"]
    q1 = vhost.declare_queue("q1", owner=None, durable=True)
    q2 = vhost.declare_queue("q2", owner=None, durable=True)
    q1.enqueue(msg(b"before"))
    tx = broker.new_transaction()
    for i in range(5):
        tx.publish([q1], msg(b"a%d" % i))
        if i % 2:
            tx.publish([q1, q2], msg(b"both%d" % i))
    tx.commit_prepared()
    assert bodies(q1) == [b"before", b"a0", b"a1", b"both1", b"a2", b"a3", b"both3", b"a4"]
    assert bodies(q2) == [b"both1", b"both3"]
    assert [e.position for e in q1.ready] == list(range(1, 9)) and q1.next_position == 9
    assert batches.calls == [("q1", list(range(2, 9))), ("q2", [1, 2])]
    assert batches.single == [1]  # the enqueue before the transaction
    assert [s for s in singly.seen if s[0] == "q1"][1:] == [
        ("q1", p, e.message.body) for p, e in zip(range(2, 9), list(q1.ready)[1:], strict=True)]
    store = broker.store
    assert isinstance(store, MemoryStore) and len(store.messages) == 10
    assert q1.ready_bytes == sum(e.message.size for e in q1.ready) == broker.memory.used - \
        q2.ready_bytes
    assert q1.published == 8 and q2.published == 2


def test_a_queue_with_a_limit_takes_the_commit_message_by_message() -> None:
    broker, singly, batches = setup()
    vhost = broker.vhosts["/"]
    vhost.declare_exchange("dlx", "fanout")
    dead = vhost.declare_queue("dead", owner=None)
    vhost.bind("dlx", dead, "")
    q = vhost.declare_queue("q", owner=None, durable=True, arguments={
        "x-max-length": 2, "x-dead-letter-exchange": "dlx"})
    other = vhost.declare_queue("other", owner=None, durable=True)
    tx = broker.new_transaction()
    for i in range(4):
        tx.publish([q, other], msg(b"%d" % i))
    tx.commit_prepared()
    assert bodies(q) == [b"2", b"3"] and bodies(dead) == [b"0", b"1"]
    assert bodies(other) == [b"0", b"1", b"2", b"3"]
    assert batches.calls == []  # one queue of the commit is not batchable: none is batched
    assert len(batches.single) == 10


def test_message_ttl_priorities_and_consumers_as_with_single_enqueues() -> None:
    broker, _, _ = setup()
    vhost = broker.vhosts["/"]
    clock = broker.clock
    assert isinstance(clock, Clock)
    ttl = vhost.declare_queue("ttl", owner=None, arguments={"x-message-ttl": 5000})
    prio = vhost.declare_queue("prio", owner=None, arguments={"x-max-priority": 2})
    tx = broker.new_transaction()
    tx.publish([ttl], msg(b"t"))
    tx.publish([ttl], msg(b"short", expiration="1000"))
    for i, p in enumerate((0, 2, 1, 2)):
        tx.publish([prio], msg(b"%d" % i, priority=p))
    clock.now = 2000.0
    tx.commit_prepared()
    assert [e.expires_at for e in ttl.ready] == [2005.0, 2001.0]
    assert [e.message.body for e in iter(prio.get, None)] == [b"1", b"3", b"2", b"0"]


def test_a_consumer_gets_the_committed_messages() -> None:
    broker, _, _ = setup()
    q = broker.vhosts["/"].declare_queue("q", owner=None)
    got: list[bytes] = []

    class Consumer:
        tag, no_ack, exclusive = "c", True, False

        def can_take(self) -> bool:
            return len(got) < 3

        def deliver(self, queue: Queue, entry: Entry) -> None:
            got.append(entry.message.body)

        def cancelled_by_server(self, queue: Queue) -> None: ...

    q.add_consumer(Consumer())
    tx = broker.new_transaction()
    for i in range(5):
        tx.publish([q], msg(b"%d" % i))
    tx.commit_prepared()
    assert got == [b"0", b"1", b"2"] and bodies(q) == [b"3", b"4"]


def test_publishes_changed_behind_the_grouping_are_grouped_again() -> None:
    broker, _, _ = setup()
    vhost = broker.vhosts["/"]
    q, g = (vhost.declare_queue(n, owner=None) for n in ("q", "global"))
    tx = broker.new_transaction()
    tx.publish([q, g], msg(b"1"))
    tx.publishes.append(([q], msg(b"2")))  # as a restored XA branch's are
    tx.publish([g], msg(b"3"))
    tx.withhold(lambda queue: queue is g)  # another layer enqueues those
    tx.commit_prepared()
    assert bodies(q) == [b"1", b"2"] and bodies(g) == []


def test_a_queue_deleted_before_the_commit_gets_nothing() -> None:
    broker, _, batches = setup()
    vhost = broker.vhosts["/"]
    q = vhost.declare_queue("q", owner=None)
    tx = broker.new_transaction()
    tx.publish([q], msg(b"1"))
    vhost.delete_queue("q", owner=None)
    tx.commit_prepared()
    assert batches.calls == [] and q.message_count == 0
