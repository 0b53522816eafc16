"""A join's catch-up is made as it is sent: slices, a window, the queue live beside it.

Issue 33: answering a join built the whole catch-up at once (every body read,
every event made) on the primary's loop, and confirms waited for the joining
backup until it had caught up; with a deep queue that stalled the primary past
its lease. Here the catch-up is streamed (``primary/catch_up.py``).
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from brokerha.cluster import replication as R
from brokerha.ha.simulation.world import entries_of, wire
from brokerha.primary.catch_up import CATCH_UP_SPAN, Pace
from brokerha.primary.events import event_size
from tests.ha.harness import Cluster, carry, consume, publish
from tests.ha.test_replication import same

SMALL = Pace(slice_bytes=4_000, slice_work=64, window_bytes=12_000)


def deep(c: Cluster, n: int, size: int = 100) -> None:
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    for i in range(n):
        publish(c.broker, b"%d:" % i + b"x" * size)


def test_each_flush_makes_one_slice_and_stops_at_the_window() -> None:
    c = Cluster(2, pace=SMALL)
    deep(c, 500)
    backup = c.follow("n2")
    session = c.primary.sessions["n2"]

    def flush() -> int:
        """One flush, delivered (as the link would) but not acknowledged: its bytes."""
        packets = c.primary.take_outbox("n2")
        for packet in packets:
            backup.receive(wire(packet))  # type: ignore[arg-type]
        return sum(event_size(e) for p in packets for e in p.events)

    first_seq = c.primary.seq - CATCH_UP_SPAN
    first = flush()
    # one slice (the last event may pass it: a run, at most a quarter of a slice)
    assert 0 < first <= SMALL.slice_bytes + SMALL.run_bytes + 200
    assert backup.applied_seq >= first_seq  # numbered from below the join
    assert session.wants_catch_up_slice and not session.caught_up
    sent = first
    while session.wants_catch_up_slice:  # no acknowledgement: the window closes
        sent += flush()
    bound = SMALL.window_bytes + SMALL.slice_bytes + SMALL.run_bytes + 200
    assert SMALL.window_bytes <= sent <= bound
    assert flush() == 0  # nothing more until it acknowledges
    c.primary.backup_acked("n2", backup.applied_seq)
    c.pump()  # its acknowledgements open the window again, slice after slice
    same(c)
    assert session.caught_up and session.guarded and c.primary.ready_backups() == ["n2"]


def test_a_flush_asks_for_the_next_one_while_the_window_is_open() -> None:
    flushes: list[bool] = []
    c = Cluster(2, pace=SMALL)
    c.primary.on_output = flushes.append
    deep(c, 200)
    c.follow("n2")
    assert flushes == [False]  # the join asks for a flush
    node = c.nodes["n2"].backup
    assert node is not None
    carry(c.primary, node, ack=False)
    assert flushes == [False, False]  # more to make, window open: the next loop turn
    while c.primary.sessions["n2"].wants_catch_up_slice:
        carry(c.primary, node, ack=False)
    before = len(flushes)
    c.primary.backup_acked("n2", node.applied_seq)  # the window opens again
    assert len(flushes) == before + 1


def test_unbounded_pace_sends_everything_in_one_flush() -> None:
    """``Unsafe.monolithic_catch_up``: the catch-up as it used to be, whole at once."""
    c = Cluster(2, pace=Pace.unbounded())
    deep(c, 300)
    c.follow("n2")
    packets = c.primary.take_outbox("n2")
    assert packets[-1].events[-1].kind == R.CAUGHT_UP
    assert sum(entries_of(p.events) for p in packets) > 300  # runs count a message each


def test_confirms_do_not_wait_for_a_backup_catching_up() -> None:
    c = Cluster(3, pace=SMALL)
    deep(c, 10)
    c.follow("n2")
    c.pump()  # n2 holds a copy
    for i in range(400):
        publish(c.broker, b"more%d" % i + b"y" * 100)
    c.silent.add("n3")
    c.follow("n3")  # a long catch-up, hardly begun
    confirmed: list[bool] = []
    publish(c.broker, b"now")
    c.broker.after_durable(lambda: confirmed.append(True))
    c.pump()
    assert confirmed == [True]  # the majority (the primary and n2) alone
    assert not c.primary.sessions["n3"].guarded
    assert c.primary.ready_backups() == ["n2"]  # n3 is not promotable yet
    c.silent.discard("n3")
    c.pump()
    same(c)
    assert c.primary.sessions["n3"].guarded and c.primary.ready_backups() == ["n2", "n3"]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([1, 3]))
def test_the_queue_goes_on_changing_during_the_catch_up_and_they_converge(
        seed: int, holds: int) -> None:
    """Publishes, consumes, acquired entries, purges, deletes and redeclares between slices.

    ``holds``: 1 -- a fresh backup; 3 -- a backup that held part of the queue and
    joins again (skips, drops, a resent tail).
    """
    rnd = random.Random(seed)
    c = Cluster(2, pace=SMALL)
    deep(c, 300, size=rnd.randrange(10, 300))
    vhost = c.broker.vhosts["/"]
    if holds == 3:
        c.follow("n2")
        c.pump()
        c.primary.backup_lost("n2", "restarted")
        consume(vhost.queues["q"], rnd.randrange(0, 50))
        for i in range(rnd.randrange(0, 50)):
            publish(c.broker, b"while-away%d" % i)
        c.join("n2")
    else:
        c.follow("n2")
    held = []
    backup = c.nodes["n2"].backup
    assert backup is not None
    for _ in range(200):
        q = vhost.queues.get("q")
        op = rnd.random()
        if q is None:
            vhost.declare_queue("q", owner=None, durable=True)
        elif op < 0.35:
            publish(c.broker, b"live%d" % rnd.randrange(10**6))
        elif op < 0.55:
            consume(q, rnd.randrange(1, 8))
        elif op < 0.65:
            entry = q.get()  # acquired: still on the queue until settled
            if entry is not None:
                held.append(entry)
        elif op < 0.7 and held:
            entry = held.pop(rnd.randrange(len(held)))
            if not q.deleted:
                (q.settle if rnd.random() < 0.5 else q.requeue)(entry)
        elif op < 0.72:
            q.purge()
        elif op < 0.73:
            vhost.delete_queue("q", owner=None)
            held.clear()
        carry(c.primary, backup, ack=rnd.random() < 0.7)
        if not c.primary.sessions["n2"].catch_up and rnd.random() < 0.2:
            break
    for entry in held:
        q = vhost.queues.get("q")
        if q is not None and not q.deleted:
            q.requeue(entry)
    c.primary.backup_acked("n2", backup.applied_seq)  # what it held back
    c.pump()
    same(c)
    assert c.primary.ready_backups() == ["n2"]
