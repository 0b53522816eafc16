"""The primary fails during a transaction: the new primary's verification phase decides."""

from __future__ import annotations

import asyncio
from typing import Any

from brokerha.broker.dtx import State, Xid
from brokerha.ha.simulation.transactions import contents
from brokerha.primary.primary import Primary
from brokerha.primary.verification import (
    COMMIT,
    IN_DOUBT,
    Verification,
    answer,
    carry_out,
)
from tests.ha.harness import Cluster, publish, settle, wire
from tests.ha.test_transactions import XID, bodies, dtx_prepared, joined, tx_work, world


def promote_verified(c: Cluster, name: str, epoch: int, peers: list[str]) -> dict[str, str]:
    """The primary is gone; ``name`` is elected, verifies with ``peers``, and they follow it."""
    c.primary.close()
    node = c.node(name)
    assert node.backup is not None
    node.backup.close()
    node.backup = None
    new = Primary(node.broker, me=name, members=len(c.nodes), epoch=epoch, start_seq=0,
                  clock=c.clock, backup_timeout=5.0)
    verification = Verification.start(node.broker, epoch, name, peers, c.clock.now, 2.0)
    request = wire(verification.request())
    for peer in peers:
        verification.receive(wire(answer(c.node(peer).broker, request, peer)))  # type: ignore[arg-type]
    assert verification.done(c.clock.now)
    decisions = carry_out(node.broker, verification)
    c.primary, c.primary_node, c.epoch = new, node, epoch
    c.silent.clear()
    c.no_ack.clear()
    for peer in peers:
        c.follow(peer)
    c.pump()
    return decisions


def same_everywhere(c: Cluster, *names: str) -> None:
    expected = contents(c.broker)
    for name in names:
        assert contents(c.node(name).broker) == expected, name


def test_an_open_tx_is_aborted_when_the_primary_fails() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", "n3", old=[b"old"])
        tx_work(c, "open", take=1)  # its accept (a td) opened it on the backups; its
        c.pump()                    # publishes would go only with its commit
        assert c.node("n2").backup.transactions.buffers  # type: ignore[union-attr]
        assert promote_verified(c, "n2", 2, ["n3"]) == {}
        assert bodies(c.broker, "q1") == []
        assert c.node("n3").backup.transactions.buffers == {}  # type: ignore[union-attr]
        same_everywhere(c, "n3")

    asyncio.run(scenario())


async def commit_reaching(c: Cluster, work: Any, reaches: set[str]) -> list[int]:
    """Run ``work`` (a commit) with only the backups in ``reaches`` hearing its outcome.

    Returns the durability barrier of its answer (``Broker.after_durable``, what
    commit-ok and XA_OK wait for): a list that stays empty while not released.
    """
    c.silent |= {"n2", "n3"} - reaches
    await settle(c, work)
    answered: list[int] = []
    c.broker.after_durable(lambda: answered.append(1))
    c.pump()
    return answered


async def tx_committed_on(c: Cluster, reaches: set[str]) -> None:
    """A TX whose commit (its one ``tc``) reaches only ``reaches``: no commit-ok yet."""
    world(c)
    publish(c.broker, b"old", rk="q3", persistent=True)
    c.follow("n2")
    c.follow("n3")
    c.pump()
    tx = tx_work(c, "t", take=1)
    c.pump()
    # every guarded backup acknowledges the commit before commit-ok
    assert await commit_reaching(c, tx.commit(), reaches) == []


def test_a_tx_whose_commit_reached_no_backup_is_gone_after_the_failover() -> None:
    async def scenario() -> None:
        c = Cluster(3)
        await tx_committed_on(c, reaches=set())
        assert bodies(c.broker, "q1") == [b"t-0", b"t-1", b"t-2"]  # the old primary applied it
        assert promote_verified(c, "n2", 2, ["n3"]) == {}  # no prepared record: no vote round
        assert bodies(c.broker, "q1") == [] and bodies(c.broker, "q3") == [b"old"]
        same_everywhere(c, "n3")

    asyncio.run(scenario())


