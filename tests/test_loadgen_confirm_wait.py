"""benchmarks/loadgen.py's ConfirmWait, the publishers' wait for confirms in
deep_queue_ops.py and ha_heavy_work.py: it returns when the confirms came, and never
waits without end -- a silent broker is a TimeoutError that says how far it got, a
connection that failed is its error. Fast: no broker, a stand-in connection."""

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import loadgen  # noqa: E402


def stand_in() -> Any:
    """What ConfirmWait reads of a LoadConnection."""
    return SimpleNamespace(confirms=loadgen.ConfirmTracker(), error=None, after_read=None)


def test_it_returns_once_the_broker_confirmed_enough() -> None:
    async def scenario() -> int:
        conn = stand_in()
        wait = loadgen.ConfirmWait(conn, stall_limit=5.0)
        loop = asyncio.get_running_loop()
        for tag in (3, 7, 10):  # three reads, each confirming up to ``tag``
            loop.call_later(0.01 * tag, lambda t=tag: (conn.confirms.confirm(t, True, False),
                                                       conn.after_read()))
        await wait.until(7)
        reached = conn.confirms.confirmed
        await wait.until(0)  # nothing to wait for
        return reached

    assert asyncio.run(scenario()) == 7


def test_a_broker_that_reads_nothing_is_a_timeout_saying_how_far_it_got() -> None:
    async def scenario() -> None:
        conn = stand_in()
        conn.confirms.confirm(4, True, False)
        await loadgen.ConfirmWait(conn, stall_limit=0.3).until(10)

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"nothing read for 0.3 s: 4 of 10 publishes confirmed"):
        asyncio.run(scenario())
    assert time.monotonic() - started < 2.0


def test_a_connection_that_failed_without_a_read_raises_its_error() -> None:
    async def scenario() -> None:
        conn = stand_in()
        asyncio.get_running_loop().call_later(
            0.05, lambda: setattr(conn, "error", loadgen.AMQPError("connection lost")))
        await loadgen.ConfirmWait(conn, stall_limit=30.0).until(1)

    started = time.monotonic()
    with pytest.raises(loadgen.AMQPError, match="connection lost"):
        asyncio.run(scenario())
    assert time.monotonic() - started < 2.0  # seen at the next look, not after 30 s
