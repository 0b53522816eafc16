"""Counters the admin metrics read on scrape (cheap: an increment on the paths they count)."""

from __future__ import annotations

import bisect

# seconds; the usual Prometheus latency buckets, cut to what a commit can take
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    """Counts per bucket (not cumulative), their sum and count."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or below it), as Prometheus wants them."""
        out, running = [], 0
        for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class BrokerStats:
    __slots__ = ("confirms", "commits", "commit_latency")

    def __init__(self) -> None:
        self.confirms = 0   # publisher confirms (acks and nacks) sent
        self.commits = 0    # tx.commit-ok sent
        self.commit_latency = LatencyHistogram()  # tx.commit received -> tx.commit-ok sent

    def committed(self, seconds: float) -> None:
        self.commits += 1
        self.commit_latency.observe(seconds)
