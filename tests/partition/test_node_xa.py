"""XA held for its TM on a partitioned node (``partition/transactions.py``): ``xa_recover``
asks every partition's leader and answers only with all of them (``XAER_RMFAIL``
otherwise, never a short list), ``xa_finish`` finds the transaction through it, and the
node forgets what it prepared after ``XA_KNOWN_FOR``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from brokerha.broker.broker import Broker
from brokerha.broker.tx_outcomes import UNKNOWN
from brokerha.cluster.messages import Message
from brokerha.partition.forward import LeaderNotice
from brokerha.partition.transactions import (
    XA_KNOWN_FOR,
    HeldXa,
    NodeTransactions,
    XtxToNode,
    XtxToPartition,
    decode,
    encode,
)
from brokerha.partition.xtx import PREPARE_TIMEOUT, XDecide, XHeld, XRecover

XID = "1:6162:01"


class Node:
    """A ``NodeTransactions`` of node n1 (P = 3, partition p led by node ``n<p+2>``)
    whose packets are kept, on a clock of its own."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sent: list[tuple[str, Message]] = []
        member = SimpleNamespace(broker=Broker("n1"), me="n1", groups={},
                                 table=SimpleNamespace(partitions=3), placement=None)
        self.tx = NodeTransactions(member, "n1.0123456789ab",  # type: ignore[arg-type]
                                   send=lambda node, m: self.sent.append((node, m)),
                                   soon=lambda f: f(), wall=lambda: self.now, hold={})
        for p in range(3):
            self.tx.leader(LeaderNotice(p + 1, 1, f"n{p + 2}"))

    def to_partitions(self) -> list[tuple[str, Any]]:
        out = [(node, decode(m.kind, m.args)) for node, m in self.sent
               if isinstance(m, XtxToPartition)]
        self.sent.clear()
        return out

    def held(self, ref: int, partition: int, entries: list[list[Any]]) -> None:
        kind, args = encode(XHeld(ref, partition, entries))
        self.tx.on_packet(f"n{partition + 2}", XtxToNode(kind, args))


def test_recover_answers_once_every_partition_did() -> None:
    node = Node()
    answers: list[tuple[list[HeldXa] | None, str]] = []
    node.tx.xa_recover(lambda held, why: answers.append((held, why)))
    asked = node.to_partitions()
    assert sorted(node_ for node_, _ in asked) == ["n2", "n3", "n4"]
    ref = asked[0][1].ref
    assert all(p == XRecover("n1.0123456789ab", ref) for _, p in asked)
    node.held(ref, 0, [[XID, "g1", [0, 2]]])
    node.held(ref, 1, [])
    assert answers == []  # partition 2 has not answered: no short list
    node.held(ref, 2, [[XID, "g1", [0, 2]]])  # the same, from its other participant
    assert answers == [([(XID, "g1", (0, 2))], "")]


def test_recover_without_every_partition_fails_after_the_prepare_timeout() -> None:
    node = Node()
    answers: list[tuple[list[HeldXa] | None, str]] = []
    node.tx.xa_recover(lambda held, why: answers.append((held, why)))
    ref = node.to_partitions()[0][1].ref
    node.held(ref, 0, [])
    node.now += 0.6
    node.tx.tick()
    assert sorted(n for n, _ in node.to_partitions()) == ["n3", "n4"]  # asked again
    node.now += PREPARE_TIMEOUT
    node.tx.tick()
    assert answers and answers[0][0] is None and "[1, 2] did not answer" in answers[0][1]


def test_a_finish_of_an_unknown_xid_asks_the_partitions_then_decides_at_the_decider() -> None:
    node = Node()
    outcomes: list[tuple[str, str]] = []
    node.tx.xa_finish(XID, True, lambda outcome, why: outcomes.append((outcome, why)))
    ref = node.to_partitions()[0][1].ref
    for p in range(3):
        node.held(ref, p, [[XID, "0000000000000000001-n9.ab", [1, 2]]] if p == 1 else [])
    assert node.to_partitions() == [
        ("n3", XDecide("0000000000000000001-n9.ab", True, "n1.0123456789ab"))]
    node.tx.xa_finish("1:63:", False, lambda outcome, why: outcomes.append((outcome, why)))
    ref = node.to_partitions()[0][1].ref
    for p in range(3):
        node.held(ref, p, [])
    assert outcomes == [(UNKNOWN, "no partition holds xid 1:63: prepared")]


def test_what_the_node_prepared_is_forgotten_after_a_while() -> None:
    node = Node()
    node.tx.xa_known[XID] = ("0000000000000000001-n1.ab", (0, 1), node.now)
    node.now += XA_KNOWN_FOR / 2
    node.tx.tick()
    assert XID in node.tx.xa_known
    node.now += XA_KNOWN_FOR
    node.tx.tick()
    assert node.tx.xa_known == {}  # its TM finished it elsewhere, or will ask around


