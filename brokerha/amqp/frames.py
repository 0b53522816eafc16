"""Splitting the byte stream into frames, and the hand-written fast path.

pamqp raises the same error for a partial frame and a broken one, and does not
enforce frame_max, so the split is done here (performance-notes.md, pitfall 1
and 4). The fast path encodes and decodes the frames every message crosses
(basic.publish, content header, body, basic.deliver, basic.ack) with struct;
it is tested byte for byte against pamqp.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from pamqp import base as pamqp_base
from pamqp import commands, decode, encode

from brokerha.amqp import constants as C
from brokerha.amqp.errors import AMQPError, FrameError
from brokerha.broker.content import check_field_table, pack_shortstr

_FRAME_HEAD = struct.Struct(">BHI")
_METHOD_ID = struct.Struct(">HH")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_HEADER_PREFIX = struct.Struct(">HHQ")
_FRAME_END_BYTE = bytes([C.FRAME_END])
_FRAME_TYPES = frozenset((C.FRAME_METHOD, C.FRAME_HEADER, C.FRAME_BODY, C.FRAME_HEARTBEAT))
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"

BASIC_PUBLISH = (60 << 16) | 40
BASIC_ACK = (60 << 16) | 80


class Frame:
    """One frame off the wire: type, channel and payload (without the end octet)."""

    __slots__ = ("type", "channel", "payload")

    def __init__(self, ftype: int, channel: int, payload: bytes) -> None:
        self.type = ftype
        self.channel = channel
        self.payload = payload

    def __repr__(self) -> str:
        return f"Frame({self.type}, {self.channel}, {self.payload[:32]!r})"


class FrameReader:
    """Accumulates bytes and yields whole frames, checking size and end octet.

    What a read brings is parsed where it lies (each payload is then one slice,
    one copy); only a frame cut off at the end of a read waits in the buffer,
    and the next read completes it with just the bytes it lacks. Copying every
    read into the buffer, then the buffer into one bytes object, cost a busy
    publisher's connection two copies of everything and a large allocation
    per read.
    """

    __slots__ = ("_buf", "_data", "frame_max")

    def __init__(self, frame_max: int) -> None:
        self._buf = bytearray()  # the start of a frame a read cut off
        self._data: bytes | None = None  # a read not parsed yet, when nothing was buffered
        self.frame_max = frame_max

    def feed(self, data: bytes) -> None:
        if self._data is None and not self._buf:
            self._data = data if type(data) is bytes else bytes(data)
        else:
            self._spill()
            self._buf += data

    def _spill(self) -> None:
        if self._data is not None:
            self._buf += self._data
            self._data = None

    def take(self, count: int) -> bytes:
        """Remove and return the first ``count`` raw bytes (the protocol header)."""
        self._spill()
        head = bytes(self._buf[:count])
        del self._buf[:count]
        return head

    def buffered(self) -> int:
        return len(self._buf) + (len(self._data) if self._data is not None else 0)

    def frames(self) -> list[Frame]:
        """All complete frames buffered; raises FrameError on a broken one, carrying
        (``FrameError.frames``) the complete frames before it."""
        out: list[Frame] = []
        try:
            return self._frames(out)
        except FrameError as exc:
            exc.frames = out
            raise

    def _frames(self, out: list[Frame]) -> list[Frame]:
        data, self._data = self._data, None
        buf = self._buf
        if data is None:
            if len(buf) < 8:
                return out
            data, self._buf = bytes(buf), bytearray()
            start = 0
        elif buf:
            start = self._complete(data, out)
            if start < 0:
                return out
        else:
            start = 0
        pos = self._parse(data, start, out)
        if pos < len(data):
            self._buf = bytearray(data[pos:])
        return out

    def _complete(self, data: bytes, out: list[Frame]) -> int:
        """Finish the buffered frame from the head of ``data``; the offset of what follows.

        -1 when ``data`` does not complete it (then all of it is buffered).
        """
        buf = self._buf
        if len(buf) < 7:  # the header first
            head = min(7 - len(buf), len(data))
            buf += data[:head]
            if len(buf) < 7:
                return -1
        else:
            head = 0
        ftype, _, size = _FRAME_HEAD.unpack_from(buf, 0)
        if size > self.frame_max - C.FRAME_OVERHEAD:
            self._raise_broken(ftype, size, C.FRAME_END)
        need: int = 8 + size - len(buf)
        if len(data) - head < need:
            buf += data[head:]
            return -1
        buf += data[head:head + need]
        self._buf = bytearray()
        self._parse(bytes(buf), 0, out)
        return head + need

    def _parse(self, data: bytes, pos: int, out: list[Frame]) -> int:
        """Append the complete frames of ``data`` from ``pos``; where the first incomplete starts."""
        append = out.append
        unpack = _FRAME_HEAD.unpack_from
        limit = self.frame_max - C.FRAME_OVERHEAD
        end = len(data)
        while end - pos >= 8:
            ftype, channel, size = unpack(data, pos)
            stop = pos + 7 + size
            if size > limit or stop >= end or data[stop] != 0xCE or ftype not in _FRAME_TYPES:
                if size > limit or (stop < end and (data[stop] != 0xCE
                                                    or ftype not in _FRAME_TYPES)):
                    self._raise_broken(ftype, size, data[stop] if stop < end else 0xCE)
                break
            append(Frame(ftype, channel, data[pos + 7 : stop]))
            pos = stop + 1
        return pos

    def _raise_broken(self, ftype: int, size: int, end_octet: int) -> NoReturn:
        if size + C.FRAME_OVERHEAD > self.frame_max:
            raise FrameError(
                f"frame size {size + C.FRAME_OVERHEAD} exceeds negotiated frame_max {self.frame_max}"
            )
        if end_octet != C.FRAME_END:
            raise FrameError(f"frame end octet was {end_octet:#04x}, expected 0xce")
        raise FrameError(f"unknown frame type {ftype}")


M = TypeVar("M", bound=pamqp_base.Frame)


def unchecked(cls: type[M], **fields: Any) -> M:
    """``cls(**fields)`` without pamqp's ``validate()``; every field must be given.

    RabbitMQ accepts any UTF-8 name up to 255 bytes; pamqp's validate() holds
    queue and exchange names to an ASCII pattern, so building queue.declare-ok
    for 'café' raised after the queue existed (a half-applied declare). The
    names in a reply are the ones the broker took in, already short strings.
    """
    method = cls.__new__(cls)
    for name in cls.__slots__:
        setattr(method, name, fields.pop(name))
    if fields:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(fields)}")
    return method


def marshal_method(method: pamqp_base.Frame) -> bytes:
    """The method frame's payload: class and method id, then the arguments.

    pamqp's ``Frame.marshal`` without its ``validate()`` (see ``unchecked``);
    the arguments are encoded by pamqp's own encoders, in its order.
    """
    out = [struct.pack(">I", method.index)]
    bits = offset = 0
    in_bits = False
    for argument in method.__slots__:
        data_type = method.amqp_type(argument)
        value = getattr(method, argument)
        if data_type == "bit":
            if not in_bits or offset == 8:
                if in_bits:
                    out.append(encode.octet(bits))
                bits, offset, in_bits = 0, 0, True
            bits = encode.bit(value, bits, offset)
            offset += 1
            continue
        if in_bits:
            out.append(encode.octet(bits))
            in_bits = False
        out.append(encode.by_type(value, data_type))
    if in_bits:
        out.append(encode.octet(bits))
    return b"".join(out)


def encode_frame(ftype: int, channel: int, payload: bytes) -> bytes:
    return _FRAME_HEAD.pack(ftype, channel, len(payload)) + payload + _FRAME_END_BYTE


def method_index(payload: bytes) -> int:
    """The (class << 16 | method) index of a method frame payload."""
    if len(payload) < 4:
        raise FrameError("method frame shorter than its class and method ids")
    cls, meth = _METHOD_ID.unpack_from(payload)
    return int(cls << 16 | meth)


# -- strings -----------------------------------------------------------------
# Short strings must be UTF-8: RabbitMQ answers anything else with
# 501 FRAME_ERROR "Malformed UTF-8 in shortstr", and so do we.

MALFORMED_UTF8 = "Malformed UTF-8 in shortstr"


def _shortstr(payload: bytes, pos: int) -> tuple[str, int]:
    n = payload[pos]
    start = pos + 1
    stop = start + n
    if stop > len(payload):
        raise struct.error("short string runs past the end of the frame")
    try:
        return payload[start:stop].decode("utf-8"), stop
    except UnicodeDecodeError as exc:
        raise FrameError(MALFORMED_UTF8) from exc


_pack_shortstr = pack_shortstr


# -- method arguments, decoded as strictly as RabbitMQ decodes them ------------------
# RabbitMQ's generated decoder (rabbit_framing_amqp_0_9_1, codegen.py) matches a
# method's arguments as one binary pattern: every length within the frame and
# nothing left over, else 501 FRAME_ERROR "cannot decode <<...>>" naming the
# method. Then, field by field: each table is parsed (rabbit_binary_parser) and
# each short string must be UTF-8 (501 "Malformed UTF-8 in shortstr"). pamqp
# alone reads past a short string's end without complaint, ignores what is left
# over and raises assorted exceptions (and bytes for a long string that is not
# UTF-8, though it annotates str): its decoders are used here only on what was
# checked first.

_NUMBERS = {"octet": struct.Struct(">B"), "short": struct.Struct(">H"),
            "long": struct.Struct(">I"), "longlong": struct.Struct(">Q")}


def erlang_binary(data: bytes, limit: int = 128) -> str:
    """``data`` as Erlang's ``~w`` prints a binary, as in RabbitMQ's texts: <<0,10,255>>.

    Only the first ``limit`` octets: a reply text is cut at 255 octets anyway.
    """
    shown = ",".join(map(str, data[:limit]))
    return f"<<{shown},...>>" if len(data) > limit else f"<<{shown}>>"


def cannot_decode(index: int, payload: bytes) -> AMQPError:
    """RabbitMQ's answer to a method frame whose arguments do not decode."""
    return AMQPError(C.FRAME_ERROR, f"cannot decode {erlang_binary(payload[4:])}",
                     index >> 16, index & 0xFFFF)


