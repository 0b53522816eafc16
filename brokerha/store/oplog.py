"""The operation log: a confirm waits for one append and one fdatasync; SQL catches up later.

Without it every group commit is an SQL transaction: for SQLite about fifteen
page writes, file locks and an fsync of its WAL per commit, and a message that
a consumer acknowledges a few milliseconds after its publish is written twice
(insert, then delete) in two commits. With it (docs/store.md, "The operation
log"):

- the ``LogAppender`` thread takes what the event loop handed over, appends it
  to the current log file as one record and fdatasyncs it; only then are the
  units' ``after_sync`` callbacks reported. That is the durability point.
- it then forwards the units to the store's ``Writer``, which folds them into
  one pending batch as they come (an insert and its delete cancel there) and
  applies the batch to SQL now and then: when a log file is full, when the
  batch is old or large, when someone waits to read a row back
  (``after_readable``), when idle, and at shutdown.
- a log file is deleted once an SQL commit covered all of it; that commit
  records the file's generation (meta ``oplog_applied``), so a crash between
  the commit and the deletion replays nothing twice.

At start-up the store replays every file above ``oplog_applied`` into SQL
before anything reads it. A file holds records ``<u32 length><u32 crc32>
msgpack([op, ...])``, the checksum seeded with the file's generation, and ends
with an end record once complete; applied files are written over as later
generations (``OpLog.open``). A record is one append, whole units, so a
transaction is in it whole or not at all. Only the newest file may lack its
end record (its records end at the first that does not check out: a torn
write, never acknowledged, or a reused file's older contents); anywhere else a
bad record is corruption and the store refuses to start.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from brokerha.files import drop_cached, fsync_dir
from brokerha.store.batch import (
    ACQUIRED,
    DEQUEUED,
    ENQUEUED,
    ENQUEUED_MANY,
    ENQUEUED_RUN,
    PURGED,
    QUEUE_DELETED,
    STATEMENT,
    Batch,
    Callback,
    Op,
    StoredContent,
    Unit,
    persistent_entries,
    runs_of,
)
from brokerha.store.writer import ApplyPolicy, DiskFull, Writer
from brokerha.thread_priority import lower_this_thread

log = logging.getLogger("brokerha.store")

MAGIC = b"BHOPLOG1"
_RECORD = struct.Struct("<II")  # length, crc32 of the payload (seeded with the generation)
_END = 0xFFFFFFFF  # the length field of the record that ends a complete file
PACK_CHUNK = 512  # rows packed in one C call at most (the GIL is held through one)
# a body at least this long is written as it is (os.writev), never copied through the
# packer: packing one 50 MiB message held the GIL 0.1-0.3 s under load (issue 33)
BIG_BODY = 64 * 1024
IOV_MAX = 512  # buffers per os.writev (Linux takes 1024)
ROTATE_BYTES = 8 * 1024 * 1024  # a new file after this many bytes (then SQL catches up)
_NAME = re.compile(r"\.oplog\.(\d{10})$")


class OpLogError(RuntimeError):
    """A log file is damaged where it cannot be a torn tail: the store does not start."""


# -- records --------------------------------------------------------------------------


def with_runs(ops: list[Op]) -> list[Op]:
    """``ops`` with each ``ENQUEUED_MANY`` as its message runs (``batch.runs_of``): packed
    once here, the same contents go to the log and to SQL."""
    for op in ops:
        if op[0] == ENQUEUED_MANY:
            break
    else:
        return ops
    out: list[Op] = []
    for op in ops:
        if op[0] == ENQUEUED_MANY:
            out.extend(runs_of(op))
        else:
            out.append(op)
    return out


def encode_ops(packer: msgpack.Packer, ops: list[Op]) -> bytes:
    """A record's payload: the ops as plain rows (a message's content is copied in; a
    message run's packed contents are one ``bin``)."""
    return b"".join(encode_parts(packer, ops))


