"""Folding recorded broker events into the rows of one database transaction.

The event-loop thread only appends small tuples (``Op``); the writer thread
folds everything that piled up into a ``Batch`` before it commits. The fold
keeps one final state per message, so a message enqueued and dequeued before
its commit (the fast-consumer case) is never written at all, configuration
statements keep their order, and of the meta values only the last one per key
is written. With the operation log (``brokerha.store.oplog``) a batch folds
everything logged since the previous apply, so the window is much wider.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class StoredContent(NamedTuple):
    """A message's row fields read back from the operation log (a ``Message`` has the same)."""

    exchange: str
    routing_key: str
    header: bytes
    body: bytes

# Op kinds (first element of each op tuple).
ENQUEUED = 0  # (ENQUEUED, vhost, queue, position, message)
ACQUIRED = 1  # (ACQUIRED, vhost, queue, position)
DEQUEUED = 2  # (DEQUEUED, vhost, queue, position)
STATEMENT = 3  # (STATEMENT, statement name, params): exchanges, queues, bindings, ...
QUEUE_DELETED = 4  # (QUEUE_DELETED, vhost, queue)
PURGED = 5  # (PURGED, vhost, queue, [(first, last), ...]): a queue.purge, positions inclusive
# (ENQUEUED_MANY, vhost, queue, [entry, ...]): a batch of enqueues (a TX's); only the
# entries of persistent messages are stored (``persistent_entries``)
ENQUEUED_MANY = 6
PUT_META = "put_meta"  # a STATEMENT folded per key: only the last value is written
APPLIED_KEY = "oplog_applied"  # meta: the newest operation log generation wholly in SQL

Op = tuple[Any, ...]
Callback = Callable[[], None]

# Final states of one message within a batch.
_INSERT = 0
_MARK_DELIVERED = 1
_DELETE = 2


@dataclass
class Unit:
    """What the event loop handed over at one safe point: ops, then the barriers after them.

    A unit is never split across commits, which is what makes a tx.commit
    (all its enqueues and dequeues are recorded in one loop callback) atomic.
    """

    ops: list[Op]
    callbacks: list[Callback]
    readable: list[Callback] = field(default_factory=list)  # oplog: after the SQL commit
    closes: int | None = None  # oplog: the last unit of this log generation


