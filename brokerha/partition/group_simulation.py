"""Partition groups on a node, simulated (issue 35, stage 2): ``--workload groups``.

The datacenter of ``ha/simulation/world.py`` (simulated disks and links, the
cost model, crashes, pauses, link failures, partitions, manual failovers)
where every node runs the product's ``PartitionedMember``
(``partition/member.py``) over its one ``Broker``: the metadata group and one
group per partition cell it holds, each a real ``HAMember`` (``Election``,
``HACore``, scoped ``Primary``/``Backup``, verification), every packet of
every group through the node pair's one link (``GroupMux``: grouped
packets, bundled heartbeats). The metadata group runs the product's
``TableCoordinator`` (stage 1): its first primary makes the table, the
metadata log carries it to every node, and each node makes its partition
groups once its copy exists (``PartitionedMember``); the table does not
change in this stage.

One client per partition, as the confirms simulation's one client
(``ha/simulation/confirms.py``), on a queue of its own whose name hashes into
that partition: it connects to *that partition's* primary (dialling any cell,
whose group admission serves it, relays it to the group's primary, or refuses
it), publishes persistent messages and waits for each confirm, given through
the group's own gate (``Broker.after_durable_in(member.durability_gate)``),
and consumes (basic.get + ack) from the head of its queue. No client crosses
nodes: a call reaches only the node that serves its partition (stage 3).

Checked after every event, each **per group** (a group's violation names it):

- (a) at most one primary per group and epoch, one vote per node, group and
  epoch;
- (b) a deposed primary of a group serves at most ``lease_timeout`` after a
  newer primary of that group was elected;
- (c) the serving primary of a group's newest epoch holds every confirmed
  message of its partition's queue not consumed since;
- (d) a backup that reports a valid position ``(epoch, seq)`` in a group holds
  every message of the group's queue its position covers;
- (e) a node never applies a group's events of an epoch older than its own in
  that group;
- (f) stability, per group: while every cell of the group and the links
  between them are up, no election in it (no new epoch persisted, its
  primary never steps down). A crash disarms only the groups the crashed
  node led (and those it leaves without a majority of cells): **killing a
  node elects only in the groups it led** -- the others keep their primary
  and epoch through the crash, the restart and the rejoin (``crashes_seen``
  counts the crashes that armed groups lived through, ``elected_after_crash``
  the groups that elected after losing their primary to one); a pause
  (SIGSTOP) and a link's failure likewise disarm only the groups their nodes
  led (``pauses_seen``, ``links_seen``); a network partition and a delayed
  packet disarm every group;
- (g) scope: a node holds a partition's queue only if it is a cell of that
  partition (N = 5, NR = 2: two nodes of five hold none of it);
- (h) every node makes its groups of the one placement (``PartitionTable.tweak``
  of the nodes: the table any first metadata primary makes).

``Unsafe``: the HA rules of ``world.Unsafe`` (the confirms simulation's
``CATCHES``), broken in every group's member at once; the checks above must
name the group where it shows.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from brokerha import seed_runner
from brokerha.broker.queue import Queue
from brokerha.cluster import election as el
from brokerha.cluster.messages import Message as Packet
from brokerha.cluster.partition_table import PartitionTable, hash_partition
from brokerha.cluster.replication import Events
from brokerha.cluster.state import NodeState
from brokerha.ha.admission import Admission
from brokerha.ha.core import PrimarySettings
from brokerha.ha.member import TICK, HAMember
from brokerha.ha.simulation.disk import Image
from brokerha.ha.simulation.world import (
    Faults,
    SimConnection,
    SimNode,
    SimProcess,
    Unsafe,
    Violation,
    Votes,
    World,
    message,
)
from brokerha.partition.coordinator import TableCoordinator
from brokerha.partition.directory import DirectoryLayer
from brokerha.partition.directory import Unsafe as DirectoryUnsafe
from brokerha.partition.member import GroupUnsafe, PartitionedMember, group_of
from brokerha.partition.mux import Grouped
from brokerha.primary.primary import Primary

__all__ = ["CATCHES", "GroupSimulation", "SimResult", "Unsafe", "run_many", "run_seed"]

CATCHES = ("confirm_early", "early_ack", "invalid_grants", "no_lease", "old_epoch_apply",
           "lagging_role")
PARTITIONS = 3
REPLICAS = 2
# the confirms simulation's faults, with fewer spiked packets: the links carry every group's
# packets (about three times as many at P = 3), and a spike disarms (f) in every group
# whose cells it joins; so about as many spikes a second as with one group
FAULTS = Faults(spike_p=0.007)


def queue_names(partitions: int, vhost: str = "/") -> list[str]:
    """One queue name per partition, each hashing into its partition (``q<p>-<i>``)."""
    names = []
    for p in range(partitions):
        i = 0
        while hash_partition(vhost, f"q{p}-{i}", partitions) != p:
            i += 1
        names.append(f"q{p}-{i}")
    return names


@dataclass
class SimResult:
    seed: int
    nodes: int
    partitions: int
    violation: str | None
    trace: list[str]
    trace_hash: str
    stats: Counter[str] = field(default_factory=Counter)
    stuck: str | None = None  # (``brokerha cluster simulate``'s summary: never, here)

    def summary(self) -> str:
        head = f"seed {self.seed} ({self.nodes} nodes, P = {self.partitions}): "
        if self.violation:
            return head + f"VIOLATION {self.violation}"
        s = self.stats
        return head + (f"ok, {s['failovers']} group failovers, {s['confirmed']}/"
                       f"{s['published']} confirmed, {s['crashes_seen']} crashes lived through "
                       "by groups the node did not lead")


class GroupNode(SimProcess):
    """One process of a partitioned node: its broker on its disk and its
    ``PartitionedMember``, whose driver (``PartitionEffects``) it is."""

    def __init__(self, world: GroupSimulation, name: str, incarnation: int,
                 disk: Image | None) -> None:
        super().__init__(world, name, disk)
        self.sim = world
        self.incarnation = incarnation
        states = {g: NodeState(epoch=v.epoch, voted_for=v.voted_for)
                  for (n, g), v in world.group_votes.items() if n == name}
        # the product's table coordinator in the metadata group (node/ha.py hands it in):
        # the first metadata primary makes the table, the groups are made from each
        # node's copy once it holds one
        self.coordinator = TableCoordinator(self.store, world.names,
                                            partitions=world.partitions, replicas=world.replicas)
        coordinator = self.coordinator
        # the queue directory's layer (partition/directory.py), when the world keeps one
        self.directory_layer = DirectoryLayer(self.store, world.directory_unsafe) \
            if world.directory else None
        layers: list[Any] = [coordinator]
        if self.directory_layer is not None:
            layers.append(self.directory_layer)
        self.ha = PartitionedMember(
            self.broker, name, world.names, lambda: coordinator.table, states, self,
            PrimarySettings(len(world.names), world.backup_timeout,
                            tx_prepare_timeout=world.tx_prepare_timeout,
                            events_per_packet=world.events_per_packet),
            world.clock, timing=world.timing, verification_timeout=world.verification_timeout,
            rng=lambda g: random.Random(f"{world.seed}/{name}/{incarnation}/{g}"),
            primary_factory=world.make_primary,
            unsafe=world.group_unsafe(), layers=layers)

    @property
    def alive(self) -> bool:
        return self.up and self.sim.nodes.get(self.name) is cast(Any, self)

    @property
    def election(self) -> el.Election:
        """The metadata group's (the world's notes read it)."""
        return self.ha.metadata.election

    def member(self, group: int) -> HAMember | None:
        return self.ha.groups.get(group)

    def serves(self, group: int) -> bool:
        """Serving group ``group``'s clients now: its verified primary within its lease."""
        member = self.ha.groups.get(group)
        return (member is not None and self.alive and not self.paused
                and member.phase == "primary" and member.election.lease_valid(self.sim.now))

    # -- partition.member.PartitionEffects --------------------------------------------------

    def send(self, peer: str, message: Packet) -> None:
        self._charge_sent(message)
        self.sim.send(self.name, peer, 0, message)

    def reply(self, peer: str, msg_id: int, message: Packet) -> None:
        self._charge_sent(message)
        self.sim.send(self.name, peer, msg_id, message)

    def _charge_sent(self, packet: Packet) -> None:
        if type(packet) is Grouped and packet.code == Events.CODE:
            self.charge(len(packet.args[2]) * self.sim.costs.event_sent)

    def connected(self, peer: str) -> bool:
        return self.sim.connected(self.name, peer)

    def peers_up(self) -> list[str]:
        return [p for p in self.sim.names if p != self.name and self.connected(p)]

    def soon(self, callback: Callable[[], None]) -> None:
        self.sim.soon.append((self, callback))

    def persist(self, group: int, epoch: int, voted_for: str | None) -> None:
        self.sim.persist(self, group, epoch, voted_for)

    def position(self, group: int, pos: el.Position) -> None:
        self.sim.on_group_position(self, group, pos)

    def replication_failed(self, group: int, reason: str) -> None:
        self.sim.violate(f"{self.name} cannot follow the primary of group {group}: {reason}")

    def joined(self, group: int, primary: str, epoch: int) -> None:
        self.sim.note(f"{self.name} joins {primary} (group {group}, epoch {epoch})")

    def elected(self, group: int, epoch: int, primary: Primary) -> None:
        self.sim.on_group_elected(self, group, epoch)

    def serving(self, group: int, epoch: int, decisions: dict[str, str]) -> None:
        self.sim.note(f"{self.name} serves group {group} (epoch {epoch})")
        member = self.ha.groups[group]
        member.clients.open(epoch)
        self.sim.check_confirmed(group, self)

    def demoted(self, group: int, reason: str) -> None:
        self.sim.note(f"{self.name} stops serving group {group}: {reason}")
        self.sim.unstable(group, f"{self.name} stopped serving group {group}: {reason}")

    def follow(self, group: int, primary: str, epoch: int) -> None:
        pass


