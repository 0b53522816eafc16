"""Folding recorded broker events into the rows of one database transaction.

The event-loop thread only appends small tuples (``Op``); the writer thread
folds everything that piled up into a ``Batch`` just before it commits. The
fold keeps one final state per message, so a message enqueued and dequeued
before its commit (the fast-consumer case) is never written at all, and
configuration statements keep their order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from brokerha.broker.message import Entry

# Op kinds (first element of each op tuple).
ENQUEUED = 0  # (ENQUEUED, vhost, queue, entry)
ACQUIRED = 1  # (ACQUIRED, vhost, queue, entry)
DEQUEUED = 2  # (DEQUEUED, vhost, queue, entry)
STATEMENT = 3  # (STATEMENT, statement name, params): exchanges, queues, bindings
QUEUE_DELETED = 4  # (QUEUE_DELETED, vhost, queue)

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


@dataclass
class Batch:
    statements: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    # (vhost, queue) -> position -> [state, entry, delivered]
    messages: dict[tuple[str, str], dict[int, list[Any]]] = field(default_factory=dict)
    callbacks: list[Callback] = field(default_factory=list)
    cancelled: int = 0

    @property
    def empty(self) -> bool:
        return not self.statements and not any(self.messages.values())

    def rows(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """(message rows to insert, delivered-flag updates, keys to delete)."""
        inserts: list[tuple[Any, ...]] = []
        delivered: list[tuple[Any, ...]] = []
        deletes: list[tuple[Any, ...]] = []
        for (vhost, queue), states in self.messages.items():
            for position, (state, entry, was_delivered) in states.items():
                if state == _INSERT:
                    m = entry.message
                    inserts.append((vhost, queue, position, m.exchange, m.routing_key,
                                    m.header, m.body, was_delivered))
                elif state == _MARK_DELIVERED:
                    delivered.append((True, vhost, queue, position))
                else:
                    deletes.append((vhost, queue, position))
        return inserts, delivered, deletes


def _enqueued(states: dict[int, list[Any]], entry: Entry) -> None:
    states[entry.position] = [_INSERT, entry, False]


def _acquired(states: dict[int, list[Any]], entry: Entry) -> None:
    state = states.get(entry.position)
    if state is None:
        states[entry.position] = [_MARK_DELIVERED, entry, True]
    elif state[0] == _INSERT:
        state[2] = True


def _dequeued(states: dict[int, list[Any]], entry: Entry) -> bool:
    """True when the dequeue cancelled an insert of the same batch."""
    state = states.get(entry.position)
    if state is not None and state[0] == _INSERT:
        del states[entry.position]
        return True
    states[entry.position] = [_DELETE, entry, False]
    return False


def fold(units: Iterable[Unit]) -> Batch:
    """One batch from units in submission order."""
    batch = Batch()
    messages = batch.messages
    for unit in units:
        for op in unit.ops:
            kind = op[0]
            if kind == STATEMENT:
                batch.statements.append((op[1], op[2]))
                continue
            if kind == QUEUE_DELETED:
                _queue_deleted(batch, op[1], op[2])
                continue
            states = messages.get((op[1], op[2]))
            if states is None:
                states = messages[(op[1], op[2])] = {}
            if kind == ENQUEUED:
                _enqueued(states, op[3])
            elif kind == ACQUIRED:
                _acquired(states, op[3])
            elif _dequeued(states, op[3]):
                batch.cancelled += 1
        batch.callbacks.extend(unit.callbacks)
    return batch


def _queue_deleted(batch: Batch, vhost: str, queue: str) -> None:
    """Pending message states of the queue are moot: its rows all go, in statement order.

    Statements run before message rows, so rows recorded after this point
    (a queue re-declared with the same name) are written after the purge.
    """
    batch.messages.pop((vhost, queue), None)
    batch.statements.append(("delete_queue", (vhost, queue)))
    batch.statements.append(("purge_queue", (vhost, queue)))
