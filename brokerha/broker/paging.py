"""Paging message bodies of long durable queues out to the store (docs/store.md).

Only what the store keeps can be paged: persistent messages on durable
queues. An entry appended while its queue already holds ``queue_limit`` bytes
of resident content (or the node ``node_limit``) is marked PENDING; once the
store reports the entry's insert readable (``after_readable``), its message is
replaced, *for this entry only*, by a ``PagedMessage`` stub that keeps the
properties and the size but not the body. A message routed to several queues
is one shared ``Message``: each queue's entry gets its own stub, and Python's
reference counting frees the body when the last entry lets go of it (so a
body is only really freed once every queue holding it has paged it).

Before an entry is delivered (or dead-lettered), ``fault`` reads its body back
with one store query that also reads ahead the next paged entries from the
head, within what the limit leaves room for. Entries appended while the queue
is under its limit stay resident, so the head of a queue is resident.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from brokerha.broker.message import Entry, Message


class Queue(Protocol):
    """What the pager reads and updates on a queue (brokerha.broker.queue.Queue)."""

    vhost: str
    name: str
    deleted: bool
    memory: Any  # the node's MemoryMeter
    ready: Any  # the queue's ReadyList
    ready_bytes: int
    paged_bytes: int
    page_pending: Any
    page_scheduled: bool

RESIDENT = 0  # body in memory
PENDING = 1  # body in memory, paged out once the store has committed its insert
PAGED = 2  # body only in the store: entry.message is a PagedMessage

READ_AHEAD = 256  # entries read back with one query at most
_UNLIMITED = 1 << 62


class PagedMessage(Message):
    """A message's properties without its body (which the store holds)."""

    __slots__ = ("body_size",)
    body_size: int

    @property
    def size(self) -> int:
        return self.body_size + len(self.header)

    def __repr__(self) -> str:
        return f"PagedMessage({self.msg_id}, {self.exchange!r}, {self.routing_key!r}, {self.body_size}B)"


_COPIED = ("exchange", "routing_key", "header", "msg_id", "persistent", "priority",
           "expiration_ms", "_headers_at", "_route", "user_id")


def paged_copy(message: Message) -> PagedMessage:
    stub = PagedMessage.__new__(PagedMessage)
    for name in _COPIED:
        setattr(stub, name, getattr(message, name))
    stub._headers = None  # no body: reading one raises AttributeError (the store holds it)
    stub.body_size = len(message.body)
    return stub


def resident_copy(stub: Message, header: bytes, body: bytes) -> Message:
    message = Message.__new__(Message)
    for name in _COPIED:
        setattr(message, name, getattr(stub, name))
    message._headers = None
    message.header = header
    message.body = body
    return message


class Pager:
    """Decides which entries to page, pages them after commit, reads them back."""

    def __init__(self, store: Any, queue_limit: int = 0, node_limit: int = 0,
                 read_ahead: int = READ_AHEAD, background: Any = None) -> None:
        self.store = store
        self.background = background  # the broker's (broker/background.py): paging in slices
        self.queue_limit = queue_limit or _UNLIMITED
        self.node_limit = node_limit or _UNLIMITED
        self.read_ahead = max(1, read_ahead)
        self.paged_out = 0  # counters for tests and logs
        self.read_back = 0
        self.reads = 0

    # -- paging out --------------------------------------------------------------------

    def added(self, queue: Queue, entry: Entry, size: int) -> None:
        """An entry was appended to ``queue``'s ready list (and counted)."""
        if not entry.message.persistent:
            return
        resident = queue.ready_bytes - queue.paged_bytes
        if resident <= self.queue_limit and queue.memory.used <= self.node_limit:
            return
        entry.paged = PENDING
        queue.paged_bytes += size
        queue.page_pending.append(entry)
        if not queue.page_scheduled:
            self._schedule(queue)

    def restored(self, queue: Queue, entry: Entry, size: int) -> None:
        """A recovered entry (already durable): page it at once when over the limit."""
        if not entry.message.persistent:
            return
        resident = queue.ready_bytes - queue.paged_bytes
        if resident <= self.queue_limit and queue.memory.used <= self.node_limit:
            return
        queue.paged_bytes += size
        self._page(queue, entry, size)

    def _schedule(self, queue: Queue) -> None:
        queue.page_scheduled = True
        covered = len(queue.page_pending)
        self.store.after_readable(lambda: self._durable(queue, covered))

    def _durable(self, queue: Queue, covered: int) -> None:
        """The inserts of the first ``covered`` pending entries are committed.

        They are paged out by a sliced work (``broker/background.py``): a TX of
        100,000 past the limit makes 100,000 stubs, too many for one loop turn.
        """
        work = PageOut(self, queue, covered)
        if self.background is None:
            while not work.step(PAGE_SLICE):
                pass
        else:
            self.background.run(work)

    def _page(self, queue: Queue, entry: Entry, size: int) -> None:
        entry.message = paged_copy(entry.message)
        entry.paged = PAGED
        queue.memory.used -= size
        self.paged_out += 1

    # -- reading back ------------------------------------------------------------------

    def fault(self, queue: Queue, entry: Entry) -> None:
        """Read back a paged entry still counted as ready, and the next ones from the head."""
        resident = queue.ready_bytes - queue.paged_bytes
        budget = min(self.queue_limit - resident, self.node_limit - queue.memory.used)
        wanted = [entry]
        budget -= entry.message.size
        scanned = 0
        for other in queue.ready:
            if scanned >= self.read_ahead or budget <= 0:
                break
            scanned += 1
            if other.paged == PAGED and other is not entry:
                size = other.message.size
                if size > budget:
                    break
                budget -= size
                wanted.append(other)
        self._read(queue, wanted)
        for e in wanted:
            size = e.message.size
            queue.paged_bytes -= size
            queue.memory.used += size

    def fault_removed(self, queue: Queue, entries: Iterable[Entry]) -> None:
        """Read back paged entries that already left the ready list (dead-lettering)."""
        wanted = [e for e in entries if e.paged == PAGED]
        if wanted:
            self._read(queue, wanted)

    def _read(self, queue: Queue, entries: list[Entry]) -> None:
        bodies = self.store.read_bodies(queue.vhost, queue.name, [e.position for e in entries])
        self.reads += 1
        for e in entries:
            found = bodies.get(e.position)
            if found is None:
                raise LookupError(f"paged message {e.position} of queue '{queue.name}' "
                                  f"in vhost '{queue.vhost}' is missing from the store")
            e.message = resident_copy(e.message, found[0], found[1])
            e.paged = RESIDENT
        self.read_back += len(entries)


PAGE_SLICE = 4096  # entries paged out at once without a background (no loop)


class PageOut:
    """Page out the first ``covered`` pending entries of ``queue``, ``budget`` at a time.

    They stay on ``page_pending`` until their step, so a purge meanwhile still
    finds (and resets) them; the queue's next page-out is scheduled once done.
    """

    def __init__(self, pager: Pager, queue: Queue, covered: int) -> None:
        self.pager = pager
        self.queue = queue
        self.left = covered

    def step(self, budget: int) -> bool:
        queue = self.queue
        pending = queue.page_pending
        n = min(self.left, budget)
        batch = pending[:n]
        del pending[:n]
        self.left -= n
        for entry in batch:
            if entry.paged == PENDING:  # still ready (leaving the ready list resets it)
                self.pager._page(queue, entry, entry.message.size)
        if self.left:
            return False
        queue.page_scheduled = False
        if pending and not queue.deleted:
            self.pager._schedule(queue)
        return True

