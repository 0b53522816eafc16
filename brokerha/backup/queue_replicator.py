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
from brokerha.store.batch import run_rows
from brokerha.store.runs import PackedEntries


class QueueReplicator:
    def __init__(self, queue: Queue, clock: Callable[[], float]) -> None:
        self.queue = queue
        self.clock = clock

    def _entry(self, position: int, message: Message, expires_in_ms: int | None,
               now: float | None = None) -> Entry:
        """An entry at the primary's position; its expiry counted from ``now``."""
        if expires_in_ms is None:
            return Entry(position, message, None)
        return Entry(position, message, (self.clock() if now is None else now)
                     + expires_in_ms / 1000.0)

    def enqueue(self, position: int, exchange: str, routing_key: str, header: bytes,
                body: bytes, expires_in_ms: int | None) -> None:
        self.add(position, Message(exchange, routing_key, bytes(header), bytes(body)),
                 expires_in_ms)

    def add(self, position: int, message: Message, expires_in_ms: int | None) -> None:
        """A message already made (a transaction's, from its te) at ``position``."""
        self.queue.add_entry(self._entry(position, message, expires_in_ms))

    def enqueue_many(self, events: list[Any]) -> None:
        """Enqueue events of this queue in a row (``Enqueued`` records), as one batch."""
        now = self.clock()
        self.queue.add_entries([
            self._entry(e.position, Message(e.exchange, e.routing_key, bytes(e.header),
                                            bytes(e.body)), e.expires_in, now)
            for e in events])

    def enqueue_packed(self, first: int, count: int, contents: bytes) -> None:
        """A catch-up's run (``er``): ``count`` messages at ``first``.. packed in the store's
        run format; the store keeps ``contents`` as it came (``PackedEntries``).

        ``ValueError`` if ``contents`` is not ``count`` messages.
        """
        rows = run_rows(contents)
        if not isinstance(rows, tuple) or len(rows) != count:
            raise ValueError(f"a run of {count} messages at {first} holds something else")
        entries: list[Entry] = []
        append = entries.append
        position = first
        # A run's rows mostly share their exchange, routing key and properties: its messages
        # hold one object of each, not one a message (~100 B of fresh memory less a message
        # held by a catching-up backup, whose loop faults its new pages in; issue 33). The
        # row's own copy dies with ``rows``, its memory reused by the next run's.
        exchange = routing_key = ""
        header = b""
        for row in rows:
            row_exchange, row_key, row_header, body = row
            if row_exchange != exchange:
                exchange = row_exchange
            if row_key != routing_key:
                routing_key = row_key
            if row_header != header:
                header = row_header
            append(Entry(position, Message(exchange, routing_key, header, body), None))
            position += 1
        self.queue.add_entries(PackedEntries(entries, contents))

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
