"""A primary that stops serving and is elected again keeps no stale transaction state.

Found by the transaction simulation once it ran real elections
(``ha/simulation/transactions.py``): a primary that lost its lease and won
the next epoch itself (no restart) still held

- an XA branch that was ended but not prepared, with the messages it had
  taken: the new Primary did not know those messages were taken, so a
  backup's catch-up missed them, and a failover then would lose them;
- a prepared branch whose observers were the stopped Primary's: its commit
  by the TM replicated as loose enqueues instead of a transaction, so a
  backup could hold part of it.

Now ``HACore.demote`` calls ``DtxManager.primary_stopped``.
"""

from __future__ import annotations

import asyncio

import pytest

from brokerha.broker.dtx import XA, State, XAError, Xid
from brokerha.cluster import election as el
from brokerha.ha.simulation.world import Faults, SimNode, World, message
from brokerha.primary.tx_observer import PrimaryTxObserver
from brokerha.primary.verification import IN_DOUBT, Verification, carry_out

XID = Xid(1, b"gtrid", b"b")


def settled_world() -> tuple[World, SimNode]:
    world = World(1, faults=Faults.none())
    world.start()
    world.run_until(3.0)
    primary = world.serving_now
    assert primary is not None
    vh = primary.broker.vhosts["/"]
    q = vh.declare_queue("q", owner=None, durable=True)
    for i in range(3):
        q.enqueue(message(b"m%d" % i, "q", persistent=True))
    world.run_until(4.0)
    return world, primary


def ready(node: SimNode) -> list[bytes]:
    return [e.message.body for e in node.broker.vhosts["/"].queues["q"].ready]


def re_elect(node: SimNode) -> None:
    """The primary steps down and wins the next epoch itself, as after a lost lease: what
    ``HAMember`` does on ``StopServing`` and then ``BecomePrimary`` (the epoch's votes aside)."""
    node.ha.carry_out([el.StopServing("lease lost (test)")])
    core = node.ha.core
    epoch = node.election.epoch + 1
    core.become_primary(epoch)
    verification = Verification.start(node.broker, epoch, node.name, [], 0.0, 1.0)
    assert carry_out(node.broker, verification) == {branch_key(): IN_DOUBT}
    core.verified()


def branch_key() -> str:
    return f"dtx:{XID.key}"


def test_an_unprepared_branch_is_rolled_back_with_the_primary_role() -> None:
    world, primary = settled_world()
    dtx = primary.broker.dtx
    q = primary.broker.vhosts["/"].queues["q"]
    branch = dtx.start(XID, "channel")
    entry = q.get()
    assert entry is not None
    branch.accept([(q, entry)], [])
    dtx.end(XID, "channel")
    assert ready(primary) == [b"m1", b"m2"]
    primary.ha.carry_out([el.StopServing("lease lost (test)")])
    assert XID not in dtx.branches
    assert ready(primary) == [b"m0", b"m1", b"m2"]  # back before any new primary's catch-up
    with pytest.raises(XAError) as refused:
        asyncio.run(dtx.prepare(XID))
    assert refused.value.code is XA.ER_NOTA


def test_a_prepared_branch_gets_the_next_primary_roles_observers() -> None:
    world, primary = settled_world()
    dtx = primary.broker.dtx
    branch = dtx.start(XID, "channel")
    q = primary.broker.vhosts["/"].queues["q"]
    branch.publish([q], message(b"x", "q", persistent=True))
    dtx.end(XID, "channel")

    async def prepare() -> XA:
        task = asyncio.ensure_future(dtx.prepare(XID))
        while not task.done():
            world.run_until(world.now + 0.01)
            await asyncio.sleep(0)
        return task.result()

    assert asyncio.run(prepare()) is XA.OK and branch.state is State.PREPARED
    old = primary.primary
    re_elect(primary)
    new = primary.primary
    assert new is not None and new is not old and primary.ha.phase == "primary"
    observers = [o for o in branch.observers if isinstance(o, PrimaryTxObserver)]
    assert observers and all(o.primary is new for o in observers)


def test_a_branch_whose_prepare_record_is_being_written_leaves_no_record_behind() -> None:
    """Found by the transaction simulation (seed 2565 of the slow run): a primary paused
    while a branch's prepared record was being written stepped down on resume
    (``primary_stopped`` rolled the branch back), then the write completed: the prepare
    answered XA_OK for a branch gone, and the record stayed on disk, so a restart
    brought the branch back, in doubt, after its TM had rolled it back."""
    from brokerha.broker.broker import Broker
    from brokerha.broker.dtx import DtxManager

    async def scenario() -> None:
        broker = Broker("n1")
        q = broker.add_vhost("/").declare_queue("q", owner=None, durable=True)
        dtx = DtxManager([], lambda: 0.0)
        records: dict[Xid, object] = {}
        waiting: list[object] = []

        def persist(branch: object, done: object) -> None:
            records[XID] = branch
            waiting.append(done)

        dtx.persist_prepared = persist  # type: ignore[assignment]
        dtx.forget_prepared = lambda xid: records.pop(xid, None)  # type: ignore[assignment]
        branch = dtx.start(XID, "channel")
        branch.publish([q], message(b"x", "q", persistent=True))
        dtx.end(XID, "channel")
        prepare = asyncio.ensure_future(dtx.prepare(XID))
        while not waiting:
            await asyncio.sleep(0)
        assert dtx.primary_stopped() == [XID]  # the node steps down while the record is written
        waiting.pop()()  # type: ignore[operator]
        with pytest.raises(XAError) as lost:
            await prepare
        assert lost.value.code is XA.ER_RMFAIL
        assert records == {} and XID not in dtx.branches

    asyncio.run(scenario())
