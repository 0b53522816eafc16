"""Applying the synchronised queue to the broker model, with backups for split recovery.

The engine's model of the global queues is what the DC's workers executed;
each synchronised entry gets its deterministic outcome here (seed 003).  A
second model, ``stable``, trails at the last position every configured master
is known to hold: that is the "last known good state" a Simple or Smart master
backs up when it detects a split, and it never lies past any fork point, so a
restore followed by a replay of the winning log is always correct.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from brokerha.txlog.engine.messages import Action, Backup, Confirm, DeliverOrdered, Restore
from brokerha.txlog.engine.state import DurableState


class Executor:
    def __init__(
        self,
        node_id: str,
        durable: DurableState,
        persist: Callable[[str, Any], None],
        emit: Callable[[Action], None],
    ) -> None:
        self.node_id = node_id
        self.durable = durable
        self._persist = persist
        self._emit = emit
        self.replay_until = 0  # entries below this, when re-applied, are replays

    @property
    def applied(self) -> int:
        return self.durable.model.applied

    def missing_bodies(self) -> list[str]:
        """Synchronised entries not yet applied for want of a body (fetch them)."""
        sync, bodies = self.durable.sync, self.durable.bodies
        start = max(self.applied, sync.offset.length)
        return [r.tx_id for r in sync.records(start) if r.tx_id not in bodies]

    def advance(self) -> None:
        """Apply synchronised entries in order while their bodies are here."""
        sync, bodies = self.durable.sync, self.durable.bodies
        while self.applied < len(sync):
            position = self.applied
            entry = sync.entries[position - sync.offset.length]
            body = bodies.get(entry.record.tx_id)
            if body is None:
                return
            self._persist("exec.apply", position)
            outcome = entry.outcome or "committed"
            replay = position < self.replay_until
            self._emit(DeliverOrdered(entry.record.tx_id, position, outcome, replay))
            if entry.record.origin == self.node_id and body.has_dequeue and not replay:
                self._emit(Confirm(entry.record.tx_id, outcome))  # a replay was confirmed before

    def advance_stable(self, floor: int) -> int:
        """Move the last-known-good snapshot up to ``floor`` (bounded by what is applied)."""
        target = min(floor, self.applied)
        if target > self.durable.stable.applied:
            self._persist("exec.stable", target)
        return self.durable.stable.applied

    def back_up(self) -> None:
        self._persist("exec.backup", None)
        self._emit(Backup(self.durable.stable.applied))

    def restore(self) -> int:
        """Restore the backup (or the stable snapshot if none was taken); returns its position."""
        if self.durable.backup is None:
            self.back_up()
        self._persist("exec.restore", None)
        position = self.applied
        self._emit(Restore(position))
        return position

    def rewind(self, position: int, replay_until: int) -> None:
        """After a new log is adopted: re-apply from ``position``; below ``replay_until`` is replay."""
        self._persist("exec.rewind", position)
        self.replay_until = replay_until
