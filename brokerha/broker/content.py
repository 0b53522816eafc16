"""The parts of an AMQP content header the broker must read or rewrite.

Messages keep the raw content-header bytes from publish to store to delivery
(pamqp's decode/encode is not byte-exact, performance-notes.md pitfall 5).
The broker needs only a few properties (delivery mode, priority, expiration,
headers); ``scan_properties`` reads those by skipping over the rest, and
``rewrite_properties`` re-encodes a header only when the broker must change it
(dead-lettering).
"""

from __future__ import annotations

import datetime
import math
import struct
from typing import Any

from pamqp import commands, decode, encode
from pamqp.header import ContentHeader

_U32 = struct.Struct(">I")
_F32 = struct.Struct(">f")
_F64 = struct.Struct(">d")
_U64 = struct.Struct(">Q")
_PREFIX = 12  # class id, weight, body size

# property flag bits, in wire order (spec 1.8.1: basic properties)
F_CONTENT_TYPE = 1 << 15
F_CONTENT_ENCODING = 1 << 14
F_HEADERS = 1 << 13
F_DELIVERY_MODE = 1 << 12
F_PRIORITY = 1 << 11
F_CORRELATION_ID = 1 << 10
F_REPLY_TO = 1 << 9
F_EXPIRATION = 1 << 8
F_MESSAGE_ID = 1 << 7
F_TIMESTAMP = 1 << 6
F_TYPE = 1 << 5
F_USER_ID = 1 << 4


class Scanned:
    """The properties the broker routes and stores by.

    A plain class, not a dataclass: mypyc compiles it to a native class (a
    ``dataclass(slots=True)`` stayed a Python class whose generated
    ``__init__`` ran for every ``Message`` made).
    """

    def __init__(self) -> None:
        self.persistent: bool = False
        self.priority: int = 0
        self.expiration: str | None = None
        self.user_id: str | None = None
        self.headers_at: int = -1  # offset of the headers table in the raw header, -1 if none
        self.message_id_at: int = -1  # offset of the message-id short string, -1 if none


def scan_properties(header: bytes) -> Scanned:
    """Read delivery mode, priority, expiration and where the headers are.

    Raises ValueError on a header that runs past its end.
    """
    out = Scanned()
    if len(header) < _PREFIX + 2:
        raise ValueError("content header too short")
    flags = (header[_PREFIX] << 8) | header[_PREFIX + 1]
    pos = _PREFIX + 2
    try:
        while header[pos - 1] & 1:  # continuation flag words (unused by 0-9-1)
            pos += 2
        if flags & F_CONTENT_TYPE:
            pos += 1 + header[pos]
        if flags & F_CONTENT_ENCODING:
            pos += 1 + header[pos]
        if flags & F_HEADERS:
            out.headers_at = pos
            pos += 4 + _U32.unpack_from(header, pos)[0]
        if flags & F_DELIVERY_MODE:
            out.persistent = header[pos] == 2
            pos += 1
        if flags & F_PRIORITY:
            out.priority = header[pos]
            pos += 1
        if flags & F_CORRELATION_ID:
            pos += 1 + header[pos]
        if flags & F_REPLY_TO:
            pos += 1 + header[pos]
        if flags & F_EXPIRATION:
            n = header[pos]
            out.expiration = header[pos + 1 : pos + 1 + n].decode("utf-8", "replace")
            pos += 1 + n
        if flags & F_MESSAGE_ID:
            out.message_id_at = pos
            pos += 1 + header[pos]
        if flags & F_USER_ID:
            if flags & F_TIMESTAMP:
                pos += 8
            if flags & F_TYPE:
                pos += 1 + header[pos]
            n = header[pos]
            out.user_id = header[pos + 1 : pos + 1 + n].decode("utf-8", "replace")
            pos += 1 + n
    except (IndexError, struct.error) as exc:
        raise ValueError("content header properties run past the end of the frame") from exc
    if pos > len(header):
        raise ValueError("content header properties run past the end of the frame")
    return out


# -- field tables as RabbitMQ parses them ------------------------------------------
# rabbit_binary_parser:parse_table/parse_array (RabbitMQ 3.10): these type octets
# with these sizes, every length within its table, nothing left over. Anything
# else crashes RabbitMQ's parser; brokerha refuses it where it arrives instead of
# failing later wherever pamqp decodes it lazily (routing, a transaction, a dead
# letter). Also refused, because pamqp cannot decode them although RabbitMQ would:
# a field name that is not UTF-8 and a timestamp beyond the year 9999.

_FIXED_SIZE = {ord(t): n for t, n in (("t", 1), ("b", 1), ("B", 1), ("s", 2), ("u", 2),
                                      ("I", 4), ("i", 4), ("l", 8), ("L", 8), ("D", 5),
                                      ("V", 0), ("f", 4), ("d", 8), ("T", 8))}
