"""A client writing megabytes at once does not hold the loop: input is read in slices
(``node/transport.py`` ``READ_SLICE``), and the connection's own pauses (flow, alarms) win."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from pamqp import commands, frame

from brokerha import slices
from brokerha.node.transport import READ_SLICE, AMQPProtocol
from tests.amqp.test_close_ok import FakeTransport, publish_frames, served  # noqa: F401

Served = tuple[AMQPProtocol, FakeTransport, asyncio.AbstractEventLoop]


class Clock:
    """perf_counter as the protocol sees it, read twice per read of input (its start and
    end): each read costs ``cost`` seconds, and ``gap`` passes before the next one."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cost = 0.0
        self.gap = 0.0
        self._end = False

    def __call__(self) -> float:
        self.now += self.cost if self._end else self.gap
        self._end = not self._end
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(slices.time, "perf_counter", c)
    return c


def declare(proto: AMQPProtocol, transport: FakeTransport, name: str) -> None:
    proto.data_received(frame.marshal(commands.Queue.Declare(queue=name), 1))
    transport.written = b""


def depth(proto: AMQPProtocol, name: str) -> int:
    assert proto.conn is not None
    return len(proto.conn.broker.vhosts["/"].queues[name].ready)


def in_one_turn(loop: asyncio.AbstractEventLoop, work: Callable[[], None]) -> None:
    """``work`` in one loop turn (the reads of one readable event), then the next turn."""
    async def turn() -> None:
        work()
    loop.run_until_complete(turn())
    loop.run_until_complete(asyncio.sleep(0))


def test_reads_of_one_turn_past_the_slice_pause_until_the_next_turn(
        served: Served, clock: Clock) -> None:  # noqa: F811
    proto, transport, loop = served
    declare(proto, transport, "q")
    clock.cost, clock.gap = READ_SLICE * 0.4, 0.005  # waiting for a core between reads

    def reads() -> None:
        proto.data_received(publish_frames(1, "q", b"a", 10))
        proto.data_received(publish_frames(1, "q", b"b", 10))
        assert transport.reading  # 0.8 of a slice
        proto.data_received(publish_frames(1, "q", b"c", 10))
        assert not transport.reading  # 1.2: the rest waits for the next loop turn
        assert depth(proto, "q") == 30  # what was read is handled, in order

    in_one_turn(loop, reads)
    assert transport.reading


def test_reads_of_separate_loop_turns_do_not_add_up(served: Served, clock: Clock) -> None:  # noqa: F811
    proto, transport, loop = served
    declare(proto, transport, "q")
    clock.cost = READ_SLICE * 0.4
    for _ in range(10):
        in_one_turn(loop, lambda: proto.data_received(publish_frames(1, "q", b"a")))
    assert transport.reading and depth(proto, "q") == 10


def test_a_flow_hold_during_a_slice_is_not_undone_by_it(served: Served, clock: Clock) -> None:  # noqa: F811
    proto, transport, loop = served
    declare(proto, transport, "q")
    clock.cost = READ_SLICE * 1.5
    proto.data_received(publish_frames(1, "q", b"a"))
    assert not transport.reading
    conn = proto.conn
    assert conn is not None
    conn._set_reading_paused(True)   # publishers held (broker/flow.py) meanwhile
    loop.run_until_complete(asyncio.sleep(0))
    assert not transport.reading     # the slice's end does not read past the hold
    conn._set_reading_paused(False)
    assert transport.reading
    # and a release that comes while a slice pauses leaves the reading to the slice's end
    proto.data_received(publish_frames(1, "q", b"b"))
    assert not transport.reading
    conn._set_reading_paused(True)
    conn._set_reading_paused(False)
    assert not transport.reading
    loop.run_until_complete(asyncio.sleep(0))
    assert transport.reading
