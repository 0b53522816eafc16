"""The confirm simulation with an operator changing the queue's ``ha-replicate`` mid-run.

``confirms.py``'s client, nodes and faults; the cluster's default is
``replicate = "none"``, and now and then the operator sets a policy
``ha-replicate`` on the client's queue on the serving primary (as ``PUT
/api/policies`` does: ``Definitions.apply``), cycling through ``all``,
``configuration``, ``all``, ``none``. Every node's broker acts on its policies
(``PolicyEffects``, as a node's does), so the primary re-decides the queue's
mode at once (``Primary.replicate_changed``).

What is promised, and checked:

- (c) a message the primary took in while the queue was replicated whole, and
  confirmed with no change away from ``all`` since, is held by the serving
  primary (the core's confirm rule); one taken in before a change to ``all``
  is held from the moment the primary reports that change applied
  (``Primary.replicate_pending`` false again, ``ctl status``), if the primary
  held it then;
- (d) a backup valid at a position at or past the change's marker holds every
  message the primary held then (and one taken in under ``all`` from its seq);
  a change away from ``all`` takes them away on the backups at its first event.

A message confirmed while the queue was not replicated whole, or before the
change to ``all`` was applied, may be lost in a failover: not checked.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from brokerha.broker.definitions import DefinitionChange
from brokerha.broker.policies import POLICY
from brokerha.broker.policy_effects import PolicyEffects
from brokerha.ha.member import PrimaryLayer
from brokerha.ha.simulation import confirms
from brokerha.ha.simulation.confirms import (
    CATCHES,
    ConfirmSimulation,
    SimResult,
    Unsafe,
    client_queue,
    held,
    quietly,
)
from brokerha.ha.simulation.world import SimNode
from brokerha.primary.primary import Primary

MODES = ("all", "configuration", "all", "none")
ALL = "all"

__all__ = ["CATCHES", "PolicyChangeSimulation", "SimResult", "Unsafe", "run_many",
           "run_policy_seed"]


class PolicyChangeSimulation(ConfirmSimulation):
    def __init__(self, seed: int, *, change_rate: float = 0.12, **kw: Any) -> None:
        kw.setdefault("replicate", "none")
        super().__init__(seed, **kw)
        self.change_rate = change_rate
        self.modes = itertools.cycle(MODES)
        self.flips = 0  # changes away from all (on any primary) so far
        self.taken_under: dict[int, int | None] = {}  # mid -> flips then, if taken in under all
        self.unprotected: set[int] = set()  # confirmed, not (yet) promised
        self.waiting: tuple[SimNode, Primary, int] | None = None  # a change to all, not applied
        self.changes = 0
        self.applied = 0      # changes to all reported applied
        self.protected = 0    # messages promised by an applied change

    def run(self) -> SimResult:
        if self.change_rate > 0:
            self.after(self.rng.expovariate(self.change_rate), self._change)
        return super().run()

    def on_elected(self, node: SimNode, epoch: int) -> None:
        super().on_elected(node, epoch)
        q, primary = client_queue(node), node.primary
        if q is not None and (primary is None or primary.replicate_mode(q) != ALL):
            self.held_at[epoch], self.alive_at[epoch] = {}, set()  # (d): no copy promised

    def make_layer(self, node: SimNode) -> PrimaryLayer | None:
        PolicyEffects(node.broker)  # a node's broker acts on its policies (node/server.py)
        return super().make_layer(node)

    # -- the operator -------------------------------------------------------------------

    def _change(self) -> None:
        self.after(self.rng.expovariate(self.change_rate), self._change)
        node = self.serving_now
        if node is not None:
            node.run(lambda: self._change_on(node))

    def _change_on(self, node: SimNode) -> None:
        primary = node.primary
        if primary is None or not node.serves_clients():
            return
        mode = next(self.modes)
        q = client_queue(node)
        old = primary.replicate_mode(q) if q is not None else None
        node.charge(self.costs.client_op)
        before = primary.seq  # the backups drop their copy after it (the df comes first)
        node.broker.definitions.apply(DefinitionChange(POLICY, ("/", "ha"), {
            "pattern": "^q$", "apply-to": "queues", "priority": 0,
            "definition": {"ha-replicate": mode}}))
        self.changes += 1
        self.note(f"operator: ha-replicate {mode} on {node.name}"
                  + (f" (the queue was {old})" if old is not None else ""))
        if q is None or old == primary.replicate_mode(q):
            return
        if old == ALL:
            self._flipped_away(primary, before + 1)
        elif mode == ALL:
            self.waiting = (node, primary, primary.replicate_status()["generation"])

    def _flipped_away(self, primary: Primary, seq: int) -> None:
        """The backups drop their copies at ``seq``: nothing confirmed is promised now."""
        self.flips += 1
        self.waiting = None
        self.unprotected |= self.confirmed_live
        self.confirmed_live.clear()
        epoch = primary.epoch
        gone = self.gone_at[epoch]
        for mid in sorted(self.alive_at[epoch]):
            gone[mid] = seq
        self.alive_at[epoch].clear()

    def check_serving(self) -> None:
        super().check_serving()
        waiting = self.waiting
        if waiting is None:
            return
        node, primary, gen = waiting
        if primary.closed or not node.alive:
            self.waiting = None  # deposed before it was applied: nothing promised
        elif primary.replicate_status()["applied_generation"] >= gen:
            self._applied(node, primary)

    def _applied(self, node: SimNode, primary: Primary) -> None:
        """The change to all is applied: what the primary holds is promised from now on."""
        self.waiting = None
        self.applied += 1
        last = primary.replicate_status()["last_applied"]
        marker = last["marker_seq"]
        self.note(f"{node.name}: the change to all is applied (marker seq {marker})")
        have = held(node)
        epoch = primary.epoch
        held_at, alive, gone = self.held_at[epoch], self.alive_at[epoch], self.gone_at[epoch]
        for mid in have - alive:
            held_at[mid] = marker
            alive.add(mid)
            gone.pop(mid, None)  # (gone_at stays in seq order for its consumption)
        promised = (self.unprotected - self.consumed) & have
        self.unprotected -= promised
        self.confirmed_live |= promised
        self.protected += len(promised)

    # -- the client's messages ------------------------------------------------------------

    def _took_in(self, node: SimNode, primary: Primary, mid: int) -> None:
        q = client_queue(node)
        if q is not None and primary.replicate_mode(q) == ALL:
            self.taken_under[mid] = self.flips
            super()._took_in(node, primary, mid)
        else:
            self.taken_under[mid] = None

    def _confirmed(self, mid: int) -> None:
        if self.taken_under.get(mid) == self.flips:
            super()._confirmed(mid)
        else:
            self.unprotected.add(mid)


def run_policy_seed(seed: int, *, nodes: int = 3, duration: float = 60.0, **kw: Any) -> SimResult:
    """One seed of the policy-change workload (module level: ``run_many``'s processes)."""
    sim = PolicyChangeSimulation(seed, nodes=nodes, duration=duration, **kw)
    result = quietly(sim)
    result.policy = {"changes": sim.changes, "applied": sim.applied,  # type: ignore[attr-defined]
                     "protected": sim.protected}
    return result


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    """``brokerha cluster simulate --workload policy``: every seed of this workload."""
    return confirms.run_many(seeds, jobs=jobs, seed_fn=run_policy_seed, **kw)
