"""Running a deterministic simulation over many seeds, in parallel when asked; the base of
the ``Unsafe`` switches by which a simulation breaks a product rule on purpose.

Shared by the simulations (``brokerha.ha.simulation.confirms``, ``brokerha.txlog.simulation.search``,
``brokerha.ha.simulation.transactions``).
Standard library only: the simulations import this module, never the other way round.
The per-seed function handed to :func:`run_many` must be a module-level function, so that
it pickles by reference for the worker processes (fork, forkserver and spawn alike).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Protocol, Self, TypeVar


@dataclass(frozen=True)
class UnsafeRules:
    """Rules of one product module to break on purpose (simulations only): a subclass
    declares one ``bool`` field per rule, each one the simulations must catch."""

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def of(cls, names: Iterable[str]) -> Self:
        """These rules broken, the others kept."""
        return cls(**{name: True for name in names})


class Seeded(Protocol):
    """What the runner needs of one seed's result: its seed, to put results in order."""

    @property
    def seed(self) -> int: ...


class SeedResult(Seeded, Protocol):
    """What the failure report needs besides."""

    @property
    def violation(self) -> str | None: ...
    @property
    def trace(self) -> list[str]: ...

    def summary(self) -> str: ...


R = TypeVar("R", bound=Seeded)
F = TypeVar("F", bound=SeedResult)


def run_chunk(run_seed: Callable[..., R], seeds: Sequence[int], kw: dict[str, Any]) -> list[R]:
    """``run_seed(seed, **kw)`` for each seed in turn (one worker's share)."""
    return [run_seed(seed, **kw) for seed in seeds]


def run_many(run_seed: Callable[..., R], seeds: Iterable[int], *, jobs: int = 1,
             **kw: Any) -> list[R]:
    """``run_seed(seed, **kw)`` for every seed over ``jobs`` processes; results in seed order.

    Fewer than two seeds a process run here, in this process.
    """
    seeds = list(seeds)
    if jobs <= 1 or len(seeds) < 2 * jobs:
        return run_chunk(run_seed, seeds, kw)
    chunks = [seeds[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs) as pool:
        parts = pool.map(partial(run_chunk, run_seed, kw=kw), chunks)
        results = [r for part in parts for r in part]
    results.sort(key=lambda r: r.seed)
    return results


def report_failures(results: Iterable[F], *, trace: bool = False) -> list[F]:
    """Print the summary (and, with ``trace``, the trace tail) of each failing seed; return them."""
    failing = [r for r in results if r.violation]
    for result in failing:
        print(result.summary())
        if trace:
            print("\n".join(f"    {line}" for line in result.trace))
    return failing
