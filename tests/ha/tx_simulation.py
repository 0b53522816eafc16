"""Deterministic simulation of the transaction protocol on the real sans-I/O objects.

Three nodes, each a real ``Broker`` over a ``DiskStore`` (a MemoryStore that
models a disk: what was recorded before a completed ``after_sync`` survives a
crash, the rest is lost), driven through the node's own HA core
(``brokerha.ha.core.HACore``, as ``node/ha.py`` drives it): the serving node's
core runs a real ``Primary`` (with its ``PrimaryTxObserverFactory``,
tx-queues, votes, TxTrackers), the others' a real ``Backup``
(``TransactionReplicator``, ``TxBuffer``). So the rules checked are the
product's: a backup acknowledges what it applied only from its store's
``after_sync``, after recording its position in the same commit; the
primary's position goes through its replication barrier the same way. The
simulation supplies the core's effects: links (ordered streams; packets
cross ``tests.ha.harness.wire``, msgpack), the loop's ``soon`` (run after
each step, in order) and timers on the virtual clock.

Clients act on the primary's broker model directly, as the channel does: TX
transactions (``Transaction``: publishes of numbered messages to 1-3 queues,
acknowledgements of earlier messages; ``tx.commit`` as a task, commit-ok after
``Broker.after_durable``; a refused prepare is a 406 and the channel's
unacked entries go back) and XA branches (``DtxManager`` start/end/prepare/
commit/rollback, one-phase commits, each answer after ``after_durable``; the
TM finishes in-doubt branches through ``recover`` after a failover).

At every step the seeded scheduler picks one of: deliver the next packet of a
link (links are ordered streams, one per backup and direction), sync a node's
store, a client action, advance the virtual clock (``tx_prepare_timeout``,
``backup_timeout``), break a link (everything in flight is lost; the primary
loses the session, the backup joins again), crash a backup, crash the primary,
restart a crashed node (rebuilt from its disk by ``Broker.restore``, it joins
as a backup), elect (the most advanced live node a majority would vote for,
by the positions and vote floors the nodes recorded; then the verification
phase with the reachable nodes — a reply may be lost — and ``carry_out``).

Checked after every step (``Violation`` with the seed and the trace tail):

- atomicity: on the primary, on every caught-up backup and on the disk image
  of every node whose recorded position is valid, the messages present
  (ready, or held by a transaction or branch) are exactly those the node's
  committed transactions (its outcome records) put there and did not take
  away: no transaction is partly there, none twice, no dequeue without its
  enqueue;
- agreement: an outcome decided (commit-ok, an XA answer, a refused commit, a
  client rollback, a verification decision) is never contradicted by a
  decision made later, nor by the outcome record of the primary or of a
  caught-up backup;
- durability: every transaction decided committed is committed on the serving
  primary; every branch whose prepare answered XA_OK and that the TM has not
  finished is listed by the primary's ``recover`` (or has its outcome there);
- TxTrackers: a backup the primary reports ready holds the outcome of every
  transaction committed after its join that it did not vote on;

and at the end of a run (every node restarted, the TM done, the links
drained): every node equal to the primary (definitions, positions, bodies and
outcome records), no prepared record or in-doubt branch left. A run whose
heal phase can elect nobody is reported *stuck* (liveness, not safety; those
final checks are skipped). It found one: the primary recorded its own position
only when a confirm waited for it, so it could restart behind the vote floors
its backups acknowledged, and if they were catching up nobody was electable;
now (as node/ha.py) the position is recorded with every flush of events.

``Unsafe`` breaks a rule on purpose; the checker must then report a violation.
Run: ``python -m tests.ha.tx_simulation --seeds 1000 --jobs 2`` (``--seed N
--trace`` replays one seed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from brokerha import seed_runner
from brokerha.backup.backup import INVALID, Backup
from brokerha.broker.broker import Broker
from brokerha.broker.dtx import XA, XAError, Xid
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.broker.transaction import TransactionAborted
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK
from brokerha.cluster.election import Position
from brokerha.cluster.messages import Message
from brokerha.cluster.quorum import majority
from brokerha.cluster.replication import (
    Ack,
    Events,
    Join,
    TxVote,
    VerifyReply,
)
from brokerha.cluster.state import NodeState
from brokerha.ha.core import POSITION_KEY, HACore, PrimarySettings, load_position
from brokerha.ha.core import Unsafe as CoreUnsafe
from brokerha.ha.simulation.disk import DiskStore, Image
from brokerha.primary.primary import Primary
from brokerha.primary.tx_queue import TxQueue
from brokerha.primary.verification import COMMIT, ROLLBACK, Verification, answer, carry_out
from tests.ha.harness import contents, message, wire

NODES = ("n1", "n2", "n3")
QUEUES = ("q1", "q2", "q3")
TRACE_TAIL = 40
TX_PREPARE_TIMEOUT = 2.0
BACKUP_TIMEOUT = 3.0
MAX_TX_CLIENTS = 3
MAX_TMS = 2


class Violation(Exception):
    pass


@dataclass(frozen=True)
class Unsafe:
    """Rules to break on purpose: each one must make the checker report a violation."""

    early_ack: bool = False       # a backup acknowledges before its store synced (ha.core's rule)
    no_tx_trackers: bool = False  # a backup joining during a prepared transaction is ready at
                                  # once (ha.core's rule)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def of(cls, names: Iterable[str]) -> Unsafe:
        return cls(**{name: True for name in names})


@dataclass
class Weights:
    """Relative weights of the scheduler's choices (each only when it can happen)."""

    deliver: float = 40.0
    sync: float = 14.0
    client: float = 18.0
    clock: float = 2.5
    link_loss: float = 2.0
    crash_backup: float = 1.2
    crash_primary: float = 0.8
    restart: float = 4.0
    elect: float = 6.0


