"""Purge and delete of a deep queue: empty at once, the per-entry work in bounded slices.

``broker/drain.py``, ``broker/background.py``: a purge or delete takes the
ready list off the queue at once; observers' ``dequeued``, memory and freeing
the entries run later in steps of at most ``Background.entries`` entries, one
step per loop turn here (``seconds=0``).
"""

from __future__ import annotations

from collections.abc import Callable

from pamqp import commands

from brokerha.broker.background import Background
from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header
from brokerha.broker.message import Entry, Message
from brokerha.broker.observers import QueueObserver
from brokerha.broker.queue import Queue
from brokerha.broker.storage import MemoryStore

STEP = 100  # entries per step (and so per loop turn)


class Loop:
    """A hand-turned event loop: ``call_soon`` queues, ``turn`` runs what was queued."""

    def __init__(self) -> None:
        self.calls: list[Callable[[], None]] = []

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.calls.append(fn)

    def turn(self) -> None:
        calls, self.calls = self.calls, []
        for fn in calls:
            fn()

    def run(self) -> int:
        turns = 0
        while self.calls:
            self.turn()
            turns += 1
        return turns


class Dequeues(QueueObserver):
    """Sees a purge entry by entry (an observer without ``purged``)."""

    def __init__(self) -> None:
        self.positions: list[int] = []

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        self.positions.append(entry.position)


class WholePurges(QueueObserver):
    """Takes a purge in one call (as the store does): no ``dequeued`` for its entries."""

    def __init__(self) -> None:
        self.purges: list[tuple[str, list[tuple[int, int]]]] = []
        self.positions: list[int] = []

    def purged(self, queue: Queue, ranges: list[tuple[int, int]]) -> None:
        self.purges.append((queue.name, ranges))

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        self.positions.append(entry.position)


def msg(body: bytes = b"x" * 100, priority: int | None = None) -> Message:
    props = commands.Basic.Properties(delivery_mode=2, priority=priority)
    return Message("", "q", build_header(len(body), props), body)


def sliced(store: MemoryStore | None = None) -> tuple[Broker, Loop, Dequeues, WholePurges]:
    broker = Broker("t", store=store or MemoryStore())
    loop = Loop()
    broker.background.schedule = loop.call_soon
    broker.background.entries = STEP
    broker.background.seconds = 0.0  # one step per loop turn
    broker.add_vhost("/")
    singly, whole = Dequeues(), WholePurges()
    broker.observers.add_queue_observer(singly)
    broker.observers.add_queue_observer(whole)
    return broker, loop, singly, whole


def fill(q: Queue, n: int, **kw: object) -> None:
    for _ in range(n):
        q.enqueue(msg(**kw))  # type: ignore[arg-type]


def covered(position: int, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= position <= hi for lo, hi in ranges)


def test_a_purged_queue_is_empty_at_once_and_its_entries_leave_in_bounded_slices() -> None:
    broker, loop, singly, whole = sliced()
    q = broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    fill(q, 1000)
    used = broker.memory.used
    assert broker.vhosts["/"].purge_queue("q", None) == 1000
    assert (q.message_count, q.ready_bytes, q.paged_bytes) == (0, 0, 0)
    assert singly.positions == [] and broker.memory.used == used  # nothing per entry yet
    assert whole.purges == [("q", [(0, 1000)])]  # no acquired entry: all below next_position
    seen = 0
    while loop.calls:
        loop.turn()
        assert len(singly.positions) - seen <= STEP  # a slice: at most STEP entries
        seen = len(singly.positions)
    assert singly.positions == list(range(1, 1001))  # each once, in order
    assert whole.positions == []  # it took the purge whole
    assert broker.memory.used == 0 and broker.background.pending == 0
    assert broker.background.slices == 1000 // STEP


