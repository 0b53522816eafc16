"""The durable store on SQL: SQLite (the embedded default) or PostgreSQL.

Threads and ordering
--------------------
The broker calls the observer methods on the event-loop thread; they only
append a small tuple to a list (no I/O, no locks). At the end of the current
loop iteration (``call_soon``) that list and the ``after_sync`` callbacks
recorded after it are handed to the writer thread as one *unit*. A unit is
handed over between two loop callbacks, never in the middle of one, so
everything a tx.commit applies (one callback) lands in the same database
transaction: after a crash a transaction is there whole or not at all.

The writer (``brokerha.store.writer``) group-commits every unit that piled up
while its previous commit ran, with the raw DBAPI driver, and only then posts
the units' callbacks back to the loop with ``call_soon_threadsafe``. When
nothing is pending or in flight, ``after_sync`` calls back at once.

A failed commit is fatal: its callbacks and all later ones never run, and
``on_failure(exc)`` is called on the loop thread so the node can stop.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Table, create_engine, event, insert, select, update
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

from brokerha.broker.definitions import DefinitionChange
from brokerha.broker.definitions import encode as definitions_encode
from brokerha.broker.exchange import Binding, Exchange
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.broker.storage import (
    BindingRecord,
    ExchangeRecord,
    PreparedBranch,
    QueueRecord,
    Recovered,
    Store,
    StoredMessage,
    binding_record,
    is_durable_binding,
    keeps,
    stored_definitions,
)
from brokerha.store import schema
from brokerha.store.batch import (
    ACQUIRED,
    APPLIED_KEY,
    DEQUEUED,
    ENQUEUED,
    ENQUEUED_MANY,
    PURGED,
    PUT_META,
    QUEUE_DELETED,
    STATEMENT,
    Batch,
    Callback,
    Op,
    Unit,
    unpack_run,
)
from brokerha.store.oplog import LogAppender, OpLog, OpLogError
from brokerha.store.runs import SELECT_REFS, RunRefError, ref_of, resolve
from brokerha.store.writer import (
    ApplyPolicy,
    Checkpointer,
    NoCheckpoints,
    SQLiteCheckpoints,
    Writer,
    commit_batch,
)

log = logging.getLogger("brokerha.store")

SYNCHRONOUS_MODES = ("full", "normal")
DEFAULT_WAL_LIMIT = 64 * 1024 * 1024
# SQLite's page size for a database the store creates (an existing one keeps its own:
# in WAL mode it cannot change). SQLite writes the WAL a page (frame) at a time and the
# checkpoint reads each frame back and writes it to the database, so a message run of
# 256 KiB was 64 frames of 4 KiB, each its own writes: the catching-up backup's writer
# thread spent half its time in them (issue 33). Measured with the writer's statements
# (800 MB of 256 KiB runs, WAL, synchronous=FULL, checkpoints at 64 MiB): 3.2-3.4 us
# of CPU per KiB at 4 KiB pages, 1.8 at 16 KiB, 1.4 at 32 KiB, 1.2 at 64 KiB; 1 KiB
# rows inserted and deleted in batches of 5,000: 9.3 us per KiB at 4 KiB, 5.4 at 16
# and 64 KiB. What a larger page costs: a commit that changes one row of a page writes
# the whole page to the WAL (with the operation log a commit comes at most about once
# a second, so that is a page per queue touched per second).
PAGE_SIZE = 32 * 1024
_PLACEHOLDERS = {"pysqlite": "?", "psycopg": "%s", "psycopg2": "%s"}


class StoreError(RuntimeError):
    """The store cannot be opened or used (bad URL, unknown schema version, ...)."""


def _sqlite_pragmas(dbapi_conn: Any, _record: Any, *, synchronous: str, wal_limit: int) -> None:
    """WAL, the chosen fsync policy, and no automatic checkpoints (the writer runs them);
    ``PAGE_SIZE`` pages in a database created now.

    ``journal_size_limit`` truncates the WAL file when it restarts after a
    checkpoint; without it the file keeps its largest size, and the writer,
    which checkpoints by WAL file size, would checkpoint after every commit.
    """
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new database only (see PAGE_SIZE)
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA synchronous={synchronous.upper()}")
    cur.execute("PRAGMA wal_autocheckpoint=0")
    cur.execute(f"PRAGMA journal_size_limit={int(wal_limit)}")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()


def create_store_engine(url: str | URL, synchronous: str = "full",
                        wal_limit: int = DEFAULT_WAL_LIMIT) -> Engine:
    """An engine for the store: no pool (the writer keeps its own connection)."""
    parsed = make_url(url)
    if synchronous not in SYNCHRONOUS_MODES:
        raise StoreError(f"synchronous must be one of {SYNCHRONOUS_MODES}, got {synchronous!r}")
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise StoreError("an SQLite store needs a file: sqlite:///path/to/brokerha.db")
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, poolclass=NullPool)
    if engine.dialect.driver not in _PLACEHOLDERS:
        raise StoreError(f"unsupported database driver {engine.dialect.driver!r}: "
                         "use sqlite:///FILE or postgresql+psycopg://...")
    if parsed.get_backend_name() == "sqlite":
        event.listen(engine, "connect",
                     partial(_sqlite_pragmas, synchronous=synchronous, wal_limit=wal_limit))
    return engine


class SQLStore(Store):
    """Durable exchanges, queues, bindings and persistent messages in SQL, group-committed."""

    def __init__(self, url: str | URL, *, synchronous: str = "full",
                 wal_limit: int = DEFAULT_WAL_LIMIT, backlog_warning: int = 200_000,
                 on_failure: Callable[[BaseException], None] | None = None,
                 oplog: bool = False, apply_policy: ApplyPolicy | None = None) -> None:
        self.engine = create_store_engine(url, synchronous, wal_limit)
        self.synchronous = synchronous
        self.on_failure = on_failure
        self.failed: BaseException | None = None
        self.disk_full: dict[str, str] = {}  # part ("database", "operation log") -> why
        _prepare_schema(self.engine)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False
        self._ops: list[Op] = []
        self._callbacks: list[Callback] = []
        self._readable: list[Callback] = []  # after_readable, with an operation log
        self._batch_hooks: list[Callable[[], None]] = []  # before_batch
        self._handoff_scheduled = False
        self._inflight = 0  # units handed over and not yet reported durable (loop thread)
        self._handed = 0  # units handed to the operation log's thread (loop thread)
        self._reader: Any = None  # connection for read_bodies (loop thread), opened on demand
        self._run_cache: tuple[tuple[str, str], int, list[Any]] | None = None  # read_bodies'
        self._meta: dict[str, str] = {}  # put_meta since start: get_meta sees them at once
        statements = schema.Statements(_PLACEHOLDERS[self.engine.dialect.driver])
        self.oplog: OpLog | None = None
        self._appender: LogAppender | None = None
        policy: ApplyPolicy | None = None
        try:
            if oplog:
                self.oplog = OpLog(self._database_file(), sync=synchronous == "full")
                next_generation = self._replay_oplog(statements, self.oplog)
                policy = apply_policy or ApplyPolicy()
                policy.on_applied = self.oplog.remove_through  # writer thread, after the commit
                policy.on_released = self.oplog.drop_kept
            else:
                self._replay_leftover_log(statements)
        except BaseException as exc:
            if self.oplog is not None:
                self.oplog.release()
            self.engine.dispose()
            if isinstance(exc, OpLogError):
                raise StoreError(str(exc)) from exc
            raise
        self._writer = Writer(
            self.engine.raw_connection, statements, self._checkpoints(wal_limit),
            self._report if self.oplog is None else self._report_readable,
            self._writer_failed, backlog_warning=backlog_warning, policy=policy,
            on_disk_full=partial(self._disk_full, "database"))
        if self.oplog is not None:
            # from here the writer's index says which log files stored runs refer to (its
            # thread loads it before it commits, and remove_through runs after a commit)
            self.oplog.keep = self._writer.runs.kept
            self.oplog.open(next_generation)
            assert policy is not None
            self._appender = LogAppender(self.oplog, self._writer, policy, self._logged,
                                         self._writer_failed,
                                         on_disk_full=partial(self._disk_full, "operation log"))

    def _database_file(self) -> Path:
        url = self.engine.url
        if url.get_backend_name() != "sqlite":
            raise StoreError("the operation log is for SQLite stores (a PostgreSQL store "
                             "commits every batch to the database)")
        return Path(str(url.database)).absolute()

    def _replay_leftover_log(self, statements: schema.Statements) -> None:
        """Without the operation log: still apply files a run with it left behind."""
        if self.engine.url.get_backend_name() != "sqlite":
            return
        leftover = OpLog.probe(self._database_file())
        if leftover is None:
            return
        try:
            self._replay_oplog(statements, leftover)
        finally:
            leftover.release()

    def _replay_oplog(self, statements: schema.Statements, oplog: OpLog) -> int:
        """Apply what the log holds beyond SQL's state (start-up); the next generation to write.

        The replay does not cancel an enqueue against its dequeue: the first part
        of a file may be in SQL already (applied before the file was complete).
        """
        applied = int(self._read_meta(APPLIED_KEY) or 0)
        generations = oplog.generations()
        pending = [g for g in generations if g > applied]
        if pending:
            batch = Batch(cancel=False)
            records = 0
            for g in pending:
                # without fdatasync (synchronous=normal) any file may end torn after power loss
                lenient = g == generations[-1] or not oplog.sync_enabled
                for ops in oplog.read(g, newest=lenient):
                    batch.add(Unit(ops, []))
                    records += 1
            batch.add(Unit([], [], closes=pending[-1]))
            conn = self.engine.raw_connection()
            try:
                rows = commit_batch(conn, statements, batch)
            finally:
                conn.close()
            log.info("store %r: replayed %d operation log records from %d file(s) (%d rows)",
                     self, records, len(pending), rows)
        newest = max([applied, *generations])
        kept = self._kept_files()
        oplog.keep = kept.__contains__
        oplog.remove_through(newest)
        return newest + 1

    def _kept_files(self) -> set[int]:
        """The log files stored message runs refer to (runs.py), read from SQL."""
        conn = self.engine.raw_connection()
        try:
            cur = conn.cursor()
            cur.execute(SELECT_REFS)
            found = {ref[0] for *_, blob in cur.fetchall()
                     if (ref := ref_of(bytes(blob))) is not None}
            conn.rollback()
            return found
        finally:
            conn.close()

    def _checkpoints(self, wal_limit: int) -> Checkpointer:
        url = self.engine.url
        if url.get_backend_name() == "sqlite":
            return SQLiteCheckpoints(f"{url.database}-wal", wal_limit)
        return NoCheckpoints()

    def __repr__(self) -> str:
        return f"SQLStore({self.engine.url.render_as_string(hide_password=True)!r})"

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Start the writer; with ``loop`` None, callbacks run on the writer thread."""
        if self._started:
            return
        self._loop = loop
        self._started = True
        self._writer.start()
        if self._appender is not None:
            self._appender.start()
        self._handoff()

    def close(self) -> None:
        """Commit what is recorded, checkpoint, and wait for the writer to finish."""
        if self._closed:
            return
        if not self._started:
            self.start(None)
        self._closed = True
        self._handoff()
        if self._appender is not None:
            self._appender.stop()  # it hands the last log file to the writer, then ends
            self._appender.join(30)
        self._writer.stop()
        self._writer.join(30)
        if self._writer.is_alive():
            log.error("store writer did not finish within 30 s; pending writes are lost")
        if self.oplog is not None:
            self.oplog.release()
        if self._reader is not None:
            try:
                self._reader.close()
            except Exception:  # a connection of another thread or already gone
                log.debug("closing the reading connection failed", exc_info=True)
            self._reader = None
        self.engine.dispose()

    # -- reading paged bodies back (brokerha.broker.paging) ----------------------------------

    can_page = True

    def read_bodies(self, vhost: str, queue: str,
                    positions: list[int]) -> dict[int, tuple[bytes, bytes]]:
        """(header, body) by position, in one query on a reading connection of its own.

        Runs on the loop thread; it never shares the writer's connection (SQLite
        WAL and PostgreSQL both let a reader see the last commit while the
        writer writes). The broker asks only for messages whose insert has
        been committed, so every position asked for is there.
        """
        if not positions:
            return {}
        if self._reader is None:
            self._reader = self.engine.raw_connection()
        p = _PLACEHOLDERS[self.engine.dialect.driver]
        sql = ('SELECT "position", "header", "body" FROM "messages" WHERE "vhost" = '
               f'{p} AND "queue" = {p} AND "position" IN ({", ".join([p] * len(positions))})')
        conn = self._reader
        try:
            cur = conn.cursor()
            cur.execute(sql, (vhost, queue, *positions))
            found = {int(r[0]): (bytes(r[1]), bytes(r[2])) for r in cur.fetchall()}
            if len(found) < len(positions):
                self._read_runs(cur, p, vhost, queue,
                                [x for x in positions if x not in found], found)
        finally:
            conn.rollback()  # end the read transaction (PostgreSQL): the next read sees new commits
        return found

    def _read_runs(self, cur: Any, p: str, vhost: str, queue: str, positions: list[int],
                   found: dict[int, tuple[bytes, bytes]]) -> None:
        """The ``positions`` that message runs hold (each run unpacked once; the last one
        kept, since the pager reads a run a few hundred positions at a time)."""
        wanted = set(positions)
        cached = self._run_cache
        if cached is not None and cached[0] == (vhost, queue):
            first, contents = cached[1], cached[2]
            for x in [x for x in wanted if first <= x < first + len(contents)]:
                found[x] = (contents[x - first].header, contents[x - first].body)
                wanted.discard(x)
        if not wanted:
            return
        cur.execute('SELECT "first_position", "contents" FROM "message_runs" WHERE "vhost" = '
                    f'{p} AND "queue" = {p} AND "first_position" <= {p} AND "last_position" >= '
                    f'{p} ORDER BY "first_position"', (vhost, queue, max(wanted), min(wanted)))
        for first, blob in cur.fetchall():
            first = int(first)
            contents = unpack_run(self._run_contents(blob))
            hit = [x for x in wanted if first <= x < first + len(contents)]
            for x in hit:
                found[x] = (contents[x - first].header, contents[x - first].body)
            if hit:
                self._run_cache = ((vhost, queue), first, contents)

    def _run_contents(self, blob: Any) -> bytes:
        """A stored run's packed contents: its column, or the log file it refers to."""
        data = bytes(blob)
        if ref_of(data) is None:
            return data
        try:
            return resolve(data, self._database_file())
        except RunRefError as exc:
            raise StoreError(str(exc)) from exc

    def stats(self) -> dict[str, Any]:
        """Counters for logs and benchmarks, including the writer's current backlog."""
        stats = dict(self._writer.stats, backlog_ops=self._writer.backlog_ops,
                     checkpoints=getattr(self._writer.checkpoints, "count", 0))
        if self._appender is not None:
            stats.update(self._appender.stats, backlog_units=self._appender.backlog_units,
                         kept_log_files=self.oplog.kept if self.oplog is not None else 0)
        return stats

    # -- the durability barrier ----------------------------------------------------------

    def after_sync(self, callback: Callback) -> None:
        if self.failed is not None:
            return  # fail-stop: never confirm after a failed commit
        if (self._loop is not None and not self._ops and not self._callbacks
                and (self._inflight == 0 if self._appender is None
                     else self._appender.synced == self._handed)):
            callback()  # nothing written is waiting for a commit or a sync
            return
        self._callbacks.append(callback)
        self._schedule_handoff()

    def after_readable(self, callback: Callback) -> None:
        """Run ``callback`` once everything written so far can be read back from SQL.

        Without an operation log that is ``after_sync``; with one it waits
        for the writer to apply the log (which it does soon when someone waits).
        """
        if self._appender is None:
            self.after_sync(callback)
            return
        if self.failed is not None:
            return
        self._readable.append(callback)
        self._schedule_handoff()

    def flush(self) -> None:
        """Hand what is recorded to the writer now (tools and tests without a loop)."""
        self._handoff()

    def _record(self, op: Op) -> None:
        self._ops.append(op)
        self._schedule_handoff()

    def _schedule_handoff(self) -> None:
        if self._loop is None:
            if self._started:
                self._handoff()
            return
        if not self._handoff_scheduled:
            self._handoff_scheduled = True
            self._loop.call_soon(self._handoff)

    def before_batch(self, hook: Callable[[], None]) -> None:
        self._batch_hooks.append(hook)

    def _handoff(self) -> None:
        for hook in self._batch_hooks:  # still marked scheduled: what they record joins this batch
            hook()
        self._handoff_scheduled = False
        if self.failed is not None:  # nothing will be written again: do not pile up
            self._ops.clear()
            self._callbacks.clear()
            self._readable.clear()
            return
        if not (self._ops or self._callbacks or self._readable) or not self._started:
            return
        ops, callbacks, readable = self._ops, self._callbacks, self._readable
        self._ops, self._callbacks, self._readable = [], [], []
        if self._appender is not None:
            self._handed += 1
            self._appender.submit(ops, callbacks, readable)
        else:
            self._inflight += 1
            self._writer.submit(ops, callbacks)

    # -- reports from the writer thread --------------------------------------------------

    def _report(self, units: int, callbacks: list[Callback]) -> None:
        self._on_loop(self._durable, units, callbacks)

    def _logged(self, callbacks: list[Callback]) -> None:
        self._on_loop(self._run_callbacks, callbacks)

    def _report_readable(self, _units: int, callbacks: list[Callback]) -> None:
        self._on_loop(self._run_callbacks, callbacks)

    def _durable(self, units: int, callbacks: list[Callback]) -> None:
        self._inflight -= units
        self._run_callbacks(callbacks)

    @staticmethod
    def _run_callbacks(callbacks: list[Callback]) -> None:
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("after_sync callback failed")

    def local_directories(self) -> list[Path]:
        url = self.engine.url
        if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
            return []
        return [Path(str(url.database)).absolute().parent]

    def _disk_full(self, part: str, exc: BaseException | None) -> None:
        """(writer or log thread) A write found the disk full (exc), or worked again (None)."""
        self._on_loop(self._disk_changed, part, exc)

    def _disk_changed(self, part: str, exc: BaseException | None) -> None:
        if exc is None:
            self.disk_full.pop(part, None)
        else:
            self.disk_full[part] = f"{part} write failed for lack of disk space: {exc}"
        reason = "; ".join(self.disk_full.values()) or None
        if self.on_disk_full is not None:
            self._on_loop(self.on_disk_full, reason)

    def _writer_failed(self, exc: BaseException) -> None:
        self.failed = exc
        self._on_loop(self._failed, exc)

    def _failed(self, exc: BaseException) -> None:
        log.error("store %r: commit failed, no further confirms will be sent: %s", self, exc)
        if self.on_failure is not None:
            self.on_failure(exc)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to confirm to
            log.debug("store report after the event loop closed", exc_info=True)

    # -- configuration events --------------------------------------------------------------

    def exchange_declared(self, exchange: Exchange) -> None:
        if exchange.durable:
            self._record((STATEMENT, "put_exchange", (
                exchange.vhost, exchange.name, exchange.type, exchange.auto_delete,
                exchange.internal, schema.encode_arguments(exchange.arguments))))

    def exchange_deleted(self, exchange: Exchange) -> None:
        if exchange.durable:
            self._record((STATEMENT, "delete_exchange", (exchange.vhost, exchange.name)))

    def queue_declared(self, queue: Queue) -> None:
        if queue.durable:
            self._record((STATEMENT, "put_queue", (
                queue.vhost, queue.name, queue.auto_delete,
                schema.encode_arguments(queue.arguments))))

    def queue_deleted(self, queue: Queue) -> None:
        if queue.durable:
            self._run_cache = None  # a queue of the same name numbers its positions anew
            self._record((QUEUE_DELETED, queue.vhost, queue.name))

    def binding_created(self, binding: Binding) -> None:
        if is_durable_binding(binding):
            self._record((STATEMENT, "put_binding", _binding_row(binding)))

    def binding_deleted(self, binding: Binding) -> None:
        if is_durable_binding(binding):
            self._record((STATEMENT, "delete_binding", _binding_row(binding)))

    # -- message events (the hot path: one append each) ---------------------------------

    def enqueued(self, queue: Queue, entry: Entry) -> None:
        if keeps(queue, entry):
            self._record((ENQUEUED, queue.vhost, queue.name, entry.position, entry.message))

    def enqueued_many(self, queue: Queue, entries: list[Entry]) -> None:
        """A transaction's enqueues on one queue: one operation, nothing per entry here.

        The writer's threads read the entries (``store/batch.py``): their
        positions never change, and their messages are replaced (paged out)
        only after this operation's insert is readable, so after they read them.
        """
        if queue.durable:
            self._record((ENQUEUED_MANY, queue.vhost, queue.name, entries))

    def acquired(self, queue: Queue, entry: Entry) -> None:
        if keeps(queue, entry):
            self._record((ACQUIRED, queue.vhost, queue.name, entry.position))

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        # of a deleted queue: its rows went with it (and a queue of the same name may
        # already use the position)
        if keeps(queue, entry) and not queue.deleted:
            self._record((DEQUEUED, queue.vhost, queue.name, entry.position))

    def purged(self, queue: Queue, ranges: list[tuple[int, int]]) -> None:
        """A purge as one operation: a crash never brings part of it back."""
        if queue.durable:
            self._record((PURGED, queue.vhost, queue.name, ranges))

    # -- prepared XA branches ----------------------------------------------------------------

    def dtx_prepared(self, record: PreparedBranch, done: Callback) -> None:
        payload = schema.encode_branch(record.publishes, record.accepts)
        self._record((STATEMENT, "put_dtx_branch", (record.xid, "prepared", payload)))
        self.after_sync(done)

    def dtx_finished(self, xid: str) -> None:
        self._record((STATEMENT, "delete_dtx_branch", (xid,)))

    # -- HA transactions and outcomes ------------------------------------------------------

    def ha_tx_prepared(self, txid: str, payload: bytes, done: Callback) -> None:
        self._record((STATEMENT, "put_ha_transaction", (txid, payload)))
        self.after_sync(done)

    def ha_tx_finished(self, txid: str) -> None:
        self._record((STATEMENT, "delete_ha_transaction", (txid,)))

    def tx_outcome(self, txid: str, client_id: str | None, outcome: str, at: float) -> None:
        self._record((STATEMENT, "put_tx_outcome", (txid, client_id, outcome, at)))

    def tx_outcome_deleted(self, txid: str) -> None:
        self._record((STATEMENT, "delete_tx_outcome", (txid,)))

    def definition_changed(self, change: DefinitionChange) -> None:
        key = json.dumps(list(change.key), separators=(",", ":"))
        if change.value is None:
            self._record((STATEMENT, "delete_definition", (change.kind, key)))
        else:
            self._record((STATEMENT, "put_definition",
                          (change.kind, key, definitions_encode(change.value))))

    def put_meta(self, key: str, value: str) -> None:
        self._meta[key] = value
        self._record((STATEMENT, PUT_META, (key, value)))

    def get_meta(self, key: str) -> str | None:
        """The value last put (this process), else the one in the database."""
        if key in self._meta:
            return self._meta[key]
        return self._read_meta(key)

    def _read_meta(self, key: str) -> str | None:
        with self.engine.connect() as conn:
            found = conn.execute(select(schema.meta.c.value)
                                 .where(schema.meta.c.key == key)).scalar()
        return None if found is None else str(found)

    # -- recovery (SQLAlchemy Core) ----------------------------------------------------------

    def load(self, stream_messages: bool = False) -> Recovered:
        """Everything durable, for ``Broker.restore``; call before ``start``.

        With ``stream_messages`` the messages are an iterator read from the
        database while the broker restores them (iterate it once), so a node
        that pages does not hold every stored body in memory at start-up.
        """
        with self.engine.connect() as conn:
            def rows(table: Table) -> Any:
                return conn.execute(select(table).order_by(*table.primary_key))

            return Recovered(
                exchanges=[_exchange(r) for r in rows(schema.exchanges)],
                queues=[_queue(r) for r in rows(schema.queues)],
                bindings=[_binding(r) for r in rows(schema.bindings)],
                messages=(self._stream_messages() if stream_messages
                          else list(self._stream_messages())),
                prepared=[_branch(r) for r in rows(schema.dtx_branches)],
                ha_transactions=[(r.txid, bytes(r.payload))
                                 for r in rows(schema.ha_transactions)],
                outcomes=[(r.txid, r.client_id, r.outcome, float(r.at))
                          for r in rows(schema.tx_outcomes)],
                definitions=stored_definitions(
                    DefinitionChange.from_wire((r.kind, json.loads(r.key), r.value))
                    for r in rows(schema.definitions)),
            )

    def _stream_messages(self) -> Iterator[StoredMessage]:
        """The stored messages in (vhost, queue, position) order: the rows of ``messages``
        and the live positions of message runs, merged."""
        with self.engine.connect() as rows_conn, self.engine.connect() as runs_conn:
            table = schema.messages
            result = rows_conn.execution_options(yield_per=1000).execute(
                select(table).order_by(*self._text_order(table), table.c.position))
            yield from heapq.merge((_message(r) for r in result),
                                   self._run_messages(runs_conn), key=_message_key)

    def _text_order(self, table: Table) -> list[Any]:
        """vhost, queue in code point order (Python's), whatever the database's collation."""
        columns = [table.c.vhost, table.c.queue]
        if self.engine.dialect.name == "postgresql":
            return [c.collate("C") for c in columns]
        return columns  # SQLite compares text as UTF-8 bytes: code point order

    def _run_messages(self, conn: Any) -> Iterator[StoredMessage]:
        runs, marks = schema.message_runs, schema.run_marks
        mark_rows = conn.execute(select(marks.c.vhost, marks.c.queue, marks.c.position,
                                        marks.c.gone))
        gone: set[tuple[str, str, int]] = set()
        delivered: set[tuple[str, str, int]] = set()
        for r in mark_rows:
            (gone if r.gone else delivered).add((r.vhost, r.queue, int(r.position)))
        result = conn.execution_options(yield_per=16).execute(
            select(runs).order_by(*self._text_order(runs), runs.c.first_position))
        for r in result:
            for i, c in enumerate(unpack_run(self._run_contents(r.contents))):
                key = (r.vhost, r.queue, int(r.first_position) + i)
                if key not in gone:
                    yield StoredMessage(r.vhost, r.queue, key[2], c.exchange, c.routing_key,
                                        bytes(c.header), bytes(c.body), key in delivered)


