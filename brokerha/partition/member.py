"""A node of a partitioned cluster: one ``HAMember`` per replication group it is in.

Sans-I/O, as ``ha/member.py``: ``PartitionedMember`` is what a node's driver
(the simulation, ``partition/group_simulation.py``; later ``node/ha.py``)
drives when P > 1 (docs/ha.md "Partitions", stage 2). It holds:

- the **metadata group** (group 0): every node a member, today's election
  and figures; it replicates the definitions, exchanges and the bindings
  between exchanges (``GroupScope.configuration``), no queue;
- one group per **partition cell** the node holds (partition p is group
  p + 1): an ``HAMember`` whose ``Election`` has the partition's voting cells
  as members, whose ``HACore`` keeps its position under ``ha_position/<g>``,
  whose ``Primary`` observes and whose ``Backup`` applies only the queues of
  partition p (``GroupScope``: ``PartitionTable.partition_of`` of the queue's
  vhost, name and ``x-partition``), and whose ``ClientAdmission`` serves the
  clients of that partition's queues. They are made once the node holds a
  table (the metadata group's ``TableCoordinator`` brought it, or the store
  kept it): until then the node runs the metadata group alone.

Every group's packets go over the node pair's one link through the
``GroupMux`` (``mux.py``); a packet of a group this node is not in is
dropped. Each group's confirms pass its own gate (``HAMember.durability_gate``
with ``Broker.after_durable_in``): the serving primary of *that* group, in its
lease; the broker's own gate (``Broker.after_durable``) is the metadata
group's. So a partition's failover ends the role, the confirms and the client
connections of that partition only; the others never notice.

What the driver supplies is ``PartitionEffects``: ``ha/member.py``'s
``MemberEffects`` with the group named (``persist`` of a group's epoch and
vote, ``elected`` / ``serving`` / ``demoted`` of a group...). ``GroupEffects``
adapts one to the other for each group's member.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from brokerha.broker.broker import Broker
from brokerha.broker.placement import METADATA_GROUP, GroupScope, no_queues
from brokerha.broker.queue import Queue
from brokerha.cluster import election as el
from brokerha.cluster.messages import Message
from brokerha.cluster.partition_table import PartitionTable, PartitionTableError, hash_partition
from brokerha.cluster.state import NodeState
from brokerha.ha import admission
from brokerha.ha.core import (
    Cancellable,
    PrimarySettings,
    load_position,
    position_key,
    stored_position,
)
from brokerha.ha.core import Unsafe as CoreUnsafe
from brokerha.ha.member import HAMember, StoreLayer
from brokerha.ha.member import Unsafe as MemberUnsafe
from brokerha.partition.moves import (
    Membership,
    MembershipChanger,
    MembershipLayer,
    ReplicationDone,
    membership_of,
)
from brokerha.partition.moves import Unsafe as MovesUnsafe
from brokerha.partition.mux import GroupMux, MuxError, unwrap, wrap
from brokerha.primary.primary import Primary

log = logging.getLogger("brokerha.partition")

# a voter the table no longer places here that follows no primary for this many election
# timeouts leaves its group (``_leave_stale``)
STALE_AFTER = 3
PIN = "x-partition"  # the queue argument that pins a queue's partition (check_pin)


def group_of(partition: int) -> int:
    """Partition p's replication group (0 is the metadata group)."""
    return partition + 1


def partition_of_group(group: int) -> int:
    return group - 1


class PartitionEffects(Protocol):
    """What a partitioned member asks of its driver: ``MemberEffects``, per group."""

    def send(self, peer: str, message: Message) -> None:
        """Put a mux packet on the link to ``peer``."""

    def reply(self, peer: str, msg_id: int, message: Message) -> None: ...

    def connected(self, peer: str) -> bool: ...

    def peers_up(self) -> list[str]: ...

    def soon(self, callback: Callable[[], None]) -> None: ...

    def later(self, delay: float, callback: Callable[[], None]) -> Cancellable: ...

    def persist(self, group: int, epoch: int, voted_for: str | None) -> None:
        """Make group ``group``'s epoch and vote durable now."""

    def position(self, group: int, pos: el.Position) -> None:
        """Group ``group``'s position changed (durably); the member told its election."""

    def replication_failed(self, group: int, reason: str) -> None: ...

    def joined(self, group: int, primary: str, epoch: int) -> None: ...

    def elected(self, group: int, epoch: int, primary: Primary) -> None: ...

    def serving(self, group: int, epoch: int, decisions: dict[str, str]) -> None: ...

    def demoted(self, group: int, reason: str) -> None: ...

    def follow(self, group: int, primary: str, epoch: int) -> None: ...


