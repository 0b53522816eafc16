"""Input handled in bounded slices per loop turn: the client and the node links.

When a socket is readable, the event loop (libuv, under uvloop) reads it up
to 32 times, 256 KiB each, calling the protocol for each read before it runs
anything else -- timers, heartbeats, other connections. One call is short;
one readable event is not (a publisher writing megabytes held the primary's
loop 0.1-0.15 s per event, issue 33). ``Burst`` adds up the time of the calls
of one loop turn, so that a protocol can stop reading once a burst has used
its slice, until the next loop turn (``pause_reading`` in the call ends
libuv's reads at once).

A burst ends when the loop has run this turn's input: its first call asks the
loop for a callback (``call_soon``), which runs only after the reads of the
readable event. It was a gap of wall time between two calls (1 ms), which a
thread waiting for a core between two reads also makes: on a loaded machine
(the cluster's own nodes and clients are enough on two cores) a TX's slices
ran 28-56 ms of the primary's loop instead of ~20 (issue 33).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any


class Burst:
    """The time a protocol spent on one burst of input (the calls of one loop turn):
    ``begin``/``end`` around each call."""

    __slots__ = ("_spent", "_began", "_running", "_fresh")

    def __init__(self) -> None:
        self._spent = 0.0
        self._began = 0.0
        self._running = False
        self._fresh = True

    def begin(self) -> None:
        if self._fresh:
            self._spent = 0.0
            self._fresh = False
            try:
                asyncio.get_running_loop().call_soon(self.restart)  # after this turn's reads
            except RuntimeError:  # no loop: each call a burst of its own
                self._fresh = True
        self._began = time.perf_counter()
        self._running = True

    def end(self) -> None:
        self._spent += time.perf_counter() - self._began
        self._running = False

    def spent(self) -> float:
        """Seconds of this burst so far, the call in progress included."""
        if self._running:
            return self._spent + time.perf_counter() - self._began
        return self._spent

    def restart(self) -> None:
        """The turn's reads are over, or the slice ended (reading paused until the next
        turn): the next call begins anew."""
        self._fresh = True


# -- big containers freed a slice a loop turn -----------------------------------------------

RELEASE_SLICE = 8192  # items freed a loop turn (8,192 of a TX's publishes: ~1-2 ms)
_releasing: deque[list[Any]] = deque()


def release_later(items: list[Any]) -> None:
    """Free ``items`` (a list nobody else will use) ``RELEASE_SLICE`` items a loop turn.

    Freeing what a big operation leaves -- a TX of 100,000 messages' publishes, made
    of 100,000 tuples and lists -- took 13-24 ms of the step that ended it (issue
    33); the loop's other work goes first this way. A short list, or no running
    loop, is freed at once.
    """
    if len(items) <= RELEASE_SLICE:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    if not _releasing:
        loop.call_soon(_release_slice)
    _releasing.append(items)


def _release_slice() -> None:
    items = _releasing[0]
    del items[-RELEASE_SLICE:]
    if not items:
        _releasing.popleft()
    if _releasing:
        asyncio.get_running_loop().call_soon(_release_slice)
