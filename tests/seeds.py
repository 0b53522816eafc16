"""What the simulation tests share: the first seed that breaks an invariant, and the
statistics of many seeds added up."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

JOBS = 2  # the CI machine's cores


def first_failing(run_seed: Callable[..., Any], unsafe: Any, seeds: Iterable[int], *,
                  jobs: int = JOBS, **kw: Any) -> tuple[int, str] | None:
    """(seed, violation) of the first seed whose run with ``unsafe`` reports a violation.

    The seeds run ``jobs`` at a time in worker processes (``run_seed`` is a module-level
    function, as ``brokerha.seed_runner`` requires) and are read in order, so the answer
    is the sequential search's; the search stops at the first violation.
    """
    order = iter(seeds)
    with ProcessPoolExecutor(jobs) as pool:
        running: deque[tuple[int, Future[Any]]] = deque()

        def submit() -> None:
            seed = next(order, None)
            if seed is not None:
                running.append((seed, pool.submit(run_seed, seed, unsafe=unsafe, **kw)))

        for _ in range(jobs):
            submit()
        while running:
            seed, future = running.popleft()
            result = future.result()
            if result.violation:
                pool.shutdown(cancel_futures=True)
                return seed, result.violation
            submit()
    return None


def totals(results: Sequence[Any]) -> Counter[str]:
    """Every seed's ``stats`` added up (what the seeds exercised)."""
    out: Counter[str] = Counter()
    for r in results:
        out.update(r.stats)
    return out