def decode_method(index: int, payload: bytes) -> Any:
    """The pamqp method of a method frame's payload (its ids included); AMQPError if it
    does not decode. ``index`` must be one of pamqp's (``commands.INDEX_MAPPING``)."""
    cls: Any = commands.INDEX_MAPPING[index]
    method = cls.__new__(cls)
    end = len(payload)
    pos = 4
    bits = 0
    bit = -1  # the next bit to read from ``bits``; -1: not in a run of bits
    checks: list[tuple[str, str, int, int]] = []  # (field, type, start, stop) read afterwards
    try:
        for name in cls.__slots__:
            kind = cls.amqp_type(name)
            if kind == "bit":
                if bit < 0 or bit == 8:
                    bits, bit = payload[pos], 0
                    pos += 1
                setattr(method, name, bool(bits >> bit & 1))
                bit += 1
                continue
            bit = -1
            if kind == "shortstr":
                start = pos + 1
                pos = start + payload[pos]
            elif kind == "longstr" or kind == "table":
                start = pos + 4
                pos = start + _U32.unpack_from(payload, pos)[0]
            else:
                number = _NUMBERS[kind]
                setattr(method, name, number.unpack_from(payload, pos)[0])
                pos += number.size
                continue
            if pos > end:
                raise cannot_decode(index, payload)
            checks.append((name, kind, start, pos))
    except (IndexError, struct.error):
        raise cannot_decode(index, payload) from None
    if pos != end:
        raise cannot_decode(index, payload)
    for name, kind, start, stop in checks:
        raw = payload[start:stop]
        value: Any
        if kind == "shortstr":
            try:
                value = raw.decode("utf-8")
            except UnicodeDecodeError:  # no method named (on channel 0 the connection names it)
                raise FrameError(MALFORMED_UTF8) from None
        elif kind == "longstr":  # as pamqp gives it: str, or bytes when not UTF-8
            try:
                value = raw.decode("utf-8")
            except UnicodeDecodeError:
                value = raw
        else:
            try:
                check_field_table(payload, start, stop)
                value = decode.field_table(payload[start - 4 : stop])[1]
            except (ValueError, OverflowError, RecursionError):
                raise cannot_decode(index, payload) from None
        setattr(method, name, value)
    return method


