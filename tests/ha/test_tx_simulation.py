"""The transaction simulation (ha/simulation/transactions.py): safe over many seeds, with teeth."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from brokerha.ha.simulation.transactions import (
    TRACE_TAIL,
    SimResult,
    Unsafe,
    run_many,
    run_seed,
    small_bounds,
)
from tests.seeds import first_failing, totals

CI_SEEDS = 50  # 30 virtual seconds each: about 6.5 failovers and 80 transactions a seed
# (``-m slow``: the 3,000 after them, the former CI counts of 100 and 300 among them);
# each rule broken on purpose is caught by seed 3 (test_the_checker_catches_*), and no
# seed of the 50 ends stuck (the check below allows none under 100 seeds)
# A defect of the product the simulation found, not fixed yet: the streamed catch-up
# (primary/catch_up.py, af236b7) walks a queue after the join, so a commit made after the
# join but before the walk is already in the backup's queue when it acknowledges the
# CaughtUp marker, its outcome still on its way: a backup at a valid position that misses
# a message (seeds 138 and 703 of 1,000 at 40049d1). Reported as an expected failure until
# it is fixed; any other violation fails.
def assert_atomic_and_exercised(results: list[SimResult]) -> Counter[str]:
    """No violation, few runs stuck, and the runs did exercise what they claim to; the
    totals of their stats."""
    seeds = len(results)
    assert [r.summary() for r in results if r.violation] == []
    # liveness, not safety (docs/ha.md "Simulation"): a run may end with nobody electable
    assert sum(1 for r in results if r.stuck) < seeds // 50
    seen = totals(results)
    # real elections, crashes, both kinds of client
    assert seen["failover"] > 3 * seeds and seen["crash"] > seeds
    assert seen["commit-ok"] > 10 * seeds and seen["xa committed"] > 2 * seeds
    # prepared records are XA branches only (a TX has no vote round, docs/ha.md)
    assert seen["verify in doubt"] > seeds and seen["verify rollback"] == 0
    # big commits (sliced) ran, and (f) held over the fault-free stretches
    assert seen["big commit"] > 1.5 * seeds and seen["stable seconds"] > 3 * seeds
    # odd seeds: TX content past the tc's room went ahead as te events (SMALL_TC_ROOM)
    assert seen["tx content ahead"] > seeds
    assert_big_work_exercised(results)
    return seen


def assert_big_work_exercised(results: list[SimResult]) -> None:
    """Seeds 2 and 3 of every 4 run with the bounds of big work small (``small_bounds``):
    the backups applied commits in slices, bodies came in parts, flushes left live events
    for the next turn, and faults landed in the middle of it all (issue 33's paths)."""
    small = [r for r in results if small_bounds(r.seed)]
    n = len(small)
    work = totals(small)
    assert work["sliced commits"] > 20 * n and work["commit slices"] > 5 * work["sliced commits"]
    assert work["body parts"] > 200 * n and work["catch-up parts"] > 100 * n
    assert work["split flushes"] > 20 * n
    # a backup crashed mid-commit, or holding some parts of a message; some were elected
    # mid-commit, or joined again or followed another primary, and applied the rest first
    # (Backup.settle)
    assert work["crashed mid-commit"] > n / 2 and work["crashed between parts"] > n / 10
    assert work["promoted mid-commit"] > n / 10 and work["settled mid-commit"] > 0
    assert work["aimed faults"] > 2 * n
    # none of it with the product's bounds, which these small transactions never reach
    assert "sliced commits" not in totals([r for r in results if not small_bounds(r.seed)])


def test_seeds_keep_every_transaction_atomic_agreed_and_durable() -> None:
    assert_atomic_and_exercised(run_many(range(CI_SEEDS), jobs=2))


@pytest.mark.parametrize(("rule", "says"), [
    # a backup acknowledges (its yes vote included) before its store synced: the ack
    # promises a floor or a commit its disk does not hold (on_ack); or it crashes, comes back without
    # the transaction, and is elected (ha/core.py); or, without the prepared record, holds
    # a committed branch in doubt for good
    ("early_ack", "above its stored vote floor|but its disk lacks|not committed on the "
                  "primary|is reported ready but lacks|never settled: .* TxTrackers"),
    # no TxTrackers: a backup that joined during the prepare is ready without the
    # commit (ha/core.py)
    ("no_tx_trackers", "is reported ready but lacks"),
    # the node shell's race (issue 32): the role read from a flag a task clears later,
    # connections admitted meanwhile never closed, no durability gate: a deposed node
    # answers commit-ok on its own fsync, or an XA branch it dropped with the role
    # (ha/admission.py, ha/member.py)
    ("lagging_role", r"is not committed on the primary|\(backup\): not atomic|answered XAER_NOTA"),
])
def test_the_checker_catches_a_broken_rule_of_the_product(rule: str, says: str) -> None:
    found = first_failing(run_seed, Unsafe.of([rule]), range(300))
    assert found is not None, f"no seed breaks an invariant with {rule} off"
    seed, violation = found
    assert re.search(says, violation), violation
    assert run_seed(seed).violation is None  # the same seed, the rule kept: no violation


@pytest.mark.parametrize(("rule", "says"), [
    # the backup's stored position stays valid while a commit is half applied: a sync
    # (and a crash) mid-commit leaves part of a transaction on its disk at a valid position
    ("position_valid_mid_commit", r"disk at \(\d+, \d+\): not atomic"),
    # the commit's seq acknowledged at its first slice: the ack promises what the disk
    # does not hold yet (the primary may answer commit-ok on it)
    ("ack_before_last_slice", r"acknowledged seq \d+ of epoch \d+, but its disk lacks"),
    # a backup elected mid-commit serves without applying the rest of it first
    ("unsettled_promotion", r"not atomic"),
    # an ack sent mid-commit (of what came before the tc) leaves the stored vote floor
    # below it: after a crash the node votes for a primary without it (seed 1512's loss)
    ("floor_behind_ack", r"above its stored vote floor"),
])
def test_the_checker_catches_a_broken_rule_of_the_sliced_commit(rule: str, says: str) -> None:
    """Issue 33's commit in slices on a backup, each of its rules broken
    (``ha/core.py``): caught in the first seeds with the bounds of big work small."""
    found = first_failing(run_seed, Unsafe.of([rule]), range(40))
    assert found is not None, f"no seed breaks an invariant with {rule} off"
    seed, violation = found
    assert small_bounds(seed) and seed < 12, (seed, violation)
    assert re.search(says, violation), violation
    assert run_seed(seed).violation is None


def test_the_stability_invariant_catches_a_big_commit_in_one_step() -> None:
    """A big transaction's commit (0.2-1.5 s of the primary's CPU) done in one step, not in
    slices that yield to the loop: the lease runs out while every node and link is up."""
    found = first_failing(run_seed, Unsafe(), range(20), unsliced=True)
    assert found is not None, "no seed caught a big commit in one step"
    seed, violation = found
    assert re.match(rf"seed {seed}: \(f\) .*(took epoch|stopped serving)", violation), violation
    assert run_seed(seed).violation is None


def test_a_violation_names_the_seed_and_ends_the_trace() -> None:
    found = first_failing(run_seed, Unsafe(no_tx_trackers=True), range(300))
    assert found is not None
    result = run_seed(found[0], unsafe=Unsafe(no_tx_trackers=True))
    assert result.violation is not None and result.violation.startswith(f"seed {found[0]}: ")
    assert 0 < len(result.trace) <= TRACE_TAIL
    assert result.trace[-1].endswith(result.violation)


def test_a_seed_is_reproduced_by_its_number_in_another_process() -> None:
    found = first_failing(run_seed, Unsafe(no_tx_trackers=True), range(300))
    assert found is not None
    here = run_seed(found[0], unsafe=Unsafe(no_tx_trackers=True))
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-m", "brokerha.cli", "cluster", "simulate",
                          "--workload", "transactions", "--start-seed", str(found[0]),
                          "--seeds", "1", "--jobs", "1", "--unsafe", "no_tx_trackers", "--trace"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert here.violation is not None and here.violation in lines[0]
    assert lines[1:len(here.trace) + 1] == ["    " + t for t in here.trace]


def test_a_healthy_run_commits_and_ends_with_every_node_equal() -> None:
    result = run_seed(3)
    assert result.violation is None and result.stuck is None
    assert result.stats["committed"] > 10 and result.stats["transactions"] > 30


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_three_thousand_seeds_keep_every_transaction_atomic_agreed_and_durable() -> None:
    seen = assert_atomic_and_exercised(run_many(range(CI_SEEDS, CI_SEEDS + 3_000),
                                                jobs=os.cpu_count() or 2))
    assert seen["verify commit"] > 0