def test_the_store_forgets_a_purge_at_once_in_one_operation() -> None:
    store = MemoryStore()
    broker, loop, _, _ = sliced(store)
    q = broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    fill(q, 500)
    assert len(store.messages) == 500
    broker.vhosts["/"].purge_queue("q", None)
    assert store.messages == {}  # before any slice ran
    fill(q, 3)  # new entries after the purge stay
    loop.run()
    assert sorted(k[2] for k in store.messages) == [501, 502, 503]


def test_acquired_entries_stay_and_their_positions_are_in_no_range() -> None:
    store = MemoryStore()
    broker, loop, singly, whole = sliced(store)
    q = broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    fill(q, 1000)
    held = [q.get() for _ in range(5)]  # positions 1..5
    for entry in held[::2]:  # 1, 3, 5 back in place: ready again
        assert entry is not None
        q.requeue(entry)
    assert broker.vhosts["/"].purge_queue("q", None) == 998
    assert whole.purges == []  # the ranges are found in slices first
    turns = loop.run()
    assert turns >= 998 // STEP
    ((name, ranges),) = whole.purges
    assert name == "q" and ranges == [(1, 1), (3, 3), (5, 1000)]
    assert sorted(k[2] for k in store.messages) == [2, 4]  # the acquired two
    assert sorted(singly.positions) == [1, 3, *range(5, 1001)]
    assert q.unacked == 2
    q.settle(held[1])  # type: ignore[arg-type]
    assert sorted(k[2] for k in store.messages) == [4]


def test_ranges_of_a_priority_queue_hold_every_purged_position_and_no_acquired_one() -> None:
    broker, loop, singly, whole = sliced()
    q = broker.vhosts["/"].declare_queue("q", owner=None, durable=True,
                                         arguments={"x-max-priority": 3})
    for i in range(600):
        q.enqueue(msg(priority=i % 4))
    held = [q.get() for _ in range(7)]  # the highest priority first: positions 4, 8, 12, ...
    broker.vhosts["/"].purge_queue("q", None)
    loop.run()
    ((_, ranges),) = whole.purges
    assert all(covered(p, ranges) for p in singly.positions) and len(singly.positions) == 593
    assert not any(covered(e.position, ranges) for e in held if e is not None)


def test_the_purge_of_a_queue_deleted_before_its_ranges_were_known_is_not_recorded() -> None:
    broker, loop, _, whole = sliced()
    vhost = broker.vhosts["/"]
    q = vhost.declare_queue("q", owner=None, durable=True)
    fill(q, 1000)
    q.get()  # an acquired entry: the ranges take slices
    vhost.purge_queue("q", None)
    loop.turn()
    vhost.delete_queue("q", owner=None)  # its deletion covers what was purged
    vhost.declare_queue("q", owner=None, durable=True)  # positions start again at 1
    loop.run()
    assert whole.purges == []


def test_a_deleted_queues_entries_get_no_dequeued_and_are_freed_in_slices() -> None:
    store = MemoryStore()
    broker, loop, singly, whole = sliced(store)
    vhost = broker.vhosts["/"]
    q = vhost.declare_queue("q", owner=None, durable=True)
    fill(q, 1000)
    entry = q.get()
    assert vhost.delete_queue("q", owner=None) == 999
    assert q.deleted and "q" not in vhost.queues and store.messages == {}
    assert broker.memory.used > 0  # still held: freed by the slices
    turns = loop.run()
    assert turns == 999 // STEP + 1
    assert broker.memory.used == 0
    assert singly.positions == whole.positions == whole.purges == []
    assert entry is not None
    q.settle(entry)  # acknowledged after the delete
    assert singly.positions == [entry.position] and store.messages == {}


def test_a_queue_declared_again_keeps_its_stored_message_when_the_old_one_is_acked() -> None:
    store = MemoryStore()
    broker = Broker("t", store=store)
    vhost = broker.add_vhost("/")
    old = vhost.declare_queue("q", owner=None, durable=True)
    fill(old, 1)
    entry = old.get()
    vhost.delete_queue("q", owner=None)
    new = vhost.declare_queue("q", owner=None, durable=True)
    fill(new, 1)  # position 1 again
    assert entry is not None
    old.settle(entry)
    assert list(store.messages) == [("/", "q", 1)]


