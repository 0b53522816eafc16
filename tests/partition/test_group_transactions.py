"""Transaction state per replication group on a partitioned node (docs/ha.md "Partitions").

One broker holds the transactions of every group the node is in. A
transaction's group is in its name (``tx_outcomes.group_of``: ``g<group>/``,
given by the group's primary: a TX's tx-queue, a cross-partition branch's
``xtx_txid``), or for an XA branch in ``DtxBranch.group`` (set by the scoped
primary that replicates it). So a group's demotion rolls back only its own
unprepared branches, its catch-up sends only its own outcomes and replaces
only those on the backup, its join releases only its own branches and its
verification settles only its own transactions. With one group (no scope)
every call is today's.
"""

from __future__ import annotations

import asyncio

import pytest

from brokerha.amqp.dtx_control import parse_xid
from brokerha.backup.tx_buffer import DtxBuffer
from brokerha.broker.dtx import XA, XTX_FORMAT, XAError, Xid
from brokerha.broker.tx_outcomes import COMMITTED, group_of, in_group
from brokerha.partition.xtx import XBranch, branch_of, xid_of, xtx_txid
from brokerha.primary.verification import IN_DOUBT, Verification
from tests.clock import Clock
from tests.ha.harness import Node, message
from tests.partition.test_group_scopes import G1, G2, joined, primary, queue

GTXID = "0000000000100000000-n9"


def xtx_branch(node: Node, partition: int) -> Xid:
    """An ended, unprepared branch of partition ``partition`` (group ``partition + 1``)."""
    xid = xid_of(XBranch(GTXID, partition, 0, (0, 1), "n9"))
    work = node.broker.dtx.start(xid, "channel")
    node.broker.dtx.end(xid, "channel")
    assert work.group == partition + 1 and work.id == xtx_txid(partition, GTXID)
    return xid


def test_names_carry_their_group() -> None:
    assert group_of(xtx_txid(0, GTXID)) == 1 and group_of(in_group(12, "tx-a-1-1")) == 12
    assert group_of("tx-a-1-1") == group_of(f"dtx:{Xid(1, b'g').key}") == group_of("g/x") == 0


def test_a_groups_demotion_rolls_back_only_its_own_branches() -> None:
    a = Node("A", Clock())
    dtx = a.broker.dtx
    first, second = xtx_branch(a, 0), xtx_branch(a, 1)
    mine = Xid(1, b"a TM's")
    dtx.start(mine, "channel")
    dtx.end(mine, "channel")
    dtx.branches[mine].group = 2  # as group 2's primary set it when it replicated the branch
    assert dtx.primary_stopped(2) == [second, mine]
    assert list(dtx.branches) == [first]
    assert dtx.primary_stopped(None) == [first]  # unpartitioned: every branch, as before


def test_a_scoped_primarys_xa_branch_is_its_groups() -> None:
    clock = Clock()
    a = Node("A", clock)
    primary(a, G1, clock)
    primary(a, G2, clock)
    q = queue(a, "b1")
    xid = Xid(1, b"a TM's")
    work = a.broker.dtx.start(xid, "channel")
    work.publish([q], message(b"m", "b1"))  # its te opens the tx-queue in group 2's log
    assert work.group == 2 and work.replication_id == f"dtx:{xid.key}"


def test_two_groups_primaries_on_one_node_name_their_transactions_apart() -> None:
    """Epochs are per group: both primaries of epoch 1 would name their first TX
    ``tx-A-1-1``, and one outcome record would replace the other."""
    async def scenario() -> None:
        clock = Clock()
        a = Node("A", clock)
        primary(a, G1, clock)
        primary(a, G2, clock)
        for name in ("a1", "b1"):
            q = queue(a, name)
            tx = a.broker.new_transaction()
            tx.publish([q], message(b"m", name))
            await tx.commit()
        assert [(r[0], r[2]) for r in a.broker.outcomes.snapshot()] == [
            ("g1/tx-A-1-1", COMMITTED), ("g2/tx-A-1-2", COMMITTED)]
    asyncio.run(scenario())


