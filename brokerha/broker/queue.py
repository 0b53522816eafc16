"""Queues: ready messages, consumers, acknowledgements, TTL, limits, priorities.

Every entry carries its replication id (``position``): assigned when the message
is first routed to the queue, strictly increasing per queue (seed 002). A
requeued entry goes back to its original place, so a queue is always sorted by
position within a priority level.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, Protocol

from mypy_extensions import mypyc_attr

from brokerha.broker.background import Background
from brokerha.broker.dedup import WINDOW_ARG, DedupWindow
from brokerha.broker.drain import Ranges, ReadyDrain, extend_runs
from brokerha.broker.errors import AccessRefused
from brokerha.broker.message import Entry, Message
from brokerha.broker.paging import PAGED, PENDING, RESIDENT, Pager


def noop_hook(method: Callable[..., None]) -> Callable[..., None]:
    """Marks a default observer method that queues need not call."""
    method.noop_hook = True  # type: ignore[attr-defined]
    return method


class QueueHooks:
    """Per-event lists of bound methods, holding only the methods an observer overrides.

    Queues call these on every message, so a no-op default costs nothing.
    """

    EVENTS = ("enqueued", "acquired", "dequeued", "requeued", "purged", "enqueued_many")

    def __init__(self) -> None:
        self.enqueued: list[Callable[[Queue, Entry], None]] = []
        self.acquired: list[Callable[[Queue, Entry], None]] = []
        self.dequeued: list[Callable[[Queue, Entry], None]] = []
        self.requeued: list[Callable[[Queue, Entry], None]] = []
        # observers that take a purge in one call: they get no ``dequeued`` for its entries
        self.purged: list[Callable[[Queue, Ranges], None]] = []
        # observers that take a batch of enqueues (a transaction's) in one call
        self.enqueued_many: list[Callable[[Queue, list[Entry]], None]] = []

    def dequeued_singly(self) -> list[Callable[[Queue, Entry], None]]:
        """The ``dequeued`` hooks of observers without ``purged``: a purge's entries one by one."""
        return _without(self.dequeued, self.purged)

    def enqueued_singly(self) -> list[Callable[[Queue, Entry], None]]:
        """The ``enqueued`` hooks of observers without ``enqueued_many``."""
        return _without(self.enqueued, self.enqueued_many)

    def add(self, observer: object) -> None:
        """Register an observer's overridden event methods (see observers.QueueObserver)."""
        for event in self.EVENTS:
            method = getattr(observer, event, None)
            if method is not None and not getattr(method, "noop_hook", False):
                getattr(self, event).append(method)


def _without(hooks: list[Any], of: list[Any]) -> list[Any]:
    """``hooks`` but those bound to the observers that ``of``'s hooks are bound to."""
    if not of:
        return list(hooks)
    owners = [getattr(hook, "__self__", None) for hook in of]
    return [hook for hook in hooks
            if not any(getattr(hook, "__self__", None) is o for o in owners)]


@mypyc_attr(allow_interpreted_subclasses=True)  # the TxLog's GlobalQueues
class QueueOrdering:
    """A queue whose enqueues and dequeues another layer orders (a TxLog global queue).

    The layer that orders a queue installs its ``QueueOrdering`` on it
    (``Queue.ordering``; the TxLog's ``GlobalQueues``,
    ``txlog/bridge/global_queues.py``) and removes it when it stops ordering.
    The broker and the AMQP layer never know that layer; they ask the queue:
    ``Queue.ordered`` (its publishes and acknowledgements outside a
    transaction become one-operation transactions, which the transaction's
    observers order), ``publish`` (an enqueue the broker makes itself, a dead
    letter, goes to the ordering layer instead of ``Queue.enqueue``), and the
    ``refuse_*`` answers for what would change this broker's copy alone (a
    purge, deleting a non-empty queue, a no-ack consumer, a management get).
    """

    def publish(self, queues: list[Queue], message: Message) -> None:
        """An enqueue the broker makes itself (a dead letter) into these ordered queues."""
        raise NotImplementedError

    def refuse_purge(self, queue: Queue) -> str:
        """Why ``queue.purge`` is refused on this queue."""
        raise NotImplementedError

    def refuse_delete(self, queue: Queue) -> str | None:
        """Why deleting the queue now is refused (None: it may be deleted)."""
        raise NotImplementedError

    def refuse_no_ack(self, queue: Queue, method: str) -> str:
        """Why ``method`` with no-ack is refused on this queue."""
        raise NotImplementedError

    def refuse_get(self, queue: Queue) -> str:
        """Why the management API's ``get`` (a dequeue outside AMQP) is refused."""
        raise NotImplementedError


