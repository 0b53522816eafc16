"""Expiry of a deep queue's head in bounded slices (``VirtualHost.tick``, ``vhost.Expiry``).

A TX of 100,000 messages with a TTL, or a store recovered after a long stop,
expires at one instant: the loop must not drop them all in one step (on an HA
primary a stall past the lease costs it its role). A tick drops a slice of
``Background.entries``; an ``Expiry`` in the broker's background does the rest,
a slice per loop turn; a get or a delivery drops at most ``EXPIRED_PER_TAKE``.
"""

from __future__ import annotations

import pytest

from brokerha.broker import queue as queue_module
from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from tests.broker.test_purge import STEP, Dequeues, Loop, fill, sliced


class Taker:
    """A consumer with unlimited credit that keeps what it is given."""

    exclusive = False
    tag = "c"

    def __init__(self) -> None:
        self.got: list[int] = []

    def can_take(self) -> bool:
        return True

    def deliver(self, queue: Queue, entry: Entry) -> None:
        self.got.append(entry.position)

    def cancelled_by_server(self, queue: Queue) -> None:
        pass


def expired_head(n: int, live: int = 1) -> tuple[Broker, Loop, Dequeues, Queue]:
    """A queue with a TTL whose first ``n`` entries are past it, then ``live`` others."""
    broker, loop, singly, _ = sliced()
    vhost = broker.vhosts["/"]
    q = vhost.declare_queue("q", owner=None, durable=True, arguments={"x-message-ttl": 60_000})
    fill(q, n + live)
    for entry in list(q.ready)[:n]:
        entry.expires_at = 0.0
    return broker, loop, singly, q


def test_a_tick_drops_a_slice_and_the_rest_expires_in_bounded_slices() -> None:
    broker, loop, singly, q = expired_head(1000)
    vhost = broker.vhosts["/"]
    vhost.tick(q.clock())
    assert len(singly.positions) == STEP
    vhost.tick(q.clock())  # a second tick meanwhile: one Expiry per queue
    assert broker.background.pending == 1
    seen = len(singly.positions)
    while loop.calls:
        loop.turn()
        assert len(singly.positions) - seen <= STEP
        seen = len(singly.positions)
    assert singly.positions == list(range(1, 1001))
    assert [e.position for e in q.ready] == [1001] and q.message_count == 1
    assert broker.background.pending == 0


def test_a_consumer_gets_the_live_head_once_the_expired_ones_are_gone() -> None:
    broker, loop, _, q = expired_head(1000)
    taker = Taker()
    q.consumers.append(taker)  # type: ignore[arg-type]  # there before the expiry: nothing to give it yet
    broker.vhosts["/"].tick(q.clock())
    assert taker.got == []
    loop.run()
    assert taker.got == [1001]


def test_a_get_drops_a_bounded_number_of_expired_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue_module, "EXPIRED_PER_TAKE", 300)
    broker, loop, singly, q = expired_head(1000)
    assert q.get() is None  # 300 dropped, the rest left to the slices
    assert len(singly.positions) == 300
    broker.vhosts["/"].tick(q.clock())
    loop.run()
    entry = q.get()
    assert entry is not None and entry.position == 1001


def test_an_expiry_ends_with_its_queue() -> None:
    broker, loop, singly, q = expired_head(1000)
    vhost = broker.vhosts["/"]
    vhost.tick(q.clock())
    vhost.delete_queue("q", owner=None)
    loop.run()
    assert broker.background.pending == 0 and not vhost._expiring
