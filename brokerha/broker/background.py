"""Work a client's operation leaves behind, done in bounded slices between loop turns.

On an HA primary any stall of the event loop longer than the lease (0.4 s)
costs it its role (docs/ha.md), and a purge or delete of a deep queue has a
million entries to let go of. What the client sees happens at once (the
queue is empty, the store has recorded the purge as one operation); what
remains per entry (observers' ``dequeued``, memory accounting, freeing the
entries) is a ``SlicedWork`` handed to the broker's ``Background``, which
runs it in slices of at most ``SLICE_ENTRIES`` entries per step and
``SLICE_SECONDS`` per loop turn, in the order the works were handed over.

The node installs ``schedule`` (``loop.call_soon``); without it (tests,
tools, a broker with no loop) every work runs to its end at once, as before.

While the broker holds its publishers (``broker/flow.py``: on an HA primary,
a backup has not acknowledged for ``flow_lag``), no slice runs: a purge's
dequeues are replication traffic too, and the backups apply them slower
than the primary makes them; the work goes on once the flow is released.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

SLICE_ENTRIES = 2048  # entries one step processes at most
SLICE_SECONDS = 0.02  # steps in one loop turn stop after this long


class SlicedWork(Protocol):
    def step(self, budget: int) -> bool:
        """Process at most ``budget`` entries; True once nothing is left."""
        ...


class Background:
    """A FIFO of sliced works; ``after`` runs a callback once those before it finished."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 entries: int = SLICE_ENTRIES, seconds: float = SLICE_SECONDS) -> None:
        self.schedule: Callable[[Callable[[], None]], Any] | None = None  # loop.call_soon
        self.clock = clock
        self.entries = entries
        self.seconds = seconds
        self._works: deque[tuple[SlicedWork | None, Callable[[], None] | None]] = deque()
        self._scheduled = False
        self.held = False  # the broker's publishers are held: no slice runs
        self.slices = 0  # loop turns given to background work (tests, metrics)

    @property
    def pending(self) -> int:
        """Works (and callbacks) not finished yet."""
        return len(self._works)

    def run(self, work: SlicedWork) -> None:
        """Do ``work`` in slices after what is pending (at once when there is no loop)."""
        if self.schedule is None:
            while not work.step(self.entries):
                pass
            return
        self._works.append((work, None))
        self._wake()

    def after(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every work handed over so far is done (now if none is)."""
        if not self._works:
            callback()
            return
        self._works.append((None, callback))

    def flow_changed(self, held: bool) -> None:
        """A ``PublishFlow`` listener: slices pause while publishers are held."""
        self.held = held
        if not held and self._works:
            self._wake()

    def finish(self) -> None:
        """Do everything pending now, in one go (shutdown, or a caller that must see it done)."""
        while self._works:
            self._step_head(1 << 62)

    def _wake(self) -> None:
        if not self._scheduled and self.schedule is not None:
            self._scheduled = True
            self.schedule(self._slice)

    def _slice(self) -> None:
        """One loop turn's share: steps until the works are done or the time is up."""
        self._scheduled = False
        if self.held:
            return  # ``flow_changed`` wakes it
        self.slices += 1
        deadline = self.clock() + self.seconds
        while self._works:
            self._step_head(self.entries)
            if self.clock() >= deadline:
                break
        if self._works:
            self._wake()

    def _step_head(self, budget: int) -> None:
        work, callback = self._works[0]
        if work is not None:
            try:
                if not work.step(budget):
                    return
            except Exception:  # a bug: the works behind it and their callbacks go on
                log.exception("background work %r failed; dropped", work)
        self._works.popleft()
        if callback is not None:
            callback()
