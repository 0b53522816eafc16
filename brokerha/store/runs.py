"""Message runs in SQL: which positions each stored run still holds, and the rows that say so.

A message run (``batch.ENQUEUED_RUN``) is the persistent messages at
consecutive positions ``first..last`` of one queue, stored as ONE row of
``message_runs`` (their contents packed once, ``batch.pack_run``) instead of
one row each: a backup's catch-up and a transaction's enqueues come as such
runs, and one insert of ~1 MiB costs SQLite a fraction of a thousand 1 KiB
inserts. What happens to a position afterwards is a row of ``run_marks``:
``gone`` (dequeued, purged) or delivered. When every position of a run is
gone, the run and its marks are deleted together.

The writer thread keeps a ``RunIndex`` of the stored runs (first, last and
the positions gone: a few numbers per run), loaded from SQL when it starts
(and again after a failed commit, which SQL rolled back), so that a dequeue
is classified without a query: a position in a run is marked, any other
deletes its ``messages`` row as before.

A run's contents written whole to the operation log (a catch-up's run of at
least ``oplog.BIG_BODY``: a buffer of its own in the log record) are not
written to SQL again: its ``contents`` column holds a **log reference**
(``log_ref``: the log file's generation, the contents' offset, length and
crc32, behind the byte 0xc1, which msgpack never uses, so a run's packed
contents never begin with it), and that log file is kept past its apply
(``OpLog.keep``) while a stored run refers to it. The run's bytes are then
written once, where SQL would have written them twice (its WAL, then the
database at the checkpoint). ``RunIndex.files`` counts the stored runs of
each kept file; a file whose last run went is deleted after that commit.
Reading a run back (``resolve``) reads the file and checks the crc32.
"""

from __future__ import annotations

import os
import struct
import zlib
from bisect import bisect_right, insort
from pathlib import Path
from typing import Any

from brokerha.store.batch import Batch
from brokerha.store.schema import Statements

Key = tuple[str, str]

# a log reference: 0xc1 "R" version, then generation, offset, length, crc32
_REF = struct.Struct("<3sQQII")
REF_TAG = b"\xc1R\x01"
REF_BYTES = _REF.size
# the runs whose contents SQL holds as a reference (a run's packed contents are longer)
SELECT_REFS = ('SELECT "vhost", "queue", "first_position", "contents" FROM "message_runs" '
               f'WHERE length("contents") <= {REF_BYTES}')


class RunRefError(RuntimeError):
    """A stored run refers to a log file that is gone or holds other bytes (a broken store)."""


def log_ref(generation: int, offset: int, length: int, crc: int) -> bytes:
    """What SQL stores for a run whose contents stay in log file ``generation``."""
    return _REF.pack(REF_TAG, generation, offset, length, crc)


def ref_of(blob: bytes) -> tuple[int, int, int, int] | None:
    """(generation, offset, length, crc) of a log reference; None for packed contents."""
    if len(blob) != REF_BYTES or blob[:3] != REF_TAG:
        return None
    _, generation, offset, length, crc = _REF.unpack(blob)
    return generation, offset, length, crc


def log_file(database: Path, generation: int) -> Path:
    """The operation log's file ``generation`` next to ``database`` (``OpLog.path``)."""
    return database.parent / f"{database.name}.oplog.{generation:010d}"


def resolve(blob: bytes, database: Path) -> bytes:
    """A stored run's packed contents: ``blob`` itself, or what its log reference names."""
    ref = ref_of(blob)
    if ref is None:
        return blob
    generation, offset, length, crc = ref
    path = log_file(database, generation)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise RunRefError(f"a stored message run refers to {path}: {exc}") from exc
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(data) != length or zlib.crc32(data) != crc:
        raise RunRefError(f"a stored message run refers to {path} at {offset}, which holds "
                          "other bytes")
    return data


class PackedEntries(list):  # type: ignore[type-arg]  # a list of Entry, plus its contents
    """Entries at consecutive positions of one queue whose contents arrived packed in the
    run format (``batch.pack_run``: a catch-up's ``er`` event, ``cluster/replication.py``).

    Handed to ``Queue.add_entries`` like any list; the store's ``ENQUEUED_MANY`` of them
    (``batch.runs_of``) is then one message run of ``contents`` as it is, logged and
    written to SQL without packing the messages again.
    """

    __slots__ = ("contents",)

    def __init__(self, entries: list[Any], contents: bytes) -> None:
        super().__init__(entries)
        self.contents = contents