@dataclass
class Client:
    """One partition's client: its queue, its connection, what it was told."""

    partition: int
    queue: str
    conn: SimConnection | None = None
    dialled_at: float = -1.0
    confirmed_live: set[int] = field(default_factory=set)
    confirmed: int = 0  # confirms it was given


@dataclass
class GroupLog:
    """For (d), per group and epoch: the seq at which its primary took each message in,
    and gave it away."""

    held_at: dict[int, int] = field(default_factory=dict)
    gone_at: dict[int, int] = field(default_factory=dict)
    alive: set[int] = field(default_factory=set)


class GroupSimulation(World):
    node_class: type[GroupNode] = GroupNode  # a workload's nodes may do more (forwarding)
    directory = False  # each node's metadata group keeps the queue directory (its layer)
    directory_unsafe: DirectoryUnsafe | None = None  # its rules broken on purpose

    def __init__(self, seed: int, *, nodes: int = 3, partitions: int = PARTITIONS,
                 replicas: int = REPLICAS, duration: float = 30.0,
                 publish_rate: float = 2.0, consume_rate: float = 1.6, **kw: Any) -> None:
        kw.setdefault("stability", True)
        if kw.get("faults") is None:
            kw["faults"] = FAULTS
        super().__init__(seed, nodes=nodes, duration=duration, **kw)
        # the table every node's coordinator makes (placement is deterministic): the cells
        # the checks expect; (h) each node's groups are made of exactly this table
        self.replicas = min(replicas, nodes - 1)
        table = PartitionTable.empty(partitions, self.replicas)
        change = table.tweak(self.names)
        assert change is not None
        table.apply(change)
        self.table = table
        self.partitions = partitions
        self.tables_seen: set[tuple[str, int]] = set()
        self.groups = [0, *(group_of(p) for p in range(partitions))]
        self.cells = {0: list(self.names),
                      **{group_of(p): table.voting(p) for p in range(partitions)}}
        self.publish_rate, self.consume_rate = publish_rate, consume_rate
        self.group_votes: dict[tuple[str, int], Votes] = {}
        self.group_primaries: dict[tuple[int, int], str] = {}
        self.group_elected_at: dict[tuple[int, int], float] = {}
        self.clients = [Client(p, name) for p, name in enumerate(queue_names(partitions))]
        self.consumed: set[int] = set()
        self.next_id = 0
        self.logs: dict[tuple[int, int], GroupLog] = {}
        self.serving_groups: dict[int, GroupNode | None] = dict.fromkeys(self.groups)
        self.group_stable: dict[int, tuple[GroupNode, float] | None] = dict.fromkeys(self.groups)
        self.crash_victims: dict[int, list[str]] = {g: [] for g in self.groups}  # while armed
        self.lost_primary: set[int] = set()  # groups whose primary crashed: elect next
        self.counts: Counter[str] = Counter()
        self._chosen = False  # a fault that disarmed its own groups runs (disturb: nothing)
        self.armed = 0.0  # group-seconds under (f), summed over the groups
        self._armed_at = 0.0
        self.result = SimResult(seed, nodes, partitions, None, [], "")

    def node(self, name: str) -> GroupNode:
        return cast(GroupNode, self.nodes[name])

    def group_unsafe(self) -> GroupUnsafe:
        """The rules every node's groups break (a workload adds its own: moves)."""
        unsafe = self.unsafe
        return GroupUnsafe(member=unsafe.member(), core=unsafe.core(),
                           election=unsafe.election(), admission=unsafe.admission())

    def group_nodes(self) -> list[GroupNode]:
        return [cast(GroupNode, n) for n in self.nodes.values()]

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> SimResult:
        result = self.result
        try:
            self.start()
            for client in self.clients:
                if self.publish_rate > 0:
                    self.after(self.rng.expovariate(self.publish_rate),
                               partial(self._publish, client))
                if self.consume_rate > 0:
                    self.after(self.rng.expovariate(self.consume_rate),
                               partial(self._consume, client))
            self.run_until(self.duration)
            for group in self.groups:
                self.check_confirmed(group, self.serving_groups[group])
            self.check_scope()
        except Violation as exc:
            result.violation = str(exc)
            self.note(f"VIOLATION {exc}")
        self.counts["events"] = self.stats.events
        self.counts["armed_group_s"] = round(self.armed)
        result.stats = self.counts
        result.trace = list(self.trace)
        self._hash.update(repr(sorted(self.counts.items())).encode())
        result.trace_hash = self.trace_hash()
        return result

    def restart(self, name: str) -> None:
        self.incarnations[name] += 1
        node = self.node_class(self, name, self.incarnations[name], self.disks[name])
        self.nodes[name] = cast(SimNode, node)
        if self.now:
            self.note(f"restart {name}: " + ", ".join(
                f"g{g} epoch {m.election.epoch} at {m.election.position}"
                for g, m in sorted(node.ha.groups.items())))
        for peer in self.names:
            if peer != name:
                self.seen[(name, peer)] = None
                self._maybe_redial(name, peer)
        node.ha.start()
        phase = self.rng.random() * TICK
        self.after(phase, lambda: self._tick(cast(SimNode, node)))

    # -- the nodes' reports (GroupNode) ------------------------------------------------------

    def persist(self, node: GroupNode, group: int, epoch: int, voted_for: str | None) -> None:
        votes = self.group_votes.setdefault((node.name, group), Votes())
        if epoch < votes.epoch:
            self.violate(f"{node.name} persisted epoch {epoch} of group {group} after "
                         f"{votes.epoch}")
        if epoch == votes.epoch and votes.voted_for not in (None, voted_for):
            self.violate(f"(a) {node.name} voted for {votes.voted_for} and {voted_for} in "
                         f"epoch {epoch} of group {group}")
        if epoch > votes.epoch:
            self.unstable(group, f"{node.name} took epoch {epoch} of group {group} (was "
                          f"{votes.epoch})")
        votes.epoch, votes.voted_for = epoch, voted_for

    def on_group_elected(self, node: GroupNode, group: int, epoch: int) -> None:
        first = self.group_primaries.setdefault((group, epoch), node.name)
        if first != node.name:
            self.violate(f"(a) two primaries of group {group} in epoch {epoch}: {first} and "
                         f"{node.name}")
        self.group_elected_at[(group, epoch)] = self.now
        if any(g == group and e < epoch for g, e in self.group_primaries):
            self.counts["failovers"] += 1
        if group in self.lost_primary:
            self.lost_primary.discard(group)
            self.counts["elected_after_crash"] += 1
        self.note(f"{node.name} elected for group {group}, epoch {epoch}")
        held = self.held(node, group)
        self.logs[(group, epoch)] = GroupLog(dict.fromkeys(held, 0), {}, set(held))

    def on_group_position(self, node: GroupNode, group: int, pos: el.Position) -> None:
        """(d): a backup valid at ``pos`` in ``group`` misses nothing that covers."""
        member = node.member(group)
        backup = member.backup if member is not None else None
        log = self.logs.get((group, pos.epoch))
        if not pos.valid or backup is None or log is None or group == 0:
            return
        applied = backup.applied_seq
        have = self.held(node, group)
        missing = [mid for mid in log.alive - have if log.held_at[mid] <= pos.seq] \
            if pos.seq + 1 > applied else []
        for mid, gone in reversed(log.gone_at.items()):
            if gone <= applied:
                break
            seq = log.held_at.get(mid)
            if seq is not None and seq <= pos.seq and mid not in have:
                missing.append(mid)
        if missing:
            mid = min(missing)
            self.violate(f"(d) backup {node.name} of group {group} ready at {pos} but misses "
                         f"message {mid} (seq {log.held_at[mid]}) of the primary of epoch "
                         f"{pos.epoch}")

    # -- invariants --------------------------------------------------------------------------

    def held(self, node: GroupNode, group: int) -> set[int]:
        if group == 0:
            return set()
        q = self.queue_on(node, self.clients[group - 1].queue)
        return set() if q is None else {int(e.message.body) for e in q.ready}

    @staticmethod
    def queue_on(node: GroupNode, name: str) -> Queue | None:
        vhost = node.broker.vhosts.get("/")
        return vhost.queues.get(name) if vhost is not None else None

    def check_confirmed(self, group: int, node: GroupNode | None) -> None:
        """(c): the serving primary of the group's newest epoch holds every confirmed
        message of its queue not consumed since."""
        if node is None or group == 0:
            return
        member = node.member(group)
        newest = max((e for g, e in self.group_primaries if g == group), default=0)
        if member is None or member.election.epoch < newest:
            return
        missing = self.clients[group - 1].confirmed_live - self.held(node, group)
        if missing:
            self.violate(f"(c) confirmed messages {sorted(missing)[:5]} of group {group} lost: "
                         f"not held by {node.name}, its primary of epoch "
                         f"{member.election.epoch}")

    def check_serving(self) -> None:
        """(b) per group; the newest server of each group (and (c) when it changes); (h)."""
        nodes = self.group_nodes()
        for node in nodes:
            table = node.ha.table
            key = (node.name, node.incarnation)
            if table is not None and key not in self.tables_seen:
                self.tables_seen.add(key)
                self.counts["groups_made"] += 1
                if table.rows != self.table.rows:
                    self.violate(f"(h) {node.name} made its groups of table {table}, not of "
                                 f"the placement {self.table}")
        for group in self.groups:
            servers = sorted((n for n in nodes if n.serves(group)),
                             key=lambda n: -self._epoch(n, group))
            for old in servers[1:]:
                epoch = self._epoch(old, group)
                successor = min(at for (g, e), at in self.group_elected_at.items()
                                if g == group and e > epoch)
                if self.now - successor > self.timing.lease_timeout:
                    self.violate(f"(b) {old.name} (group {group}, epoch {epoch}) still serves "
                                 f"{self.now - successor:.3f}s after a newer primary was "
                                 "elected")
            serving = servers[0] if servers else None
            if serving is not self.serving_groups[group]:
                self.serving_groups[group] = serving
                self.check_confirmed(group, serving)
        metadata = self.serving_groups[0]
        self.serving_now = cast(SimNode | None, metadata)  # the world's unserved time

    @staticmethod
    def _epoch(node: GroupNode, group: int) -> int:
        member = node.member(group)
        return member.election.epoch if member is not None else -1

    def check_scope(self) -> None:
        """(g): a partition's queue is only on its cells."""
        for node in self.group_nodes():
            for client in self.clients:
                cell = node.name in self.cells[group_of(client.partition)]
                if not cell and self.queue_on(node, client.queue) is not None:
                    self.violate(f"(g) {node.name} holds queue {client.queue} of partition "
                                 f"{client.partition}, whose cells are "
                                 f"{self.cells[group_of(client.partition)]}")

    # -- (f) stability, per group ------------------------------------------------------------

    def disturb(self, until: float | None = None) -> None:
        """A fault that may elect in any group (a partition, a spike); a crash, a pause or a
        link's failure choose the groups they disarm (``_disarm``)."""
        if self._chosen:
            return
        for group in self.groups:
            self.group_stable[group] = None
        if until is not None and until > self.disturbed_until:
            self.disturbed_until = until

    def unstable(self, group: int, what: str) -> None:  # type: ignore[override]
        armed = self.group_stable[group]
        if self.stability and armed is not None:
            primary, since = armed
            crashed = self.crash_victims[group]
            self.violate(f"(f) {what}, {self.now - since:.3f}s into a stretch where group "
                         f"{group}'s cells and links were up and every backup followed "
                         f"{primary.name}" + (f" (faults since, of nodes and links it does "
                                              f"not depend on: {crashed})" if crashed else ""))

    def group_healthy(self, group: int) -> GroupNode | None:
        cells = self.cells[group]
        nodes = [self.node(n) for n in cells]
        if any(not n.alive or n.paused for n in nodes):
            return None
        for i, a in enumerate(cells):
            for b in cells[i + 1:]:
                link = self.links[frozenset((a, b))]
                if not link.up or self.seen.get((a, b)) != link.gen \
                        or self.seen.get((b, a)) != link.gen:
                    return None
        servers = [n for n in nodes if n.serves(group)]
        if len(servers) != 1:
            return None
        primary = servers[0]
        epoch = self._epoch(primary, group)
        for node in nodes:
            member = node.member(group)
            if node is not primary and (member is None or member.election.epoch != epoch
                                        or member.core.following != primary.name):
                return None
        return primary

    def check_stable(self) -> None:
        if not self.stability:
            return
        t = self.timing
        count = sum(1 for g in self.groups if self.group_stable[g] is not None)
        self.armed += count * (self.now - self._armed_at)  # group-seconds under (f)
        self._armed_at = self.now
        for group in self.groups:
            armed = self.group_stable[group]
            if armed is None:
                if self.now < self.disturbed_until:
                    continue
                primary = self.group_healthy(group)
                member = primary.member(group) if primary is not None else None
                if primary is not None and member is not None and member.election.lease_valid(
                        self.now + t.lease_timeout - 2 * t.heartbeat_interval):
                    self.group_stable[group] = (primary, self.now)
                    self.crash_victims[group] = []
                continue
            primary = armed[0]
            member = primary.member(group)
            assert member is not None
            if not (primary.alive and member.election.role == "primary"
                    and member.phase == "primary"):
                self.unstable(group, f"{primary.name}, primary of group {group} in epoch "
                              f"{member.election.epoch}, is {member.election.role} now")

    # -- faults ------------------------------------------------------------------------------

    def _fault(self) -> None:
        fault = self._next_fault()
        if fault is None:
            return
        (kind, outage), rng = fault, self.rng
        up = [n for n in self.group_nodes() if n.alive and not n.paused]
        if kind == "crash" and up:
            self.crash_node(rng.choice(up), outage)
        elif kind == "pause" and up:
            self.pause_node(rng.choice(up), outage)
        elif kind == "partition":
            self.partition(outage)
        elif kind == "link":
            a, b = rng.sample(self.names, 2)
            self.fail_link_between(a, b)
        elif kind == "promote":
            group = rng.choice(self.groups)
            serving = self.serving_groups[group]
            if serving is not None:
                target = rng.choice([n for n in self.cells[group] if n != serving.name])
                self.promote_group(serving, group, target)

    def promote_group(self, node: GroupNode, group: int, target: str) -> None:
        self.group_stable[group] = None  # a handover is an election on purpose
        try:
            node.ha.promote(group, target)
        except el.PromoteRefused as exc:
            self.note(f"promote {target} in group {group} refused: {exc}")
            return
        self.note(f"promote {target} in group {group} (from {node.name})")

    def crash_node(self, node: GroupNode, downtime: float) -> None:
        """The process dies: only the groups it led may elect (the others stay armed)."""
        led = self._disarm([node], "crashes_seen")
        for group in led:
            self.lost_primary.add(group)
        self.note(f"crash {node.name} for {downtime:.2f}s (led groups {led})")
        self.stats.crashes += 1
        node.up = False
        for member in node.ha.groups.values():
            for link in list(member.clients.connections):
                if isinstance(link, SimConnection) and link.open:
                    link.open = False
        self.disks[node.name] = node.store.disk
        for peer in self.names:
            if peer != node.name:
                self.seen[(node.name, peer)] = None
                self._fail_link_quietly(node.name, peer)
        self.after(downtime, lambda: self.restart(node.name))

    def _led_by(self, node: GroupNode) -> list[int]:
        return [g for g in self.groups if self.serving_groups[g] is node
                or (node.member(g) is not None and node.ha.groups[g].election.role == "primary")]

    def _disarm(self, hit: list[GroupNode], seen: str) -> list[int]:
        """A fault on ``hit`` (a crash or a pause of one node, a link between two): (f)
        stays armed in every group none of them leads that keeps a majority of its cells
        out of it (``seen`` counts those); the groups they led, disarmed, are returned."""
        names = {n.name for n in hit}
        led = sorted({g for n in hit for g in self._led_by(n)})
        for group in self.groups:
            cells = self.cells[group]
            left = [n for n in cells if n not in names and self.node(n).alive
                    and not self.node(n).paused]
            if group in led or 2 * len(left) <= len(cells):  # its primary, or its majority
                self.group_stable[group] = None
            elif self.group_stable[group] is not None:
                self.crash_victims[group].append("+".join(sorted(names)))
                self.counts[seen] += 1
        return led

    def pause_node(self, node: GroupNode, length: float) -> None:
        """SIGSTOP: only the groups the node led (or left without a majority) may elect."""
        self._disarm([node], "pauses_seen")
        self._chosen = True
        try:
            self.pause(cast(SimNode, node), length)
        finally:
            self._chosen = False

    def fail_link_between(self, a: str, b: str) -> None:
        """A link fails: only the groups either end led may elect (or that lose a majority:
        with three cells, never)."""
        self._disarm_link(a, b)
        self._chosen = True
        try:
            self.fail_link(a, b)
        finally:
            self._chosen = False

    def _disarm_link(self, a: str, b: str) -> None:
        led = set(self._led_by(self.node(a))) | set(self._led_by(self.node(b)))
        for group in self.groups:
            if group in led:
                self.group_stable[group] = None
            elif self.group_stable[group] is not None:
                self.crash_victims[group].append(f"{a}-{b}")
                self.counts["links_seen"] += 1

    def _fail_link_quietly(self, a: str, b: str) -> None:
        """``_fail_link`` without disarming every group (a crash chose which)."""
        link = self.links[frozenset((a, b))]
        link.gen += 1
        link.up = False
        lo, hi = self.faults.detect
        for me, peer in ((a, b), (b, a)):
            self.after(lo + (hi - lo) * self.rng.random(),
                       partial(self._notice_down, me, peer, link.gen))

    # -- the receiving side: (e) per group ---------------------------------------------------

    def _receive(self, node: SimNode, src: str, gen: int, msg_id: int, packet: Packet) -> None:
        if self.links[frozenset((src, node.name))].gen != gen:
            return
        gnode = cast(GroupNode, node)
        if type(packet) is Grouped and packet.code == Events.CODE:
            gnode.charge(len(packet.args[2]) * self.costs.event_applied)
            member = gnode.member(packet.group)
            backup = member.backup if member is not None else None
            before = backup.applied_seq if backup is not None else None
            epoch = int(packet.args[0])
            older = member is not None and epoch < member.election.epoch
            gnode.ha.on_message(src, msg_id, packet)
            if older and backup is not None and member is not None \
                    and member.backup is backup and backup.applied_seq != before:
                self.violate(f"(e) {node.name} applied events of group {packet.group}, epoch "
                             f"{epoch}, after adopting epoch {member.election.epoch}")
            return
        gnode.ha.on_message(src, msg_id, packet)

    # -- the clients -------------------------------------------------------------------------

    def _call(self, client: Client, work: Callable[[GroupNode, HAMember, SimConnection],
                                                   object]) -> None:
        conn = client.conn
        if conn is None or not conn.usable:
            client.conn = None
            if self.now - client.dialled_at > 0.05:
                client.dialled_at = self.now
                cells = self.cells[group_of(client.partition)]
                self.dial(self.rng.choice(cells), client, 0)
            return
        node = cast(GroupNode, conn.node)

        def call() -> None:
            member = node.member(group_of(client.partition))
            if conn.usable and member is not None:
                work(node, member, conn)

        node.run(call)

    def dial(self, name: str, client: Client, hops: int) -> None:
        """The client dials node ``name``; the node's admission of the partition's group
        serves it, relays it to the group's primary, or refuses it."""
        delay = self.faults.delay
        group = group_of(client.partition)

        def accept() -> None:
            node = self.node(name)
            member = node.member(group)
            if member is None:
                return
            following = member.core.following
            decision = member.clients.decide(following is not None)
            if decision is Admission.RELAY and following is not None and hops < 2:
                self.dial(following, client, hops + 1)
            elif decision is Admission.SERVE:
                conn = SimConnection(self, cast(SimNode, node))
                self.after(0.002 * self.rng.random(),
                           lambda: node.run(lambda: made(node, member, conn)))

        def made(node: GroupNode, member: HAMember, conn: SimConnection) -> None:
            if member.clients.admit(conn):
                conn.open = True
                if client.conn is None or not client.conn.usable:
                    client.conn = conn
                else:
                    conn.force_close()

        self.after(delay[0] + (delay[1] - delay[0]) * self.rng.random(),
                   lambda: self.node(name).run(accept))

    def client_queue(self, node: GroupNode, client: Client) -> Queue:
        vhost = node.broker.vhosts["/"]
        q = vhost.queues.get(client.queue)
        if q is None:
            q = vhost.declare_queue(client.queue, owner=None, durable=True)
        return q

    def _publish(self, client: Client) -> None:
        self.after(self.rng.expovariate(self.publish_rate), partial(self._publish, client))
        self._call(client, partial(self._publish_on, client))

    def _publish_on(self, client: Client, node: GroupNode, member: HAMember,
                    conn: SimConnection) -> None:
        node.charge(self.costs.client_op)
        self.next_id += 1
        mid = self.next_id
        self.counts["published"] += 1
        q = self.client_queue(node, client)
        q.enqueue(message(b"%d" % mid, client.queue, persistent=True))
        primary = member.primary
        group = group_of(client.partition)
        if primary is not None:
            log = self.logs[(group, primary.epoch)]
            log.held_at[mid] = primary.seq
            log.alive.add(mid)

        def confirmed() -> None:
            if not conn.usable:
                return
            self.counts["confirmed"] += 1
            client.confirmed += 1
            if mid not in self.consumed:
                client.confirmed_live.add(mid)
                self.check_confirmed(group, self.serving_groups[group])

        node.broker.after_durable_in(member.durability_gate, confirmed, member.barriers())

    def _consume(self, client: Client) -> None:
        self.after(self.rng.expovariate(self.consume_rate), partial(self._consume, client))
        self._call(client, partial(self._consume_on, client))

    def _consume_on(self, client: Client, node: GroupNode, member: HAMember,
                    conn: SimConnection) -> None:
        node.charge(self.costs.client_op)
        q = self.client_queue(node, client)
        entry = q.get()
        if entry is None:
            return
        q.settle(entry)
        mid = int(entry.message.body)
        self.counts["consumed"] += 1
        self.consumed.add(mid)
        client.confirmed_live.discard(mid)
        primary = member.primary
        if primary is not None:
            log = self.logs[(group_of(client.partition), primary.epoch)]
            log.gone_at.setdefault(mid, primary.seq)
            log.alive.discard(mid)


# ---- running many seeds ---------------------------------------------------------------------


def run_quietly(simulation: Callable[..., GroupSimulation], seed: int,
                **kw: Any) -> SimResult:
    """One seed of a groups world (this one or a subclass: forward, remote-consume), the
    product's warnings silenced (its faults make many)."""
    logging.disable(logging.WARNING)
    try:
        return simulation(seed, **kw).run()
    finally:
        logging.disable(logging.NOTSET)


def run_seeds(run_seed: Callable[..., SimResult], seeds: Sequence[int], *, jobs: int = 1,
              **kw: Any) -> list[SimResult]:
    """``run_seed`` (a module-level function: the seeds go to processes) of every seed; a
    result without a violation keeps no trace."""
    results: list[SimResult] = seed_runner.run_many(run_seed, seeds, jobs=jobs, **kw)
    for result in results:
        if result.violation is None:
            result.trace = []
    return results


def run_seed(seed: int, *, nodes: int = 3, duration: float = 30.0,
             faults: Faults | None = None, **kw: Any) -> SimResult:
    return run_quietly(GroupSimulation, seed, nodes=nodes, duration=duration, faults=faults,
                       **kw)


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    return run_seeds(run_seed, seeds, jobs=jobs, **kw)
