"""Cross-partition commit, simulated (``brokerha/partition/xtx_simulation.py``, ``--workload xtx``).

Three partitions whose primaries fail over (a new one keeps what was durable
on its majority; the deposed one runs on a while, nothing it writes durable),
three coordinators that crash between the rounds and
stall, packets lost and late: (a) no gtxid committed in one partition and
rolled back in another, (b) every answer backed by a durable record, (c)
nothing in doubt once the faults stop, (d) committed everywhere or nowhere;
a third of the commits are XA prepares held for a TM that decides later from
any coordinator: (f) none is rolled back without its TM, its commit commits.
Each rule of ``partition.xtx.Unsafe`` broken is caught in the first seeds.
About 0.05 s a seed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from brokerha.partition.xtx_simulation import (
    CATCHES,
    Unsafe,
    XtxSimulation,
    run_many,
    run_seed,
)
from tests.seeds import first_failing, totals

SEEDS = 40


def test_a_seed_replays_exactly() -> None:
    first, again = run_seed(7, trace=True), run_seed(7, trace=True)
    assert first.trace and first.trace == again.trace and first.stats == again.stats


def test_seeds_of_cross_partition_commits_through_faults_have_no_violation() -> None:
    results = run_many(range(SEEDS), jobs=2)
    assert [r.summary() for r in results if r.violation] == []
    seen = totals(results)
    # transactions over 1, 2 and 3 partitions, most of them committed everywhere
    assert min(seen[f"over {n} partitions"] for n in (1, 2, 3)) > 20 * SEEDS
    assert seen["commit-ok"] + seen["xa held for the TM"] > 0.5 * seen["begun"]
    # XA: prepares held for their TM, whose commits and rollbacks came through any
    # coordinator (again through another when that one died), participants told to wait
    # (rule c), what a dead coordinator left held rolled back by the TM's recovery
    assert seen["xa held for the TM"] > 20 * SEEDS
    assert seen["tm answered committed"] > 10 * SEEDS and seen["tm answered rolled back"] > SEEDS
    assert seen["xa outcome asked: prepared"] > 10 * SEEDS and seen["tm asks again"] > SEEDS
    assert seen["tm recovery rolls back"] > 0
    # the faults the protocol must ride out happened, and each path was taken: failovers
    # losing undurable records, coordinators lost between the rounds, participants in
    # doubt resolved by asking (both answers), late commits refused by a tombstone, a
    # tombstone written with no branch, prepares refused
    assert seen["failover"] > 5 * SEEDS and seen["undurable records lost"] > 0
    assert seen["coordinator crash between the rounds"] > 5 * SEEDS
    assert seen["coordinator stall"] > SEEDS
    assert seen["outcome asked: committed"] > SEEDS and seen["outcome asked: rolled back"] > SEEDS
    assert seen["refused: the decision partition had rolled it back"] > 0
    assert seen["rollback of absent"] > 0 and seen["refused: a no vote"] > 0
    # deposed primaries ran on a while: packets reached them, their prepares failed
    assert seen["packets to a deposed primary"] > SEEDS
    assert seen["prepare failed on a deposed primary"] > SEEDS


def test_without_faults_every_commit_is_answered_and_only_a_no_vote_refuses() -> None:
    results = run_many(range(5), faults=False)
    assert [r.summary() for r in results if r.violation] == []
    seen = totals(results)
    assert seen["unanswered"] == 0 and seen["outcome asked: rolled back"] == 0
    assert seen["refused"] == seen["refused: a no vote"] > 0
    assert seen["begun"] == seen["commit-ok"] + seen["refused"] + seen["xa held for the TM"]
    assert seen["tm answered committed"] + seen["tm answered rolled back"] == seen[
        "xa held for the TM"]
    assert seen["committed everywhere"] == seen["commit-ok"] + seen["tm answered committed"]


@pytest.mark.parametrize("seeds", [3, pytest.param(200, marks=pytest.mark.slow)])
def test_five_partitions_and_five_coordinators_have_no_violation(seeds: int) -> None:
    results = run_many(range(50_000, 50_000 + seeds), partitions=5, coordinators=5)
    assert [r.summary() for r in results if r.violation] == []
    assert totals(results)["commit-ok"] > 100 * seeds


@pytest.mark.slow
def test_many_seeds_have_no_violation() -> None:
    results = run_many(range(1_000, 3_000), jobs=2)
    assert [r.summary() for r in results if r.violation] == []


def test_commit_before_the_decision_is_durable_is_caught() -> None:
    # rule (a) broken: a participant commits, the coordinator dies before the decider heard
    # XDecide, the decider's own undecided branch is rolled back: (a) in the first seed
    found = first_failing(run_seed, Unsafe(commit_before_decision=True), range(3))
    assert found is not None and found[0] == 0 and "(a)" in found[1], found


def test_an_abort_answered_without_being_written_is_caught() -> None:
    # rule (b) broken: the decider answers "rolled back" without its tombstone; (b) sees
    # the answer no durable record backs, in the first seed
    found = first_failing(run_seed, Unsafe(presume_without_tombstone=True), range(3))
    assert found is not None and found[0] == 0 and "(b) p" in found[1], found


def test_an_abort_answered_without_being_written_loses_agreement() -> None:
    # the same, with only (a) checked: the late XDecide(commit) commits at the decider what
    # a participant rolled back on its answer
    found = first_failing(run_seed, Unsafe(presume_without_tombstone=True), range(10),
                          check_answers=False)
    assert found is not None and "(a)" in found[1], found


BROKERS = (0, 1, 2)  # every partition's primary the product's (BrokerPartition)


@pytest.mark.parametrize("seeds", [10, pytest.param(200, marks=pytest.mark.slow)])
def test_the_workload_over_the_products_brokers_has_no_violation(seeds: int) -> None:
    """Each partition's primary a ``Broker`` with ``BrokerTransactions`` over a simulated
    disk, restored from it at each failover and verified (``primary/verification.py``):
    (a)-(d), and (e) its queue holds exactly the committed transactions' messages."""
    results = run_many(range(seeds), jobs=2, brokers=BROKERS)
    assert [r.summary() for r in results if r.violation] == []
    seen = totals(results)
    assert seen["commit-ok"] + seen["xa held for the TM"] > 0.5 * seen["begun"]
    assert seen["failover"] > 5 * seeds and seen["tm answered committed"] > 10 * seeds
    assert seen["broker partition messages"] > 100 * seeds  # (e) counted them
    # a restored primary's verification kept its prepared branches for DecisionRules, which
    # asked their decider; deposed primaries' prepares failed
    assert seen["verification: resolve"] > seeds and seen["outcome asked: committed"] > seeds
    assert seen["prepare failed on a deposed primary"] > seeds
    assert seen["refused: a no vote"] > 0 and seen["unanswered"] > 0
    assert seen["undurable writes lost"] > 0 and seen["undurable writes kept"] > 0