class StoredRun:
    __slots__ = ("first", "last", "gone", "generation")

    def __init__(self, first: int, last: int, gone: set[int], generation: int = 0) -> None:
        self.first = first
        self.last = last
        self.gone = gone
        self.generation = generation  # the log file its contents are in (0: in SQL)

    @property
    def empty(self) -> bool:
        return len(self.gone) >= self.last - self.first + 1


class _QueueRuns:
    __slots__ = ("firsts", "runs")

    def __init__(self) -> None:
        self.firsts: list[int] = []  # sorted
        self.runs: dict[int, StoredRun] = {}


class RunIndex:
    """The runs SQL holds, by queue (the writer thread's; rebuilt from SQL with ``load``)."""

    def __init__(self, refs: bool = False) -> None:
        self.queues: dict[Key, _QueueRuns] = {}
        self.refs = refs  # runs may be log references (an SQLite store with a log)
        self.files: dict[int, int] = {}  # kept log file -> the stored runs in it
        self.released: list[int] = []  # kept files whose last run went (since taken)

    def __len__(self) -> int:
        return sum(len(q.runs) for q in self.queues.values())

    def load(self, conn: Any, statements: Statements) -> None:
        self.queues = {}
        self.files = {}
        self.released = []
        cur = conn.cursor()
        cur.execute(statements.select_runs)
        for vhost, queue, first, last in cur.fetchall():
            self.add(vhost, queue, int(first), int(last), set())
        if self.refs:
            cur.execute(SELECT_REFS)
            for vhost, queue, first, blob in cur.fetchall():
                ref = ref_of(bytes(blob))
                run = self.find(vhost, queue, int(first))
                if ref is not None and run is not None:
                    run.generation = ref[0]
                    self.files[ref[0]] = self.files.get(ref[0], 0) + 1
        cur.execute(statements.select_gone, (True,))
        for vhost, queue, position in cur.fetchall():
            run = self.find(vhost, queue, int(position))
            if run is not None:
                run.gone.add(int(position))
        if hasattr(conn, "rollback"):
            conn.rollback()  # end the read transaction (PostgreSQL)

    def find(self, vhost: str, queue: str, position: int) -> StoredRun | None:
        q = self.queues.get((vhost, queue))
        if q is None:
            return None
        i = bisect_right(q.firsts, position) - 1
        if i < 0:
            return None
        run = q.runs[q.firsts[i]]
        return run if position <= run.last else None

    def add(self, vhost: str, queue: str, first: int, last: int, gone: set[int],
            generation: int = 0) -> None:
        q = self.queues.get((vhost, queue))
        if q is None:
            q = self.queues[(vhost, queue)] = _QueueRuns()
        old = q.runs.get(first)
        if old is None:
            if not q.firsts or first > q.firsts[-1]:
                q.firsts.append(first)
            else:
                insort(q.firsts, first)
        else:
            self._left(old)  # written again (a replay): its row is replaced
        q.runs[first] = StoredRun(first, last, gone, generation)
        if generation:
            self.files[generation] = self.files.get(generation, 0) + 1

    def _left(self, run: StoredRun) -> None:
        """``run``'s row is gone (or replaced): one run fewer in its log file."""
        g = run.generation
        if g:
            left = self.files.get(g, 0) - 1
            if left > 0:
                self.files[g] = left
            else:
                self.files.pop(g, None)
                self.released.append(g)

    def kept(self, generation: int) -> bool:
        """Whether a stored run refers to log file ``generation`` (``OpLog.keep``)."""
        return generation in self.files

    def take_released(self) -> list[int]:
        """The kept log files whose last stored run went since the last call."""
        released, self.released = self.released, []
        return [g for g in released if g not in self.files]

    def remove(self, vhost: str, queue: str, first: int) -> None:
        q = self.queues.get((vhost, queue))
        if q is None:
            return
        run = q.runs.pop(first, None)
        if run is None:
            return
        self._left(run)
        q.firsts.remove(first)
        if not q.runs:
            del self.queues[(vhost, queue)]

    def drop_queue(self, vhost: str, queue: str) -> None:
        q = self.queues.pop((vhost, queue), None)
        if q is not None:
            for run in q.runs.values():
                self._left(run)

    def overlapping(self, vhost: str, queue: str, lo: int, hi: int) -> list[StoredRun]:
        q = self.queues.get((vhost, queue))
        if q is None:
            return []
        i = max(0, bisect_right(q.firsts, lo) - 1)
        out = []
        for first in q.firsts[i:]:
            if first > hi:
                break
            run = q.runs[first]
            if run.last >= lo:
                out.append(run)
        return out