def test_purge_ok_waits_for_the_slices_and_then_for_durability() -> None:
    from tests.amqp.wire import Wire

    w = Wire().connected()
    broker = w.broker
    loop = Loop()
    broker.background.schedule = loop.call_soon
    broker.background.entries = STEP
    broker.background.seconds = 0.0
    w.method(1, commands.Queue.Declare(queue="q", durable=True))
    for i in range(250):
        w.publish(1, "", "q", b"%d" % i)
    w.methods()
    w.method(1, commands.Queue.Purge(queue="q"))
    w.method(1, commands.Queue.Declare(queue="q", passive=True))  # waits behind purge-ok
    assert w.methods() == []
    assert broker.vhosts["/"].queues["q"].message_count == 0  # empty for everyone at once
    loop.run()
    purge_ok, declare_ok = w.methods()
    assert isinstance(purge_ok, commands.Queue.PurgeOk) and purge_ok.message_count == 250
    assert isinstance(declare_ok, commands.Queue.DeclareOk) and declare_ok.message_count == 0


def test_on_an_ha_member_purge_ok_waits_for_the_durability_barrier() -> None:
    from tests.amqp.wire import Wire

    class Gate:
        def term(self) -> int | None:
            return 1

        def lapsed(self) -> int | None:
            return None

        def refused(self) -> None:
            raise AssertionError("refused")

        def defer(self, release: Callable[[], None]) -> None:
            raise AssertionError("deferred")

    w = Wire().connected()
    broker = w.broker
    loop = Loop()
    broker.background.schedule = loop.call_soon
    broker.background.seconds = 0.0
    broker.durability_gate = Gate()
    held: list[Callable[[], None]] = []
    broker.replication_barriers.append(held.append)  # a backup that has not acknowledged
    w.method(1, commands.Queue.Declare(queue="q", durable=True))
    held.pop()()  # the declare's barrier
    for i in range(10):
        w.publish(1, "", "q", b"%d" % i)
    w.methods()
    w.method(1, commands.Queue.Purge(queue="q"))
    loop.run()
    assert w.methods() == [] and len(held) == 1  # the slices are done; the backups not yet
    held.pop()()
    (purge_ok,) = w.methods()
    assert isinstance(purge_ok, commands.Queue.PurgeOk) and purge_ok.message_count == 10


def test_without_a_loop_a_purge_is_done_before_it_returns() -> None:
    broker = Broker("t")
    singly = Dequeues()
    broker.observers.add_queue_observer(singly)
    q = broker.add_vhost("/").declare_queue("q", owner=None)
    fill(q, 10)
    assert broker.vhosts["/"].purge_queue("q", None) == 10
    assert singly.positions == list(range(1, 11)) and broker.memory.used == 0


def test_a_failing_work_is_dropped_and_what_waits_behind_it_still_runs() -> None:
    class Broken:
        def step(self, budget: int) -> bool:
            raise RuntimeError("bug")

    loop = Loop()
    background = Background()
    background.schedule = loop.call_soon
    done: list[str] = []
    background.run(Broken())
    background.after(lambda: done.append("after"))
    loop.run()
    assert done == ["after"] and background.pending == 0


def test_slices_pause_while_publishers_are_held_and_go_on_once_released() -> None:
    """On an HA primary a lagging backup holds publishers (``flow_lag``): a purge's
    dequeues are replication traffic too, so its slices wait as well."""
    broker, loop, singly, _ = sliced()
    q = broker.vhosts["/"].declare_queue("q", owner=None)
    fill(q, 1000)
    broker.vhosts["/"].purge_queue("q", None)
    loop.turn()
    assert len(singly.positions) == STEP
    broker.flow.hold("replication", "a backup lags")
    loop.run()
    assert len(singly.positions) == STEP and broker.background.pending == 1
    broker.flow.release("replication")
    loop.run()
    assert len(singly.positions) == 1000 and broker.background.pending == 0