# -- fast path: decoding ------------------------------------------------------


@dataclass(slots=True)
class Publish:
    """basic.publish as the fast path decodes it.

    ``route`` keeps the exchange and routing-key short strings as they came
    off the wire, so a delivery re-uses them instead of encoding them again.
    """

    exchange: str
    routing_key: str
    mandatory: bool
    immediate: bool
    route: bytes = b""


def decode_publish(payload: bytes) -> Publish:
    # class, method, ticket (2+2+2), exchange, routing-key, bits
    exchange, pos = _shortstr(payload, 6)
    routing_key, pos = _shortstr(payload, pos)
    bits = payload[pos]
    if pos + 1 != len(payload):
        raise struct.error("basic.publish longer than its arguments")
    return Publish(exchange, routing_key, bool(bits & 1), bool(bits & 2), payload[6:pos])





def decode_ack(payload: bytes) -> tuple[int, bool]:
    """basic.ack (client to server): delivery tag and the multiple bit."""
    if len(payload) != 13:
        raise struct.error("basic.ack is 8 octets of tag and 1 of bits")
    tag = _U64.unpack_from(payload, 4)[0]
    return tag, bool(payload[12] & 1)


def header_body_size(payload: bytes) -> tuple[int, int]:
    """(class id, body size) of a content header payload."""
    if len(payload) < 14:
        raise struct.error("content header too short")
    class_id, _weight, size = _HEADER_PREFIX.unpack_from(payload)
    return class_id, size


