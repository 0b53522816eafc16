"""Running many seeds, in parallel when asked: the CI run and the counter-example search."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from brokerha.txlog.config import SplitRecovery
from brokerha.txlog.faults import run_seed
from brokerha.txlog.rules import Rules
from brokerha.txlog.simulation import SimParams


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


def run_range(
    seeds: Sequence[int],
    rules: Rules | None = None,
    masters: int | None = None,
    strategy: SplitRecovery | None = None,
    profile: str = "mixed",
) -> list[Outcome]:
    rules = rules or Rules()
    return [
        Outcome(s, run_seed(s, params_for(s, masters, strategy), rules, profile).violation) for s in seeds
    ]


def run_parallel(seeds: Sequence[int], jobs: int = 2, **kw: object) -> list[Outcome]:
    """Split the seeds over ``jobs`` processes (results in seed order)."""
    if jobs <= 1:
        return run_range(seeds, **kw)  # type: ignore[arg-type]
    chunks = [list(seeds[i::jobs]) for i in range(jobs)]
    with ProcessPoolExecutor(jobs) as pool:
        parts = list(pool.map(_run_chunk, [(c, kw) for c in chunks]))
    return sorted((o for part in parts for o in part), key=lambda o: o.seed)


def _run_chunk(job: tuple[list[int], dict[str, object]]) -> list[Outcome]:
    seeds, kw = job
    return run_range(seeds, **kw)  # type: ignore[arg-type]
