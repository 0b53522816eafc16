"""The event loop monitor: lag histogram, and a stall named by what ran (node/loop_monitor.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from brokerha.node.loop_monitor import LoopMonitor


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
