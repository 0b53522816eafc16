"""The heavy-work workload: deep queues, a backup restarted behind them, slow operations; no faults.

Issue 33's suite on the datacenter of ``world.py``, with its cost model
(``world.Costs``: a node's loop is busy for the work it does, and what comes
meanwhile waits): the client of ``confirms.py`` publishing and consuming as
there (its checks (a)-(e) stay), and ``CYCLES`` rounds of

1. a backup stopped (its process gone, its disk kept) while the client
   publishes ``deep`` messages in batches of ``BATCH`` (a pipelining
   publisher): a deep queue, all of it missing from the stopped backup;
2. the backup restarted: its join's catch-up is the whole backlog (streamed:
   ``primary/catch_up.py``, at the simulation's pace ``world.PACE``);
3. once it caught up, a purge of the queue (a get and an ack of each message,
   ``Costs.client_op`` apiece: thousands of them) and a slow operation (a big
   message's publish, modelled as 0.2-1.5 virtual seconds of CPU); both in
   slices of ``Costs.slice`` that yield to the loop between them (the fix of
   issue 33), or each in one step with ``unsliced=True``;
4. a stall of the primary's loop that no slicing avoids (a full collection,
   CPU starvation by a neighbour), a little longer than its lease (``STALL``):
   its lease lapses and is renewed once the loop runs again, before any backup
   stands (``cluster/election.py``'s lapse);

and slow fsyncs throughout (``HEAVY_FAULTS``). No fault is injected but the
stops: the stability invariant (f) (``World.check_stable``: no new epoch, no
primary stepping down while every node and link is up) must hold from each
restarted backup's join on. With ``Unsafe(monolithic_catch_up=True)`` (the
catch-up made at once: 1.2 s of the primary's loop), ``unsliced=True`` (the
purge, 1.2 s, and the slow operation in one step) or
``Unsafe(step_down_at_lease_end=True)`` (the stall costs the role) it must
report a violation: ``brokerha cluster simulate --workload heavy [--unsafe
monolithic_catch_up | step_down_at_lease_end] [--unsliced-operations]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from brokerha.ha.simulation import confirms
from brokerha.ha.simulation.confirms import ConfirmSimulation, SimResult
from brokerha.ha.simulation.world import Faults, SimConnection, SimNode, Unsafe

__all__ = ["CATCHES", "HeavyWork", "SimResult", "Unsafe", "run_many", "run_seed"]

CATCHES = ("monolithic_catch_up", "step_down_at_lease_end")
SLOW_OPERATIONS = True  # takes ``unsliced`` (cli.py: --unsliced-operations)
DEEP = 6000             # messages published while a backup is down, per round
BATCH = 100             # messages per publish step of the filling client ...
FILL_GAP = 0.01         # ... each sent this long after the node took the last one
CYCLES = 2              # rounds per seed, one after the other
SLOW_OP = (0.2, 1.5)    # CPU seconds of a slow operation
STALL = (1.0, 1.15)     # an unavoidable stall of the primary's loop, in lease timeouts
CAUGHT_UP_WITHIN = 20.0  # a restarted backup not caught up by then: the round goes on
HEAVY_FAULTS = replace(Faults.none(), slow_fsync_p=0.02)


class HeavyWork(ConfirmSimulation):
    def __init__(self, seed: int, *, duration: float = 36.0, deep: int = DEEP,
                 cycles: int = CYCLES, unsliced: bool = False, **kw: Any) -> None:
        kw.setdefault("faults", HEAVY_FAULTS)
        super().__init__(seed, duration=duration, **kw)
        self.deep, self.cycles, self.unsliced = deep, cycles, unsliced
        self.stopped: str | None = None
        self.filled = 0
        self.rounds = 0

    def start(self) -> None:
        super().start()
        self.after(2.0, self._stop_backup)

    # -- a round ---------------------------------------------------------------------------

    def _stop_backup(self) -> None:
        serving = self.serving_now
        if serving is None:
            self.after(0.5, self._stop_backup)  # still electing
            return
        self.rounds += 1
        node = self.nodes[self.rng.choice([n for n in self.names if n != serving.name])]
        self.stopped = node.name
        self.note(f"heavy: stop {node.name}; the client publishes {self.deep} messages")
        self.crash(node, 1e9)  # restarted by the round (_restart), not by the fault's timer
        self.filled = 0
        self._fill()

    def _fill(self) -> None:
        """The next batch once the node took the last one (and ``FILL_GAP``): a pipelining
        publisher held back by the broker's pace, as TCP holds it back."""
        if self.filled >= self.deep:
            self.after(0.5, self._restart)
            return
        self._call(self._publish_batch)
        if self.conn is None:
            self.after(FILL_GAP, self._fill)  # dialling

    def _publish_batch(self, node: SimNode, conn: SimConnection) -> None:
        for _ in range(min(BATCH, self.deep - self.filled)):
            self._publish_on(node, conn)
            self.filled += 1
        self.after(FILL_GAP, self._fill)

    def _restart(self) -> None:
        name = self.stopped
        assert name is not None
        self.note(f"heavy: restart {name} ({self.filled} messages published while it was down)")
        self.restart(name)
        self._await_catch_up(name, self.now)

    def _await_catch_up(self, name: str, since: float) -> None:
        serving = self.serving_now
        primary = serving.primary if serving is not None else None
        session = primary.sessions.get(name) if primary is not None else None
        if session is not None and session.caught_up:
            self.note(f"heavy: {name} caught up {self.now - since:.2f}s after its restart")
            self.result.catch_ups.append(self.now - since)
        elif self.now - since < CAUGHT_UP_WITHIN:
            self.after(0.25, lambda: self._await_catch_up(name, since))
            return
        else:
            self.note(f"heavy: {name} not caught up {CAUGHT_UP_WITHIN:.0f}s after its restart")
        self.stopped = None
        self.after(0.5, lambda: self._client_does(self._purge))

    def _purge(self, node: SimNode, conn: SimConnection) -> None:
        """Everything on the queue taken off (get and ack), sliced or in one step."""
        per_slice = max(1, int(self.costs.slice / self.costs.client_op)) \
            if self.costs.client_op > 0 and not self.unsliced else None
        self.note(f"heavy: purge of {self._client_queue(node).message_count} messages on "
                  f"{node.name}" + (" (one step)" if per_slice is None else ""))
        purged = [0]

        def one_slice() -> None:
            if not conn.usable:
                return
            taken = 0
            while per_slice is None or taken < per_slice:
                if not self._consume_on(node, conn):
                    self.note(f"heavy: purged {purged[0]} messages")
                    self.after(0.5, lambda: self._client_does(self._slow_operation))
                    return
                taken += 1
                purged[0] += 1
            node.run(one_slice)  # yield: what came meanwhile runs first

        one_slice()

    def _slow_operation(self, node: SimNode, conn: SimConnection) -> None:
        cost = SLOW_OP[0] + (SLOW_OP[1] - SLOW_OP[0]) * self.rng.random()
        self.note(f"heavy: a slow operation of {cost:.2f}s on {node.name}"
                  + (" (one step)" if self.unsliced else ""))
        self.slow_operation(node, cost, lambda: self._publish_on(node, conn),
                            sliced=not self.unsliced, alive=lambda: conn.usable)
        self.after(cost + 1.0, self._stall)

    def _stall(self) -> None:
        node = self.serving_now
        stall = self.timing.lease_timeout * (STALL[0] + (STALL[1] - STALL[0]) * self.rng.random())
        if node is not None:
            self.note(f"heavy: {node.name}'s loop stalls {stall:.3f}s (lease "
                      f"{self.timing.lease_timeout}s)")
            node.run(lambda: node.charge(stall))
        if self.rounds < self.cycles:
            self.after(stall + 1.0, self._stop_backup)  # the next round

    def _client_does(self, work: Callable[[SimNode, SimConnection], object]) -> None:
        """The client's call once it has a connection (dialling meanwhile)."""
        if self.conn is None or not self.conn.usable:
            self._call(work)  # dials
            self.after(0.1, lambda: self._client_does(work))
            return
        self._call(work)


# ---- running many seeds ---------------------------------------------------------------------


def run_seed(seed: int, **kw: Any) -> SimResult:
    """One seed; the result names the first violation (and the trace tail leading to it)."""
    return confirms.quietly(HeavyWork(seed, **kw))


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    """Run every seed (over ``jobs`` processes); results in seed order, traces kept for failures."""
    return confirms.run_many(seeds, jobs=jobs, seed_fn=run_seed, **kw)
