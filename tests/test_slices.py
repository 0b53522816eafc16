"""``brokerha/slices.py``: the time of one burst of input adds up over the calls of one loop
turn; a big list is freed a slice a loop turn."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from brokerha import slices
from brokerha.slices import Burst
from tests.clock import Clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock(50.0)
    monkeypatch.setattr(slices.time, "perf_counter", c)
    return c


def call(burst: Burst, clock: Clock, cost: float, gap: float = 0.0) -> None:
    clock.now += gap
    burst.begin()
    clock.now += cost
    burst.end()


def on_loop(turns: list[Callable[[], None]]) -> None:
    """Each of ``turns`` in a loop turn of its own (the loop runs its callbacks between)."""
    async def run() -> None:
        for turn in turns:
            turn()
            await asyncio.sleep(0)
    asyncio.run(run())


def test_the_calls_of_one_loop_turn_add_up_and_the_next_turn_starts_a_new_burst(
        clock: Clock) -> None:
    burst = Burst()
    spent: list[float] = []

    def one_turn() -> None:
        call(burst, clock, 0.008)
        call(burst, clock, 0.008, gap=0.005)  # the thread waited for a core between reads
        spent.append(burst.spent())

    on_loop([one_turn, lambda: call(burst, clock, 0.003), lambda: spent.append(burst.spent())])
    assert spent == [pytest.approx(0.016), pytest.approx(0.003)]


def test_spent_counts_the_call_in_progress(clock: Clock) -> None:
    burst = Burst()

    def one_turn() -> None:
        call(burst, clock, 0.010)
        burst.begin()
        clock.now += 0.015
        assert burst.spent() == pytest.approx(0.025)
        burst.end()

    on_loop([one_turn])


def test_after_a_restart_the_next_call_begins_anew_in_the_same_turn(clock: Clock) -> None:
    burst = Burst()

    def one_turn() -> None:
        call(burst, clock, 0.030)
        burst.restart()  # the slice ended: reading paused until the next loop turn
        call(burst, clock, 0.002)
        assert burst.spent() == pytest.approx(0.002)

    on_loop([one_turn])


def test_without_a_loop_each_call_is_a_burst_of_its_own(clock: Clock) -> None:
    burst = Burst()
    call(burst, clock, 0.008)
    call(burst, clock, 0.003)
    assert burst.spent() == pytest.approx(0.003)


def test_a_big_list_is_freed_a_slice_a_loop_turn_and_a_small_one_at_once() -> None:
    async def scenario() -> list[int]:
        big, small = list(range(3 * slices.RELEASE_SLICE + 5)), list(range(10))
        slices.release_later(big)
        slices.release_later(small)
        lengths = [len(big)]
        while big:
            await asyncio.sleep(0)
            lengths.append(len(big))
        assert small == list(range(10))  # left alone: dropped by its owner
        return lengths

    lengths = asyncio.run(scenario())
    assert lengths[0] == 3 * slices.RELEASE_SLICE + 5
    assert lengths[-1] == 0
    # no step freed more than a slice
    assert all(a - b <= slices.RELEASE_SLICE for a, b in zip(lengths, lengths[1:], strict=False))
    assert len(lengths) >= 5


def test_a_committed_transaction_leaves_its_lists_to_be_freed_after_its_step() -> None:
    from brokerha.broker.broker import Broker
    from brokerha.broker.storage import MemoryStore
    from tests.ha.harness import route

    async def scenario() -> None:
        broker = Broker("n1", store=MemoryStore())
        broker.add_vhost("/")
        broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
        tx = broker.new_transaction()
        n = 2 * slices.RELEASE_SLICE + 1
        for i in range(n):
            tx.publish(*route(broker, b"%d" % i, rk="q"))
        held = tx.publishes
        await tx.commit()
        assert tx.publishes == [] and tx.empty
        assert len(broker.vhosts["/"].queues["q"].ready) == n  # committed whole, in its step
        assert len(held) > slices.RELEASE_SLICE  # not yet freed
        for _ in range(5):
            await asyncio.sleep(0)
        assert held == []

    asyncio.run(scenario())
