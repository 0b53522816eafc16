"""A purge on the primary, its entries let go of in slices: the backups end equal.

Issue 33: a purge of a deep queue ran on the primary's loop in one go. Now
the queue is empty at once and the per-entry rest runs in slices between loop
turns (``broker/drain.py``); live traffic, a delete and a join go on between
them. The backups get the purge in one ``pg`` event when nothing was acquired
on the queue (and empty their copy at once, letting go of it in slices of
their own), in one ``pr`` of the purged ranges when entries were acquired
(their copy keeps those), else (a priority queue, or a copy to scan too long)
as dequeue events of at most ``DEQUEUES_PER_EVENT`` positions
(``Primary.purged``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from brokerha.broker.broker import Broker
from brokerha.cluster import replication as R
from brokerha.cluster.replication import Events, ReplicationError
from brokerha.ha.simulation.world import wire
from brokerha.primary.events import DEQUEUES_PER_EVENT
from brokerha.store.factory import open_store
from tests.broker.test_purge import Loop
from tests.ha.harness import Cluster, consume, publish
from tests.ha.test_replication import same

STEP = 1000


def sliced(c: Cluster) -> Loop:
    loop = Loop()
    background = c.broker.background
    background.schedule, background.entries, background.seconds = loop.call_soon, STEP, 0.0
    return loop


def deep(c: Cluster, n: int, arguments: dict[str, Any] | None = None) -> None:
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True, arguments=arguments)
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


def test_a_purge_with_acquired_entries_goes_as_one_event_and_keeps_them() -> None:
    """A consumer's unacknowledged deliveries are not purged: one ``pr`` of the purged
    ranges (found in slices), the backup's copy keeps the acquired entries -- one
    requeued and one acknowledged while the purge runs -- and what came in since."""
    c = Cluster(2)
    n = 3 * DEQUEUES_PER_EVENT + 10
    deep(c, n)
    c.follow("n2")
    c.pump()
    q = c.broker.vhosts["/"].queues["q"]
    first, requeued, kept = q.get(), q.get(), q.get()
    assert first is not None and requeued is not None and kept is not None
    q.requeue(requeued)  # ready again, behind an acquired head: ranges [(2, 2), (4, n)]
    loop = sliced(c)
    backup_broker = c.node("n2").broker
    assert c.broker.vhosts["/"].purge_queue("q", None) == n - 2
    q.settle(first)  # acknowledged while the ranges are found
    publish(c.broker, b"live")
    events: list[Any] = []
    while loop.calls:
        loop.turn()
        events += carry(c, "n2")
    purges = [e for e in events if e.kind == R.PURGED_RANGES]
    assert len(purges) == 1 and [list(r) for r in purges[0].ranges] == [[2, 2], [4, n]]
    assert [e.positions for e in events if e.kind == R.DEQUEUED] == [[first.position]]
    backup_q = backup_broker.vhosts["/"].queues["q"]
    assert [e.position for e in backup_q.ready] == [kept.position, n + 1]  # and "live"
    q.settle(kept)
    c.pump()
    same(c)


@pytest.mark.parametrize("why", ["priorities", "scan"])
def test_a_purge_a_backup_could_not_take_at_once_goes_as_bounded_dequeues(
        why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A priority queue's copy is not in position order, and a copy with many entries
    outside the purge's last range would be scanned in one step: ``d`` events then."""
    from brokerha.primary import primary

    c = Cluster(2)
    n = 3 * DEQUEUES_PER_EVENT + 10
    deep(c, n, {"x-max-priority": 5} if why == "priorities" else None)
    c.follow("n2")
    c.pump()
    q = c.broker.vhosts["/"].queues["q"]
    held = q.get()
    assert held is not None
    if why == "scan":  # the entry held is the 151st: a first range of 150 before the last
        monkeypatch.setattr(primary, "PURGE_RANGES_SCAN", 100)
        taken = [held] + [q.get() for _ in range(199)]
        held = taken[150]
        for e in taken:
            assert e is not None
            if e is not held:
                q.requeue(e)
    loop = sliced(c)
    c.broker.vhosts["/"].purge_queue("q", None)
    sizes: list[int] = []
    while loop.calls:
        loop.turn()
        events = carry(c, "n2")
        assert not [e for e in events if e.kind in (R.PURGED, R.PURGED_RANGES)]
        sizes += [len(e.positions) for e in events if e.kind == R.DEQUEUED]
    assert sum(sizes) == n - 1 and max(sizes) <= DEQUEUES_PER_EVENT
    assert held is not None
    q.settle(held)
    c.pump()
    same(c)


