"""The timestamp counter behind the ADD limit (safety rule F2).

The ADD step may order every transaction with a timestamp up to the least
counter the members posted.  That is sound only if a posted counter is a
promise: once a master posted ``c``, none of its future transactions gets a
timestamp ``<= c``.  A wall clock breaks the promise when it steps back (NTP,
failover to a host whose clock is behind) and a volatile counter breaks it on
restart, so the counter is a hybrid Lamport clock whose high-water mark is
persisted (as a reservation, to keep writes rare).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HybridCounter:
    """Hybrid Lamport counter; ``safe=False`` is the seed's wall-clock counter.

    ``reserved`` is the persisted high-water mark: the counter never exceeds it
    without first raising it (by ``reserve_step``), and a restart resumes from
    it, so nothing posted before a crash can be undercut after it.
    """

    value: int = 0
    reserved: int = 0
    safe: bool = True
    reserve_step: int = 10_000

    @classmethod
    def restored(cls, reserved: int, safe: bool = True) -> HybridCounter:
        start = reserved if safe else 0
        return cls(value=start, reserved=reserved, safe=safe)

    def for_post(self, clock_ms: int) -> int:
        """The counter to put in a post: c <- max(c, clock)."""
        if not self.safe:
            self.value = clock_ms
            return clock_ms
        self.value = max(self.value, clock_ms)
        return self.value

    def observe(self, counter: int, timestamps: list[int] | tuple[int, ...] = ()) -> None:
        """On a received post: c <- max(c, its counter, its timestamps)."""
        if not self.safe:
            return
        self.value = max(self.value, counter, *timestamps) if timestamps else max(self.value, counter)

    def new_timestamp(self, clock_ms: int) -> int:
        """A new transaction's timestamp: max(c + 1, clock), strictly above every post."""
        if not self.safe:
            self.value = clock_ms
            return clock_ms
        self.value = max(self.value + 1, clock_ms)
        return self.value

    def reservation_needed(self) -> int | None:
        """The new high-water mark to persist before acting on ``value``, if any."""
        if not self.safe or self.value <= self.reserved:
            return None
        self.reserved = self.value + self.reserve_step
        return self.reserved
