"""TxTracker (seed 002): a prepared transaction a joining backup must see finished.

A backup that joins while a transaction is prepared but not yet committed or
rolled back receives the transaction's tx-queue, prepare included, in its
catch-up (so it holds the transaction as prepared and can apply the commit
event), but it was not there to vote. Until the transaction's outcome
reached it, it holds the prepared transaction and not its effects: seed 002
calls it *blocked* by the transaction. A TxTracker per queue the transaction
touches holds that backup's readiness (``RemoteBackup.ready``) until the backup
acknowledged the event that carries the outcome (``tc`` or ``tr``: one event
carries every enqueue and dequeue of the transaction, so all the trackers of
one transaction clear together).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from brokerha.cluster import replication as R


@dataclass
class TxTracker:
    txid: str
    vhost: str
    queue: str
    enqueues: int = 0                                 # messages the transaction puts on it
    dequeues: set[int] = field(default_factory=set)   # positions it takes off it
    clear_seq: int | None = None                      # the seq of the tc/tr event, once sent

    def cleared(self, acked: int) -> bool:
        return self.clear_seq is not None and acked >= self.clear_seq


def trackers_for(txid: str, events: list[list[Any]]) -> list[TxTracker]:
    """One tracker per queue named by the transaction's ``te``/``td`` events."""
    by_queue: dict[tuple[str, str], TxTracker] = {}

    def tracker(vhost: str, queue: str) -> TxTracker:
        key = (vhost, queue)
        if key not in by_queue:
            by_queue[key] = TxTracker(txid, vhost, queue)
        return by_queue[key]

    for event in events:
        if event[0] == R.TX_ENQUEUE:
            for name in event[3]:
                tracker(event[2], name).enqueues += 1
        elif event[0] == R.TX_DEQUEUE:
            tracker(event[2], event[3]).dequeues.update(event[4])
    return list(by_queue.values())
