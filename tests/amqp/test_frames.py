"""The hand-written fast path is byte-identical to pamqp."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import body as pbody
from pamqp import commands, frame, header

from brokerha.amqp import frames as F
from brokerha.amqp.errors import FrameError

names = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=60)
# pamqp validates exchange names against the spec's domain
exchanges = st.text(alphabet="abcXYZ019-_.:", max_size=60)
tags = st.integers(min_value=1, max_value=2**63 - 1)  # pamqp encodes longlong as signed


@given(names, tags, st.booleans(), exchanges, names)
def test_deliver_matches_pamqp(ctag: str, dtag: int, redelivered: bool, ex: str, rk: str) -> None:
    ours = F.encode_deliver(3, ctag, dtag, redelivered, ex, rk)
    theirs = frame.marshal(commands.Basic.Deliver(consumer_tag=ctag, delivery_tag=dtag,
                                                  redelivered=redelivered, exchange=ex,
                                                  routing_key=rk), 3)
    assert ours == theirs


@given(tags, st.booleans(), exchanges, names, st.integers(0, 2**32 - 1))
def test_get_ok_matches_pamqp(dtag: int, redelivered: bool, ex: str, rk: str, count: int) -> None:
    ours = F.encode_get_ok(1, dtag, redelivered, ex, rk, count)
    theirs = frame.marshal(commands.Basic.GetOk(delivery_tag=dtag, redelivered=redelivered,
                                                exchange=ex, routing_key=rk,
                                                message_count=count), 1)
    assert ours == theirs


@given(tags, st.booleans(), st.booleans())
def test_confirms_match_pamqp(dtag: int, multiple: bool, ack: bool) -> None:
    method = (commands.Basic.Ack(delivery_tag=dtag, multiple=multiple) if ack
              else commands.Basic.Nack(delivery_tag=dtag, multiple=multiple, requeue=False))
    assert F.encode_confirm(2, dtag, multiple, ack) == frame.marshal(method, 2)


@given(exchanges, names, st.booleans(), st.booleans())
def test_publish_decodes_like_pamqp(ex: str, rk: str, mandatory: bool, immediate: bool) -> None:
    raw = frame.marshal(commands.Basic.Publish(exchange=ex, routing_key=rk, mandatory=mandatory,
                                               immediate=immediate), 1)
    payload = raw[7:-1]
    assert F.method_index(payload) == F.BASIC_PUBLISH
    publish = F.decode_publish(payload)
    assert (publish.exchange, publish.routing_key, publish.mandatory, publish.immediate) == (
        ex, rk, mandatory, immediate)


@given(names, tags, st.booleans(), exchanges, names, st.binary(max_size=9000))
def test_one_shot_delivery_matches_pamqp(ctag: str, dtag: int, redelivered: bool, ex: str,
                                         rk: str, body: bytes) -> None:
    props = commands.Basic.Properties(content_type="x/y", delivery_mode=2)
    raw_header = header.ContentHeader(0, len(body), props).marshal()
    route = F.pack_shortstr(ex) + F.pack_shortstr(rk)
    ours = F.encode_delivery(5, F.pack_shortstr(ctag), dtag, redelivered, route, raw_header,
                             body, 4096)
    theirs = F.encode_deliver(5, ctag, dtag, redelivered, ex, rk) + F.encode_content(
        5, raw_header, body, 4096)
    assert ours == theirs


def test_non_utf8_routing_key_is_a_frame_error_as_in_rabbitmq() -> None:
    payload = struct.pack(">HHH", 60, 40, 0) + b"\x00" + b"\x02\xff\xfe" + b"\x00"
    with pytest.raises(FrameError, match="Malformed UTF-8 in shortstr"):
        F.decode_publish(payload)


@given(tags, st.booleans())
def test_ack_decodes_like_pamqp(dtag: int, multiple: bool) -> None:
    raw = frame.marshal(commands.Basic.Ack(delivery_tag=dtag, multiple=multiple), 1)
    assert F.decode_ack(raw[7:-1]) == (dtag, multiple)


@given(st.binary(max_size=20000), st.sampled_from([4096, 8192, 131072]))
def test_content_split_at_frame_max_and_reassembles(body: bytes, frame_max: int) -> None:
    props = commands.Basic.Properties(content_type="text/plain", headers={"k": 1})
    raw_header = header.ContentHeader(0, len(body), props).marshal()
    data = F.encode_content(1, raw_header, body, frame_max)
    reader = F.FrameReader(frame_max)
    reader.feed(data)
    frames = reader.frames()
    assert frames[0].payload == raw_header
    assert b"".join(f.payload for f in frames[1:]) == body
    assert all(len(f.payload) + 8 <= frame_max for f in frames)
    expected = frame.marshal(header.ContentHeader(0, len(body), props), 1)
    if body and len(body) <= frame_max - 8:
        expected += frame.marshal(pbody.ContentBody(body), 1)
        assert data == expected


@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 8]), st.integers(0, 3), st.binary(max_size=300)),
                max_size=12),
       st.lists(st.integers(0, 4000), max_size=8))
def test_frames_read_in_any_pieces_are_the_frames_written(
        written: list[tuple[int, int, bytes]], cuts: list[int]) -> None:
    """Reads end anywhere: inside a header, a payload, right before the end octet."""
    data = b"".join(F.encode_frame(t, ch, payload) for t, ch, payload in written)
    reader = F.FrameReader(4096)
    got = []
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    for a, b in zip(bounds, bounds[1:], strict=False):
        reader.feed(data[a:b])
        got += [(f.type, f.channel, f.payload) for f in reader.frames()]
    assert got == written and reader.buffered() == 0


def test_an_oversized_frame_is_refused_as_soon_as_its_header_is_read_even_mid_stream() -> None:
    reader = F.FrameReader(4096)
    ok = F.encode_frame(1, 1, b"x" * 10)
    reader.feed(ok[:5])
    assert reader.frames() == []
    reader.feed(ok[5:] + F.encode_frame(3, 1, b"y" * 5000)[:9])
    with pytest.raises(FrameError, match="exceeds negotiated frame_max"):
        reader.frames()
    reader = F.FrameReader(4096)
    reader.feed(ok[:3])
    assert reader.frames() == []
    reader.feed(ok[3:] + b"\x03\x00\x01")  # the next header cut off, then completed
    assert len(reader.frames()) == 1
    reader.feed(b"\x00\x00\x20\x00z")
    with pytest.raises(FrameError, match="exceeds negotiated frame_max"):
        reader.frames()


def test_reader_waits_for_the_end_octet() -> None:
    reader = F.FrameReader(4096)
    data = F.encode_frame(1, 1, b"\x00\x3c\x00\x28")
    reader.feed(data[:-1])
    assert reader.frames() == []
    reader.feed(data[-1:])
    assert len(reader.frames()) == 1


def test_zero_length_body_frame_is_accepted() -> None:
    reader = F.FrameReader(4096)
    reader.feed(F.encode_frame(3, 1, b""))
    assert reader.frames()[0].payload == b""
