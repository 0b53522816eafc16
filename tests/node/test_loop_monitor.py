"""The event loop monitor: lag histogram, and a stall named by what ran (node/loop_monitor.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest

from brokerha.node.loop_monitor import RECENT, LoopMonitor


def busy_purging_a_deep_queue(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_stall_is_logged_with_the_function_that_held_the_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> LoopMonitor:
        monitor = LoopMonitor(asyncio.get_running_loop())
        monitor.start()
        await asyncio.sleep(0.1)
        busy_purging_a_deep_queue(0.3)
        await asyncio.sleep(0.1)
        monitor.stop()
        return monitor

    with caplog.at_level(logging.WARNING, logger="brokerha.node"):
        monitor = asyncio.run(run())
    assert monitor.stalls == 1 and 0.25 < monitor.max_lag < 1.0
    lines = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(lines) == 1 and "busy_purging_a_deep_queue" in lines[0], lines
    counts = dict(monitor.lag.cumulative())
    assert counts["0.1"] < counts["+Inf"] == sum(monitor.lag.counts)


def test_status_gives_the_lag_of_the_last_minute_p99_and_max() -> None:
    loop = asyncio.new_event_loop()
    monitor = LoopMonitor(loop)
    loop.close()
    assert monitor.status() == {"lag_p99": 0.0, "lag_max": 0.0, "window": 0.0,
                                "max_lag": 0.0, "stalls": 0}
    monitor.observe(2.0)  # long ago: out of the window once RECENT newer wake-ups came
    for i in range(RECENT):
        monitor.observe(0.001 if i % 100 else 0.04)  # 1 % of wake-ups 40 ms late
    status = monitor.status()
    assert status["lag_p99"] == 0.001 and status["lag_max"] == 0.04
    assert status["max_lag"] == 2.0  # since the node started
    assert 60.0 <= status["window"] <= 65.0  # about a minute of wake-ups
    monitor.observe(0.3)
    assert monitor.status()["lag_max"] == 0.3


def test_a_stall_names_what_the_other_threads_were_doing(caplog: pytest.LogCaptureFixture) -> None:
    """The CPU each thread used during a stall: a store thread holding the GIL is named."""
    import threading

    stop = threading.Event()

    def encode_a_big_batch() -> None:
        while not stop.is_set():
            sum(range(10_000))

    async def run() -> LoopMonitor:
        monitor = LoopMonitor(asyncio.get_running_loop())
        monitor.start()
        await asyncio.sleep(0.1)
        worker = threading.Thread(target=encode_a_big_batch, name="store-writer", daemon=True)
        worker.start()
        busy_purging_a_deep_queue(0.3)
        await asyncio.sleep(0.1)
        stop.set()
        worker.join()
        monitor.stop()
        return monitor

    with caplog.at_level(logging.WARNING, logger="brokerha.node"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert lines and "busy_purging_a_deep_queue" in lines[0], lines
    assert "loop thread CPU" in lines[0] and "store-writer" in lines[0], lines
    assert "loop-watchdog" not in lines[0]
    if os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        # the rest of the stall: the loop's thread waiting for a core, or blocked (the GIL)
        assert "waiting for a core" in lines[0] and "blocked (the GIL" in lines[0], lines


def test_a_stall_says_how_much_of_it_was_the_cyclic_gc(caplog: pytest.LogCaptureFixture) -> None:
    """The governor's collections run on the loop (node/gc_governor.py): the stall line says
    how long they took in it (``gc_seconds``: the node's ``GCGovernor.pause_total``)."""
    collected = [0.0]

    async def run() -> None:
        monitor = LoopMonitor(asyncio.get_running_loop(), gc_seconds=lambda: collected[0])
        monitor.start()
        await asyncio.sleep(0.1)
        busy_purging_a_deep_queue(0.3)
        collected[0] += 0.2  # a collection during the step
        await asyncio.sleep(0.1)
        busy_purging_a_deep_queue(0.3)  # none in this one
        await asyncio.sleep(0.1)
        monitor.stop()

    with caplog.at_level(logging.WARNING, logger="brokerha.node"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].endswith("; cyclic GC 0.200s of it)"), lines
    assert "cyclic GC" not in lines[1], lines
