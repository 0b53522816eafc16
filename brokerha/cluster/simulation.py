"""Deterministic simulation of one datacenter's election and replication (virtual clock).

Each node runs a real :class:`~brokerha.cluster.election.Election`, driven as
the asyncio layer drives it (actions carried out in order, ``Persist`` first,
ticks at ``wakeup_at``), and a small model of replication: the primary
numbers its events (enqueue, dequeue) from 0 in its epoch and streams them to
the backups that joined it; a joining backup is *catching up* (position
INVALID) until the primary's snapshot arrives; a backup acknowledges an event
after applying and persisting it; the primary confirms a published message
once ``quorum.replicated_seq`` covers it (guarded: every backup with a live
session, until ``backup_timeout`` of silence). A simulated client publishes
to and consumes from whichever node serves.

Faults are drawn from the seed: message delays and spikes; drops and
duplicates of election messages; replication links that are TCP-like (in
order while up; a failure loses what is in flight, both ends notice after a
detection delay, the backup joins again); partitions (one node, or a split)
that heal; crashes (the node keeps only what it persisted) and restarts;
pauses (SIGSTOP: the node resumes later with a stale view); manual failover.

After every event: (a) at most one primary per epoch, ever; (b) a deposed
primary serves at most ``lease_timeout`` after a newer one was elected (two
nodes may serve at once: a backup whose link to the primary closed votes at
once, election.py); (c) every confirmed, unconsumed message is held by the
newest serving primary (checked at each promotion and each confirm, wherever
the client sent it: while two serve, the client uses either); (d) a
backup whose position is valid under the current primary holds every
message the primary holds at or below that position; (e) a backup never
applies an event of an epoch older than its own. A failing seed is replayed
by its number (``brokerha cluster simulate --seeds 1 --start-seed N --trace``).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from brokerha import seed_runner
from brokerha.cluster.election import (
    BecomePrimary,
    Election,
    ElectionTiming,
    HeartbeatAck,
    Persist,
    Position,
    PromoteRefused,
    Send,
    StopServing,
)
from brokerha.cluster.quorum import replicated_seq

JOIN_RETRY = 1.0  # a backup whose join got no snapshot joins again after this
TRACE_TAIL = 60


@dataclass(frozen=True)
class Faults:
    delay: tuple[float, float] = (0.0005, 0.005)  # one-way message delay
    spike_p: float = 0.02        # chance a message is slow (congestion, GC) ...
    spike_max: float = 0.6       # ... by up to this much
    drop_p: float = 0.01         # election messages only; the stream breaks instead
    dup_p: float = 0.01          # election messages only
    rate: float = 0.15           # faults per virtual second
    crash: float = 2.0           # relative weights of the fault kinds
    pause: float = 2.0
    partition: float = 2.0
    link: float = 2.0
    promote: float = 1.0
    outage: tuple[float, float] = (0.3, 6.0)   # crash downtime, pause, partition length
    detect: tuple[float, float] = (0.05, 2.0)  # a broken link is noticed after this

    @classmethod
    def none(cls) -> Faults:
        return cls(spike_p=0.0, drop_p=0.0, dup_p=0.0, rate=0.0)


@dataclass(frozen=True)
class Unsafe:
    """Rules to break on purpose: each one must make the checker report a violation."""

    confirm_early: bool = False     # confirm on append, without the quorum rule
    invalid_grants: bool = False    # a catching-up voter forgets its vote floor
    no_lease: bool = False          # a primary keeps serving without a majority
    old_epoch_apply: bool = False   # a backup applies events from an older epoch
    skip_catch_up: bool = False     # a joining backup takes the marker without the state

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def of(cls, names: Iterable[str]) -> Unsafe:
        return cls(**{name: True for name in names})

    def any(self) -> bool:
        return any(getattr(self, name) for name in self.names())


class Violation(Exception):
    pass


@dataclass
class SimResult:
    seed: int
    nodes: int
    violation: str | None
    trace: list[str]
    trace_hash: str
    failovers: int = 0
    published: int = 0
    confirmed: int = 0
    consumed: int = 0
    unserved: float = 0.0       # virtual seconds without a serving primary
    overlap: float = 0.0        # virtual seconds with two serving (a deposed one in its lease)
    deposed_calls: int = 0      # client calls that went to a deposed primary still serving
    events: int = 0

    def summary(self) -> str:
        head = f"seed {self.seed} ({self.nodes} nodes): "
        if self.violation:
            return head + f"VIOLATION {self.violation}"
        return head + (f"ok, {self.failovers} failovers, {self.confirmed}/{self.published} "
                       f"confirmed, {self.unserved:.1f}s unserved")


@dataclass
class Durable:
    """What survives a crash: the election's Persist, the applied state and position."""

    epoch: int = 0
    voted_for: str | None = None
    position: Position = Position(0, 0)
    floor: Position = Position(0, 0)
    held: dict[int, int] = field(default_factory=dict)  # message id -> enqueue seq