def encode_parts(packer: msgpack.Packer, ops: list[Op]) -> list[Any]:
    """``encode_ops``'s bytes as buffers to write one after the other: a body, or a message
    run's packed contents, of at least ``BIG_BODY`` bytes is one of them as it is (after its
    ``bin`` header), the rest packed."""
    rows: list[Any] = []
    append = rows.append
    big = False
    for op in ops:
        kind = op[0]
        if kind == ENQUEUED:
            m = op[4]
            append((ENQUEUED, op[1], op[2], op[3], m.exchange, m.routing_key, m.header, m.body))
            big = big or len(m.body) >= BIG_BODY
        elif kind == ENQUEUED_MANY:  # logged as the enqueues it stands for
            vhost, queue = op[1], op[2]
            for position, m in persistent_entries(op[3]):
                append((ENQUEUED, vhost, queue, position, m.exchange, m.routing_key, m.header,
                        m.body))
                big = big or len(m.body) >= BIG_BODY
        else:
            append(op)
            # a message run's contents (a catch-up's, as it came: ~256 KiB) likewise
            big = big or (kind == ENQUEUED_RUN and len(op[5]) >= BIG_BODY)
    if len(rows) <= PACK_CHUNK and not big:
        return [packer.pack(rows)]
    # the same bytes as one pack of the list, made a chunk at a time: one C call over a
    # big commit's rows (100,000 x 512 B: 0.2 s) would hold the GIL, and so stall the
    # event loop, for all of it
    parts: list[Any] = [packer.pack_array_header(len(rows))]
    pack = packer.pack
    chunk: list[Any] = []
    for row in rows:
        kind = row[0]
        if (kind == ENQUEUED or kind == ENQUEUED_RUN) and len(row[-1]) >= BIG_BODY:
            if chunk:
                parts.append(b"".join(map(pack, chunk)))
                chunk = []
            body = row[-1]  # a body, or a run's packed contents: the row's last field
            parts.append(b"".join([packer.pack_array_header(len(row)), *map(pack, row[:-1]),
                                   _bin_header(len(body))]))
            parts.append(body)
            continue
        chunk.append(row)
        if len(chunk) >= PACK_CHUNK:
            parts.append(b"".join(map(pack, chunk)))
            chunk = []
    if chunk:
        parts.append(b"".join(map(pack, chunk)))
    return parts


def _bin_header(length: int) -> bytes:
    """msgpack's ``bin 16``/``bin 32`` header (what packing bytes of ``length`` begins with;
    the C Packer has no ``pack_bin_header``)."""
    if length < 0x10000:
        return b"\xc5" + length.to_bytes(2, "big")
    return b"\xc6" + length.to_bytes(4, "big")


def decode_ops(payload: bytes) -> list[Op]:
    ops: list[Op] = []
    for row in msgpack.unpackb(payload, raw=False, use_list=True):
        kind = row[0]
        if kind == ENQUEUED:
            ops.append((ENQUEUED, row[1], row[2], row[3], StoredContent(*row[4:8])))
        elif kind == ENQUEUED_RUN:
            ops.append((ENQUEUED_RUN, row[1], row[2], row[3], row[4], row[5]))
        elif kind == STATEMENT:
            ops.append((STATEMENT, row[1], tuple(row[2])))
        elif kind in (ACQUIRED, DEQUEUED, QUEUE_DELETED):
            ops.append(tuple(row))
        elif kind == PURGED:
            ops.append((PURGED, row[1], row[2], [(lo, hi) for lo, hi in row[3]]))
        else:
            raise OpLogError(f"unknown operation kind {kind!r}")
    return ops


# -- files ----------------------------------------------------------------------------


