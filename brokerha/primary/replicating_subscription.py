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
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter

from brokerha.broker.message import Entry, Message
from brokerha.broker.paging import PAGED
from brokerha.broker.queue import Queue
from brokerha.cluster.ranges import RangeSet
from brokerha.primary import events as ev
from brokerha.primary.events import Event

BodyReader = Callable[[str, str, list[int]], dict[int, tuple[bytes, bytes]]]

DROPS_PER_EVENT = 8192
READ_BATCH = 256
# entries looked at without an event to show for it (skipped: the backup has them)
# before the walk yields None, so that whoever pulls it can stop for this turn
WORK_PER_YIELD = 4096

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


class ReplicatingSubscription:
    def __init__(self, queue: Queue, held: RangeSet,
                 part_bytes: int = ev.BODY_PART_BYTES) -> None:
        self.queue = queue
        self.held = held
        self.part_bytes = part_bytes  # a body over this goes in parts (events.in_parts)
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
        for e in entries:  # past the first gap: everything
            batch.append(e)
            if len(batch) >= READ_BATCH:
                yield from self._send(batch, clock(), read_bodies)
                batch = []
        if batch:
            yield from self._send(batch, clock(), read_bodies)
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

    def _send(self, batch: list[Entry], now: float, read_bodies: BodyReader) -> Iterator[Event]:
        q = self.queue
        contents = self._paged_contents(batch, read_bodies)
        for e in batch:
            content: Message | None = e.message
            if e.paged == PAGED:
                content = contents.get(e.position)
                if content is None:  # dequeued since the join: the live dequeue follows
                    self.gone += 1
                    continue
            assert content is not None
            self.sent += 1
            self.bytes += len(content.body) + len(content.header)
            yield from ev.in_parts(ev.enqueued(q, e, now, content), self.part_bytes)

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
