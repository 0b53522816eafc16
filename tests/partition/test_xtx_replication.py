"""Cross-partition branches and their records on a replication group (partition/xtx_broker.py).

A primary (``n1``) and its backup (``n2``), the product's ``Primary`` and
``Backup``, with ``BrokerTransactions`` on the primary's broker: the
decider's records are today's outcome records, replicated today's way (a
commit's ``tc``, a prepared branch's ``tr``; a tombstone, which no
transaction event carries, as a ``to`` of its own), so a backup promoted
holds the decision; its verification keeps a prepared cross-partition
branch for ``DecisionRules`` (``resolve``), not for a TM's ``recover``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from brokerha.broker.content import build_header
from brokerha.broker.dtx import XA, Xid
from brokerha.broker.message import Message
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK
from brokerha.cluster.replication import HA_ID
from brokerha.partition.forward import ForwardMessage
from brokerha.partition.xtx import (
    DecisionRules,
    Status,
    ToPartition,
    WhenDurable,
    XBranch,
    XOutcome,
    XOutcomeReply,
    xtx_txid,
)
from brokerha.partition.xtx_broker import BrokerTransactions
from brokerha.primary.verification import IN_DOUBT, RESOLVE, ROLLBACK, Verification, carry_out
from tests.ha.harness import Cluster, carry

GTXID = "0000000000100000000-n9"
HA_ID_Q = "1.1"  # the queue's x-ha-id: a branch's publish names it so


def spawn(work: Any, on_done: Callable[[BaseException | None], None]) -> None:
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: on_done(None if t.cancelled() else t.exception()))


def group(partition: int = 0) -> tuple[Cluster, BrokerTransactions, list[tuple[str, bool]]]:
    """``n1`` the primary of partition ``partition``'s group, ``n2`` its caught-up backup."""
    c = Cluster(2)
    c.broker._spawn = spawn  # a node's broker has its spawner; the harness's has none
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True,
                                      arguments={HA_ID: HA_ID_Q})
    c.follow("n2")
    c.pump()
    reports: list[tuple[str, bool]] = []
    txs = BrokerTransactions(c.broker, partition, lambda g, ok: reports.append((g, ok)))
    return c, txs, reports


def branch(partition: int = 0, decider: int = 0) -> XBranch:
    body = b"m"
    return XBranch(GTXID, partition, decider, (0, 1), "n9",
                   (ForwardMessage("/", (HA_ID_Q,), "", "q", build_header(len(body)), body),))


async def run(c: Cluster, rounds: int = 30) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)
        c.pump()


def record(c: Cluster, node: str, partition: int = 0) -> str | None:
    found = c.node(node).broker.outcomes.get(xtx_txid(partition, GTXID))
    return None if found is None else found[2]


def test_the_deciders_tombstone_reaches_its_backups_as_a_to_event() -> None:
    c, txs, _ = group()
    rules = DecisionRules(0, txs)
    effects = rules.receive(c.clock(), XOutcome(GTXID, 1))
    assert effects == [WhenDurable(ToPartition(1, XOutcomeReply(GTXID, ROLLED_BACK)))]
    c.pump()
    assert record(c, "n1") == record(c, "n2") == ROLLED_BACK
    # the promoted backup refuses the late commit from the record
    assert BrokerTransactions(c.node("n2").broker, 0, lambda g, ok: None).status(
        GTXID) is Status.ROLLED_BACK


def test_a_commit_is_the_tc_and_its_record_on_the_backup() -> None:
    async def scenario() -> None:
        c, txs, reports = group()
        txs.prepare(branch())
        await run(c)
        assert reports == [(GTXID, True)]
        backup = c.node("n2").broker
        assert list(backup.ha_transactions) == [xtx_txid(0, GTXID)]  # the tp, voted on
        txs.commit(GTXID)
        c.pump()
        assert record(c, "n1") == record(c, "n2") == COMMITTED
        assert not backup.ha_transactions and backup.vhosts["/"].queues["q"].message_count == 1
        promoted = BrokerTransactions(backup, 0, lambda g, ok: None)
        assert promoted.status(GTXID) is Status.COMMITTED
    asyncio.run(scenario())


