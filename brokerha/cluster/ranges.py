"""Sets of queue positions as sorted ``[first, last]`` runs.

A backup's inventory of a long queue is a few runs, not a million numbers:
positions are assigned in order, so what a queue holds is mostly contiguous.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator


def to_ranges(positions: Iterable[int]) -> list[list[int]]:
    """Sorted, merged runs covering ``positions`` (any order, duplicates allowed)."""
    runs: list[list[int]] = []
    for p in sorted(positions):
        if runs and p <= runs[-1][1] + 1:
            runs[-1][1] = max(runs[-1][1], p)
        else:
            runs.append([p, p])
    return runs


class RangeSet:
    """Membership in a list of sorted, disjoint runs (``to_ranges`` output)."""

    __slots__ = ("_firsts", "_lasts")

    def __init__(self, ranges: Iterable[Iterable[int]]) -> None:
        runs = sorted((int(a), int(b)) for a, b in ranges)
        self._firsts = [a for a, _ in runs]
        self._lasts = [b for _, b in runs]

    def __contains__(self, position: int) -> bool:
        i = bisect_right(self._firsts, position) - 1
        return i >= 0 and position <= self._lasts[i]

    def __iter__(self) -> Iterator[int]:
        for a, b in zip(self._firsts, self._lasts, strict=True):
            yield from range(a, b + 1)

    def runs(self) -> list[tuple[int, int]]:
        """The ``(first, last)`` runs, in order."""
        return list(zip(self._firsts, self._lasts, strict=True))

    def __len__(self) -> int:
        return sum(b - a + 1 for a, b in zip(self._firsts, self._lasts, strict=True))
