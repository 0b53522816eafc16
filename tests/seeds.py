"""The seed search the simulation tests share: the first seed that breaks an invariant."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def first_failing(run_seed: Callable[..., Any], unsafe: Any, seeds: Iterable[int],
                  **kw: Any) -> tuple[int, str] | None:
    """(seed, violation) of the first seed whose run with ``unsafe`` reports a violation."""
    for seed in seeds:
        result = run_seed(seed, unsafe=unsafe, **kw)
        if result.violation:
            return seed, result.violation
    return None
