"""A backup applies enqueues on one queue in a row as one batch (issue 33).

A catch-up is almost only such runs, and so is a burst of publishes in one
flush: one ``Queue.add_entries`` each, so the backup's store records a batch
as one operation instead of one per message.
"""

from __future__ import annotations

from typing import Any

from brokerha.broker.observers import QueueObserver
from brokerha.broker.queue import Queue
from brokerha.primary.catch_up import Pace
from tests.ha.harness import Cluster, carry, publish
from tests.ha.test_replication import same


class Spy(QueueObserver):
    """What the backup's queues told their observers, call by call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []

    def enqueued(self, queue: Queue, entry: Any) -> None:
        self.calls.append(("one", queue.name, 1))

    def enqueued_many(self, queue: Queue, entries: list[Any]) -> None:
        self.calls.append(("many", queue.name, len(entries)))


def two_queues(c: Cluster) -> None:
    vh = c.broker.vhosts["/"]
    vh.declare_queue("a", owner=None, durable=True)
    vh.declare_queue("b", owner=None, durable=True, arguments={"x-message-ttl": 60_000})


def watched(c: Cluster, name: str) -> Spy:
    spy = Spy()
    c.node(name).broker.observers.add_queue_observer(spy)
    return spy


def test_live_enqueues_in_a_row_are_one_batch_per_queue_and_run() -> None:
    c = Cluster(2)
    two_queues(c)
    backup = c.follow("n2")
    c.pump()
    spy = watched(c, "n2")
    for i in range(5):
        publish(c.broker, b"a%d" % i, rk="a")
    publish(c.broker, b"b0", rk="b")  # another queue: the run ends
    for i in range(3):
        publish(c.broker, b"b%d" % (i + 1), rk="b")
    publish(c.broker, b"a5", rk="a")
    carry(c.primary, backup)
    assert spy.calls == [("many", "a", 5), ("many", "b", 4), ("one", "a", 1)]
    same(c)
    # the TTL queue's entries expire on the backup as on the primary
    ttl = c.node("n2").broker.vhosts["/"].queues["b"]
    assert all(e.expires_at is not None for e in ttl.ready)


def test_a_catch_up_is_applied_in_batches_and_ends_equal() -> None:
    c = Cluster(2, pace=Pace(slice_bytes=2_000, slice_work=50, window_bytes=1 << 20))
    two_queues(c)
    for i in range(300):
        publish(c.broker, b"m%d" % i, rk="a" if i % 3 else "b")
    spy = watched(c, "n2")
    c.follow("n2")
    c.pump()
    same(c)
    batches = [n for kind, _, n in spy.calls if kind == "many"]
    assert sum(n for _, _, n in spy.calls) == 300
    assert len(batches) < 30 and max(batches) > 5  # batches, not one call per message