class GroupEffects:
    """One group's ``MemberEffects``: its packets through the mux, its events named."""

    def __init__(self, group: int, members: Sequence[str], effects: PartitionEffects,
                 mux: GroupMux, states: dict[int, NodeState] | None = None) -> None:
        self.group = group
        self.states = states  # the node's epoch and vote per group, kept as persisted
        self.members = frozenset(members)
        self.effects = effects
        self.mux = mux
        self.member: HAMember | None = None  # set once made (the member takes its effects)

    # -- ha.core.Effects --

    def send(self, peer: str, message: Message) -> None:
        self.mux.send(self.group, peer, message)

    def send_many(self, peer: str, messages: Sequence[Message]) -> None:
        for message in messages:
            self.mux.send(self.group, peer, message)

    def connected(self, peer: str) -> bool:
        return self.effects.connected(peer)

    def position(self, pos: el.Position) -> None:
        member = self.member
        assert member is not None
        member.carry_out(member.election.set_position(pos))
        self.effects.position(self.group, pos)

    def soon(self, callback: Callable[[], None]) -> None:
        self.effects.soon(callback)

    def later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        return self.effects.later(delay, callback)

    def replication_failed(self, reason: str) -> None:
        self.effects.replication_failed(self.group, reason)

    def joined(self, primary: str, epoch: int) -> None:
        self.effects.joined(self.group, primary, epoch)
        if self.member is not None:
            self.member.joined()

    # -- ha.member.MemberEffects --

    def persist(self, epoch: int, voted_for: str | None) -> None:
        if self.states is not None:  # a group made again in this process starts from it
            self.states[self.group] = dataclasses.replace(
                self.states.get(self.group, NodeState()), epoch=epoch, voted_for=voted_for)
        self.effects.persist(self.group, epoch, voted_for)

    def reply(self, peer: str, msg_id: int, message: Message) -> None:
        self.effects.reply(peer, msg_id, wrap(self.group, message))

    def peers_up(self) -> list[str]:
        return [p for p in self.effects.peers_up() if p in self.members]

    def elected(self, epoch: int, primary: Primary) -> None:
        self.effects.elected(self.group, epoch, primary)

    def serving(self, epoch: int, decisions: dict[str, str]) -> None:
        self.effects.serving(self.group, epoch, decisions)

    def demoted(self, reason: str) -> None:
        self.effects.demoted(self.group, reason)

    def follow(self, primary: str, epoch: int) -> None:
        self.effects.follow(self.group, primary, epoch)


@dataclasses.dataclass(frozen=True)
class GroupUnsafe:
    """The rules to break on purpose in every group's member (simulations only)."""

    member: MemberUnsafe | None = None
    core: CoreUnsafe | None = None
    election: el.Unsafe | None = None
    admission: admission.Unsafe | None = None
    moves: MovesUnsafe | None = None


class PartitionScope:
    """Which partition a queue is in (``PartitionTable.partition_of``), remembered per
    queue name and pin: every group's ``Primary`` asks on every enqueue."""

    def __init__(self, table: PartitionTable) -> None:
        self.table = table
        self._known: dict[tuple[str, str, object, type], int] = {}

    def partition(self, queue: Queue) -> int | None:
        """``queue``'s partition; None for an exclusive queue (in none: not replicated)."""
        if queue.exclusive_owner is not None:
            return None
        return self.of_name(queue.vhost, queue.name, queue.arguments.get(PIN))

    def of_name(self, vhost: str, name: str, pin: object) -> int:
        """The partition of a (non-exclusive) queue of that name and pin, declared or not
        (asked on every publish: one lookup when known; the pin's type in the key: a
        decimal pin equal to an int one is no pin, ``_first``)."""
        try:
            return self._known[(vhost, name, pin, type(pin))]
        except (KeyError, TypeError):  # not asked yet, or an unhashable pin
            return self._first(vhost, name, pin)

    def _first(self, vhost: str, name: str, pin: object) -> int:
        if not isinstance(pin, int | float | str | bytes | None):  # a table, a list: no pin
            return hash_partition(vhost, name, self.table.partitions)
        try:
            p = self.table.partition_of(vhost, name, pin)
        except PartitionTableError:  # a pin out of range: stage 3 refuses it at declare
            p = hash_partition(vhost, name, self.table.partitions)
        self._known[(vhost, name, pin, type(pin))] = p
        return p

    def of(self, partition: int) -> Callable[[Queue], bool]:
        def holds(queue: Queue) -> bool:
            return self.partition(queue) == partition

        return holds


