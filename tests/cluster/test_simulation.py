"""The deterministic simulation of election + replication: safe over many seeds, and with teeth."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from brokerha.cluster.election import NewEpoch
from brokerha.cluster.simulation import (
    Faults,
    Simulation,
    Unsafe,
    Violation,
    run_many,
    run_seed,
)

CI_SEEDS = 1000


def test_a_thousand_seeds_of_three_nodes_have_no_violation() -> None:
    results = run_many(range(CI_SEEDS), jobs=2)
    assert [r.summary() for r in results if r.violation] == []
    # the runs did exercise what they claim to: failovers, confirms, bounded unavailability
    assert sum(r.failovers for r in results) > CI_SEEDS
    assert sum(r.confirmed for r in results) > 50 * CI_SEEDS
    assert sum(r.unserved for r in results) / CI_SEEDS < 0.25 * 60.0
    assert sum(r.overlap for r in results) > 0  # see the next test


def test_a_deposed_primary_that_still_serves_loses_nothing_confirmed() -> None:
    """The case the fast election allows: a successor elected within the old lease.

    Busy clients, so that some calls reach the deposed primary in that moment:
    what it takes is never confirmed (its backups left its epoch), and (b) bounds
    how long it serves.
    """
    results = run_many(range(500), jobs=2, publish_rate=20.0, consume_rate=16.0)
    assert [r.summary() for r in results if r.violation] == []
    assert sum(r.deposed_calls for r in results) > 0
    assert sum(r.overlap for r in results) < 0.01 * 500 * 60.0


def test_a_hundred_seeds_of_five_nodes_have_no_violation() -> None:
    results = run_many(range(10_000, 10_100), jobs=2, nodes=5)
    assert [r.summary() for r in results if r.violation] == []


def test_a_healthy_cluster_elects_once_and_confirms_everything() -> None:
    result = run_seed(7, faults=Faults.none())
    assert result.violation is None and result.failovers == 0
    timing = Simulation(7).timing
    assert result.unserved < 1.5 * timing.election_timeout + 0.5  # the first election only
    assert result.published > 0 and result.confirmed >= result.published - 1


def first_failing(unsafe: Unsafe, seeds: range, **kw: object) -> tuple[int, str] | None:
    for seed in seeds:
        result = run_seed(seed, unsafe=unsafe, **kw)  # type: ignore[arg-type]
        if result.violation:
            return seed, result.violation
    return None


@pytest.mark.parametrize(("rule", "invariant", "kw"), [
    ("confirm_early", "(c)", {}),
    ("invalid_grants", "(c)", {}),
    ("no_lease", "(b)", {}),
    ("skip_catch_up", "(d)", {}),
    ("old_epoch_apply", "(e)", {}),
])
def test_the_checker_catches_a_broken_rule(rule: str, invariant: str, kw: dict[str, float]) -> None:
    found = first_failing(Unsafe.of([rule]), range(400), **kw)
    assert found is not None, f"no seed breaks an invariant with {rule} off"
    seed, violation = found
    assert violation.startswith(invariant), violation
    assert run_seed(seed, **kw).violation is None  # the same seed is safe with every rule


def test_a_seed_is_reproduced_by_its_number() -> None:
    first, again = run_seed(4242), run_seed(4242)
    assert first.trace_hash == again.trace_hash and first.trace == again.trace
    assert (first.published, first.confirmed, first.events) == (again.published, again.confirmed,
                                                                again.events)
    assert run_seed(4243).trace_hash != first.trace_hash


def test_a_seed_is_reproduced_in_another_process() -> None:
    code = ("from brokerha.cluster.simulation import run_seed; "
            "print(run_seed(99, nodes=5, duration=20).trace_hash)")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=os.getcwd())
    assert out.stdout.strip() == run_seed(99, nodes=5, duration=20).trace_hash


def test_a_violation_names_the_seed_and_ends_the_trace() -> None:
    found = first_failing(Unsafe(confirm_early=True), range(400))
    assert found is not None
    result = run_seed(found[0], unsafe=Unsafe(confirm_early=True))
    assert f"seed {found[0]}" in result.summary() and "VIOLATION" in result.summary()
    assert result.trace[-1].endswith(result.violation or "-")


# ---- the checker itself, on hand-made states ----------------------------------------------


def settled(unsafe: Unsafe | None = None) -> Simulation:
    sim = Simulation(3, faults=Faults.none(), duration=8.0, unsafe=unsafe)
    assert sim.run().violation is None
    return sim


def test_the_checker_reports_two_primaries_in_one_epoch() -> None:
    sim = settled()
    primary = sim._serving
    assert primary is not None
    other = next(n for n in sim.nodes.values() if n is not primary)
    with pytest.raises(Violation, match=r"^\(a\) two primaries"):
        sim._become_primary(other, primary.prim.epoch)  # type: ignore[union-attr]


def test_the_checker_reports_a_lost_confirmed_message() -> None:
    sim = settled()
    primary = sim._serving
    assert primary is not None and sim.confirmed_live
    primary.durable.held.pop(min(sim.confirmed_live))
    with pytest.raises(Violation, match=r"^\(c\) confirmed messages"):
        sim._check_confirmed(primary)


def test_a_backup_refuses_events_of_an_older_epoch_and_the_checker_reports_one_applied() -> None:
    for unsafe in (Unsafe(), Unsafe(old_epoch_apply=True)):
        sim = settled(unsafe)
        primary = sim._serving
        assert primary is not None and primary.prim is not None
        backup = next(n for n in sim.nodes.values() if n is not primary)
        assert backup.following is not None and backup.following.caught_up
        epoch, nonce, seq = primary.prim.epoch, backup.following.nonce, backup.durable.position.seq
        sim.carry_out(backup, backup.election.receive(sim.now, primary.name,  # type: ignore[union-attr]
                                                      NewEpoch(epoch + 1, primary.name)))
        event = ("ev", epoch, nonce, seq + 1, True, 10_000)
        if unsafe.old_epoch_apply:
            with pytest.raises(Violation, match=r"^\(e\)"):
                sim._on_stream(backup, primary.name, event)
        else:
            sim._on_stream(backup, primary.name, event)
            assert 10_000 not in backup.durable.held and backup.durable.position.seq == seq


@pytest.mark.slow
def test_ten_thousand_seeds_of_three_nodes_and_two_thousand_of_five_have_no_violation() -> None:
    results = run_many(range(10_000), jobs=os.cpu_count() or 2)
    results += run_many(range(100_000, 102_000), jobs=os.cpu_count() or 2, nodes=5)
    assert [r.summary() for r in results if r.violation] == []
