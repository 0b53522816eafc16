"""The partition table (cluster/partition_table.py, issue 35 stage 1): placement, ptids,
operational partitions, the x-partition pin. Property tests with hypothesis."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brokerha.cluster.partition_table import (
    PRECONDITION_FAILED,
    Cell,
    CellState,
    PartitionChange,
    PartitionPinError,
    PartitionTable,
    PartitionTableError,
    check_pin,
    hash_partition,
)

U, OUT, F, C = (CellState.UP_TO_DATE, CellState.OUT_OF_DATE, CellState.FEEDING,
              CellState.CORRUPTED)


def names(n: int) -> list[str]:
    return [f"n{i + 1}" for i in range(n)]


@st.composite
def layouts(draw: st.DrawFn, max_nodes: int = 7) -> tuple[list[str], int, int]:
    """(nodes, P, NR): N in 1..7, P in 1..64, NR in 0..N-1."""
    n = draw(st.integers(1, max_nodes))
    return names(n), draw(st.integers(1, 64)), draw(st.integers(0, n - 1))


def placed(nodes: list[str], partitions: int, replicas: int) -> PartitionTable:
    table = PartitionTable.empty(partitions, replicas)
    change = table.tweak(nodes)
    assert change is not None
    table.apply(change)
    return table


def cell_counts(table: PartitionTable, nodes: list[str]) -> Counter[str]:
    counts: Counter[str] = Counter({n: 0 for n in nodes})
    counts.update(c.node for row in table.rows for c in row)
    return counts


def leader_counts(table: PartitionTable, nodes: list[str]) -> Counter[str]:
    counts: Counter[str] = Counter({n: 0 for n in nodes})
    counts.update(row[0].node for row in table.rows)
    return counts


def catch_up_every_learner(table: PartitionTable) -> None:
    """What ReplicationDone will do (stage 5): every learner caught up, one ptid each."""
    for p in range(table.partitions):
        for cell in list(table.rows[p]):
            if cell.state is OUT:
                change = table.replicated(p, cell.node)
                assert change is not None and change.ptid == table.ptid + 1
                table.apply(change)


# -- placement ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_a_new_table_is_balanced_within_one_of_the_ideal(layout: tuple[list[str], int, int]
                                                         ) -> None:
    nodes, partitions, replicas = layout
    table = placed(nodes, partitions, replicas)
    n = len(nodes)
    assert table.ptid == 1 and table.partitions == partitions
    for row in table.rows:
        assert len(row) == replicas + 1 and len({c.node for c in row}) == replicas + 1
        assert all(c.state is U for c in row)  # NEO: the initial state
    ideal_cells = (replicas + 1) * partitions / n
    for node, count in cell_counts(table, nodes).items():
        assert abs(count - ideal_cells) < 1, (node, count, ideal_cells)
    for node, count in leader_counts(table, nodes).items():
        assert abs(count - partitions / n) < 1, (node, count, partitions / n)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_placement_is_deterministic_whatever_the_order_of_the_nodes(
        layout: tuple[list[str], int, int]) -> None:
    nodes, partitions, replicas = layout
    first = placed(nodes, partitions, replicas)
    again = placed(list(reversed(nodes)), partitions, replicas)
    assert first == again
    assert PartitionTable.from_json(first.to_json()) == first


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_tweak_is_idempotent(layout: tuple[list[str], int, int], data: st.DataObject) -> None:
    nodes, partitions, replicas = layout
    table = placed(nodes, partitions, replicas)
    assert table.tweak(nodes) is None
    if len(nodes) > 1:
        gone = data.draw(st.sampled_from(nodes))
        change = table.tweak(nodes, exclude=[gone])
        assert (change is None) == (table.cells_of(gone) == [])
        if change is not None:
            table.apply(change)
        assert table.tweak(nodes, exclude=[gone]) is None  # the drain under way is kept


@settings(max_examples=300, deadline=None)
@given(layouts(), st.data())
def test_draining_a_node_moves_every_cell_off_it_through_learners(
        layout: tuple[list[str], int, int], data: st.DataObject) -> None:
    nodes, partitions, replicas = layout
    if len(nodes) < 2:
        return
    table = placed(nodes, partitions, replicas)
    gone = data.draw(st.sampled_from(nodes))
    before = [list(row) for row in table.rows]
    change = table.tweak(nodes, exclude=[gone])
    if change is not None:
        table.apply(change)
    width = min(replicas + 1, len(nodes) - 1)
    for p, row in enumerate(table.rows):
        # while the learners catch up the leaving cells still vote: nothing lost meanwhile
        assert [c.state for c in row if c.node == gone] in ([], [F])
        assert {c.node for c in before[p] if c.node != gone} <= {c.node for c in row}
        # up to date or learning (a cell moved to even the counts out feeds its learner too)
        assert len([c for c in row if c.node != gone and c.state is not F]) == width
        if row[0].node == gone:
            assert all(c.state is not U for c in row)  # leader stays only if none is up to date
    catch_up_every_learner(table)
    rest = [n for n in nodes if n != gone]
    for row in table.rows:
        assert gone not in {c.node for c in row}
        assert [c.state for c in row] == [U] * width  # NR+1 voting cells (N-1 if fewer)
    counts = cell_counts(table, rest)
    assert max(counts.values()) - min(counts.values()) <= 1
    leaders = leader_counts(table, rest)
    assert max(leaders.values()) - min(leaders.values()) <= 1 or table.tweak(rest) is not None


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_every_change_is_the_next_ptid_and_nothing_else_is_taken(
        layout: tuple[list[str], int, int], data: st.DataObject) -> None:
    nodes, partitions, replicas = layout
    table = PartitionTable.empty(partitions, replicas)
    follower = PartitionTable()  # a backup's copy: every change in order
    changes: list[PartitionChange] = []
    change = table.tweak(nodes)
    for _ in range(4):
        if change is None:
            break
        assert change.ptid == table.ptid + 1
        table.apply(change)
        follower.apply(change)
        changes.append(change)
        assert follower == table
        exclude = data.draw(st.lists(st.sampled_from(nodes), max_size=len(nodes) - 1))
        change = table.tweak(nodes, exclude=exclude)
    assert [c.ptid for c in changes] == list(range(1, len(changes) + 1))
    for stale in changes:  # a change applied again, or one from the past, is refused
        with pytest.raises(PartitionTableError, match="ptid"):
            follower.apply(stale)
    ahead = PartitionChange(table.ptid + 2, replicas, partitions, {})
    with pytest.raises(PartitionTableError, match="ptid"):
        follower.apply(ahead)
    assert follower == table


def test_the_default_layout_of_three_nodes_is_every_node_in_every_partition() -> None:
    table = placed(names(3), 9, 2)
    assert [[c.node for c in row] for row in table.rows[:3]] == [
        ["n1", "n2", "n3"], ["n2", "n3", "n1"], ["n3", "n1", "n2"]]
    assert [table.preferred_leader(p) for p in range(9)] == ["n1", "n2", "n3"] * 3


def test_a_table_with_fewer_nodes_than_replicas_plus_one_uses_every_node() -> None:
    table = PartitionTable.empty(4, 2)
    table.apply(table.tweak(["a", "b"]))  # type: ignore[arg-type]
    assert all(len(row) == 2 for row in table.rows)


def test_a_move_that_evens_the_counts_out_is_kept_by_the_next_tweak() -> None:
    """Found by CI: draining n2 of 7 nodes (P 17, NR 4) also moved an up-to-date cell
    of n3 to n1 to even the counts out; the next tweak undid that move and made
    another one (n3 out of partition 2 instead of 1) -- a new ptid for nothing."""
    nodes = names(7)
    table = placed(nodes, 17, 4)
    change = table.tweak(nodes, exclude=["n2"])
    assert change is not None
    table.apply(change)
    moved = [(p, c.node) for p, row in enumerate(table.rows) for c in row
             if c.state is F and c.node != "n2"]
    assert moved  # the evening out did move a cell of a staying node
    assert table.tweak(nodes, exclude=["n2"]) is None


def test_a_node_back_in_before_its_learners_caught_up_keeps_its_cells() -> None:
    nodes = names(4)
    table = placed(nodes, 8, 1)
    original = list(table.rows)
    table.apply(table.tweak(nodes, exclude=["n2"]))  # type: ignore[arg-type]
    undo = table.tweak(nodes)
    assert undo is not None
    table.apply(undo)
    assert sorted(sorted(c.node for c in r) for r in table.rows) == \
        sorted(sorted(c.node for c in r) for r in original)
    assert all(c.state is U for row in table.rows for c in row)


def test_a_corrupted_cell_is_replaced_by_a_learner() -> None:
    table = placed(names(4), 4, 1)
    row = list(table.rows[0])
    row[1] = Cell(row[1].node, C)
    rows = list(table.rows)
    rows[0] = tuple(row)
    table.apply(table.change_to(rows))  # type: ignore[arg-type]
    table.apply(table.tweak(names(4)))  # type: ignore[arg-type]
    assert [c.state for c in table.rows[0]] == [U, OUT]


# -- the queue's partition ------------------------------------------------------------------


@given(st.text(max_size=20), st.text(max_size=40), st.integers(1, 64))
def test_a_queue_hashes_to_the_same_partition_in_every_process(vhost: str, name: str,
                                                               partitions: int) -> None:
    table = PartitionTable.empty(partitions, 0)
    p = table.partition_of(vhost, name)
    assert 0 <= p < partitions
    assert p == hash_partition(vhost, name, partitions)


def test_the_hash_is_crc32_of_vhost_nul_name() -> None:
    import zlib

    assert PartitionTable.empty(9, 2).partition_of("/", "orders") == \
        zlib.crc32(b"/\0orders") % 9
    # the NUL keeps ("a", "bc") and ("ab", "c") apart
    assert hash_partition("a", "bc", 1 << 30) != hash_partition("ab", "c", 1 << 30)


def test_a_pin_names_the_partition() -> None:
    table = PartitionTable.empty(9, 2)
    assert table.partition_of("/", "orders", pinned=4) == 4
    assert check_pin(0, 9) == 0 and check_pin(8, 9) == 8


@pytest.mark.parametrize("value", [9, -1, 100, True, "3", 2.0, b"1"])
def test_a_bad_pin_is_a_406(value: object) -> None:
    with pytest.raises(PartitionPinError, match="x-partition") as info:
        PartitionTable.empty(9, 2).partition_of("/", "q", pinned=value)
    assert info.value.reply_code == PRECONDITION_FAILED == 406


def test_no_table_no_partition() -> None:
    with pytest.raises(PartitionTableError):
        PartitionTable().partition_of("/", "q")


# -- operational partitions ------------------------------------------------------------------


def test_with_three_nodes_any_minority_may_go() -> None:
    table = placed(names(3), 9, 2)
    assert all(table.operational(["n1", "n2"]))
    assert not any(table.operational(["n1"]))
    assert table.stopped_by("n2") == []
    assert table.stopped_by("n2", alive=["n1", "n2"]) == list(range(9))


def test_with_five_nodes_a_partition_survives_one_of_its_three_cells() -> None:
    nodes = names(5)
    table = placed(nodes, 15, 2)
    for node in nodes:
        assert table.stopped_by(node) == []
    stopped = table.stopped_by("n2", alive=[n for n in nodes if n != "n1"])
    assert stopped == [p for p in range(15) if {"n1", "n2"} <= set(table.voting(p))]
    assert stopped  # two nodes share cells of some partitions


def test_learners_and_corrupted_cells_do_not_count() -> None:
    table = PartitionTable(3, 2, [[Cell("a", U), Cell("b", OUT), Cell("c", C), Cell("d", F)]])
    assert table.voting(0) == ["a", "d"]
    assert table.operational(["a", "d"]) == [True]
    assert table.operational(["a", "b", "c"]) == [False]  # 1 of 2 voting cells


def test_a_row_with_two_cells_on_one_node_is_refused() -> None:
    with pytest.raises(PartitionTableError, match="two cells"):
        PartitionTable(1, 1, [[Cell("a", U), Cell("a", OUT)]])


def test_the_wire_forms_round_trip() -> None:
    table = placed(names(4), 7, 2)
    assert PartitionTable.from_wire(*table.as_wire()) == table
    change = table.tweak(names(4), exclude=["n3"])
    assert change is not None
    assert PartitionChange.from_wire(*change.as_wire()) == change
