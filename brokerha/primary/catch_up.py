"""A join's catch-up, streamed: made as it is sent, in bounded slices, behind a window.

The primary answers a join with the configuration at the join (made at
once: it is small), then each queue's ``ReplicatingSubscription`` walk (made
lazily, from the queue as it is when its turn comes, below its
``QueueGuard`` position), then the transactions' and other layers' state at
the join, and the ``CaughtUp`` marker; live events, numbered after the join's
seq, wait behind it in the session's outbox. Nothing of it exists before it
is sent, so a join costs the primary's loop nothing that grows with the
queues, and memory stays bounded by the window:

- a slice: each flush (one per loop turn) makes at most ``SLICE_BYTES`` of
  events (and ``SLICE_WORK`` entries looked at), so the loop goes on serving
  clients, heartbeats and the other backups between slices;
- a window (flow control, as Kafka's fetch size or Raft's chunked
  InstallSnapshot): at most ``WINDOW_BYTES`` sent and not acknowledged; the
  backup's acknowledgements (after its store synced) open it again, so the
  catch-up runs at the pace of the backup's disk and never piles up in the
  primary's socket buffers.

Numbering: the catch-up's events are numbered from ``join_seq -
CATCH_UP_SPAN`` up, consecutively (how many there are is known only at the
end); the marker names ``join_seq`` and the backup's applied seq moves to it
(``Backup.receive``), so live events go on from ``join_seq + 1``.
Acknowledgements below ``join_seq`` only report catch-up progress, as before.

``Unsafe.monolithic_catch_up`` (``ha/core.py``, simulations only) makes one
slice of everything, as the catch-up used to be: the simulation's stability
invariant must catch it (the primary's loop stalls past its lease).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from brokerha.cluster import replication as R
from brokerha.primary.events import Event, event_size
from brokerha.primary.queue_guard import QueueGuard
from brokerha.store.batch import RUN_MAX, RUN_MAX_BYTES, RUN_MIN

CATCH_UP_SPAN = 1 << 48
SLICE_BYTES = 1 << 20
SLICE_WORK = 16384
WINDOW_BYTES = 8 << 20


@dataclass(frozen=True)
class Pace:
    """How much of a catch-up one flush makes, and how much may be unacknowledged."""

    slice_bytes: float = SLICE_BYTES
    slice_work: float = SLICE_WORK
    window_bytes: float = WINDOW_BYTES
    # a queue's messages at consecutive positions go as runs (``er``) of run_min..run_max
    # (replicating_subscription.py); 0: each its own ``e``
    run_min: int = RUN_MIN
    run_max: int = RUN_MAX

    @property
    def run_bytes(self) -> int:
        """A run's bytes at most: a quarter of a slice (a run is made whole, so a slice
        passes its bound by at most that), and no more than the store's run."""
        return int(min(RUN_MAX_BYTES, self.slice_bytes / 4))

    @classmethod
    def unbounded(cls) -> Pace:
        """Everything in one go (``Unsafe.monolithic_catch_up``)."""
        return cls(math.inf, math.inf, math.inf)


class CatchUp:
    def __init__(self, join_seq: int, head: list[Event],
                 queues: list[tuple[QueueGuard, Iterable[Event | None]]],
                 tail: list[Event], seq_now: Callable[[], int] | None = None) -> None:
        self.join_seq = join_seq
        # A queue is walked as it is when its turn comes, after live events the backup
        # applies only behind the catch-up: its copy is consistent once it applied
        # everything up to the primary's seq at the last read of the last queue (a
        # message a transaction took off a queue after the join, and that the walk no
        # longer finds, is restored by nothing if that transaction is lost with the
        # primary). The marker carries that seq (``valid_at``).
        self.valid_at = join_seq
        self._seq_now = seq_now or (lambda: join_seq)
        self.first_seq = join_seq - CATCH_UP_SPAN
        self.next_seq = self.first_seq  # the seq of the next event made
        self.done = False
        self._walking = False  # a queue's walk is under way (its reads move valid_at)
        self._stream = self._all(head, queues, tail)

    def _all(self, head: list[Event], queues: list[tuple[QueueGuard, Iterable[Event | None]]],
             tail: list[Event]) -> Iterator[Event | None]:
        yield from head
        seq_now = self._seq_now
        for guard, events in queues:
            self._walking = True
            yield from events  # valid_at moves at the end of each take() that read the queue
            self._walking = False
            self.valid_at = max(self.valid_at, seq_now())
            guard.ready_seq = self.next_seq - 1
        yield from tail
        yield R.CaughtUp(R.CAUGHT_UP, self.join_seq, self.valid_at)

    def take(self, max_bytes: float, max_events: int, max_work: float) -> tuple[list[Event], int]:
        """The next events (at least one if any is left and ``max_work`` >= 1), and the work
        it took (events made, and entries looked at that made none)."""
        out: list[Event] = []
        size = work = 0
        for event in self._stream:
            work += 1
            if event is not None:
                out.append(event)
                self.next_seq += 1  # before the stream goes on: a guard reads it
                size += event_size(event)
                if event[0] == R.CAUGHT_UP:
                    self.done = True
                    break
            if len(out) >= max_events or size >= max_bytes or work >= max_work:
                break
        else:
            self.done = True
        if self._walking:
            # the seq after this take's reads of the queue: the primary's seq cannot move
            # while one take runs (the loop's thread), so once here is as after each read
            self.valid_at = max(self.valid_at, self._seq_now())
        return out, work
