"""One datacenter on a virtual clock: the product's HA members on simulated disks and links.

Every node is what a broker process runs: a ``Broker`` on a ``DiskStore``
(``disk.py``: only what a completed sync wrote survives a crash) and an
``HAMember`` (``ha/member.py``: the real ``Election``, ``HACore``, ``Primary``
or ``Backup``, verification), driven the way ``node/ha.py`` drives it: a tick
every ``TICK``, packets of its cluster links, links up and down, ``soon``
callbacks after each input, timers. The world supplies what the asyncio
shell supplies, and nothing else: no rule of the protocol lives here, so a
violation found is a defect of the product.

- **Links** are one ordered stream per pair of nodes, as ``ClusterLinks``
  (TCP): a message crosses the codec (``wire``: msgpack, as the link frames
  it) and arrives after a random delay, in order. A link fails (a fault, a
  crash, a partition): what is in flight is lost, each end notices after its
  own detection delay (``peer_down``), and once both did, the link is
  redialled (``peer_up``) unless a partition blocks it.
- **Disks**: a store sync is scheduled whenever a callback waits for one and
  completes after a random fsync latency.
- **Faults** drawn from the seed: crashes (the process is gone, its disk
  image stays; it restarts later from that image and its vote record),
  pauses (SIGSTOP: nothing runs, input waits, TCP stays up), link failures,
  partitions that heal, and manual failovers (``HAMember.promote``); with the
  bounds of big work small (``Bounds``), faults aimed at a backup in the
  middle of a commit in slices or of a large message's parts (``aim_now``).
- **CPU** (``Costs``, the cost model): a node's event loop is busy for the
  work of each input (the replication events it sends and applies, the
  client operations it carries out, a slow operation's slices); meanwhile
  its later input and timers wait (``SimProcess``). Store syncs are now and
  then slow (``Faults.slow_fsync_p``).

Checked after every event, whatever the workload: (a) at most one primary
per epoch and one vote per node and epoch; (b) a deposed primary serves at
most ``lease_timeout`` after a newer one was elected; (e) a node never
applies replication events of an epoch older than its own; (f) no election
(no new epoch, no primary stepping down) while every node and link is up
(``check_stable``). The workloads
(``confirms.py``, the transaction simulation in ``tests/ha``) add theirs.
``Unsafe`` switches off a rule in the product module that holds it (the
election's, the member's, the HA core's); the checker must then report a
violation.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import math
import random
import traceback
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
from pamqp import commands

from brokerha.backup.backup import Backup
from brokerha.backup.transaction_replicator import COMMIT_SLICE
from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header
from brokerha.broker.message import Message
from brokerha.cluster import election as el
from brokerha.cluster import replication as R
from brokerha.cluster.messages import REGISTRY
from brokerha.cluster.messages import Message as Packet
from brokerha.cluster.replication import Ack, Events
from brokerha.cluster.state import NodeState
from brokerha.ha import admission, core, member
from brokerha.ha.admission import Admission
from brokerha.ha.core import PrimarySettings, load_position
from brokerha.ha.member import TICK, HAMember, PrimaryLayer, StoreLayer
from brokerha.ha.simulation.disk import DiskStore, Image, sync_latency
from brokerha.primary.catch_up import Pace
from brokerha.primary.events import BODY_PART_BYTES
from brokerha.primary.primary import Primary
from brokerha.primary.remote_backup import FLUSH_BYTES
from brokerha.seed_runner import UnsafeRules

TRACE_TAIL = 60
SETTLE_LIMIT = 120.0  # virtual seconds after a run for everything to settle (AsyncWorld.finish)
# small replication packets: a join's catch-up spans several, as a big queue's does
EVENTS_PER_PACKET = 4


def wire(packet: Packet) -> Packet:
    """The packet after a trip through the cluster link's msgpack framing."""
    data = msgpack.packb([0, packet.CODE, packet.to_args()], use_bin_type=True)
    _, code, args = msgpack.unpackb(data, raw=False)
    return REGISTRY[code].from_args(args)


def message(body: bytes, rk: str = "q", exchange: str = "", persistent: bool = False,
            **props: Any) -> Message:
    """An AMQP message as the channel builds it from a basic.publish."""
    properties = commands.Basic.Properties(delivery_mode=2 if persistent else 1, **props)
    return Message(exchange, rk, build_header(len(body), properties), body)


@dataclass(frozen=True)
class Faults:
    delay: tuple[float, float] = (0.0005, 0.005)  # one-way message delay
    spike_p: float = 0.02        # chance a message is slow (congestion, GC) ...
    spike_max: float = 0.6       # ... by up to this much
    rate: float = 0.15           # faults per virtual second
    crash: float = 2.0           # relative weights of the fault kinds
    pause: float = 2.0
    partition: float = 2.0
    link: float = 2.0
    promote: float = 1.0
    outage: tuple[float, float] = (0.3, 6.0)   # crash downtime, pause, partition length
    detect: tuple[float, float] = (0.05, 2.0)  # a broken link is noticed after this
    redial: tuple[float, float] = (0.05, 0.5)  # a link comes back this long after both noticed
    fsync: tuple[float, float] = (0.0005, 0.01)  # a store sync takes this long ...
    slow_fsync_p: float = 0.0    # ... or, with this chance, ...
    slow_fsync: tuple[float, float] = (0.05, 0.5)  # ... this long (disk.sync_latency)
    # the chances that a fault is aimed at a backup in the middle of big work (``World.aim``):
    # for each commit it applies in slices, after 0-7 more of them; for each packet that
    # left some parts of a message waiting for its ``e``, then. 0: never (no draw: seeds
    # keep their traces)
    mid_commit: float = 0.0
    between_parts: float = 0.0

    @classmethod
    def none(cls) -> Faults:
        return cls(spike_p=0.0, rate=0.0)


@dataclass(frozen=True)
class Costs:
    """The cost model: virtual CPU seconds a node's event loop spends on its work.

    A node handling an input (a packet, a timer, a client's operation) is busy
    for the sum of what it did: each replication event it put into a packet
    it sent (read, encoded), each event of a packet it applied, each client
    operation it carried out (a publish, a get and its ack, a message of a
    transaction). Meanwhile its later input and timers wait (``SimProcess``).
    At this scale one simulated message stands for about a hundred real ones of
    1 KiB (a real primary made a join's catch-up of 150,000 such messages in
    0.3-0.5 s, issue 33): a catch-up or a purge of thousands here costs what
    one of hundreds of thousands costs a real node, and the streamed catch-up's
    pace is scaled alike (``PACE``). ``slice`` is how much CPU a sliced slow
    operation spends before it yields to the loop.
    """

    event_sent: float = 200e-6
    event_applied: float = 300e-6
    client_op: float = 200e-6
    slice: float = 0.02
    # a slice of a backup's commit (``Bounds.commit_slice`` entries, standing for the real
    # COMMIT_SLICE's 4,096: 10-20 ms of a real backup's loop), the first one included
    commit_slice: float = 0.015

    @classmethod
    def none(cls) -> Costs:
        """Every step takes no virtual time (the harness before the cost model)."""
        return cls(0.0, 0.0, 0.0, commit_slice=0.0)