def write_runs(cur: Any, st: Statements, batch: Batch, index: RunIndex) -> int:
    """Insert the batch's runs (and their marks); the rows written."""
    runs = batch.run_rows()
    if not runs:
        return 0
    # ``where`` read with getattr: a compiled batch.py older than this module has none
    located = [getattr(r, "where", None) if index.refs else None for _, _, r in runs]
    cur.executemany(st.put_run, [
        (v, q, r.first, r.last, r.contents if where is None else log_ref(*where))
        for (v, q, r), where in zip(runs, located, strict=True)])
    ranges = [(v, q, r.first, r.last) for v, q, r in runs]
    # a replay may write a run again: what was marked of it before is marked again after
    cur.executemany(st.delete_mark_range, ranges)
    cur.executemany(st.delete_message_range, ranges)
    marks: list[tuple[Any, ...]] = []
    for (v, q, r), where in zip(runs, located, strict=True):
        marks.extend((v, q, p, True) for p in r.gone)
        marks.extend((v, q, p, False) for p in r.delivered - r.gone)
        index.add(v, q, r.first, r.last, set(r.gone), where[0] if where is not None else 0)
    if marks:
        cur.executemany(st.put_run_gone, marks)
    return len(runs) + len(marks)


def drop_runs(cur: Any, st: Statements, index: RunIndex,
              runs: list[tuple[str, str, int, int]]) -> None:
    """Delete whole runs (every position gone) with their marks."""
    if runs:
        cur.executemany(st.delete_run, [(v, q, first) for v, q, first, _ in runs])
        cur.executemany(st.delete_mark_range, runs)
        for v, q, first, _ in runs:
            index.remove(v, q, first)


def purge_runs(cur: Any, st: Statements, index: RunIndex,
               purges: list[tuple[str, str, int, int]]) -> None:
    """A purge's ranges over the stored runs: runs inside go, runs across are marked."""
    cur.executemany(st.delete_run_range, purges)
    cur.executemany(st.delete_mark_range, purges)
    marks: list[tuple[Any, ...]] = []
    emptied: list[tuple[str, str, int, int]] = []
    for vhost, queue, lo, hi in purges:
        for run in index.overlapping(vhost, queue, lo, hi):
            if lo <= run.first and run.last <= hi:
                index.remove(vhost, queue, run.first)  # deleted by the range delete above
                continue
            for p in range(max(lo, run.first), min(hi, run.last) + 1):
                if p not in run.gone:
                    run.gone.add(p)
                    marks.append((vhost, queue, p, True))
            if run.empty:
                emptied.append((vhost, queue, run.first, run.last))
    if marks:
        cur.executemany(st.put_run_gone, marks)
    drop_runs(cur, st, index, emptied)


def split_deletes(deletes: list[tuple[Any, ...]], index: RunIndex) -> tuple[
        list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[str, str, int, int]]]:
    """(message rows to delete, gone marks, runs emptied) of the batch's deletes."""
    if not index.queues:
        return deletes, [], []
    plain: list[tuple[Any, ...]] = []
    marks: list[tuple[Any, ...]] = []
    emptied: list[tuple[str, str, int, int]] = []
    for key in deletes:
        vhost, queue, position = key
        run = index.find(vhost, queue, position)
        if run is None:
            plain.append(key)
        elif position not in run.gone:
            run.gone.add(position)
            marks.append((vhost, queue, position, True))
            if run.empty:
                emptied.append((vhost, queue, run.first, run.last))
    return plain, marks, emptied


def split_delivered(delivered: list[tuple[Any, ...]], index: RunIndex) -> tuple[
        list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(delivered flags of message rows, delivered marks of run positions)."""
    if not index.queues:
        return delivered, []
    plain: list[tuple[Any, ...]] = []
    marks: list[tuple[Any, ...]] = []
    for row in delivered:
        _, vhost, queue, position = row
        if index.find(vhost, queue, position) is None:
            plain.append(row)
        else:
            marks.append((vhost, queue, position, False))
    return plain, marks