OVERFLOW_MODES = ("drop-head", "reject-publish", "reject-publish-dlx")


class Consumer(Protocol):
    """What a queue needs of a consumer; the AMQP channel implements it."""

    tag: str
    no_ack: bool
    exclusive: bool

    def can_take(self) -> bool:
        """Has prefetch credit and a writable connection."""
        ...

    def deliver(self, queue: Queue, entry: Entry) -> None: ...

    def cancelled_by_server(self, queue: Queue) -> None: ...


class DeadLetterSink(Protocol):
    def dead_letter(self, queue: Queue, entries: list[Entry], reason: str) -> None: ...


class MemoryMeter:
    """Bytes of message content held by queues, for connection.blocked.

    Bodies paged out to the store (``pager``, set by the broker when its store
    can page) are not counted.
    """

    __slots__ = ("used", "pager")

    def __init__(self) -> None:
        self.used = 0
        self.pager: Pager | None = None


# expired entries one take drops at most (a get, a delivery): past it the vhost's expiry
# slices go on (background.SLICE_ENTRIES a step)
EXPIRED_PER_TAKE = 2048


# discarded entries told as ranges from this many on (``Queue._discard``)
DISCARD_IN_RANGES = 64


def _in(ranges: Ranges, starts: list[int], position: int) -> bool:
    """Whether ``position`` lies in one of ``ranges`` (ascending; ``starts``: their firsts)."""
    i = bisect_right(starts, position) - 1
    return i >= 0 and position <= ranges[i][1]


def _split_head(level: deque[Entry], count: int, ranges: Ranges,
                starts: list[int]) -> tuple[deque[Entry], deque[Entry]]:
    """The first ``count`` entries off ``level``: (those at ``ranges``' positions, the
    others), each in their order."""
    taken: deque[Entry] = deque()
    kept: deque[Entry] = deque()
    for _ in range(count):
        entry = level.popleft()
        (taken if _in(ranges, starts, entry.position) else kept).append(entry)
    return taken, kept


def _not_the_copy(found: int, wanted: int, ranges: Ranges) -> ValueError:
    return ValueError(f"the copy holds {found} of the {wanted} positions purged "
                      f"({len(ranges)} ranges up to {ranges[-1][1]})")