@dataclass
class Session:  # a backup's session, as the primary sees it
    nonce: int
    gen: int
    acked: int = 0
    last_heard: float = 0.0


@dataclass
class Following:  # the backup's side of the session
    primary: str
    epoch: int
    nonce: int
    gen: int
    joined_at: float
    caught_up: bool = False


@dataclass
class PrimarySide:
    epoch: int
    seq: int = 0
    sessions: dict[str, Session] = field(default_factory=dict)
    pending: deque[tuple[int, int]] = field(default_factory=deque)  # (seq, message id)


@dataclass
class SimNode:
    name: str
    durable: Durable = field(default_factory=Durable)
    election: Election | None = None
    incarnation: int = 0
    paused_until: float = 0.0
    inbox: list[tuple[Any, ...]] = field(default_factory=list)
    following: Following | None = None
    prim: PrimarySide | None = None
    tick_at: float = math.inf


def _unsafe_election(unsafe: Unsafe) -> type[Election]:
    if not (unsafe.invalid_grants or unsafe.no_lease):
        return Election

    class UnsafeElection(Election):
        def _may_vote_for(self, cand: Position) -> bool:
            if unsafe.invalid_grants:
                return cand.valid and cand >= self.position
            return super()._may_vote_for(cand)

        def _update_lease(self) -> None:
            super()._update_lease()
            if unsafe.no_lease:
                self._lease_expiry = math.inf

    return UnsafeElection


