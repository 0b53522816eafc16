"""Broker objects as replication events (the table in ``cluster.replication``)."""

from __future__ import annotations

from typing import Any

from brokerha.broker.exchange import Binding, Exchange
from brokerha.broker.message import Entry, Message
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R

Event = list[Any]


def exchange_declared(ex: Exchange) -> Event:
    return [R.EXCHANGE_DECLARED, ex.vhost, ex.name, ex.type, ex.durable, ex.auto_delete,
            ex.internal, R.encode_table(ex.arguments)]


def exchange_deleted(ex: Exchange) -> Event:
    return [R.EXCHANGE_DELETED, ex.vhost, ex.name]


def queue_declared(q: Queue) -> Event:
    return [R.QUEUE_DECLARED, q.vhost, q.name, q.durable, q.auto_delete,
            R.encode_table(q.arguments)]


def queue_deleted(q: Queue) -> Event:
    return [R.QUEUE_DELETED, q.vhost, q.name]


def binding(kind: str, b: Binding) -> Event:
    dest_kind = "exchange" if isinstance(b.destination, Exchange) else "queue"
    return [kind, b.source.vhost, b.source.name, dest_kind, b.destination.name, b.routing_key,
            R.encode_table(b.arguments)]


def enqueued(q: Queue, entry: Entry, now: float, message: Message | None = None) -> Event:
    """``message``: the entry's content when ``entry.message`` is a paged-out stub.

    The expiry travels as what is left of it: the two nodes' clocks are unrelated.
    """
    m = message or entry.message
    expires_in = None
    if entry.expires_at is not None:
        expires_in = max(0, int((entry.expires_at - now) * 1000))
    return [R.ENQUEUED, q.vhost, q.name, entry.position, m.exchange, m.routing_key,
            m.header, m.body, expires_in]


def dequeued(q: Queue, positions: list[int]) -> Event:
    return [R.DEQUEUED, q.vhost, q.name, positions]


def is_dequeue_of(event: Event, q: Queue) -> bool:
    """Whether ``event`` is a dequeue on ``q`` a further dequeue can join."""
    return bool(event[0] == R.DEQUEUED and event[2] == q.name and event[1] == q.vhost)


def join_dequeue(event: Event, q: Queue, position: int) -> bool:
    """Add ``position`` to ``event`` if it is a dequeue on ``q`` (one event, one seq)."""
    if not is_dequeue_of(event, q):
        return False
    event[3].append(position)  # dequeued(): [DEQUEUED, vhost, queue, positions]
    return True


def event_size(event: Event) -> int:
    """Rough bytes of an event on the wire (to cut packets)."""
    if event[0] == R.ENQUEUED:
        return 64 + len(event[6]) + len(event[7])
    if event[0] == R.DEQUEUED:
        return 32 + 9 * len(event[3])
    if event[0] in (R.TXLOG_RECORD, R.TXLOG_SNAPSHOT, R.TXLOG_BROKER_BACKUP, R.TXLOG_PEERS):
        return 64 + len(event[-1] or b"")  # an lp of None: back to the configured peers
    return 64
