"""The cluster wire protocol without a network: framing, magic, identification, proofs."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brokerha.cluster.messages import Error, ErrorCode, Message
from brokerha.cluster.protocol import (
    HANDSHAKE_MAX_PACKET,
    MAGIC,
    VERSION,
    Acceptor,
    Authenticate,
    Challenge,
    Dialer,
    Established,
    Identify,
    PacketCodec,
    ProtocolError,
    Refused,
    State,
    Welcome,
    proof,
)
from brokerha.cluster.replication import Events

SECRET = b"0123456789abcdef0123"
D_NONCE = b"d" * 16
A_NONCE = b"a" * 16


def raw_packet(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def decode_all(data: bytes) -> list[tuple[int, Message]]:
    return PacketCodec().feed(data)


# -- codec -----------------------------------------------------------------------------


def test_codec_round_trip_keeps_str_and_bytes_apart() -> None:
    codec = PacketCodec()
    msgs = [(7, Error(ErrorCode.UNKNOWN, "héllo")), (8, Identify("dc1", "n1", b"\x00\xff" * 8))]
    assert codec.feed(b"".join(codec.encode_many(msgs))) == msgs
    (_, ident), = codec.feed(codec.encode(9, msgs[1][1]))
    assert isinstance(ident, Identify) and isinstance(ident.nonce, bytes)


def test_codec_reassembles_packets_fed_byte_by_byte() -> None:
    codec = PacketCodec()
    data = codec.encode(1, Error("a", "b")) + codec.encode(2, Welcome("n2"))
    got = []
    for i in range(len(data)):
        got += codec.feed(data[i:i + 1])
    assert got == [(1, Error("a", "b")), (2, Welcome("n2"))]
    assert codec.leftover() == b""


def test_codec_feed_limit_leaves_the_rest_buffered() -> None:
    codec = PacketCodec()
    data = codec.encode(1, Welcome("a")) + codec.encode(2, Welcome("b"))
    assert codec.feed(data, limit=1) == [(1, Welcome("a"))]
    assert codec.leftover() == data[len(data) // 2:]
    assert codec.feed(b"") == [(2, Welcome("b"))]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
       cuts=st.lists(st.integers(1, 9000), max_size=20), data=st.data())
def test_codec_gives_the_same_packets_however_the_stream_is_cut(
        sizes: list[int], cuts: list[int], data: st.DataObject) -> None:
    """Packets split over reads (a part of its own size being filled), a header split
    across two reads, several packets in one read, a limit now and then: the same packets,
    in order, and ``leftover`` is exactly what was not decoded."""
    codec = PacketCodec()
    msgs = [(i, Welcome("n" * size)) for i, size in enumerate(sizes)]
    stream = b"".join(codec.encode(i, m) for i, m in msgs)
    got: list[tuple[int, Message]] = []
    pos = 0
    for cut in [*cuts, len(stream)]:
        chunk = stream[pos:pos + cut]
        pos += len(chunk)
        limit = data.draw(st.sampled_from([None, None, 1, 2]))
        got += codec.feed(chunk, limit=limit)
        decoded = sum(len(codec.encode(i, m)) for i, m in got)
        assert codec.leftover() == stream[decoded:pos]
        if pos == len(stream):
            break
    while len(got) < len(msgs):
        got += codec.feed(b"")
    assert got == msgs
    assert codec.leftover() == b""


def test_a_handshake_refuses_a_packet_longer_than_a_handshake_s() -> None:
    """Before the peer is known, a header alone may not make a node hold a big buffer."""
    _, acceptor = pair()
    acceptor.start()
    step = acceptor.receive(MAGIC + struct.pack(">I", HANDSHAKE_MAX_PACKET + 1))
    assert isinstance(step.outcome, Refused), step
    assert "exceeds the limit" in step.outcome.reason


def test_oversized_length_is_refused_before_the_body_arrives() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        PacketCodec(max_packet=1000).feed(struct.pack(">I", 1001))


def test_encoding_an_oversized_packet_fails_locally() -> None:
    with pytest.raises(ValueError, match="exceeds the packet limit"):
        PacketCodec(max_packet=100).encode(1, Error("x", "y" * 200))


@pytest.mark.parametrize("body, match", [
    (b"\xc1", "malformed msgpack"),                           # never-used byte
    (b"\x93\x01", "malformed msgpack"),                       # truncated array
    (msgpack.packb({"a": 1}), "not \\[msg_id, code, args\\]"),
    (msgpack.packb([1, 2]), "not \\[msg_id, code, args\\]"),
    (msgpack.packb(["x", 0, []]), "bad packet header"),
    (msgpack.packb([-1, 0, []]), "bad packet header"),
    (msgpack.packb([1, 9999, []]), "unknown packet code 9999"),
    (msgpack.packb([1, 0, ["only-one"]]), "bad Error"),       # wrong arity
    (msgpack.packb([1, 0, "notalist"]), "bad Error"),
    (b"", "malformed msgpack"),
    # replication events: each must be a known kind with its record's fields
    (msgpack.packb([1, Events.CODE, [1, 0, [["zz", 1]]]]), "bad Events: unknown event kind 'zz'"),
    (msgpack.packb([1, Events.CODE, [1, 0, [["e", "/", "q"]]]]), "bad Events: event 'e' has 3 fields"),
    (msgpack.packb([1, Events.CODE, [1, 0, [[]]]]), "bad Events: not an event"),
    (msgpack.packb([1, Events.CODE, [1, 0, [["tc", "t", None, [["zz"]]]]]]), "unknown event kind 'zz'"),
    (msgpack.packb([1, Events.CODE, [1, 0, {"e": 1}]]), "bad Events: Events.events is not a list"),
])
def test_malformed_packets_are_protocol_errors(body: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match) as info:
        PacketCodec().feed(struct.pack(">I", len(body)) + body)
    assert info.value.code == ErrorCode.PROTOCOL


def test_good_packets_before_a_bad_one_are_kept_on_the_error() -> None:
    codec = PacketCodec()
    data = codec.encode(1, Welcome("a")) + raw_packet([2, 9999, []])
    with pytest.raises(ProtocolError) as info:
        codec.feed(data)
    assert info.value.decoded == [(1, Welcome("a"))]


# -- handshake -------------------------------------------------------------------------


def pair(**acceptor: object) -> tuple[Dialer, Acceptor]:
    d = Dialer("dc1", "n1", "n2", SECRET, D_NONCE)
    kw: dict[str, object] = {"cluster": "dc1", "me": "n2", "peers": {"n1", "n3"},
                             "secret": SECRET, "nonce": A_NONCE}
    kw.update(acceptor)
    return d, Acceptor(**kw)  # type: ignore[arg-type]


def run(d: Dialer, a: Acceptor) -> tuple[object, object]:
    """Shuttle bytes until both sides have an outcome (or nobody has anything to say)."""
    d_out, a_out = None, None
    to_a = d.start()
    while to_a and a_out is None:
        step = a.receive(to_a)
        a_out = step.outcome
        to_a = b""
        if step.out and d_out is None:
            back = d.receive(step.out)
            d_out = back.outcome
            to_a = back.out
    return d_out, a_out


def test_handshake_establishes_both_sides() -> None:
    d, a = pair()
    d_out, a_out = run(d, a)
    assert d_out == Established("n2") and a_out == Established("n1")
    assert d.state is State.ESTABLISHED and a.state is State.ESTABLISHED


def test_handshake_works_fed_byte_by_byte_with_packets_behind_it() -> None:
    d, a = pair()
    after = PacketCodec().encode(5, Error("x", "first packet after the handshake"))
    to_d = to_a = b""
    for b in d.start():
        step = a.receive(bytes([b]))
        assert step.outcome is None
        to_d += step.out
    for b in to_d:
        step = d.receive(bytes([b]))
        assert step.outcome is None
        to_a += step.out
    step = a.receive(to_a + after)
    assert step.outcome == Established("n1", leftover=after)
    assert d.receive(step.out).outcome == Established("n2")


def test_magic_is_compared_raw_before_any_decoding() -> None:
    _, a = pair()
    step = a.receive(b"GET / HTTP/1.1\r\n")
    assert step == type(step)(b"", Refused("wrong magic: b'GET / HT'"))


def test_wrong_magic_is_noticed_at_the_first_wrong_byte() -> None:
    _, a = pair()
    assert a.receive(b"BR").outcome is None
    assert a.receive(b"X").outcome == Refused("wrong magic: b'BRX'")


def test_another_protocol_version_is_told_apart() -> None:
    _, a = pair()
    step = a.receive(b"BRKRHA\x00\x0f")
    assert step.outcome == Refused("protocol version 15 is not ours (14)") and step.out == b""


def test_a_peer_of_a_version_before_replica_checks_is_refused() -> None:
    """Version 1 knows neither ``bp`` nor ``er`` events, version 2 no grouped packet of a
    node running partition groups (codes 20-22), version 3 no ``ck`` event nor
    ``CheckReport`` (a replica check), version 4 no forward of a publish (codes 23-26),
    version 5 no remote consumer's packet (codes 40-47), version 10 no part of a large body
    forwarded or delivered (codes 27, 48), version 11 no remote consume's ``Attached`` nor
    ``Credit`` (codes 49, 57) and a ``GetReply`` one field short, version 12 no ``pg``
    event (a purge in one event), version 13 no ``pr`` (a purge of ranges): each would fail on the first one (a replication error, or an unknown packet code), so all are refused at the
    handshake."""
    assert VERSION == 14 and MAGIC == b"BRKRHA\x00\x0e"
    for old in (1, 2, 3, 4, 5, 10, 11, 12, 13):
        dialer, acceptor = pair()
        dialer.start()
        for side in (dialer, acceptor):
            step = side.receive(b"BRKRHA\x00" + bytes([old]))
            assert step.outcome == Refused(f"protocol version {old} is not ours ({VERSION})")
            assert step.out == b""


def test_garbage_after_a_good_magic_is_a_protocol_error_answered() -> None:
    _, a = pair()
    step = a.receive(MAGIC + b"\x00\x00\x00\x03abc")
    assert isinstance(step.outcome, Refused) and step.outcome.code == ErrorCode.PROTOCOL
    assert step.out.startswith(MAGIC)
    (_, err), = decode_all(step.out[len(MAGIC):])
    assert isinstance(err, Error) and err.code == ErrorCode.PROTOCOL


def test_node_of_another_cluster_is_refused_with_an_error_packet() -> None:
    d = Dialer("dc2", "n1", "n2", SECRET, D_NONCE)
    _, a = pair()
    step = a.receive(d.start())
    assert step.outcome == Refused("node 'n1' of cluster 'dc2' is not of cluster 'dc1'")
    (_, err), = decode_all(step.out[len(MAGIC):])
    assert err == Error(ErrorCode.REFUSED, "node 'n1' of cluster 'dc2' is not of cluster 'dc1'")
    # the dialer logs the acceptor's reason
    assert d.receive(step.out).outcome == Refused(
        "refused by node 'n2': node 'n1' of cluster 'dc2' is not of cluster 'dc1'",
        ErrorCode.REFUSED)


def test_unconfigured_node_is_refused() -> None:
    d = Dialer("dc1", "zz", "n2", SECRET, D_NONCE)
    _, a = pair()
    step = a.receive(d.start())
    assert step.outcome == Refused("node 'zz' is not a configured peer of 'n2'")
    assert a.state is State.REFUSED


def test_dialer_with_a_wrong_secret_is_refused_by_the_acceptor() -> None:
    d = Dialer("dc1", "n1", "n2", b"not-the-secret-at-all", D_NONCE)
    _, a = pair()
    step = a.receive(d.start())
    # the dialer sees the acceptor's proof fail too (it cannot tell who is wrong)
    back = d.receive(step.out)
    assert back.outcome == Refused("bad secret from node 'n2'")
    # an impostor that ignores that and sends a made-up proof is refused by the acceptor
    forged = PacketCodec().encode(0, Authenticate(b"\x00" * 32))
    assert a.receive(forged).outcome == Refused("bad secret from node 'n1'")


def test_dialer_refuses_an_impostor_acceptor_without_the_secret() -> None:
    d, a = pair(secret=b"impostor-guessing-the-secret")
    d_out, a_out = run(d, a)
    assert d_out == Refused("bad secret from node 'n2'")
    assert a_out == Refused("refused by node 'n1': bad secret from node 'n2'", ErrorCode.REFUSED)


def test_dialer_refuses_a_different_node_answering() -> None:
    d = Dialer("dc1", "n1", "n3", SECRET, D_NONCE)
    _, a = pair()
    step = a.receive(d.start())
    assert d.receive(step.out).outcome == Refused("dialed node 'n3' but node 'n2' answered")


def test_a_replayed_proof_fails_on_a_connection_with_another_nonce() -> None:
    d, a = pair()
    challenge = a.receive(d.start()).out
    recorded = d.receive(challenge).out          # an eavesdropper records Authenticate
    # a second connection: the acceptor draws another nonce
    _, a2 = pair(nonce=b"b" * 16)
    a2.receive(MAGIC + PacketCodec().encode(0, Identify("dc1", "n1", D_NONCE)))
    assert a2.receive(recorded).outcome == Refused("bad secret from node 'n1'")


def test_the_acceptors_proof_cannot_be_reflected_as_the_dialers() -> None:
    _, a = pair()
    step = a.receive(MAGIC + PacketCodec().encode(0, Identify("dc1", "n1", D_NONCE)))
    (_, challenge), = decode_all(step.out[len(MAGIC):])
    assert isinstance(challenge, Challenge)
    reflected = PacketCodec().encode(0, Authenticate(challenge.proof))
    assert a.receive(reflected).outcome == Refused("bad secret from node 'n1'")


def test_proofs_depend_on_every_part() -> None:
    base = ("acceptor", "dc1", "n1", "n2", D_NONCE, A_NONCE)
    ref = proof(SECRET, *base)
    for i, other in enumerate(("dialer", "dc2", "n3", "n3", b"x" * 16, b"y" * 16)):
        parts = list(base)
        parts[i] = other
        assert proof(SECRET, *parts) != ref  # type: ignore[arg-type]
    # length-prefixed: shifting a boundary between names changes the proof
    assert proof(SECRET, "acceptor", "dc1", "n1n", "2", D_NONCE, A_NONCE) != ref


@pytest.mark.parametrize("first", [
    Authenticate(b"\x00" * 32),      # skipping Identify
    Welcome("n1"),
    Challenge("n1", D_NONCE, b"\x00" * 32),
])
def test_acceptor_refuses_packets_out_of_order(first: Message) -> None:
    _, a = pair()
    step = a.receive(MAGIC + PacketCodec().encode(0, first))
    assert isinstance(step.outcome, Refused) and step.outcome.code == ErrorCode.PROTOCOL
    assert "unexpected" in step.outcome.reason and "await-identify" in step.outcome.reason


def test_dialer_refuses_welcome_before_challenge() -> None:
    d, _ = pair()
    d.start()
    step = d.receive(MAGIC + PacketCodec().encode(0, Welcome("n2")))
    assert step.outcome == Refused("unexpected Welcome while in await-challenge",
                                   ErrorCode.PROTOCOL)


def test_identify_with_wrong_field_types_is_a_protocol_error() -> None:
    _, a = pair()
    step = a.receive(MAGIC + raw_packet([0, Identify.CODE, ["dc1", "n1", "short"]]))
    assert step.outcome == Refused("bad Identify: nonce must be 16-64 bytes",
                                   ErrorCode.PROTOCOL)


def test_receive_after_the_outcome_is_a_local_error() -> None:
    _, a = pair()
    a.receive(b"nope-nope")
    with pytest.raises(RuntimeError):
        a.receive(b"more")


def test_a_peers_error_text_is_logged_on_one_line() -> None:
    d, _ = pair()
    d.start()
    step = d.receive(MAGIC + PacketCodec().encode(0, Error("refused", "a\nfake log line")))
    assert step.outcome == Refused("refused by node 'n2': a?fake log line", "refused")


# -- msgpack values of another type than the message's annotation ----------------------
# protocol.py is compiled by mypyc, which checks annotations at run time: a field read
# under its ``str`` annotation raised TypeError (not a refusal) when a peer sent an int.


@pytest.mark.parametrize("fields", [[5, 6], [b"\xff", b"\x00"], [[1], {"a": 1}], [None, 2.5]])
def test_an_error_packet_with_fields_of_any_type_is_a_refusal(fields: list[object]) -> None:
    _, a = pair()  # before the peer identified itself: anyone can send this
    step = a.receive(MAGIC + raw_packet([0, Error.CODE, fields]))
    assert isinstance(step.outcome, Refused)
    assert step.outcome.reason == f"refused by the peer: {fields[1]}"
    assert step.outcome.code == str(fields[0])
    d, _ = pair()
    d.start()
    assert isinstance(d.receive(MAGIC + raw_packet([0, Error.CODE, fields])).outcome, Refused)


@pytest.mark.parametrize("node", [5, b"n2", None])
def test_a_welcome_naming_no_string_is_a_protocol_error(node: object) -> None:
    d, a = pair()
    challenge = a.receive(d.start()).out  # magic, challenge
    step = d.receive(challenge + raw_packet([0, Welcome.CODE, [node]]))
    assert step.outcome == Refused("bad Welcome: node is not str", ErrorCode.PROTOCOL)