# the streamed catch-up's pace (primary/catch_up.py) at the cost model's scale: a slice of
# 16 entries (about 1,600 real ones, above the 1 MiB slice of real 1 KiB messages), a window
# of 8 KiB of events (about 90 simulated messages: 9,000 real, the real 8 MiB window's)
# the runs (``er``, replicating_subscription.py) as short as 2 to 4 messages, so that runs,
# their cuts at gaps and single ``e`` events all occur among a few simulated messages
PACE = Pace(slice_bytes=math.inf, slice_work=16, window_bytes=8 * 1024, run_min=2, run_max=4)
# with the bounds of big work small: no runs, each message of a catch-up its ``e``, in parts
SMALL_PACE = replace(PACE, run_min=0)


def entries_of(events: list[Any]) -> int:
    """What a packet's events cost to make or apply: one each, a run (``er``) one a message."""
    return sum(e.length if e[0] == R.ENQUEUED_RUN else 1 for e in events)


@dataclass(frozen=True)
class Bounds:
    """The bounds of big work the nodes run with (``PrimarySettings``, issue 33).

    The product's by default, which the simulation's small messages and
    transactions never reach; ``SMALL_BOUNDS`` makes them take the paths of big
    work: a backup applies a commit of more than ``commit_slice`` entries in
    slices, a loop turn each (``Backup.step``); a body over ``body_part_bytes``
    goes as ``bp`` parts before its ``e`` or ``te``; a primary's flush takes at
    most ``flush_bytes`` of a backup's live events, the rest the next turns.
    """

    commit_slice: int = COMMIT_SLICE
    body_part_bytes: int = BODY_PART_BYTES
    flush_bytes: int = FLUSH_BYTES


# every commit of more than one entry in slices, every body over 4 bytes (the simulations'
# are 1-9 bytes) in parts, about one packet of live events per flush
SMALL_BOUNDS = Bounds(commit_slice=1, body_part_bytes=4, flush_bytes=128)


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules to break on purpose, each in the product module that holds it.

    ``invalid_grants`` and ``no_lease``: ``cluster.election.Unsafe``;
    ``old_epoch_apply``: ``ha.member.Unsafe``; ``early_ack``,
    ``confirm_early`` and ``no_tx_trackers``: ``ha.core.Unsafe``;
    ``lagging_role``: ``ha.admission.Unsafe`` and ``ha.member.Unsafe`` (the
    shell's race of issue 32); ``monolithic_catch_up``: ``ha.core.Unsafe`` (a
    join's catch-up made and sent at once, one long step of the primary's
    loop) and ``step_down_at_lease_end``: ``cluster.election.Unsafe`` (a stall
    a little longer than the lease costs the role): the stability invariant
    (f) catches them where queues are deep and loops stall (``heavy.py``);
    ``runs_across_gaps``: ``ha.core.Unsafe`` (a catch-up's run of enqueues not
    cut where the queue's positions have a gap, so the backup holds messages
    at other positions); ``local_purge``: ``ha.core.Unsafe`` (a purge not
    replicated: answered, then undone by a failover). Each workload names the rules it can catch
    (``CATCHES``).
    """

    confirm_early: bool = False     # the primary confirms on its own disk, without the quorum
    invalid_grants: bool = False    # a voter forgets its vote floor
    no_lease: bool = False          # a primary keeps serving without a majority
    old_epoch_apply: bool = False   # a backup applies events of an older epoch
    no_tx_trackers: bool = False    # a backup joining during a prepared transaction is ready
    early_ack: bool = False         # a backup acknowledges before its store synced
    lagging_role: bool = False      # the shell serves by a flag set late; no durability gate
    monolithic_catch_up: bool = False  # a join's whole catch-up made in one step (issue 33)
    step_down_at_lease_end: bool = False  # a primary whose lease ran out steps down (no lapse)
    # a backup's commit in slices (``Bounds``, ha.core.Unsafe): its stored position valid
    # while half applied; its seq acknowledged at the first slice; promoted unsettled
    position_valid_mid_commit: bool = False
    ack_before_last_slice: bool = False
    unsettled_promotion: bool = False
    floor_behind_ack: bool = False  # an ack sent mid-commit, the stored floor left below it
    runs_across_gaps: bool = False  # a catch-up's run of enqueues not cut at a gap (issue 33)
    local_purge: bool = False  # a purge's entries not replicated (Primary.purged sends nothing)

    def _part(self, kind: type[Any]) -> Any:
        """The module's own rules (a rule no workload here can catch stays unbroken)."""
        return kind(**{name: getattr(self, name, False) for name in kind.names()})

    def election(self) -> el.Unsafe:
        return self._part(el.Unsafe)  # type: ignore[no-any-return]

    def member(self) -> member.Unsafe:
        return self._part(member.Unsafe)  # type: ignore[no-any-return]

    def core(self) -> core.Unsafe:
        return self._part(core.Unsafe)  # type: ignore[no-any-return]

    def admission(self) -> admission.Unsafe:
        return self._part(admission.Unsafe)  # type: ignore[no-any-return]


class Violation(Exception):
    pass


@dataclass
class Votes:
    """What the state file keeps: the election's last ``Persist``."""

    epoch: int = 0
    voted_for: str | None = None


@dataclass
class Link:
    """The cluster link between two nodes (one TCP connection)."""

    gen: int = 0          # bumped by every failure: what was in flight is lost
    up: bool = False
    blocked: int = 0      # partitions cutting it (it cannot be redialled meanwhile)