def test_a_tx_whose_commit_reached_the_elected_backup_is_everywhere_after_the_failover() -> None:
    async def scenario() -> None:
        c = Cluster(3)
        await tx_committed_on(c, reaches={"n3"})
        assert promote_verified(c, "n3", 2, ["n2"]) == {}
        assert bodies(c.broker, "q1") == [b"t-0", b"t-1", b"t-2"]
        assert bodies(c.broker, "q3") == []
        same_everywhere(c, "n2")  # n2 never saw the tc: the catch-up brought the whole of it

    asyncio.run(scenario())


def test_a_prepared_dtx_another_node_committed_is_committed_by_the_new_primary() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", "n3")
        await dtx_prepared(c)
        txid = f"dtx:{XID.key}"
        assert await commit_reaching(c, c.broker.dtx.commit(XID), {"n3"}) == []
        assert txid in c.node("n2").broker.ha_transactions
        assert txid not in c.node("n3").broker.ha_transactions
        assert promote_verified(c, "n2", 2, ["n3"]) == {txid: COMMIT}
        assert bodies(c.broker, "q1") == [b"x-0", b"x-1", b"x-2"]
        assert c.broker.outcomes.committed(txid)
        assert c.broker.dtx.recover() == []
        same_everywhere(c, "n3")  # n3's copy, at the old primary's positions, was replaced

    asyncio.run(scenario())


def test_a_prepared_dtx_stays_in_doubt_and_the_tm_finishes_it_on_the_new_primary() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", "n3")
        await dtx_prepared(c)
        assert promote_verified(c, "n2", 2, ["n3"]) == {f"dtx:{XID.key}": IN_DOUBT}
        dtx = c.broker.dtx
        assert dtx.recover() == [XID]
        assert dtx.branches[XID].state is State.PREPARED
        # n3 joined after the adoption: it holds the branch prepared again, not yet ready
        assert list(c.node("n3").broker.ha_transactions) == [f"dtx:{XID.key}"]
        assert not c.primary.sessions["n3"].ready
        assert await settle(c, dtx.commit(XID)) == 0
        assert bodies(c.broker, "q1") == [b"x-0", b"x-1", b"x-2"]
        same_everywhere(c, "n3")
        assert c.node("n3").broker.ha_transactions == {}
        assert c.primary.ready_backups() == ["n3"]

    asyncio.run(scenario())


def test_a_dtx_rolled_back_after_a_failover_gives_back_what_it_consumed() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", "n3", old=[b"held"])
        dtx = c.broker.dtx
        xid = Xid(7, b"consume")
        branch = dtx.start(xid, "channel")
        q3 = c.broker.vhosts["/"].queues["q3"]
        entry = q3.get()
        branch.accept([(q3, entry)], [])
        dtx.end(xid, "channel")
        assert await settle(c, dtx.prepare(xid)) == 0
        promote_verified(c, "n3", 2, ["n2"])
        assert c.broker.dtx.recover() == [xid]
        assert bodies(c.broker, "q3") == []  # held by the in-doubt branch
        assert c.broker.dtx.rollback(xid) == 0
        c.pump()
        assert bodies(c.broker, "q3") == [b"held"]
        same_everywhere(c, "n2")

    asyncio.run(scenario())


def test_a_local_branch_committed_by_verification_records_its_outcome() -> None:
    """Found by the simulation (then tests/ha/tx_simulation.py, now brokerha/ha/simulation/transactions.py).

    A primary that adopted an in-doubt branch (a prepared branch of its own
    DtxManager, in its store), crashed and was elected again learns from a
    peer that the branch was committed. The commit was applied, but the
    restored branch has no tx-queue observer, so no outcome was recorded: the
    outcome read "unknown" everywhere (every catch-up copies this primary's).
    """
    from brokerha.broker.broker import Broker
    from brokerha.cluster.replication import VerifyReply
    from tests.ha.harness import message

    broker = Broker("n2")
    q = broker.add_vhost("/").declare_queue("q1", owner=None, durable=True)
    xid = Xid(9, b"adopted")
    txid = f"dtx:{xid.key}"
    broker.dtx.restore_prepared(xid, [([q], message(b"x", "q1", persistent=True))], [])
    verification = Verification.start(broker, 3, "n2", ["n1"], 0.0, 2.0)
    verification.receive(VerifyReply(3, "n1", [], [txid]))
    assert carry_out(broker, verification) == {txid: COMMIT}
    assert bodies(broker, "q1") == [b"x"]
    assert broker.outcomes.committed(txid)
    assert broker.dtx.recover() == []
