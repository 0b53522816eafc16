"""The wire of transactions across partitions (``partition/transactions.py``): every packet
of ``partition/xtx.py`` through the cluster link's codec and back, the coordinator's node
from its name, the test hook's setting."""

from __future__ import annotations

import pytest

from brokerha.cluster.protocol import PacketCodec
from brokerha.partition.forward import ForwardMessage
from brokerha.partition.transactions import (
    KINDS,
    XtxToNode,
    XtxToPartition,
    coordinator_name,
    decode,
    encode,
    node_of,
    parse_hold,
)
from brokerha.partition.xtx import (
    Packet,
    Query,
    XBranch,
    XCommit,
    XDecide,
    XDecided,
    XDequeue,
    XFinished,
    XHeld,
    XHold,
    XOutcome,
    XOutcomeReply,
    XPrepare,
    XPrepared,
    XRecover,
    XRollback,
)

GTXID = "1764428400000000000-n1.0123456789ab"
BRANCH = XBranch(GTXID, 2, 0, (0, 2), "n1.0123456789ab", (
    ForwardMessage("/", ("3.17", "3.18"), "ex", "rk", b"\x00\x3c\x00\x00header", b"body\x00"),
    XDequeue("/", "q", (4, 9)),
    ForwardMessage("v", ("3.2",), "", "q2", b"h", b""),
))
PACKETS: list[Packet | Query] = [
    XPrepare(BRANCH), XPrepared(GTXID, 2, True), XDecide(GTXID, False, "n1.0123456789ab"),
    XDecided(GTXID, "committed"), XCommit(GTXID, "n1.0123456789ab"),
    XRollback(GTXID, "n1.0123456789ab"), XFinished(GTXID, 2, "rolled back"),
    XOutcome(GTXID, 2), XOutcomeReply(GTXID, "committed"),
    XHold(GTXID, "1:6162:01", [0, 2], "n1.0123456789ab"), XRecover("n1.0123456789ab", 3),
    XHeld(3, 2, [["1:6162:01", GTXID, [0, 2]]]),
]


def test_every_kind_is_a_packet() -> None:
    assert sorted(KINDS, key=lambda k: k.__name__) == sorted(
        {type(p) for p in PACKETS}, key=lambda k: k.__name__)


@pytest.mark.parametrize("packet", PACKETS, ids=lambda p: type(p).__name__)
def test_a_packet_crosses_the_link_unchanged(packet: Packet | Query) -> None:
    kind, args = encode(packet)
    codec = PacketCodec()
    for message in (XtxToPartition(2, kind, args), XtxToNode(kind, args)):
        [(msg_id, got)] = codec.feed(codec.encode(7, message))
        assert msg_id == 7 and type(got) is type(message)
        assert isinstance(got, XtxToPartition | XtxToNode)
        assert decode(got.kind, got.args) == packet
    if isinstance(packet, XPrepare):
        assert packet.branch.ops[1] == XDequeue("/", "q", (4, 9))


def test_a_reject_s_dequeue_carries_its_how_and_an_ack_s_wire_is_as_before() -> None:
    ops = (XDequeue("/", "q", (4,)), XDequeue("/", "q", (5,), "requeue"),
           XDequeue("/", "q", (6,), "reject"))
    prepare = XPrepare(XBranch(GTXID, 2, 0, (0, 2), "n1.0123456789ab", ops))
    kind, args = encode(prepare)
    assert args[-1][0] == [1, "/", "q", [4]]  # an ack's: four fields, as before
    assert decode(kind, args) == prepare


def test_a_malformed_packet_raises() -> None:
    kind, args = encode(XDecided(GTXID, "committed"))
    with pytest.raises(TypeError):
        decode(kind, args[:1])
    with pytest.raises(IndexError):
        decode(len(KINDS), args)


def test_the_coordinator_s_node_is_its_name_before_the_incarnation() -> None:
    assert node_of("n1.0123456789ab") == "n1"
    assert node_of("rabbit.example.0123456789ab") == "rabbit.example"


def test_a_long_node_name_shortens_the_incarnation() -> None:
    assert coordinator_name("n1.0123456789ab") == "n1.0123456789ab"
    node = "x" * 36
    assert coordinator_name(f"{node}.0123456789ab") == f"{node}.0123456"  # 44 bytes
    assert coordinator_name(f"{'x' * 38}.0123456789ab") is None


def test_the_hold_hook() -> None:
    assert parse_hold("") == {}
    assert parse_hold("decide=2.5") == {XDecide: 2.5}
    assert parse_hold("commit=1, decide=3") == {XCommit: 1.0, XRollback: 1.0, XDecide: 3.0}
    assert parse_hold("hold=4") == {XHold: 4.0}  # an XA prepare's XHold
    with pytest.raises(ValueError):
        parse_hold("prepare=1")
