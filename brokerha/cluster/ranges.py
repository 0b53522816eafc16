"""Sets of queue positions as sorted ``[first, last]`` runs.

A backup's inventory of a long queue is a few runs, not a million numbers:
positions are assigned in order, so what a queue holds is mostly contiguous.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator


def to_ranges(positions: Iterable[int]) -> list[list[int]]:
    """Sorted, merged runs covering ``positions`` (any order, duplicates allowed).

    A queue's positions usually come in order already: one pass, no sort.
    """
    items = list(positions)
    runs = _runs_in_order(items)
    return runs if runs is not None else _runs_in_order(sorted(items)) or []


def _runs_in_order(items: list[int]) -> list[list[int]] | None:
    """The runs of ``items`` if they are in ascending order, else None."""
    runs: list[list[int]] = []
    if not items:
        return runs
    first = last = items[0]
    for p in items:
        if p == last + 1:
            last = p
        elif p > last + 1:
            runs.append([first, last])
            first = last = p
        elif p < last:
            return None  # out of order
    runs.append([first, last])
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