# -- fast path: encoding -------------------------------------------------------

_DELIVER_PREFIX = _METHOD_ID.pack(60, 60)
_GET_OK_PREFIX = _METHOD_ID.pack(60, 71)
_ACK_PREFIX = _METHOD_ID.pack(60, 80)
_NACK_PREFIX = _METHOD_ID.pack(60, 120)


def encode_content(channel: int, header: bytes, body: bytes, frame_max: int) -> bytes:
    """Content header + body frames, bodies split at frame_max (pitfall 4)."""
    parts = [encode_frame(C.FRAME_HEADER, channel, header)]
    chunk = frame_max - C.FRAME_OVERHEAD
    if len(body) <= chunk:
        if body:
            parts.append(encode_frame(C.FRAME_BODY, channel, body))
    else:
        view = memoryview(body)
        for start in range(0, len(body), chunk):
            parts.append(encode_frame(C.FRAME_BODY, channel, bytes(view[start : start + chunk])))
    return b"".join(parts)


_FRAME_END_ONLY = b"\xce"
_METHOD_HEAD = struct.Struct(">BHI")


def encode_delivery(channel: int, ctag: bytes, delivery_tag: int, redelivered: bool,
                    route: bytes, header: bytes, body: bytes, frame_max: int) -> bytes:
    """basic.deliver + content header + body in one buffer (the hot path).

    ``ctag`` is the packed consumer-tag short string, ``route`` the packed
    exchange and routing key (kept from the publish).
    """
    if len(body) > frame_max - C.FRAME_OVERHEAD:
        method = b"".join((_DELIVER_PREFIX, ctag, _U64.pack(delivery_tag),
                           b"\x01" if redelivered else b"\x00", route))
        return encode_frame(C.FRAME_METHOD, channel, method) + encode_content(
            channel, header, body, frame_max)
    size = 4 + len(ctag) + 9 + len(route)
    parts = [
        _METHOD_HEAD.pack(1, channel, size), _DELIVER_PREFIX, ctag, _U64.pack(delivery_tag),
        b"\x01" if redelivered else b"\x00", route, _FRAME_END_ONLY,
        _METHOD_HEAD.pack(2, channel, len(header)), header, _FRAME_END_ONLY,
    ]
    if body:
        parts += (_METHOD_HEAD.pack(3, channel, len(body)), body, _FRAME_END_ONLY)
    return b"".join(parts)


def encode_deliver(
    channel: int, consumer_tag: str, delivery_tag: int, redelivered: bool,
    exchange: str, routing_key: str,
) -> bytes:
    payload = b"".join((
        _DELIVER_PREFIX,
        _pack_shortstr(consumer_tag),
        _U64.pack(delivery_tag),
        b"\x01" if redelivered else b"\x00",
        _pack_shortstr(exchange),
        _pack_shortstr(routing_key),
    ))
    return encode_frame(C.FRAME_METHOD, channel, payload)


def encode_get_ok(
    channel: int, delivery_tag: int, redelivered: bool, exchange: str,
    routing_key: str, message_count: int,
) -> bytes:
    payload = b"".join((
        _GET_OK_PREFIX,
        _U64.pack(delivery_tag),
        b"\x01" if redelivered else b"\x00",
        _pack_shortstr(exchange),
        _pack_shortstr(routing_key),
        struct.pack(">I", message_count),
    ))
    return encode_frame(C.FRAME_METHOD, channel, payload)


def encode_confirm(channel: int, delivery_tag: int, multiple: bool, ack: bool) -> bytes:
    """basic.ack or basic.nack (requeue off) from the server, for publisher confirms."""
    if ack:
        payload = _ACK_PREFIX + _U64.pack(delivery_tag) + (b"\x01" if multiple else b"\x00")
    else:
        payload = _NACK_PREFIX + _U64.pack(delivery_tag) + (b"\x01" if multiple else b"\x00")
    return encode_frame(C.FRAME_METHOD, channel, payload)