def test_a_backup_whose_copy_misses_a_purged_position_joins_again() -> None:
    """Fails closed: a ``pr`` naming a position the copy does not hold (a copy that is not
    the primary's) changes nothing and raises."""
    c = Cluster(2)
    deep(c, 10)
    backup = c.follow("n2")
    c.pump()
    backup_q = c.node("n2").broker.vhosts["/"].queues["q"]
    with pytest.raises(ReplicationError, match="positions purged"):
        backup.receive(wire(Events(c.primary.epoch, backup.applied_seq + 1,  # type: ignore[arg-type]
                                   [R.PurgedRanges(R.PURGED_RANGES, "/", "q", [[3, 13]])])))
    assert [e.position for e in backup_q.ready] == list(range(1, 11))


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
    deep(c, n, {"x-max-priority": 2})
    c.follow("n2")
    c.pump()
    q = c.broker.vhosts["/"].queues["q"]
    held = q.get()  # acquired, on a queue with priorities: the purge goes as dequeues
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


def test_a_backup_restarted_after_a_purge_of_ranges_finds_the_kept_messages(
        tmp_path: Path) -> None:
    """The ``pr``'s one store record (the purged ranges): a backup restarted from its
    store holds the acquired entries the purge left and what came after, nothing else."""
    url = f"sqlite:///{tmp_path / 'n2.db'}"
    c = Cluster(2, stores={"n2": open_store(url, tmp_path)})
    q = c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    c.follow("n2")
    for i in range(50):
        publish(c.broker, b"%d" % i, persistent=True)
    c.pump()
    held = [q.get(), q.get()]
    q.requeue(held.pop(0))  # kept: the second message, acquired
    c.broker.vhosts["/"].purge_queue("q", None)
    publish(c.broker, b"after", persistent=True)
    events = carry(c, "n2")
    assert [e.kind for e in events if e.kind != R.ENQUEUED] == [R.PURGED_RANGES]
    c.pump()
    c.node("n2").broker.store.close()

    store = open_store(url, tmp_path)
    broker = Broker("n2", clock=c.clock, store=store)
    broker.restore(store.load())
    assert [e.message.body for e in broker.vhosts["/"].queues["q"].ready] == [b"1", b"after"]
    store.close()


@pytest.mark.parametrize("how", ["expiry", "trim"])
def test_an_expiry_or_a_trim_reaches_the_backup_as_one_event_a_slice(how: str) -> None:
    """A slice of an expiry or of a length trim off the head of a deep queue goes as one
    ``pr`` (``Queue._discard``), not a ``d`` per message: the backup takes the slice off
    its head (its copy's long rest untouched) and ends equal, its acquired entry kept."""
    c = Cluster(2)
    n = 5000
    deep(c, n, {"x-message-ttl": 600_000})
    c.follow("n2")
    c.pump()
    vhost = c.broker.vhosts["/"]
    q = vhost.queues["q"]
    held = q.get()  # acquired: not discarded, kept by the backup
    assert held is not None
    if how == "expiry":
        for entry in list(q.ready)[:3 * STEP]:
            entry.expires_at = 0.0
        loop = sliced(c)
        vhost.tick(q.clock())
        loop.run()
    else:
        q.max_length = n - 1 - 3 * STEP
        while q.drop_head(STEP):
            pass
    events = carry(c, "n2")
    assert [e.kind for e in events] == [R.PURGED_RANGES] * 3
    assert [list(r) for r in events[0].ranges] == [[2, STEP + 1]]  # position 1 held
    backup_q = c.node("n2").broker.vhosts["/"].queues["q"]
    assert backup_q.message_count == n - 3 * STEP and backup_q.ready.peek().position == 1
    q.settle(held)
    c.pump()
    same(c)