def test_a_rollback_decided_while_the_prepare_awaits_its_votes() -> None:
    async def scenario() -> None:
        c, txs, reports = group()
        txs.prepare(branch())
        for _ in range(3):
            await asyncio.sleep(0)  # the prepare's tp is out, its votes not back
        [work] = c.broker.dtx.branches.values()
        assert work.preparing
        txs.rollback(GTXID)  # XRollback, or the decider's tombstone
        assert txs.status(GTXID) is Status.ROLLED_BACK  # the decision: the record, now
        await run(c)
        assert reports == [(GTXID, False)]
        assert not c.broker.dtx.branches and not c.node("n2").broker.ha_transactions
        assert record(c, "n2") == ROLLED_BACK
        assert c.broker.vhosts["/"].queues["q"].message_count == 0
    asyncio.run(scenario())


def test_verification_keeps_a_cross_partition_branch_for_its_decision_rules() -> None:
    async def scenario() -> None:
        c, txs, reports = group(partition=1)
        txs.prepare(branch(partition=1, decider=0))
        ordinary = Xid(1, b"a TM's", b"b")
        dtx = c.broker.dtx
        work = dtx.start(ordinary, "channel")
        work.publish([c.broker.vhosts["/"].queues["q"]], Message("", "q", build_header(1), b"x"))
        dtx.end(ordinary, "channel")
        prepared = asyncio.ensure_future(dtx.prepare(ordinary))
        await run(c)
        assert reports == [(GTXID, True)] and prepared.result() is XA.OK
        # n1 is gone; n2, promoted, verifies with nobody else
        n2 = c.node("n2").broker
        verification = Verification.start(n2, 2, "n2", [], c.clock(), 1.0)
        decisions = carry_out(n2, verification)
        assert decisions == {xtx_txid(1, GTXID): RESOLVE, f"dtx:{ordinary.key}": IN_DOUBT}
        assert n2.dtx.recover() == [ordinary]  # the TM's; not the cross-partition branch
        rules = DecisionRules(1, BrokerTransactions(n2, 1, lambda g, ok: None))
        [doubt] = rules.txs.in_doubt()
        assert doubt.branch == XBranch(GTXID, 1, 0, (0, 1), "")
        c.clock.now += 2.0
        assert rules.tick(c.clock()) == [ToPartition(0, XOutcome(GTXID, 1))]
        rules.receive(c.clock(), XOutcomeReply(GTXID, COMMITTED))
        assert n2.vhosts["/"].queues["q"].message_count == 1
        assert n2.outcomes.committed(xtx_txid(1, GTXID))
    asyncio.run(scenario())


def test_a_branch_whose_rollback_came_before_its_tr_is_rolled_back_by_the_verification() -> None:
    """The decision (its record, a ``to``) reached the backup while the prepare was open; the
    primary died before the ``tr``: the promoted backup finishes the branch from the record
    instead of keeping it prepared for ever (``in_doubt`` skips a decided branch)."""
    async def scenario() -> None:
        c, txs, reports = group()
        txs.prepare(branch())
        for _ in range(3):
            await asyncio.sleep(0)
        txs.rollback(GTXID)
        backup = c.node("n2").backup
        assert backup is not None
        carry(c.primary, backup, ack=False)  # tb, te, tp, to: no votes, so no tr yet
        n2 = c.node("n2").broker
        assert list(n2.ha_transactions) == [xtx_txid(0, GTXID)] and record(c, "n2") == ROLLED_BACK
        decisions = carry_out(n2, Verification.start(n2, 2, "n2", [], c.clock(), 1.0))
        assert decisions == {xtx_txid(0, GTXID): ROLLBACK}
        assert not n2.ha_transactions and not n2.dtx.branches
    asyncio.run(scenario())