_SIZED = frozenset(map(ord, "SxFA"))  # a 32-bit length, then that many octets
TABLE_DEPTH = 100  # nested tables and arrays (pamqp decodes them recursively)


def check_field_table(data: bytes, start: int, end: int, *, utf8_names: bool = True,
                      depth: int = 0) -> list[tuple[bytes, int, int, int]]:
    """Check the field table in ``data[start:end]`` (without its length prefix).

    Returns its top-level entries as (name, type octet, value start, value end);
    raises ValueError saying what is wrong. ``utf8_names=False`` accepts any
    octets as a field name, as RabbitMQ does (an AMQPLAIN response).
    """
    entries: list[tuple[bytes, int, int, int]] = []
    pos = start
    while pos < end:
        stop = pos + 1 + data[pos]
        if stop >= end:
            raise ValueError("field table entry runs past the end of its table")
        name = data[pos + 1 : stop]
        if utf8_names:
            try:
                name.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"field name {name!r} is not UTF-8") from None
        kind = data[stop]
        pos = _check_field_value(data, stop, end, depth, utf8_names)
        entries.append((name, kind, stop + 1, pos))
    return entries


def _check_field_array(data: bytes, start: int, end: int, depth: int, utf8_names: bool) -> None:
    pos = start
    while pos < end:
        pos = _check_field_value(data, pos, end, depth, utf8_names)


def _check_field_value(data: bytes, pos: int, end: int, depth: int, utf8_names: bool) -> int:
    """Check the typed value at ``pos`` (its type octet); where the next entry starts."""
    kind = data[pos]
    pos += 1
    size = _FIXED_SIZE.get(kind)
    if size is not None:
        if pos + size > end:
            raise ValueError(f"field value of type {chr(kind)!r} runs past the end of its table")
        if kind == 0x54:  # T: a timestamp pamqp can turn into a datetime
            seconds: float = _U64.unpack_from(data, pos)[0]
            if seconds > 0xFFFFFFFF:  # pamqp reads these as milliseconds
                seconds /= 1000.0
            try:
                datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
            except (ValueError, OverflowError, OSError):
                raise ValueError(f"timestamp {seconds} is out of range") from None
        elif kind == 0x64 or kind == 0x66:  # d, f: Erlang reads no NaN or infinity
            value = (_F64 if kind == 0x64 else _F32).unpack_from(data, pos)[0]
            if not math.isfinite(value):
                raise ValueError(f"field value {value} is not a finite number")
        return pos + size
    if kind not in _SIZED:
        raise ValueError(f"unknown field type {bytes([kind])!r}")
    if pos + 4 > end:
        raise ValueError(f"field value of type {chr(kind)!r} runs past the end of its table")
    stop: int = pos + 4 + _U32.unpack_from(data, pos)[0]
    if stop > end:
        raise ValueError(f"field value of type {chr(kind)!r} runs past the end of its table")
    if kind == 0x46 or kind == 0x41:  # F, A
        if depth >= TABLE_DEPTH:
            raise ValueError(f"field tables nested more than {TABLE_DEPTH} deep")
        if kind == 0x46:
            check_field_table(data, pos + 4, stop, utf8_names=utf8_names, depth=depth + 1)
        else:
            _check_field_array(data, pos + 4, stop, depth + 1, utf8_names)
    return stop


def read_message_id(header: bytes) -> str | None:
    """The ``message_id`` property, or None (read only by deduplicating queues).

    Bytes that are not UTF-8 are kept distinct (surrogateescape).
    """
    try:
        at = scan_properties(header).message_id_at
    except ValueError:
        return None
    if at < 0:
        return None
    n = header[at]
    return header[at + 1 : at + 1 + n].decode("utf-8", "surrogateescape")


def read_headers(header: bytes, headers_at: int) -> dict[str, Any]:
    """Decode the headers table (for the headers exchange and dead-lettering)."""
    if headers_at < 0:
        return {}
    _, table = decode.field_table(header[headers_at:])
    return dict(table)


def decode_header(header: bytes) -> ContentHeader:
    frame = ContentHeader()
    frame.unmarshal(header)
    return frame


# basic properties in wire order: pamqp's name, flag bit, type
_PROPERTIES = (
    ("content_type", F_CONTENT_TYPE, "shortstr"), ("content_encoding", F_CONTENT_ENCODING, "shortstr"),
    ("headers", F_HEADERS, "table"), ("delivery_mode", F_DELIVERY_MODE, "octet"),
    ("priority", F_PRIORITY, "octet"), ("correlation_id", F_CORRELATION_ID, "shortstr"),
    ("reply_to", F_REPLY_TO, "shortstr"), ("expiration", F_EXPIRATION, "shortstr"),
    ("message_id", F_MESSAGE_ID, "shortstr"), ("timestamp", F_TIMESTAMP, "timestamp"),
    ("message_type", F_TYPE, "shortstr"), ("user_id", F_USER_ID, "shortstr"),
    ("app_id", 1 << 3, "shortstr"), ("cluster_id", 1 << 2, "shortstr"),
)
_PROPERTY_NAMES = frozenset(name for name, _, _ in _PROPERTIES)


