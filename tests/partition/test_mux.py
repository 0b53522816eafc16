"""``GroupMux`` (brokerha/partition/mux.py): every group's packets over one link per node pair.

A group's packet goes wrapped with its group and comes back as the very
packet its member sent (through the msgpack framing of the link); the
heartbeats and heartbeat acknowledgements of every group to one peer in one
loop turn go as one packet.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from brokerha.cluster.election import Heartbeat, HeartbeatAck, VoteRequest
from brokerha.cluster.messages import Error, ErrorCode, Message
from brokerha.cluster.replication import ENQUEUED, Enqueued, Events
from brokerha.ha.simulation.world import wire
from brokerha.partition.mux import (
    Grouped,
    GroupMux,
    HeartbeatAcks,
    Heartbeats,
    MuxError,
    unwrap,
    wrap,
)


class Link:
    """What the mux put on the links, and the ``soon`` callbacks it asked for."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []
        self.soon: list[Callable[[], None]] = []

    def mux(self) -> GroupMux:
        return GroupMux(lambda peer, packet: self.sent.append((peer, packet)), self.soon.append)

    def turn(self) -> None:
        soon, self.soon = self.soon, []
        for callback in soon:
            callback()


def test_a_grouped_packet_crosses_the_wire_and_comes_back_as_its_groups_own() -> None:
    events = Events(3, 7, [Enqueued(ENQUEUED, "/", "q1-0", 12, "", "q1-0", b"h", b"body", None)])
    vote = VoteRequest(4, "n1", 3, 7, pre=True)
    for group, packet in [(2, events), (0, vote), (5, Error(ErrorCode.OLD_EPOCH, "old"))]:
        crossed = wire(wrap(group, packet))
        assert isinstance(crossed, Grouped) and crossed.group == group
        [(got_group, got)] = unwrap("n1", crossed)
        assert got_group == group and type(got) is type(packet)
        assert got.to_args() == wire(packet).to_args()
    [(_, got)] = unwrap("n1", wire(wrap(2, events)))
    assert isinstance(got, Events) and got.events[0].queue == "q1-0"  # records, by name


def test_heartbeats_of_every_group_to_one_peer_go_as_one_packet_per_turn() -> None:
    link = Link()
    mux = link.mux()
    for group, epoch in [(0, 5), (1, 2), (3, 9)]:
        for peer in ("n2", "n3"):
            mux.send(group, peer, Heartbeat(epoch, "n1", 10.0 + group))
    assert link.sent == [] and len(link.soon) == 1  # one flush scheduled for the turn
    link.turn()
    assert [(peer, type(p)) for peer, p in link.sent] == [("n2", Heartbeats), ("n3", Heartbeats)]
    assert mux.sent["heartbeats"] == 2 and mux.bundled == 6
    peer, bundle = link.sent[0]
    beats = unwrap("n1", wire(bundle))
    assert beats == [(0, Heartbeat(5, "n1", 10.0)), (1, Heartbeat(2, "n1", 11.0)),
                     (3, Heartbeat(9, "n1", 13.0))]


def test_heartbeat_acks_are_bundled_and_name_their_sender() -> None:
    link = Link()
    mux = link.mux()
    mux.send(1, "n1", HeartbeatAck(2, "n2", 11.0, 2, 40, True))
    mux.send(2, "n1", HeartbeatAck(7, "n2", 12.5, -1, -1, False))
    mux.flush()  # the driver flushes at the end of the input: the scheduled one sends nothing
    link.turn()
    [(peer, bundle)] = link.sent
    assert peer == "n1" and isinstance(bundle, HeartbeatAcks)
    assert unwrap("n2", wire(bundle)) == [(1, HeartbeatAck(2, "n2", 11.0, 2, 40, True)),
                                          (2, HeartbeatAck(7, "n2", 12.5, -1, -1, False))]


def test_other_packets_go_at_once_in_the_order_sent() -> None:
    link = Link()
    mux = link.mux()
    mux.send(1, "n2", VoteRequest(1, "n1", 0, 0))
    mux.send(2, "n2", Heartbeat(1, "n1", 1.0))
    mux.send(2, "n2", Events(1, 1, []))
    assert [type(p) for _, p in link.sent] == [Grouped, Grouped]
    assert [p.group for _, p in link.sent] == [1, 2]  # type: ignore[attr-defined]


def test_what_is_no_mux_packet_is_refused() -> None:
    with pytest.raises(MuxError):
        unwrap("n1", Heartbeat(1, "n1", 0.0))  # a group's packet that was never wrapped
    with pytest.raises(MuxError):
        unwrap("n1", Grouped(1, Heartbeats.CODE, [[]]))  # a bundle inside a group
    with pytest.raises(MuxError):
        unwrap("n1", Grouped(1, 9999, []))


def test_the_cluster_links_codec_carries_the_mux_packets() -> None:
    """The node's codec (cluster/protocol.py) frames them as any packet: a group's
    ``Events`` with a body part cut without copying (a memoryview) included."""
    from brokerha.cluster.protocol import PacketCodec
    from brokerha.cluster.replication import BODY_PART, BodyPart

    body = memoryview(b"x" * 1000)[10:500]
    events = Events(2, 9, [BodyPart(BODY_PART, body),
                           Enqueued(ENQUEUED, "/", "q", 3, "", "q", b"h", b"", None)])
    packets = [wrap(1, events), Heartbeats([[0, 1, 2.5], [3, 4, 2.5]]),
               HeartbeatAcks([[1, 2, 2.5, 2, 9, True]])]
    codec = PacketCodec()
    data = b"".join(codec.encode(i, p) for i, p in enumerate(packets))
    decoded = PacketCodec().feed(data)
    assert [msg_id for msg_id, _ in decoded] == [0, 1, 2]
    [(group, got)] = unwrap("n2", decoded[0][1])
    assert group == 1 and isinstance(got, Events)
    assert bytes(got.events[0].data) == bytes(body) and got.events[1].position == 3
    assert [g for g, _ in unwrap("n2", decoded[1][1])] == [0, 3]
    assert unwrap("n2", decoded[2][1]) == [(1, HeartbeatAck(2, "n2", 2.5, 2, 9, True))]