Pos = tuple[int, int]


def read_position(meta: dict[str, str]) -> tuple[Pos, Pos]:
    raw = meta.get(POSITION_KEY)
    if raw is None:
        return INVALID, INVALID
    pe, ps, fe, fs = json.loads(raw)
    return (pe, ps), (fe, fs)


# -- nodes, links, clients ------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class SimPrimary(Primary):
    """The real Primary; the simulation notes each commit's seqs for the TxTracker check."""

    sim: Simulation

    def tx_commit(self, txq: TxQueue) -> None:
        prepare_seq = txq.prepare_seq
        super().tx_commit(txq)
        self.sim.committed_here.append((txq.name, prepare_seq, self.seq))


@dataclass
class Link:
    """One backup's ordered streams to (down) and from (up) the primary."""

    down: deque[Any] = field(default_factory=deque)
    up: deque[Any] = field(default_factory=deque)


class Timer:
    """A ``later`` callback on the virtual clock (ha.core.Cancellable)."""

    def __init__(self, due: float, callback: Callable[[], None]) -> None:
        self.due, self.callback, self.cancelled = due, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class NodeEffects:
    """What one node's HA core asks of the simulation (ha.core.Effects)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def send(self, peer: str, message: Message) -> None:
        node = self.node
        if not node.up:
            return
        if node.primary is not None:  # to a backup, down its link
            link = node.sim.links.get(peer)
            if link is not None:
                link.down.append(message)
        else:
            link = node.sim.links.get(node.name)
            if link is not None:
                link.up.append(message)

    def send_many(self, peer: str, messages: Sequence[Message]) -> None:
        for packet in messages:
            self.send(peer, packet)

    def connected(self, peer: str) -> bool:
        return self.node.up and self.node.name in self.node.sim.links

    def position(self, pos: Position) -> None:
        self.node.position = (pos.epoch, pos.seq)

    def soon(self, callback: Callable[[], None]) -> None:
        self.node.sim.soon.append((self.node, callback))

    def later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(self.node.sim.clock.now + delay, callback)
        self.node.sim.timers.append((self.node, timer))
        return timer

    def replication_failed(self, reason: str) -> None:
        self.node.sim.violate(f"{self.node.name} cannot follow the primary: {reason}")

    def joined(self, primary: str, epoch: int) -> None:
        self.node.sim.note(f"{self.node.name} joins {primary} (epoch {epoch})")


class Node:
    """One node: a Broker on a DiskStore and the product's HA core."""

    def __init__(self, name: str, sim: Simulation, disk: Image | None = None) -> None:
        self.name = name
        self.sim = sim
        self.store = DiskStore(disk)
        self.broker = Broker(name, clock=sim.clock, store=self.store)
        if disk is not None:
            self.broker.restore(self.store.load())
        self.broker.add_vhost("/")
        self.up = True
        state = NodeState()
        load_position(self.broker, state)
        self.position, _ = read_position(self.store.meta)
        self.core = HACore(self.broker, name, state, NodeEffects(self),
                           PrimarySettings(len(NODES), BACKUP_TIMEOUT,
                                           tx_prepare_timeout=TX_PREPARE_TIMEOUT),
                           sim.clock, primary_factory=sim.make_primary,
                           unsafe=CoreUnsafe(early_ack=sim.unsafe.early_ack,
                                                  no_tx_trackers=sim.unsafe.no_tx_trackers))

    @property
    def primary(self) -> SimPrimary | None:
        return self.core.primary  # type: ignore[return-value]

    @property
    def backup(self) -> Backup | None:
        return self.core.backup

    @property
    def floor(self) -> Pos:
        return (self.core.state.floor_epoch, self.core.state.floor_seq)

    @property
    def consistent(self) -> bool:
        """Holds a consistent copy in memory: the primary, or a caught-up backup."""
        return self.up and (self.primary is not None
                            or (self.backup is not None and self.backup.caught_up))

@dataclass
class Client:
    """One transaction (TX) or branch (DTX) from the client's (or TM's) side."""

    key: int
    kind: str                          # "tx" | "dtx"
    node: Node
    obj: Any                           # the Transaction, or the Xid
    txid: str | None = None            # the replication id (tx-queue name)
    enq: list[tuple[str, bytes]] = field(default_factory=list)
    deq: list[tuple[str, bytes]] = field(default_factory=list)
    held: list[tuple[Queue, Entry]] = field(default_factory=list)
    state: str = "open"                # open | busy | idle | prepared | unknown | done
    tm: str | None = None              # the TM's decision: commit | rollback
    prepared_ok: bool = False          # prepare answered XA_OK
    task: asyncio.Task[Any] | None = None


# -- the simulation -------------------------------------------------------------------------

