"""The store's writer thread: group commit with the raw driver, and SQLite checkpoints.

Each commit takes everything that piled up while the previous one was running
(no timer, no fixed batch size): under light load a commit holds one unit and
confirms go out after one fsync; under heavy load one fsync covers thousands
of messages. The callbacks of a batch are reported only after its commit
returned; after a failed commit nothing is reported again and the failure goes
to the store (fail-stop), because a node that cannot persist must not confirm.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from brokerha.store.batch import Batch, Callback, Op, Unit, fold
from brokerha.store.runs import (
    RunIndex,
    drop_runs,
    purge_runs,
    split_deletes,
    split_delivered,
    write_runs,
)
from brokerha.store.schema import Statements
from brokerha.thread_priority import lower_this_thread

log = logging.getLogger("brokerha.store")

IDLE_SECONDS = 0.5  # no work for this long: checkpoint the SQLite WAL
WARN_INTERVAL = 10.0  # at most one "falling behind" warning per interval
SLOW_COMMIT_SECONDS = 1.0


class Checkpointer(Protocol):
    """What the writer does about a write-ahead log between commits."""

    def after_commit(self, conn: Any) -> None: ...
    def idle(self, conn: Any) -> None: ...


class NoCheckpoints:
    """PostgreSQL checkpoints on its own."""

    def after_commit(self, conn: Any) -> None:
        pass

    def idle(self, conn: Any) -> None:
        pass


class SQLiteCheckpoints:
    """Checkpoint the WAL ourselves (``wal_autocheckpoint=0``), never inside a commit.

    An automatic checkpoint runs inside whichever commit crosses the threshold
    and caused 10-20 ms p99 spikes; here a PASSIVE checkpoint runs between
    commits once the WAL passes ``wal_limit`` bytes, and a TRUNCATE one when
    the writer has been idle, so the WAL file shrinks back when load stops.
    """

    def __init__(self, wal_path: str, wal_limit: int) -> None:
        self.wal_path = wal_path
        self.wal_limit = wal_limit
        self.dirty = False
        self.count = 0

    def after_commit(self, conn: Any) -> None:
        self.dirty = True
        try:
            size = os.path.getsize(self.wal_path)
        except OSError:
            return
        if size > self.wal_limit:
            self._run(conn, "PASSIVE")

    def idle(self, conn: Any) -> None:
        if self.dirty:
            self._run(conn, "TRUNCATE")
            self.dirty = False

    def _run(self, conn: Any, mode: str) -> None:
        try:
            conn.cursor().execute(f"PRAGMA wal_checkpoint({mode})").fetchall()
            self.count += 1
        except Exception as exc:  # a busy checkpoint is retried later; commits stay correct
            log.warning("WAL checkpoint (%s) failed: %s", mode, exc)


class ApplyPolicy:
    """When the operation log's thread hands its pending batch to the writer for SQL.

    Confirms do not wait for these commits (the log made the units durable),
    so the batch may grow: a message consumed while it is pending is never
    written. It is handed over when a log file is complete (so the file can
    go), when someone waits to read a row back, when it is ``max_age`` old or
    holds ``max_ops`` operations, after ``idle`` seconds without new work, and
    at shutdown.
    """

    def __init__(self, max_age: float = 1.0, max_ops: int = 50_000, idle: float = IDLE_SECONDS,
                 on_applied: Callable[[int], None] | None = None) -> None:
        self.max_age = max_age
        self.max_ops = max_ops
        self.idle = idle
        self.on_applied = on_applied  # called (writer thread) with each completed generation
        # called (writer thread, after a commit) with the kept log files whose last stored
        # message run went in it (store/runs.py)
        self.on_released: Callable[[list[int]], None] | None = None


DISK_FULL_RETRY_SECONDS = 1.0  # how soon a write that found the disk full is tried again


def is_disk_full(exc: BaseException) -> bool:
    """A failure for lack of space, which frees up, not a broken store.

    ENOSPC/EDQUOT from the file system, SQLite's SQLITE_FULL ("database or disk
    is full"), PostgreSQL's disk_full (SQLSTATE 53100).
    """
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, sqlite3.Error):
        return (getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
                or "database or disk is full" in str(exc))
    return getattr(exc, "sqlstate", None) == "53100"  # psycopg's DiskFull


class DiskFull:
    """Retry-after-space for a writing thread: report once, wait, try the same write again.

    The write is retried unchanged, in order, so nothing is lost or reordered:
    what waits behind it waits too (confirms and commit-oks included). ``report``
    is called with the error when the disk first refuses, and with None once a
    retry succeeds. ``stopping()`` ends the wait: the node is shutting down, the
    write gives up and the error is fatal as before.
    """

    def __init__(self, report: Callable[[BaseException | None], None] | None,
                 stopping: Callable[[], bool], retry_seconds: float = DISK_FULL_RETRY_SECONDS,
                 what: str = "store write") -> None:
        self.report = report
        self.stopping = stopping
        self.retry_seconds = retry_seconds
        self.what = what
        self.full = False
        self.retries = 0

    def wait(self, exc: BaseException) -> bool:
        """After a failed write: True when it should be tried again (after a pause)."""
        if not is_disk_full(exc) or self.stopping():
            return False
        if not self.full:
            self.full = True
            log.error("%s failed for lack of disk space (%s); retrying every %.1f s, "
                      "publishers are blocked meanwhile", self.what, exc, self.retry_seconds)
            if self.report is not None:
                self.report(exc)
        self.retries += 1
        deadline = time.monotonic() + self.retry_seconds
        while time.monotonic() < deadline and not self.stopping():
            time.sleep(min(0.05, self.retry_seconds))
        return not self.stopping()

    def succeeded(self) -> None:
        if self.full:
            self.full = False
            log.warning("%s succeeded again after %d retries: disk space is back",
                        self.what, self.retries)
            if self.report is not None:
                self.report(None)


class Writer(threading.Thread):
    """Owns the writing connection; the only thread that writes to the database.

    Without an ``ApplyPolicy`` (no operation log) it takes units from the
    event loop: everything that piled up is one commit, and the callbacks are
    the units' ``after_sync`` callbacks. With one, the operation log's thread
    hands it batches already folded (``submit_batch``): each is one commit,
    and the callbacks are ``after_readable`` ones.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        statements: Statements,
        checkpoints: Checkpointer,
        report: Callable[[int, list[Callback]], None],
        fail: Callable[[BaseException], None],
        backlog_warning: int = 200_000,
        policy: ApplyPolicy | None = None,
        on_disk_full: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        super().__init__(name="brokerha-store-writer", daemon=True)
        self._connect = connect
        self.statements = statements
        self.checkpoints = checkpoints
        self._report = report
        self._fail = fail
        self.backlog_warning = backlog_warning
        self.policy = policy
        self._cond = threading.Condition()
        self._units: list[Unit] = []
        self._batches: list[Batch] = []
        self._queued_ops = 0
        self._stopping = False
        self.disk = DiskFull(on_disk_full, lambda: self._stopping)
        self._last_warning = 0.0
        # the message runs SQL holds (loaded when the thread starts); with an operation log
        # some are references to its files (runs.py), which stay while a run refers to them
        self.runs = RunIndex(refs=policy is not None)
        self.stats: dict[str, Any] = {"commits": 0, "rows": 0, "cancelled": 0, "units": 0,
                                      "max_backlog_ops": 0, "max_commit_seconds": 0.0}

    # -- any thread ----------------------------------------------------------------------

    def submit(self, ops: list[Op], callbacks: list[Callback]) -> None:
        with self._cond:
            self._units.append(Unit(ops, callbacks))
            self._queued_ops += len(ops)
            self._cond.notify()

    def submit_batch(self, batch: Batch) -> None:
        """(with an ApplyPolicy) One folded batch to commit after those before it."""
        with self._cond:
            self._batches.append(batch)
            self._cond.notify()

    @property
    def backlog_ops(self) -> int:
        """Ops recorded but not yet taken into a commit (observable lag)."""
        return self._queued_ops

    def stop(self) -> None:
        """Finish what was submitted, checkpoint, close the connection and end."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # -- writer thread -------------------------------------------------------------------

    def run(self) -> None:
        lower_this_thread()  # [node] background_nice: the event loop's thread first
        try:
            conn = self._connect()
            self.runs.load(conn, self.statements)
        except Exception as exc:
            self._fail(exc)
            return
        try:
            if self.policy is None:
                self._serve(conn)
            else:
                self._serve_batches(conn, self.policy)
        finally:
            conn.close()

    def _serve(self, conn: Any) -> None:
        while True:
            units = self._take()
            if units is None:
                self.checkpoints.idle(conn)
                return
            if not units:
                self.checkpoints.idle(conn)
                continue
            batch = fold(units)
            if not self._commit_reported(conn, batch, len(units)):
                return

    def _serve_batches(self, conn: Any, policy: ApplyPolicy) -> None:
        while True:
            with self._cond:
                if not self._batches and not self._stopping:
                    self._cond.wait(IDLE_SECONDS)
                batches, self._batches = self._batches, []
                stopping = self._stopping
            for batch in batches:
                if not self._commit_reported(conn, batch, 0):
                    return
                if batch.closes is not None and policy.on_applied is not None:
                    policy.on_applied(batch.closes)
            if not batches:
                self.checkpoints.idle(conn)
                if stopping:
                    return

    def _commit_reported(self, conn: Any, batch: Batch, units: int) -> bool:
        """Commit, then report the batch's callbacks; False after a failure (reported)."""
        while True:
            try:
                self._commit(conn, batch)
                break
            except Exception as exc:
                self._rollback(conn)
                if not self.disk.wait(exc) or not self._reload_runs(conn):
                    self._fail(exc)
                    return False
        self.disk.succeeded()
        released = self.runs.take_released()
        if released and self.policy is not None and self.policy.on_released is not None:
            self.policy.on_released(released)  # kept log files no stored run refers to now
        self.stats["cancelled"] += batch.cancelled
        self._report(units, batch.callbacks)
        self.checkpoints.after_commit(conn)
        return True

    def _take(self) -> list[Unit] | None:
        """Everything submitted so far; [] after an idle wait; None once stopped and drained."""
        with self._cond:
            if not self._units and not self._stopping:
                self._cond.wait(IDLE_SECONDS)
            if not self._units:
                return None if self._stopping else []
            units, self._units = self._units, []
            backlog, self._queued_ops = self._queued_ops, 0
        self.stats["units"] += len(units)
        self._note_backlog(backlog)
        return units

    def _note_backlog(self, backlog: int) -> None:
        stats = self.stats
        stats["max_backlog_ops"] = max(stats["max_backlog_ops"], backlog)
        if backlog >= self.backlog_warning:
            self._warn("store writer is falling behind: %d operations waited for one commit",
                       backlog)

    def _warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_warning >= WARN_INTERVAL:
            self._last_warning = now
            log.warning(message, *args)

    def _commit(self, conn: Any, batch: Batch) -> None:
        if batch.empty:
            return
        started = time.monotonic()
        rows = commit_batch(conn, self.statements, batch, self.runs)
        self._count(batch, rows, started)

    def _count(self, batch: Batch, rows: int, started: float) -> None:
        elapsed = time.monotonic() - started
        stats = self.stats
        stats["commits"] += 1
        stats["rows"] += rows
        stats["max_commit_seconds"] = max(stats["max_commit_seconds"], elapsed)
        if elapsed >= SLOW_COMMIT_SECONDS:
            self._warn("store commit of %d rows took %.2f s", rows, elapsed)

    def _reload_runs(self, conn: Any) -> bool:
        """After a rollback: the run index as SQL holds it again (False: failed, reported)."""
        try:
            self.runs.load(conn, self.statements)
        except Exception as exc:
            self._fail(exc)
            return False
        return True

    @staticmethod
    def _rollback(conn: Any) -> None:
        try:
            conn.rollback()
        except Exception:  # the connection may be gone; the failure is reported anyway
            log.debug("rollback after a failed commit failed", exc_info=True)


