"""The TxLog master's durable state in an HA datacenter: replicated to the DC's backups.

The master runs on the serving primary only. Its journal (one record per
engine call: the ``Persist`` changes, :mod:`brokerha.txlog.master.journal`) travels in
the primary's replication log (``cluster/replication.py``: ``lr`` records,
``ls`` snapshots, ``la`` applied positions), so it is ordered with the queue
events, acknowledged with them and confirmed by the same rule
(``cluster/quorum.py``: every guarded backup plus a majority):

* primary side, :class:`PrimaryJournal` is the driver's ``replication``: each
  record is emitted into the log, and the engine call's other actions (its
  ``Send``s above all) are carried out from ``Primary.barrier``, i.e. once
  the record is on the quorum. A master that starts on a new primary first
  emits its whole state (``ls``): the backups replace theirs with it.
* backup side, :class:`TxLogReplica` writes each record into the node's own
  journal (and each ``lb``, the global queues backed up at a split, into its
  own ``broker-backup.msgpack``, so a primary elected during a split restores
  it at the rejoin; and each ``lp``, the sync peers an operator changed at
  runtime, into its own ``txlog-peers.json``, so a promoted node's master
  starts with them rather than the configuration's), in the master's format
  and with the master's sequence numbers,
  and installs snapshots; the node acknowledges an event only once this
  journal is fsynced (off the loop, :meth:`TxLogReplica.after_durable`) and
  the store synced. Promoted, the node starts a master on that directory,
  which loads it exactly as a restarted master loads its own.

Why the election keeps it safe: a record is released only when a majority
holds it at its HA seq, and a node votes only for a candidate at least as
advanced (``cluster/election.py``), so the new primary holds every record
whose sends left. Records it holds beyond that were never acted on: a master
that persisted and crashed before sending, which the engine already handles.
A backup's TxLog state is always replaced by the primary's at its join
(catch-up ``ls``) and at a master's start, so a node never carries an older
term's TxLog past a newer primary's.

``la`` (how many synchronised entries the global queues reflect) is written
by the bridge into the store's meta after the queue events it covers, on the
primary and on every backup: the position from which a master re-applies the
log at its start (``broker_bridge.TxLogBridge.start``).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from brokerha.cluster import replication as R
from brokerha.cluster.replication import ReplicationError
from brokerha.files import fsync_off_loop
from brokerha.txlog.bridge.broker_state import write_backup_file
from brokerha.txlog.engine.config import TxLogConfig
from brokerha.txlog.engine.state import DurableState
from brokerha.txlog.master.driver import Fsync, decode_peers, write_peers_file
from brokerha.txlog.master.journal import (
    SNAPSHOT_EVERY_BYTES,
    Journal,
    apply_record,
    decode_record,
    decode_snapshot,
    encode_snapshot,
)

log = logging.getLogger("brokerha.txlog")

SNAPSHOT_PART = 1 << 20  # bytes of an ``ls`` event (a packet stays far below MAX_PACKET)

Event = list[Any]


def snapshot_events(seq: int, state: DurableState) -> list[Event]:
    """``state`` as of journal record ``seq``, as ``ls`` events of at most SNAPSHOT_PART bytes."""
    data = encode_snapshot(seq, state)
    parts = max(1, -(-len(data) // SNAPSHOT_PART))
    return [R.TxLogSnapshot(R.TXLOG_SNAPSHOT, seq, i, parts,
                            data[i * SNAPSHOT_PART:(i + 1) * SNAPSHOT_PART])
            for i in range(parts)]


class PrimaryJournal:
    """The driver's ``replication`` on the serving primary: the HA log carries the journal."""

    def __init__(self, primary: Any) -> None:
        self.primary = primary

    def record(self, seq: int, body: bytes) -> None:
        self.primary.emit(R.TxLogRecord(R.TXLOG_RECORD, seq, body))

    def snapshot(self, seq: int, state: DurableState) -> None:
        for event in snapshot_events(seq, state):
            self.primary.emit(event)

    def barrier(self, callback: Callable[[], None]) -> None:
        self.primary.barrier(callback)

    def applied(self, count: int) -> None:
        self.primary.emit(R.TxLogApplied(R.TXLOG_APPLIED, count))

    def broker_backup(self, data: bytes) -> None:
        self.primary.emit(R.TxLogBrokerBackup(R.TXLOG_BROKER_BACKUP, data))

    def peers(self, data: bytes | None) -> None:
        """The master's peers file (``driver.PEERS_FILE``), or None when it has none."""
        self.primary.emit(R.TxLogPeers(R.TXLOG_PEERS, data))


