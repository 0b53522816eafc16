"""The confirm simulation with the queue's ``ha-replicate`` changed mid-run (issue 34).

``brokerha/ha/simulation/policy_change.py``: through crashes, pauses, partitions
and failovers, an operator changes the client's queue between ``all``,
``configuration`` and ``none`` on the serving primary; what was confirmed under
``all``, and what the primary held when it reported a change to ``all`` applied,
is never lost. About 0.25 s a seed on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest

from brokerha.ha.simulation.confirms import SimResult
from brokerha.ha.simulation.policy_change import (
    PolicyChangeSimulation,
    run_many,
    run_policy_seed,
)
from brokerha.primary.primary import Primary
from tests.seeds import first_failing

SEEDS = 30


def totals(results: list[SimResult]) -> dict[str, int]:
    out = {"changes": 0, "applied": 0, "protected": 0}
    for r in results:
        for key in out:
            out[key] += r.policy[key]  # type: ignore[attr-defined]
    return out


def test_seeds_with_ha_replicate_changes_have_no_violation() -> None:
    results = run_many(range(SEEDS), jobs=2)
    assert [r.summary() for r in results if r.violation] == []
    seen = totals(results)
    # changes to all were applied (the backups joined again) and then promised messages
    # that were confirmed before them; failovers came after some of them
    assert seen["applied"] > SEEDS and seen["protected"] > 5 * SEEDS
    assert sum(r.failovers for r in results) > SEEDS
    assert sum(r.confirmed for r in results) > 50 * SEEDS


@pytest.mark.parametrize("seeds", [10, pytest.param(200, marks=pytest.mark.slow)])
def test_seeds_of_five_nodes_with_ha_replicate_changes_have_no_violation(seeds: int) -> None:
    results = run_many(range(20_000, 20_000 + seeds), jobs=2, nodes=5)
    assert [r.summary() for r in results if r.violation] == []
    assert totals(results)["applied"] > 0


@pytest.mark.slow
def test_many_seeds_with_ha_replicate_changes_have_no_violation() -> None:
    results = run_many(range(1_000, 3_000), jobs=2)
    assert [r.summary() for r in results if r.violation] == []


class AppliedWithoutJoins(Primary):
    """Broken on purpose: the backups are taken as holding a queue now replicated whole
    without joining again (the change reported applied once its events are replicated)."""

    def _ask_rejoin(self, stale: list[str]) -> None:
        for node in stale:
            self.sessions[node].replicate_gen = self._replicate_gen
        self._advance_changes()


class Broken(PolicyChangeSimulation):
    def make_primary(self, *args: Any, **kw: Any) -> Primary:
        return AppliedWithoutJoins(*args, **self.paced(kw))


def run_broken_seed(seed: int, **kw: Any) -> SimResult:
    from brokerha.ha.simulation.confirms import quietly

    return quietly(Broken(seed, **kw))


def test_the_checker_catches_a_change_applied_before_the_backups_hold_the_queue() -> None:
    found = first_failing(run_broken_seed, None, range(40))
    assert found is not None, "no seed catches a change to all applied without the joins"
    seed, violation = found
    assert violation.startswith(("(c)", "(d)")), violation
    assert run_policy_seed(seed).violation is None
