"""The TxLog in an HA datacenter, simulated: the product's bridge, master and replica through failovers.

Datacenter A is the datacenter of ``ha/simulation/world.py``: three nodes,
each a ``Broker`` on a simulated disk with the product's ``HAMember`` and,
as its ``PrimaryLayer``, the product's ``TxLogBridge``: the master
(``TxLogDriver`` on the round engine) runs on the serving primary and
replicates its journal through the ``Primary``; every backup keeps the
journal in its ``TxLogReplica``. Datacenter B is one standalone node with its
own bridge and master. Clients in both run TX transactions on the global
queue ``g``: publishes (enqueues) and acknowledgements of messages they
consumed (dequeues), each commit ordered by the two masters' rounds.

The harness supplies only I/O (``MasterIO``): the links between the two
masters (one ordered stream while both run, lost in flight when either
stops or the datacenters are cut apart), timers on the virtual clock, and
the TxLog directory of each node (``TxLogDisk``: real files the product
writes; what a crash keeps of a journal is what its completed fsyncs
covered, perhaps with a torn part of the rest). A's nodes crash, pause,
lose links and are promoted as in the other HA workloads; the datacenters
are cut apart now and then. No rule of the protocol lives here.

Checked after every event that changed anything:

- S1 and S3 (``txlog/simulation/invariants.py``) between the two datacenters'
  current masters (B's synchronised queue only grows, so A's every new master is
  held against all B ever agreed to; what a master of A synchronised but never
  got onto A's quorum nor sent may be rewritten by its successor, as after a
  standalone master's crash);
- the global queue holds the log: on every node whose master runs and whose
  bridge applied all its engine executed, the ready messages of ``g`` are
  the engine's model (no message twice, none the log dequeued, none it
  enqueued missing unless a client holds it);
- what B holds of A's own transactions, A's master knows (a failover never forgets
  what left the datacenter);
- a client told its commit failed (406) never sees it committed.

After the run (no new faults, A's nodes back, the clients done): both
masters hold the same synchronised queue, every commit-ok'd transaction is
in it as committed, no message was enqueued twice, ``g`` holds the same
messages in the same order in both datacenters and on every node of A.
``Unsafe`` breaks a rule in the product module that holds it (the driver's
``no_quorum_wait``, the bridge's ``no_reapply``; the HA rules of
``world.Unsafe`` too); the checks must then report a violation.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from brokerha import seed_runner
from brokerha.broker.arguments import GLOBAL_ARG
from brokerha.broker.broker import Broker
from brokerha.broker.content import read_message_id
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.broker.transaction import TransactionAborted
from brokerha.cluster.messages import Message as Packet
from brokerha.ha.simulation import world as w
from brokerha.ha.simulation.disk import DiskStore, Image
from brokerha.ha.simulation.transactions import contents
from brokerha.ha.simulation.world import (
    SETTLE_LIMIT,
    AsyncWorld,
    Faults,
    SimNode,
    SimProcess,
    SimResult,
    message,
    wire,
)
from brokerha.primary.primary import Primary
from brokerha.txlog.bridge import broker_bridge
from brokerha.txlog.bridge.broker_bridge import TxLogBridge
from brokerha.txlog.bridge.global_queues import queue_key
from brokerha.txlog.engine.config import Peer, TxLogConfig
from brokerha.txlog.engine.state import DurableState
from brokerha.txlog.engine.validation import COMMITTED
from brokerha.txlog.master import driver
from brokerha.txlog.master.driver import MasterIO, OnPacket, OnPeer, TxLogDriver
from brokerha.txlog.master.journal import JOURNAL, Journal
from brokerha.txlog.master.settings import MasterSettings, NodeTxLog
from brokerha.txlog.simulation.invariants import check_no_duplicate, check_prefix, converged

__all__ = ["CATCHES", "DatacenterSimulation", "SimResult", "Unsafe", "run_many", "run_seed"]

QUEUE = "g"
KEY = queue_key("/", QUEUE)
DCS = ("A", "B")
CATCHES = ("no_quorum_wait", "no_reapply")
MAX_CLIENTS = 3             # commits in flight per datacenter
FAULTS = Faults(rate=0.3, outage=(0.3, 4.0))
CUT_RATE = 0.1              # the datacenters cut apart, per virtual second ...
CUT_LENGTH = (0.1, 3.0)     # ... for this long (well below max-peer-lag: no split)
WAN_DELAY = (0.005, 0.04)   # one way between the datacenters


@dataclass(frozen=True)
class Unsafe(w.Unsafe):
    """The HA rules of ``world.Unsafe`` and the TxLog's, each in its product module."""

    no_quorum_wait: bool = False  # the master acts on a journal record before A's quorum has it
    no_reapply: bool = False      # a master starts without re-applying entries past the mark

    def driver(self) -> driver.Unsafe:
        return self._part(driver.Unsafe)  # type: ignore[no-any-return]

    def bridge(self) -> broker_bridge.Unsafe:
        return self._part(broker_bridge.Unsafe)  # type: ignore[no-any-return]


