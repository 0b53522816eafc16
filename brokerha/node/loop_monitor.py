"""How late the node's event loop runs, and what held it when it stalled.

A task on the loop wakes every ``INTERVAL`` and records how late it woke
(the loop lag: a histogram in ``/metrics``, ``brokerha_event_loop_lag_seconds``).
A small watchdog thread notices when the loop has not woken for
``STALL_WARNING`` and samples the main thread's stack then -- the innermost
brokerha function running, and the outermost one that led to it -- so the
WARNING that follows the stall names the operation (a join's catch-up, a
purge, a commit) without instrumenting each of them. On an HA member a stall
longer than the lease lapses the primary's lease, and a longer one may cost it
its role (docs/ha.md, "When the primary's loop is busy"): this is how an
operator sees why. ``status`` gives the lag's p99 and max over the last
``RECENT`` wake-ups (about a minute) for ``ctl status`` and the management UI's
overview; the histogram, since the node started, is for Prometheus.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any

from brokerha.broker.stats import LatencyHistogram

log = logging.getLogger("brokerha.node")

INTERVAL = 0.02       # the monitor's own wake-ups
STALL_WARNING = 0.1   # a stall longer than this is logged, with what ran
RECENT = 3000         # wake-ups ``status`` looks at: about a minute at INTERVAL
PACKAGE = "brokerha"
BUSY_CPU = 0.005     # a thread that used this much CPU during a stall is named


def _where(frame: FrameType | None) -> str:
    """'outer -> inner' brokerha functions of a stack, or what ran if none is ours."""
    ours: list[str] = []
    last = ""
    while frame is not None:
        code = frame.f_code
        module = frame.f_globals.get("__name__", "")
        name = f"{module}.{code.co_qualname}:{frame.f_lineno}"
        if str(module).startswith(PACKAGE):
            ours.append(name)
        elif not last:
            last = name
        frame = frame.f_back
    if not ours:
        return last or "?"
    return ours[0] if len(ours) == 1 else f"{ours[-1]} -> {ours[0]}"


class LoopMonitor:
    """``gc_seconds``: the seconds the process's cyclic GC collections took so far (the
    node's ``GCGovernor.pause_total``): a stall's WARNING says how much of it they were."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 gc_seconds: Callable[[], float] | None = None) -> None:
        self.loop = loop
        self.gc_seconds = gc_seconds
        self._gc_at_beat = 0.0
        self.lag = LatencyHistogram()
        self.max_lag = 0.0
        self.stalls = 0           # stalls over STALL_WARNING
        self.recent: deque[float] = deque(maxlen=RECENT)  # the latest lags, seconds
        self._beat = time.monotonic()
        self._sample: str | None = None
        self._main: int | None = None  # the loop's thread, known at start
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Called on the loop's thread."""
        self._main = threading.get_ident()
        self._beat = time.monotonic()
        self._gc_at_beat = self.gc_seconds() if self.gc_seconds is not None else 0.0
        self._task = self.loop.create_task(self._run())
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            due = time.monotonic() + INTERVAL
            await asyncio.sleep(INTERVAL)
            now = time.monotonic()
            lag = max(0.0, now - due)
            self.observe(lag)
            self._beat = now
            gc_then, self._gc_at_beat = self._gc_at_beat, \
                self.gc_seconds() if self.gc_seconds is not None else 0.0
            if lag > STALL_WARNING:
                self.stalls += 1
                where, self._sample = self._sample, None
                collected = self._gc_at_beat - gc_then
                log.warning("event loop stalled %.3fs (running: %s%s)", lag,
                            where or "not sampled",
                            f"; cyclic GC {collected:.3f}s of it" if collected >= 0.001 else "")

    def observe(self, lag: float) -> None:
        """One wake-up ``lag`` seconds late."""
        self.lag.observe(lag)
        self.recent.append(lag)
        self.max_lag = max(self.max_lag, lag)

    def status(self) -> dict[str, Any]:
        """The lag lately (p99 and max of the last ``RECENT`` wake-ups, about a minute),
        the longest since start and the stalls; seconds."""
        recent = sorted(self.recent)
        p99 = recent[max(0, math.ceil(0.99 * len(recent)) - 1)] if recent else 0.0  # nearest rank
        return {"lag_p99": round(p99, 4), "lag_max": round(recent[-1] if recent else 0.0, 4),
                "window": round(len(recent) * INTERVAL + sum(recent), 1),
                "max_lag": round(self.max_lag, 4), "stalls": self.stalls}

    def _watch(self) -> None:
        """Sample the main thread once per stall, while it lasts."""
        sampled_at = 0.0
        seen_beat = 0.0
        at_beat: dict[int, tuple[float, float | None]] = {}
        since = 0.0
        while not self._stop.wait(INTERVAL):
            beat = self._beat
            if beat != seen_beat:  # the loop woke since: a stall would start from here
                seen_beat, at_beat, since = beat, _thread_times(self._main), time.monotonic()
            elif time.monotonic() - beat > STALL_WARNING and sampled_at != beat:
                self._sample = self._where_all(sys._current_frames(),  # noqa: SLF001
                                               at_beat, _thread_times(self._main),
                                               time.monotonic() - since)
                sampled_at = beat

    def _where_all(self, frames: dict[int, FrameType],
                   before: dict[int, tuple[float, float | None]],
                   after: dict[int, tuple[float, float | None]], span: float = 0.0) -> str:
        """What the loop's thread runs, and the CPU each thread used since the stall began.

        The loop's thread using little CPU through a stall was not running: it
        waited for a core (the process starved: the kernel's run-queue wait,
        ``/proc/self/task/<tid>/schedstat``, says how long) or it was blocked --
        on the GIL, held by another thread of the process (their CPU says which:
        a store thread encoding or committing a batch), or in a blocking call.
        ``span``: the seconds the figures cover (the stall so far).
        """
        where = _where(frames.get(self._main or -1))
        names = {t.ident: t.name for t in threading.enumerate()}
        used = {ident: cpu - before.get(ident, (0.0, None))[0]
                for ident, (cpu, _) in after.items()}  # new: all
        main = self._main or -1
        if main not in used:
            return where
        others = sorted(((cpu, ident) for ident, cpu in used.items()
                         if ident != main and cpu >= BUSY_CPU), reverse=True)
        text = f"{where}; loop thread CPU {used[main]:.3f}s"
        waited_now, waited_then = after[main][1], before.get(main, (0.0, None))[1]
        if span > 0 and waited_now is not None and waited_then is not None:
            waited = waited_now - waited_then
            blocked = max(0.0, span - used[main] - waited)
            text += (f" of {span:.3f}s, waiting for a core {waited:.3f}s, "
                     f"blocked (the GIL, or a blocking call) {blocked:.3f}s")
        if others:
            text += ", other threads' " + ", ".join(
                f"{names.get(ident, ident)} {cpu:.3f}s at {_where(frames.get(ident))}"
                for cpu, ident in others)
        return text


def _thread_times(loop_thread: int | None = None) -> dict[int, tuple[float, float | None]]:
    """(CPU seconds, seconds spent runnable waiting for a core) of each of the process's
    threads but the watchdog. The wait is read for ``loop_thread`` only, from
    ``/proc/self/task/<tid>/schedstat`` (on-CPU ns, run-queue wait ns, timeslices); None
    for the others, and where the kernel does not say."""
    out: dict[int, tuple[float, float | None]] = {}
    me = threading.get_ident()
    for thread in threading.enumerate():
        ident = thread.ident
        if ident is None or ident == me:
            continue
        if ident == loop_thread:
            try:
                fd = os.open(f"/proc/self/task/{thread.native_id}/schedstat", os.O_RDONLY)
                try:
                    cpu_ns, wait_ns = os.read(fd, 128).split()[:2]
                finally:
                    os.close(fd)
                out[ident] = (int(cpu_ns) / 1e9, int(wait_ns) / 1e9)
                continue
            except (OSError, ValueError):  # not Linux
                pass
        try:
            out[ident] = (time.clock_gettime(time.pthread_getcpuclockid(ident)), None)
        except (OSError, AttributeError):  # the thread just ended; or not POSIX
            continue
    return out
