"""The cyclic GC of a node holding a deep backlog: pauses that do not grow with it.

CPython's full (generation 2) collection walks every tracked object; a node
holding messages keeps two per message (the ``Message`` and its ``Entry``),
so with 300,000 messages queued a full collection stalled the loop ~0.1 s,
with 2,000,000 most of a second -- longer than the lease (issue 33). And full
collections come back as the backlog grows (CPython runs one whenever the
objects promoted since the last one exceed a quarter of those it holds) and
as messages flow through a deep queue.

And not only full ones: a busy primary allocates ~16 tracked objects per message
that live until the backups and the disk answer (events in the outbox, confirm
records, store batches), so they survive the youngest collection; with 20
young collections per middle one (``node/server.py`` ``GC_THRESHOLDS`` as it
was) each middle (generation 1) collection walked up to 400,000 of them:
0.3-0.45 s pauses every 1.5 s while a queue filled at 16,000 msgs/s, on the
primary and on the backups. The middle generation now collects after 2
young ones (at most ~60,000 objects walked).

So after each collection of generation 1 or 2 the survivors are frozen (``gc.freeze``):
reference counting still frees them the moment they are dropped (a consumed
message goes as before), but later collections walk only what was allocated
since. What this gives up: a reference *cycle* among frozen objects that
becomes garbage is not collected while frozen. The broker's message objects
form no cycles; other objects may (a closed connection's channels). Hence the
thaw: every ``THAW_INTERVAL`` seconds, if at most ``THAW_MAX_OBJECTS`` are
frozen (a full collection of that many costs a few tens of milliseconds),
everything is unfrozen and collected once; with a deeper backlog the thaw
waits for the backlog to drain. ``stats`` feeds the node's status and
``/metrics`` (with ``pauses``, a histogram per generation); a collection
longer than ``STALL_WARNING`` is logged.

A backup's catch-up makes the same long-lived objects in bulk (an ``Entry``
and a ``Message`` per message caught up, ~150,000 a second): with the
thresholds above each of them was still walked by a young and a middle
collection before being frozen, a seventh of the catching-up backup's loop
(issue 33). So the backup says when it applied a catch-up packet
(``gc_hooks.bulk_made``, a bottom-floor hook the installed governor sets: a
no-op in a process without one) and the governor freezes at once what is not frozen yet (``gc.freeze``
moves the generations' lists, it walks nothing): those objects are never
walked. What that gives up is the same as above, for the cyclic garbage made
since the last collection (a catch-up packet's decode and apply make none: the
backup's objects are freed by reference counting, tests/node/test_gc_governor.py).

And on the loop's thread only. A collection runs on the thread whose
allocation passed the young threshold, and holds the GIL for all of it: the
store's threads (``store/writer.py``, ``store/oplog.py``) allocate too, so
now and then they ran one, and the loop waited for it without running --
0.090 and 0.176 s of two stalls beside two CPU burners, the collection itself
waiting for a core (issue 33). So once installed with the node's loop
(``install(loop)``) the governor turns automatic collection off
(``gc.disable``) and the loop checks every ``POLL_INTERVAL`` whether the young
generation passed its threshold (``gc.get_count``, the counts CPython itself
compares); if so it collects the oldest generation due, as CPython would
(``_due``), on the loop, between two steps. A store thread's allocations
only count. What this gives up: while the loop is held by one long step,
cyclic garbage waits for the step's end (reference counting frees the rest
as before); and a young collection then walks what that step left, not
20,000 at a time. ``COLLECT_ON_LOOP`` False: CPython's automatic collection,
on whatever thread allocates.

And not one middle walk of a bulk. A loop step that takes 20-30 ms makes more
than the young threshold (a TX's publishes: five tracked objects a message;
its commit step 100,000-150,000 at once), so the survivors of two young
collections that a middle collection walks were 60,000-170,000 objects of the
big transaction: 28-44 ms of the primary's loop each, on top of the step the
collection fell in (issue 33). A middle or full collection due while more
than ``BULK_WALK`` objects wait for it (the young ones, and the survivors of
young collections since the last middle one, counted from each young
collection's start and its collected) collects only the young generation, then
freezes what survived without walking it again (``bulk_walks_frozen`` in the
stats): what it walks is bounded by what one loop step made. What this gives
up is what the freeze of the survivors gives up, a little earlier: a cycle
that outlived a young collection and became garbage before the middle one
would have walked it waits for the thaw.

Counting the frozen objects is itself a walk of all of them
(``gc.get_freeze_count`` follows the permanent generation's linked list):
called by every ``/metrics`` scrape and status read it held the node
0.1-0.4 s with a deep backlog (10 % of the nodes' samples in a TX of 100,000,
issue 33). So the count is taken only at the thaw check, and only when the
node's ``backlog`` (messages held, a cheap callable) says it is small; the
status reports that count and when it was taken.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from brokerha import gc_hooks
from brokerha.broker.stats import LatencyHistogram

log = logging.getLogger("brokerha.node")

THAW_INTERVAL = 60.0
THAW_MAX_OBJECTS = 200_000
STALL_WARNING = 0.1
OBJECTS_PER_MESSAGE = 3  # tracked objects a held message keeps (its Entry, Message, ...)
COLLECT_ON_LOOP = True   # collections run by the loop (install(loop)), never by a store thread
POLL_INTERVAL = 0.01     # the loop's check of the young generation's count, seconds
# a middle or full collection due that would walk more than this many objects (young,
# and survivors of young collections since the last): young only, the survivors frozen
# (a walk of 30,000 of a TX's objects ~10 ms; 90,000 took 28-44 ms, issue 33)
BULK_WALK = 30_000


# glibc's malloc in a node's process (``tune_malloc``): mallopt's parameters and values
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
TOP_PAD = 16 << 20  # what the heap grows by past a request (node/prefault.py widens it)
MALLOC_SETTINGS = ((M_MMAP_THRESHOLD, 8 << 20), (M_TRIM_THRESHOLD, 64 << 20),
                   (M_TOP_PAD, TOP_PAD))


def tune_malloc() -> bool:
    """Keep the C heap's freed memory for the next buffers (a node's own process only).

    A catch-up makes and frees buffers of 0.25-1 MiB many times a second (a run's
    packed contents, a packet, a socket read). With glibc's defaults those above
    its mmap threshold were mapped and unmapped each time, and freed memory at the
    top of the heap was given back as soon as it passed the trim threshold, so
    the next buffer faulted its pages in again: page faults and the kernel's
    zeroing of pages were an eighth of the primary's loop in a catch-up (issue
    33). Here buffers up to 8 MiB come from the heap and up to 64 MiB of free
    memory stay at its top (RSS that may stay after a burst). A no-op where
    there is no glibc ``mallopt``, or when the operator set glibc's own
    variables (``MALLOC_*_``, ``GLIBC_TUNABLES``). True if applied.
    """
    if "GLIBC_TUNABLES" in os.environ or any(
            k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    return all([mallopt(param, value) for param, value in MALLOC_SETTINGS])


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt`` (thread-safe: it takes the main arena's lock); False without it."""
    try:
        call = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_int]
    call.restype = ctypes.c_int
    return bool(call(param, value) == 1)


