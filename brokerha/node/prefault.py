"""The C heap's new pages faulted in by a thread of their own, not by the event loop (issue 33).

A backup caught up 2,000,000 x 1 KiB behind holds every message it applies:
~1.4 KiB of fresh memory a message, a page fault every ~3 messages, each
taken by the event loop's thread where it first writes the page (a body's
copy, ``malloc``'s chunk header). On this VM a fresh page past the first few
GB of free memory costs ~10 us to clear (the host backs it at its first
touch): ~3 of the loop's 3.7 us a message (docs/benchmarks.md, "The 2 GB
catch-up's cost was the kernel's").

So a thread watches the top of the heap (``sbrk(0)``: the event loop's is
the process's main arena, grown ``M_TOP_PAD`` at a time, ``gc_governor.tune_malloc``)
and faults in what it grew by with ``madvise(MADV_POPULATE_WRITE)`` (Linux
5.14), which maps the pages writable as a write would, without writing: the
contents of a page that is already in use are not touched, so racing the
allocator is harmless. The loop then finds its pages mapped; the clearing's
CPU is spent on this thread, off the loop's path (and with the GIL released:
``ctypes`` drops it around the call). What it costs: the heap's unused top
(at most ``M_TOP_PAD``) is resident. Objects of Python's own allocator
(arenas mapped apart) are not covered. Without ``sbrk``, ``madvise`` or the
advice (another libc, an older kernel) the thread ends at its first try.
It looks every ``POLL_INTERVAL`` while the heap grows, every ``IDLE_POLL`` once
it has not for ``IDLE_AFTER``: a heap that starts growing after a quiet spell
has its first ``IDLE_POLL`` of growth faulted in by the loop itself, as before.

Each time the heap grows the loop races the thread for a while: the new top is
used at once, and the thread sees it a look later (and then has to take the
GIL, which a busy loop holds up to its switch interval), so the loop faults in
the first pages itself -- a 2 GB catch-up's backup loop took ~13 % of the
heap's faults this way, ~2 MiB of every 16 MiB step. So while the heap grows
it grows ``GROWING_TOP_PAD`` at a time (``M_TOP_PAD``; the thread sets it at the
first growth and puts ``gc_governor.TOP_PAD`` back once the heap has not grown
for ``IDLE_AFTER``): a quarter of the steps, a quarter of the races. What it
costs: up to that much of the heap's unused top resident while it grows.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading
import time
from typing import Any

from brokerha.node.gc_governor import M_TOP_PAD, TOP_PAD, mallopt

log = logging.getLogger("brokerha.node")

MADV_POPULATE_WRITE = 23  # linux/mman.h
POLL_INTERVAL = 0.005  # seconds between two looks at the heap's top while it grows
IDLE_POLL = 0.1  # ... and once it has not grown for IDLE_AFTER (a look takes the GIL)
IDLE_AFTER = 1.0  # (it grows M_TOP_PAD at a time: at 150 MB/s every ~0.1-0.4 s)
GROWING_TOP_PAD = 64 << 20  # M_TOP_PAD while the heap grows (TOP_PAD otherwise)
# bytes faulted in by one madvise call, which holds the process's mmap lock for reading
# throughout (~9 us a page here): the loop's own brk or mmap (a new pymalloc arena) waits
# for it. In one call a 64 MiB step held the catching-up backup's loop 0.10-0.24 s.
POPULATE_CHUNK = 4 << 20


class HeapPrefault(threading.Thread):
    """Faults in the pages the main arena's heap grows by (``start``; ``stop``)."""

    def __init__(self, poll: float = POLL_INTERVAL, idle_poll: float = IDLE_POLL,
                 idle_after: float = IDLE_AFTER) -> None:
        super().__init__(name="brokerha-prefault", daemon=True)
        self.poll = poll
        self.idle_poll = idle_poll
        self.idle_after = idle_after
        self.growing = False  # the heap grew within idle_after: M_TOP_PAD is GROWING_TOP_PAD
        self.populated = 0  # bytes faulted in (stats, tests)
        self.rounds = 0  # madvise calls
        self.covered = 0  # the heap's top up to which every page is faulted in (tests)
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            sbrk, madvise = libc.sbrk, libc.madvise
        except (OSError, AttributeError):
            return
        sbrk.argtypes, sbrk.restype = [ctypes.c_ssize_t], ctypes.c_void_p
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        try:
            self._watch(sbrk, madvise)
        finally:
            if self.growing:
                self._grow_by(TOP_PAD)

    def _grow_by(self, pad: int) -> None:
        """The heap's step past a request from now on (``M_TOP_PAD``)."""
        if mallopt(M_TOP_PAD, pad):
            self.growing = pad != TOP_PAD

    def _watch(self, sbrk: Any, madvise: Any) -> None:
        page = mmap.PAGESIZE
        done = self.covered = sbrk(0) or 0  # what the heap holds now was touched already
        grew = -self.idle_after
        while not self._stop_event.wait(
                self.poll if time.monotonic() - grew < self.idle_after else self.idle_poll):
            top = sbrk(0) or 0
            if top <= done:
                done = self.covered = min(done, top)  # trimmed: from there on
                if self.growing and time.monotonic() - grew >= self.idle_after:
                    self._grow_by(TOP_PAD)
                continue
            grew = time.monotonic()
            if not self.growing:
                self._grow_by(GROWING_TOP_PAD)
            start = done - done % page
            while start < top:  # a chunk at a time: the call holds the mmap lock (below)
                end = min(top, start + POPULATE_CHUNK)
                if madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
                    error = ctypes.get_errno()
                    if error != errno.ENOMEM:  # ENOMEM: trimmed meanwhile, look again
                        log.info("heap prefault off: madvise(MADV_POPULATE_WRITE) failed: %s",
                                 errno.errorcode.get(error, error))
                        return
                    break
                self.rounds += 1
                self.populated += end - start
                start = done = self.covered = end
