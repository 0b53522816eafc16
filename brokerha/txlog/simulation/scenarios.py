"""Scripted counter-examples, one per safety rule (design/txlog-safety.md).

Each scenario is a fixed schedule on the simulation (no random faults, no
clock skew unless the scenario is about clocks).  With its rule off the
simulation reports a violation; with every rule on it passes and converges.
The random search (``brokerha txlog simulate --unsafe RULE``) finds the same
kinds of counter-examples on its own for ``full`` and ``view``; the scenarios
for ``lamport`` and ``origin`` need a relay that forgets (a restart) *and* a
post delivered late, which random faults rarely combine, so they are
scripted here.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

from brokerha.txlog.engine.rules import Rules
from brokerha.txlog.simulation.simulation import SimParams, SimResult, Simulation

A, B, C = "dc1", "dc2", "dc3"


class _Shifted:
    """A simulation whose scheduled events move by up to ``spread`` ms (perturbed variants)."""

    def __init__(self, sim: Simulation, rng: random.Random, spread: int) -> None:
        self._sim, self._rng, self._spread = sim, rng, spread

    def at(self, when: int, action: Callable[[], None]) -> None:
        self._sim.at(max(0, when + self._rng.randint(-self._spread, self._spread)), action)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sim, name)


def _run(
    build: Callable[[Simulation], None], rules: Rules, heal_at: int, variant: int | None = None, spread: int = 0
) -> SimResult:
    params = SimParams(heal_at_ms=heal_at, max_peer_lag_ms=1_200)
    sim = Simulation(variant or 0, params, rules)
    if variant is None:
        build(sim)
    else:
        build(_Shifted(sim, random.Random(f"variant-{variant}"), spread))  # type: ignore[arg-type]
    sim.at(heal_at, sim.heal)
    problem = sim.run(heal_at) or sim.run_to_convergence()
    return sim.result(problem)


def no_fault_divergence(rules: Rules, variant: int | None = None, spread: int = 0) -> SimResult:
    """F1: 3 masters, 40 ms one way, timeout 160 ms, four transactions, no fault at all.

    Found by the simulation (seed 24 of a search over transaction placements):
    an early ADD makes the others' posts carry another merge base, their
    rounds time out, and a timed-out round ADDs with the last known counter
    of the master that moved on.
    """

    def build(sim: Simulation) -> None:
        for at, m in ((85, A), (86, C), (93, A), (196, C)):
            sim.at(at, functools.partial(sim.transaction, m))

    return _run(build, rules, heal_at=600, variant=variant, spread=spread)


def clock_step_back(rules: Rules, variant: int | None = None, spread: int = 0) -> SimResult:
    """F2: a counter that follows the wall clock back lets a new tx slip under a posted counter.

    dc1 posts counter 140 (with dc3's tx u, ts 100); its clock steps back 1 s
    and it creates v (ts -850).  dc1 and dc3 order v first, using dc2's post
    that lists v.  dc2 restarts (forgetting foreign entries) just before two
    old posts without v, held up on slow links, arrive: it orders u first.
    """

    def build(sim: Simulation) -> None:
        net = sim.net
        slow = {(A, B): 1_050, (C, B): 1_050}
        sim.at(95, lambda: net.faults.slow.update(slow))
        sim.at(100, lambda: sim.transaction(C))
        sim.at(146, lambda: [net.faults.slow.pop(k, None) for k in slow])
        sim.at(146, lambda: net.cut({(C, B)}))
        sim.at(147, lambda: sim.step_clock(A, -1_000))
        sim.at(150, lambda: sim.transaction(A))
        sim.at(195, lambda: net.cut({(A, B)}))
        sim.at(400, lambda: sim.crash(B))
        sim.at(1_170, lambda: sim.restart(B))
        sim.at(1_186, lambda: net.faults.cut.difference_update({(A, B), (C, B)}))

    return _run(build, rules, heal_at=2_000, variant=variant, spread=spread)


def relayed_from_dropped_master(rules: Rules, variant: int | None = None, spread: int = 0) -> SimResult:
    """F5: a tx relayed from a dropped master is vouched for by nobody.

    dc3's tx z reaches dc2 only, then dc3 is cut off and dropped.  dc1 learns z
    late (it cannot fetch the body from dc2 for a while) and orders [z, y]
    with a post of dc2; dc2 restarts, forgets z, and orders [y] with an old
    post of dc1, delivered late, that did not list z yet.
    """

    def build(sim: Simulation) -> None:
        net = sim.net
        net.cut({(C, A), (A, C)})
        net.faults.bodies_cut.add((B, A))
        sim.at(100, lambda: sim.transaction(C))
        sim.at(150, lambda: net.cut({(C, B), (B, C)}))
        sim.at(1_400, lambda: sim.transaction(B))
        sim.at(1_435, lambda: net.faults.slow.__setitem__((A, B), 500))
        sim.at(1_445, lambda: net.faults.slow.pop((A, B), None))
        sim.at(1_450, lambda: net.faults.bodies_cut.clear())
        sim.at(1_545, lambda: sim.crash(B))
        sim.at(1_960, lambda: sim.restart(B))

    return _run(build, rules, heal_at=3_000, variant=variant, spread=spread)


def kept_both_sides(rules: Rules, variant: int | None = None, spread: int = 0) -> SimResult:
    """F3: dc3 hears both sides of a cut between dc1 and dc2 and keeps both in its view.

    dc1 and dc2 drop each other after MaxPeerLag and each orders with dc3.
    Without views, dc3 never learns of the split: it takes dc1's history from a
    catch-up while dc2, still a member for dc3, orders a different one.
    """

    def build(sim: Simulation) -> None:
        sim.at(100, lambda: sim.net.cut({(A, B), (B, A)}))
        for at in range(300, 2_400, 150):
            for m in (A, B, C):
                sim.at(at + {A: 0, B: 40, C: 80}[m], functools.partial(sim.transaction, m))

    return _run(build, rules, heal_at=2_600, variant=variant, spread=spread)


SCENARIOS: dict[str, Callable[..., SimResult]] = {
    "full": no_fault_divergence,
    "lamport": clock_step_back,
    "view": kept_both_sides,
    "origin": relayed_from_dropped_master,
}


def perturbed(rule: str, variants: int, spread: int, rules: Rules) -> list[int]:
    """Variants (numbers) of the rule's scenario, every event moved by up to ``spread`` ms, that fail."""
    scenario = SCENARIOS[rule]
    return [v for v in range(1, variants + 1) if scenario(rules, variant=v, spread=spread).violation]
