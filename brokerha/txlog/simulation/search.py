"""Running many seeds, in parallel when asked: the CI run and the counter-example search."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from brokerha.seed_runner import run_many
from brokerha.txlog.engine.config import SplitRecovery
from brokerha.txlog.engine.rules import Rules
from brokerha.txlog.simulation.faults import run_seed
from brokerha.txlog.simulation.simulation import SimParams


@dataclass(frozen=True)
class Outcome:
    seed: int
    violation: str | None


def params_for(seed: int, masters: int | None, strategy: SplitRecovery | None) -> SimParams:
    """3 to 5 masters and the three strategies in turn, unless fixed."""
    strategies = list(SplitRecovery)
    return SimParams(
        masters=masters or 3 + seed % 3,
        strategy=strategy or strategies[(seed // 3) % len(strategies)],
    )


def run_one(
    seed: int,
    rules: Rules | None = None,
    masters: int | None = None,
    strategy: SplitRecovery | None = None,
    profile: str = "mixed",
) -> Outcome:
    params = params_for(seed, masters, strategy)
    return Outcome(seed, run_seed(seed, params, rules or Rules(), profile).violation)


def run_range(seeds: Sequence[int], rules: Rules | None = None, masters: int | None = None,
              strategy: SplitRecovery | None = None, profile: str = "mixed") -> list[Outcome]:
    return [run_one(s, rules, masters, strategy, profile) for s in seeds]


def run_parallel(seeds: Sequence[int], jobs: int = 2, **kw: object) -> list[Outcome]:
    """Split the seeds over ``jobs`` processes (results in seed order)."""
    return run_many(run_one, seeds, jobs=jobs, **kw)
