"""``ReadyList.take_ranges``: a backup's copy of a purge made while entries were acquired
on the primary (the ``pr`` event, ``Queue.begin_purge_ranges``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from brokerha.broker.content import build_header
from brokerha.broker.message import Entry, Message
from brokerha.broker.queue import ReadyList

HEADER = build_header(1)


def ready(positions: list[int]) -> ReadyList:
    r = ReadyList()
    r.extend([Entry(p, Message("", "q", HEADER, b"%d" % p), None) for p in positions])
    return r


def runs(positions: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p - 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


@given(st.integers(1, 300), st.sets(st.integers(1, 300), max_size=20), st.integers(0, 400))
def test_the_entries_of_the_ranges_leave_and_the_others_stay_in_order(
        n: int, acquired: set[int], newer: int) -> None:
    """The primary's queue held 1..n; ``acquired`` were out (kept by the copy), the rest
    purged; ``newer`` came after (a few: the last range is split off; many: the entries up
    to it are taken from the head). Whatever their places, the copy ends as the primary."""
    purged = [p for p in range(1, n + 1) if p not in acquired]
    if not purged:
        return
    copy = ready(list(range(1, n + newer + 1)))
    taken = copy.take_ranges(runs(purged))
    assert [e.position for level in taken for e in level] == purged
    assert [e.position for e in copy] == (
        sorted(p for p in acquired if p <= n) + list(range(n + 1, n + newer + 1)))
    assert len(copy) == n + newer - len(purged)


@pytest.mark.parametrize("ranges", [
    [(3, 13)],            # past the copy's end
    [(2, 2), (4, 5)],     # 2 is not in the copy
    [(0, 0), (5, 6)],     # nor 0
])
def test_a_copy_without_every_purged_position_is_refused_and_left_as_it_was(
        ranges: list[tuple[int, int]]) -> None:
    copy = ready([1, 3, 4, 5, 6, 7, 8, 9, 10])
    with pytest.raises(ValueError, match="positions purged"):
        copy.take_ranges(ranges)
    assert [e.position for e in copy] == [1, 3, 4, 5, 6, 7, 8, 9, 10] and len(copy) == 9


def test_a_queue_with_priorities_is_refused() -> None:
    with pytest.raises(ValueError, match="priorities"):
        ReadyList(3).take_ranges([(1, 1)])
