"""A purge on the primary, its entries let go of in slices: the backups end equal.

Issue 33: a purge of a deep queue ran on the primary's loop in one go. Now
the queue is empty at once and the per-entry rest (the Primary's ``dequeued``,
joined into dequeue events of at most ``DEQUEUES_PER_EVENT`` positions) runs
in slices between loop turns (``broker/drain.py``); live traffic, a delete
and a join go on between them.
"""

from __future__ import annotations

from brokerha.cluster import replication as R
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


def carry_dequeues(c: Cluster, name: str) -> list[int]:
    """One flush to ``name``, applied and acknowledged: the sizes of its dequeue events."""
    backup = c.nodes[name].backup
    assert backup is not None
    sizes = []
    packets = c.primary.take_outbox(name)
    for packet in packets:
        sizes += [len(e.positions) for e in packet.events if e.kind == R.DEQUEUED]
        backup.receive(wire(packet))  # type: ignore[arg-type]
    if packets:
        c.primary.backup_acked(name, backup.applied_seq)
    return sizes


def test_a_sliced_purge_reaches_the_backup_as_bounded_dequeues() -> None:
    c = Cluster(2)
    n = 3 * DEQUEUES_PER_EVENT + 10
    deep(c, n)
    c.follow("n2")
    c.pump()
    loop = sliced(c)
    assert c.broker.vhosts["/"].purge_queue("q", None) == n
    backup_q = c.node("n2").broker.vhosts["/"].queues["q"]
    sizes: list[int] = []
    while loop.calls:
        loop.turn()
        publish(c.broker, b"live")  # between two slices
        sizes += carry_dequeues(c, "n2")
    c.pump()
    same(c)
    assert sum(sizes) == n and max(sizes) <= STEP  # one event per slice here
    assert [e.message.body for e in backup_q.ready] == [b"live"] * len(sizes)


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
    c.broker.vhosts["/"].purge_queue("q", None)  # no slices here: all dequeues at once
    packets = c.primary.take_outbox("n2")
    work = [sum(len(e.positions) for e in p.events if e.kind == R.DEQUEUED) for p in packets]
    assert sum(work) == n
    assert max(work) <= WORK_PER_PACKET and len(packets) >= 6
    backup = c.nodes["n2"].backup
    assert backup is not None
    for packet in packets:
        backup.receive(wire(packet))  # type: ignore[arg-type]
    c.pump()
    same(c)
