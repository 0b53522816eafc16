"""The ready entries a purge or a delete took off a queue at once, let go of in slices.

``Queue.purge`` and ``Queue.delete`` detach the whole ready list in O(1)
(``ReadyList.detach``): from that instant the queue is empty to every client,
its byte counts are zero, and nothing can deliver those entries again. What is
left per entry is a ``ReadyDrain`` (a ``background.SlicedWork``):

1. (a purge with acquired entries on the queue) the purged positions as
   ranges, for observers that take a purge in one call (``purged``);
2. ``purged(queue, ranges)`` on those observers -- the store records one
   operation, so a crash in the middle never brings purged messages back; the
   HA primary sends one event, or its positions (``Primary.purged``) --
   unless the queue was deleted meanwhile (its deletion covers them);
3. per entry: ``dequeued`` on the other observers, the node's memory meter,
   and dropping the entry (freeing a million entries is itself a stall of a
   second).

A delete does only step 3, without observers: ``queue_deleted`` tells them.

With no acquired entry on the queue (``Queue.unacked == 0``) every stored
message of the queue is a purged one, so the ranges are known at once:
everything below ``next_position``. Otherwise they are the runs of the
detached positions (by level: unsorted across priority levels), and no
acquired entry's position is in one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, islice
from typing import Generic, Protocol, TypeVar

from brokerha.broker.message import Entry
from brokerha.broker.paging import PAGED

Ranges = list[tuple[int, int]]


def extend_runs(runs: Ranges, entries: Iterable[Entry]) -> int:
    """Add the entries' positions (ascending, after ``runs``' own) to ``runs`` as runs
    ``(first, last)``, a run going on across calls; how many entries there were."""
    seen = 0
    for entry in entries:
        seen += 1
        p = entry.position
        if runs and runs[-1][1] == p - 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return seen


class _Meter(Protocol):
    used: int


class DrainedQueue(Protocol):
    """What a drain reads of its queue (``broker/queue.py``'s ``Queue``, which imports
    this module: a Protocol rather than an import back up)."""

    @property
    def deleted(self) -> bool: ...
    @property
    def unacked(self) -> int: ...
    @property
    def next_position(self) -> int: ...
    @property
    def memory(self) -> _Meter: ...


Q = TypeVar("Q", bound=DrainedQueue)


class ReadyDrain(Generic[Q]):
    """Detached ready entries of ``queue`` (in delivery order), processed ``budget`` at a time."""

    def __init__(self, queue: Q, levels: list[deque[Entry]], *,
                 purged: list[Callable[[Q, Ranges], None]] | None = None,
                 dequeued: list[Callable[[Q, Entry], None]] | None = None,
                 ranges: Ranges | None = None) -> None:
        """``ranges``: the entries' positions, when the caller knows them (a backup's
        copy of a purge, ``Queue.begin_purge_ranges``); otherwise found here."""
        self.queue = queue
        self.count = sum(len(level) for level in levels)
        self.remaining = self.count
        self._levels = deque(level for level in levels if level)
        self._purged = purged or []
        self._dequeued = dequeued or []
        self.ranges: Ranges | None = ranges
        self._scan: Iterator[Entry] | None = None
        self._runs: Ranges = []
        if self._purged and self.count and ranges is None:
            if queue.unacked == 0:
                self.ranges = [(0, queue.next_position - 1)]
            else:
                self._scan = chain.from_iterable(list(self._levels))
        self.steps = 0

    def start(self) -> ReadyDrain[Q]:
        """What can be done at once: the ``purged`` observers, if the ranges are known."""
        if self.ranges is not None and self._purged:
            self._tell_purged()
        return self

    def step(self, budget: int) -> bool:
        """At most ``budget`` entries of work; True once all is done."""
        self.steps += 1
        if self._scan is not None:
            self._find_runs(budget)
            return False
        if self._purged:
            self._tell_purged()
            return not self._levels
        return self._release(budget)

    def finish(self) -> int:
        """Everything at once (a caller without slices); the count."""
        while not self.step(1 << 62):
            pass
        return self.count

    # -- 1. the ranges ----------------------------------------------------------------

    def _find_runs(self, budget: int) -> None:
        assert self._scan is not None
        if extend_runs(self._runs, islice(self._scan, budget)) < budget:  # the scan is over
            self._scan = None
            self.ranges, self._runs = self._runs, []

    # -- 2. observers that take the purge in one call -----------------------------------

    def _tell_purged(self) -> None:
        hooks, self._purged = self._purged, []
        if self.queue.deleted or self.ranges is None:
            return  # deleted meanwhile: its deletion removed every stored message of it
        for hook in hooks:
            hook(self.queue, self.ranges)

    # -- 3. per entry ----------------------------------------------------------------

    def _release(self, budget: int) -> bool:
        levels = self._levels
        queue = self.queue
        hooks = self._dequeued
        freed = 0
        done = 0
        while levels and done < budget:
            level = levels[0]
            n = min(budget - done, len(level))
            for _ in range(n):
                entry = level.popleft()
                if entry.paged != PAGED:  # a paged body was not counted
                    freed += entry.message.size
                for hook in hooks:
                    hook(queue, entry)
            done += n
            if not level:
                levels.popleft()
        queue.memory.used -= freed
        self.remaining -= done
        return not levels