class Timer:
    """A ``later`` callback on the virtual clock (ha.core.Cancellable)."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimProcess:
    """One broker process on the virtual clock: its broker on its simulated disk.

    Its event loop runs one input at a time (a packet, a timer, a client's
    frame, a ``soon`` callback) and spends virtual CPU time on it (``charge``:
    the world's ``Costs``); while it is busy, or paused (SIGSTOP), later input
    waits in its inbox, in order, and runs when the loop is free again: a
    stalled loop, heartbeats and lease included. Input is dropped once the
    process died; a store sync completes after the world's fsync latency.
    """

    def __init__(self, world: World, name: str, disk: Image | None) -> None:
        self.world = world
        self.name = name
        self.up = True
        self.paused_until = 0.0
        self.busy_until = 0.0  # the loop is on one input's work until then (virtual CPU)
        self.inbox: deque[Callable[[], None]] = deque()  # input waiting for the loop
        self._drain_at: float | None = None  # the inbox is taken up then
        self.tick_waiting = False  # a tick due while the loop was busy waits in the inbox
        self.sync_pending = False
        self.store = DiskStore(disk, on_wait=self._sync_wanted)
        self.broker = Broker(name, clock=world.clock, store=self.store)
        if disk is not None:
            self.broker.restore(self.store.load())
        self.broker.add_vhost("/")

    @property
    def alive(self) -> bool:
        return self.up

    @property
    def paused(self) -> bool:
        return self.paused_until > self.world.now

    @property
    def busy(self) -> bool:
        return self.busy_until > self.world.now

    def run(self, work: Callable[[], None]) -> None:
        """Input for this process: now if its loop is free, else once it is (after a pause,
        after the work it is on, after the input that came before); never after it died."""
        if not self.alive:
            return
        if self.paused or self.busy or self.inbox:
            self.inbox.append(work)
            if not self.paused:
                self._drain_later()
            return
        work()

    def charge(self, cost: float) -> None:
        """The loop spends ``cost`` virtual CPU seconds on the input it runs now: what it
        sends leaves after that, and later input waits for it."""
        if cost <= 0.0:
            return
        now = self.world.now
        start = max(self.busy_until, now)
        self.busy_until = start + cost
        self.world.on_busy(self, self.busy_until - now)

    def _drain_later(self) -> None:
        if self._drain_at is None:
            self._drain_at = max(self.busy_until, self.world.now)
            self.world.after(self._drain_at - self.world.now, self.drain)

    def drain(self) -> None:
        """The loop is free: the input that waited, in order, until it is busy again."""
        self._drain_at = None
        world = self.world
        while self.inbox and self.alive and not self.paused and not self.busy:
            self.inbox.popleft()()
            world.run_soon()
        if self.inbox and self.alive and not self.paused:
            self._drain_later()

    def later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer()

        def due() -> None:
            if not timer.cancelled:
                self.run(callback)

        self.world.after(delay, due)
        return timer

    def _sync_wanted(self) -> None:
        if not self.sync_pending:
            self.sync_pending = True
            self.world.after(self.world.fsync_delay(), self._sync)

    def _sync(self) -> None:
        self.sync_pending = False
        self.run(self._synced)

    def _synced(self) -> None:
        self.store.sync()
        self.world.on_sync(self)


class SimNode(SimProcess):
    """One process of a datacenter's node: its broker on its disk, its HA member (and the
    workload's layer above HA, if any), and the member's effects."""

    def __init__(self, world: World, name: str, incarnation: int, disk: Image | None,
                 votes: Votes) -> None:
        super().__init__(world, name, disk)
        self.incarnation = incarnation
        self.mid_commit = False  # its backup is in the middle of a commit in slices
        self.mid_commit_seq: tuple[int, int | None] | None = None  # (epoch, seq) of the last
        self.aim_in: int | None = None  # slices of it left before a fault aimed at it
        state = NodeState(epoch=votes.epoch, voted_for=votes.voted_for)
        load_position(self.broker, state)
        self.layer = world.make_layer(self)
        unsafe = world.unsafe
        self.ha = HAMember(
            self.broker, name, world.names, state, self,
            PrimarySettings(len(world.names), world.backup_timeout, replicate=world.replicate,
                            tx_prepare_timeout=world.tx_prepare_timeout,
                            events_per_packet=world.events_per_packet,
                            body_part_bytes=world.bounds.body_part_bytes,
                            flush_bytes=world.bounds.flush_bytes,
                            commit_slice=world.bounds.commit_slice),
            world.clock, timing=world.timing, verification_timeout=world.verification_timeout,
            rng=random.Random(f"{world.seed}/{name}/{incarnation}"),
            primary_factory=world.make_primary, unsafe=unsafe.member(),
            core_unsafe=unsafe.core(), election_unsafe=unsafe.election(),
            admission_unsafe=unsafe.admission(), layer=self.layer,
            layers=world.make_layers(self))

    @property
    def election(self) -> el.Election:
        return self.ha.election

    @property
    def primary(self) -> Primary | None:
        return self.ha.primary

    @property
    def alive(self) -> bool:
        return self.up and self.world.nodes[self.name] is self

    def serves_clients(self) -> bool:
        """Serving AMQP clients at this instant: a verified primary within its lease."""
        return (self.alive and not self.paused and self.ha.phase == "primary"
                and self.election.lease_valid(self.world.now))

    # -- ha.member.MemberEffects ------------------------------------------------------------

    def send(self, peer: str, message: Packet) -> None:
        self._charge_sent(message)
        if type(message) is Ack:
            self.world.on_ack(self, message)
        self.world.send(self.name, peer, 0, message)

    def send_many(self, peer: str, messages: Sequence[Packet]) -> None:
        for packet in messages:
            self._charge_sent(packet)
            self.world.send(self.name, peer, 0, packet)

    def reply(self, peer: str, msg_id: int, message: Packet) -> None:
        self._charge_sent(message)
        self.world.send(self.name, peer, msg_id, message)

    def _charge_sent(self, packet: Packet) -> None:
        """The events a packet carries were made (read, encoded) by this loop."""
        if type(packet) is Events:
            self.charge(entries_of(packet.events) * self.world.costs.event_sent)

    def connected(self, peer: str) -> bool:
        return self.world.connected(self.name, peer)

    def peers_up(self) -> list[str]:
        return [peer for peer in self.world.names if peer != self.name and self.connected(peer)]

    def persist(self, epoch: int, voted_for: str | None) -> None:
        votes = self.world.votes[self.name]
        if epoch < votes.epoch:
            self.world.violate(f"{self.name} persisted epoch {epoch} after {votes.epoch}")
        if epoch == votes.epoch and votes.voted_for not in (None, voted_for):
            self.world.violate(f"(a) {self.name} voted for {votes.voted_for} and {voted_for} "
                               f"in epoch {epoch}")
        if epoch > votes.epoch:
            self.world.unstable(f"{self.name} took epoch {epoch} (was {votes.epoch}; role "
                                f"{self.election.role})")
        votes.epoch, votes.voted_for = epoch, voted_for

    def position(self, pos: el.Position) -> None:
        self.ha.carry_out(self.election.set_position(pos))
        self.world.on_position(self, pos)

    def soon(self, callback: Callable[[], None]) -> None:
        core = self.ha.core if hasattr(self, "ha") else None
        if core is not None:
            if callback == core._next_slice:  # the backup's next slice of a commit
                callback = partial(self.world.next_slice, self, callback)
            elif callback == core.flush:  # the primary's flush of its backups' events
                callback = partial(self.world.flush, self, callback)
        self.world.soon.append((self, callback))

    def replication_failed(self, reason: str) -> None:
        self.world.violate(f"{self.name} cannot follow the primary: {reason}")

    def elected(self, epoch: int, primary: Primary) -> None:
        self.world.on_elected(self, epoch)

    def serving(self, epoch: int, decisions: dict[str, str]) -> None:
        self.world.note(f"{self.name} serves clients (epoch {epoch})"
                        + (f"; verification decided {decisions}" if decisions else ""))
        self.ha.clients.open(epoch)  # the shell is open for this term (Node.serve_clients)
        self.world.on_serving(self, epoch, decisions)

    def demoted(self, reason: str) -> None:
        self.world.note(f"{self.name} stops serving: {reason}")
        self.world.unstable(f"{self.name} stopped serving: {reason}")
        self.world.on_demoted(self)

    def follow(self, primary: str, epoch: int) -> None:
        pass

    def joined(self, primary: str, epoch: int) -> None:
        self.world.note(f"{self.name} joins {primary} (epoch {epoch})")


class SimConnection:
    """A client's AMQP connection to one node, as the node's ``ClientAdmission`` took it.

    Open from its admission until the node closes it (``force_close``: the
    role ended) or its process dies; an answer reaches the client only while
    it is open.
    """

    def __init__(self, world: World, node: SimNode) -> None:
        self.world = world
        self.node = node
        self.open = False

    def force_close(self) -> None:
        if self.open:
            self.open = False
            self.world.note(f"{self.node.name} closes a client connection (320)")
            self.world.connection_closed(self)

    @property
    def usable(self) -> bool:
        """Open on a live process (a paused one takes the client's frames later)."""
        return self.open and self.node.alive


@dataclass
class WorldStats:
    failovers: int = 0
    crashes: int = 0
    unserved: float = 0.0       # virtual seconds without a serving primary
    overlap: float = 0.0        # virtual seconds with two serving (a deposed one in its lease)
    events: int = 0
    stable: float = 0.0         # virtual seconds under the stability invariant (f) ...
    lapsed: float = 0.0         # ... of which its primary's lease had lapsed (serving nobody)
    longest_step: float = 0.0   # the longest a node's loop was busy at once (virtual CPU)
    # big work in small bounds (``Bounds``): commits a backup applied in slices, their
    # slices, promotions and crashes of a backup in the middle of one; ``bp`` parts a
    # backup applied, crashes of a backup holding some parts of a message; a primary's
    # flushes that left live events for the next turn; faults aimed mid-work (``aim``)
    sliced_commits: int = 0
    commit_slices: int = 0
    promoted_mid_commit: int = 0
    settled_mid_commit: int = 0  # a join or a follow while its commit was half applied
    crashed_mid_commit: int = 0
    body_parts: int = 0
    catch_up_parts: int = 0
    crashed_between_parts: int = 0
    split_flushes: int = 0
    aimed_faults: int = 0

    def big_work(self) -> dict[str, int]:
        """The counts of big work, named for a run's statistics."""
        return {"sliced commits": self.sliced_commits, "commit slices": self.commit_slices,
                "promoted mid-commit": self.promoted_mid_commit,
                "settled mid-commit": self.settled_mid_commit,
                "crashed mid-commit": self.crashed_mid_commit, "body parts": self.body_parts,
                "catch-up parts": self.catch_up_parts,
                "crashed between parts": self.crashed_between_parts,
                "split flushes": self.split_flushes, "aimed faults": self.aimed_faults}


class World:
    """The nodes, their links and disks, the clock and the faults; subclasses add a workload."""

    def __init__(self, seed: int, *, nodes: int = 3, duration: float = 60.0,
                 faults: Faults | None = None, unsafe: Unsafe | None = None,
                 timing: el.ElectionTiming | None = None, backup_timeout: float = 5.0,
                 tx_prepare_timeout: float = 5.0, verification_timeout: float = 2.0,
                 events_per_packet: int = EVENTS_PER_PACKET,
                 trace_tail: int | None = TRACE_TAIL, costs: Costs | None = None,
                 pace: Pace | None = PACE, stability: bool = False,
                 replicate: str = "all", bounds: Bounds | None = None) -> None:
        self.seed = seed
        self.bounds = bounds or Bounds()  # the product's unless a workload makes them small
        self.replicate = replicate  # [cluster] replicate: the mode of a queue no policy names
        self.duration = duration
        self.faults = faults or Faults()
        self.unsafe = unsafe or Unsafe()
        self.timing = timing or el.ElectionTiming()
        self.backup_timeout = backup_timeout
        self.tx_prepare_timeout = tx_prepare_timeout
        self.verification_timeout = verification_timeout
        self.events_per_packet = events_per_packet
        self.costs = costs or Costs()
        self.pace = pace  # None: the product's own (catch_up.Pace)
        # (f): armed once every node and link is up, every backup follows the serving
        # primary and its lease is fresh (``check_stable``), until the next fault. The
        # workloads check it; off for a world a test drives by hand (its own faults)
        self.stability = stability
        self.stable: tuple[SimNode, float] | None = None  # (its primary, since when)
        self.disturbed_until = 0.0  # a fault's effect lasts until then (a spiked packet)
        self._stable_checked = 0.0
        self.rng = random.Random(seed)
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.soon: list[tuple[SimProcess, Callable[[], None]]] = []
        self.votes = {name: Votes() for name in self.names}
        self.disks: dict[str, Image | None] = dict.fromkeys(self.names)
        self.incarnations = dict.fromkeys(self.names, 0)
        self.nodes: dict[str, SimNode] = {}
        self.links = {frozenset(p): Link() for p in itertools.combinations(self.names, 2)}
        self.seen: dict[tuple[str, str], int | None] = {}   # (me, peer) -> link gen I use
        self.last_at: dict[tuple[str, str], float] = {}     # in-order delivery per direction
        self.primaries: dict[int, str] = {}
        self.elected_at: dict[int, float] = {}
        self.trace: deque[str] = deque(maxlen=trace_tail)
        self._hash = hashlib.sha256()
        self.stats = WorldStats()
        self.serving_now: SimNode | None = None   # the newest serving primary
        self._servers: list[SimNode] = []  # every serving node, after the last event
        self.calm = False  # no new faults (the end of a run; the old ones run their course)
        self._overlapping = False

    # -- the clock and the event queue -------------------------------------------------------

    def clock(self) -> float:
        return self.now

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (self.now + delay, next(self._order), fn))

    def note(self, text: str) -> None:
        line = f"{self.now:9.4f} {text}"
        self.trace.append(line)
        self._hash.update(line.encode())

    def trace_hash(self) -> str:
        return self._hash.hexdigest()[:16]

    def violate(self, text: str) -> None:
        raise Violation(text)

    def fsync_delay(self) -> float:
        f = self.faults
        return sync_latency(self.rng, f.fsync, f.slow_fsync_p, f.slow_fsync)

    def start(self) -> None:
        for name in self.names:
            self.restart(name)
        if self.faults.rate > 0:
            self.after(self.rng.expovariate(self.faults.rate), self._fault)

    def run_until(self, end: float) -> None:
        """Run every event due up to ``end``; the invariants after each one."""
        while self.step(end):
            pass

    def step(self, end: float) -> bool:
        """Run the next event if it is due by ``end``; False (the clock at ``end``) if none is."""
        queue, stats = self._queue, self.stats
        if not queue or queue[0][0] > end:
            if self.serving_now is None:
                stats.unserved += max(0.0, end - self.now)
            self.now = max(self.now, end)
            return False
        when, _, fn = heapq.heappop(queue)
        if self.serving_now is None:
            stats.unserved += when - self.now
        elif self._overlapping:
            stats.overlap += when - self.now
        self.now = when
        fn()
        self.run_soon()
        stats.events += 1
        self.check_serving()
        self.check_stable()
        return True

    def run_soon(self) -> None:
        """The loop's ``call_soon`` callbacks, in order, until none is left."""
        soon = self.soon
        while soon:
            node, callback = soon.pop(0)
            node.run(callback)

    # -- the workload's hooks (a subclass overrides what it checks) ------------------------------

    def make_primary(self, *args: Any, **kw: Any) -> Primary:
        return Primary(*args, **self.paced(kw))

    def paced(self, kw: dict[str, Any]) -> dict[str, Any]:
        """A new Primary's arguments with the simulation's catch-up pace, unless the core
        chose one (``Unsafe.monolithic_catch_up``: everything at once)."""
        if kw.get("pace") is None and self.pace is not None:
            return {**kw, "pace": self.pace}
        return kw

    def on_busy(self, node: SimProcess, length: float) -> None:
        """A node's loop is busy for ``length`` from now."""
        if length > self.stats.longest_step:
            self.stats.longest_step = length

    def make_layer(self, node: SimNode) -> PrimaryLayer | None:
        """The layer above HA a node runs (the TxLog bridge), if the workload has one."""
        return None

    def make_layers(self, node: SimNode) -> Sequence[StoreLayer]:
        """The store layers a node runs (``HAMember(layers=...)``: the partition table's
        coordinator, ``partition/simulation.py``), as ``node/ha.py`` hands them in."""
        return ()

    def on_elected(self, node: SimNode, epoch: int) -> None:
        first = self.primaries.setdefault(epoch, node.name)
        if first != node.name:
            self.violate(f"(a) two primaries in epoch {epoch}: {first} and {node.name}")
        self.elected_at[epoch] = self.now
        self.stats.failovers += len(self.primaries) > 1
        if node.mid_commit:  # its commit in slices: applied whole before it serves (settle)
            self.stats.promoted_mid_commit += 1
            node.mid_commit = False
        self.note(f"{node.name} elected for epoch {epoch}")

    def on_serving(self, node: SimNode, epoch: int, decisions: dict[str, str]) -> None:
        pass

    def on_demoted(self, node: SimNode) -> None:
        """The node stops being the primary (its clients' connections close)."""

    def on_crash(self, node: SimNode) -> None:
        """The node's process is about to die."""

    def on_sync(self, node: SimProcess) -> None:
        """A store sync of a node completed."""

    def on_position(self, node: SimNode, pos: el.Position) -> None:
        pass

    def on_new_server(self, node: SimNode | None) -> None:
        pass

    def connection_closed(self, conn: SimConnection) -> None:
        """A client connection closed (by its node, or with its process)."""

    # -- clients connecting: the node shell's accept path -------------------------------------

    def connect(self, name: str, opened: Callable[[SimConnection], None], hops: int = 0) -> None:
        """A client dials node ``name``: accepted when the node runs (a paused node's
        backlog waits), served, relayed or refused as its ``ClientAdmission`` decides
        then, and admitted again when the transport hands the connection over (a
        moment later: the node may have stopped serving meanwhile). ``opened`` gets
        the connection once it is served; a refused client tries again on its own."""
        delay = self.faults.delay
        self.after(delay[0] + (delay[1] - delay[0]) * self.rng.random(),
                   lambda: self._accept(self.nodes[name], opened, hops))

    def _accept(self, node: SimNode, opened: Callable[[SimConnection], None], hops: int) -> None:
        def accept() -> None:
            following = node.ha.core.following
            decision = node.ha.clients.decide(following is not None)
            if decision is Admission.RELAY and following is not None and hops < 2:
                self.connect(following, opened, hops + 1)  # the relay dials the primary
            elif decision is Admission.SERVE:
                conn = SimConnection(self, node)
                self.after(0.002 * self.rng.random(), lambda: node.run(lambda: made(conn)))

        def made(conn: SimConnection) -> None:
            if node.ha.clients.admit(conn):
                conn.open = True
                self.note(f"client connected to {node.name}")
                opened(conn)

        node.run(accept)

    # -- invariants --------------------------------------------------------------------------

    def servers(self) -> list[SimNode]:
        """The nodes serving at this instant, newest epoch first."""
        found = [n for n in self.nodes.values() if n.serves_clients()]
        return sorted(found, key=lambda n: -n.election.epoch)

    def check_serving(self) -> None:
        """(b): a deposed primary stops within its lease."""
        servers = self._servers = self.servers()
        serving = servers[0] if servers else None
        self._overlapping = len(servers) > 1
        for old in servers[1:]:
            epoch = old.election.epoch
            successor = min(at for e, at in self.elected_at.items() if e > epoch)
            if self.now - successor > self.timing.lease_timeout:
                self.violate(f"(b) {old.name} (epoch {epoch}) still serves "
                             f"{self.now - successor:.3f}s after a newer primary was elected")
        if serving is not self.serving_now:
            self.serving_now = serving
            self.on_new_server(serving)

    # -- (f) stability: no election while every node and link is up -------------------------

    def disturb(self, until: float | None = None) -> None:
        """A fault (or one's effect, until ``until``): (f) is off until the cluster is
        healthy again and its primary's lease fresh (``check_stable``)."""
        self.stable = None
        if until is not None and until > self.disturbed_until:
            self.disturbed_until = until

    def healthy(self) -> SimNode | None:
        """The serving primary when every node's process runs (up, not paused), every link
        is up and known up at both ends, exactly one node serves, and every other node
        follows it in its epoch (joined; it may still be catching up); else None."""
        nodes = list(self.nodes.values())
        if any(not n.alive or n.paused for n in nodes):
            return None
        seen = self.seen
        for pair, link in self.links.items():
            a, b = tuple(pair)
            if not link.up or seen.get((a, b)) != link.gen or seen.get((b, a)) != link.gen:
                return None
        servers = self._servers
        if len(servers) != 1:
            return None
        primary = servers[0]
        epoch = primary.election.epoch
        for node in nodes:
            if node is not primary and (node.election.epoch != epoch
                                        or node.ha.core.following != primary.name):
                return None
        return primary

    def fresh_lease(self, primary: SimNode) -> bool:
        """The primary's lease was renewed by its latest heartbeat round (or the one before):
        what a fault did to it (a pause, a delayed acknowledgement) is over."""
        t = self.timing
        return primary.election.lease_valid(self.now + t.lease_timeout - 2 * t.heartbeat_interval)

    def unstable(self, what: str) -> None:
        """An election happens (a new epoch, a primary stepping down): (f) if armed."""
        if self.stability and self.stable is not None:
            primary, since = self.stable
            self.violate(f"(f) {what}, {self.now - since:.3f}s into a stretch with every node "
                         f"and link up and every backup following {primary.name} (since "
                         f"{since:.4f}; no fault since)")

    def check_stable(self) -> None:
        """(f) stability: no election while every node and link is up.

        Armed at the first instant, after the last fault and its effects (a spiked
        packet arrived), when the cluster is ``healthy`` and its primary's lease
        ``fresh``; then, until the next fault, no node takes a new epoch
        (``SimNode.persist``) and the primary stays the primary: it never steps down
        (``SimNode.demoted``; checked here too). Its lease may lapse (a stall longer
        than the lease: it serves nobody and keeps its role, ``Election.lapsed``) and
        be renewed: no election, but counted (``WorldStats.lapsed``). A catch-up, a
        purge, a big commit, a slow fsync are no faults: the invariant holds through
        them.
        """
        if not self.stability:
            return
        stable = self.stable
        if stable is None:
            if self.now >= self.disturbed_until:
                primary = self.healthy()
                if primary is not None and self.fresh_lease(primary):
                    self.stable = (primary, self.now)
                    self._stable_checked = self.now
            return
        primary = stable[0]
        elapsed = self.now - self._stable_checked
        self.stats.stable += elapsed
        self._stable_checked = self.now
        election = primary.election
        if not (primary.alive and election.role == "primary" and primary.ha.phase == "primary"):
            self.unstable(f"{primary.name}, primary of epoch {election.epoch}, is "
                          f"{election.role} now")
        elif not election.lease_valid(self.now):
            self.stats.lapsed += elapsed  # it serves nobody meanwhile (its loop stalled)

    # -- slow operations ---------------------------------------------------------------------

    def slow_operation(self, node: SimProcess, cost: float, done: Callable[[], None], *,
                       sliced: bool = True, alive: Callable[[], bool] = lambda: True) -> None:
        """A client operation that takes ``cost`` virtual CPU seconds on ``node`` (a purge
        of a deep queue, a big transaction's commit), then ``done`` in its last step.

        Sliced (the fix of issue 33): in steps of ``Costs.slice``, each yielding to the
        loop, so that what came meanwhile (ticks, heartbeats, acks) waits one slice at
        most. Unsliced: one step, the loop stalled for all of it. ``alive``: whether the
        operation still goes on (its connection open) at each step.
        """
        step = self.costs.slice if sliced and self.costs.slice > 0 else cost
        left = [cost]

        def one() -> None:
            if not alive():
                return
            part = min(step, left[0])
            left[0] -= part
            node.charge(part)
            if left[0] > 1e-12:
                node.run(one)  # behind what waits: the loop's next turn
            else:
                done()

        node.run(one)

    # -- the end of a run --------------------------------------------------------------------

    def rejoin_timed_out(self, serving: SimNode) -> None:
        """A backup the primary timed out stays out until it joins again: make it join."""
        primary = serving.primary
        assert primary is not None
        for name, session in sorted(primary.sessions.items()):
            if session.timed_out:
                self.fail_link(serving.name, name)

    def backups_settled(self, serving: SimNode) -> bool:
        """Every other node a live, ready backup that acknowledged everything; no sync due."""
        return not self.backups_unsettled(serving)

    def backups_unsettled(self, serving: SimNode) -> str:
        """What keeps ``backups_settled`` false ("": nothing)."""
        primary = serving.primary
        assert primary is not None
        for name in self.names:
            if name == serving.name:
                continue
            session = primary.sessions.get(name)
            if session is None:
                return f"{name} has not joined {serving.name}"
            if not session.ready or session.progress < primary.seq:
                return (f"{name} acknowledged {session.progress} of {primary.seq} (ready: "
                        f"{session.ready}, {len(session.tx_trackers)} TxTrackers)")
            if not self.nodes[name].alive or self.nodes[name].store.waiting:
                return f"{name} is down or its store has a sync due"
        return f"{serving.name}'s store has a sync due" if serving.store.waiting else ""

    # -- processes ---------------------------------------------------------------------------

    def restart(self, name: str) -> None:
        self.incarnations[name] += 1
        node = SimNode(self, name, self.incarnations[name], self.disks[name], self.votes[name])
        self.nodes[name] = node
        if self.now:
            st = node.ha.core.state
            self.note(f"restart {name} at epoch {node.election.epoch}, position "
                      f"({st.pos_epoch}, {st.pos_seq}), floor ({st.floor_epoch}, {st.floor_seq})")
        for peer in self.names:
            if peer != name:
                self.seen[(name, peer)] = None
                self._maybe_redial(name, peer)
        node.ha.start()
        phase = self.rng.random() * TICK
        self.after(phase, lambda: self._tick(node))

    def _tick(self, node: SimNode) -> None:
        if not node.alive:
            return
        self.after(TICK, lambda: self._tick(node))
        if node.paused:
            return  # the resume ticks
        if node.busy or node.inbox:  # a stalled loop: the tick runs once, late
            if not node.tick_waiting:
                node.tick_waiting = True
                node.run(partial(self._late_tick, node))
            return
        node.ha.tick()

    def _late_tick(self, node: SimNode) -> None:
        node.tick_waiting = False
        node.ha.tick()

    def crash(self, node: SimNode, downtime: float) -> None:
        self.disturb()
        self.note(f"crash {node.name} for {downtime:.2f}s"
                  + (" (primary)" if node.primary is not None else ""))
        self.stats.crashes += 1
        backup = node.ha.backup
        if backup is not None:
            self.stats.crashed_mid_commit += backup.busy
            self.stats.crashed_between_parts += backup.partial_body
        self.on_crash(node)
        node.up = False
        for link in list(node.ha.clients.connections):  # the process is gone: so are they
            if isinstance(link, SimConnection) and link.open:
                link.open = False
                self.connection_closed(link)
        self.disks[node.name] = node.store.disk
        for peer in self.names:
            if peer != node.name:
                self.seen[(node.name, peer)] = None
                self._fail_link(node.name, peer)
        self.after(downtime, lambda: self.restart(node.name))

    def pause(self, node: SimNode, length: float) -> None:
        self.disturb()
        node.paused_until = self.now + length
        if node.busy_until > self.now:
            node.busy_until += length  # its work goes on after the pause
        self.note(f"pause {node.name} for {length:.2f}s")
        self.after(length, lambda: self._resume(node))

    def _resume(self, node: SimNode) -> None:
        if not node.alive or node.paused:
            return
        self.note(f"resume {node.name} ({node.election.role}, epoch {node.election.epoch})")
        # what waited runs in an order the loop does not promise: input (a client's
        # connection in the accept backlog, a peer's packet) may come before the tick
        # that would notice the lease ran out during the pause
        inbox = node.inbox
        inbox.insert(self.rng.randint(0, len(inbox)), node.ha.tick)
        node.drain()

    # -- links -------------------------------------------------------------------------------

    def connected(self, me: str, peer: str) -> bool:
        gen = self.seen.get((me, peer))
        return gen is not None and gen == self.links[frozenset((me, peer))].gen

    def send(self, src: str, dst: str, msg_id: int, packet: Packet) -> None:
        gen = self.seen.get((src, dst))
        if gen is None or gen != self.links[frozenset((src, dst))].gen:
            return  # not connected, or the link failed and this end has not noticed yet
        f, rng = self.faults, self.rng
        delay = f.delay[0] + (f.delay[1] - f.delay[0]) * rng.random()
        spike = f.spike_p and rng.random() < f.spike_p
        if spike:
            delay += f.spike_max * rng.random()
        key = (src, dst)
        # it leaves once the sender's loop made it (the work charged so far)
        when = max(max(self.now, self.nodes[src].busy_until) + delay, self.last_at.get(key, 0.0))
        self.last_at[key] = when
        if spike:
            self.disturb(until=when)  # congestion, a GC: a fault until it arrived
        packet = wire(packet)
        self.after(when - self.now, lambda: self._deliver(src, dst, gen, msg_id, packet))

    def _deliver(self, src: str, dst: str, gen: int, msg_id: int, packet: Packet) -> None:
        if self.links[frozenset((src, dst))].gen != gen:
            return
        node = self.nodes[dst]
        node.run(lambda: self._receive(node, src, gen, msg_id, packet))

    def _receive(self, node: SimNode, src: str, gen: int, msg_id: int, packet: Packet) -> None:
        if self.links[frozenset((src, node.name))].gen != gen:
            return  # the link failed while the node was paused
        if type(packet) is Events:
            node.charge(entries_of(packet.events) * self.costs.event_applied)
            backup = node.ha.backup
            before = backup.applied_seq if backup is not None else None
            commit = backup.commit_seq if backup is not None else None
            older = packet.epoch < node.election.epoch
            node.ha.on_message(src, msg_id, packet)
            if older and backup is not None and node.ha.backup is backup \
                    and backup.applied_seq != before:
                self.violate(f"(e) {node.name} applied events of epoch {packet.epoch} after "
                             f"adopting epoch {node.election.epoch}")
            if node.ha.backup is not None:
                self._big_work(node, packet, commit if node.ha.backup is backup else None)
            return
        node.ha.on_message(src, msg_id, packet)

    # -- big work in small bounds (``Bounds``): counted, and faults aimed at it --------------

    def _big_work(self, node: SimNode, packet: Events, commit: int | None) -> None:
        """After a backup took a packet: a commit it began in slices (``commit``: the one it
        was on before), the parts it applied, a message's parts left waiting."""
        backup = node.ha.backup
        assert backup is not None
        stats = self.stats
        if self.bounds.body_part_bytes < BODY_PART_BYTES:
            parts = sum(1 for e in packet.events if e[0] == R.BODY_PART)
            stats.body_parts += parts
            if packet.first_seq < 0:  # a catch-up's (numbered below its join's seq)
                stats.catch_up_parts += parts
            if backup.partial_body and self.aim(self.faults.between_parts):
                self.aim_now(node, "between parts", self.aimed_kind())
        if backup.busy and backup.commit_seq != commit:
            self._slice_done(node, backup)

    def next_slice(self, node: SimNode, step: Callable[[], None]) -> None:
        """The backup's next slice of a commit (``HACore._next_slice``): its CPU counted."""
        backup = node.ha.backup
        busy = backup is not None and backup.busy
        step()
        if not busy:  # settled meanwhile (a join, following another primary): nothing left
            self.stats.settled_mid_commit += node.mid_commit
            node.mid_commit = False
        elif backup is not None and node.ha.backup is backup:
            self._slice_done(node, backup)

    def _slice_done(self, node: SimNode, backup: Backup) -> None:
        """A slice of a commit ran: the first of one, the next, or the last."""
        stats = self.stats
        node.charge(self.costs.commit_slice)
        stats.commit_slices += 1
        commit = (backup.epoch, backup.commit_seq)
        if backup.busy and commit != node.mid_commit_seq:  # a new one (a packet held
            stats.sliced_commits += 1                        # behind the last may begin it)
            node.mid_commit_seq = commit
            node.aim_in = self.rng.randrange(8) if self.aim(self.faults.mid_commit) else None
            self.commit_begun(node, backup)
        node.mid_commit = backup.busy
        if backup.busy and node.aim_in is not None:
            if node.aim_in == 0:
                node.aim_in = None
                self.aim_now(node, "mid-commit", self.aimed_kind())
            else:
                node.aim_in -= 1

    def flush(self, node: SimNode, flush: Callable[[], None]) -> None:
        """The primary's flush (``HACore.flush``): whether it left live events for later."""
        flush()
        primary = node.primary
        if primary is not None and any(s.more_to_send for s in primary.sessions.values()):
            self.stats.split_flushes += 1

    def commit_begun(self, node: SimNode, backup: Backup) -> None:
        """``node``'s backup began a commit in slices (the workload may aim a fault at it)."""

    def aim(self, chance: float) -> bool:
        """Whether a fault is aimed at this moment of big work (drawn only if ``chance``)."""
        return bool(chance) and not self.calm and self.rng.random() < chance

    def aimed_kind(self) -> str:
        """An aimed fault: the backup's crash (its store synced just before, or not), the
        primary's crash, a handover to it (which waits for its position: it lands
        mid-commit only while the primary's own position lags its last commit), a pause
        of it, its link to the primary failing."""
        return self.rng.choice(("crash", "synced crash", "primary crash", "handover", "pause",
                                "link"))

    def aim_now(self, node: SimNode, where: str, kind: str,
                downtime: float | None = None) -> None:
        """A fault of ``kind`` at ``node`` in the middle of big work (``where``), right
        after the input it runs (a crash's ``downtime``: drawn as any outage's by default)."""
        self.after(0.0, partial(self._aimed, node, where, kind, downtime))

    def _aimed(self, node: SimNode, where: str, kind: str, downtime: float | None) -> None:
        if not node.alive or node.paused:
            return
        backup = node.ha.backup
        if backup is None or not (backup.busy or backup.partial_body):
            return  # done meanwhile
        serving = self.serving_now
        self.stats.aimed_faults += 1
        self.note(f"aimed at {node.name} {where}: {kind}")
        lo, hi = self.faults.outage
        outage = lo + (hi - lo) * self.rng.random() if downtime is None else downtime
        if kind in ("crash", "synced crash"):
            if kind == "synced crash":  # the store's writer committed what it had, then
                node._synced()
            if node.alive:
                self.crash(node, outage)
        elif kind == "primary crash" and serving is not None and serving is not node:
            self.crash(serving, outage)
        elif kind == "handover" and serving is not None and serving is not node:
            self.promote(serving, node.name)
        elif kind == "pause":
            self.pause(node, outage)
        elif kind == "link" and node.ha.core.following is not None:
            self.fail_link(node.name, node.ha.core.following)

    def on_ack(self, node: SimNode, ack: Ack) -> None:
        """A backup sends an acknowledgement (the workload may check what it promises)."""

    def fail_link(self, a: str, b: str) -> None:
        self.note(f"link {a}-{b} fails")
        self._fail_link(a, b)

    def _fail_link(self, a: str, b: str) -> None:
        self.disturb()
        link = self.links[frozenset((a, b))]
        link.gen += 1
        link.up = False
        lo, hi = self.faults.detect
        for me, peer in ((a, b), (b, a)):
            self.after(lo + (hi - lo) * self.rng.random(),
                       partial(self._notice_down, me, peer, link.gen))

    def _notice_down(self, me: str, peer: str, gen: int) -> None:
        link = self.links[frozenset((me, peer))]
        if link.gen != gen or link.up:
            return  # failed again since (that failure's notice comes), or redialled already
        if self.seen.get((me, peer)) is not None:
            self.seen[(me, peer)] = None
            node = self.nodes[me]
            node.run(lambda: node.ha.peer_down(peer))
        self._maybe_redial(me, peer)

    def _maybe_redial(self, a: str, b: str) -> None:
        """Redial once both ends know the link is gone (and are alive)."""
        if self.seen.get((a, b)) is not None or self.seen.get((b, a)) is not None:
            return
        lo, hi = self.faults.redial
        link = self.links[frozenset((a, b))]
        self.after(lo + (hi - lo) * self.rng.random(), partial(self._redial, a, b, link.gen))

    def _redial(self, a: str, b: str, gen: int) -> None:
        link = self.links[frozenset((a, b))]
        if link.gen != gen or link.up:
            return
        if not (self.nodes[a].alive and self.nodes[b].alive):
            return  # the restart redials
        if self.seen.get((a, b)) is not None or self.seen.get((b, a)) is not None:
            return
        if link.blocked:
            lo, hi = self.faults.redial
            self.after(lo + (hi - lo) * self.rng.random(), lambda: self._redial(a, b, gen))
            return
        link.up = True
        for me, peer in ((a, b), (b, a)):
            self.seen[(me, peer)] = link.gen
            node = self.nodes[me]
            node.run(partial(node.ha.peer_up, peer))

    def partition(self, length: float) -> None:
        names = self.names[:]
        self.rng.shuffle(names)
        cut = 1 if self.rng.random() < 0.5 else self.rng.randint(1, len(names) - 1)
        side = set(names[:cut])
        crossing = [(a, b) for a in sorted(side) for b in self.names if b not in side]
        self.note(f"partition {sorted(side)} | {sorted(set(self.names) - side)} for {length:.2f}s")
        for a, b in crossing:
            self.links[frozenset((a, b))].blocked += 1
            self._fail_link(a, b)

        def heal() -> None:
            self.note("heal " + " ".join(f"{a}-{b}" for a, b in crossing))
            for a, b in crossing:
                self.links[frozenset((a, b))].blocked -= 1

        self.after(length, heal)

    # -- faults ------------------------------------------------------------------------------

    def _next_fault(self) -> tuple[str, float] | None:
        """The fault to inflict now and its outage (None once calm); the next is scheduled."""
        if self.calm:
            return None
        f, rng = self.faults, self.rng
        self.after(rng.expovariate(f.rate), self._fault)
        kinds = ("crash", "pause", "partition", "link", "promote")
        kind = rng.choices(kinds, weights=[getattr(f, k) for k in kinds])[0]
        return kind, f.outage[0] + (f.outage[1] - f.outage[0]) * rng.random()

    def _fault(self) -> None:
        fault = self._next_fault()
        if fault is None:
            return
        (kind, outage), rng = fault, self.rng
        up = [n for n in self.nodes.values() if n.alive and not n.paused]
        if kind == "crash" and up:
            self.crash(rng.choice(up), outage)
        elif kind == "pause" and up:
            self.pause(rng.choice(up), outage)
        elif kind == "partition":
            self.partition(outage)
        elif kind == "link":
            a, b = rng.sample(self.names, 2)
            self.fail_link(a, b)
        elif kind == "promote" and self.serving_now is not None:
            self.promote(self.serving_now,
                         rng.choice([n for n in self.names if n != self.serving_now.name]))

    def promote(self, node: SimNode, target: str) -> None:
        self.disturb()  # a handover is an election on purpose
        try:
            node.ha.promote(target)
        except el.PromoteRefused as exc:
            self.note(f"promote {target} refused: {exc}")
            return
        self.note(f"promote {target} (from {node.name})")


@dataclass
class SimResult:
    """One seed of an ``AsyncWorld`` workload."""

    seed: int
    violation: str | None
    trace: list[str]
    stats: dict[str, int]
    stuck: str | None = None  # nobody was elected after the run (liveness): checks skipped

    def summary(self) -> str:
        if self.violation:
            return self.violation
        return f"seed {self.seed}: " + (f"STUCK {self.stuck}" if self.stuck else f"ok {self.stats}")


class AsyncWorld(World):
    """A world whose clients are coroutines: a commit or an XA verb awaits the broker.

    Everything runs in one asyncio loop on the virtual clock: after each event
    the client tasks run until they wait again (``quiesce``), and the checks
    run when anything they read changed (``signature``). ``run`` is one seed:
    the faulty run, then the workload's ``finish`` (calm, settle, final checks).
    """

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.running: list[asyncio.Future[Any]] = []  # the clients' tasks not done yet
        self.counts: Counter[str] = Counter()
        self.stuck: str | None = None

    def violate(self, text: str) -> None:
        raise Violation(f"seed {self.seed}: {text}")

    async def run(self) -> SimResult:
        violation = None
        try:
            self.start()
            await self.advance_to(self.duration)
            await self.finish()
        except Violation as exc:
            violation = str(exc)
            self.note(f"VIOLATION {exc}")
        except Exception as exc:  # noqa: BLE001 - a node's code failed: a defect found
            where = traceback.extract_tb(exc.__traceback__)[-1]
            violation = (f"seed {self.seed}: {type(exc).__name__}: {exc} (raised at "
                         f"{Path(where.filename).name}:{where.lineno} {where.name})")
            self.note(f"VIOLATION {violation}")
        stats = dict(self.counts)
        stats["failover"] = self.stats.failovers
        stats["crash"] = self.stats.crashes
        stats["stable seconds"] = round(self.stats.stable)
        stats["lapsed ms"] = round(self.stats.lapsed * 1000)
        if self.bounds != Bounds():
            stats.update(self.stats.big_work())
        return SimResult(self.seed, violation, list(self.trace) if violation else [], stats,
                         self.stuck)

    async def finish(self) -> None:
        """After the faulty run: no new faults; within ``SETTLE_LIMIT`` virtual seconds the
        workload settles on a serving primary and its final checks run, or the run is
        *stuck* (liveness: ``stuck_reason``), or it never settled (a violation)."""
        self.note(f"--- calm: {self.calm_note} ---")
        self.calm = True
        end = self.now + SETTLE_LIMIT
        while self.now < end:
            await self.advance_to(self.now + 0.5)  # crashed nodes restart as scheduled
            serving = self.serving_now
            if serving is None or serving.primary is None:
                continue
            self.rejoin_timed_out(serving)
            self.settling(serving)
            if self.settled(serving):
                self.final_checks(serving)
                return
        self.stuck = self.stuck_reason()
        if self.stuck is not None:
            self.note(self.stuck)
            return
        serving = self.serving_now
        self.violate("never settled: " + (self.why_unsettled() or (
            self.backups_unsettled(serving) if serving is not None and serving.primary is not None
            else "")))

    calm_note = "no new faults"

    def settling(self, serving: SimNode) -> None:
        """While the run settles: what the workload's clients still do."""

    def settled(self, serving: SimNode) -> bool:
        return not self.why_unsettled() and self.backups_settled(serving)

    def why_unsettled(self) -> str:
        """What the workload still waits for ("": nothing)."""
        return ""

    def final_checks(self, serving: SimNode) -> None:
        """The workload's checks once everything settled."""

    def stuck_reason(self) -> str | None:
        """Why the run is stuck (nobody serves), or None."""
        if self.serving_now is not None:
            return None
        return f"no primary serves within {SETTLE_LIMIT:.0f}s of calm: " + ", ".join(
            f"{n.name} {n.election.role} epoch {n.election.epoch} at {n.election.position}"
            for n in self.nodes.values())

    def spawn(self, work: Any) -> asyncio.Future[Any]:
        """A client's request as a task that waits for the broker."""
        task: asyncio.Future[Any] = asyncio.ensure_future(work)
        self.running.append(task)
        return task

    async def quiesce(self) -> None:
        """Let the client tasks run until they wait again (and the loop's ``call_soon``
        callbacks); then what they asked for soon."""
        await asyncio.sleep(0)
        for _ in range(5):
            self.running = [t for t in self.running if not t.done()]
            if not self.running:
                break
            await asyncio.sleep(0)
        self.run_soon()

    async def advance_to(self, end: float) -> None:
        """Run the events due by ``end``, the checks after each one that changed anything."""
        last = None
        while self.step(end):
            await self.quiesce()
            state = self.signature()
            if state != last:
                self.check()
                last = state
        await self.quiesce()

    def signature(self) -> tuple[Any, ...]:
        """What the checks read, in brief (the checks run when it changes)."""
        return ()

    def check(self) -> None:
        """The workload's invariants."""