class ReadyList:
    """Ready entries in order; one deque per priority level (1 when no x-max-priority)."""

    __slots__ = ("_levels", "_max", "_count")

    def __init__(self, max_priority: int = 0) -> None:
        self._max = max_priority
        self._levels: list[deque[Entry]] = [deque() for _ in range(max_priority + 1)]
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def prioritised(self) -> bool:
        """Whether entries are kept per priority level (x-max-priority), not in one."""
        return self._max > 0

    def _level(self, entry: Entry) -> deque[Entry]:
        return self._levels[min(entry.message.priority, self._max)]

    def append(self, entry: Entry) -> None:
        self._level(entry).append(entry)
        self._count += 1

    def extend(self, entries: list[Entry]) -> None:
        if self._max == 0:
            self._levels[0].extend(entries)
        else:
            for entry in entries:
                self._level(entry).append(entry)
        self._count += len(entries)

    def insert_in_order(self, entry: Entry) -> None:
        """Put an entry back at its original place (by position)."""
        level = self._level(entry)
        index = 0
        for index, other in enumerate(level):  # noqa: B007 - requeues land near the head
            if other.position > entry.position:
                break
        else:
            index = len(level)
        level.insert(index, entry)
        self._count += 1

    def remove(self, entry: Entry) -> None:
        self._level(entry).remove(entry)
        self._count -= 1

    def peek(self) -> Entry | None:
        for level in reversed(self._levels):
            if level:
                return level[0]
        return None

    def popleft(self) -> Entry:
        for level in reversed(self._levels):
            if level:
                self._count -= 1
                return level.popleft()
        raise IndexError("empty queue")

    def pop_oldest(self) -> Entry:
        """The head of the lowest priority level: what drop-head discards first."""
        for level in self._levels:
            if level:
                self._count -= 1
                return level.popleft()
        raise IndexError("empty queue")

    def clear(self) -> list[Entry]:
        out = [e for level in reversed(self._levels) for e in level]
        for level in self._levels:
            level.clear()
        self._count = 0
        return out

    def detach(self) -> list[deque[Entry]]:
        """Every entry at once, in O(1): the levels as they are (in delivery order); empty after."""
        levels = list(reversed(self._levels))
        self._levels = [deque() for _ in range(self._max + 1)]
        self._count = 0
        return levels

    def take_ranges(self, ranges: Ranges) -> list[deque[Entry]]:
        """The entries at ``ranges``' positions (ascending, disjoint), taken off: a
        backup's copy of a purge its primary made while entries were acquired there, or
        of a slice of an expiry or a trim off the head.

        One level only (no x-max-priority: its entries in position order). What is
        left is the entries before the last range that no range holds (acquired on
        the primary) and those after it (enqueued since, or not expired yet). The
        cost is the entries outside the last range on the shorter side: when few
        come after it (a purge) the last range is split off whole; when many do (a
        slice off the head of a deep queue) the entries up to it are taken from the
        head. ValueError, with nothing taken, unless the list holds an entry at each
        position of the ranges: a copy that is not the primary's.
        """
        if self._max:
            raise ValueError("a queue with priorities")
        level = self._levels[0]
        first, last = ranges[-1]
        starts = [lo for lo, _ in ranges]
        wanted = sum(hi - lo + 1 for lo, hi in ranges)
        tail = 0
        for entry in reversed(level):
            if entry.position <= last or tail > last - first + 1:
                break
            tail += 1
        if tail > last - first + 1:  # many after it: from the head up to it
            upto = 0
            found = 0
            for entry in level:
                if entry.position > last:
                    break
                upto += 1
                found += _in(ranges, starts, entry.position)
            if found != wanted:
                raise _not_the_copy(found, wanted, ranges)
            taken, kept = _split_head(level, upto, ranges, starts)
            kept.reverse()
            level.extendleft(kept)  # back at the head, in their order
            self._count -= len(taken)
            return [taken]
        head = 0
        for entry in level:
            if entry.position >= first:
                break
            head += 1
        middle = len(level) - head - tail
        in_head = sum(1 for entry in islice(level, head) if _in(ranges, starts, entry.position))
        if (middle != last - first + 1 or in_head + middle != wanted
                or level[head].position != first or level[head + middle - 1].position != last):
            raise _not_the_copy(in_head + max(middle, 0), wanted, ranges)
        taken, kept = _split_head(level, head, ranges, starts)
        after: deque[Entry] = deque()
        for _ in range(tail):
            after.appendleft(level.pop())
        kept.extend(after)
        self._levels[0] = kept
        self._count = len(kept)
        return [taken, level]

    def levels_copy(self) -> list[list[Entry]]:
        """Each priority level's entries (highest first), each in position order: copies of
        the references made at C speed (a replica check lists a deep queue at once,
        ha/check.py; iterating the list costs three times as much)."""
        return [list(level) for level in reversed(self._levels)]

    def __iter__(self) -> Iterator[Entry]:
        for level in reversed(self._levels):
            yield from level


