"""A purge on the primary, its entries let go of in slices: the backups end equal.

Issue 33: a purge of a deep queue ran on the primary's loop in one go. Now
the queue is empty at once and the per-entry rest runs in slices between loop
turns (``broker/drain.py``); live traffic, a delete and a join go on between
them. The backups get the purge in one ``pg`` event when nothing was acquired
on the queue (and empty their copy at once, letting go of it in slices of
their own), else as dequeue events of at most ``DEQUEUES_PER_EVENT`` positions
(``Primary.purged``).
"""

from __future__ import annotations

from typing import Any

import pytest

from brokerha.cluster import replication as R
from brokerha.cluster.replication import Events, ReplicationError
from brokerha.ha.simulation.world import wire
from brokerha.primary.events import DEQUEUES_PER_EVENT
from tests.broker.test_purge import Loop
from tests.ha.harness import Cluster, consume, publish
from tests.ha.test_replication import same

STEP = 1000


def sliced(c: Cluster) -> Loop:
    loop = Loop()
    background = c.broker.background
    background.schedule, background.entries, background.seconds = loop.call_soon, STEP, 0.0
    return loop


def deep(c: Cluster, n: int) -> None:
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    for i in range(n):
        publish(c.broker, b"%d" % i)


def carry(c: Cluster, name: str) -> list[Any]:
    """One flush to ``name``, applied and acknowledged: its events."""
    backup = c.nodes[name].backup
    assert backup is not None
    events: list[Any] = []
    packets = c.primary.take_outbox(name)
    for packet in packets:
        events += packet.events
        backup.receive(wire(packet))  # type: ignore[arg-type]
    if packets:
        c.primary.backup_acked(name, backup.applied_seq)
    return events


def test_a_purge_without_acquired_entries_reaches_the_backup_as_one_event() -> None:
    """One ``pg``, not a dequeue per position: the backup empties its copy at once, its
    store records one purge, and it lets go of the entries in bounded slices too."""
    c = Cluster(2)
    n = 3 * DEQUEUES_PER_EVENT + 10
    deep(c, n)
    c.follow("n2")
    c.pump()
    loop = sliced(c)
    backup_broker = c.node("n2").broker
    backup_loop = Loop()
    background = backup_broker.background
    background.schedule, background.entries, background.seconds = \
        backup_loop.call_soon, STEP, 0.0
    assert c.broker.vhosts["/"].purge_queue("q", None) == n
    events = carry(c, "n2")
    assert [e.kind for e in events] == [R.PURGED]
    assert events[0].below == c.broker.vhosts["/"].queues["q"].next_position
    backup_q = backup_broker.vhosts["/"].queues["q"]
    assert len(backup_q.ready) == 0 and background.pending == 1  # empty at once
    while loop.calls or backup_loop.calls:
        loop.turn()
        backup_loop.turn()
        publish(c.broker, b"live")  # between two slices
        events += carry(c, "n2")
    c.pump()
    same(c)
    assert not [e for e in events if e.kind == R.DEQUEUED]
    assert background.slices >= n // STEP  # at most STEP entries a loop turn
    assert [e.message.body for e in backup_q.ready] == [b"live"] * (len(events) - 1)
    assert backup_q.memory.used == c.broker.vhosts["/"].queues["q"].memory.used


def test_a_purge_with_acquired_entries_goes_as_bounded_dequeues_and_keeps_them() -> None:
    c = Cluster(2)
    n = 3 * DEQUEUES_PER_EVENT + 10
    deep(c, n)
    c.follow("n2")
    c.pump()
    q = c.broker.vhosts["/"].queues["q"]
    held = q.get()  # acquired: its backups' copies have it, the purge does not take it
    assert held is not None
    loop = sliced(c)
    assert c.broker.vhosts["/"].purge_queue("q", None) == n - 1
    sizes: list[int] = []
    while loop.calls:
        loop.turn()
        sizes += [len(e.positions) for e in carry(c, "n2") if e.kind == R.DEQUEUED]
    assert sum(sizes) == n - 1 and max(sizes) <= DEQUEUES_PER_EVENT
    backup_q = c.node("n2").broker.vhosts["/"].queues["q"]
    assert [e.position for e in backup_q.ready] == [held.position]
    q.settle(held)
    c.pump()
    same(c)


def test_a_backup_whose_copy_is_numbered_past_a_purge_joins_again() -> None:
    """Fails closed: emptying a copy that holds a position the primary's purge did not
    cover would drop a message the primary kept."""
    c = Cluster(2)
    deep(c, 10)
    backup = c.follow("n2")
    c.pump()
    below = c.broker.vhosts["/"].queues["q"].next_position
    with pytest.raises(ReplicationError, match="numbered up to"):
        backup.receive(wire(Events(c.primary.epoch, backup.applied_seq + 1,  # type: ignore[arg-type]
                                   [R.Purged(R.PURGED, "/", "q", below - 1)])))


def test_a_delete_and_a_declare_between_the_slices_converge() -> None:
    c = Cluster(2)
    deep(c, 5000)
    c.follow("n2")
    c.pump()
    vhost = c.broker.vhosts["/"]
    held = vhost.queues["q"].get()  # acquired: the ranges are found in slices
    assert held is not None
    loop = sliced(c)
    vhost.purge_queue("q", None)
    loop.turn()
    c.pump()
    vhost.delete_queue("q", owner=None)
    vhost.declare_queue("q", owner=None, durable=True)
    publish(c.broker, b"new")
    loop.run()
    c.pump()
    same(c)
    assert consume(vhost.queues["q"]) == [b"new"]


def test_a_backup_joining_during_the_slices_converges() -> None:
    c = Cluster(3)
    deep(c, 5000)
    c.follow("n2")
    c.pump()
    loop = sliced(c)
    c.broker.vhosts["/"].purge_queue("q", None)
    loop.turn()
    c.follow("n3")  # its catch-up has none of the purged entries
    while loop.calls:
        loop.turn()
        c.pump()
    c.pump()
    same(c)
    assert c.primary.ready_backups() == ["n2", "n3"]


def test_a_packet_carries_at_most_work_per_packet_dequeued_positions() -> None:
    """A backup applies a packet in one step: bounded in entries touched, not only bytes
    (1 MiB of dequeue events was ~110,000 positions; issue 33)."""
    from brokerha.primary.remote_backup import WORK_PER_PACKET

    c = Cluster(2)
    n = 6 * WORK_PER_PACKET
    deep(c, n)
    c.follow("n2")
    c.pump()
    q = c.broker.vhosts["/"].queues["q"]
    held = q.get()  # acquired: the purge goes as dequeues
    assert held is not None
    c.broker.vhosts["/"].purge_queue("q", None)  # no slices here: all dequeues at once
    packets = c.primary.take_outbox("n2")
    work = [sum(len(e.positions) for e in p.events if e.kind == R.DEQUEUED) for p in packets]
    assert sum(work) == n - 1
    assert max(work) <= WORK_PER_PACKET and len(packets) >= 6
    backup = c.nodes["n2"].backup
    assert backup is not None
    for packet in packets:
        backup.receive(wire(packet))  # type: ignore[arg-type]
    q.settle(held)
    c.pump()
    same(c)