class Simulation:
    def __init__(self, seed: int, *, nodes: int = 3, duration: float = 60.0,
                 faults: Faults | None = None, unsafe: Unsafe | None = None,
                 timing: ElectionTiming | None = None, backup_timeout: float = 5.0,
                 publish_rate: float = 2.0, consume_rate: float = 1.6) -> None:
        self.seed = seed
        self.duration = duration
        self.faults = faults or Faults()
        self.unsafe = unsafe or Unsafe()
        self.timing = timing or ElectionTiming()
        self.backup_timeout = backup_timeout
        self.election_cls = _unsafe_election(self.unsafe)
        self.rng = random.Random(seed)
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.nodes = {name: SimNode(name) for name in self.names}
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._nonce = itertools.count(1)
        self._ids = itertools.count(1)
        pairs = [(a, b) for a in self.names for b in self.names if a != b]
        self.gen = dict.fromkeys(pairs, 0)
        self.last_at = dict.fromkeys(pairs, 0.0)
        self.blocked = dict.fromkeys(pairs, 0)
        self.primaries: dict[int, str] = {}
        self.confirmed_live: set[int] = set()
        self.consumed: set[int] = set()
        self.trace: deque[str] = deque(maxlen=TRACE_TAIL)
        self._hash = hashlib.sha256()
        self.result = SimResult(seed, nodes, None, [], "")
        self._serving: SimNode | None = None  # the newest serving primary
        self._overlapping = False  # a deposed primary serves too
        self._elected_at: dict[int, float] = {}  # epoch -> when its primary was elected
        self._publish_rate, self._consume_rate = publish_rate, consume_rate

    # ---- scheduling -------------------------------------------------------------------

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (when, next(self._order), fn, args))

    def note(self, text: str) -> None:
        line = f"{self.now:9.4f} {text}"
        self.trace.append(line)
        self._hash.update(line.encode())

    def run(self) -> SimResult:
        for node in self.nodes.values():
            self._restart(node)
        if self._publish_rate > 0:
            self.at(self.rng.expovariate(self._publish_rate), self._publish)
        if self._consume_rate > 0:
            self.at(self.rng.expovariate(self._consume_rate), self._consume)
        if self.faults.rate > 0:
            self.at(self.rng.expovariate(self.faults.rate), self._fault)
        result, queue = self.result, self._queue
        try:
            while queue and queue[0][0] <= self.duration:
                when, _, fn, args = heapq.heappop(queue)
                if self._serving is None:
                    result.unserved += when - self.now
                elif self._overlapping:
                    result.overlap += when - self.now
                self.now = when
                fn(*args)
                result.events += 1
                self._check_serving()
            if self._serving is None:
                result.unserved += self.duration - self.now
            self.now = self.duration
            self._check_confirmed(self._serving)
        except Violation as exc:
            result.violation = str(exc)
            self.note(f"VIOLATION {exc}")
        result.trace = list(self.trace)
        self._hash.update(f"{result.published} {result.confirmed} {result.consumed}".encode())
        result.trace_hash = self._hash.hexdigest()[:16]
        return result

    # ---- invariants -------------------------------------------------------------------

    def violate(self, text: str) -> None:
        raise Violation(text)

    def _servers(self) -> list[tuple[SimNode, Election]]:
        """The nodes serving at this instant (with their elections), newest epoch first."""
        now = self.now
        found = [(node, node.election) for node in self.nodes.values()
                 if node.election is not None and node.election.lease_valid(now)]
        return sorted(found, key=lambda pair: -pair[1].epoch)

    def _check_serving(self) -> None:
        """(b): a deposed primary stops within its lease; (c) when the newest server changes."""
        servers = self._servers()
        serving = servers[0][0] if servers else None
        self._overlapping = len(servers) > 1
        for old, el in servers[1:]:
            successor = min(at for epoch, at in self._elected_at.items() if epoch > el.epoch)
            if self.now - successor > self.timing.lease_timeout:
                self.violate(f"(b) {old.name} (epoch {el.epoch}) still serves "
                             f"{self.now - successor:.3f}s after a newer primary was elected")
        if serving is not self._serving:
            self._serving = serving
            self._check_confirmed(serving)

    def _check_confirmed(self, node: SimNode | None) -> None:
        """(c): the serving primary holds every confirmed message not consumed since."""
        if node is None:
            return
        missing = self.confirmed_live.difference(node.durable.held)
        if missing:
            self.violate(f"(c) confirmed messages {sorted(missing)[:5]} lost: not held by "
                         f"{node.name}, primary of epoch {node.durable.position.epoch}")

    def _check_ready(self, node: SimNode, pos: Position) -> None:
        """(d): a backup about to be valid at ``pos`` under the current primary misses nothing."""
        primary = self.nodes[self.primaries.get(pos.epoch, node.name)]
        if primary is node or primary.prim is None or primary.prim.epoch != pos.epoch:
            return
        held = node.durable.held
        for mid, seq in primary.durable.held.items():
            if seq <= pos.seq and mid not in held:
                self.violate(f"(d) backup {node.name} ready at {pos} but misses message {mid} "
                             f"(seq {seq}) of primary {primary.name}")

    # ---- network ----------------------------------------------------------------------

    def _delay(self) -> float:
        f, rng = self.faults, self.rng
        d = f.delay[0] + (f.delay[1] - f.delay[0]) * rng.random()
        if f.spike_p and rng.random() < f.spike_p:
            d += f.spike_max * rng.random()
        return d

    def send(self, src: str, dst: str, msg: Any, stream: bool, gen: int | None = None) -> None:
        """``gen``: the link generation a stream message belongs to (lost if it failed since)."""
        key = (src, dst)
        if self.blocked[key]:
            return
        if gen is None:
            gen = self.gen[key]
        when = self.now + self._delay()
        if stream:  # TCP-like: in order
            when = max(when, self.last_at[key])
            self.last_at[key] = when
            self.at(when, self._deliver, dst, src, gen, msg, True)
            return
        r = self.rng.random()
        if r < self.faults.drop_p:
            return
        self.at(when, self._deliver, dst, src, gen, msg, False)
        if r > 1.0 - self.faults.dup_p:
            self.at(when + self._delay(), self._deliver, dst, src, gen, msg, False)

    def _fail_link(self, a: str, b: str) -> None:
        self.gen[(a, b)] += 1
        self.gen[(b, a)] += 1
        lo, hi = self.faults.detect
        for me, peer in ((a, b), (b, a)):
            when = self.now + lo + (hi - lo) * self.rng.random()
            self.at(when, self._deliver, me, peer, None, ("down",), True)

    def _deliver(self, dst: str, src: str, gen: int | None, msg: Any, stream: bool) -> None:
        node = self.nodes[dst]
        if node.election is None or (gen is not None and gen != self.gen[(src, dst)]):
            return
        if node.paused_until > self.now:
            node.inbox.append((src, gen, msg, stream))
            return
        if stream:
            self._on_stream(node, src, msg)
            return
        if node.prim is not None and isinstance(msg, HeartbeatAck):
            session = node.prim.sessions.get(src)
            if session is not None:
                session.last_heard = self.now
        self.carry_out(node, node.election.receive(self.now, src, msg))

    # ---- the election's actions -------------------------------------------------------

    def carry_out(self, node: SimNode, actions: list[Any]) -> None:
        for action in actions:
            kind = type(action)
            if kind is Send:
                self.send(node.name, action.to, action.message, False)
            elif kind is Persist:
                self._persist(node, action)
            elif kind is BecomePrimary:
                self._become_primary(node, action.epoch)
            elif kind is StopServing:
                self._demote(node, action.reason)
        self._maybe_join(node)
        self._schedule_tick(node)

    def _persist(self, node: SimNode, action: Persist) -> None:
        durable = node.durable
        if action.epoch < durable.epoch:
            self.violate(f"{node.name} persisted epoch {action.epoch} after {durable.epoch}")
        if action.epoch == durable.epoch and durable.voted_for not in (None, action.voted_for):
            self.violate(f"(a) {node.name} voted for {durable.voted_for} and {action.voted_for} "
                         f"in epoch {action.epoch}")
        durable.epoch, durable.voted_for = action.epoch, action.voted_for
        following = node.following
        if following is not None and following.epoch < action.epoch and not self.unsafe.old_epoch_apply:
            node.following = None  # never apply anything of the older primary again

    def _become_primary(self, node: SimNode, epoch: int) -> None:
        first = self.primaries.setdefault(epoch, node.name)
        if first != node.name:
            self.violate(f"(a) two primaries in epoch {epoch}: {first} and {node.name}")
        self._elected_at[epoch] = self.now
        self.result.failovers += len(self.primaries) > 1
        self.note(f"{node.name} primary for epoch {epoch} (held {len(node.durable.held)})")
        node.following = None
        node.prim = PrimarySide(epoch)
        durable = node.durable
        durable.held = dict.fromkeys(durable.held, 0)  # the state at seq 0 of this epoch
        self._set_position(node, Position(epoch, 0))
        self._check_confirmed(node)

    def _demote(self, node: SimNode, reason: str) -> None:
        self.note(f"{node.name} stops serving: {reason}")
        prim = node.prim
        if prim is not None:
            for backup, session in prim.sessions.items():
                self.send(node.name, backup, ("close", prim.epoch, session.nonce), True,
                          session.gen)
            node.prim = None

    def _set_position(self, node: SimNode, pos: Position, ack: tuple[Any, ...] | None = None) -> None:
        """Persist the position, then send ``ack`` (a backup's), then tell the election."""
        durable = node.durable
        durable.position = pos
        if pos > durable.floor:
            durable.floor = pos
        if ack is not None and node.following is not None:
            self.send(node.name, node.following.primary, ack, True, node.following.gen)
        actions = node.election.set_position(pos) if node.election is not None else []
        if actions:
            self.carry_out(node, actions)

    def _schedule_tick(self, node: SimNode) -> None:
        el = node.election
        if el is None:
            return
        when = el.wakeup_at()
        if when < node.tick_at:
            node.tick_at = max(when, self.now)
            self.at(node.tick_at, self._tick, node, node.incarnation, node.tick_at)

    def _tick(self, node: SimNode, incarnation: int, when: float) -> None:
        if node.incarnation != incarnation or node.tick_at != when or node.election is None:
            return
        node.tick_at = math.inf
        if node.paused_until > self.now:
            return  # the resume ticks
        actions = node.election.tick(self.now)
        if node.prim is not None:
            self._expire_backups(node)
        self.carry_out(node, actions)

    # ---- replication model ------------------------------------------------------------

    def _maybe_join(self, node: SimNode) -> None:
        el = node.election
        if el is None or el._role != "backup" or el.primary is None:
            return
        f = node.following
        if (f is not None and f.primary == el.primary and f.epoch == el.epoch
                and (f.caught_up or self.now - f.joined_at < JOIN_RETRY)):
            return
        if self.blocked[(node.name, el.primary)] or self.nodes[el.primary].election is None:
            return  # as the node's link: the join goes out when the link is up again
        gen = self.gen[(node.name, el.primary)]
        node.following = f = Following(el.primary, el.epoch, next(self._nonce), gen, self.now)
        if not self.unsafe.skip_catch_up:
            self._set_position(node, Position.INVALID)
        self.send(node.name, f.primary, ("join", f.epoch, f.nonce), True, gen)

    def _on_stream(self, node: SimNode, src: str, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ev":
            self._on_event(node, src, msg)
        elif kind == "ack":
            self._on_ack(node, src, msg)
        elif kind == "snap":
            self._on_snapshot(node, src, msg)
        elif kind == "join":
            self._on_join(node, src, msg)
        elif kind == "close":
            if node.following is not None and node.following.nonce == msg[2]:
                node.following = None
        elif kind == "down":
            self._on_link_down(node, src)

    def _on_join(self, node: SimNode, src: str, msg: tuple[Any, ...]) -> None:
        _, epoch, nonce = msg
        prim = node.prim
        if prim is None or prim.epoch != epoch:
            return
        gen = self.gen[(src, node.name)]
        prim.sessions[src] = Session(nonce, gen, 0, self.now)
        held = dict(node.durable.held)
        self.send(node.name, src, ("snap", epoch, nonce, prim.seq, held), True, gen)

    def _accept(self, node: SimNode, msg: tuple[Any, ...]) -> bool:
        """Is this event for the session we follow, and of our epoch? (e) is checked here."""
        f = node.following
        if f is None or f.nonce != msg[2]:
            return False
        epoch = msg[1]
        if epoch < node.election.epoch:
            if not self.unsafe.old_epoch_apply:
                node.following = None
                return False
            self.violate(f"(e) {node.name} applies an event of epoch {epoch} after adopting "
                         f"epoch {node.election.epoch}")
        return True

    def _on_snapshot(self, node: SimNode, src: str, msg: tuple[Any, ...]) -> None:
        if not self._accept(node, msg):
            return
        _, epoch, nonce, seq, held = msg
        if not self.unsafe.skip_catch_up:
            node.durable.held = held
        node.following.caught_up = True  # type: ignore[union-attr]
        self._check_ready(node, Position(epoch, seq))
        self._set_position(node, Position(epoch, seq), ("ack", epoch, nonce, seq))

    def _on_event(self, node: SimNode, src: str, msg: tuple[Any, ...]) -> None:
        if not self._accept(node, msg):
            return
        _, epoch, nonce, seq, enqueue, mid = msg
        pos = node.durable.position
        if pos.epoch == epoch and seq <= pos.seq:
            return  # a duplicate
        if pos.epoch == epoch and seq != pos.seq + 1:
            self.violate(f"{node.name} got event {seq} of epoch {epoch} after {pos}")
        if enqueue:
            node.durable.held[mid] = seq
        else:
            node.durable.held.pop(mid, None)
        self._check_ready(node, Position(epoch, seq))
        self._set_position(node, Position(epoch, seq), ("ack", epoch, nonce, seq))

    def _on_ack(self, node: SimNode, src: str, msg: tuple[Any, ...]) -> None:
        _, epoch, nonce, seq = msg
        prim = node.prim
        session = prim.sessions.get(src) if prim is not None else None
        if session is None or session.nonce != nonce:
            return
        session.acked = max(session.acked, seq)
        session.last_heard = self.now
        self._confirm(node)

    def _on_link_down(self, node: SimNode, peer: str) -> None:
        gen = self.gen[(peer, node.name)]
        prim = node.prim
        if prim is not None and peer in prim.sessions and prim.sessions[peer].gen != gen:
            del prim.sessions[peer]
            self._confirm(node)
        f = node.following
        if f is not None and f.primary == peer:
            node.following = None
        if node.election is not None:
            self.carry_out(node, node.election.link_down(self.now, peer))

    def _expire_backups(self, node: SimNode) -> None:
        prim = node.prim
        assert prim is not None
        limit = self.now - self.backup_timeout
        silent = [b for b, s in prim.sessions.items() if s.last_heard < limit]
        for backup in silent:
            session = prim.sessions.pop(backup)
            self.note(f"{node.name}: backup {backup} silent for {self.backup_timeout}s, unguarded")
            self.send(node.name, backup, ("close", prim.epoch, session.nonce), True, session.gen)
        if silent:
            self._confirm(node)

    def _confirm(self, node: SimNode) -> None:
        prim = node.prim
        if prim is None or not prim.pending:
            return
        if self.unsafe.confirm_early:
            upto = prim.seq
        else:
            acked = {b: s.acked for b, s in prim.sessions.items()}
            upto = replicated_seq(prim.seq, acked, acked.keys(), len(self.names))
        pending, serving = prim.pending, self._serving
        while pending and pending[0][0] <= upto:
            _, mid = pending.popleft()
            self.result.confirmed += 1
            if mid not in self.consumed:
                self.confirmed_live.add(mid)
                if serving is not None and mid not in serving.durable.held:
                    self._check_confirmed(serving)

    def _append(self, node: SimNode, mid: int, enqueue: bool) -> int:
        prim = node.prim
        assert prim is not None
        prim.seq += 1
        if enqueue:
            node.durable.held[mid] = prim.seq
        else:
            del node.durable.held[mid]
        self._set_position(node, Position(prim.epoch, prim.seq))
        for backup, session in prim.sessions.items():
            self.send(node.name, backup, ("ev", prim.epoch, session.nonce, prim.seq, enqueue, mid),
                      True, session.gen)
        return prim.seq

    # ---- the client ---------------------------------------------------------------------

    def _client_target(self) -> SimNode | None:
        """Where the client's next call goes: any serving node (one still deposed, sometimes)."""
        servers = self._servers()
        if not servers:
            return None
        node = servers[0][0] if len(servers) == 1 else self.rng.choice(servers)[0]
        self.result.deposed_calls += node is not servers[0][0]
        if node.prim is None or node.paused_until > self.now:
            return None
        return node

    def _publish(self) -> None:
        self.at(self.now + self.rng.expovariate(self._publish_rate), self._publish)
        node = self._client_target()
        if node is None:
            return
        mid = next(self._ids)
        self.result.published += 1
        node.prim.pending.append((self._append(node, mid, True), mid))  # type: ignore[union-attr]
        self._confirm(node)

    def _consume(self) -> None:
        self.at(self.now + self.rng.expovariate(self._consume_rate), self._consume)
        node = self._client_target()
        if node is None or not node.durable.held:
            return
        mid = min(node.durable.held)
        self.result.consumed += 1
        self.consumed.add(mid)
        self.confirmed_live.discard(mid)
        self._append(node, mid, False)

    # ---- faults -------------------------------------------------------------------------

    def _fault(self) -> None:
        f, rng = self.faults, self.rng
        self.at(self.now + rng.expovariate(f.rate), self._fault)
        kinds = ("crash", "pause", "partition", "link", "promote")
        kind = rng.choices(kinds, weights=[getattr(f, k) for k in kinds])[0]
        outage = f.outage[0] + (f.outage[1] - f.outage[0]) * rng.random()
        up = [n for n in self.nodes.values() if n.election is not None and n.paused_until <= self.now]
        if kind == "crash" and up:
            self._crash(rng.choice(up), outage)
        elif kind == "pause" and up:
            node = rng.choice(up)
            node.paused_until = self.now + outage
            self.note(f"pause {node.name} for {outage:.2f}s")
            self.at(node.paused_until, self._resume, node, node.incarnation)
        elif kind == "partition":
            self._partition(outage)
        elif kind == "link":
            a, b = rng.sample(self.names, 2)
            self.note(f"link {a}-{b} fails")
            self._fail_link(a, b)
        elif kind == "promote" and self._serving is not None:
            self._promote(self._serving, rng.choice([n for n in self.names
                                                     if n != self._serving.name]))

    def _crash(self, node: SimNode, downtime: float) -> None:
        self.note(f"crash {node.name} for {downtime:.2f}s")
        node.election, node.prim, node.following = None, None, None
        node.inbox, node.paused_until, node.tick_at = [], 0.0, math.inf
        node.incarnation += 1
        for peer in self.names:
            if peer != node.name:
                self._fail_link(node.name, peer)
        self.at(self.now + downtime, self._restart, node)

    def _restart(self, node: SimNode) -> None:
        d = node.durable
        rng = random.Random(f"{self.seed}/{node.name}/{node.incarnation}")
        node.election = self.election_cls(node.name, self.names, epoch=d.epoch,
                                          voted_for=d.voted_for, position=d.position,
                                          timing=self.timing, rng=rng, vote_floor=d.floor)
        if self.now:
            self.note(f"restart {node.name} at epoch {d.epoch}, position {d.position}")
        self.carry_out(node, node.election.start(self.now))

    def _resume(self, node: SimNode, incarnation: int) -> None:
        if node.incarnation != incarnation or node.election is None:
            return
        node.paused_until = 0.0
        self.note(f"resume {node.name} ({node.election.role}, epoch {node.election.epoch})")
        node.tick_at = math.inf
        self.carry_out(node, node.election.tick(self.now))
        if node.prim is not None:
            self._expire_backups(node)
        inbox, node.inbox = node.inbox, []
        for src, gen, msg, stream in inbox:
            self._deliver(node.name, src, gen, msg, stream)

    def _partition(self, length: float) -> None:
        names = self.names[:]
        self.rng.shuffle(names)
        cut = 1 if self.rng.random() < 0.5 else self.rng.randint(1, len(names) - 1)
        side = set(names[:cut])
        crossing = [(a, b) for a in names[:cut] for b in self.names if b not in side]
        self.note(f"partition {sorted(side)} | {sorted(set(self.names) - side)} "
                  f"for {length:.2f}s")
        for a, b in crossing:
            self.blocked[(a, b)] += 1
            self.blocked[(b, a)] += 1
            self._fail_link(a, b)
        self.at(self.now + length, self._heal, crossing)

    def _heal(self, crossing: list[tuple[str, str]]) -> None:
        self.note("heal " + " ".join(f"{a}-{b}" for a, b in crossing))
        for a, b in crossing:
            self.blocked[(a, b)] -= 1
            self.blocked[(b, a)] -= 1

    def _promote(self, node: SimNode, target: str) -> None:
        assert node.election is not None
        try:
            actions = node.election.promote(self.now, target)
        except PromoteRefused as exc:
            self.note(f"promote {target} refused: {exc}")
            return
        self.note(f"promote {target} (from {node.name})")
        self.carry_out(node, actions)


# ---- running many seeds ---------------------------------------------------------------


def run_seed(seed: int, *, nodes: int = 3, duration: float = 60.0,
             faults: Faults | None = None, **kw: Any) -> SimResult:
    """One seed; the result names the first violation (and the trace tail leading to it)."""
    return Simulation(seed, nodes=nodes, duration=duration, faults=faults, **kw).run()


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    """Run every seed (over ``jobs`` processes); results in seed order, traces kept for failures."""
    results = seed_runner.run_many(run_seed, seeds, jobs=jobs, **kw)
    for result in results:
        if result.violation is None:
            result.trace = []
    return results


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=1000, help="number of seeds (default 1000)")
    parser.add_argument("--start-seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--nodes", type=int, default=3, help="nodes per datacenter (default 3)")
    parser.add_argument("--duration", type=float, default=60.0, help="virtual seconds per seed")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--no-faults", action="store_true", help="no network faults or crashes")
    parser.add_argument("--unsafe", nargs="+", action="extend", default=[],
                        choices=Unsafe.names(), metavar="RULE",
                        help=f"break a rule on purpose ({', '.join(Unsafe.names())})")
    parser.add_argument("--trace", action="store_true", help="print the trace tail of failing seeds")
    parser.set_defaults(handler=simulate)


def simulate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    faults = Faults.none() if args.no_faults else Faults()
    results = run_many(range(args.start_seed, args.start_seed + args.seeds), jobs=args.jobs,
                       nodes=args.nodes, duration=args.duration, faults=faults,
                       unsafe=Unsafe.of(args.unsafe))
    failing = seed_runner.report_failures(results, trace=args.trace)
    elapsed = time.monotonic() - started
    failovers = sum(r.failovers for r in results)
    unserved = sum(r.unserved for r in results) / max(1, len(results))
    print(f"seeds {len(results)}, violations {len(failing)}, failovers {failovers}, "
          f"confirmed {sum(r.confirmed for r in results)}, unserved {unserved:.1f}s/seed, "
          f"elapsed {elapsed:.1f}s ({len(results) / max(elapsed, 1e-9):.0f} seeds/s over "
          f"{args.jobs} processes)")
    return 1 if failing else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="brokerha cluster simulate", description=__doc__.splitlines()[0])
    register(parser)
    return simulate(parser.parse_args(argv))

