"""Deterministic validation of the synchronised queue (seed 003).

Every datacenter applies the synchronised queue in the same order to the same
model of the global queues, so a transaction that dequeues a message an
earlier transaction already consumed fails *the same way everywhere*, without
any further message.  Enqueue-only transactions cannot fail, so they are
confirmable as soon as their origin has acquired them (one phase); a
transaction with a dequeue is confirmable only once ordered and validated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from brokerha.txlog.engine.records import TxBody

COMMITTED = "committed"
FAILED = "failed"


@dataclass
class GlobalQueues:
    """The model every DC keeps of its global queues: which messages each holds."""

    queues: dict[str, set[str]] = field(default_factory=dict)
    applied: int = 0  # how many synchronised entries this state reflects

    def validate(self, body: TxBody) -> str:
        """COMMITTED if every dequeue finds its message (counting the tx's own enqueues)."""
        added: dict[str, set[str]] = {}
        removed: dict[str, set[str]] = {}
        for op in body.operations:
            held = self.queues.get(op.queue, set())
            if op.kind == "enqueue":
                added.setdefault(op.queue, set()).add(op.message_id)
                continue
            gone = removed.setdefault(op.queue, set())
            present = op.message_id in held or op.message_id in added.get(op.queue, set())
            if not present or op.message_id in gone:
                return FAILED
            gone.add(op.message_id)
        return COMMITTED

    def apply(self, body: TxBody) -> str:
        """Validate and, if it passes, apply all operations (all or nothing)."""
        outcome = self.validate(body)
        if outcome == COMMITTED:
            for op in body.operations:
                held = self.queues.setdefault(op.queue, set())
                if op.kind == "enqueue":
                    held.add(op.message_id)
                else:
                    held.discard(op.message_id)
        self.applied += 1
        return outcome

    def snapshot(self) -> GlobalQueues:
        return copy.deepcopy(self)


def confirmable_on_acquire(body: TxBody) -> bool:
    """One-phase confirmation: an enqueue-only transaction can never fail validation."""
    return not body.has_dequeue