class GCGovernor:
    """``backlog``: how many messages the node holds (cheap); without it the thaw check
    counts the frozen objects whatever their number (tests, tools)."""

    def __init__(self, clock: Any = time.monotonic,
                 backlog: Callable[[], int] | None = None) -> None:
        self.clock = clock
        self.backlog = backlog
        self.frozen = 0            # frozen objects when last counted (``frozen_at``)
        self.frozen_at: float | None = None
        # by generation (/metrics): the counts of collections and their pauses
        self.pauses = [LatencyHistogram() for _ in range(3)]
        self.pause_max = 0.0
        self.thaws = 0
        self.skipped_thaws = 0
        self.bulk_freezes = 0  # freeze_bulk (a backup's catch-up packets)
        self.loop_collections = 0  # collections the loop ran (install(loop))
        self.other_thread_collections = 0  # collections run on another thread than the loop's
        self.bulk_walks_frozen = 0  # middle or full collections due, frozen instead (BULK_WALK)
        self._young = 0     # the young count when the running collection started
        self._promoted = 0  # survivors of young collections since the last middle one (about)
        self._started = 0.0
        self._last_thaw = clock()
        self._installed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._poll_handle: asyncio.TimerHandle | None = None
        self._was_enabled = False  # automatic collection, before install(loop) turned it off

    @property
    def collections(self) -> list[int]:
        """Collections by generation (their pauses' histograms count them)."""
        return [h.count for h in self.pauses]

    @property
    def pause_total(self) -> float:
        return sum(h.sum for h in self.pauses)

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Watch the process's collections; freeze what a backup makes in bulk
        (``gc_hooks.bulk_made``). With ``loop`` (called on its thread, the node's own
        process) and ``COLLECT_ON_LOOP``: automatic collection off, the loop collects."""
        if self._installed:
            return
        gc.callbacks.append(self._callback)
        self._installed = True
        gc_hooks.set_bulk_hook(self.freeze_bulk)
        if loop is not None and COLLECT_ON_LOOP:
            self._loop, self._loop_thread = loop, threading.get_ident()
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._poll_handle = loop.call_later(POLL_INTERVAL, self._poll)

    def uninstall(self) -> None:
        if not self._installed:
            return
        gc.callbacks.remove(self._callback)
        self._installed = False
        gc_hooks.clear_bulk_hook(self.freeze_bulk)
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        if self._loop is not None:
            self._loop = self._loop_thread = None
            if self._was_enabled:
                gc.enable()

    @property
    def on_loop(self) -> bool:
        """The loop runs the collections (automatic collection off)."""
        return self._loop is not None

    def _poll(self) -> None:
        """On the loop: the collection CPython would have started, if one is due."""
        loop = self._loop
        if loop is None:
            return
        try:
            counts = gc.get_count()
            generation = _due(counts, gc.get_threshold())
            if generation is not None:
                self.loop_collections += 1
                if generation >= 1 and self._promoted + counts[0] > BULK_WALK:
                    gc.collect(0)
                    gc.freeze()
                    self._promoted = 0
                    self.bulk_walks_frozen += 1
                else:
                    gc.collect(generation)
        finally:  # whatever happened, the next check comes: nothing else collects
            self._poll_handle = loop.call_later(POLL_INTERVAL, self._poll)

    def freeze_bulk(self) -> None:
        """Freeze what is not frozen yet, without a collection (``bulk_made``)."""
        if self._installed:
            gc.freeze()
            self._promoted = 0
            self.bulk_freezes += 1

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self._young = gc.get_count()[0]
            if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
                self.other_thread_collections += 1  # gc.collect() called there (a test, a tool)
            return
        pause = time.perf_counter() - self._started
        generation = int(info.get("generation", 0))
        self.pauses[generation].observe(pause)
        self.pause_max = max(self.pause_max, pause)
        if pause > STALL_WARNING:
            log.warning("cyclic GC (generation %d) paused the node %.3fs (%d objects not "
                        "frozen)", generation, pause, sum(gc.get_count()))
        if generation >= 1:
            gc.freeze()  # the survivors: out of the next collections' walk
            self._promoted = 0
        else:
            self._promoted += max(0, self._young - int(info.get("collected", 0)))

    def tick(self) -> None:
        """Called now and then from the loop: the thaw, when it is cheap."""
        now = self.clock()
        if now - self._last_thaw < THAW_INTERVAL:
            return
        self._last_thaw = now
        if self.backlog is not None and \
                self.backlog() * OBJECTS_PER_MESSAGE > THAW_MAX_OBJECTS:
            self.skipped_thaws += 1  # a deep backlog: not even counted (a walk of it)
            return
        if self.count_frozen(now) > THAW_MAX_OBJECTS:
            self.skipped_thaws += 1
            return
        self.thaws += 1
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.count_frozen(now)

    def count_frozen(self, now: float | None = None) -> int:
        """Count them now (a walk of every frozen object: at start, or when few)."""
        now = self.clock() if now is None else now
        self.frozen, self.frozen_at = gc.get_freeze_count(), now
        return self.frozen

    def stats(self) -> dict[str, Any]:
        """Never walks the frozen objects: ``frozen`` is their count at the last thaw check
        that counted them (``frozen_age``: seconds ago, None before the first)."""
        age = None if self.frozen_at is None else round(self.clock() - self.frozen_at, 1)
        return {"collections": self.collections, "pause_seconds_total": self.pause_total,
                "pause_seconds_max": self.pause_max, "frozen": self.frozen,
                "frozen_age": age, "thaws": self.thaws, "thaws_skipped": self.skipped_thaws,
                "bulk_freezes": self.bulk_freezes, "on_loop": self.on_loop,
                "loop_collections": self.loop_collections,
                "bulk_walks_frozen": self.bulk_walks_frozen,
                "other_thread_collections": self.other_thread_collections}


def _due(counts: tuple[int, int, int], thresholds: tuple[int, ...]) -> int | None:
    """The generation CPython's allocator would collect now (``collect_generations``):
    none until the young count passes its threshold, then the oldest whose count passed
    its own (a generation's count: collections of the one below since its last).
    CPython also defers a full collection until a quarter of the long-lived objects are
    new; not here: the survivors are frozen (``_callback``), a full one walks few."""
    if not thresholds or thresholds[0] <= 0 or counts[0] <= thresholds[0]:
        return None
    for generation in range(len(counts) - 1, 0, -1):
        if generation < len(thresholds) and counts[generation] > thresholds[generation]:
            return generation
    return 0