def commit_batch(conn: Any, statements: Statements, batch: Batch,
                 runs: RunIndex | None = None) -> int:
    """Write one folded batch in one database transaction; the number of rows touched.

    ``runs``: the message runs SQL holds (``runs.py``), kept up to date here
    (None: read from ``conn`` first). After a failed commit the caller rolls
    back and must load it again.
    """
    st = statements
    if runs is None:
        runs = RunIndex()
        runs.load(conn, st)
    inserts, delivered, deletes = batch.rows()
    cur = conn.cursor()
    rows = batch.statement_rows()
    for name, params in rows:
        cur.execute(getattr(st, name), params)
        if name == "purge_queue":  # a deleted queue: its runs and their marks go too
            cur.execute(st.purge_queue_runs, params)
            cur.execute(st.purge_queue_marks, params)
            runs.drop_queue(*params)
    if batch.purges:
        cur.executemany(st.delete_message_range, batch.purges)
        purge_runs(cur, st, runs, batch.purges)
    drop_runs(cur, st, runs, batch.dropped_runs)
    if inserts:
        cur.executemany(st.put_message, inserts)
    written = write_runs(cur, st, batch, runs)
    delivered, delivered_marks = split_delivered(delivered, runs)
    if delivered:
        cur.executemany(st.set_delivered, delivered)
    if delivered_marks:
        cur.executemany(st.put_run_delivered, delivered_marks)
    deletes, gone, emptied = split_deletes(deletes, runs)
    if deletes:
        cur.executemany(st.delete_message, deletes)
    if gone:
        cur.executemany(st.put_run_gone, gone)
    drop_runs(cur, st, runs, emptied)
    conn.commit()
    return (len(rows) + len(batch.purges) + len(inserts) + written + len(delivered)
            + len(delivered_marks) + len(deletes) + len(gone) + len(emptied))
