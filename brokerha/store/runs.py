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
"""

from __future__ import annotations

from bisect import bisect_right, insort
from typing import Any

from brokerha.store.batch import Batch
from brokerha.store.schema import Statements

Key = tuple[str, str]


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
    __slots__ = ("first", "last", "gone")

    def __init__(self, first: int, last: int, gone: set[int]) -> None:
        self.first = first
        self.last = last
        self.gone = gone

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

    def __init__(self) -> None:
        self.queues: dict[Key, _QueueRuns] = {}

    def __len__(self) -> int:
        return sum(len(q.runs) for q in self.queues.values())

    def load(self, conn: Any, statements: Statements) -> None:
        self.queues = {}
        cur = conn.cursor()
        cur.execute(statements.select_runs)
        for vhost, queue, first, last in cur.fetchall():
            self.add(vhost, queue, int(first), int(last), set())
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

    def add(self, vhost: str, queue: str, first: int, last: int, gone: set[int]) -> None:
        q = self.queues.get((vhost, queue))
        if q is None:
            q = self.queues[(vhost, queue)] = _QueueRuns()
        if first not in q.runs:
            if not q.firsts or first > q.firsts[-1]:
                q.firsts.append(first)
            else:
                insort(q.firsts, first)
        q.runs[first] = StoredRun(first, last, gone)

    def remove(self, vhost: str, queue: str, first: int) -> None:
        q = self.queues.get((vhost, queue))
        if q is None or q.runs.pop(first, None) is None:
            return
        q.firsts.remove(first)
        if not q.runs:
            del self.queues[(vhost, queue)]

    def drop_queue(self, vhost: str, queue: str) -> None:
        self.queues.pop((vhost, queue), None)

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
    cur.executemany(st.put_run, [(v, q, r.first, r.last, r.contents) for v, q, r in runs])
    ranges = [(v, q, r.first, r.last) for v, q, r in runs]
    # a replay may write a run again: what was marked of it before is marked again after
    cur.executemany(st.delete_mark_range, ranges)
    cur.executemany(st.delete_message_range, ranges)
    marks: list[tuple[Any, ...]] = []
    for v, q, r in runs:
        marks.extend((v, q, p, True) for p in r.gone)
        marks.extend((v, q, p, False) for p in r.delivered - r.gone)
        index.add(v, q, r.first, r.last, set(r.gone))
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