class OpLog:
    """The numbered log files next to the database: ``<db file>.oplog.<generation>``."""

    def __init__(self, database: Path, sync: bool = True) -> None:
        self.directory = database.parent
        self.prefix = database.name + ".oplog."
        self.sync_enabled = sync
        self._spare_lock = threading.Lock()  # the writer recycles, the appender reuses
        self.generation = 0  # the file being appended to (0: none open)
        self.size = 0
        self._fd: int | None = None
        self.dirty = False  # appended since the last sync
        self.reused = 0  # files written over (the spare) rather than created
        # a file a stored message run still refers to (store/runs.py) is kept past its
        # apply: ``keep(generation)`` says so (set by the store: SQL's refs at start-up,
        # then the writer's ``RunIndex``); kept files are never the spare
        self.keep: Callable[[int], bool] = _keep_none
        self.kept = 0  # applied files kept for their runs, now
        # kept files whose pages were dropped from the page cache (remove_through): never
        # made the spare, whose reuse would then read back each page it writes part of
        self._uncached: set[int] = set()
        self._removed_through = 0  # the newest generation remove_through was asked for
        self._lock_fd: int | None = self._lock(database)

    def _lock(self, database: Path) -> int:
        """One store per log: a second opener would replay and delete a live node's files."""
        path = database.with_name(database.name + ".oplog-lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OpLogError(f"the store {database} is in use by another process or store "
                             "(its operation log is locked)") from None
        return fd

    def release(self) -> None:
        """Close the current file and give up the lock (the store is closed)."""
        self.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @classmethod
    def probe(cls, database: Path) -> OpLog | None:
        """The log of ``database`` if files of one are there (locked), else None."""
        if not any(_NAME.search(p.name) for p in database.parent.glob(database.name + ".oplog.*")):
            return None
        return cls(database)

    def path(self, generation: int) -> Path:
        return self.directory / f"{self.prefix}{generation:010d}"

    @property
    def spare(self) -> Path:
        """A complete, applied file kept to be written over as the next generation."""
        return self.directory / f"{self.prefix}spare"

    def generations(self) -> list[int]:
        found = []
        for p in self.directory.glob(self.prefix + "*"):
            m = _NAME.search(p.name)
            if m is not None and p.name.startswith(self.prefix):
                found.append(int(m.group(1)))
        return sorted(found)

    def read(self, generation: int, newest: bool) -> Iterator[list[Op]]:
        """The records of one file, in order, up to its end record.

        Only the newest file may lack one (the node stopped while writing it):
        its records end at the first that does not check out -- a torn write,
        or what a reused file held before (stamped with an older generation).
        """
        path = self.path(generation)
        data = path.read_bytes()
        if data[:len(MAGIC)] != MAGIC:
            if newest and len(data) < len(MAGIC):
                return  # created, never written
            raise OpLogError(f"{path.name}: not an operation log file")
        seed = _seed(generation)
        pos = len(MAGIC)
        while True:
            bad = None
            if len(data) - pos < _RECORD.size:
                bad = "no end record" if pos == len(data) else "a partial record header"
            else:
                size, crc = _RECORD.unpack_from(data, pos)
                if size == _END and crc == _end_crc(seed):
                    return
                payload = data[pos + _RECORD.size:pos + _RECORD.size + size]
                if len(payload) < size:
                    bad = "a partial record"
                elif zlib.crc32(payload, seed) != crc:
                    bad = "a record that does not check out"
            if bad is not None:
                if not newest:
                    raise OpLogError(f"{path.name}: {bad} at byte {pos} of an older log file")
                log.info("operation log %s: records end at byte %d (%s: a write the crash "
                         "cut short, or what the reused file held before)", path.name, pos, bad)
                return
            try:
                yield decode_ops(payload)
            except (ValueError, TypeError, IndexError, msgpack.ExtraData) as exc:
                raise OpLogError(f"{path.name}: undecodable record at byte {pos}: {exc}") from None
            pos += _RECORD.size + size

    def open(self, generation: int) -> None:
        """Start a new file: a reused spare when there is one (its directory entry made durable).

        Writing over a file whose blocks are already allocated and written lets
        an fdatasync skip the inode and extent updates that growing a file
        needs (measured on ext4 here: about 120 µs instead of 230 µs per append
        and sync, and half the CPU). A reused file's old records carry an older
        generation in their checksum, so they read back as the end of the log.
        """
        path = self.path(generation)
        with self._spare_lock:
            reused = self.spare.exists()
            if reused:
                os.rename(self.spare, path)
                self.reused += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            if reused:
                os.lseek(fd, len(MAGIC), os.SEEK_SET)
            else:
                os.ftruncate(fd, 0)
                os.write(fd, MAGIC)
            if self.sync_enabled:
                os.fdatasync(fd)
                fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self.generation, self.size = fd, generation, len(MAGIC)
        self.dirty = False

    def append(self, payload: bytes | list[Any]) -> int:
        """One record (whole hand-overs): its payload, or the buffers that make it up one
        after the other (``encode_parts``: no copy of a big body); its size in bytes."""
        assert self._fd is not None, "operation log not open"
        parts = [payload] if isinstance(payload, bytes) else payload
        crc, length = _seed(self.generation), 0
        for part in parts:
            crc = zlib.crc32(part, crc)  # the GIL is released over a big buffer
            length += len(part)
        if len(parts) == 1:
            self._write(_RECORD.pack(length, crc) + parts[0])
        else:
            self._write_parts([_RECORD.pack(length, crc), *parts])
        return _RECORD.size + length

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.size += len(data)
        self.dirty = True

    def _write_parts(self, parts: list[Any]) -> None:
        """``parts`` one after the other with ``os.writev`` (the GIL released through it)."""
        assert self._fd is not None
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = 0
        while views:
            written = os.writev(self._fd, views[:IOV_MAX])
            total += written
            while written:
                if written >= len(views[0]):
                    written -= len(views.pop(0))
                else:
                    views[0] = views[0][written:]
                    written = 0
        self.size += total
        self.dirty = True

    def undo_partial(self) -> None:
        """Cut off what a failed write (the disk full) left past the last whole record.

        ``size`` grows only after a whole write, so the file ends with whole
        records again and the next append goes where the failed one began.
        """
        if self._fd is not None:
            os.ftruncate(self._fd, self.size)
            os.lseek(self._fd, self.size, os.SEEK_SET)

    def sync(self) -> None:
        """Make every append so far durable (nothing to do when nothing was appended since)."""
        if self.dirty and self._fd is not None:
            if self.sync_enabled:
                try:
                    os.fdatasync(self._fd)
                except OSError as exc:
                    # not retried, even for ENOSPC: after a failed sync the kernel may have
                    # dropped the dirty pages, so a later sync that succeeds proves nothing
                    raise OpLogError(f"operation log sync failed: {exc}") from exc
            self.dirty = False

    def finish(self) -> int:
        """End the current file with its end record, sync and close it; its generation."""
        finished = self.generation
        if self._fd is not None:
            self._write(_RECORD.pack(_END, _end_crc(_seed(finished))))
            self.sync()
            self.close()
        return finished

    def rotate(self) -> int:
        """Finish the current file and open the next; the finished generation."""
        finished = self.finish()
        self.open(finished + 1)
        return finished

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove_through(self, generation: int) -> None:
        """Drop the files an SQL commit covered: one is kept as the spare, the rest deleted.

        A file kept for its stored runs leaves the page cache then (``drop_cached``:
        complete and synced, it is read back only by recovery and paging). A
        backup caught up 2,000,000 x 1 KiB behind kept ~2 GB of such pages, on
        every node likewise, each page taken fresh from the kernel; on this VM
        fresh pages past the first few GB of free memory cost ~10 us each to
        clear or fill (the host backs them on first touch), and the catching-up
        backup's loop then spent most of its CPU clearing pages for the
        messages it holds (issue 33, docs/benchmarks.md). Dropped, those pages
        are reused for the next writes and allocations.

        A leftover (a crash before this ran) is skipped at start-up: its
        generation is not above the applied one.
        """
        self._removed_through = max(self._removed_through, generation)
        kept = 0
        for g in self.generations():
            if g > generation or (g == self.generation and self._fd is not None):
                continue
            if self.keep(g):
                kept += 1
                if g not in self._uncached:
                    self._uncached.add(g)
                    drop_cached(self.path(g))
                continue
            self._recycle(g)
        self.kept = kept

    def drop_kept(self, generations: list[int]) -> None:
        """Files whose last stored run went (writer thread, after that commit): removed
        like any applied file (those not applied yet stay for the log's own sake)."""
        for g in generations:
            if (g <= self._removed_through and not self.keep(g)
                    and not (g == self.generation and self._fd is not None)):
                if self.path(g).exists():
                    self._recycle(g)
                    self.kept = max(0, self.kept - 1)

    def _recycle(self, g: int) -> None:
        """Drop file ``g``: the spare if there is none and its pages are cached, else deleted."""
        uncached = g in self._uncached
        self._uncached.discard(g)
        with self._spare_lock:
            try:
                if uncached or self.spare.exists():
                    self.path(g).unlink()
                else:
                    os.rename(self.path(g), self.spare)
            except FileNotFoundError:
                pass