def test_a_catch_up_sends_and_replaces_only_its_groups_outcomes() -> None:
    clock = Clock()
    a, b = Node("A", clock), Node("B", clock)
    pa = primary(a, G1, clock)
    a.broker.outcomes.record("g1/tx-A-1-1", None, COMMITTED)
    a.broker.outcomes.record("g2/tx-C-3-1", None, COMMITTED)  # A follows group 2
    b.broker.outcomes.record("g1/tx-old-1-1", None, COMMITTED)  # A's group 1 never had it
    b.broker.outcomes.record("g2/tx-B-2-1", None, COMMITTED)  # B leads group 2
    prepared = DtxBuffer(xtx_txid(1, GTXID), xid=xid_of(XBranch(GTXID, 1, 0, (0, 1), "")).key)
    b.broker.ha_transactions[prepared.txid] = prepared.payload()  # B's group 2 prepared
    joined(pa, b, G1)
    assert [r[0] for r in b.broker.outcomes.snapshot()] == ["g2/tx-B-2-1", "g1/tx-A-1-1"]
    assert list(b.broker.ha_transactions) == [xtx_txid(1, GTXID)]


def test_a_groups_join_releases_only_its_own_branches() -> None:
    clock = Clock()
    a, b = Node("A", clock), Node("B", clock)
    pb = primary(b, G2, clock)
    first, _ = xtx_branch(a, 0), xtx_branch(a, 1)
    joined(pb, a, G2)  # A follows group 2: the branches it held of group 2 go
    assert list(a.broker.dtx.branches) == [first]


def test_a_groups_verification_settles_only_its_transactions() -> None:
    a = Node("A", Clock())
    for partition in (0, 1):
        xid = xid_of(XBranch(GTXID, partition, 0, (0, 1), ""))
        buffer = DtxBuffer(xtx_txid(partition, GTXID), xid=xid.key)
        a.broker.ha_transactions[buffer.txid] = buffer.payload()
    ordinary = DtxBuffer("dtx:x", xid=Xid(1, b"x").key)
    a.broker.ha_transactions[ordinary.txid] = ordinary.payload()
    mine = Verification.start(a.broker, 2, "A", [], 0.0, 1.0, group=2)
    assert list(mine.decisions()) == [xtx_txid(1, GTXID)]
    everything = Verification.start(a.broker, 2, "A", [], 0.0, 1.0)
    assert len(everything.decisions()) == 3 and everything.decisions()["dtx:x"] == IN_DOUBT


def test_a_tms_xid_of_the_cross_partition_format_is_an_ordinary_branch() -> None:
    """A TM may use any format id: one of ``XTX_FORMAT`` whose bqual is not
    ``<partition>/<decider>/<participants>`` is its own branch, listed by ``recover``."""
    async def scenario() -> None:
        a = Node("A", Clock())
        dtx = a.broker.dtx
        q = queue(a, "a1")
        for xid in (Xid(XTX_FORMAT, b"mine", b"not/ours"), Xid(XTX_FORMAT, b"\xff", b"0/0/0")):
            work = dtx.start(xid, "channel")
            assert work.id == f"dtx:{xid.key}" and work.group is None and branch_of(xid) is None
            work.publish([q], message(b"m", "a1"))
            dtx.end(xid, "channel")
            assert await dtx.prepare(xid) == XA.OK
        assert len(dtx.recover()) == 2
    asyncio.run(scenario())


def test_a_tm_cannot_name_a_cross_partition_branch() -> None:
    """Its partitions decide it (``DecisionRules``): the ``amq.dtx`` verbs refuse its xid."""
    xid = xid_of(XBranch(GTXID, 1, 0, (0, 1), "n9"))
    named = {"format_id": xid.format_id, "gtrid": xid.gtrid.hex(), "bqual": xid.bqual.hex()}
    with pytest.raises(XAError) as refused:
        parse_xid(named)
    assert refused.value.code is XA.ER_INVAL
    tms = {**named, "bqual": b"mine".hex()}  # the same format id, a TM's own bqual
    assert parse_xid(tms) == Xid(XTX_FORMAT, xid.gtrid, b"mine")
