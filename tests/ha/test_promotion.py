"""A backup becomes primary; the old primary comes back as its backup."""

from __future__ import annotations

import pytest

from brokerha.backup.backup import Backup
from brokerha.ha.simulation.transactions import contents
from brokerha.primary.primary import POSITION_EPOCH_SHIFT, Primary
from tests.ha.harness import Cluster, carry, consume, publish, wire


def promote(c: Cluster, name: str, epoch: int) -> Primary:
    """``name`` stops following and becomes the primary of ``epoch``; the old one is gone."""
    c.primary.close()
    node = c.node(name)
    assert node.backup is not None
    node.backup.close()
    node.backup = None
    return Primary(node.broker, me=name, members=len(c.nodes), epoch=epoch, start_seq=0,
                   clock=c.clock, backup_timeout=5.0)


def test_positions_continue_above_every_replicated_one_after_promotion() -> None:
    c = Cluster(3)
    vh = c.broker.vhosts["/"]
    vh.declare_queue("q", owner=None, durable=True)
    c.follow("n2")
    c.follow("n3")
    for i in range(5):
        publish(c.broker, b"%d" % i)
    c.pump()
    new = promote(c, "n2", epoch=2)
    q2 = c.node("n2").broker.vhosts["/"].queues["q"]
    highest = max(e.position for e in q2.ready)
    assert q2.next_position == max(highest + 1, 2 << POSITION_EPOCH_SHIFT)
    publish(c.node("n2").broker, b"after")
    positions = [e.position for e in q2.ready]
    assert positions == sorted(positions) and positions[-1] > highest
    assert new.seq == 1


def deposed_primary_rejoins(consumed: int) -> tuple[Cluster, Primary, list[bytes]]:
    """n1 enqueues "lost" (and consumes ``consumed``) unreplicated, n2 takes over, n1 rejoins."""
    c = Cluster(3)
    q = c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    c.follow("n2")
    c.follow("n3")
    for i in range(3):
        publish(c.broker, b"kept%d" % i)
    c.pump()
    c.silent |= {"n2", "n3"}
    publish(c.broker, b"lost")  # on the old primary only: never confirmed
    consume(q, consumed)        # an acknowledgement nobody else saw
    new = promote(c, "n2", epoch=2)
    b2 = c.node("n2").broker
    publish(b2, b"fresh")       # a new id, not the one "lost" has on n1
    old = Backup(c.broker, me="n1", epoch=2, position=(1, 5))
    new.backup_joined(wire(old.join_message()))  # type: ignore[arg-type]
    while carry(new, old):
        pass
    assert contents(c.broker) == contents(b2)
    return c, new, consume(q)


def test_a_deposed_primary_drops_what_it_never_replicated() -> None:
    _, new, bodies = deposed_primary_rejoins(consumed=0)
    assert bodies == [b"kept0", b"kept1", b"kept2", b"fresh"]
    catch_up = new.status()["backups"]["n1"]["catch_up"]
    assert {k: catch_up[k] for k in ("sent", "skipped", "dropped")} == {"sent": 1, "skipped": 3, "dropped": 1}


def test_what_a_deposed_primary_consumed_alone_comes_back_in_order() -> None:
    # n1 lacks kept0 but keeps later ids: they are resent so the queue stays in order
    _, new, bodies = deposed_primary_rejoins(consumed=1)
    assert bodies == [b"kept0", b"kept1", b"kept2", b"fresh"]
    catch_up = new.status()["backups"]["n1"]["catch_up"]
    assert {k: catch_up[k] for k in ("sent", "skipped", "dropped")} == {"sent": 4, "skipped": 0, "dropped": 3}


def test_a_promoted_backup_keeps_time_again() -> None:
    c = Cluster(2)
    vh = c.broker.vhosts["/"]
    vh.declare_queue("ttl", owner=None, arguments={"x-message-ttl": 1000})
    c.follow("n2")
    publish(c.broker, b"m", rk="ttl")
    c.pump()
    b2 = c.node("n2").broker
    assert not b2.vhosts["/"].timed_queues
    promote(c, "n2", epoch=2)
    c.clock.now += 2
    b2.tick()
    assert b2.vhosts["/"].queues["ttl"].message_count == 0


def test_a_backup_refuses_a_broker_a_primary_still_observes() -> None:
    c = Cluster(2)
    with pytest.raises(RuntimeError):
        Backup(c.broker, me="n1", epoch=1, position=(0, 0))
    c.primary.close()
    assert c.broker.replication_barriers == []
    assert c.primary not in c.broker.observers.configuration
    assert not any(getattr(m, "__self__", None) is c.primary
                   for name in ("enqueued", "acquired", "dequeued", "requeued")
                   for m in getattr(c.broker.observers.queue_hooks, name))
    Backup(c.broker, me="n1", epoch=2, position=(1, 0))


def test_a_new_primary_answers_nothing_from_its_inherited_state_before_a_majority_holds_it() -> None:
    """Found by the transaction simulation (seed 1001 of the slow run).

    A primary is elected ahead of voters that lack its last events; at seq 0 of
    its epoch its state is what it inherited, held by it alone. A barrier (an XA
    recover, an outcome, a declare-ok) must wait until a majority acknowledged
    it, or a TM reads an outcome that the next election loses.
    """
    from brokerha.cluster.quorum import replicated_seq

    assert replicated_seq(0, {}, [], 3) == -1
    assert replicated_seq(0, {"n2": 0}, ["n2"], 3) == 0
    c = Cluster(3)  # a fresh primary, no backup joined yet
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    released: list[str] = []
    c.primary.barrier(lambda: released.append("answer"))
    assert released == []
    c.follow("n2")
    c.pump()  # n2 catches up and acknowledges: a majority (n1, n2) holds the state
    assert released == ["answer"]
