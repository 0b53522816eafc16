"""Position runs: a backup's inventory of a queue."""

from __future__ import annotations

from brokerha.cluster.ranges import RangeSet, to_ranges


def test_positions_compress_to_sorted_runs_and_back() -> None:
    positions = [9, 1, 2, 3, 7, 8, 3, 20]
    runs = to_ranges(positions)
    assert runs == [[1, 3], [7, 9], [20, 20]]
    held = RangeSet(runs)
    assert list(held) == [1, 2, 3, 7, 8, 9, 20] and len(held) == 7
    assert 8 in held and 4 not in held and 0 not in held and 21 not in held
    assert to_ranges([]) == [] and 1 not in RangeSet([])
