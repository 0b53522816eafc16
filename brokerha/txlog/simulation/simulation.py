"""Deterministic simulation of 3 to 5 TxLog masters on a virtual clock.

Each master is a :class:`~brokerha.txlog.engine.rounds.RoundEngine` driven exactly as
a real driver would drive it: its actions are carried out (sends go through
the simulated :class:`~brokerha.txlog.simulation.network.Network`, persists are already
in its :class:`~brokerha.txlog.engine.state.DurableState`), and it is ticked at its
``wakeup_after``.  A crash throws the engine (all volatile state) away and a
restart builds a new one from the durable state, possibly on another host
whose clock is behind (failover).  After every event the invariants S1, S2, S3
are checked; after the heal, convergence (L) within a bound.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from brokerha.txlog.engine.config import Peer, SplitRecovery, TxLogConfig
from brokerha.txlog.engine.messages import Bodies, Event, FetchBodies, Send
from brokerha.txlog.engine.records import MasterEvent, Operation
from brokerha.txlog.engine.rounds import RoundEngine
from brokerha.txlog.engine.rules import Rules
from brokerha.txlog.engine.state import DurableState
from brokerha.txlog.simulation.invariants import (
    check_no_duplicate,
    check_no_loss,
    check_prefix,
    converged,
)
from brokerha.txlog.simulation.network import Network


@dataclass
class SimMaster:
    config: TxLogConfig
    durable: DurableState
    engine: RoundEngine | None
    offset_ms: int = 0  # local clock = virtual time + offset
    events: list[MasterEvent] = field(default_factory=list)
    created_ms: dict[str, int] = field(default_factory=dict)


@dataclass
class SimResult:
    seed: int
    violation: str | None
    trace: list[str]
    masters: dict[str, SimMaster]
    created: list[str]
    ended_ms: int
    stats: dict[str, float] = field(default_factory=dict)


class Violation(Exception):
    pass


@dataclass
class SimParams:
    masters: int = 3
    one_way_ms: int = 40
    jitter_ms: int = 0
    round_timeout_ms: int = 160
    idle_interval_ms: int = 400
    max_peer_lag_ms: int = 800
    strategy: SplitRecovery = SplitRecovery.SMART
    heal_at_ms: int = 3_000
    converge_within_ms: int = 0  # 0: derived from the timeouts
    check_invariants: bool = True  # off only to time the engine itself (benchmarks)

    def bound_ms(self) -> int:
        """L: how long after the heal every queue must be equal and complete."""
        if self.converge_within_ms:
            return self.converge_within_ms
        return 2 * self.idle_interval_ms + 30 * self.round_timeout_ms


class Simulation:
    """Event loop over virtual time; schedule with :meth:`at`, run with :meth:`run`."""

    def __init__(self, seed: int, params: SimParams, rules: Rules | None = None) -> None:
        self.seed = seed
        self.params = params
        self.rules = rules or Rules()
        self.rng = random.Random(seed)
        self.net = Network(self.rng, params.one_way_ms, params.jitter_ms)
        self.now = 0
        self._queue: list[tuple[int, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self._tick_at: dict[str, int] = {}
        self._signatures: dict[str, Any] = {}
        self.trace: list[str] = []
        self.created: list[str] = []
        self.replaced: dict[str, str] = {}
        ids = [f"dc{i + 1}" for i in range(params.masters)]
        self.masters: dict[str, SimMaster] = {}
        for me in ids:
            config = TxLogConfig(
                node_id=me,
                master_url=f"brokerha://{me}.example:5672",
                peers=tuple(Peer(p, f"brokerha://{p}.example:5672") for p in ids if p != me),
                split_recovery=params.strategy,
                round_timeout_ms=params.round_timeout_ms,
                idle_interval_ms=params.idle_interval_ms,
                max_peer_lag_ms=params.max_peer_lag_ms,
            )
            durable = DurableState(members=config.masters, strategy=config.split_recovery)
            self.masters[me] = SimMaster(config, durable, RoundEngine(config, 0, durable, self.rules))
        for me in ids:
            self._schedule_tick(me)

    # ---- scheduling -----------------------------------------------------------

    def at(self, when: int, action: Callable[[], object]) -> None:
        """Run ``action`` at virtual time ``when`` (its result, if any, is ignored)."""
        heapq.heappush(self._queue, (when, next(self._seq), action))

    def local(self, m: str) -> int:
        return self.now + self.masters[m].offset_ms

    def _schedule_tick(self, m: str) -> None:
        engine = self.masters[m].engine
        if engine is None:
            return
        when = self.now + max(engine.wakeup_after(), 1)
        if self._tick_at.get(m) == when:
            return
        self._tick_at[m] = when
        self.at(when, lambda: self._tick(m, when))

    def _tick(self, m: str, when: int) -> None:
        engine = self.masters[m].engine
        if self._tick_at.get(m) != when or engine is None:
            return
        self._carry_out(m, engine.tick(self.local(m)))

    # ---- inputs -----------------------------------------------------------------

    def transaction(self, m: str, operations: list[Operation] | None = None) -> None:
        master = self.masters[m]
        if master.engine is None:
            return
        ops = operations or [Operation("enqueue", "/orders", f"msg-{len(self.created)}-{self.seed}")]
        record, actions = master.engine.local_tx(ops, self.local(m))
        self.created.append(record.tx_id)
        master.created_ms[record.tx_id] = self.local(m)
        self.note(f"tx {record.tx_id} ts={record.timestamp} at {m}")
        self._carry_out(m, actions)

    def crash(self, m: str) -> None:
        master = self.masters[m]
        if master.engine is None:
            return
        master.engine = None
        self._tick_at.pop(m, None)
        self._record_event(m, "crash", None, {})
        self.note(f"crash {m}")
        self._check([m])

    def restart(self, m: str, clock_step_ms: int = 0) -> None:
        """Restart from durable state; a non-zero step models failover to a host whose clock differs."""
        master = self.masters[m]
        if master.engine is not None:
            return
        master.offset_ms += clock_step_ms
        master.engine = RoundEngine(master.config, self.local(m), master.durable, self.rules)
        self._record_event(m, "restart", None, {"clock_step_ms": clock_step_ms})
        self.note(f"restart {m} clock step {clock_step_ms}")
        self._carry_out(m, [])

    def step_clock(self, m: str, delta_ms: int) -> None:
        self.masters[m].offset_ms += delta_ms
        self.note(f"clock {m} {delta_ms:+d} ms")
        self._schedule_tick(m)

    def _deliver(self, src: str, dst: str, message: Any) -> None:
        engine = self.masters[dst].engine
        if engine is None:
            return
        self._carry_out(dst, engine.received(message, self.local(dst)))

    # ---- outputs ----------------------------------------------------------------

    def _carry_out(self, m: str, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Send):
                exchange = isinstance(action.message, FetchBodies | Bodies)
                for delay in self.net.delays(m, action.peer, exchange):
                    self.at(self.now + delay, functools.partial(
                        self._deliver, m, action.peer, action.message))
            elif isinstance(action, Event):
                self._on_event(m, action)
        changed = self._note_sync(m)
        self._schedule_tick(m)
        if changed and self.params.check_invariants:
            self._check([m])

    def _note_sync(self, m: str) -> bool:
        """Trace a change of m's queue or view; True if there was one (invariants may move)."""
        durable = self.masters[m].durable
        signature = (durable.sync.merge_base(), durable.generation, durable.members)
        if self._signatures.get(m) == signature:
            return False
        self._signatures[m] = signature
        tail = ", ".join(e.record.tx_id[-8:] for e in durable.sync.entries[-4:])
        self.note(f"{m} synchronised length {len(durable.sync)} ... {tail}")
        return True

    def _on_event(self, m: str, event: Event) -> None:
        if event.kind == "renegotiate":
            self.replaced[event.detail["replay_of"]] = event.detail["tx_id"]
            self.created.append(event.detail["tx_id"])
        self._record_event(m, event.kind, event.peer, event.detail)
        self.note(f"{m} {event.kind} {event.peer or ''} {event.detail}")

    def _record_event(self, m: str, kind: str, peer: str | None, detail: dict[str, Any]) -> None:
        master = self.masters[m]
        master.events.append(MasterEvent(self.local(m), kind, master.durable.generation, peer, detail))

    def note(self, text: str) -> None:
        self.trace.append(f"{self.now:>6} ms  {text}")

    # ---- invariants -------------------------------------------------------------

    def _states(self) -> dict[str, DurableState]:
        return {m: s.durable for m, s in self.masters.items()}

    def _check(self, changed: list[str]) -> None:
        states = self._states()
        problem = check_prefix(states, changed) or check_no_duplicate(states, changed)
        if problem is None:
            holders = [self._held(m) for m in self.masters]
            problem = check_no_loss(self.created, holders, self.replaced)
        if problem:
            self.note(problem)
            raise Violation(problem)

    def _held(self, m: str) -> set[str]:
        master = self.masters[m]
        held = master.durable.sync.id_set() | set(master.durable.own)
        if master.engine is not None:
            held.update(r.tx_id for r in master.engine.incoming.records())
        return held

    # ---- running ------------------------------------------------------------------

    def heal(self) -> None:
        self.net.heal()
        self.note("heal")
        for m, master in self.masters.items():
            if master.engine is None:
                self.restart(m)

    def run(self, until_ms: int) -> str | None:
        """Process events up to ``until_ms``; the first violation, or None."""
        try:
            while self._queue and self._queue[0][0] <= until_ms:
                when, _, action = heapq.heappop(self._queue)
                self.now = when
                action()
        except Violation as exc:
            return str(exc)
        self.now = until_ms
        return None

    def run_to_convergence(self) -> str | None:
        """After the heal: run until L holds or the bound passes."""
        deadline = self.now + self.params.bound_ms()
        step = self.params.round_timeout_ms
        while self.now < deadline:
            problem = self.run(min(self.now + step, deadline))
            if problem:
                return problem
            if self.convergence_problem() is None:
                return None
        return f"L convergence: not within {self.params.bound_ms()} ms of the heal ({self.convergence_problem()})"

    def convergence_problem(self) -> str | None:
        if any(m.engine is None or m.engine.voting for m in self.masters.values()):
            return "a master is down or voting"
        return converged(self._states(), self.created, self.replaced)

    def result(self, violation: str | None) -> SimResult:
        return SimResult(self.seed, violation, self.trace, self.masters, self.created, self.now)
