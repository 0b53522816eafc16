"""Messages and queue entries.

A Message is immutable content shared by every queue it was routed to; an
Entry is one message's place in one queue, numbered by its replication id
(seed 002: ids assigned when a message is first routed, monotonic per queue).
"""

from __future__ import annotations

import itertools
from typing import Any

from mypy_extensions import mypyc_attr

from brokerha.broker.content import pack_shortstr, read_headers, scan_properties

_message_ids = itertools.count(1)


@mypyc_attr(allow_interpreted_subclasses=True)  # broker/paging.py's PagedMessage
class Message:
    __slots__ = (
        "exchange", "routing_key", "header", "body", "msg_id",
        "persistent", "priority", "expiration_ms", "_headers_at", "_headers", "_route", "user_id",
    )

    def __init__(self, exchange: str, routing_key: str, header: bytes, body: bytes,
                 msg_id: int | None = None, route: bytes | None = None) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self._route = route
        self.header = header
        self.body = body
        self.msg_id = next(_message_ids) if msg_id is None else msg_id
        scanned = scan_properties(header)
        self.persistent = scanned.persistent
        self.priority = scanned.priority
        self.user_id = scanned.user_id
        self._headers_at = scanned.headers_at
        self._headers: dict[str, Any] | None = None
        self.expiration_ms = _parse_expiration(scanned.expiration)

    @property
    def route(self) -> bytes:
        """Exchange and routing key as wire short strings (kept from the publish)."""
        if self._route is None:
            self._route = pack_shortstr(self.exchange) + pack_shortstr(self.routing_key)
        return self._route

    @property
    def size(self) -> int:
        return len(self.body) + len(self.header)

    @property
    def headers(self) -> dict[str, Any]:
        if self._headers is None:
            self._headers = read_headers(self.header, self._headers_at)
        return self._headers

    def __repr__(self) -> str:
        return f"Message({self.msg_id}, {self.exchange!r}, {self.routing_key!r}, {len(self.body)}B)"


def _parse_expiration(value: str | None) -> int | None:
    """The per-message TTL in ms; RabbitMQ accepts only a non-negative integer string."""
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"invalid expiration '{value}'")
    return int(value)


class Entry:
    """A message on one queue: its replication id, delivery state, expiry."""

    __slots__ = ("position", "message", "redelivered", "expires_at", "delivery_count", "paged")

    def __init__(self, position: int, message: Message, expires_at: float | None) -> None:
        self.position = position
        self.message = message
        self.redelivered = False
        self.expires_at = expires_at
        self.delivery_count = 0
        self.paged = 0  # brokerha.broker.paging: RESIDENT, PENDING or PAGED

    def __repr__(self) -> str:
        return f"Entry({self.position}, {self.message!r})"