class PartitionedMember:
    """The node's groups: the metadata ``HAMember`` and one per cell the node holds."""

    def __init__(self, broker: Broker, me: str, nodes: Sequence[str],
                 table: PartitionTable | Callable[[], PartitionTable],
                 states: dict[int, NodeState], effects: PartitionEffects,
                 settings: PrimarySettings, clock: Callable[[], float], *,
                 timing: el.ElectionTiming, verification_timeout: float,
                 rng: Callable[[int], random.Random] | None = None,
                 primary_factory: Callable[..., Primary] = Primary,
                 unsafe: GroupUnsafe | None = None,
                 layers: Sequence[StoreLayer] = (),
                 preferred_first: float = 0.0) -> None:
        """``table``: the partition table, or where to read the node's copy (the metadata
        group's ``TableCoordinator``: the partition groups are made once it holds one).
        ``states``: each group's epoch and vote (the state file's; absent: none yet); the
        positions are read from the store. ``rng(group)``: each election's.
        ``preferred_first``: a partition group's first campaign on a cell that is not the
        partition's preferred leader (``PartitionTable.preferred_leader``) waits that much
        longer, so the preferred cells, spread over the nodes by the placement, stand
        first when a cluster starts (node/ha_groups.py; 0: whoever stands first, as the
        simulation runs). Only a start's first campaign: after a failover the leader
        stays where it was elected (moving it back is stage 5's ``balance``)."""
        self.broker = broker
        self.me = me
        self.clock = clock
        self.effects = effects
        self.mux = GroupMux(effects.send, effects.soon)
        self._table_of = table if callable(table) else (lambda: table)
        self.table: PartitionTable | None = None  # the one the partition groups were made of
        self.placement: PartitionScope | None = None
        self._states = dict(states)  # kept up to date as each group persists (stage 5)
        self._settings = settings
        self._timing = timing
        self._verification_timeout = verification_timeout
        self._rng = rng
        self._primary_factory = primary_factory
        self._unsafe = unsafe or GroupUnsafe()
        self._preferred_first = preferred_first
        self.groups: dict[int, HAMember] = {}
        self.members: dict[int, tuple[str, ...]] = {}
        # stage 5 (partition/moves.py): each partition group's membership (its ``pm``) and,
        # while this node leads it, the walk towards the table's row
        self.memberships: dict[int, MembershipLayer] = {}
        self.changers: dict[int, MembershipChanger] = {}
        #: learners caught up, seen as a group's primary (NEO's ReplicationDone): the
        #: driver hands them to the coordinator (``moves.Mover``)
        self.replication_done: dict[tuple[int, str], ReplicationDone] = {}
        self.dropped = 0  # partition groups this node left (its cell moved away)
        self._cells: set[int] = set()  # the partitions the table places here
        self._unfollowed: dict[int, float] = {}  # a group the table left: following none since
        #: told of each membership this node appends as a group's primary (group, the one
        #: before, the new one): the simulation's single-cell check
        self.emitted: Callable[[int, Membership, Membership], None] | None = None
        #: told of a partition whose group starts here, before it is made (the queue
        #: directory's stand-ins of it go: partition/directory.py)
        self.group_adding: Callable[[int], None] | None = None
        self._add_group(METADATA_GROUP, tuple(nodes), GroupScope(METADATA_GROUP, no_queues, True),
                        layers)
        self._partition_groups()

    def _partition_groups(self) -> list[HAMember]:
        """Make the partition groups from the table, once the node holds one (its groups
        are those of its voting cells); the members made."""
        if self.table is not None:
            return []
        current = self._table_of()
        if not current.exists:
            return []
        table = self.table = PartitionTable(current.ptid, current.num_replicas, current.rows)
        self.placement = PartitionScope(table)
        self._cells = set(table.cells_of(self.me))
        self._drop_uncelled()
        made = [self._add_partition(p) for p in sorted(self._cells)]
        log.info("node %s: partition table ptid %d: %d partition groups (%s)", self.me,
                 table.ptid, len(made), ", ".join(str(m.core.scope) for m in made))
        return made

    def _drop_uncelled(self) -> None:
        """At the start (the node's first table): the store's queues of a partition this
        node holds no cell of go, and that group's stored position is made invalid -- its
        group left before a crash whose store had not synced the deletion yet (the moves
        simulation's seed 133), or the cell moved away while the node was down. Fail
        closed: a queue is served only by a node running its partition's group, and a
        later cell here catches up whole."""
        changed = False
        for p in range(self.table.partitions if self.table is not None else 0):
            if p in self._cells:
                continue
            removed = self._remove_queues(p)
            key = position_key(GroupScope(group_of(p), no_queues, False))
            raw = self.broker.store.get_meta(key)
            if raw is not None:
                pos_epoch, _, floor_epoch, floor_seq = stored_position(raw)
                if pos_epoch >= 0:
                    self.broker.store.put_meta(key, json.dumps([-1, -1, floor_epoch, floor_seq]))
                    changed = True
            if removed:
                changed = True
                log.warning("node %s: no cell of partition %d (table ptid %d): its %d "
                            "queue(s) in the store dropped", self.me, p,
                            self.table.ptid if self.table is not None else 0, removed)
        if changed:  # a start with nothing to drop asks nothing (the simulations' courses)
            self._durable("the queues of partitions without a cell here dropped")

    def _remove_queues(self, p: int) -> int:
        """Delete partition ``p``'s queues held here (the store's too); how many."""
        placement, removed = self.placement, 0
        if placement is None:
            return 0
        for vhost in list(self.broker.vhosts.values()):
            for q in list(vhost.queues.values()):
                if placement.partition(q) == p:
                    vhost.remove_queue(q)
                    removed += 1
        return removed

    def _durable(self, what: str) -> None:
        """Ask the store to sync what was just recorded (a deletion waits for no other
        write: a crash before the next one would bring the queues back)."""
        self.broker.store.after_sync(lambda: log.debug("node %s: %s, durable", self.me, what))

    def _add_partition(self, p: int) -> HAMember:
        """Partition ``p``'s group on this node (a cell of it): its membership the one the
        store holds (the latest ``pm`` applied here), else the table's row; a learner if
        this node is not one of its voters."""
        table, placement = self.table, self.placement
        assert table is not None and placement is not None
        if self.group_adding is not None:  # the queue directory's stand-ins of p go first
            self.group_adding(p)
        group = group_of(p)
        initial = membership_of(table, p)
        layer = MembershipLayer(group, self.broker.store, initial,
                                lambda m: self._membership_changed(group, m),
                                lambda: self._table_of().ptid)
        if self.me not in layer.membership.everyone:  # moved away and back: the row's
            layer.membership = initial
        if self.me not in layer.membership.everyone:  # the row lists this node: a learner
            layer.membership = Membership(initial.ptid, initial.voters,
                                          (*initial.learners, self.me))
        layer.emitted = lambda old, new: self._emitted(group, old, new)
        self.memberships[group] = layer
        self.changers[group] = MembershipChanger(p, self.me, self._unsafe.moves or MovesUnsafe())
        m = layer.membership
        return self._add_group(group, m.voters, GroupScope(group, placement.of(p), False),
                               [layer], m.learners)

    def _add_group(self, group: int, members: tuple[str, ...], scope: GroupScope,
                   layers: Sequence[StoreLayer], learners: Sequence[str] = ()) -> HAMember:
        unsafe = self._unsafe
        state = dataclasses.replace(self._states.get(group, NodeState()))
        load_position(self.broker, state, position_key(scope))
        group_effects = GroupEffects(group, (*members, *learners), self.effects, self.mux,
                                     self._states)
        member = HAMember(
            self.broker, self.me, list(members), state, group_effects,
            dataclasses.replace(self._settings, members=len(members)), self.clock,
            timing=self._timing, verification_timeout=self._verification_timeout,
            rng=self._rng(group) if self._rng is not None else None,
            primary_factory=self._primary_factory, unsafe=unsafe.member,
            core_unsafe=unsafe.core, election_unsafe=unsafe.election,
            admission_unsafe=unsafe.admission, layers=layers, scope=scope,
            gate=group == METADATA_GROUP, learners=learners)
        group_effects.member = member
        self.groups[group] = member
        self.members[group] = (*members, *learners)
        return member

    # -- stage 5: memberships, moves (partition/moves.py) --------------------------------

    def _membership_changed(self, group: int, m: Membership) -> None:
        """A ``pm`` appended here (emitted as primary, applied as backup, a catch-up's):
        the group runs ``m`` from now on this node."""
        member = self.groups.get(group)
        if member is None:
            return
        everyone = m.everyone
        self.members[group] = everyone
        effects = member.effects
        if isinstance(effects, GroupEffects):
            effects.members = frozenset(everyone)
        primary = member.primary
        election = member.election
        moves = self._unsafe.moves
        counted = m.voters + (m.learners if moves is not None and moves.learner_confirms else ())
        if primary is not None:
            primary.voters = frozenset(counted)
            primary.members = len(m.voters)
        if self.me not in everyone:
            log.warning("node %s leaves group %d: %s", self.me, group, m)
            self.effects.soon(lambda: self._drop(group))
            return
        member.carry_out(election.reconfigure(m.voters, m.learners))

    def _emitted(self, group: int, old: Membership, new: Membership) -> None:
        if self.emitted is not None:
            self.emitted(group, old, new)

    def _table_changed(self) -> None:
        """The node's table moved on (a ``pt``, a catch-up's ``ps``): a new cell of this node
        starts its group (as a learner, until its group makes it a voter). A group whose
        row no longer lists this node goes when its own ``pm`` removes the node
        (``_membership_changed``), or now if the node follows no primary in it."""
        table = self.table
        if table is None:
            return
        current = self._table_of()
        if current.ptid == table.ptid and current.rows == table.rows:
            return
        table.replace(PartitionTable(current.ptid, current.num_replicas, current.rows))
        self._cells = set(table.cells_of(self.me))
        for p in sorted(self._cells):
            group = group_of(p)
            if group not in self.groups:
                log.warning("node %s: a cell of partition %d (table ptid %d): its group "
                            "starts here", self.me, p, table.ptid)
                self._start(group, self._add_partition(p))

    def _leave_stale(self) -> None:
        """Each tick: a group of a partition the table no longer places here that follows
        no primary goes (see ``_table_changed``)."""
        if self.table is None or len(self.groups) - 1 <= len(self._cells):
            return
        cells, now = self._cells, self.clock()
        for group in sorted(self.groups):
            if group == METADATA_GROUP or partition_of_group(group) in cells:
                self._unfollowed.pop(group, None)
                continue
            election = self.groups[group].election
            layer = self.memberships.get(group)
            if election.role not in ("joining", "candidate") \
                    or (layer is not None and self.me not in layer.membership.voters):
                self._unfollowed.pop(group, None)  # following, or a learner: its pm decides
                continue
            # the group removes a leaving voter by its own ``pm``, which a node cut off then
            # never gets: one that followed no primary for a while goes by the table (it
            # acknowledges nothing, so no confirm waits for it). Not at once: a leader that
            # just handed over is still a voter its successor's election may need
            since = self._unfollowed.setdefault(group, now)
            if now - since >= STALE_AFTER * election.timing.election_timeout:
                self._drop(group)

    def _drop(self, group: int) -> None:
        """This node leaves partition ``group``'s group: its member stops, the partition's
        queues held here go (a later cell here is a learner again, caught up anew)."""
        member = self.groups.get(group)
        if member is None or group == METADATA_GROUP:
            return
        if member.primary is not None:
            member.carry_out([el.StopServing("its cell moved away", "transfer")])
        core = member.core
        if core.state.pos_epoch >= 0:
            core.invalidate_position()  # its queues go: a later cell here catches up whole
        if core.backup is not None:
            core.backup.close()
            core.backup = None
        core.following = None
        core.demote()
        del self.groups[group]
        del self.members[group]
        self._unfollowed.pop(group, None)
        self.memberships.pop(group, None)
        self.changers.pop(group, None)
        self.dropped += 1
        self._remove_queues(partition_of_group(group))
        # durable now: the deletion and the invalid position would otherwise wait for
        # the store's next write, and a crash before it brought the queues back (seed 133)
        self._durable(f"the group of partition {partition_of_group(group)} left")
        log.warning("node %s left the group of partition %d", self.me, partition_of_group(group))

    def _moves(self) -> None:
        """Each group this node serves as primary walks its membership towards the row."""
        table = self.table
        if table is None:
            return
        reports: dict[tuple[int, str], ReplicationDone] = {}
        for group, changer in list(self.changers.items()):
            member = self.groups.get(group)
            layer = self.memberships.get(group)
            if member is None or layer is None or member.phase != "primary" \
                    or member.term() is None:
                continue
            handover, done = changer.step(layer, table)
            for report in done:
                reports[(report.partition, report.node)] = report
            if handover is not None:
                try:
                    member.promote(handover.target)
                    log.warning("node %s hands group %d over to %s: it leaves the voters",
                                self.me, group, handover.target)
                except el.PromoteRefused as exc:
                    log.info("node %s: handover of group %d to %s refused: %s", self.me,
                             group, handover.target, exc)
        self.replication_done = reports  # as of this tick: a stale report never stays

    def _new_groups(self) -> None:
        """After an input: the table arrived (the metadata log's ``pt``/``ps``)? Its groups
        start now."""
        if self.table is None:
            made = self._partition_groups()
            for group, member in list(self.groups.items()):
                if member in made:
                    self._start(group, member)
        else:
            self._table_changed()

    # -- reading -------------------------------------------------------------------------

    @property
    def metadata(self) -> HAMember:
        return self.groups[METADATA_GROUP]

    def led(self) -> list[int]:
        """The groups this node is the verified primary of (lease valid or lapsed)."""
        return [g for g, m in self.groups.items() if m.role_term() is not None]

    def status(self) -> dict[str, object]:
        """Per group: its role, epoch and primary (``ctl status`` will show it)."""
        out: dict[str, object] = {}
        for group, member in sorted(self.groups.items()):
            election = member.election
            entry = {**member.status(), "epoch": election.epoch,
                     "primary": election.primary, "members": list(election.members)}
            if election.learners:
                entry["learners"] = list(election.learners)
            out[str(group)] = entry
        return out

    # -- inputs (as HAMember's) ----------------------------------------------------------

    def start(self) -> None:
        """The groups start. A node's shell recovers its store after making this object
        (node/server.py: the broker is restored in its ``start``): the queues of partitions
        without a cell here are dropped again now, over what was recovered."""
        if self.table is not None:
            self._drop_uncelled()
        for group, member in self.groups.items():
            self._start(group, member)
        self.mux.flush()

    def _start(self, group: int, member: HAMember) -> None:
        """``HAMember.start``, a cell that is not the partition's preferred leader standing
        ``preferred_first`` later (``Election.start``'s delay)."""
        table, delay = self.table, 0.0
        if group != METADATA_GROUP and table is not None and self._preferred_first \
                and table.preferred_leader(partition_of_group(group)) != self.me:
            delay = self._preferred_first
        member.carry_out(member.election.start(self.clock(), delay))

    def tick(self) -> None:
        """Every group's tick; then, if any group's heartbeat went out, every other group
        this node leads beats too (``Election.heartbeat_now``): from then on their
        heartbeats fall due in the same ticks, one bundle per peer."""
        self._new_groups()
        self._leave_stale()
        started = self.clock()
        for member in list(self.groups.values()):
            member.tick()
        self._moves()
        leading = [m for m in self.groups.values() if m.election.role == "primary"]
        if any(m.election.last_heartbeat >= started for m in leading):
            now = self.clock()
            for member in leading:
                if member.election.last_heartbeat < started:
                    member.carry_out(member.election.heartbeat_now(now))
        self.mux.flush()

    def peer_up(self, peer: str) -> None:
        for group, member in list(self.groups.items()):
            if peer in self.members[group]:
                member.peer_up(peer)
        self.mux.flush()

    def peer_down(self, peer: str) -> None:
        for group, member in list(self.groups.items()):
            if peer in self.members[group]:
                member.peer_down(peer)
        self.mux.flush()

    def on_message(self, peer: str, msg_id: int, packet: Message) -> None:
        """A mux packet from ``peer``: each group's packet to that group's member."""
        try:
            parts = unwrap(peer, packet)
        except (MuxError, TypeError, ValueError) as exc:
            log.warning("node %s: bad packet from %s: %s", self.me, peer, exc)
            return
        for group, message in parts:
            member = self.groups.get(group)
            if member is None or peer not in self.members[group]:
                continue  # not a group of ours (stage 5: a cell moved away meanwhile)
            member.on_message(peer, msg_id, message)
        self._new_groups()
        self.mux.flush()

    def promote(self, group: int, target: str) -> None:
        """Manual failover of one group (``el.PromoteRefused`` says why not)."""
        member = self.groups.get(group)
        if member is None:
            raise el.PromoteRefused(f"{self.me} is not a member of group {group}")
        member.promote(target)
        self.mux.flush()