def test_a_seed_over_the_products_brokers_replays_exactly() -> None:
    first, again = run_seed(3, trace=True, brokers=(0,)), run_seed(3, trace=True, brokers=(0,))
    assert first.trace and first.trace == again.trace and first.stats == again.stats


def test_a_held_xa_transaction_decided_without_its_tm_is_caught() -> None:
    # rule (c) broken: the decider's timeout rolls back its own branch of a transaction
    # held for its TM (XA_OK answered), or it answers a participant's XOutcome with a
    # tombstone: (f) in the first seed
    found = first_failing(run_seed, Unsafe(presume_held_abort=True), range(3))
    assert found is not None and found[0] == 0 and "(f)" in found[1], found
    assert "held for its TM, rolled back" in found[1]


@pytest.mark.parametrize("rule,check", [("commit_before_decision", "(a)"),
                                        ("presume_without_tombstone", "(b) p"),
                                        ("presume_held_abort", "(f)")])
def test_each_rule_broken_is_caught_over_the_products_brokers(rule: str, check: str) -> None:
    found = first_failing(run_seed, Unsafe(**{rule: True}), range(3), brokers=BROKERS)
    assert found is not None and found[0] == 0 and check in found[1], found


def test_a_decided_record_a_failover_left_held_is_caught_if_never_rewritten() -> None:
    # bounded memory broken: a failover kept a held transaction's decision and lost its
    # record's rewrite "decided" (the next entry of the log); nothing rewrites it again,
    # so it stays apart for good: (g) once the rest settled
    found = first_failing(run_seed, Unsafe(keep_decided_holds=True), range(60))
    assert found is not None and "(g) all-prepared records kept apart" in found[1], found


def test_the_workload_names_what_it_catches() -> None:
    assert set(CATCHES) == {"commit_before_decision", "presume_without_tombstone",
                            "presume_held_abort", "keep_decided_holds"}
    assert XtxSimulation(0).parts[0].rules is not None


def test_the_command_line_runs_the_xtx_workload_and_reproduces_a_seed() -> None:
    unsafe = Unsafe(presume_without_tombstone=True)
    here = run_seed(0, unsafe=unsafe)
    assert here.violation is not None
    out = subprocess.run([sys.executable, "-m", "brokerha.cli", "cluster", "simulate",
                          "--workload", "xtx", "--jobs", "1", "--seeds", "1",
                          "--unsafe", "presume_without_tombstone", "--trace"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert here.violation in lines[0]
    assert lines[1:len(here.trace) + 1] == ["    " + t for t in here.trace]
    assert "xtx: seeds 1, violations 1" in out.stdout


def test_the_command_line_runs_the_workload_on_the_products_brokers() -> None:
    out = subprocess.run([sys.executable, "-m", "brokerha.cli", "cluster", "simulate",
                          "--workload", "xtx", "--jobs", "1", "--seeds", "2", "--on-brokers"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "xtx: seeds 2, violations 0" in out.stdout
    assert run_seed(0, brokers="all").stats == run_seed(0, brokers=(0, 1, 2)).stats