def _keep_none(_generation: int) -> bool:
    return False


def _seed(generation: int) -> int:
    """Each file's checksums start from its generation: a reused file's old records fail."""
    return zlib.crc32(generation.to_bytes(8, "little"))


def _end_crc(seed: int) -> int:
    return zlib.crc32(b"end", seed)


# -- the appending thread ---------------------------------------------------------------


class LogAppender(threading.Thread):
    """Appends each hand-over to the log, syncs what someone waits for, folds it for SQL.

    The event loop learns of progress through two counters it only reads:
    ``appended`` (hand-overs written) and ``synced`` (hand-overs a sync
    covers); a hand-over's ``after_sync`` callbacks are posted to the loop
    after its sync. The fold of everything appended since the last apply
    lives here too (``Batch.add`` as each hand-over is written), so the
    writer thread wakes only to apply a batch, not at every append.
    """

    def __init__(self, oplog: OpLog, writer: Writer, policy: ApplyPolicy,
                 report: Callable[[list[Callback]], None],
                 fail: Callable[[BaseException], None], rotate_bytes: int = ROTATE_BYTES,
                 on_disk_full: Callable[[BaseException | None], None] | None = None) -> None:
        super().__init__(name="brokerha-store-oplog", daemon=True)
        self.oplog = oplog
        self.writer = writer
        self.policy = policy
        self._report = report
        self._fail = fail
        self.rotate_bytes = rotate_bytes
        # SimpleQueue (C, no Python-level lock): submit runs on the event loop once per
        # hand-over, where a Condition's notify cost about 5 % of a busy primary's loop
        self._inbox: queue.SimpleQueue[Unit | None] = queue.SimpleQueue()
        self._packer = msgpack.Packer(use_bin_type=True)
        self.appended = 0  # hand-overs written (this thread writes, the loop reads)
        self.synced = 0  # hand-overs a sync covers
        self._stop_asked = False
        # a write that finds the disk full is tried again (fdatasync failing is still fatal:
        # after a failed sync the kernel may have dropped the pages, a retry proves nothing)
        self.disk = DiskFull(on_disk_full, lambda: self._stop_asked, what="operation log write")
        self._pending = Batch()  # folded since the last hand-over to the writer
        # message runs whose contents are a buffer of their own in the log are kept there,
        # SQL holding a reference (store/runs.py); False: SQL holds a copy, as before. Not
        # without fdatasync (synchronous=normal): SQL could then outlive what it refers to
        self.run_refs = oplog.sync_enabled
        self._pending_refs = False  # the pending batch refers to runs in the log
        self._pending_ops = 0
        self._pending_since = 0.0
        self.stats: dict[str, Any] = {"appends": 0, "syncs": 0, "log_bytes": 0, "rotations": 0,
                                      "applies": 0}

    def submit(self, ops: list[Op], callbacks: list[Callback], readable: list[Callback]) -> None:
        self._inbox.put(Unit(ops, callbacks, readable))

    @property
    def backlog_units(self) -> int:
        """Hand-overs waiting for the log (observable lag)."""
        return self._inbox.qsize()

    def stop(self) -> None:
        self._stop_asked = True
        self._inbox.put(None)

    def _write(self, write: Callable[[], int]) -> int:
        """``write()`` on the log, tried again while the disk is full."""
        while True:
            try:
                done = write()
            except OSError as exc:
                self.oplog.undo_partial()
                if not self.disk.wait(exc):
                    raise
                continue
            self.disk.succeeded()
            return done

    def run(self) -> None:
        lower_this_thread()  # [node] background_nice: the event loop's thread first
        try:
            self._serve()
        except Exception as exc:
            self._fail(exc)

    def _take(self, timeout: float | None) -> tuple[list[Unit], bool]:
        """Everything handed over so far (waits up to ``timeout`` for the first); stop asked?"""
        units: list[Unit] = []
        stopping = False
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return units, stopping
        while True:
            if item is None:
                stopping = True
            else:
                units.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return units, stopping

    def _serve(self) -> None:
        policy = self.policy
        stopping = False
        while not stopping:
            timeout = None
            if self._pending_ops or self._pending.callbacks:
                timeout = max(0.0, min(policy.idle,
                                       self._pending_since + policy.max_age - time.monotonic()))
            units, stopping = self._take(timeout)
            if units:
                self._append(units)
            if stopping:
                break
            if self.oplog.size >= self.rotate_bytes:
                self._pending.add(Unit([], [], closes=self._write(self.oplog.rotate)))
                self.stats["rotations"] += 1
            self._hand_over(idle=not units)
        # everything is logged: finish the last file and let SQL catch up with it
        self._pending.add(Unit([], [], closes=self.oplog.finish()))
        self._hand_over(idle=True)

    def _append(self, units: list[Unit]) -> None:
        """Append what was handed over; sync only when someone waits for it.

        A hand-over without ``after_sync`` callbacks (a consumer's acks on a
        standalone node, the dequeues a backup acknowledges later) promises
        nobody anything: it is written, and the next sync (the next callback, a
        rotation, shutdown) covers it. Until then ``synced`` lags behind
        ``appended``, and the store's ``after_sync`` does not take its
        "nothing pending" shortcut.
        """
        for unit in units:
            unit.ops = with_runs(unit.ops)
        ops = [op for unit in units for op in unit.ops]
        if ops:
            payload = encode_parts(self._packer, ops)
            start: list[int] = []

            def append() -> int:
                start[:] = [self.oplog.generation, self.oplog.size]  # again after a retry
                return self.oplog.append(payload)

            self.stats["log_bytes"] += self._write(append)
            self.stats["appends"] += 1
            if self.run_refs and len(payload) > 1:
                self._locate_runs(units, payload, start[0], start[1])
        callbacks = [cb for unit in units for cb in unit.callbacks]
        if callbacks:
            self.oplog.sync()
            self.stats["syncs"] += 1
        self.appended += len(units)
        if not self.oplog.dirty:
            self.synced = self.appended
        if callbacks:
            self._report(callbacks)
        if not self._pending_ops and not self._pending.callbacks:
            self._pending_since = time.monotonic()
        for unit in units:
            self._pending.add(Unit(unit.ops, unit.readable))
        self._pending_ops += len(ops)

    def _locate_runs(self, units: list[Unit], parts: list[Any], generation: int,
                     start: int) -> None:
        """Name where each message run's contents went in the log, when they are a buffer of
        their own there (``encode_parts``: at least ``BIG_BODY``): SQL then keeps a
        reference to them instead of a copy (store/runs.py). The op gets a 7th field,
        (generation, offset, length, crc32); the record as written does not change."""
        offsets: dict[int, int] = {}
        offset = start + _RECORD.size
        for part in parts:
            if isinstance(part, bytes) and len(part) >= BIG_BODY:
                offsets.setdefault(id(part), offset)
            offset += len(part)
        for unit in units:
            located: list[Op] | None = None
            for i, op in enumerate(unit.ops):
                if op[0] != ENQUEUED_RUN or len(op) != 6:
                    continue
                contents = op[5]
                at = offsets.get(id(contents))
                if at is None or not isinstance(contents, bytes):
                    continue
                if located is None:
                    located = list(unit.ops)
                located[i] = (*op, (generation, at, len(contents), zlib.crc32(contents)))
                self._pending_refs = True
            if located is not None:
                unit.ops = located

    def _hand_over(self, idle: bool) -> None:
        """Give the pending batch to the writer when the policy says it is due."""
        batch, policy = self._pending, self.policy
        if not (self._pending_ops or batch.callbacks or batch.closes is not None):
            return
        if not (idle or batch.closes is not None or batch.callbacks
                or self._pending_ops >= policy.max_ops
                or time.monotonic() - self._pending_since >= policy.max_age):
            return
        if self._pending_refs:
            # SQL is to refer to runs in the log: they must be on the disk before it commits
            if self.oplog.dirty:
                self.oplog.sync()
                self.stats["syncs"] += 1
                self.synced = self.appended
            self._pending_refs = False
        self.writer.submit_batch(batch)
        self.stats["applies"] += 1
        self._pending, self._pending_ops = Batch(), 0