def _property_spans(header: bytes) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(flags, where the properties start, name -> (start, stop) of each one present)."""
    flags = (header[_PREFIX] << 8) | header[_PREFIX + 1]
    first = pos = _PREFIX + 2
    spans: dict[str, tuple[int, int]] = {}
    try:
        while header[first - 1] & 1:  # continuation flag words (unused by 0-9-1)
            first += 2
        pos = first
        for name, flag, kind in _PROPERTIES:
            if flags & flag:
                start = pos
                if kind == "shortstr":
                    pos += 1 + header[pos]
                elif kind == "table":
                    pos += 4 + _U32.unpack_from(header, pos)[0]
                else:
                    pos += 1 if kind == "octet" else 8
                spans[name] = (start, pos)
    except (IndexError, struct.error):
        pos = len(header) + 1
    if pos > len(header):
        raise ValueError("content header properties run past the end of the frame")
    return flags, first, spans


def check_content_header(header: bytes) -> None:
    """Check what ``scan_properties`` skips: every property within the frame (app-id and
    cluster-id too) and the headers table (``check_field_table``). Raises ValueError."""
    _, _, spans = _property_spans(header)
    table = spans.get("headers")
    if table is not None:
        check_field_table(header, table[0] + 4, table[1])


def rewrite_properties(header: bytes, **changes: Any) -> bytes:
    """A new raw header with some properties changed (None removes one).

    The properties not changed keep their octets: RabbitMQ takes short strings
    that are not UTF-8 and timestamps pamqp cannot turn into a datetime, and a
    dead letter must not fail on them. ``headers`` may be a dict or a table
    already encoded (with its length, as ``update_headers`` makes it).
    """
    unknown = set(changes) - _PROPERTY_NAMES
    if unknown:
        raise ValueError(f"no such properties: {sorted(unknown)}")
    flags, first, spans = _property_spans(header)
    parts: list[bytes] = []
    for name, flag, kind in _PROPERTIES:
        if name not in changes:
            span = spans.get(name)
            if span is not None:
                parts.append(header[span[0] : span[1]])
            continue
        value = changes[name]
        if value is None:
            flags &= ~flag
        else:
            flags |= flag
            if kind == "table":
                parts.append(value if isinstance(value, bytes) else encode_field_table(value))
            else:
                parts.append(encode.by_type(value, kind))
    return b"".join((header[:_PREFIX], struct.pack(">H", flags), header[_PREFIX + 2 : first],
                     *parts))


def update_headers(header: bytes, headers_at: int, changes: dict[str, Any]) -> bytes:
    """The headers table of a raw content header with ``changes`` made (None removes an
    entry), encoded with its length: the other entries keep their octets (a double
    stays a double, a long string that is not UTF-8 stays as it was), the changed
    ones follow. Raises ValueError if the table does not parse."""
    parts: list[bytes] = []
    if headers_at >= 0:
        start = headers_at + 4
        for name, _, value_start, value_end in check_field_table(
                header, start, start + _U32.unpack_from(header, headers_at)[0]):
            if name.decode("utf-8") not in changes:
                parts.append(header[value_start - 2 - len(name) : value_end])
    for key, value in changes.items():
        if value is not None:
            parts.append(pack_shortstr(key) + encode_field_value(value))
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


def encode_field_table(table: dict[str, Any]) -> bytes:
    """A field table with its length; unlike pamqp's, bytes are a long string as they
    came (pamqp decodes a long string that is not UTF-8 to bytes but cannot encode
    them) and a float is a double."""
    body = b"".join(pack_shortstr(name) + encode_field_value(value)
                    for name, value in table.items())
    return _U32.pack(len(body)) + body


def encode_field_value(value: Any) -> bytes:
    if isinstance(value, bytes):
        return b"S" + _U32.pack(len(value)) + value
    if isinstance(value, dict):
        return b"F" + encode_field_table(value)
    if isinstance(value, list):
        body = b"".join(encode_field_value(item) for item in value)
        return b"A" + _U32.pack(len(body)) + body
    if isinstance(value, float):
        return b"d" + _F64.pack(value)
    return encode.encode_table_value(value)


def pack_shortstr(value: str) -> bytes:
    """An AMQP short string; surrogateescape keeps non-UTF-8 routing keys exact."""
    raw = value.encode("utf-8", "surrogateescape")
    if len(raw) > 255:
        raise ValueError("short string longer than 255 bytes")
    return bytes((len(raw),)) + raw


def build_header(body_size: int, properties: commands.Basic.Properties | None = None) -> bytes:
    """A raw header for a message the broker creates itself."""
    return ContentHeader(0, body_size, properties or commands.Basic.Properties()).marshal()
