"""Split recovery in a broker node: the global queues backed up at a position, and restored.

Seed 000's Simple and Smart strategies back the workers' state up when a split
is acknowledged and, at the rejoin, restore it and replay the resynchronised
log. In a broker node the "workers' state" the TxLog decides is the contents
of the global queues: which messages (by global id), with which content, in
which order. This module keeps that backup; the bridge
(:mod:`brokerha.txlog.bridge.broker_bridge`) calls it on the engine's ``Backup`` and
``Restore`` actions and on every ``DeliverOrdered`` it applies.

**The position is in the past.** The engine backs up its *stable* state — the
last position every configured master is known to hold (so it lies before any
fork point) — which trails what the broker applied by about a round. The
broker's queues only show the present, so every applied transaction leaves an
*undo record* here (the global ids it enqueued; the entries it dequeued, with
their content): the state at position P is the present state with the records
from P on undone, newest first. Records older than the engine's stable
position can never be needed again and are dropped, so they cost about one
round of dequeued messages (more during a split, when the stable position
stands still).

During a split the stable position stands still and the records pile up
with every dequeued message's content; past ``UNDO_MAX_BYTES`` of content
the oldest are dropped (down to half of it, with a warning) and a backup
reaches them as it does after a restart. After a node restart the records
are gone; a backup that reaches further back than the first transaction
whose record is kept reads the gap from the TxLog's retained log (the
bodies of those transactions, and, for a dequeued message, the body of the
transaction that enqueued it). A message whose enqueue is past the
retention cannot be rebuilt and is counted as ``backup_missing`` (logged).

**Durable.** A backup is written to ``<txlog data dir>/broker-backup.msgpack``
(temporary file, fsync, atomic rename, fsync of the directory) before the
engine's next action is carried out, because the Restore it serves can come
after a crash of the node during the split.

**Restore** makes each global queue hold exactly the backup's messages in the
backup's order (its ready messages are rebuilt; a message some consumer
still holds stays with that consumer if the backup has it). A held message
the backup does not have is withdrawn: the consumer's ack or reject is void
and a requeue drops it, as for a message an ordered dequeue removed
elsewhere. The replay that follows (the engine's ``DeliverOrdered`` from the
backup's position on) rebuilds the rest.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from brokerha.broker.message import Entry, Message
from brokerha.broker.paging import PAGED
from brokerha.broker.queue import Queue
from brokerha.files import replace_durably

log = logging.getLogger("brokerha.txlog")

BACKUP_FILE = "broker-backup.msgpack"
# content of dequeued messages the undo records may hold (a long split keeps them all)
UNDO_MAX_BYTES = 64 * 1024 * 1024

# a global queue's contents: global id -> entry, and how a message travels in a backup
Index = dict[str, dict[str, Entry]]
Packer = Callable[[Message, bytes], bytes]
Unpacker = Callable[[bytes], Message]


@dataclass
class UndoRecord:
    """What one applied synchronised transaction changed in the global queues."""

    position: int
    enqueued: list[tuple[str, str]] = field(default_factory=list)  # (queue key, global id)
    dequeued: list[tuple[str, str, Entry]] = field(default_factory=list)
    size: int = 0  # bytes of the dequeued messages' content


@dataclass
class BrokerBackup:
    """The global queues at synchronised position ``position``: per queue, (id, message) in order."""

    position: int
    queues: dict[str, list[tuple[str, bytes]]]
    taken_ms: int = 0

    @property
    def messages(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def encode(self) -> bytes:
        return msgpack.packb({"position": self.position, "taken_ms": self.taken_ms,
                              "queues": {k: [list(m) for m in v] for k, v in self.queues.items()}},
                             use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> BrokerBackup:
        raw = msgpack.unpackb(data, raw=False)
        return cls(int(raw["position"]), {k: [(g, d) for g, d in v] for k, v in raw["queues"].items()},
                   int(raw.get("taken_ms", 0)))


@dataclass
class RestoreResult:
    position: int
    removed: int = 0     # messages the backup does not have (ready: gone; held: withdrawn)
    rebuilt: int = 0     # ready messages put back in the backup's order
    kept_held: int = 0   # messages a consumer holds that the backup has too


def write_backup_file(data_dir: Path, data: bytes) -> None:
    """An encoded backup into ``data_dir`` durably (temporary file, fsync, rename, fsync).

    The primary writes the one it takes; an HA backup writes the copy it
    receives (``lb`` events, ``txlog/bridge/replica.py``), so a primary elected during
    the split restores it at the rejoin.
    """
    replace_durably(Path(data_dir) / BACKUP_FILE, data)


class SplitBackups:
    """Undo records, backups and restores of one node's global queues (see the module docstring)."""

    def __init__(self, data_dir: Path, pack: Packer, unpack: Unpacker,
                 undo_max_bytes: int = UNDO_MAX_BYTES) -> None:
        self.path = Path(data_dir) / BACKUP_FILE
        self.pack = pack
        self.unpack = unpack
        self.undo: deque[UndoRecord] = deque()
        self.current: UndoRecord | None = None
        self.covered_from: int | None = None  # first position whose record is here
        self.undo_bytes = 0  # sum of the records' sizes
        self.undo_max_bytes = undo_max_bytes
        self.undo_shed = 0  # records dropped over the bound (a backup reads them from the log)
        self.last_backup: dict[str, Any] | None = None
        self.last_restore: dict[str, Any] | None = None

    # ---- undo records (called while DeliverOrdered is applied) ---------------------

    def begin(self, position: int, stable: int) -> None:
        """A synchronised transaction at ``position`` is about to be applied."""
        while self.undo and self.undo[-1].position >= position:
            # re-applied after a rewind: the old records describe another log
            self.undo_bytes -= self.undo.pop().size
        while self.undo and self.undo[0].position < stable:
            self._drop_oldest()
        if self.undo_bytes > self.undo_max_bytes:
            self._shed()
        if self.covered_from is None or (not self.undo and position < self.covered_from):
            self.covered_from = position
        self.current = UndoRecord(position)
        self.undo.append(self.current)

    def _drop_oldest(self) -> None:
        dropped = self.undo.popleft()
        self.undo_bytes -= dropped.size
        self.covered_from = dropped.position + 1

    def _shed(self) -> None:
        """Over the bound (a long split): keep the newest records, half the bound's worth."""
        shed, start = 0, self.undo[0].position
        while self.undo and self.undo_bytes > self.undo_max_bytes // 2:
            self._drop_oldest()
            shed += 1
        self.undo_shed += shed
        log.warning("txlog: undo records over %d MiB (the stable position stands still, as in "
                    "a split): dropped %d, positions %d-%d; a backup taken there reads them "
                    "from the TxLog's retained log", self.undo_max_bytes >> 20, shed, start,
                    (self.covered_from or start) - 1)

    def enqueued(self, key: str, gid: str) -> None:
        if self.current is not None:
            self.current.enqueued.append((key, gid))

    def dequeued(self, key: str, gid: str, entry: Entry) -> None:
        if self.current is not None:
            self.current.dequeued.append((key, gid, entry))
            self.current.size += entry.message.size
            self.undo_bytes += entry.message.size

    def status(self) -> dict[str, Any]:
        """The undo records kept now (``covered_from``: the oldest position they reach)."""
        return {"records": len(self.undo), "bytes": self.undo_bytes,
                "max_bytes": self.undo_max_bytes, "covered_from": self.covered_from,
                "shed": self.undo_shed}

    # ---- backup ----------------------------------------------------------------------

    def take(self, position: int, applied: int, index: Index, queues: dict[str, Queue],
             log_since: Callable[[int], Iterator[tuple[int, Any]]],
             find_enqueue: Callable[[str, str], tuple[int, bytes] | None],
             ) -> tuple[BrokerBackup, int]:
        """The global queues as of ``position``, written durably; returns it and how many were lost.

        ``applied``: the position the broker's queues reflect when no record
        was taken since the node started. ``log_since(p)`` yields (position,
        committed body) of the retained log from ``p`` on (for the gap after a
        restart); ``find_enqueue(key, gid)`` is (position, packed content) of
        the transaction that enqueued a message.
        """
        state: dict[str, dict[str, tuple[int, bytes | Entry]]] = {
            key: {gid: (entry.position, entry) for gid, entry in ids.items()}
            for key, ids in index.items()}
        for record in reversed(self.undo):
            if record.position < position:
                break
            for key, gid, entry in reversed(record.dequeued):
                state.setdefault(key, {})[gid] = (entry.position, entry)
            for key, gid in record.enqueued:
                state.get(key, {}).pop(gid, None)
        missing = 0
        gap_end = applied if self.covered_from is None else min(self.covered_from, applied)
        if gap_end > position:
            missing = self._undo_from_log(position, gap_end, state, log_since, find_enqueue)
        backup = BrokerBackup(position, {}, int(time.time() * 1000))
        for key, messages in state.items():
            ordered = sorted(messages.items(), key=lambda kv: kv[1][0])
            backup.queues[key] = [(gid, self._content(queues.get(key), item))
                                  for gid, (_, item) in ordered]
        self.write(backup)
        self.last_backup = {"position": position, "messages": backup.messages,
                            "queues": len(backup.queues), "missing": missing,
                            "at_ms": backup.taken_ms, "file": str(self.path)}
        return backup, missing

    def _undo_from_log(self, position: int, end: int,
                       state: dict[str, dict[str, tuple[int, bytes | Entry]]],
                       log_since: Callable[[int], Iterator[tuple[int, Any]]],
                       find_enqueue: Callable[[str, str], tuple[int, bytes] | None]) -> int:
        """Undo the transactions in [position, end) from the TxLog's retained bodies."""
        bodies = [(p, b) for p, b in log_since(position) if p < end]
        missing = 0
        for p, body in reversed(bodies):
            for op in reversed(body.operations):
                if op.kind == "enqueue":
                    state.get(op.queue, {}).pop(op.message_id, None)
                    continue
                found = find_enqueue(op.queue, op.message_id)
                if found is None:
                    missing += 1
                    log.error("txlog: backup at %d cannot rebuild message %s of %s (dequeued at "
                              "%d before this node restarted; its enqueue is past the TxLog's "
                              "retention)", position, op.message_id, op.queue, p)
                    continue
                # put back from the log, it sorts by its enqueue's position, before the
                # messages the broker holds (an approximation: the broker's own entries
                # carry queue positions, which do not compare with log positions)
                enqueued_at, data = found
                state.setdefault(op.queue, {})[op.message_id] = (-(1 << 62) + enqueued_at, data)
        return missing

    def _content(self, queue: Queue | None, item: bytes | Entry) -> bytes:
        if isinstance(item, bytes):
            return item
        message = item.message
        if item.paged == PAGED and queue is not None and queue.pager is not None:
            found = queue.pager.store.read_bodies(queue.vhost, queue.name, [item.position])
            header, body = found[item.position]
            return self.pack(Message(message.exchange, message.routing_key, header, body),
                             header)
        return self.pack(message, message.header)

    def write(self, backup: BrokerBackup) -> None:
        write_backup_file(self.path.parent, backup.encode())

    def read(self) -> BrokerBackup | None:
        try:
            return BrokerBackup.decode(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
            log.error("txlog: broker backup %s unreadable: %s", self.path, exc)
            return None

    # ---- restore ---------------------------------------------------------------------

    def restore(self, backup: BrokerBackup, index: Index,
                queue_for: Callable[[str, bool], Queue | None]) -> RestoreResult:
        """Make every global queue hold the backup's messages, in its order (module docstring)."""
        result = RestoreResult(backup.position)
        for key in sorted(set(index) | set(backup.queues)):
            wanted = backup.queues.get(key, [])
            queue = queue_for(key, bool(wanted))
            ids = index.setdefault(key, {})
            if queue is None:
                ids.clear()
                continue
            ready = {entry.position: entry for entry in queue.ready}
            keep = {gid for gid, _ in wanted}
            held: dict[str, Entry] = {}
            for gid, entry in list(ids.items()):
                if entry.position not in ready:
                    if gid in keep:
                        held[gid] = entry  # with a consumer, and in the backup too: stays
                        result.kept_held += 1
                    else:
                        queue.withdraw(entry.position)  # its ack is void, a requeue drops it
                        result.removed += 1
                elif gid not in keep:
                    result.removed += 1
            queue.purge()  # the ready list is rebuilt below, in the backup's order
            ids.clear()
            ids.update(held)
            for gid, data in wanted:
                if gid in held:
                    continue
                added = queue.add_entry(Entry(queue.next_position, self.unpack(data), None))
                ids[gid] = added
                result.rebuilt += 1
        while self.undo and self.undo[-1].position >= backup.position:
            self.undo.pop()
        self.covered_from = backup.position if not self.undo else self.undo[0].position
        self.current = None
        self.last_restore = {"position": backup.position, "removed": result.removed,
                             "rebuilt": result.rebuilt, "kept_held": result.kept_held,
                             "at_ms": int(time.time() * 1000)}
        return result