class Queue:
    def __init__(
        self,
        vhost: str,
        name: str,
        *,
        durable: bool = False,
        exclusive_owner: object | None = None,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        hooks: QueueHooks | None = None,
        memory: MemoryMeter | None = None,
        clock: Callable[[], float],
        sink: DeadLetterSink | None = None,
    ) -> None:
        self.vhost = vhost
        self.name = name
        self.durable = durable
        self.exclusive_owner = exclusive_owner
        self.auto_delete = auto_delete
        self.arguments = dict(arguments or {})
        self.hooks = hooks if hooks is not None else QueueHooks()
        self.memory = memory or MemoryMeter()
        self.clock = clock
        self.sink = sink
        args = self.arguments
        self.message_ttl: int | None = args.get("x-message-ttl")
        self.expires: int | None = args.get("x-expires")
        self.max_length: int | None = args.get("x-max-length")
        self.max_length_bytes: int | None = args.get("x-max-length-bytes")
        self.overflow: str = args.get("x-overflow", "drop-head")
        self.dead_letter_exchange: str | None = args.get("x-dead-letter-exchange")
        self.dead_letter_routing_key: str | None = args.get("x-dead-letter-routing-key")
        self.ready = ReadyList(int(args.get("x-max-priority", 0) or 0))
        window = args.get(WINDOW_ARG)  # brokerha.broker.dedup; None costs one check per message
        self.dedup: DedupWindow | None = (
            DedupWindow(window, f"queue '{name}' in vhost '{vhost}'") if window else None)
        self.ready_bytes = 0
        # paging (brokerha.broker.paging): bytes of ready entries paged or about to be
        self.pager = self.memory.pager if durable else None
        self.paged_bytes = 0
        self.page_pending: list[Entry] = []
        self.page_scheduled = False
        self.unacked = 0
        self.published = 0  # entries added (metrics: messages in)
        self.delivered = 0  # entries handed to a consumer or basic.get (messages out)
        self.acked = 0  # entries settled (acknowledged, or taken without an ack)
        self.next_position = 1
        self.consumers: list[Consumer] = []
        self._rr = 0
        self.had_consumers = False
        self.last_used = clock()
        self.deleted = False
        self.on_unused: Callable[[Queue], None] | None = None  # auto-delete hook
        self._dispatching = False
        # set by the layer that orders this queue's enqueues and dequeues (a TxLog global
        # queue: brokerha/txlog/bridge/global_queues.py); see broker/queue.py
        self.ordering: QueueOrdering | None = None
        self._withdrawn: set[int] = set()  # acquired entries already dequeued elsewhere

    # -- introspection ---------------------------------------------------------

    @property
    def ordered(self) -> bool:
        """Its enqueues and dequeues are ordered by another layer (``broker/queue.py``)."""
        return self.ordering is not None

    @property
    def message_count(self) -> int:
        return len(self.ready)

    @property
    def consumer_count(self) -> int:
        return len(self.consumers)

    @property
    def dedup_dropped(self) -> int:
        """Publishes dropped as duplicates (x-deduplication-window)."""
        return self.dedup.dropped if self.dedup is not None else 0

    @property
    def has_timers(self) -> bool:
        return self.message_ttl is not None or self.expires is not None

    def __repr__(self) -> str:
        return f"Queue({self.vhost!r}, {self.name!r}, ready={len(self.ready)})"

    # -- enqueue -----------------------------------------------------------------

    def _expiry(self, message: Message, now: float) -> float | None:
        ttl = self.message_ttl
        if message.expiration_ms is not None:
            ttl = message.expiration_ms if ttl is None else min(ttl, message.expiration_ms)
        return None if ttl is None else now + ttl / 1000.0

    def enqueue(self, message: Message, *, deduplicate: bool = True) -> bool:
        """Put a routed message on the queue; False when the overflow policy refuses it.

        drop-head makes room by discarding the oldest entries; a limit of zero
        leaves no room at all, and then the new message itself is discarded
        (accepted, like RabbitMQ, but never delivered). A message whose id the
        deduplication window holds is dropped and accepted (it was stored
        already); the broker's own republishes (dead-lettering) pass
        ``deduplicate=False``.
        """
        if self.dedup is not None and deduplicate and self.dedup.drops(message):
            return True
        if self._full(message) and not self._make_room(message):
            if self.overflow != "drop-head":
                if self.overflow == "reject-publish-dlx":
                    self._dead_letter_new(message)
                return False
            self._dead_letter_new(message)
            return True
        entry = Entry(self.next_position, message, self._expiry(message, self.clock()))
        self.next_position += 1
        self.add_entry(entry)
        return True

    def add_entry(self, entry: Entry) -> Entry:
        """Append an entry whose position was assigned elsewhere (replication, recovery)."""
        if entry.position >= self.next_position:
            self.next_position = entry.position + 1
        self.published += 1
        if self.dedup is not None:
            self.dedup.remember(entry.message)
        for hook in self.hooks.enqueued:
            hook(self, entry)
        if self.consumers and not self.ready and not self._dispatching:
            # nothing waits ahead of it: hand it straight to a consumer with credit
            consumer = self._next_consumer()
            if consumer is not None:
                self._hand_to(consumer, entry)
                return entry
        self.ready.append(entry)
        size = entry.message.size
        self.ready_bytes += size
        self.memory.used += size
        if self.pager is not None:
            self.pager.added(self, entry, size)
        if self.consumers:
            self.dispatch()
        return entry

    @property
    def batchable(self) -> bool:
        """Its enqueues need no decision per message (no length limit, no deduplication):
        a transaction's go on as one batch (``enqueue_many``)."""
        return self.dedup is None and self.max_length is None and self.max_length_bytes is None

    def enqueue_many(self, messages: list[Message]) -> None:
        """A transaction's messages for this queue, in order, as one batch.

        The same as ``enqueue`` for each (a queue that is not ``batchable`` does
        just that), for less per message: the entries are made in one loop,
        observers with ``enqueued_many`` get one call, the ready list one extend.
        """
        if not self.batchable:
            for message in messages:
                self.enqueue(message)
            return
        now = self.clock()
        ttl = self.message_ttl
        position = self.next_position
        entries: list[Entry] = []
        append = entries.append
        for message in messages:
            expires = (None if ttl is None and message.expiration_ms is None
                       else self._expiry(message, now))
            append(Entry(position, message, expires))
            position += 1
        self.add_entries(entries)

    def add_entries(self, entries: list[Entry]) -> None:
        """``add_entry`` for a batch whose positions are assigned, ascending."""
        if not entries:
            return
        last = entries[-1].position
        if last >= self.next_position:
            self.next_position = last + 1
        self.published += len(entries)
        hooks = self.hooks
        for hook in hooks.enqueued_singly():
            for entry in entries:
                hook(self, entry)
        for many in hooks.enqueued_many:
            many(self, entries)
        if self.dedup is not None:
            for entry in entries:
                self.dedup.remember(entry.message)
        self.ready.extend(entries)
        memory = self.memory
        pager = self.pager
        if pager is None:
            size = 0
            for entry in entries:
                size += entry.message.size
            self.ready_bytes += size
            memory.used += size
        else:
            for entry in entries:
                size = entry.message.size
                self.ready_bytes += size
                memory.used += size
                pager.added(self, entry, size)
        if self.consumers:
            self.dispatch()

    def missing_positions(self, positions: list[int]) -> list[int]:
        """Which of ``positions`` no ready entry has (a backup checks a dequeue before applying it).

        Scans from the head and stops once all are found: dequeues are of the
        oldest messages, so this costs their distance from the head, not the
        queue's depth.
        """
        wanted = set(positions)
        if wanted:
            for entry in self.ready:
                wanted.discard(entry.position)
                if not wanted:
                    return []
        return [p for p in positions if p in wanted]

    def take_position(self, position: int) -> Entry | None:
        """Remove a ready entry by replication id and hold it as acquired (recovery)."""
        for entry in self.ready:
            if entry.position == position:
                if entry.paged == PAGED and self.pager is not None:
                    self.pager.fault(self, entry)
                self.ready.remove(entry)
                self._left_ready(entry)
                self.unacked += 1
                return entry
        return None

    def restore_entry(self, entry: Entry) -> None:
        """Put back an entry recovered from the store (no hooks: it is stored already)."""
        if entry.position >= self.next_position:
            self.next_position = entry.position + 1
        if self.dedup is not None:
            self.dedup.remember(entry.message)
        self.ready.append(entry)
        size = entry.message.size
        self.ready_bytes += size
        self.memory.used += size
        if self.pager is not None:
            self.pager.restored(self, entry, size)

    def _full(self, message: Message) -> bool:
        if self.max_length is not None and len(self.ready) >= self.max_length:
            return True
        return (self.max_length_bytes is not None
                and self.ready_bytes + len(message.body) > self.max_length_bytes)

    def _make_room(self, message: Message) -> bool:
        if self.overflow != "drop-head":
            return False
        self._drop_oldest(lambda: self._full(message), -1)
        return not self._full(message)

    def over_limit(self) -> bool:
        """More ready entries or bytes than ``max_length``/``max_length_bytes`` allow."""
        return ((self.max_length is not None and len(self.ready) > self.max_length)
                or (self.max_length_bytes is not None
                    and self.ready_bytes > self.max_length_bytes))

    def drop_head(self, budget: int) -> int:
        """Drop (dead-letter as ``maxlen``) at most ``budget`` of the oldest ready entries
        while the queue is ``over_limit``; how many. A policy that lowers a limit trims
        an existing queue with it, in slices (``broker/policy_effects.py``)."""
        return self._drop_oldest(self.over_limit, budget)

    def _drop_oldest(self, while_: Callable[[], bool], budget: int) -> int:
        dropped: list[Entry] = []
        while self.ready and len(dropped) != budget and while_():
            entry = self.ready.pop_oldest()
            self._left_ready(entry)
            dropped.append(entry)
        self._discard(dropped, "maxlen")
        return len(dropped)

    def _dead_letter_new(self, message: Message) -> None:
        """A message refused or discarded on arrival goes to the DLX without being queued."""
        if self.sink and self.dead_letter_exchange is not None:
            entry = Entry(0, message, None)
            self.sink.dead_letter(self, [entry], "maxlen")

    def _left_ready(self, entry: Entry) -> None:
        size = entry.message.size
        self.ready_bytes -= size
        if entry.paged:
            self.paged_bytes -= size
            if entry.paged == PAGED:
                self.memory.used += size  # a paged body was not counted
            else:
                entry.paged = 0  # pending: stays resident
        self.memory.used -= size

    # -- delivery ------------------------------------------------------------------

    def dispatch(self) -> None:
        """Hand ready entries to consumers with credit, round robin."""
        if self._dispatching:
            return
        self._dispatching = True
        try:
            consumers = self.consumers
            ready = self.ready
            while ready and consumers:
                consumer = self._next_consumer()
                if consumer is None:
                    break
                entry = self._take_head()
                if entry is None:
                    break
                self._hand_to(consumer, entry)
        finally:
            self._dispatching = False

    def _next_consumer(self) -> Consumer | None:
        consumers = self.consumers
        n = len(consumers)
        for i in range(n):
            candidate = consumers[(self._rr + i) % n]
            if candidate.can_take():
                self._rr = (self._rr + i + 1) % n
                return candidate
        return None

    def _take_head(self) -> Entry | None:
        """Pop the first unexpired entry (expired ones at the head are dropped, at most
        ``EXPIRED_PER_TAKE``: past that, None -- the rest expire in the vhost's slices,
        ``VirtualHost.tick``, which hand the head to consumers once it is live)."""
        ready = self.ready
        now = None
        dropped = 0
        while ready and dropped < EXPIRED_PER_TAKE:
            entry = ready.popleft()
            if entry.paged == PAGED:
                self.pager.fault(self, entry)  # type: ignore[union-attr]
            self._left_ready(entry)
            if entry.expires_at is not None:
                now = now or self.clock()
                if entry.expires_at <= now:
                    self._discard([entry], "expired")
                    dropped += 1
                    continue
            return entry
        return None

    def _hand_to(self, consumer: Consumer, entry: Entry) -> None:
        entry.delivery_count += 1
        self.delivered += 1
        self.unacked += 1
        for hook in self.hooks.acquired:
            hook(self, entry)
        consumer.deliver(self, entry)
        if consumer.no_ack:
            self.settle(entry)

    def get(self) -> Entry | None:
        """basic.get: the head entry, acquired."""
        self.last_used = self.clock()
        entry = self._take_head()
        if entry is not None:
            entry.delivery_count += 1
            self.delivered += 1
            self.unacked += 1
            for hook in self.hooks.acquired:
                hook(self, entry)
        return entry

    # -- settlement --------------------------------------------------------------------

    def settle(self, entry: Entry) -> None:
        """Acknowledged: the entry leaves the queue for good."""
        self.unacked -= 1
        self.acked += 1
        if self._withdrawn:
            self._withdrawn.discard(entry.position)
        for hook in self.hooks.dequeued:
            hook(self, entry)

    def requeue(self, entry: Entry) -> None:
        """Back to its original place, marked redelivered."""
        if entry.position in self._withdrawn:  # dequeued elsewhere meanwhile: drop it
            self.settle(entry)
            return
        self.unacked -= 1
        if self.deleted:
            return
        entry.redelivered = True
        self.ready.insert_in_order(entry)
        size = entry.message.size
        self.ready_bytes += size
        self.memory.used += size
        for hook in self.hooks.requeued:
            hook(self, entry)

    def withdraw(self, position: int) -> bool:
        """Dequeue by replication id, wherever the entry is (a global queue's ordered dequeue).

        A ready entry leaves now; an acquired one leaves when its holder settles
        or requeues it (a requeue then drops it). False when no ready entry has
        that position (acquired entries are marked all the same).
        """
        entry = self.take_position(position)
        if entry is None:
            self._withdrawn.add(position)
            return False
        self.settle(entry)
        return True

    def withdrawn(self, entry: Entry) -> bool:
        """An acquired entry that an ordered dequeue already removed elsewhere."""
        return entry.position in self._withdrawn

    def own_withdrawal(self, entry: Entry) -> None:
        """The ordered dequeue that withdrew this held entry was its holder's own.

        So the holder's settlement is not void: a reject without requeue
        dead-letters the message here, in the datacenter whose consumer rejected it.
        """
        self._withdrawn.discard(entry.position)

    def reject(self, entry: Entry) -> None:
        """Rejected without requeue: dead-lettered if the queue has a DLX, else dropped."""
        if entry.position in self._withdrawn:
            self.settle(entry)
            return
        self.unacked -= 1
        self._discard([entry], "rejected")

    def _discard(self, entries: list[Entry], reason: str) -> None:
        """Entries gone from the queue (expired, dropped over a length limit, rejected):
        observers told, then dead-lettered. Many at once (a slice of an expiry or a
        trim, ``DISCARD_IN_RANGES`` or more, off a queue without priorities: in position
        order) go to the observers that take ranges as one ``purged`` (the store: one
        operation; an HA primary: one event, not a dequeue each), to the others singly."""
        if not entries:
            return
        if self.pager is not None and self.sink and self.dead_letter_exchange is not None:
            self.pager.fault_removed(self, entries)  # before the store forgets them
        hooks = self.hooks
        if len(entries) >= DISCARD_IN_RANGES and hooks.purged and not self.ready.prioritised:
            ranges: Ranges = []
            extend_runs(ranges, entries)
            for purged in hooks.purged:
                purged(self, ranges)
            singly = hooks.dequeued_singly()
        else:
            singly = hooks.dequeued
        for entry in entries:
            for hook in singly:
                hook(self, entry)
        if self.sink and self.dead_letter_exchange is not None:
            self.sink.dead_letter(self, entries, reason)

    # -- maintenance -------------------------------------------------------------------

    def expire(self, now: float, budget: int | None = None) -> bool:
        """Drop expired entries at the head (RabbitMQ expires from the head only), at
        most ``budget`` (None: all); True if the head is still expired after, for the
        caller to go on in slices (``VirtualHost.tick``: a million messages of one big
        TX, or recovered after a long stop, expire at once). Consumers the drops
        uncovered ready entries for get them."""
        ready = self.ready
        expired: list[Entry] = []
        while len(expired) != budget and self._head_expired(now):
            head = ready.popleft()
            self._left_ready(head)
            expired.append(head)
        self._discard(expired, "expired")
        more = self._head_expired(now)
        if expired and not more and self.consumers:
            self.dispatch()
        return more

    def _head_expired(self, now: float) -> bool:
        head = self.ready.peek()
        return head is not None and head.expires_at is not None and head.expires_at <= now

    def unused_since(self, now: float) -> float | None:
        """Seconds unused, for x-expires; None while it has consumers."""
        if self.consumers:
            return None
        return now - self.last_used

    def purge(self) -> int:
        """queue.purge, all of it now (see ``begin_purge``); the count."""
        return self.begin_purge().finish()

    def begin_purge(self) -> ReadyDrain[Queue]:
        """queue.purge: every ready entry leaves now; the rest is the returned work's.

        The queue is empty from this instant (acquired entries stay: a purge
        takes only ready ones). Observers with ``purged`` get it in one call
        (the store: one operation) and no ``dequeued`` for these entries; the
        others get ``dequeued`` per entry, as the work runs (``broker/drain.py``).
        """
        hooks = self.hooks
        return ReadyDrain(self, self._detach_ready(), purged=list(hooks.purged),
                          dequeued=hooks.dequeued_singly()).start()

    def begin_purge_ranges(self, ranges: Ranges) -> ReadyDrain[Queue]:
        """A backup's copy of a purge its primary made while entries were acquired, or of
        a slice of an expiry or a trim (the ``pr`` event): the entries at ``ranges``'
        positions leave now, as ``begin_purge``'s (the store records one purge of these
        ranges), the others stay (``ReadyList.take_ranges``: ValueError if the copy is
        not the primary's)."""
        levels = self.ready.take_ranges(ranges)
        starts = [lo for lo, _ in ranges]
        for entry in self.page_pending:
            if entry.paged == PENDING and _in(ranges, starts, entry.position):
                entry.paged = RESIDENT  # off the queue: the pager leaves it alone
        taken = sum(len(level) for level in levels)
        if taken <= len(self.ready):  # a slice off the head: count what left
            for level in levels:
                for entry in level:
                    self.ready_bytes -= entry.message.size
                    if entry.paged:
                        self.paged_bytes -= entry.message.size
        else:  # a purge: count the few left (acquired on the primary, or newer)
            self.ready_bytes = self.paged_bytes = 0
            for entry in self.ready:
                self.ready_bytes += entry.message.size
                if entry.paged:
                    self.paged_bytes += entry.message.size
        hooks = self.hooks
        return ReadyDrain(self, levels, purged=list(hooks.purged),
                          dequeued=hooks.dequeued_singly(), ranges=ranges).start()

    def _detach_ready(self) -> list[deque[Entry]]:
        """Take every ready entry off (O(1) but for bodies waiting to be paged out)."""
        levels = self.ready.detach()
        self.ready_bytes = 0
        self.paged_bytes = 0
        for entry in self.page_pending:
            if entry.paged == PENDING:
                entry.paged = RESIDENT  # off the queue: the pager leaves it alone
        return levels

    # -- consumers ---------------------------------------------------------------------

    def check_consumer(self, exclusive: bool) -> None:
        """Refuse (403) a consumer that an exclusive consumer rules out."""
        if any(c.exclusive for c in self.consumers) or (exclusive and self.consumers):
            raise AccessRefused(f"queue '{self.name}' in vhost '{self.vhost}' in exclusive use")

    def add_consumer(self, consumer: Consumer) -> None:
        self.check_consumer(consumer.exclusive)
        self.consumers.append(consumer)
        self.had_consumers = True
        self.last_used = self.clock()
        self.dispatch()

    def remove_consumer(self, consumer: Consumer) -> None:
        try:
            self.consumers.remove(consumer)
        except ValueError:
            return
        self.last_used = self.clock()
        if self.auto_delete and not self.consumers and self.on_unused is not None:
            self.on_unused(self)

    def delete(self, background: Background | None = None) -> int:
        """Mark deleted, drop ready entries, tell consumers; returns the ready count.

        Observers get no ``dequeued`` for the ready entries: ``queue_deleted``
        covers them. Letting go of them is done by ``background`` in slices
        (``broker/drain.py``), or now without one.
        """
        self.deleted = True
        drain = ReadyDrain(self, self._detach_ready())
        consumers, self.consumers = self.consumers, []
        for consumer in consumers:
            consumer.cancelled_by_server(self)
        if background is None:
            return drain.finish()
        background.run(drain)
        return drain.count