class TxLogDisk:
    """One node's TxLog directory on a simulated disk.

    Real files in a temporary directory, written by the product. Its
    replacements (``files.replace_durably``: snapshots, the peers file, an
    emptied journal) are durable when they return, as on a real disk; its
    journal appends are durable once an fsync that started after them
    completed (``fsync``, the product's ``MasterIO.fsync``). A crash keeps of
    the journal what the completed fsyncs covered and, half the time, a random
    part of the rest (a torn record, perhaps), which the next start cuts off
    with the product's own loader.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.synced: dict[int, int] = {}  # journal file (inode) -> bytes on disk

    def fsync(self, process: SimProcess, fd: int, done: Callable[[BaseException | None], None],
              *, sync: bool = True) -> None:
        stat = os.fstat(fd)
        os.close(fd)
        world = process.world

        def complete() -> None:
            if not process.alive:
                return  # the process died during the fsync: nothing known on disk
            if sync:
                self.synced[stat.st_ino] = max(self.synced.get(stat.st_ino, 0), stat.st_size)
            process.run(lambda: done(None))

        world.after(world.fsync_delay(), complete)

    def crash(self, rng: random.Random, config: TxLogConfig) -> None:
        journal = self.path / JOURNAL
        if journal.exists():
            stat = journal.stat()
            kept = min(self.synced.get(stat.st_ino, 0), stat.st_size)
            if stat.st_size > kept and rng.random() < 0.5:
                kept += rng.randint(0, stat.st_size - kept)
            os.truncate(journal, kept)
        loader = Journal(self.path, fsync=False)  # what the next start reads
        loader.load(config)
        loader.close()
        journal_now = journal.stat()
        self.synced = {journal_now.st_ino: journal_now.st_size}


class TxLogNet:
    """The links between the two datacenters' masters: a TCP stream while both run."""

    def __init__(self, world: DatacenterSimulation) -> None:
        self.world = world
        self.masters: dict[str, SimLinks] = {}
        self.cut = 0          # cuts in force between the datacenters
        self.gen = 0          # bumped by every change: what is in flight is lost
        self.last_at: dict[tuple[str, str], float] = {}

    def change(self) -> None:
        self.gen += 1

    def connected(self, links: SimLinks, peer: str) -> bool:
        other = self.masters.get(peer)
        return (self.masters.get(links.dc) is links and other is not None and not self.cut
                and links.process.alive and other.process.alive)

    def send(self, links: SimLinks, peer: str, packet: Packet) -> int | None:
        if not self.connected(links, peer):
            return None
        world, other, gen = self.world, self.masters[peer], self.gen
        lo, hi = WAN_DELAY
        key = (links.dc, peer)
        when = max(world.now + lo + (hi - lo) * world.rng.random(), self.last_at.get(key, 0.0))
        self.last_at[key] = when
        packet = wire(packet)

        def arrive() -> None:
            if self.gen == gen:
                other.on_packet(links.dc, 0, packet)

        def deliver() -> None:
            if self.gen == gen:
                other.process.run(arrive)  # a paused master reads it when it resumes

        world.after(when - world.now, deliver)
        return 1


class SimLinks:
    """A master's ``MasterLinks`` on the simulated WAN (``driver.MasterLinks``)."""

    address: tuple[str, int] | None = None

    def __init__(self, net: TxLogNet, process: SimProcess, dc: str, on_packet: OnPacket) -> None:
        self.net = net
        self.process = process
        self.dc = dc
        self.on_packet = on_packet

    async def start(self) -> None:
        self.net.masters[self.dc] = self
        self.net.change()

    async def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        if self.net.masters.get(self.dc) is self:
            del self.net.masters[self.dc]
            self.net.change()

    def send(self, peer: str, message: Packet) -> int | None:
        return self.net.send(self, peer, message)

    def connected(self, peer: str) -> bool:
        return self.net.connected(self, peer)

    def add_peer(self, peer: str, address: list[tuple[str, int]]) -> None:
        raise NotImplementedError("operators' peer changes are not simulated")

    def remove_peer(self, peer: str) -> None:
        raise NotImplementedError("operators' peer changes are not simulated")


