"""HANode's acknowledgements as a backup (the glue around ``Backup``), with a fake link."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from brokerha.cluster.replication import Ack, Events, Join
from brokerha.ha.simulation.disk import DiskStore
from brokerha.node.cluster_config import ClusterConfig, ClusterMember
from brokerha.node.ha import HANode
from tests.ha.harness import Cluster, wire


class FakeLinks:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def connected(self, peer: str) -> bool:
        return True

    def send(self, peer: str, message: Any, msg_id: int | None = None) -> int:
        self.sent.append(wire(message))
        return 1


def backup_node(tmp_path: Path, store: DiskStore | None = None,
                ) -> tuple[DiskStore, Cluster, HANode, FakeLinks]:
    """An HANode as backup n2 (its links faked) of an in-process primary n1."""
    store = store or DiskStore()
    c = Cluster(2, stores={"n2": store})
    members = [ClusterMember(n, ("127.0.0.1", 5672 + i), ("127.0.0.1", 15672 + i),
                             ("127.0.0.1", 25672 + i)) for i, n in enumerate(["n1", "n2"])]
    node = SimpleNamespace(config=SimpleNamespace(name="n2", data_dir=tmp_path),
                           broker=c.node("n2").broker,
                           admin=SimpleNamespace(route=lambda *a, **k: None),
                           set_relay_target=lambda target: None, txlog=None)
    ha = HANode(node, ClusterConfig("dc", b"secret", members))  # type: ignore[arg-type]
    links = FakeLinks()
    ha.links = links  # type: ignore[assignment]
    return store, c, ha, links


def test_a_backup_that_joins_again_while_an_ack_waits_for_the_disk_still_acks_its_catch_up(
        tmp_path: Path) -> None:
    """Found by the transaction simulation (then tests/ha/tx_simulation.py, now brokerha/ha/simulation/transactions.py).

    The pending acknowledgement was one flag per node: a Backup replaced (a
    new primary, or joining again after a replication error) while the old
    one's ack waited for the store sync had its whole catch-up applied
    without an ack scheduled, and the old callback returned early; the
    primary saw it catching up (and its position stayed invalid) until some
    later event happened to arrive.
    """
    store, c, ha, links = backup_node(tmp_path)

    def answer_join() -> None:
        join = links.sent.pop()
        assert isinstance(join, Join)
        c.primary.backup_joined(join)
        for packet in c.primary.take_outbox("n2"):
            ha.ha.core.on_events("n1", wire(packet))  # type: ignore[arg-type]

    ha.ha._become_backup(1, "n1")
    answer_join()                       # the catch-up applied; its ack waits for the disk
    assert links.sent == []
    backup = ha.ha.backup
    assert backup is not None and backup.caught_up
    gap = Events(1, backup.applied_seq + 5, [["d", "/", "q", [1]]])
    ha.ha.core.on_events("n1", gap)            # a replication error: a new Backup joins again
    assert ha.ha.backup is not backup
    answer_join()                       # the new catch-up, applied while the old ack waits
    store.sync()
    acks = [m for m in links.sent if isinstance(m, Ack)]
    assert acks and acks[-1].seq == c.primary.sessions["n2"].join_seq
    c.primary.backup_acked("n2", acks[-1].seq)
    assert c.primary.ready_backups() == ["n2"]


def test_an_ack_that_waited_for_the_disk_across_a_new_join_does_not_make_the_position_valid(
        tmp_path: Path) -> None:
    """Found by the transaction simulation (then tests/ha/tx_simulation.py, now brokerha/ha/simulation/transactions.py).

    The link drops while an acknowledgement waits for the disk, and the
    backup joins again (the same Backup, a new session): from then on its
    state is a catch-up in progress. The old callback used to set the
    election position back to the old, valid one (and send the old
    session's ack), so a node in the middle of a catch-up could stand and
    win an election.
    """
    store, c, ha, links = backup_node(tmp_path)
    ha.ha._become_backup(1, "n1")
    join = links.sent.pop()
    c.primary.backup_joined(join)
    for packet in c.primary.take_outbox("n2"):
        ha.ha.core.on_events("n1", wire(packet))  # type: ignore[arg-type]
    ha.ha.core.send_join()                     # the link came back: join again, same Backup
    assert isinstance(links.sent.pop(), Join)
    store.sync()                        # the first session's ack completes now
    assert not [m for m in links.sent if isinstance(m, Ack)]
    assert ha.election.position.seq == -1 and ha.election.position.epoch == -1


def test_a_backup_acknowledges_replicated_dequeues_later_and_everything_else_at_once(
        tmp_path: Path) -> None:
    """Dequeues (a consumer's acks) wait for nobody: their ack may come later, or with the next.

    Anything else (here a publish) is acknowledged once the store synced it,
    and that acknowledgement covers the dequeues applied before it; dequeues
    alone are acknowledged ``DEQUEUE_ACK_DELAY`` later.
    """
    import asyncio

    from brokerha.ha import core as core_module
    from tests.ha.harness import consume, publish

    async def scenario() -> None:
        store, c, ha, links = backup_node(tmp_path)

        def deliver() -> None:
            for packet in c.primary.take_outbox("n2"):
                ha.ha.core.on_events("n1", wire(packet))  # type: ignore[arg-type]

        def acks() -> list[int]:
            found = [m.seq for m in links.sent if isinstance(m, Ack)]
            links.sent.clear()
            return found

        q = c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
        ha.ha._become_backup(1, "n1")
        c.primary.backup_joined(links.sent.pop())
        deliver()
        store.sync()
        assert acks() == [c.primary.seq]  # the catch-up: acknowledged once synced

        publish(c.broker, b"one")
        publish(c.broker, b"two")
        deliver()
        assert store.waiting, "a publish is acknowledged after a sync"
        store.sync()
        assert acks() == [c.primary.seq]

        assert consume(q, 1) == [b"one"]
        deliver()                          # a dequeue only
        assert not store.waiting and acks() == []
        dequeued = c.primary.seq
        await asyncio.sleep(core_module.DEQUEUE_ACK_DELAY * 3)
        store.sync()
        assert acks() == [dequeued]        # later, on its own

        assert consume(q, 1) == [b"two"]
        deliver()                          # another dequeue, then a publish before the delay
        publish(c.broker, b"three")
        deliver()
        store.sync()
        assert acks() == [c.primary.seq]   # one ack covers both
        await asyncio.sleep(core_module.DEQUEUE_ACK_DELAY * 3)
        store.sync()
        assert acks() == []                # the deferred one was folded into it

    asyncio.run(scenario())


def test_a_barrier_right_after_dequeues_is_acknowledged_without_the_delay(
        tmp_path: Path) -> None:
    """A reply or confirm that waits on dequeues only does not wait ``DEQUEUE_ACK_DELAY``.

    Here the confirm of an unroutable message: it emits nothing of its own,
    so its barrier lands on the last event, a consumer's ack. The primary
    follows it with an ``a`` event, which the backup acknowledges at once.
    """
    import asyncio

    from brokerha.cluster import replication as R
    from tests.ha.harness import consume, publish

    async def scenario() -> None:
        store, c, ha, links = backup_node(tmp_path)
        c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
        q = c.broker.vhosts["/"].queues["q"]
        ha.ha._become_backup(1, "n1")
        c.primary.backup_joined(links.sent.pop())

        def deliver() -> list[Any]:
            events = []
            for packet in c.primary.take_outbox("n2"):
                events.extend(packet.events)
                ha.ha.core.on_events("n1", wire(packet))  # type: ignore[arg-type]
            store.sync()
            acks = [m.seq for m in links.sent if isinstance(m, Ack)]
            links.sent.clear()
            if acks:
                c.primary.backup_acked("n2", acks[-1])
            return events

        publish(c.broker, b"one")
        deliver()  # the catch-up and "one" (two packets: two acknowledgements, two syncs)
        deliver()
        assert consume(q, 1) == [b"one"]
        released: list[str] = []
        c.broker.replication_barriers[0](lambda: released.append("confirm"))  # Primary.barrier
        events = deliver()
        assert [e[0] for e in events] == [R.DEQUEUED, R.ACK_PROMPTLY]
        assert released == ["confirm"], "acknowledged at once, not DEQUEUE_ACK_DELAY later"
        assert ha.ha.core._deferred_ack is None

        c.primary.barrier(lambda: released.append("again"))  # nothing new: no marker
        assert released == ["confirm", "again"] and deliver() == []

    asyncio.run(scenario())
