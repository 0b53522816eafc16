"""The five safety rules of design/txlog-safety.md, each switchable for the simulation.

Every real node runs with all five on.  Turning one off reproduces the seed's
literal behaviour for that aspect, so the simulation can show the
counter-example the rule exists for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

RULE_NAMES = ("full", "lamport", "view", "hash", "origin")


@dataclass(frozen=True)
class Rules:
    full: bool = True  # F1: ADD only with a same-merge-base post from every member
    lamport: bool = True  # F2: hybrid Lamport counter with a persisted high-water mark
    view: bool = True  # F3: (generation, member set) in posts; rejoin only by vote
    hash: bool = True  # F4: merge base = (length, running hash)
    origin: bool = True  # F5: ADD only transactions whose origin is a member

    @classmethod
    def without(cls, names: Iterable[str]) -> Rules:
        """All rules on except ``names`` (``all`` turns every rule off)."""
        off: set[str] = set()
        for name in names:
            if name == "all":
                off.update(RULE_NAMES)
            elif name in RULE_NAMES:
                off.add(name)
            else:
                raise ValueError(f"unknown rule {name!r}: expected one of {', '.join(RULE_NAMES)}, all")
        return replace(cls(), **{name: False for name in off})

    def off(self) -> list[str]:
        return [f.name for f in fields(self) if not getattr(self, f.name)]