@dataclass
class Batch:
    statements: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)  # put_meta, last value per key
    # (vhost, queue) -> position -> [state, content, delivered]
    messages: dict[tuple[str, str], dict[int, list[Any]]] = field(default_factory=dict)
    # (vhost, queue, first, last): purged ranges, deleted after the statements, before
    # the message rows (a position in one has no pending state left in ``messages``)
    purges: list[tuple[str, str, int, int]] = field(default_factory=list)
    callbacks: list[Callback] = field(default_factory=list)
    cancelled: int = 0
    closes: int | None = None  # the newest log generation this batch completes
    # An insert and its delete cancel only when the batch holds every op since the
    # last commit. A replay of the operation log re-reads a file whose first part
    # may already be in SQL: there a dequeue must delete the row.
    cancel: bool = True

    @property
    def empty(self) -> bool:
        return (not self.statements and not self.meta and not self.purges
                and not any(self.messages.values()))

    def add(self, unit: Unit) -> None:
        """Fold one more unit in (units in submission order)."""
        messages = self.messages
        for op in unit.ops:
            kind = op[0]
            if kind == STATEMENT:
                if op[1] == PUT_META:
                    self.meta[op[2][0]] = op[2][1]
                else:
                    self.statements.append((op[1], op[2]))
                continue
            if kind == QUEUE_DELETED:
                _queue_deleted(self, op[1], op[2])
                continue
            if kind == PURGED:
                _purged(self, op[1], op[2], op[3])
                continue
            states = messages.get((op[1], op[2]))
            if states is None:
                states = messages[(op[1], op[2])] = {}
            if kind == ENQUEUED:
                states[op[3]] = [_INSERT, op[4], False]
            elif kind == ENQUEUED_MANY:
                for position, content in persistent_entries(op[3]):
                    states[position] = [_INSERT, content, False]
            elif kind == ACQUIRED:
                _acquired(states, op[3])
            elif _dequeued(states, op[3], self.cancel):
                self.cancelled += 1
        self.callbacks.extend(unit.callbacks)
        if unit.closes is not None:
            self.closes = unit.closes
            self.meta[APPLIED_KEY] = str(unit.closes)

    def statement_rows(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements in order, then one upsert per meta key."""
        return self.statements + [(PUT_META, item) for item in self.meta.items()]

    def rows(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """(message rows to insert, delivered-flag updates, keys to delete)."""
        inserts: list[tuple[Any, ...]] = []
        delivered: list[tuple[Any, ...]] = []
        deletes: list[tuple[Any, ...]] = []
        for (vhost, queue), states in self.messages.items():
            for position, (state, m, was_delivered) in states.items():
                if state == _INSERT:
                    inserts.append((vhost, queue, position, m.exchange, m.routing_key,
                                    m.header, m.body, was_delivered))
                elif state == _MARK_DELIVERED:
                    delivered.append((True, vhost, queue, position))
                else:
                    deletes.append((vhost, queue, position))
        return inserts, delivered, deletes


def persistent_entries(entries: list[Any]) -> list[tuple[int, Any]]:
    """(position, message) of an ``ENQUEUED_MANY``'s entries whose message is persistent."""
    out = []
    for entry in entries:
        message = entry.message
        if message.persistent:
            out.append((entry.position, message))
    return out


def _acquired(states: dict[int, list[Any]], position: int) -> None:
    state = states.get(position)
    if state is None:
        states[position] = [_MARK_DELIVERED, None, True]
    elif state[0] == _INSERT:
        state[2] = True


def _dequeued(states: dict[int, list[Any]], position: int, cancel: bool) -> bool:
    """True when the dequeue cancelled an insert of the same batch."""
    state = states.get(position)
    if cancel and state is not None and state[0] == _INSERT:
        del states[position]
        return True
    states[position] = [_DELETE, None, False]
    return False


def fold(units: Iterable[Unit]) -> Batch:
    """One batch from units in submission order."""
    batch = Batch()
    for unit in units:
        batch.add(unit)
    return batch


def _queue_deleted(batch: Batch, vhost: str, queue: str) -> None:
    """Pending message states of the queue are moot: its rows all go, in statement order.

    Statements run before message rows, so rows recorded after this point
    (a queue re-declared with the same name) are written after the purge.
    """
    batch.messages.pop((vhost, queue), None)
    batch.statements.append(("delete_queue", (vhost, queue)))
    batch.statements.append(("purge_queue", (vhost, queue)))


def _purged(batch: Batch, vhost: str, queue: str, ranges: list[tuple[int, int]]) -> None:
    """Pending states inside the ranges are moot: the ranges' rows all go (one operation).

    Any position a later op of the batch names is outside them: positions grow,
    and purged entries are gone (a queue deleted and declared again starts its
    positions anew, but its rows are written after the ranges are deleted).
    """
    states = batch.messages.get((vhost, queue))
    if states:
        inside = within(ranges)
        for position in [p for p in states if inside(p)]:
            del states[position]
    batch.purges.extend((vhost, queue, first, last) for first, last in ranges)


def within(ranges: list[tuple[int, int]]) -> Callable[[int], bool]:
    """A membership test for inclusive ranges (sorted once, then bisected)."""
    if len(ranges) == 1:
        lo, hi = ranges[0]
        return lambda p: lo <= p <= hi
    ordered = sorted(ranges)
    starts = [lo for lo, _ in ordered]

    def inside(p: int) -> bool:
        i = bisect_right(starts, p) - 1
        return i >= 0 and p <= ordered[i][1]

    return inside
