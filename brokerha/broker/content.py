"""The parts of an AMQP content header the broker must read or rewrite.

Messages keep the raw content-header bytes from publish to store to delivery
(pamqp's decode/encode is not byte-exact, performance-notes.md pitfall 5).
The broker needs only a few properties (delivery mode, priority, expiration,
headers); ``scan_properties`` reads those by skipping over the rest, and
``rewrite_properties`` re-encodes a header only when the broker must change it
(dead-lettering).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from pamqp import commands, decode
from pamqp.header import ContentHeader

_U32 = struct.Struct(">I")
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


@dataclass(slots=True)
class Scanned:
    """The properties the broker routes and stores by."""

    persistent: bool = False
    priority: int = 0
    expiration: str | None = None
    user_id: str | None = None
    headers_at: int = -1  # offset of the headers table in the raw header, -1 if none
    message_id_at: int = -1  # offset of the message-id short string, -1 if none


def scan_properties(header: bytes) -> Scanned:
    """Read delivery mode, priority, expiration and where the headers are.

    Raises ValueError on a header that runs past its end.
    """
    out = Scanned()
    if len(header) < _PREFIX + 2:
        raise ValueError("content header too short")
    flags = (header[_PREFIX] << 8) | header[_PREFIX + 1]
    pos = _PREFIX + 2
    while header[pos - 1] & 1:  # continuation flag words (unused by 0-9-1)
        pos += 2
    try:
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


def rewrite_properties(header: bytes, **changes: Any) -> bytes:
    """A new raw header with some properties changed (None removes one)."""
    frame = decode_header(header)
    props = frame.properties
    for name, value in changes.items():
        setattr(props, name, value)
    return ContentHeader(0, frame.body_size, props).marshal()


def pack_shortstr(value: str) -> bytes:
    """An AMQP short string; surrogateescape keeps non-UTF-8 routing keys exact."""
    raw = value.encode("utf-8", "surrogateescape")
    if len(raw) > 255:
        raise ValueError("short string longer than 255 bytes")
    return bytes((len(raw),)) + raw


def build_header(body_size: int, properties: commands.Basic.Properties | None = None) -> bytes:
    """A raw header for a message the broker creates itself."""
    return ContentHeader(0, body_size, properties or commands.Basic.Properties()).marshal()