def _prepare_schema(engine: Engine) -> None:
    """Create missing tables; migrate an older schema version; refuse any other."""
    schema.metadata.create_all(engine)
    with engine.begin() as conn:
        found = conn.execute(select(schema.meta.c.value)
                             .where(schema.meta.c.key == "schema_version")).scalar()
        if found is None:
            conn.execute(insert(schema.meta).values(key="schema_version",
                                                     value=schema.SCHEMA_VERSION))
        elif found in schema.MIGRATES_FROM:
            # 1 -> 2: the run tables are new (created above); the message rows stay valid
            conn.execute(update(schema.meta).where(schema.meta.c.key == "schema_version")
                         .values(value=schema.SCHEMA_VERSION))
            log.info("store schema version %s migrated to %s", found, schema.SCHEMA_VERSION)
        elif found != schema.SCHEMA_VERSION:
            raise StoreError(f"store schema version {found}, this brokerha expects "
                             f"{schema.SCHEMA_VERSION}")


def _binding_row(binding: Binding) -> tuple[Any, ...]:
    r = binding_record(binding)
    return (r.vhost, r.source, r.destination_kind, r.destination, r.routing_key,
            schema.encode_arguments(r.arguments))


def _exchange(r: Any) -> ExchangeRecord:
    return ExchangeRecord(r.vhost, r.name, r.type, bool(r.auto_delete), bool(r.internal),
                          schema.decode_arguments(r.arguments))


def _queue(r: Any) -> QueueRecord:
    return QueueRecord(r.vhost, r.name, bool(r.auto_delete), schema.decode_arguments(r.arguments))


def _binding(r: Any) -> BindingRecord:
    return BindingRecord(r.vhost, r.source, r.destination_kind, r.destination, r.routing_key,
                         schema.decode_arguments(r.arguments))


def _message_key(m: StoredMessage) -> tuple[str, str, int]:
    return (m.vhost, m.queue, m.position)


def _message(r: Any) -> StoredMessage:
    return StoredMessage(r.vhost, r.queue, r.position, r.exchange, r.routing_key,
                         bytes(r.header), bytes(r.body), bool(r.delivered))


def _branch(r: Any) -> PreparedBranch:
    publishes, accepts = schema.decode_branch(r.payload)
    return PreparedBranch(r.xid, publishes, accepts)