class TxLogReplica:
    """This node's copy of its DC's TxLog master, kept while the master runs elsewhere.

    The journal directory belongs to one ``Journal`` at a time: this one
    opens it lazily (first event, or a catch-up to answer as a new primary)
    and the bridge closes it before its own master opens the directory
    (``suspend``). ``on_applied`` receives every ``la``.
    """

    def __init__(self, data_dir: Path | str, config: TxLogConfig, *,
                 on_applied: Callable[[int], None], fsync: bool = True,
                 snapshot_every: int = SNAPSHOT_EVERY_BYTES,
                 fsync_later: Fsync = fsync_off_loop) -> None:
        self.dir = Path(data_dir)
        self.config = config
        self.on_applied = on_applied
        self.fsync = fsync
        self.fsync_later = fsync_later  # off the loop (a simulation's: on its virtual clock)
        self.snapshot_every = snapshot_every
        self.journal: Journal | None = None
        self.state: DurableState | None = None
        self.suspended = False  # the master runs on this node: it owns the directory
        self._parts: list[bytes] = []
        self._parts_seq = -1
        self._written = 0   # writes handed to the journal file (records, snapshots)
        self._synced = 0    # of those, known to be on disk
        self._syncing = False
        self._waiters: deque[tuple[int, Callable[[], None]]] = deque()
        self.counters = dict.fromkeys(("records", "duplicates", "snapshots", "compactions",
                                       "fsyncs", "fsync_errors", "broker_backups",
                                       "peer_changes"), 0)

    # ---- the directory ---------------------------------------------------------------

    def open(self) -> tuple[int, DurableState]:
        """(journal seq, state) of the directory, loading it on first use."""
        if self.suspended:
            raise RuntimeError("the TxLog master runs on this node: its state is the driver's")
        if self.journal is None or self.state is None:
            journal = Journal(self.dir, fsync=self.fsync, snapshot_every=self.snapshot_every)
            self.state = journal.load(self.config)
            self.journal = journal
            self._written = self._synced = 0
        return self.journal.seq, self.state

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        self.journal, self.state = None, None
        self._parts, self._parts_seq = [], -1
        # acks waiting for this journal's fsync belong to a backup role that ended
        self._waiters.clear()

    def suspend(self) -> None:
        """The master starts on this node: let go of the directory."""
        self.close()
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False

    @property
    def seq(self) -> int | None:
        return None if self.journal is None else self.journal.seq

    # ---- events from the primary (Backup._apply) --------------------------------------

    def apply(self, event: Event) -> None:
        kind = event[0]
        if kind == R.TXLOG_APPLIED:
            self.on_applied(int(event[1]))
            return
        if self.suspended:  # never acknowledge what was not written: join again
            raise ReplicationError(f"TxLog event {kind!r} while this node runs the master")
        if kind == R.TXLOG_BROKER_BACKUP:
            write_backup_file(self.dir, bytes(event[1]))  # small; synced before it returns
            self.counters["broker_backups"] += 1
            return
        if kind == R.TXLOG_PEERS:
            self._peers(None if event[1] is None else bytes(event[1]))
            return
        self.open()
        if kind == R.TXLOG_RECORD:
            self._record(int(event[1]), bytes(event[2]))
        elif kind == R.TXLOG_SNAPSHOT:
            self._snapshot_part(int(event[1]), int(event[2]), int(event[3]), bytes(event[4]))
        else:
            raise ReplicationError(f"unknown TxLog event {kind!r}")

    def _peers(self, data: bytes | None) -> None:
        """The sync peers an operator set on the primary (``None``: the configuration's).

        Written like the master writes them (``driver.write_peers_file``:
        atomic, fsynced before this returns), so a master started here after a
        promotion dials and accepts the same DCs as the old primary's. A file
        the master could not read is refused rather than written.
        """
        if data is not None:
            try:
                decode_peers(data)
            except ValueError as exc:
                raise ReplicationError(f"TxLog peers unreadable: {exc}") from exc
        write_peers_file(self.dir, data)
        self.counters["peer_changes"] += 1

    def _record(self, seq: int, body: bytes) -> None:
        journal, state = self.journal, self.state
        assert journal is not None and state is not None
        if seq <= journal.seq:
            self.counters["duplicates"] += 1
            return
        if seq != journal.seq + 1:
            raise ReplicationError(f"TxLog record {seq} after {journal.seq}: a gap")
        record_seq, changes = decode_record(body)
        if record_seq != seq:
            raise ReplicationError(f"TxLog record {record_seq} announced as {seq}")
        apply_record(state, changes)
        journal.append(seq, body)
        self._written += 1
        self.counters["records"] += 1
        if journal.size >= self.snapshot_every:
            journal.snapshot(state)  # synced: everything written so far is on disk
            self.counters["compactions"] += 1
            self._mark_synced(self._written)

    def _snapshot_part(self, seq: int, part: int, parts: int, data: bytes) -> None:
        if part == 0:
            self._parts, self._parts_seq = [], seq
        if seq != self._parts_seq or part != len(self._parts):
            raise ReplicationError(f"TxLog snapshot part {part} of {seq} out of order")
        self._parts.append(data)
        if len(self._parts) < parts:
            return
        blob, self._parts, self._parts_seq = b"".join(self._parts), [], -1
        try:
            snap_seq, state = decode_snapshot(blob)
        except Exception as exc:
            raise ReplicationError(f"TxLog snapshot {seq} unreadable: {exc}") from exc
        assert self.journal is not None
        self.journal.install(snap_seq, state)  # fsynced before it returns
        self.state = state
        self._written += 1
        self.counters["snapshots"] += 1
        self._mark_synced(self._written)
        log.info("txlog: installed the primary's TxLog state at journal seq %d "
                 "(synchronised length %d)", snap_seq, len(state.sync))

    # ---- durability (the node acknowledges from here) ----------------------------------

    def after_durable(self, callback: Callable[[], None]) -> None:
        """``callback`` once everything written so far is fsynced (the fsync runs off the loop)."""
        if self._synced >= self._written or self.journal is None:
            callback()
            return
        self._waiters.append((self._written, callback))
        self._start_sync()

    def _start_sync(self) -> None:
        if self._syncing or self.journal is None:
            return
        self._syncing = True
        target = self._written
        # a duplicate descriptor: a compaction or snapshot may close the file meanwhile
        fd = os.dup(self.journal.fileno())
        self.fsync_later(fd, lambda exc: self._synced_to(target, exc), sync=self.fsync)

    def _synced_to(self, target: int, exc: BaseException | None) -> None:
        self._syncing = False
        if exc is not None:
            # never acknowledge what may not be on disk: the primary times this backup out
            self.counters["fsync_errors"] += 1
            log.error("txlog: fsync of the replicated journal failed: %s", exc)
            return
        self.counters["fsyncs"] += 1
        self._mark_synced(target)
        if self._waiters:
            self._start_sync()

    def _mark_synced(self, target: int) -> None:
        self._synced = max(self._synced, target)
        while self._waiters and self._waiters[0][0] <= self._synced:
            _, callback = self._waiters.popleft()
            callback()

    # ---- a catch-up's answer (this node is the primary, the master not started) -------

    def catch_up_events(self) -> list[Event]:
        seq, state = self.open()
        return snapshot_events(seq, state)

    def status(self) -> dict[str, Any]:
        return {"journal_seq": self.seq, "suspended": self.suspended,
                "synchronised": None if self.state is None else len(self.state.sync),
                "pending_fsync": self._written - self._synced, **self.counters}
