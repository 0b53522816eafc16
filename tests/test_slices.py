"""``brokerha/slices.py``: the time of one burst of input adds up over back-to-back calls."""

from __future__ import annotations

import pytest

from brokerha import slices
from brokerha.slices import BACK_TO_BACK, Burst
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


def test_back_to_back_calls_add_up_and_a_gap_starts_a_new_burst(clock: Clock) -> None:
    burst = Burst()
    call(burst, clock, 0.008)
    call(burst, clock, 0.008, gap=BACK_TO_BACK / 2)
    assert burst.spent() == pytest.approx(0.016)
    call(burst, clock, 0.003, gap=BACK_TO_BACK * 5)  # the loop ran other work between
    assert burst.spent() == pytest.approx(0.003)


def test_spent_counts_the_call_in_progress(clock: Clock) -> None:
    burst = Burst()
    call(burst, clock, 0.010)
    burst.begin()
    clock.now += 0.015
    assert burst.spent() == pytest.approx(0.025)
    burst.end()


def test_after_a_restart_the_next_call_begins_anew_even_back_to_back(clock: Clock) -> None:
    burst = Burst()
    call(burst, clock, 0.030)
    burst.restart()  # the slice ended: reading paused until the next loop turn
    call(burst, clock, 0.002)  # the next turn came at once
    assert burst.spent() == pytest.approx(0.002)
