"""The partition table's coordinator in the HA simulation (issue 35, ``--workload table``).

``brokerha/partition/simulation.py``: every node runs the product's
``TableCoordinator``; through crashes, pauses, partitions and failovers an
operator drains nodes, brings them back and marks learners caught up on the
serving primary. A committed ptid has one table (a), is never lost (b), a
node's table leaves its line only by a catch-up replacing a deposed
primary's uncommitted change (c), every node ends with the primary's table
(d), and the table is made once (e). About 0.1-0.25 s a seed on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from brokerha.partition.coordinator import TableCoordinator
from brokerha.partition.simulation import (
    CATCHES,
    TableSimulation,
    Unsafe,
    run_many,
    run_seed,
)
from tests.seeds import first_failing, totals

SEEDS = 20


def test_every_node_runs_the_products_coordinator() -> None:
    sim = TableSimulation(0)
    sim.start()
    assert all(isinstance(layer, TableCoordinator) and layer is sim.coordinators[name]
               for name, node in sim.nodes.items() for layer in node.ha.layers)


def test_seeds_of_table_changes_through_failovers_have_no_violation() -> None:
    results = run_many(range(SEEDS), jobs=2)
    assert [r.summary() for r in results if r.violation] == []
    assert not any(r.stuck for r in results)
    seen = totals(results)
    # one table made per seed, then the operator's changes, nearly all of them committed,
    # through failovers and crashes; some seeds saw a deposed primary's uncommitted change
    # replaced by its catch-up (c)
    assert seen["created"] == SEEDS
    assert seen["changes"] > 30 * SEEDS and seen["committed"] > 0.9 * seen["changes"]
    assert min(seen["drain"], seen["back"], seen["replicated"]) > 5 * SEEDS
    assert seen["failover"] > SEEDS and seen["crash"] > SEEDS
    assert seen["replaced"] > 0


@pytest.mark.parametrize("seeds", [4, pytest.param(100, marks=pytest.mark.slow)])
def test_seeds_of_five_nodes_have_no_violation(seeds: int) -> None:
    results = run_many(range(20_000, 20_000 + seeds), jobs=2, nodes=5)
    assert [r.summary() for r in results if r.violation] == []
    seen = totals(results)
    assert seen["committed"] > 30 * seeds and seen["failover"] > seeds


@pytest.mark.slow
def test_many_seeds_of_table_changes_have_no_violation() -> None:
    results = run_many(range(1_000, 1_500), jobs=2)
    assert [r.summary() for r in results if r.violation] == []
    assert totals(results)["replaced"] > 50


def test_a_new_primary_recreating_the_table_is_caught() -> None:
    found = first_failing(run_seed, Unsafe(recreate_table=True), range(5))
    assert found is not None and "(e)" in found[1], found


def test_a_backup_keeping_its_table_over_the_catch_up_is_caught() -> None:
    # a deposed primary's uncommitted change survives the catch-up's ps of no higher ptid
    found = first_failing(run_seed, Unsafe(keep_own_table=True), range(20))
    assert found is not None and ("(a)" in found[1] or "(d)" in found[1]), found


def test_a_confirm_without_the_quorum_loses_a_committed_table() -> None:
    found = first_failing(run_seed, Unsafe(confirm_early=True), range(20))
    assert found is not None and "(b)" in found[1], found


@pytest.mark.slow
def test_an_acknowledgement_before_the_sync_loses_a_committed_table() -> None:
    found = first_failing(run_seed, Unsafe(early_ack=True), range(200))
    assert found is not None and any(f"({c})" in found[1] for c in "abc"), found


def test_the_workload_names_what_it_catches() -> None:
    assert set(CATCHES) == {"recreate_table", "keep_own_table", "confirm_early", "early_ack"}
    assert set(CATCHES) <= set(Unsafe.names())


def test_the_command_line_runs_the_table_workload_and_reproduces_a_seed() -> None:
    unsafe = Unsafe(keep_own_table=True)
    found = first_failing(run_seed, unsafe, range(20))
    assert found is not None
    here = run_seed(found[0], unsafe=unsafe)
    out = subprocess.run([sys.executable, "-m", "brokerha.cli", "cluster", "simulate",
                          "--workload", "table", "--jobs", "1", "--start-seed", str(found[0]),
                          "--seeds", "1", "--unsafe", "keep_own_table", "--trace"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert here.violation is not None and here.violation in lines[0]
    assert lines[1:len(here.trace) + 1] == ["    " + t for t in here.trace]
    assert "table: seeds 1, violations 1" in out.stdout
