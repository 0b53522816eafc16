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

import time
from bisect import bisect_right, insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack


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
# (ENQUEUED_RUN, vhost, queue, first, last, contents[, where]): a message run, the persistent messages
# at consecutive positions first..last of one queue as ONE row and one log record, their
# (exchange, routing_key, header, body) packed once (``pack_run``) by the store's thread
# and written as they are to the operation log and to SQL (``message_runs``); positions
# taken off it are marked apart (``run_marks``) until the run is empty
ENQUEUED_RUN = 7
RUN_MIN = 16  # fewer consecutive messages than this are rows of their own
RUN_MAX = 4096  # messages in one run at most
RUN_MAX_BYTES = 1 << 20  # and body bytes (a bigger run is split): one pack holds the GIL
PUT_META = "put_meta"  # a STATEMENT folded per key: only the last value is written
APPLIED_KEY = "oplog_applied"  # meta: the newest operation log generation wholly in SQL
# Items a loop of this module walks between two hand-overs of the GIL (``_let_others_run``).
# Compiled (brokerha/_native.json), this module's code never runs CPython's eval loop,
# so it does not honour the interpreter's request to drop the GIL (``sys.getswitchinterval``,
# 5 ms) until it returns: a fold of 200,000 dequeues (a backup applying a purge) held it
# 0.14 s, the event loop waiting. 1,024 ops are 0.5-1 ms of work.
YIELD_EVERY = 1024

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
    # (vhost, queue) -> first -> PendingRun: message runs to insert
    runs: dict[tuple[str, str], dict[int, PendingRun]] = field(default_factory=dict)
    # (vhost, queue) -> the firsts of its runs in ``runs``, sorted (a dequeue bisects)
    run_firsts: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    # (vhost, queue, first, last): runs a replay saw wholly taken (their rows must go)
    dropped_runs: list[tuple[str, str, int, int]] = field(default_factory=list)
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
                and not any(self.messages.values()) and not any(self.runs.values())
                and not self.dropped_runs)

    def add(self, unit: Unit) -> None:
        """Fold one more unit in (units in submission order)."""
        messages = self.messages
        n = 0
        for op in unit.ops:
            n += 1
            if n >= YIELD_EVERY:
                n = 0
                _let_others_run()
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
            elif kind == ENQUEUED_RUN:
                self._add_run(op)
            elif kind == ENQUEUED_MANY:
                for piece in runs_of(op):
                    if piece[0] == ENQUEUED_RUN:
                        self._add_run(piece)
                    else:
                        states[piece[3]] = [_INSERT, piece[4], False]
            elif kind == ACQUIRED:
                if op[3] in states or not self._run_acquired(op[1], op[2], op[3]):
                    _acquired(states, op[3])
            elif op[3] not in states and self._run_dequeued(op[1], op[2], op[3]):
                pass
            elif _dequeued(states, op[3], self.cancel):
                self.cancelled += 1
        self.callbacks.extend(unit.callbacks)
        if unit.closes is not None:
            self.closes = unit.closes
            self.meta[APPLIED_KEY] = str(unit.closes)

    # -- message runs ----------------------------------------------------------------------

    def _add_run(self, op: Op) -> None:
        key = (op[1], op[2])
        runs = self.runs.get(key)
        if runs is None:
            runs = self.runs[key] = {}
            self.run_firsts[key] = []
        first = op[3]
        if first not in runs:
            firsts = self.run_firsts[key]
            if not firsts or first > firsts[-1]:
                firsts.append(first)
            else:
                insort(firsts, first)
        # an op of 7: the operation log's thread wrote the contents as a buffer of their own
        # (generation, offset, length, crc32): SQL may keep a reference to them (runs.py)
        runs[first] = PendingRun(first, op[4], op[5], op[6] if len(op) > 6 else None)

    def _drop_run(self, key: tuple[str, str], first: int) -> None:
        del self.runs[key][first]
        self.run_firsts[key].remove(first)

    def _pending_run(self, vhost: str, queue: str, position: int) -> PendingRun | None:
        key = (vhost, queue)
        firsts = self.run_firsts.get(key)
        if not firsts:
            return None
        i = bisect_right(firsts, position) - 1
        if i < 0:
            return None
        run = self.runs[key][firsts[i]]
        return run if position <= run.last else None

    def _run_acquired(self, vhost: str, queue: str, position: int) -> bool:
        run = self._pending_run(vhost, queue, position)
        if run is None:
            return False
        run.delivered.add(position)
        return True

    def _run_dequeued(self, vhost: str, queue: str, position: int) -> bool:
        """A dequeue of a position in a run of this batch: marked; the run goes once empty."""
        run = self._pending_run(vhost, queue, position)
        if run is None:
            return False
        if position not in run.gone:
            run.gone.add(position)
            if self.cancel:
                self.cancelled += 1
        if len(run.gone) == run.last - run.first + 1:
            self._drop_run((vhost, queue), run.first)
            if not self.cancel:  # a replay: the row may be in SQL already
                self.dropped_runs.append((vhost, queue, run.first, run.last))
        return True

    def statement_rows(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The statements in order, then one upsert per meta key."""
        return self.statements + [(PUT_META, item) for item in self.meta.items()]

    def rows(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """(message rows to insert, delivered-flag updates, keys to delete)."""
        inserts: list[tuple[Any, ...]] = []
        delivered: list[tuple[Any, ...]] = []
        deletes: list[tuple[Any, ...]] = []
        n = 0
        for (vhost, queue), states in self.messages.items():
            for position, (state, m, was_delivered) in states.items():
                n += 1
                if n >= YIELD_EVERY:
                    n = 0
                    _let_others_run()
                if state == _INSERT:
                    inserts.append((vhost, queue, position, m.exchange, m.routing_key,
                                    m.header, m.body, was_delivered))
                elif state == _MARK_DELIVERED:
                    delivered.append((True, vhost, queue, position))
                else:
                    deletes.append((vhost, queue, position))
        return inserts, delivered, deletes

    def run_rows(self) -> list[tuple[str, str, PendingRun]]:
        """The message runs to insert (each with its positions taken or delivered since)."""
        return [(vhost, queue, run) for (vhost, queue), runs in self.runs.items()
                for run in runs.values()]


class PendingRun:
    """A message run of a batch, with the positions taken off it or delivered meanwhile."""

    __slots__ = ("first", "last", "contents", "gone", "delivered", "where")

    def __init__(self, first: int, last: int, contents: bytes,
                 where: tuple[int, int, int, int] | None = None) -> None:
        self.first = first
        self.last = last
        self.contents = contents
        self.gone: set[int] = set()
        self.delivered: set[int] = set()
        # (log generation, offset, length, crc32) of ``contents`` in the operation log, when
        # they are a buffer of their own there (runs.py: SQL keeps a reference), else None
        self.where = where


def pack_run(messages: list[Any]) -> bytes:
    """A run's contents: msgpack ``[[exchange, routing_key, header, body], ...]``."""
    data: bytes = msgpack.packb([(m.exchange, m.routing_key, m.header, m.body)
                                 for m in messages], use_bin_type=True)
    return data


def run_rows(contents: bytes) -> Any:
    """A run's contents unpacked: a tuple of ``(exchange, routing_key, header, body)`` rows
    (any other shape is the caller's to refuse: a replicated run is checked)."""
    return msgpack.unpackb(contents, raw=False, use_list=False)


def unpack_run(contents: bytes) -> list[StoredContent]:
    return [StoredContent(e, k, h, b) for e, k, h, b in run_rows(contents)]


def runs_of(op: Op) -> list[Op]:
    """An ``ENQUEUED_MANY`` as the ops it stands for: message runs of its persistent entries
    at consecutive positions (at least ``RUN_MIN``), ``ENQUEUED`` for the others.

    Entries that came packed (``runs.PackedEntries``: a catch-up's ``er`` event), all
    persistent, are one run of the contents as they came, whatever their number: nothing
    is packed again."""
    vhost, queue = op[1], op[2]
    entries = op[3]
    packed = getattr(entries, "contents", None)  # runs.PackedEntries: packed as they came
    if packed is not None and entries and all(e.message.persistent for e in entries):
        return [(ENQUEUED_RUN, vhost, queue, entries[0].position, entries[-1].position, packed)]
    out: list[Op] = []
    pieces = persistent_entries(entries)
    count = len(pieces)
    start = 0
    walked = 0
    while start < count:
        if start - walked >= YIELD_EVERY:  # a run packs at most RUN_MAX messages
            walked = start
            _let_others_run()
        end = start + 1
        size = len(pieces[start][1].body)
        while (end < count and pieces[end][0] == pieces[end - 1][0] + 1
               and end - start < RUN_MAX and size < RUN_MAX_BYTES):
            size += len(pieces[end][1].body)
            end += 1
        if end - start >= RUN_MIN:
            out.append((ENQUEUED_RUN, vhost, queue, pieces[start][0], pieces[end - 1][0],
                        pack_run([m for _, m in pieces[start:end]])))
        else:
            for position, message in pieces[start:end]:
                out.append((ENQUEUED, vhost, queue, position, message))
        start = end
    return out


def persistent_entries(entries: list[Any]) -> list[tuple[int, Any]]:
    """(position, message) of an ``ENQUEUED_MANY``'s entries whose message is persistent."""
    out = []
    n = 0
    for entry in entries:
        n += 1
        if n >= YIELD_EVERY:
            n = 0
            _let_others_run()
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


def _let_others_run() -> None:
    """Release the GIL for a moment: a thread that asked for it (the event loop) takes it."""
    time.sleep(0)


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
    batch.runs.pop((vhost, queue), None)
    batch.run_firsts.pop((vhost, queue), None)
    batch.statements.append(("delete_queue", (vhost, queue)))
    batch.statements.append(("purge_queue", (vhost, queue)))  # its runs and marks too


def _purged(batch: Batch, vhost: str, queue: str, ranges: list[tuple[int, int]]) -> None:
    """Pending states inside the ranges are moot: the ranges' rows all go (one operation).

    Any position a later op of the batch names is outside them: positions grow,
    and purged entries are gone (a queue deleted and declared again starts its
    positions anew, but its rows are written after the ranges are deleted).
    """
    states = batch.messages.get((vhost, queue))
    if states:
        inside = within(ranges)
        n = 0
        for position in list(states):
            n += 1
            if n >= YIELD_EVERY:
                n = 0
                _let_others_run()
            if inside(position):
                del states[position]
    runs = batch.runs.get((vhost, queue))
    if runs:
        n = 0
        for run in list(runs.values()):
            if n >= YIELD_EVERY:
                n = 0
                _let_others_run()
            for lo, hi in ranges:
                lo, hi = max(lo, run.first), min(hi, run.last)
                if lo <= hi:
                    run.gone.update(range(lo, hi + 1))
                    n += hi - lo + 1
            if len(run.gone) == run.last - run.first + 1:
                batch._drop_run((vhost, queue), run.first)  # the purge's range delete: SQL
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
