"""A master's :class:`DurableState` on disk: a snapshot plus a journal of ``Persist`` actions.

The engine changes its durable state only through ``Persist(key, value)``
actions, and :meth:`DurableState.apply` is the reference implementation of
every key; so the disk format is that sequence. Each batch of persists (one
engine call) is one journal record, written and fsynced before any ``Send``
of the same batch leaves the node. Recovery loads the snapshot and re-applies
the records written after it.

Files in the data directory:

* ``txlog-state.pickle``: the whole ``DurableState`` and the sequence number of
  the last record it includes, replaced atomically (temporary file, fsync,
  rename, fsync of the directory);
* ``txlog-journal.bin``: records ``[4-byte length][4-byte CRC-32][pickle of
  (seq, [(key, value), ...])]``. A torn or corrupt tail (a crash in the middle
  of a write) is cut off at start; records at or below the snapshot's sequence
  number are skipped, so a crash between the snapshot's rename and the
  journal's truncation never applies a change twice.

Pickle is used because the values are the engine's own objects (entries,
ballots, the global-queue model). The files are this node's private state;
in an HA datacenter the same records (and snapshots) also travel to the DC's
backups over the authenticated cluster link (``brokerha.txlog.bridge.replica``), which
write them into their own journal in this format -- never to or from another
datacenter's master.
"""

from __future__ import annotations

import os
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

from brokerha.files import replace_durably
from brokerha.txlog.engine.config import TxLogConfig
from brokerha.txlog.engine.messages import Persist
from brokerha.txlog.engine.state import DurableState

SNAPSHOT = "txlog-state.pickle"
JOURNAL = "txlog-journal.bin"
_HEAD = struct.Struct(">II")
SNAPSHOT_EVERY_BYTES = 8 * 1024 * 1024
FORMAT = 1


def decode_record(body: bytes) -> tuple[int, list[tuple[str, Any]]]:
    """A record's (seq, [(key, value), ...])."""
    seq, changes = pickle.loads(body)
    return int(seq), changes


def apply_record(state: DurableState, changes: list[tuple[str, Any]]) -> None:
    for key, value in changes:
        state.apply(Persist(key, value))


def encode_snapshot(seq: int, state: DurableState) -> bytes:
    """The snapshot file's bytes: ``(FORMAT, seq, state)``."""
    return pickle.dumps((FORMAT, seq, state), protocol=pickle.HIGHEST_PROTOCOL)


def decode_snapshot(data: bytes) -> tuple[int, DurableState]:
    fmt, seq, state = pickle.loads(data)
    if fmt != FORMAT:
        raise ValueError(f"TxLog snapshot format {fmt}, this version reads {FORMAT}")
    return int(seq), state


class Journal:
    """Loads a master's durable state and makes each later batch of changes durable."""

    def __init__(self, data_dir: Path | str, fsync: bool = True,
                 snapshot_every: int = SNAPSHOT_EVERY_BYTES) -> None:
        self.dir = Path(data_dir)
        self.fsync = fsync
        self.snapshot_every = snapshot_every
        self.seq = 0
        self.records_replayed = 0
        self._file: Any = None

    # ---- start-up ---------------------------------------------------------------

    def load(self, config: TxLogConfig) -> DurableState:
        """The state as of the last durable record (a fresh one for an empty directory)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        state, self.seq = self._read_snapshot(config)
        path = self.dir / JOURNAL
        good = 0
        if path.exists():
            data = path.read_bytes()
            pos = 0
            while pos + _HEAD.size <= len(data):
                size, crc = _HEAD.unpack_from(data, pos)
                body = data[pos + _HEAD.size: pos + _HEAD.size + size]
                if len(body) < size or zlib.crc32(body) != crc:
                    break  # torn tail: the batch never finished, so nothing was sent after it
                seq, changes = decode_record(body)
                pos += _HEAD.size + size
                good = pos
                if seq <= self.seq:
                    continue
                apply_record(state, changes)
                self.seq = seq
                self.records_replayed += 1
            if good < len(data):
                with open(path, "r+b") as f:
                    f.truncate(good)
        self._file = open(path, "ab")  # noqa: SIM115 - kept open for the node's lifetime
        return state

    def _read_snapshot(self, config: TxLogConfig) -> tuple[DurableState, int]:
        path = self.dir / SNAPSHOT
        if not path.exists():
            return DurableState(members=config.masters, strategy=config.split_recovery), 0
        try:
            fmt, seq, state = pickle.loads(path.read_bytes())
        except Exception as exc:  # a damaged snapshot must stop the node, not reset it
            raise RuntimeError(f"cannot read {path}: {exc}; refusing to start with a "
                               "forgotten TxLog") from exc
        if fmt != FORMAT:
            raise RuntimeError(f"{path}: format {fmt}, this version reads {FORMAT}")
        return state, seq

    # ---- running -------------------------------------------------------------------

    def write(self, changes: list[Persist], state: DurableState, *,
              sync: bool = True) -> bytes | None:
        """Make ``changes`` (already applied to ``state``) durable before returning.

        Returns the record's body (what :meth:`append` writes on a backup), or
        None when there was nothing to write. With ``sync=False`` the record is
        written but not fsynced: the caller syncs it (off its event loop, on a
        duplicate of :meth:`fileno`) before anything that depends on it.
        """
        if not changes:
            return None
        self.seq += 1
        body = pickle.dumps((self.seq, [(c.key, c.value) for c in changes]),
                            protocol=pickle.HIGHEST_PROTOCOL)
        self._write_record(body)
        if self.fsync and sync:
            os.fsync(self._file.fileno())
        if self._file.tell() >= self.snapshot_every:
            self.snapshot(state)
        return body

    def _write_record(self, body: bytes) -> None:
        self._file.write(_HEAD.pack(len(body), zlib.crc32(body)) + body)
        self._file.flush()

    # ---- a backup's copy (brokerha.txlog.bridge.replica) ----------------------------------

    def append(self, seq: int, body: bytes) -> None:
        """Write a record the master wrote (its ``seq`` and body), not synced: see :meth:`sync`."""
        self._write_record(body)
        self.seq = seq

    def install(self, seq: int, state: DurableState) -> None:
        """Replace everything with ``state`` as of the master's record ``seq`` (durable on return)."""
        self.seq = seq
        self.snapshot(state)

    def fileno(self) -> int:
        return int(self._file.fileno())

    @property
    def size(self) -> int:
        return int(self._file.tell())

    def snapshot(self, state: DurableState) -> None:
        """Write the whole state, then start an empty journal (a new file, durably: what a
        crash keeps of the old one can never run on into the new one's records)."""
        replace_durably(self.dir / SNAPSHOT, encode_snapshot(self.seq, state))
        self._file.close()
        replace_durably(self.dir / JOURNAL, b"")
        self._file = open(self.dir / JOURNAL, "ab")  # noqa: SIM115

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
