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