class Simulation:
    def __init__(self, seed: int, *, steps: int = 300, unsafe: Unsafe | None = None,
                 weights: Weights | None = None, trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.steps = steps
        self.unsafe = unsafe or Unsafe()
        self.weights = weights or Weights()
        self.clock = Clock()
        self.nodes: dict[str, Node] = {}
        self.links: dict[str, Link] = {}
        self.soon: list[tuple[Node, Callable[[], None]]] = []   # the cores' ``soon``, in order
        self.timers: list[tuple[Node, Timer]] = []             # their ``later``
        self.primary_node: Node | None = None
        self.epoch = 0
        self.trace: deque[str] = deque(maxlen=None if trace else TRACE_TAIL)
        self.step = 0
        self.clients: list[Client] = []
        self.keys = 0
        self.initial: Counter[tuple[str, bytes]] = Counter()
        self.effects: dict[str, tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]] = {}
        self.decided: dict[str, tuple[str, str]] = {}   # txid -> (commit|rollback, why)
        self.committed_here: list[tuple[str, int | None, int]] = []  # this epoch's tc seqs
        self.stats: Counter[str] = Counter()
        self._expected: dict[frozenset[str], dict[tuple[str, bytes], int]] = {}
        self.stuck: str | None = None

    # -- trace and checks ------------------------------------------------------------------

    def note(self, text: str) -> None:
        self.trace.append(f"{self.step:4d} t={self.clock.now - 1000:7.2f} {text}")

    def violate(self, text: str) -> None:
        raise Violation(f"seed {self.seed}: {text}")

    def make_primary(self, *args: Any, **kw: Any) -> SimPrimary:
        """The cores' ``primary_factory``: the real Primary, noting commits for the checks."""
        primary = SimPrimary(*args, **kw)
        primary.sim = self
        return primary

    def decide(self, txid: str | None, outcome: str, why: str) -> None:
        if txid is None:
            return
        before = self.decided.get(txid)
        if before is not None and before[0] != outcome:
            self.violate(f"{txid} decided {outcome} ({why}) after {before[0]} ({before[1]})")
        if before is None:
            self.decided[txid] = (outcome, why)
            self.note(f"decided {txid} {outcome} ({why})")

    # -- set-up ----------------------------------------------------------------------------

    async def run(self) -> SimResult:
        violation = None
        try:
            self.setup()
            await self.quiesce()
            self.check()
            for step in range(1, self.steps + 1):
                self.step = step
                await self.one_step()
                await self.quiesce()
                self.check()
            self.step += 1
            await self.finish()
        except Violation as exc:
            violation = str(exc)
        return SimResult(self.seed, violation, list(self.trace) if violation else [],
                         dict(self.stats), self.stuck)

    def setup(self) -> None:
        for name in NODES:
            self.nodes[name] = Node(name, self)
        first = self.nodes[NODES[0]]
        vh = first.broker.vhosts["/"]
        for q in QUEUES:
            vh.declare_queue(q, owner=None, durable=True)
        self.become_primary(first, epoch=1, verify=False)
        for q in QUEUES:
            for i in range(4):
                body = b"init-%s-%d" % (q.encode(), i)
                first.broker.vhosts["/"].queues[q].enqueue(message(body, q, persistent=True))
                self.initial[(q, body)] += 1
        for node in self.nodes.values():
            node.store.sync()
        for name in NODES[1:]:
            self.follow(self.nodes[name])

    async def quiesce(self) -> None:
        """Let the client tasks run until they wait again; queue what the primary emitted."""
        for _ in range(6):
            if not any(c.task is not None and not c.task.done() for c in self.clients):
                break
            await asyncio.sleep(0)
        self.flush()

    # -- roles -----------------------------------------------------------------------------

    def become_primary(self, node: Node, epoch: int, verify: bool = True) -> dict[str, str]:
        self.epoch = epoch
        self.committed_here = []
        self.links = {}
        primary = node.core.become_primary(epoch)
        self.primary_node = node
        decisions: dict[str, str] = {}
        if verify:
            peers = [n for n in self.nodes.values() if n.up and n is not node]
            verification = Verification.start(node.broker, epoch, node.name,
                                               [p.name for p in peers], self.clock.now, 2.0)
            request = wire(verification.request())
            for peer in peers:
                if self.rng.random() < 0.85:
                    reply = wire(answer(peer.broker, request, peer.name))  # type: ignore[arg-type]
                    assert isinstance(reply, VerifyReply)
                    verification.receive(reply)
                else:
                    self.note(f"verify reply of {peer.name} lost (timeout)")
            decisions = carry_out(node.broker, verification)
            for decision in decisions.values():
                self.stats[f"verify {decision}"] += 1

            def durable() -> None:
                # known to anyone (a tx-outcome answer) only from here: a new primary
                # that dies before replicating its decisions may be overruled
                if node.primary is not primary or not node.up:
                    return
                for txid, decision in sorted(decisions.items()):
                    if decision in (COMMIT, ROLLBACK):
                        self.decide(txid, "commit" if decision == COMMIT else "rollback",
                                    f"verification by {node.name}")

            if decisions:
                node.broker.after_durable(durable)
        node.core.verified()
        return decisions

    def follow(self, node: Node) -> None:
        """``node`` follows the current primary: a new Backup (position as recorded), a join."""
        assert self.primary_node is not None
        self.links[node.name] = Link()
        if not node.core.become_backup(self.epoch, self.primary_node.name):
            node.core.send_join()

    def join(self, node: Node) -> None:
        """A new link (the old one broke): the same Backup joins again, as on the node."""
        self.links[node.name] = Link()
        node.core.send_join()

    # -- packets ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Run what the cores asked to run soon (flushes, position records), in order; then
        the primary's flush, as node/ha.py after every packet and on every tick."""
        while self.soon:
            node, callback = self.soon.pop(0)
            if node.up and self.nodes.get(node.name) is node:
                callback()
        if self.primary_node is not None:
            self.primary_node.core.flush()

    def run_timers(self) -> None:
        due = [(n, t) for n, t in self.timers if t.due <= self.clock.now]
        self.timers = [(n, t) for n, t in self.timers if t.due > self.clock.now]
        for node, timer in due:
            if not timer.cancelled and node.up and self.nodes.get(node.name) is node:
                timer.callback()

    def deliver_down(self, name: str) -> None:
        link = self.links[name]
        packet = wire(link.down.popleft())
        node = self.nodes[name]
        assert isinstance(packet, Events) and node.backup is not None
        self.note(f"-> {name} events {packet.first_seq}..{packet.first_seq + len(packet.events) - 1}"
                  f" {[e[0] for e in packet.events][:12]}")
        node.core.on_events(self.primary_node.name, packet)  # type: ignore[union-attr]

    def deliver_up(self, name: str) -> None:
        link = self.links[name]
        packet = wire(link.up.popleft())
        primary = self.primary_node.primary  # type: ignore[union-attr]
        assert primary is not None
        if isinstance(packet, Join):
            self.note(f"{name} joins at ({packet.pos_epoch}, {packet.pos_seq})")
            self.primary_node.core.on_join(name, 0, packet)  # type: ignore[union-attr]
        elif isinstance(packet, Ack):
            self.note(f"{name} acks {packet.seq}")
            primary.backup_acked(name, packet.seq)
        elif isinstance(packet, TxVote):
            self.note(f"{name} votes {packet.ok} on {packet.txid}: {packet.reason}")
            primary.tx_vote(name, packet.txid, packet.ok, packet.reason)

    def break_link(self, name: str) -> None:
        self.note(f"link to {name} breaks: {len(self.links[name].down)} down, "
                  f"{len(self.links[name].up)} up packets lost; it joins again")
        self.stats["link loss"] += 1
        primary = self.primary_node.primary  # type: ignore[union-attr]
        primary.backup_lost(name, "link down")  # type: ignore[union-attr]
        self.join(self.nodes[name])

    # -- crashes, restarts, elections ----------------------------------------------------------

    def crash(self, node: Node) -> None:
        self.note(f"CRASH {node.name}" + (" (primary)" if node.primary is not None else ""))
        self.stats["crash"] += 1
        for client in self.clients:
            if client.node is node and client.state not in ("done",):
                if client.task is not None and not client.task.done():
                    client.task.cancel()
                if client.kind == "tx":
                    client.state = "done"  # the connection is gone: the client never knows
                    client.held = []
                elif client.state in ("open", "idle"):
                    client.state = "done"  # never prepared: the branch died with the primary
                    client.held = []
                else:
                    client.state = "unknown"
        node.up = False
        node.store.waiting = []  # never completed: the process is gone
        if node.primary is not None:
            node.core.demote()
            self.primary_node = None
            self.links = {}
        else:
            node.core.backup = None
            self.links.pop(node.name, None)
            primary = self.primary_node.primary if self.primary_node else None
            if primary is not None:
                primary.backup_lost(node.name, "link down")

    def restart(self, node: Node) -> None:
        fresh = Node(node.name, self, node.store.disk.copy())
        self.nodes[node.name] = fresh
        self.note(f"restart {node.name} at position {fresh.position} floor {fresh.floor}")
        self.check_disk(fresh.name, fresh.store.disk)
        if self.primary_node is not None:
            self.follow(fresh)

    def candidate(self) -> Node | None:
        """The node the election would make primary: the most advanced with a majority of votes."""
        live = [n for n in self.nodes.values() if n.up]
        if len(live) < majority(len(NODES)):
            return None
        valid = sorted((n for n in live if n.position != INVALID),
                       key=lambda n: (n.position, n.name), reverse=True)
        for cand in valid:
            voters = [n for n in live if n is not cand and n.floor <= cand.position]
            if 1 + len(voters) >= majority(len(NODES)):
                return cand
        return None

    def elect(self, node: Node) -> None:
        epoch = max(self.epoch, max(n.floor[0] for n in self.nodes.values())) + 1
        self.note(f"ELECT {node.name} at {node.position} for epoch {epoch}")
        self.stats["failover"] += 1
        decisions = self.become_primary(node, epoch)
        if decisions:
            self.note(f"verification: {decisions}")
        for other in self.nodes.values():
            if other.up and other is not node:
                self.follow(other)
        # the TM and the clients move to the new primary: in-flight work is unknown
        for client in self.clients:
            if client.state == "unknown":
                client.node = node

    # -- clients ---------------------------------------------------------------------------

    def queue(self, node: Node, name: str) -> Queue:
        return node.broker.vhosts["/"].queues[name]

    def work(self, client: Client, publish: Callable[[list[Queue], Any], None],
             accept: Callable[[list[tuple[Queue, Entry]]], None]) -> None:
        node = client.node
        for i in range(self.rng.randint(0 if self.rng.random() < 0.3 else 1, 4)):
            names = sorted(self.rng.sample(QUEUES, self.rng.randint(1, 3)))
            body = b"%s%d.%d" % (client.kind.encode(), client.key, i)
            publish([self.queue(node, q) for q in names], message(body, "", persistent=True))
            client.enq.extend((q, body) for q in names)
        for _ in range(self.rng.randint(0, 2)):
            q = self.queue(node, self.rng.choice(QUEUES))
            entry = q.get()
            if entry is None:
                continue
            client.held.append((q, entry))
            client.deq.append((q.name, entry.message.body))
            accept([(q, entry)])

    def give_back(self, client: Client) -> None:
        """The channel closes (or the branch rolls back): unacked entries go back."""
        for q, entry in client.held:
            if not q.deleted and client.node.up and client.kind == "tx":
                q.requeue(entry)
        client.held = []

    def client_action(self) -> bool:
        node = self.primary_node
        if node is None:
            return False
        live = [c for c in self.clients if c.state != "done"]
        choices: list[Callable[[], None]] = []
        if sum(c.kind == "tx" for c in live) < MAX_TX_CLIENTS:
            choices.append(self.tx_begin)
        if sum(c.kind == "dtx" for c in live) < MAX_TMS:
            choices.append(self.dtx_begin)
        for c in live:
            if c.state in ("open", "idle", "prepared", "unknown") and c.node is node:
                choices.append(lambda c=c: self.advance(c))  # type: ignore[misc]
        if not choices:
            return False
        self.rng.choice(choices)()
        return True

    def tx_begin(self) -> None:
        node = self.primary_node
        assert node is not None
        self.keys += 1
        tx = node.broker.new_transaction()
        client = Client(self.keys, "tx", node, tx)
        self.work(client, tx.publish, lambda acked: tx.accept(acked, []))
        client.txid = tx.replication_id
        self.clients.append(client)
        self.note(f"tx{client.key} {client.txid}: +{client.enq} -{client.deq}")
        if client.txid is not None:
            self.effects[client.txid] = (client.enq, client.deq)

    def dtx_begin(self) -> None:
        node = self.primary_node
        assert node is not None
        self.keys += 1
        xid = Xid(1, b"sim-%d-%d" % (self.seed, self.keys))
        branch = node.broker.dtx.start(xid, "channel")
        client = Client(self.keys, "dtx", node, xid)
        self.work(client, branch.publish, lambda acked: branch.accept(acked, []))
        node.broker.dtx.end(xid, "channel")
        client.txid = branch.replication_id
        client.state = "idle"
        self.clients.append(client)
        self.note(f"dtx{client.key} {client.txid}: +{client.enq} -{client.deq}")
        if client.txid is not None:
            self.effects[client.txid] = (client.enq, client.deq)

    def advance(self, client: Client) -> None:
        if client.kind == "tx":
            if self.rng.random() < 0.12:
                self.note(f"tx{client.key} rollback")
                client.obj.rollback()
                self.give_back(client)
                client.state = "done"
                self.decide(client.txid, "rollback", "client rollback")
                return
            client.state = "busy"
            client.task = asyncio.ensure_future(self.tx_commit(client))
            return
        if client.state == "unknown":
            self.tm_recover(client)
            return
        dtx = client.node.broker.dtx
        xid = client.obj
        r = self.rng.random()
        if client.state == "idle" and r < 0.65:
            client.state = "busy"
            client.task = asyncio.ensure_future(self.xa(client, "prepare", dtx.prepare(xid)))
        elif client.state == "idle" and r < 0.85:
            client.state, client.tm = "busy", "commit"
            client.task = asyncio.ensure_future(
                self.xa(client, "commit1", dtx.commit(xid, one_phase=True)))
        elif client.state == "prepared" and r < 0.75:
            client.state, client.tm = "busy", "commit"
            client.task = asyncio.ensure_future(self.xa(client, "commit", dtx.commit(xid)))
        else:
            client.tm, client.state = "rollback", "busy"
            self.note(f"dtx{client.key} rollback")
            self.answer_xa(client, "rollback", self.xa_now(dtx.rollback, xid))

    def xa_now(self, verb: Callable[[Xid], XA], xid: Xid) -> XA:
        """A verb that answers at once; an XA error is its answer."""
        try:
            return verb(xid)
        except XAError as exc:
            return exc.code

    async def tx_commit(self, client: Client) -> None:
        node = client.node
        self.note(f"tx{client.key} commit")
        try:
            await client.obj.commit()
        except TransactionAborted:
            self.note(f"tx{client.key} 406: not committed")
            self.give_back(client)
            client.state = "done"
            self.decide(client.txid, "rollback", "commit refused")
            return
        client.held = []

        def commit_ok() -> None:
            if client.node is node and node.up and node.primary is not None:
                client.state = "done"
                self.stats["commit-ok"] += 1
                self.decide(client.txid, "commit", "commit-ok")

        node.broker.after_durable(commit_ok)

    async def xa(self, client: Client, verb: str, work: Any) -> None:
        try:
            code = await work
        except XAError as exc:
            code = exc.code
        self.answer_xa(client, verb, code)

    def answer_xa(self, client: Client, verb: str, code: XA) -> None:
        """The TM hears ``code`` once ``after_durable`` passed (dtx_control.answer)."""
        node = client.node
        client.held = [] if verb != "prepare" or code != XA.OK else client.held

        def deliver() -> None:
            if not (client.node is node and node.up and node.primary is not None):
                return
            self.note(f"dtx{client.key} {verb}: {code.label}")
            if verb == "prepare" and code == XA.OK:
                client.state, client.prepared_ok = "prepared", True
                self.stats["xa prepared"] += 1
                return
            client.state = "done"
            if verb.startswith("commit") and code == XA.OK:
                self.stats["xa committed"] += 1
                self.decide(client.txid, "commit", f"XA {verb} XA_OK")
            elif verb == "rollback" and code == XA.OK:
                self.decide(client.txid, "rollback", "XA rollback XA_OK")
            elif code in (XA.RBROLLBACK, XA.RBTIMEOUT):
                self.decide(client.txid, "rollback", f"XA {verb} {code.label}")
            elif code != XA.RDONLY:
                self.violate(f"dtx{client.key} {verb} answered {code.label}")

        node.broker.after_durable(deliver)

    def tm_recover(self, client: Client) -> None:
        """After a failover the TM asks recover (answered after_durable) and finishes the branch."""
        node = client.node
        xid = client.obj
        listed = xid in node.broker.dtx.recover()
        client.state = "busy"

        def heard() -> None:
            if not (client.node is node and node.up and node.primary is not None):
                client.state = "unknown"
                return
            dtx = node.broker.dtx
            if xid not in dtx.recover():
                outcome = node.broker.outcomes._records.get(client.txid or "")
                self.note(f"dtx{client.key}: not in recover, outcome {outcome and outcome[2]}")
                if client.prepared_ok and outcome is None:
                    self.violate(f"dtx{client.key} {client.txid} prepared XA_OK, then neither in "
                                 f"recover nor decided on {node.name}")
                if outcome is not None and outcome[2] == COMMITTED and client.tm != "commit":
                    self.violate(f"dtx{client.key} committed without the TM's commit")
                if outcome is not None and outcome[2] == COMMITTED:
                    self.decide(client.txid, "commit", "TM read the outcome")
                elif client.txid is not None:
                    self.decide(client.txid, "rollback", "TM: not in recover")
                client.state = "done"
                return
            if client.tm == "commit" or (client.prepared_ok and client.tm is None
                                         and self.rng.random() < 0.5):
                client.tm, client.state = "commit", "busy"
                self.note(f"dtx{client.key}: recover lists it; TM commits")
                client.task = asyncio.ensure_future(self.xa(client, "commit", dtx.commit(xid)))
            else:
                client.tm, client.state = "rollback", "busy"
                self.note(f"dtx{client.key}: recover lists it; TM rolls back")
                self.answer_xa(client, "rollback", self.xa_now(dtx.rollback, xid))

        self.note(f"dtx{client.key}: TM asks recover on {node.name} (listed now: {listed})")
        node.broker.after_durable(heard)

    # -- the scheduler ---------------------------------------------------------------------

    async def one_step(self) -> None:
        w = self.weights
        options: list[tuple[float, Callable[[], None]]] = []
        primary = self.primary_node
        for name, link in sorted(self.links.items()):
            if link.down:
                options.append((w.deliver, lambda n=name: self.deliver_down(n)))  # type: ignore[misc]
            if link.up:
                options.append((w.deliver / 2, lambda n=name: self.deliver_up(n)))  # type: ignore[misc]
        for node in self.nodes.values():
            if node.up and node.store.waiting:
                options.append((w.sync, lambda n=node: self.sync(n)))  # type: ignore[misc]
        if primary is not None:
            options.append((w.client, self.client_action))
            for name in sorted(self.links):
                options.append((w.link_loss / 2, lambda n=name: self.break_link(n)))  # type: ignore[misc]
            options.append((w.crash_primary, lambda: self.crash(primary)))  # type: ignore[arg-type]
        options.append((w.clock, self.tick))
        for node in self.nodes.values():
            if node.up and node.primary is None:
                options.append((w.crash_backup / 2, lambda n=node: self.crash(n)))  # type: ignore[misc]
            if not node.up:
                options.append((w.restart, lambda n=node: self.restart(n)))  # type: ignore[misc]
        if primary is None:
            cand = self.candidate()
            if cand is not None:
                options.append((w.elect, lambda c=cand: self.elect(c)))  # type: ignore[misc]
        total = sum(weight for weight, _ in options)
        r = self.rng.random() * total
        for weight, action in options:
            r -= weight
            if r <= 0:
                action()
                return
        options[-1][1]()

    def sync(self, node: Node) -> None:
        self.note(f"sync {node.name}")
        node.store.sync()
        if node.store.disk.meta.get(POSITION_KEY):
            self.check_disk(node.name, node.store.disk)

    def tick(self) -> None:
        self.clock.now += self.rng.choice((0.2, 0.5, 1.0, 2.5))
        self.note("clock")
        self.run_timers()
        node = self.primary_node
        if node is not None and node.primary is not None:
            node.primary.tick(self.clock.now)
            node.broker.tick(self.clock.now)

    # -- invariants ------------------------------------------------------------------------

    def expected(self, committed: frozenset[str]) -> dict[tuple[str, bytes], int]:
        """What the committed transactions leave: counts, none zero (negative: a bug)."""
        want = self._expected.get(committed)
        if want is None:
            counts = Counter(self.initial)
            for txid in committed:
                enq, deq = self.effects.get(txid, ([], []))
                counts.update(enq)
                counts.subtract(deq)
            want = self._expected[committed] = {k: v for k, v in counts.items() if v}
        return want

    def check_atomic(self, where: str, present: Counter[tuple[str, bytes]],
                     outcomes: dict[str, Any]) -> None:
        committed = frozenset(t for t, r in outcomes.items() if r[2] == COMMITTED)
        want = self.expected(committed)
        if not dict.__eq__(want, present):  # (Counter.__eq__ is slow)
            unknown = [t for t in committed if t not in self.effects]
            if unknown:
                self.violate(f"{where}: committed transactions no client ran: {unknown}")
            missing = sorted((Counter(want) - present).elements())
            extra = sorted((present - Counter(want)).elements())
            negative = sorted(k for k, v in want.items() if v < 0)
            self.violate(f"{where}: not atomic: missing {missing[:8]}, extra {extra[:8]}"
                         + (f", dequeued before enqueued {negative[:4]}" if negative else ""))

    def present(self, node: Node) -> Counter[tuple[str, bytes]]:
        out: Counter[tuple[str, bytes]] = Counter()
        for q in node.broker.vhosts["/"].queues.values():
            name = q.name
            out.update([(name, e.message.body) for e in q.ready])
        if node.primary is not None:
            for branch in node.broker.dtx.branches.values():
                for q, e in branch.accepts:
                    out[(q.name, e.message.body)] += 1
            for client in self.clients:
                if client.node is node and client.kind == "tx":
                    for q, e in client.held:
                        out[(q.name, e.message.body)] += 1
        return out

    def check_disk(self, name: str, disk: Image) -> None:
        position, _ = read_position(disk.meta)
        if position == INVALID:
            return
        present: Counter[tuple[str, bytes]] = Counter(
            (m.queue, m.body) for m in disk.messages.values())
        self.check_atomic(f"{name}'s disk at {position}", present, disk.outcomes)

    def check(self) -> None:
        primary_node = self.primary_node
        for node in self.nodes.values():
            if node.consistent:
                self.check_atomic(f"{node.name} ({'primary' if node.primary else 'backup'})",
                                  self.present(node), node.broker.outcomes._records)
                for txid, (outcome, why) in self.decided.items():
                    record = node.broker.outcomes._records.get(txid)
                    if record is None:
                        continue
                    if (outcome == "commit") != (record[2] == COMMITTED):
                        self.violate(f"{node.name} shows {txid} {record[2]}, decided {outcome} "
                                     f"({why})")
        if primary_node is None:
            return
        primary = primary_node.primary
        assert primary is not None
        outcomes = primary_node.broker.outcomes
        for txid, (outcome, why) in self.decided.items():
            if outcome == "commit" and not outcomes.committed(txid):
                self.violate(f"{txid} decided committed ({why}) is not committed on the "
                             f"primary {primary_node.name}")
        recover = set(primary_node.broker.dtx.recover())
        for client in self.clients:
            if (client.kind == "dtx" and client.prepared_ok and client.state != "done"
                    and client.node is primary_node and client.obj not in recover
                    and not outcomes.known(client.txid or "")):
                self.violate(f"dtx{client.key} {client.txid} answered XA_OK to prepare, is "
                             f"neither listed by recover nor decided on {primary_node.name}")
        for name, session in primary.sessions.items():
            if not session.ready:
                continue
            node = self.nodes[name]
            for txid, prepare_seq, tc_seq in self.committed_here:
                if (prepare_seq is not None and prepare_seq <= session.join_seq < tc_seq
                        and not node.broker.outcomes.committed(txid)):
                    self.violate(f"{name} is reported ready but lacks {txid}, committed at seq "
                                 f"{tc_seq} after its join at {session.join_seq} (prepared at "
                                 f"{prepare_seq})")

    # -- the end of a run: heal everything, drain, compare -------------------------------------

    async def finish(self) -> None:
        self.note("--- heal ---")
        for _ in range(60):
            for node in list(self.nodes.values()):
                if not node.up:
                    self.restart(node)
            if self.primary_node is None:
                cand = self.candidate()
                if cand is None:
                    # liveness, not safety: the primary's own recorded position lags the
                    # vote floors its backups acknowledged, and they were catching up
                    self.stuck = ("no node can be elected with every node up: "
                                  + ", ".join(f"{n.name} at {n.position} floor {n.floor}"
                                              for n in self.nodes.values()))
                    self.note(self.stuck)
                    return
                self.elect(cand)
            await self.drain()
            primary = self.primary_node.primary  # type: ignore[union-attr]
            for name, session in sorted(primary.sessions.items()):  # type: ignore[union-attr]
                if session.timed_out:  # it stays out until it joins again: make it
                    self.break_link(name)
            for client in self.clients:
                if client.state == "open" and client.kind == "tx":
                    client.obj.rollback()
                    self.give_back(client)
                    client.state = "done"
                    self.decide(client.txid, "rollback", "client rollback")
                elif client.state in ("idle", "prepared", "unknown") and client.kind == "dtx":
                    if client.state == "unknown":
                        self.tm_recover(client)
                    else:
                        client.tm = "rollback" if client.state == "idle" else (client.tm or "commit")
                        client.state = "busy"
                        if client.tm == "commit":
                            client.task = asyncio.ensure_future(self.xa(
                                client, "commit", client.node.broker.dtx.commit(client.obj)))
                        else:
                            self.answer_xa(client, "rollback", self.xa_now(
                                client.node.broker.dtx.rollback, client.obj))
            await self.drain()
            if all(c.state == "done" for c in self.clients):
                break
            self.clock.now += TX_PREPARE_TIMEOUT + 0.1
            self.primary_node.primary.tick(self.clock.now)  # type: ignore[union-attr]
        else:
            self.violate(f"clients never finished: {[(c.key, c.state) for c in self.clients if c.state != 'done']}")
        self.check()
        self.final_checks()

    async def drain(self) -> None:
        for _ in range(10_000):
            await self.quiesce()
            moved = False
            for name, link in sorted(self.links.items()):
                while link.down:
                    self.deliver_down(name)
                    moved = True
                while link.up:
                    self.deliver_up(name)
                    moved = True
            for node in self.nodes.values():
                if node.store.waiting:
                    self.sync(node)
                    moved = True
            if self.timers:  # a backup's deferred ack of dequeues (DEQUEUE_ACK_DELAY)
                self.clock.now = max(self.clock.now, min(t.due for _, t in self.timers))
                self.run_timers()
                moved = True
            await self.quiesce()
            self.check()
            if not moved:
                return
        self.violate("the links never drained")

    def final_checks(self) -> None:
        primary_node = self.primary_node
        assert primary_node is not None and primary_node.primary is not None
        primary = primary_node.primary
        expected = contents(primary_node.broker)
        records = {t: r[1:3] for t, r in primary_node.broker.outcomes._records.items()}
        for node in self.nodes.values():
            broker = node.broker
            if broker.ha_transactions:
                self.violate(f"{node.name} still holds prepared records {list(broker.ha_transactions)}")
            if broker.dtx.branches:
                self.violate(f"{node.name} still holds branches {list(broker.dtx.branches)}")
            if node is primary_node:
                continue
            session = primary.sessions.get(node.name)
            if session is None or not session.ready:
                self.violate(f"{node.name} is not a ready backup at the end")
            if contents(broker) != expected:
                self.violate(f"{node.name} differs from the primary {primary_node.name} at the end")
            mine = {t: r[1:3] for t, r in broker.outcomes._records.items()}
            if mine != records:
                diff = sorted(set(mine.items()) ^ set(records.items()))[:6]
                self.violate(f"{node.name}'s outcomes differ from the primary's: {diff}")
        for txid, (outcome, why) in self.decided.items():
            record = records.get(txid)
            if outcome == "commit" and (record is None or record[1] != COMMITTED):
                self.violate(f"{txid} decided committed ({why}) is {record} at the end")
            if outcome == "rollback" and record is not None and record[1] != ROLLED_BACK:
                self.violate(f"{txid} decided rolled back ({why}) is {record} at the end")
        self.stats["transactions"] = len(self.effects)
        self.stats["committed"] = sum(1 for r in records.values() if r[1] == COMMITTED)


