"""ReplicatingSubscription (seed 002): one queue, replicated to one backup.

At the join it compares the queue with what the backup says it holds: ids
only the backup has are dropped, ids both have are skipped (the *skip set*,
which transactions will extend with what a tx-queue already carried), the rest
is sent with its content. Entries acquired by consumers are still on the queue
until they are acknowledged, so they are sent too.

A backup applies enqueues by appending, so its queue stays in position order
only if nothing it keeps lies after something it lacks. That happens only
when the backup's history diverged (a deposed primary's unreplicated work):
then what it keeps past the first gap is dropped and sent again.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable

from brokerha.broker.message import Entry, Message
from brokerha.broker.paging import PAGED
from brokerha.broker.queue import Queue
from brokerha.cluster.ranges import RangeSet, to_ranges
from brokerha.primary import events as ev
from brokerha.primary.events import Event

BodyReader = Callable[[str, str, list[int]], dict[int, tuple[bytes, bytes]]]

DROPS_PER_EVENT = 8192
READ_BATCH = 256


def _position(entry: Entry) -> int:
    return entry.position


def _first_gap(positions: list[int], runs: list[tuple[int, int]]) -> int:
    """The index of the first position (sorted) that no run covers; len if none."""
    i, n = 0, len(positions)
    for a, b in runs:
        if i >= n:
            return n
        if positions[i] < a:
            return i
        i = bisect_right(positions, b, i)
    return i


class ReplicatingSubscription:
    def __init__(self, queue: Queue, held: RangeSet) -> None:
        self.queue = queue
        self.held = held
        self.skip_set = RangeSet([])
        self.sent = 0
        self.skipped = 0
        self.dropped = 0

    def catch_up(self, entries: list[Entry], now: float, read_bodies: BodyReader) -> list[Event]:
        """The events that bring the backup's copy of the queue to ``entries``.

        ``entries``: everything on the queue (ready and acquired), any order.
        Worked out by runs, not by position: a backup that holds a deep queue
        it already has costs a sort (linear on a queue in order) and a bisect
        per run of its inventory, so answering its join does not stall the
        primary's loop (hundreds of milliseconds for 200,000 messages when
        every position was looked up).
        """
        q = self.queue
        entries = sorted(entries, key=_position)
        positions = [e.position for e in entries]
        runs = self.held.runs()
        # every entry before the first one the backup lacks is kept (skipped); from
        # there on everything is sent again, and what the backup holds past it dropped
        gap = _first_gap(positions, runs)
        drops: list[int] = []
        skips: list[list[int]] = []
        for a, b in runs:
            lo = bisect_left(positions, a, 0, gap)
            hi = bisect_right(positions, b, lo, gap)
            if hi - lo == b - a + 1:
                skips.append([a, b])  # the whole run is on the queue: kept as it is
                continue
            kept = positions[lo:hi]
            skips.extend(to_ranges(kept))
            present = set(kept)
            drops.extend(p for p in range(a, b + 1) if p not in present)
        sends = entries[gap:]
        self.skip_set = RangeSet(skips)
        self.dropped, self.skipped, self.sent = len(drops), len(self.skip_set), len(sends)
        out: list[Event] = [ev.dequeued(q, drops[i:i + DROPS_PER_EVENT])
                            for i in range(0, len(drops), DROPS_PER_EVENT)]
        for i in range(0, len(sends), READ_BATCH):
            batch = sends[i:i + READ_BATCH]
            contents = self._paged_contents(batch, read_bodies)
            out.extend(ev.enqueued(q, e, now, contents.get(e.position)) for e in batch)
        return out

    def _paged_contents(self, batch: list[Entry], read_bodies: BodyReader) -> dict[int, Message]:
        """Bodies paged out to the store, read back for sending (the entries stay paged)."""
        paged = [e for e in batch if e.paged == PAGED]
        if not paged:
            return {}
        bodies = read_bodies(self.queue.vhost, self.queue.name, [e.position for e in paged])
        out = {}
        for e in paged:
            header, body = bodies[e.position]
            m = e.message
            out[e.position] = Message(m.exchange, m.routing_key, header, body, msg_id=m.msg_id)
        return out
