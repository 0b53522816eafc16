"""QueueReplicator (seed 002): one queue on a backup, kept equal to the primary's.

Enqueues keep the primary's positions (``Queue.add_entry``), so a dequeue
names the same entry on both nodes and a promoted backup numbers on from
there. A dequeue takes the entry off the ready list and settles it, which
tells the backup's store like an acknowledgement would; an entry already
absent (dropped by an earlier catch-up) is simply not there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from brokerha.broker.message import Entry, Message
from brokerha.broker.queue import Queue


class QueueReplicator:
    def __init__(self, queue: Queue, clock: Callable[[], float]) -> None:
        self.queue = queue
        self.clock = clock

    def enqueue(self, position: int, exchange: str, routing_key: str, header: bytes,
                body: bytes, expires_in_ms: int | None) -> None:
        expires_at = None if expires_in_ms is None else self.clock() + expires_in_ms / 1000.0
        message = Message(exchange, routing_key, bytes(header), bytes(body))
        self.queue.add_entry(Entry(position, message, expires_at))

    def enqueue_many(self, events: list[Any]) -> None:
        """Enqueue events of this queue in a row (``Enqueued`` records), as one batch."""
        now = self.clock()
        self.queue.add_entries([
            Entry(e.position, Message(e.exchange, e.routing_key, bytes(e.header), bytes(e.body)),
                  None if e.expires_in is None else now + e.expires_in / 1000.0)
            for e in events])

    def enqueue_run(self, position: int, messages: list[Message]) -> None:
        """A transaction's run (``OpRefs``): ``messages`` at ``position``.. in one batch
        (``Queue.add_entries``: the store's hooks take it in one call)."""
        self.queue.add_entries([Entry(position + i, message, None)
                                for i, message in enumerate(messages)])

    def dequeue(self, positions: list[Any]) -> None:
        q = self.queue
        for position in positions:
            entry = q.take_position(position)
            if entry is not None:
                q.settle(entry)
