"""Seeded fault schedules for the simulation, and running one seed end to end.

A profile names the faults a seed may draw; ``mixed`` (the default for random
runs) draws from all of them: symmetric, asymmetric and one-way cuts, a lost
single link, slow links that deliver old posts late, loss and duplicates,
crashes with restarts that lose volatile state, clock steps backwards,
failover of a master to a host whose clock is behind, and an outage of the
body-exchange interface alone on one link.  Every fault ends at the
heal, after which convergence is required within a bound.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from brokerha.txlog.engine.rules import Rules
from brokerha.txlog.simulation.simulation import SimParams, SimResult, Simulation

FAULTS = ("partition", "one-way", "link", "slow", "lossy", "crash", "clock", "failover", "bodies")
PROFILES = {"none": (), "mixed": FAULTS, "stress": FAULTS, **{name: (name,) for name in FAULTS}}


def schedule_transactions(sim: Simulation, rng: random.Random, until_ms: int, rate_per_s: float) -> None:
    for m in sim.masters:
        t = rng.expovariate(rate_per_s) * 1000
        while t < until_ms:
            sim.at(int(t), functools.partial(sim.transaction, m))
            t += rng.expovariate(rate_per_s) * 1000


def _two_sides(rng: random.Random, ids: list[str]) -> tuple[list[str], list[str]]:
    shuffled = ids[:]
    rng.shuffle(shuffled)
    k = rng.randint(1, len(ids) - 1)
    return shuffled[:k], shuffled[k:]


def schedule_fault(sim: Simulation, rng: random.Random, kind: str, start: int, end: int) -> None:
    ids = sorted(sim.masters)
    net = sim.net

    def at(when: int, text: str, action: Callable[[], object]) -> None:
        def noted() -> None:
            sim.note(f"fault {kind}: {text}")
            action()
        sim.at(when, noted)

    a, b = _two_sides(rng, ids)
    if kind in ("partition", "one-way", "link"):
        if kind == "partition":
            pairs = {(x, y) for x in a for y in b} | {(y, x) for x in a for y in b}
        elif kind == "one-way":
            pairs = {(x, y) for x in a for y in b}
        else:
            x, y = rng.sample(ids, 2)
            pairs = {(x, y), (y, x)}
        at(start, f"cut {sorted(pairs)}", lambda: net.cut(pairs))
        at(end, "restored", lambda: net.faults.cut.difference_update(pairs))
    elif kind == "bodies":
        x, y = rng.sample(ids, 2)
        link = (x, y)
        at(start, f"exchange down {link}", lambda: net.faults.bodies_cut.add(link))
        at(end, "restored", lambda: net.faults.bodies_cut.discard(link))
    elif kind == "slow":
        x, y = rng.sample(ids, 2)
        link = (x, y)
        extra = rng.randint(150, 900)
        at(start, f"{link} +{extra} ms", lambda: net.faults.slow.__setitem__(link, extra))
        at(end, "restored", lambda: net.faults.slow.pop(link, None))
    elif kind == "lossy":
        drop, dup = rng.uniform(0.02, 0.25), rng.uniform(0.0, 0.2)

        def lossy(drop: float, dup: float) -> None:
            net.drop, net.duplicate = drop, dup
        at(start, f"drop {drop:.2f} duplicate {dup:.2f}", functools.partial(lossy, drop, dup))
        at(end, "restored", functools.partial(lossy, 0.0, 0.0))
    elif kind in ("crash", "failover"):
        m = rng.choice(ids)
        down = rng.randint(20, 300) if kind == "failover" else end - start
        step = -rng.randint(0, 1_500) if kind == "failover" else 0
        sim.at(start, lambda: sim.crash(m))
        sim.at(start + down, lambda: sim.restart(m, step))
    elif kind == "clock":
        m = rng.choice(ids)
        delta = -rng.randint(50, 1_500)
        sim.at(start, lambda: sim.step_clock(m, delta))


def build(seed: int, params: SimParams, rules: Rules, profile: str = "mixed") -> Simulation:
    """A simulation for ``seed``: skewed clocks, jitter, transactions and the profile's faults."""
    rng = random.Random(f"faults-{seed}")
    sim = Simulation(seed, params, rules)
    for master in sim.masters.values():
        master.offset_ms = rng.randint(-30, 30)
    kinds = PROFILES[profile]
    heal = params.heal_at_ms
    schedule_transactions(sim, rng, heal - 300, rate_per_s=rng.uniform(1.0, 4.0))
    count = rng.randint(4, 8) if profile == "stress" else rng.randint(1, 3)
    for _ in range(count if kinds else 0):
        kind = rng.choice(kinds)
        start = rng.randint(100, heal - 600)
        long = rng.random() < 0.5
        length = rng.randint(params.max_peer_lag_ms + 200, 2 * params.max_peer_lag_ms) if long else rng.randint(50, 700)
        schedule_fault(sim, rng, kind, start, min(start + length, heal))
    sim.at(heal, sim.heal)
    return sim


def run_seed(
    seed: int,
    params: SimParams | None = None,
    rules: Rules | None = None,
    profile: str = "mixed",
    setup: Callable[[Simulation], None] | None = None,
) -> SimResult:
    """Run one seed through the fault phase, the heal and the convergence bound."""
    params = params or SimParams()
    sim = build(seed, params, rules or Rules(), profile)
    if setup is not None:
        setup(sim)
    problem = sim.run(params.heal_at_ms) or sim.run_to_convergence()
    return sim.result(problem)