def test_a_finish_through_the_node_that_prepared_asks_its_decider_alone() -> None:
    """What the node prepared is a hint: its decider (partition 1, led by n3) still holds
    that gtxid under that xid, then ``XDecide`` goes to it -- one round trip, one leader."""
    node = Node()
    gtxid = "0000000000000000001-n1.0123456789ab"
    node.tx.xa_known[XID] = (gtxid, (1, 2), node.now)
    outcomes: list[tuple[str, str]] = []
    node.tx.xa_finish(XID, True, lambda outcome, why: outcomes.append((outcome, why)))
    [(asked, recover)] = node.to_partitions()
    assert asked == "n3" and isinstance(recover, XRecover)
    node.held(recover.ref, 1, [[XID, gtxid, [1, 2]]])
    assert node.to_partitions() == [("n3", XDecide(gtxid, True, "n1.0123456789ab"))]
    assert node.tx.stats["xa_recovers"] == 0 and outcomes == []


def test_a_reused_xid_is_never_finished_from_what_the_node_prepared_before() -> None:
    """The node prepared ``XID`` (gtxid ``old``); the TM committed it through another node,
    then reused ``XID`` for a new transaction prepared through a third one (``new``, decided
    by partition 2), and commits it through this node within ``XA_KNOWN_FOR``: the old entry
    must not finish ``old`` again (its decider would answer "committed" for a transaction
    it did not commit): the decider no longer holds ``old``, every partition is asked,
    ``new`` is committed."""
    node = Node()
    old, new = "0000000000000000001-n1.0123456789ab", "0000000000000000002-n9.ab"
    node.tx.xa_known[XID] = (old, (1, 2), node.now)
    node.now += 5.0
    outcomes: list[tuple[str, str]] = []
    node.tx.xa_finish(XID, True, lambda outcome, why: outcomes.append((outcome, why)))
    [(asked, recover)] = node.to_partitions()
    assert asked == "n3" and isinstance(recover, XRecover)
    node.held(recover.ref, 1, [])  # old decided: its record no longer held
    asked_all = node.to_partitions()
    assert sorted(n for n, _ in asked_all) == ["n2", "n3", "n4"]  # every partition now
    assert XID not in node.tx.xa_known and node.tx.stats["xa_known_stale"] == 1
    ref = asked_all[0][1].ref
    for p in range(3):
        node.held(ref, p, [[XID, new, [2]]] if p == 2 else [])
    assert node.to_partitions() == [("n4", XDecide(new, True, "n1.0123456789ab"))]
    assert outcomes == []


def test_a_decider_without_an_answer_fails_the_finish_and_drops_the_entry() -> None:
    node = Node()
    node.tx.xa_known[XID] = ("0000000000000000001-n1.0123456789ab", (0, 1), node.now)
    outcomes: list[tuple[str, str]] = []
    node.tx.xa_finish(XID, False, lambda outcome, why: outcomes.append((outcome, why)))
    assert [n for n, _ in node.to_partitions()] == ["n2"]
    node.now += PREPARE_TIMEOUT
    node.tx.tick()
    assert outcomes and outcomes[0][0] == "failed" and "[0] did not answer" in outcomes[0][1]
    assert XID not in node.tx.xa_known  # the TM asks again: through every partition


def test_ctl_status_reading_the_held_records_writes_nothing() -> None:
    """A held record whose transaction a primary before this one decided (its rewrite
    ``decided`` lost with the failover): ``status()`` counts it out, and changes nothing --
    the rules' tick rewrites it (``tests/partition/test_xtx_xa.py``), never a reader."""
    from brokerha.broker.tx_outcomes import COMMITTED
    from brokerha.partition.xtx import HELD

    node = Node()
    node.tx.member.placement = SimpleNamespace(  # type: ignore[assignment]
        of=lambda partition: None)
    node.tx.serving(1, 1)
    txs = node.tx.rules[1].txs
    outcomes = txs.broker.outcomes
    gtxid = "0000000000000000001-n9.ab"
    txs.hold(gtxid, XID, (0, 1))
    outcomes.record(txs.txid(gtxid), None, COMMITTED)  # decided, as restored
    written: list[Any] = []
    outcomes.listeners.append(written.append)
    stored = dict(outcomes.store.outcomes)  # type: ignore[attr-defined]
    status = node.tx.status()
    assert status["xa_held"] == {"1": 0}
    assert outcomes.get(txs.hold_txid(gtxid))[2] == HELD  # type: ignore[index]
    assert written == []  # nothing sent to the group's backups
    assert outcomes.store.outcomes == stored  # type: ignore[attr-defined]  # nor stored


def test_the_xa_kinds_are_carried_by_a_link_version_that_refuses_the_nodes_before_them() -> None:
    """XA's kinds 9-11 of codes 63-64 (``XHold``, ``XRecover``, ``XHeld``) came while the
    link's VERSION was 11 and before its raise to 12 (task F's codes 49 and 57): a node of
    version 11 or before, which would drop them as malformed (an unknown kind) or misread
    them, is refused at the handshake (``tests/cluster/test_protocol.py``). A kind added or
    moved after: raise ``VERSION``, then this list (docs/ha.md's wire notes)."""
    from brokerha.cluster.protocol import VERSION
    from brokerha.partition.transactions import KINDS

    assert VERSION >= 12
    assert [k.__name__ for k in KINDS] == [
        "XPrepare", "XPrepared", "XDecide", "XDecided", "XCommit", "XRollback", "XFinished",
        "XOutcome", "XOutcomeReply", "XHold", "XRecover", "XHeld"]
