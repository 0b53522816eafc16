"""ReplicatingSubscription (seed 002): one queue, replicated to one backup.

At the join it compares the queue with what the backup says it holds: ids
only the backup has are dropped, ids both have are skipped (the *skip set*),
the rest is sent with its content. Entries acquired by consumers are still on
the queue until they are acknowledged, so they are sent too.

A backup applies enqueues by appending, so its queue stays in position order
only if nothing it keeps lies after something it lacks. That happens only
when the backup's history diverged (a deposed primary's unreplicated work):
then what it keeps past the first gap is dropped and sent again.

Streamed (``catch_up.py``): the events are made as the catch-up is sent, from
the queue as it is then, below its ``QueueGuard`` position (everything above
it goes out live, after the join). An entry taken off the queue since the
join may be sent or not: the live dequeue that follows the catch-up removes
it on the backup either way, and a dequeue of an entry the backup lacks does
nothing (``QueueReplicator.dequeue``). So the queue's state at the join need
not be copied at the join: a deep queue costs the join nothing.

Runs (issue 33): messages at consecutive positions without expiry are sent as
``er`` events, at least ``run_min`` and at most ``run_max`` messages (and
``run_bytes``: a quarter of a catch-up slice, ``Pace.run_bytes``) each, their
contents packed once in the store's run format, which the backup stores as it
is (``cluster/replication.py``).
A run is cut at every gap in the positions: the backup numbers its messages
``first``, ``first + 1``, ... (``Unsafe.runs_across_gaps`` does not cut it: the
messages after a gap get the positions of others, and a later dequeue takes
the wrong one).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter

from brokerha.broker.message import Entry, Message
from brokerha.broker.paging import PAGED
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R
from brokerha.cluster.ranges import RangeSet
from brokerha.primary import events as ev
from brokerha.primary.events import Event
from brokerha.store.batch import RUN_MAX, RUN_MAX_BYTES, RUN_MIN

BodyReader = Callable[[str, str, list[int]], dict[int, tuple[bytes, bytes]]]

DROPS_PER_EVENT = 8192
READ_BATCH = 256
# entries looked at without an event to show for it (skipped: the backup has them)
# before the walk yields None, so that whoever pulls it can stop for this turn
WORK_PER_YIELD = 4096
RUN_ITEM_FRAMING = 12  # msgpack's bytes around one message of a packed run, at most

_position = attrgetter("position")


def queue_entries(queue: Queue, acquired: Iterable[Entry], below: int) -> Iterator[Entry]:
    """The queue's entries (ready, and acquired but not acknowledged) below ``below``, in
    position order: a copy of the ready list's references taken now (C speed, ~35 ms for
    2,000,000 entries), so that the queue may change while it is walked."""
    ready = list(queue.ready)
    if queue.arguments.get("x-max-priority"):
        ready.sort(key=_position)  # one run per priority level, merged
    held = sorted(acquired, key=_position)
    merged = heapq.merge(ready, held, key=_position) if held else iter(ready)
    return itertools.takewhile(lambda e: e.position < below, merged)


def _held_positions(held: RangeSet) -> Iterator[int]:
    return itertools.chain.from_iterable(range(a, b + 1) for a, b in held.runs())


class _Run:
    """Messages waiting to go as one ``er`` event: consecutive positions, no expiry."""

    __slots__ = ("first", "messages", "size")

    def __init__(self) -> None:
        self.first = 0
        self.messages: list[Message] = []
        self.size = 0  # its packed bytes, about


class ReplicatingSubscription:
    def __init__(self, queue: Queue, held: RangeSet, run_min: int = RUN_MIN,
                 run_max: int = RUN_MAX, run_bytes: int = RUN_MAX_BYTES,
                 runs_across_gaps: bool = False,
                 part_bytes: int = ev.BODY_PART_BYTES) -> None:
        self.queue = queue
        self.held = held
        self.part_bytes = part_bytes  # a body over this goes in parts (events.in_parts)
        # runs of run_min..run_max messages, of run_bytes at most (bodies and headers), go
        # as ``er`` events (run_min 0: never, each its ``e``)
        self.run_min = run_min
        self.run_max = run_max
        self.run_bytes = run_bytes
        self.runs_across_gaps = runs_across_gaps  # Unsafe: a run is not cut at a gap
        self.runs = 0  # ``er`` events made
        self.sent = 0
        self.skipped = 0
        self.dropped = 0
        self.gone = 0  # taken off the queue (and out of the store) before it could be sent
        self.bytes = 0  # message bodies and headers sent

    def events(self, entries: Iterable[Entry], clock: Callable[[], float],
               read_bodies: BodyReader) -> Iterator[Event | None]:
        """The events that bring the backup's copy of the queue to ``entries``.

        ``entries``: the queue in position order (``queue_entries``). One merge
        walk of the entries against the backup's runs; ``None`` now and then
        when only skipping (see ``WORK_PER_YIELD``).
        """
        held = _held_positions(self.held)
        nxt = next(held, None)
        drops: list[int] = []
        batch: list[Entry] = []
        idle = 0
        entries = iter(entries)
        for e in entries:
            p = e.position
            while nxt is not None and nxt < p:  # the backup holds it, the queue does not
                drops.append(nxt)
                nxt = next(held, None)
                if len(drops) >= DROPS_PER_EVENT:
                    yield self._drop(drops)
                    drops = []
            if nxt == p:  # both have it: kept
                self.skipped += 1
                nxt = next(held, None)
                idle += 1
                if idle >= WORK_PER_YIELD:
                    idle = 0
                    yield None
                continue
            # the first entry the backup lacks: from here everything is sent, and what
            # the backup holds past it is dropped first (what is on the queue comes again)
            batch.append(e)
            if nxt is not None:
                drops.append(nxt)
            yield from self._drops(itertools.chain(drops, held))
            drops = []
            nxt = None
            break
        run = _Run()  # may span read batches: flushed before anything else is made
        for e in entries:  # past the first gap: everything
            batch.append(e)
            if len(batch) >= READ_BATCH:
                yield from self._send(batch, clock(), read_bodies, run)
                batch = []
        if batch:
            yield from self._send(batch, clock(), read_bodies, run)
        yield from self._flush(run)
        if nxt is not None:  # no gap: what the backup holds past the queue's last entry
            drops.append(nxt)
        yield from self._drops(itertools.chain(drops, held))

    def _drop(self, positions: list[int]) -> Event:
        self.dropped += len(positions)
        return ev.dequeued(self.queue, positions)

    def _drops(self, positions: Iterator[int]) -> Iterator[Event]:
        while True:
            chunk = list(itertools.islice(positions, DROPS_PER_EVENT))
            if not chunk:
                return
            yield self._drop(chunk)

    def _send(self, batch: list[Entry], now: float, read_bodies: BodyReader,
              run: _Run) -> Iterator[Event]:
        q = self.queue
        contents = self._paged_contents(batch, read_bodies)
        runs = self.run_min > 0
        for e in batch:
            content: Message | None = e.message
            if e.paged == PAGED:
                content = contents.get(e.position)
                if content is None:  # dequeued since the join: the live dequeue follows
                    self.gone += 1
                    continue
            assert content is not None
            self.sent += 1
            size = len(content.body) + len(content.header)
            self.bytes += size
            # its room in a packed run: the names and msgpack's framing too
            size += len(content.exchange) + len(content.routing_key) + RUN_ITEM_FRAMING
            if runs and e.expires_at is None and size <= self.run_bytes:
                messages = run.messages
                if messages and (len(messages) >= self.run_max
                                 or run.size + size > self.run_bytes
                                 or (e.position != run.first + len(messages)
                                     and not self.runs_across_gaps)):
                    yield from self._flush(run)
                    messages = run.messages
                if not messages:
                    run.first = e.position
                messages.append(content)
                run.size += size
                continue
            yield from self._flush(run)
            yield from ev.in_parts(ev.enqueued(q, e, now, content), self.part_bytes)

    def _flush(self, run: _Run) -> Iterator[Event]:
        """The run so far: one ``er`` event, or an ``e`` each when shorter than ``run_min``."""
        messages = run.messages
        if not messages:
            return
        q = self.queue
        if len(messages) >= self.run_min:
            self.runs += 1
            yield ev.enqueued_run(q, run.first, messages)
        else:
            for i, m in enumerate(messages):
                yield R.Enqueued(R.ENQUEUED, q.vhost, q.name, run.first + i, m.exchange,
                                 m.routing_key, m.header, m.body, None)
        run.messages = []
        run.size = 0

    def _paged_contents(self, batch: list[Entry], read_bodies: BodyReader) -> dict[int, Message]:
        """Bodies paged out to the store, read back for sending (the entries stay paged).

        An entry dequeued since it was listed may be gone from the store: absent here.
        """
        paged = [e for e in batch if e.paged == PAGED]
        if not paged:
            return {}
        bodies = read_bodies(self.queue.vhost, self.queue.name, [e.position for e in paged])
        out = {}
        for e in paged:
            found = bodies.get(e.position)
            if found is None:
                continue
            header, body = found
            m = e.message
            out[e.position] = Message(m.exchange, m.routing_key, header, body, msg_id=m.msg_id)
        return out