# -- running seeds ------------------------------------------------------------------------

@dataclass
class SimResult:
    seed: int
    violation: str | None
    trace: list[str]
    stats: dict[str, int]
    stuck: str | None = None  # the heal phase could elect nobody (liveness): checks skipped

    def summary(self) -> str:
        if self.violation:
            return self.violation
        return f"seed {self.seed}: " + (f"STUCK {self.stuck}" if self.stuck else f"ok {self.stats}")


def run_seed(seed: int, **kw: Any) -> SimResult:
    return asyncio.run(Simulation(seed, **kw).run())


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    return seed_runner.run_many(run_seed, seeds, jobs=jobs, **kw)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.ha.tx_simulation",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--unsafe", nargs="+", default=[], choices=Unsafe.names())
    parser.add_argument("--trace", action="store_true", help="print failing seeds' trace tails")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the nodes' warnings: the trace says what happened
    started = time.monotonic()
    results = run_many(range(args.seed, args.seed + args.seeds), jobs=args.jobs,
                       steps=args.steps, unsafe=Unsafe.of(args.unsafe))
    failing = seed_runner.report_failures(results, trace=args.trace)
    stuck = [r for r in results if r.stuck]
    for r in stuck:
        print(r.summary())
    totals: Counter[str] = Counter()
    for r in results:
        totals.update(r.stats)
    elapsed = time.monotonic() - started
    print(f"seeds {len(results)}, violations {len(failing)}, stuck {len(stuck)}, {elapsed:.1f}s "
          f"({len(results) / elapsed:.0f} seeds/s); {dict(sorted(totals.items()))}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
