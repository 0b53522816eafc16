"""The simulated WAN between masters: latency, jitter, loss, duplicates, cuts, slow links.

Everything is drawn from the simulation's seeded RNG, so a run is reproduced
by its seed number.  A cut is directed (``src -> dst``) so asymmetric and
one-way partitions and a single lost link are all the same mechanism.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class LinkFaults:
    cut: set[tuple[str, str]] = field(default_factory=set)
    slow: dict[tuple[str, str], int] = field(default_factory=dict)  # extra one-way ms
    bodies_cut: set[tuple[str, str]] = field(default_factory=set)  # transaction exchange only


@dataclass
class Network:
    rng: random.Random
    one_way_ms: int = 40
    jitter_ms: int = 0
    drop: float = 0.0
    duplicate: float = 0.0
    faults: LinkFaults = field(default_factory=LinkFaults)

    def delays(self, src: str, dst: str, exchange: bool = False) -> list[int]:
        """One-way delays for the copies of a message sent now (empty: lost).

        ``exchange`` marks the separate transaction-exchange interface (bodies),
        which ``bodies_cut`` can take down on its own.
        """
        if (src, dst) in self.faults.cut or (exchange and (src, dst) in self.faults.bodies_cut):
            return []
        if self.drop and self.rng.random() < self.drop:
            return []
        copies = 2 if self.duplicate and self.rng.random() < self.duplicate else 1
        extra = self.faults.slow.get((src, dst), 0)
        return [
            self.one_way_ms + extra + (self.rng.randint(0, self.jitter_ms) if self.jitter_ms else 0)
            for _ in range(copies)
        ]

    def cut(self, pairs: set[tuple[str, str]]) -> None:
        self.faults.cut |= pairs

    def heal(self) -> None:
        self.faults = LinkFaults()