@dataclass
class Client:
    """One TX transaction on ``g``, committed at once, from the client's side."""

    key: int
    dc: str
    process: SimProcess
    role: Primary | None               # A: the primary role its connection was made to
    tx: Any = None                     # its Transaction
    enq: list[str] = field(default_factory=list)
    deq: list[str] = field(default_factory=list)
    held: list[tuple[Queue, Entry]] = field(default_factory=list)
    state: str = "busy"                # busy | done | refused | unknown (its answer is lost)

    def hears(self) -> bool:
        """Its connection stands: the process lives and holds the same primary role."""
        process = self.process
        if not process.alive:
            return False
        return not isinstance(process, SimNode) or process.primary is self.role


def initial_disk() -> Image:
    """Every node's disk before the run: the global queue, declared and synced."""
    store = DiskStore()
    broker = Broker("init", store=store)
    broker.add_vhost("/").declare_queue(QUEUE, owner=None, durable=True,
                                        arguments={GLOBAL_ARG: True})
    store.sync()
    return store.disk


class DatacenterSimulation(AsyncWorld):
    def __init__(self, seed: int, root: Path, *, duration: float = 30.0,
                 client_rate: float = 6.0, trace: bool = False, **kw: Any) -> None:
        kw.setdefault("faults", FAULTS)
        unsafe = kw.setdefault("unsafe", Unsafe())
        if not isinstance(unsafe, Unsafe):
            raise TypeError("the datacenter workload takes its own Unsafe (the TxLog's rules too)")
        super().__init__(seed, nodes=3, duration=duration, backup_timeout=3.0,
                         trace_tail=None if trace else w.TRACE_TAIL, **kw)
        self.rules = unsafe
        self.root = root
        self.client_rate = client_rate
        image = initial_disk()
        for name in self.names:
            self.disks[name] = image.copy()
        self.txlog_disks = {name: TxLogDisk(root / name) for name in [*self.names, "b"]}
        self.net = TxLogNet(self)
        self.b = SimProcess(self, "b", image.copy())
        self.b_bridge = self._bridge(self.b, "B")
        self.clients: list[Client] = []
        self.keys = 0
        self.errors: list[str] = []

    # -- the nodes' TxLog ----------------------------------------------------------------

    def settings(self, dc: str, data_dir: Path) -> NodeTxLog:
        other = "B" if dc == "A" else "A"
        config = TxLogConfig(node_id=dc, master_url=f"txlog://{dc.lower()}.sim:1",
                             peers=(Peer(other, f"txlog://{other.lower()}.sim:1"),))
        return NodeTxLog(MasterSettings(config, "sim", b"sim", ("127.0.0.1", 0),
                                        ("127.0.0.1", 0), data_dir))

    def master_io(self, process: SimProcess, disk: TxLogDisk) -> MasterIO:
        def links(settings: MasterSettings, config: TxLogConfig, on_packet: OnPacket,
                  on_up: OnPeer, on_down: OnPeer) -> SimLinks:
            return SimLinks(self.net, process, config.node_id, on_packet)

        return MasterIO(links=links, later=process.later, clock=lambda: int(self.now * 1000),
                        fsync=partial(disk.fsync, process))

    def _bridge(self, process: SimProcess, dc: str) -> TxLogBridge:
        disk = self.txlog_disks[process.name]
        return TxLogBridge(process.broker, self.settings(dc, disk.path),
                           io=self.master_io(process, disk), unsafe=self.rules.bridge(),
                           driver_factory=partial(TxLogDriver, unsafe=self.rules.driver()))

    def make_layer(self, node: SimNode) -> TxLogBridge:
        return self._bridge(node, "A")

    def bridge(self, process: SimProcess) -> TxLogBridge:
        """The node's bridge: B's, or the layer of one of A's nodes."""
        if process is self.b:
            return self.b_bridge
        layer = process.layer if isinstance(process, SimNode) else None
        assert isinstance(layer, TxLogBridge)
        return layer

    def run_master(self, process: SimProcess, work: Any, what: str) -> None:
        """Start or stop a master as the node does (serve_clients): a task; a failure is one."""
        async def task() -> None:
            try:
                await work
            except Exception as exc:  # noqa: BLE001 - reported as a violation
                if process.alive:
                    self.errors.append(f"{process.name}: {what} failed: {exc!r}")

        self.spawn(task())

    def live_masters(self) -> list[tuple[str, SimProcess, TxLogDriver]]:
        """Every running master: A's (a deposed primary's too, within its lease), B's."""
        out = []
        for process in [*self.nodes.values(), self.b]:
            if process.alive:
                bridge = self.bridge(process)
                if bridge.driver is not None:
                    out.append(("B" if process is self.b else "A", process, bridge.driver))
        return out

    def masters(self) -> dict[str, tuple[SimProcess, TxLogDriver]]:
        """Each datacenter's current master: A's on the primary of the newest epoch (a deposed
        primary's, paused within its lease, never reaches the other datacenter: its sends wait
        for a quorum it cannot have), B's."""
        newest = max(self.primaries, default=None)
        out = {}
        for dc, process, drv in self.live_masters():
            if isinstance(process, SimNode) and (process.election.epoch != newest
                                                 or process.ha.phase != "primary"):
                continue
            out[dc] = (process, drv)
        return out

    def master_of(self, dc: str) -> SimProcess | None:
        """The node whose clients may commit on ``g``: the master runs there, it serves."""
        found = self.masters().get(dc)
        if found is None:
            return None
        process = found[0]
        if isinstance(process, SimNode) and not process.serves_clients():
            return None
        return process

    # -- roles and processes --------------------------------------------------------------

    def start(self) -> None:
        super().start()
        self.run_master(self.b, self.b_bridge.start(), "start")
        self.after(self.rng.expovariate(self.client_rate), self._client_tick)
        self.after(self.rng.expovariate(CUT_RATE), self._cut)

    def on_serving(self, node: SimNode, epoch: int, decisions: dict[str, str]) -> None:
        async def serve() -> None:
            if node.alive and node.ha.phase == "primary" and node.election.epoch == epoch:
                await self.bridge(node).start()
                self.note(f"{node.name} runs the TxLog master (epoch {epoch})")

        self.run_master(node, serve(), "the master's start")

    def on_demoted(self, node: SimNode) -> None:
        self._connections_lost(node)
        self.run_master(node, self.bridge(node).stop("this node stopped serving clients"),
                        "the master's stop")

    def on_crash(self, node: SimNode) -> None:
        node.up = False
        self._connections_lost(node)
        bridge = self.bridge(node)
        if bridge.driver is not None:
            links = bridge.driver.links
            assert isinstance(links, SimLinks)
            links.stop()
            self.run_master(node, bridge.stop("crashed"), "the master's stop")
        bridge.replica.close()
        self.txlog_disks[node.name].crash(self.rng, bridge.config.settings.txlog)

    def _connections_lost(self, process: SimProcess) -> None:
        """The node's client connections close: a commit in flight is unknown to its client.

        On a live node (demoted) each channel is released as ``Channel.release``
        does: its transaction rolled back, what it held requeued.
        """
        for client in self.clients:
            if client.process is not process or client.state != "busy":
                continue
            client.state = "unknown"
            self.counts["unknown"] += 1
            if process.alive:
                client.tx.rollback()
                self._release(client)
            client.held = []

    @staticmethod
    def _release(client: Client) -> None:
        """The client's channel is gone (``Channel.release``): what it held goes back."""
        for queue, entry in sorted(client.held, key=lambda h: -h[1].position):
            queue.requeue(entry)
        client.held = []

    def _cut(self) -> None:
        if self.calm:
            return
        self.after(self.rng.expovariate(CUT_RATE), self._cut)
        lo, hi = CUT_LENGTH
        length = lo + (hi - lo) * self.rng.random()
        self.note(f"the datacenters are cut apart for {length:.2f}s")
        self.net.cut += 1
        self.net.change()

        def heal() -> None:
            self.net.cut -= 1
            self.net.change()
            self.note("the datacenters are joined again")

        self.after(length, heal)

    # -- clients ----------------------------------------------------------------------------

    def _client_tick(self) -> None:
        self.after(self.rng.expovariate(self.client_rate), self._client_tick)
        if self.calm:
            return
        dc = self.rng.choice(DCS)
        process = self.master_of(dc)
        if process is None:
            return
        if sum(c.dc == dc and c.state == "busy" for c in self.clients) >= MAX_CLIENTS:
            return
        self.begin(dc, process)

    def begin(self, dc: str, process: SimProcess) -> None:
        self.keys += 1
        role = process.primary if isinstance(process, SimNode) else None
        client = Client(self.keys, dc, process, role)
        queue = process.broker.vhosts["/"].queues[QUEUE]
        tx = client.tx = process.broker.new_transaction()
        for i in range(self.rng.randint(0, 2)):
            gid = f"{dc}{client.key}.{i}"
            tx.publish([queue], message(gid.encode(), QUEUE, persistent=True, message_id=gid))
            client.enq.append(gid)
        if not client.enq or self.rng.random() < 0.5:
            entry = queue.get()
            if entry is not None:
                client.held.append((queue, entry))
                client.deq.append(read_message_id(entry.message.header) or "?")
                tx.accept([(queue, entry)], [])
        if not client.enq and not client.deq:
            tx.rollback()
            return
        self.clients.append(client)
        self.note(f"{dc} tx{client.key} on {process.name}: +{client.enq} -{client.deq}")
        self.spawn(self.commit(client))

    async def commit(self, client: Client) -> None:
        try:
            await client.tx.commit()
        except TransactionAborted as exc:
            if not client.hears():
                return
            self.note(f"{client.dc} tx{client.key} 406: {exc}")
            client.state = "refused"
            self.counts["refused"] += 1
            self._release(client)  # the 406 closes the channel (the transaction rolled back)
            return

        def commit_ok() -> None:
            if client.hears() and client.state == "busy":
                client.state = "done"
                client.held = []
                self.counts["commit-ok"] += 1

        client.process.broker.after_durable(commit_ok)

    # -- invariants ---------------------------------------------------------------------------

    def signature(self) -> tuple[Any, ...]:
        out: list[Any] = [len(self.errors), self.counts["commit-ok"], self.counts["refused"],
                          len(self.clients), self.serving_now and self.serving_now.name]
        for process in [*self.nodes.values(), self.b]:
            bridge = self.bridge(process)
            engine = bridge.driver.engine if bridge.driver is not None else None
            queue = process.broker.vhosts["/"].queues.get(QUEUE)
            out += [process.alive, bridge.applied, queue and len(queue.ready),
                    engine and (engine.generation, len(engine.sync), engine.durable.model.applied)]
        return tuple(out)

    def check(self) -> None:
        if self.errors:
            self.violate(self.errors[0])
        masters = self.masters()
        states = {dc: d.engine.durable for dc, (_, d) in masters.items()}
        problem = check_prefix(states, states) or check_no_duplicate(states, states)
        if problem:
            self.violate(problem)
        for _, process, drv in self.live_masters():
            self.check_queue(process, self.bridge(process), drv.engine.durable)
        if set(masters) == set(DCS):
            self.check_heard("A", masters["A"][1], masters["B"][1])

    def check_heard(self, dc: str, master: TxLogDriver, other: TxLogDriver) -> None:
        """What the other datacenter heard of ``dc``'s own transactions, ``dc``'s master knows.

        Each master persists its own transaction before its post tells anyone; in
        an HA datacenter before the post leaves the datacenter's quorum, so no
        failover can bring up a master that forgot one another datacenter holds.
        """
        heard = {r.tx_id for r in other.engine.incoming.records() if r.origin == dc}
        heard.update(r.tx_id for r in other.engine.sync.records() if r.origin == dc)
        known = set(master.engine.durable.own) | set(master.engine.sync.ids())
        forgotten = sorted(heard - known)
        if forgotten:
            self.violate(f"{dc}'s master forgot its own transactions {forgotten[:3]}, which "
                         "the other datacenter holds (a failover lost what was sent)")

    def check_queue(self, process: SimProcess, bridge: TxLogBridge, state: DurableState) -> None:
        """The global queue is the engine's model once the bridge applied what it executed."""
        if bridge.applied != state.model.applied:
            return
        model = state.model.queues.get(KEY, set())
        queue = process.broker.vhosts["/"].queues[QUEUE]
        ready = Counter(read_message_id(e.message.header) for e in queue.ready)
        twice = sorted(str(g) for g, n in ready.items() if n > 1)
        if twice:
            self.violate(f"{process.name}: {twice[:4]} twice in {QUEUE}")
        extra = sorted(str(g) for g in ready if g not in model)
        if extra:
            self.violate(f"{process.name}: {extra[:4]} ready in {QUEUE}, not in the log's model "
                         f"(applied {bridge.applied})")
        held = {read_message_id(e.message.header) for c in self.clients
                if c.process is process and c.state == "busy" for _, e in c.held}
        missing = sorted(g for g in model if g not in ready and g not in held)
        if missing:
            self.violate(f"{process.name}: {missing[:4]} of the log's model missing from "
                         f"{QUEUE} (applied {bridge.applied})")

    # -- running ---------------------------------------------------------------------------------

    calm_note = "no new faults or clients"

    def stuck_reason(self) -> str | None:
        if self.serving_now is None or "A" not in self.masters():
            return f"A has no running master within {SETTLE_LIMIT:.0f}s of calm"
        return None

    def why_unsettled(self) -> str:
        masters = self.masters()
        if set(masters) != set(DCS):
            return f"masters running: {sorted(masters)}"
        busy = [f"{c.dc} tx{c.key}" for c in self.clients if c.state == "busy"]
        if busy:
            return f"commits in flight: {busy}"
        states = {dc: d.engine.durable for dc, (_, d) in masters.items()}
        waiting = {dc: len(state.own) for dc, state in states.items() if state.own}
        if waiting:  # acquired (an enqueue-only one confirmed), not synchronised yet
            return f"own transactions not synchronised yet: {waiting}"
        problem = converged(states, [], {})
        if problem:
            return problem
        for process, drv in masters.values():
            if self.bridge(process).applied != drv.engine.durable.model.applied:
                return f"{process.name} has not applied everything"
            if process.store.waiting:
                return f"{process.name}'s store has not synced"
        return ""

    def final_checks(self, serving: SimNode) -> None:
        masters = self.masters()
        a_process, a_driver = masters["A"]
        state = a_driver.engine.durable
        committed: Counter[tuple[str, str]] = Counter()
        for entry in state.sync.entries:
            body = state.bodies.get(entry.record.tx_id)
            if entry.outcome == COMMITTED and body is not None:
                committed.update((op.kind, op.message_id) for op in body.operations)
        twice = sorted(k for k, n in committed.items() if n > 1)
        if twice:
            self.violate(f"ordered twice: {twice[:4]}")
        for client in self.clients:
            ops = [("enqueue", g) for g in client.enq] + [("dequeue", g) for g in client.deq]
            if client.state == "done":
                lost = [op for op in ops if op not in committed]
                if lost:
                    self.violate(f"{client.dc} tx{client.key} was commit-ok'd, yet {lost} "
                                 "is not committed in the synchronised log")
            elif client.state == "refused":  # (a message it dequeues: maybe by another)
                seen = [op for op in ops if op in committed and op[0] == "enqueue"]
                if seen:
                    self.violate(f"{client.dc} tx{client.key} was refused (406), yet {seen} "
                                 "is committed in the synchronised log")
        order = {}
        for dc, (process, _) in masters.items():
            queue = process.broker.vhosts["/"].queues[QUEUE]
            order[dc] = [read_message_id(e.message.header) for e in queue.ready]
        if order["A"] != order["B"]:
            self.violate(f"{QUEUE} differs between the datacenters: A {order['A'][:6]}, "
                         f"B {order['B'][:6]}")
        if set(order["A"]) != state.model.queues.get(KEY, set()):
            self.violate(f"{QUEUE} is not the log's model at the end")
        expected = contents(serving.broker)
        for node in self.nodes.values():
            if node is not serving and contents(node.broker) != expected:
                self.violate(f"{node.name} differs from the primary {serving.name} at the end")
        self.counts["ordered"] = len(state.sync)
        self.counts["messages left"] = len(order["A"])
        assert a_process is serving


def run_seed(seed: int, **kw: Any) -> SimResult:
    logging.disable(logging.CRITICAL)  # the nodes' warnings and errors: the trace tells
    shm = Path("/dev/shm")
    try:
        with tempfile.TemporaryDirectory(prefix="brokerha-dc-sim-",
                                         dir=shm if shm.is_dir() else None) as root:
            return asyncio.run(DatacenterSimulation(seed, Path(root), **kw).run())
    finally:
        logging.disable(logging.NOTSET)


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    return seed_runner.run_many(run_seed, seeds, jobs=jobs, **kw)
