"""A clock that a test moves by hand (``clock.now += 0.5``); pass it where the code under
test takes a ``clock`` callable, or patch it over ``time.perf_counter``/``monotonic``."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
