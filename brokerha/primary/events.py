"""Broker objects as replication events (the table in ``cluster.replication``)."""

from __future__ import annotations

from typing import Any

from brokerha.broker.definitions import DefinitionChange, Definitions
from brokerha.broker.exchange import Binding, Exchange
from brokerha.broker.message import Entry, Message
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R
from brokerha.store.batch import pack_run

Event = Any  # one of cluster.replication's records (a NamedTuple; an array on the wire)


def definition_changed(change: DefinitionChange) -> Event:
    return R.DefinitionChanged(R.DEFINITION, change.as_wire())


def definitions(defs: Definitions) -> Event:
    """Every definition: a joining backup's become these (``BrokerReplicator``)."""
    return R.DefinitionsSnapshot(R.DEFINITIONS, [c.as_wire() for c in defs.changes()])


def exchange_declared(ex: Exchange) -> Event:
    return R.ExchangeDeclared(R.EXCHANGE_DECLARED, ex.vhost, ex.name, ex.type, ex.durable,
                              ex.auto_delete, ex.internal, R.encode_table(ex.arguments))


def exchange_deleted(ex: Exchange) -> Event:
    return R.ExchangeDeleted(R.EXCHANGE_DELETED, ex.vhost, ex.name)


def queue_declared(q: Queue) -> Event:
    return R.QueueDeclared(R.QUEUE_DECLARED, q.vhost, q.name, q.durable, q.auto_delete,
                           R.encode_table(q.arguments))


def queue_deleted(q: Queue) -> Event:
    return R.QueueDeleted(R.QUEUE_DELETED, q.vhost, q.name)


def binding(kind: str, b: Binding) -> Event:
    dest_kind = "exchange" if isinstance(b.destination, Exchange) else "queue"
    return R.BindingChanged(kind, b.source.vhost, b.source.name, dest_kind, b.destination.name,
                            b.routing_key, R.encode_table(b.arguments))


def enqueued(q: Queue, entry: Entry, now: float, message: Message | None = None) -> Event:
    """``message``: the entry's content when ``entry.message`` is a paged-out stub.

    The expiry travels as what is left of it: the two nodes' clocks are unrelated.
    """
    m = message or entry.message
    expires_in = None
    if entry.expires_at is not None:
        expires_in = max(0, int((entry.expires_at - now) * 1000))
    return R.Enqueued(R.ENQUEUED, q.vhost, q.name, entry.position, m.exchange, m.routing_key,
                      m.header, m.body, expires_in)


def enqueued_run(q: Queue, first: int, messages: list[Message]) -> Event:
    """``messages`` at positions ``first``.. (none expires), their contents packed once in
    the store's run format: the backup stores that blob as it is (``cluster/replication.py``)."""
    return R.EnqueuedRun(R.ENQUEUED_RUN, q.vhost, q.name, first, len(messages),
                         pack_run(messages))


def te_runs(q: Queue, entries: list[Entry], index_of: dict[int, int]) -> list[Any]:
    """A committing transaction's batch for ``q`` as the ops of its ``tc`` refer to its te
    content: runs of consecutive positions whose messages are consecutive te events (and
    do not expire) as one ``OpRefs`` each; any other entry as itself, for the caller to
    make its op (compiled: 100,000 entries of a TX took 30 ms of the commit's loop step
    interpreted, issue 33)."""
    out: list[Any] = []
    vhost, name = q.vhost, q.name
    first = start = count = 0
    for entry in entries:
        index = index_of.get(entry.message.msg_id)
        if index is not None and entry.expires_at is None:
            if count and entry.position == first + count and index == start + count:
                count += 1
                continue
            if count:
                out.append(R.OpRefs(R.OP_REFS, vhost, name, first, start, count))
            first, start, count = entry.position, index, 1
            continue
        if count:
            out.append(R.OpRefs(R.OP_REFS, vhost, name, first, start, count))
            count = 0
        out.append(entry)
    if count:
        out.append(R.OpRefs(R.OP_REFS, vhost, name, first, start, count))
    return out


# a body over this goes as ``bp`` events of this size, then its ``e`` with an empty body
# (cluster/replication.py): one 50 MiB message packed and written whole to two backups
# held the primary's loop 0.1-0.4 s (issue 33)
BODY_PART_BYTES = 1 << 20


def in_parts(event: Event, part_bytes: int = BODY_PART_BYTES) -> list[Event]:
    """An ``e`` event as it is sent: itself, or its body's parts and then itself bodiless.

    The parts are views of the body (no copy); each is packed when its packet is.
    ``part_bytes``: smaller in simulations (``PrimarySettings``), so that their
    small bodies go in parts.
    """
    body = event.body
    size = len(body)
    if size <= part_bytes:
        return [event]
    view = memoryview(body)
    parts: list[Event] = [R.BodyPart(R.BODY_PART, view[start:start + part_bytes])
                          for start in range(0, size, part_bytes)]
    parts.append(event._replace(body=b""))
    return parts


def dequeued(q: Queue, positions: list[int]) -> Event:
    return R.Dequeued(R.DEQUEUED, q.vhost, q.name, positions)


def is_dequeue_of(event: Event, q: Queue) -> bool:
    """Whether ``event`` is a dequeue on ``q`` a further dequeue can join."""
    return bool(event.kind == R.DEQUEUED and event.queue == q.name and event.vhost == q.vhost)


# a dequeue event's bound: a purge of a deep queue goes as several events, so that neither
# side spends one long step on it (packing, applying) and packets stay bounded
DEQUEUES_PER_EVENT = 4096


def join_dequeue(event: Event, q: Queue, position: int) -> bool:
    """Add ``position`` to ``event`` if it is a dequeue on ``q`` with room (one event, one seq)."""
    if not is_dequeue_of(event, q) or len(event.positions) >= DEQUEUES_PER_EVENT:
        return False
    event.positions.append(position)
    return True


def event_work(event: Event) -> int:
    """Rough work of applying an event on a backup (to cut packets): entries it touches."""
    kind = event[0]
    if kind == R.DEQUEUED:
        return len(event.positions)
    return event.length if kind == R.ENQUEUED_RUN else 1


def event_size(event: Event) -> int:
    """Rough bytes of an event on the wire (to cut packets)."""
    kind = event[0]
    if kind == R.ENQUEUED:
        return 64 + len(event.header) + len(event.body)
    if kind == R.ENQUEUED_RUN:
        return 64 + len(event.contents)
    if kind == R.BODY_PART:
        return 16 + len(event.data)
    if kind == R.DEQUEUED:
        return 32 + 9 * len(event.positions)
    if kind in (R.TXLOG_RECORD, R.TXLOG_SNAPSHOT, R.TXLOG_BROKER_BACKUP, R.TXLOG_PEERS):
        return 64 + len(event[-1] or b"")  # an lp of None: back to the configured peers
    if kind == R.DEFINITIONS:
        return 64 + sum(64 + len(change[2]) for change in event.changes)
    return 64
