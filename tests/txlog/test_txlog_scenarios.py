"""One counter-example per safety rule: it fails with the rule off and passes with all on."""

import pytest

from brokerha.txlog.engine.rules import Rules
from brokerha.txlog.simulation.scenarios import (
    clock_step_back,
    kept_both_sides,
    no_fault_divergence,
    perturbed,
    relayed_from_dropped_master,
)


def test_no_fault_divergence_needs_add_with_every_member() -> None:
    unsafe = no_fault_divergence(Rules.without(["full"]))
    assert unsafe.violation and unsafe.violation.startswith("S1 prefix")
    assert unsafe.ended_ms < 500  # within half a second, with no fault at all
    assert no_fault_divergence(Rules()).violation is None


def test_clock_step_back_needs_the_lamport_counter() -> None:
    assert (clock_step_back(Rules.without(["lamport"])).violation or "").startswith("S1 prefix")
    assert clock_step_back(Rules()).violation is None


def test_master_that_kept_both_sides_needs_views() -> None:
    assert (kept_both_sides(Rules.without(["view"])).violation or "").startswith("S1 prefix")
    assert kept_both_sides(Rules()).violation is None


def test_tx_relayed_from_a_dropped_master_needs_the_origin_rule() -> None:
    assert (relayed_from_dropped_master(Rules.without(["origin"])).violation or "").startswith("S1 prefix")
    assert relayed_from_dropped_master(Rules()).violation is None


def test_every_scenario_is_safe_and_converges_with_all_rules() -> None:
    for scenario in (no_fault_divergence, clock_step_back, kept_both_sides, relayed_from_dropped_master):
        result = scenario(Rules())
        assert result.violation is None
        assert len({tuple(m.durable.sync.ids()) for m in result.masters.values()}) == 1


@pytest.mark.parametrize("rule", ["full", "lamport", "view", "origin"])
def test_perturbed_variants_fail_with_the_rule_off_and_never_with_all_on(rule: str) -> None:
    """Every scheduled event moved by up to 5 ms: the counter-example is not a knife edge."""
    assert perturbed(rule, 20, 5, Rules.without([rule]))
    assert perturbed(rule, 20, 5, Rules()) == []
