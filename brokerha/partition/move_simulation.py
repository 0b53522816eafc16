"""Moving partitions under faults, simulated (issue 35, stage 5): ``--workload moves``.

The groups world (``group_simulation.py``: every node the product's
``PartitionedMember`` over its broker, one client per partition publishing
with confirms and consuming, crashes, pauses, link failures, partitions,
spiked packets, manual failovers) with an **operator** too: every few
seconds it drains a node (``ctl partitions drain NODE``) or undrains the one
drained before (cells moved back onto it). The coordinator's side is the
product's ``moves.Mover``, stepped every tick on the serving metadata primary
with what it can see (each partition group's membership as its serving primary
runs it, the ``ReplicationDone`` reports of the nodes linked to it), its
changes applied through that node's ``TableCoordinator``; the groups' side is
the product's ``MembershipChanger`` in every node's ``PartitionedMember``
(learners, ``pm`` events, handovers, a cell's group dropped).

Checked, beside the groups world's (a)-(h) per group:

- (i) every membership a group's primary appends differs from the one it ran
  by at most one voter (``Unsafe.two_cells`` breaks it);
- (j) a drain that finished leaves its node holding no cell: the table has
  none, and once settled (``SETTLE_TIMEOUTS``) no group's serving primary counts it,
  and the node (if up, and no random fault ran within the settle time and a fault's
  longest effect: a node cut off hears its removal only once back) holds no
  partition group and no partition queue;
- (c) across moves: a group whose membership changed still holds every
  confirmed message (``Unsafe.learner_confirms``: confirms counted with a
  learner's acknowledgement are lost when the voters elect without it).

Scripted cases (``script``): one drain of the node leading partition 0 at
``SCRIPT_AT``, no random faults, and a failure at one point of its first
move -- ``pt`` (the group's leader crashes right after the coordinator's
``pt``, before any ``pm``), ``pm`` (right after the leader appends the
learner's ``pm``, uncommitted), ``done`` (right after the coordinator's
``replicated``), ``remove`` (right after the ``pm`` removing the drained
cell), ``coordinator`` (the metadata primary crashes after the ``pt``);
``stop`` (the drained node is stopped once the drain is over: no group
elects). ``cut`` (the leader's links to the two other voters fail as it
reports its learner caught up: it confirms nothing more unless a learner
counts, ``learner_confirms``) and ``split`` (the same as it appends its first
change of voters: with ``two_cells`` its new voter set is a majority of its
own without them, and it serves on beside the primary they elect) show the
two unsafe rules by their effects, not only by (i). ``stall`` (``LEARNER_SCRIPTS``:
its drain does not finish) shows ``learner_confirms``: once the learner caught up
the coordinator is held (it stays a learner) and the two other voters' disks
stall -- they renew the lease but acknowledge nothing and leave the guarded set
after ``backup_timeout`` --, then they and the leader crash: counted, the
learner's acknowledgements confirmed what the two, restarted, elect without (c).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from brokerha.cluster.partition_table import PartitionTable, PartitionTableError
from brokerha.ha.member import TICK
from brokerha.ha.simulation.world import Faults
from brokerha.ha.simulation.world import Unsafe as WorldUnsafe
from brokerha.partition.group_simulation import (
    GroupNode,
    GroupSimulation,
    SimResult,
    run_quietly,
    run_seeds,
)
from brokerha.partition.member import STALE_AFTER, GroupUnsafe, group_of, partition_of_group
from brokerha.partition.moves import (
    Change,
    Finished,
    Membership,
    Mover,
    ReplicationDone,
    membership_of,
    voter_changes,
)
from brokerha.partition.moves import Unsafe as MovesUnsafe

__all__ = ["CATCHES", "LEARNER_SCRIPTS", "SCRIPTS", "MoveSimulation", "SimResult", "Unsafe", "run_many",
           "run_seed"]

CATCHES = ("two_cells",)  # (i) in any run that moves a cell; (c) in the script "split"


@dataclass(frozen=True)
class Unsafe(WorldUnsafe):
    """The HA rules of the groups world and the moves' own (``moves.Unsafe``), by name for
    ``brokerha cluster simulate --workload moves --unsafe``."""

    two_cells: bool = False
    learner_confirms: bool = False

    def moves(self) -> MovesUnsafe:
        return self._part(MovesUnsafe)  # type: ignore[no-any-return]

# after a drain finished (or the drained node resumed from a pause), the groups drop the
# node within this many election timeouts: a node cut off when the pm removing it went out
# leaves by the table once it followed no primary for STALE_AFTER of them (member.py)
SETTLE_TIMEOUTS = STALE_AFTER + 3
MOVES_EVERY = (2.0, 5.0)  # the operator's next drain or undrain, after the last finished
SCRIPT_AT = 2.0
SCRIPTS = ("pt", "pm", "done", "remove", "coordinator", "stop", "cut", "split")
# a script whose drain does not finish (its coordinator is held): the learner's case
LEARNER_SCRIPTS = ("stall",)


class MoveNode(GroupNode):
    def _sync_wanted(self) -> None:
        """A stalled disk (the script ``stall``): its syncs complete only once it ends."""
        until = cast("MoveSimulation", self.sim).disk_stalled.get(self.name, 0.0)
        if until <= self.sim.now:
            super()._sync_wanted()
        elif not self.sync_pending:
            self.sync_pending = True
            self.world.after(until - self.sim.now + self.world.fsync_delay(), self._sync)

    def demoted(self, group: int, reason: str) -> None:
        """(f) counts a step-down of the group's cells only: a removed cell's (its links cut
        by a script, a zombie) changes nothing in the group."""
        sim = self.sim
        if group == 0 or self.name in sim.cells[group]:
            super().demoted(group, reason)
        else:
            sim.note(f"{self.name} stops serving group {group}, no longer a cell: {reason}")


class MoveSimulation(GroupSimulation):
    node_class = MoveNode
    def __init__(self, seed: int, *, nodes: int = 4, partitions: int = 4, replicas: int = 2,
                 moves_unsafe: MovesUnsafe | None = None, script: str | None = None,
                 single_cell_check: bool = True, **kw: Any) -> None:
        """``single_cell_check`` False: (i) left out, to see what a two-cell change does."""
        if script is not None:
            if script not in SCRIPTS + LEARNER_SCRIPTS:
                raise ValueError(f"no script {script!r} "
                                 f"({', '.join(SCRIPTS + LEARNER_SCRIPTS)})")
            kw["faults"] = Faults(rate=0.0, spike_p=0.0)
            kw.setdefault("publish_rate", 10.0 if script in ("cut", "split", "stall") else 4.0)
        unsafe = kw.get("unsafe")
        self.moves_unsafe = moves_unsafe or (unsafe.moves() if isinstance(unsafe, Unsafe)
                                             else MovesUnsafe())
        super().__init__(seed, nodes=nodes, partitions=partitions, replicas=replicas, **kw)
        self.script = script
        self.single_cell_check = single_cell_check
        self.mover: Mover | None = None
        self.drained: str | None = None
        self.tables = [self.table.rows]  # every table the coordinators made (for (h))
        self.first_move: int | None = None  # the partition of the script's first move
        self.fired = False
        self.settle_due: float | None = None
        self.stopped_epochs: dict[int, int] | None = None
        self.stop_check_at = 0.0
        self.settle = SETTLE_TIMEOUTS * self.timing.election_timeout
        self.last_fault_at = -1e9  # the last random fault's start (j: the node's own side)
        self.disk_stalled: dict[str, float] = {}  # node -> its syncs complete from then on
        self.coordinator_held = False  # the script ``stall``: the Mover is not stepped

    def group_unsafe(self) -> GroupUnsafe:
        return replace(super().group_unsafe(), moves=self.moves_unsafe)

    def restart(self, name: str) -> None:
        super().restart(name)
        self.node(name).ha.emitted = (
            lambda group, old, new: self._emitted(name, group, old, new))

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> SimResult:
        if self.script is not None:
            self.after(SCRIPT_AT, self._scripted_drain)
        else:
            self.after(self.rng.uniform(*MOVES_EVERY), self._operate)
        self.after(TICK, self._drive)
        return super().run()

    def _operate(self) -> None:
        if self.mover is not None:
            return  # the next one once this finished (``_drive``)
        if self.settle_due is not None:  # (j) of the last drain first
            self.after(self.settle_due - self.now + TICK, self._operate)
            return
        if self.drained is None:
            node = self.rng.choice(self.names)
            self.mover = Mover(node, self.names)
            self.note(f"operator: drain {node}")
            self.counts["drains"] += 1
        else:
            node, self.drained = self.drained, None
            self.mover = Mover(node, self.names, undrain=True)
            self.note(f"operator: undrain {node}")
            self.counts["undrains"] += 1

    def _scripted_drain(self) -> None:
        leader = self.serving_groups[group_of(0)]
        node = leader.name if leader is not None else self.names[0]
        self.mover = Mover(node, self.names)
        self.counts["drains"] += 1
        self.note(f"operator: drain {node} (script {self.script})")

    def _drive(self) -> None:
        """The coordinator's tick: the Mover stepped on the serving metadata primary."""
        self.after(TICK, self._drive)
        self._settled()
        mover = self.mover
        coord = self.serving_groups[0]
        if mover is None or coord is None or not coord.alive or coord.paused:
            return
        coordinator = coord.coordinator
        if coordinator.primary is None:
            return
        table = coordinator.table
        memberships: dict[int, Membership | None] = {}
        for p in range(self.partitions):
            leader = self.serving_groups[group_of(p)]
            if leader is not None and (leader is coord or self.connected(coord.name,
                                                                         leader.name)):
                layer = leader.ha.memberships.get(group_of(p))
                memberships[p] = layer.membership if layer is not None else None
        done: list[ReplicationDone] = []
        for node in self.group_nodes():
            if node.alive and not node.paused and (node is coord
                                                   or self.connected(coord.name, node.name)):
                done.extend(node.ha.replication_done.values())
        if self.script in ("cut", "stall") and not self.fired and self.first_move is not None:
            leader = self.serving_groups[group_of(self.first_move)]
            if leader is not None and any(p == self.first_move
                                          for p, _ in leader.ha.replication_done):
                layer = leader.ha.memberships[group_of(self.first_move)]
                if self.script == "cut":
                    self._cut(layer.membership)  # its learner caught up: counted if unsafe
                else:
                    self._stall(leader, layer.membership)
                return
        if self.coordinator_held:
            return
        step = mover.step(table, memberships, done)
        if isinstance(step, Finished):
            self._finished(mover, table, step)
        elif isinstance(step, Change):
            self._change(coord, step)

    def _change(self, coord: GroupNode, step: Change) -> None:
        try:
            coord.coordinator.change(step.change)
        except PartitionTableError as exc:
            self.note(f"coordinator {coord.name}: {step.why}: refused ({exc})")
            return
        self.counts["table_changes"] += 1
        table = PartitionTable(coord.coordinator.table.ptid, coord.coordinator.table.num_replicas,
                               coord.coordinator.table.rows)
        self.tables.append(table.rows)
        self.note(f"coordinator {coord.name}: {step.why} (ptid {table.ptid}: "
                  f"{' '.join(map(str, table.rows[step.partition]))})")
        self.group_stable[group_of(step.partition)] = None  # a move may hand over
        if self.script is None or self.fired:
            return
        if self.first_move is None:
            self.first_move = step.partition
        if step.partition != self.first_move:
            return
        if self.script == "pt" and "->" in step.why:
            self._fire("after the pt")
        elif self.script == "coordinator" and "->" in step.why:
            self.fired = True
            self.note("script: crash the coordinator after the pt")
            self.crash_node(coord, 1.0)
        elif self.script == "done" and "caught up" in step.why:
            self._fire("after the coordinator's replicated")

    def _fault(self) -> None:
        self.last_fault_at = self.now
        super()._fault()

    def _emitted(self, name: str, group: int, old: Membership, new: Membership) -> None:
        """(i), and the scripts' failures at a ``pm``."""
        self.counts["memberships"] += 1
        if voter_changes(old, new) > 1 and self.single_cell_check:
            self.violate(f"(i) {name}, primary of group {group}, appended {new} over {old}: "
                         f"{voter_changes(old, new)} voters changed at once")
        self.note(f"{name} appends group {group}'s membership: {new}")
        if self.script is None or self.fired or self.first_move is None \
                or partition_of_group(group) != self.first_move:
            return
        added = set(new.everyone) - set(old.everyone)
        removed = set(old.voters) - set(new.voters)
        if self.script == "pm" and added:
            self.after(0.0, lambda: self._fire("after the learner's pm"))
        elif self.script == "remove" and removed:
            self.after(0.0, lambda: self._fire("after the pm removing a voter"))
        elif self.script == "split" and set(new.voters) != set(old.voters):
            self.after(0.0, lambda: self._cut(old))

    def _fire(self, when: str) -> None:
        """Crash the leader of the script's partition now."""
        if self.fired or self.first_move is None:
            return
        self.fired = True
        leader = self.serving_groups[group_of(self.first_move)]
        if leader is None or not leader.alive:
            self.note(f"script: no leader of partition {self.first_move} to crash {when}")
            return
        self.counts["scripted_crashes"] += 1
        self.note(f"script: crash {leader.name}, leader of partition {self.first_move}, {when}")
        self.crash_node(leader, 1.0)

    def _cut(self, old: Membership) -> None:
        """The leader's links to the voters of its membership ``old`` fail (not to a node
        the new one adds): what it does next rests on the new membership alone."""
        if self.fired or self.first_move is None:
            return
        group = group_of(self.first_move)
        leader = self.serving_groups[group]
        layer = leader.ha.memberships.get(group) if leader is not None else None
        if leader is None or layer is None:
            return
        self.fired = True
        others = [n for n in old.voters if n != leader.name]
        self.note(f"script: links {leader.name}-{'/'.join(others)} fail (learners "
                  f"{layer.membership.learners} follow)")
        for other in others:
            self.fail_link_between(leader.name, other)

    def _stall(self, leader: GroupNode, running: Membership) -> None:
        """The script ``stall``: the learner caught up and stays one (the coordinator is
        held: no ``replicated``); the other voters' disks stall -- they still answer
        heartbeats (the leader's lease holds) but acknowledge no event, and leave the
        guarded set after ``backup_timeout``. Safe, nothing is confirmed from then on (a
        majority of the voters is the leader and one of them); with ``learner_confirms``
        the leader and the learner confirm. Then the stalled voters crash (their unsynced
        events lost) and the leader with them for good: the two elect without what was
        confirmed meanwhile, (c)."""
        self.fired = True
        self.coordinator_held = True
        others = [n for n in running.voters if n != leader.name]
        wait = self.backup_timeout + 1.0
        for name in others:
            self.disk_stalled[name] = self.now + wait + 1.0
        self.note(f"script: the disks of {'/'.join(others)} stall (learners "
                  f"{running.learners} follow {leader.name}); the coordinator is held")

        def crash() -> None:
            self.note(f"script: crash {leader.name} and {'/'.join(others)}")
            self.counts["scripted_crashes"] += 1
            if leader.alive:
                self.crash_node(leader, self.duration)
            for name in others:
                node = self.node(name)
                if node.alive:
                    self.crash_node(node, 1.0)
        self.after(wait, crash)

    def _finished(self, mover: Mover, table: PartitionTable, step: Finished) -> None:
        self.mover = None
        for line in step.lines:
            self.note(f"operator: {line}")
        if mover.undrain:
            self.counts["undrains_done"] += 1
        else:
            self.counts["drains_done"] += 1
            self.drained = mover.node
            held = table.cells_of(mover.node)
            if held and len(mover.skipped) < len(held):
                self.violate(f"(j) drain of {mover.node} finished; the table still places "
                             f"it in partitions {held}")
            self.settle_due = self.now + self.settle
        if self.script is None:
            self.after(self.rng.uniform(*MOVES_EVERY), self._operate)

    def _settled(self) -> None:
        """(j) once a drain settled: nothing counts the drained node any more; the script
        ``stop`` then stops it and checks no group elects."""
        if self.settle_due is None or self.now < self.settle_due:
            self._stopped()
            return
        name = self.drained
        if name is None:
            self.settle_due = None
            return
        self.settle_due = None
        for p in range(self.partitions):
            leader = self.serving_groups[group_of(p)]
            layer = leader.ha.memberships.get(group_of(p)) if leader is not None else None
            if layer is not None and name in layer.membership.everyone:
                self.violate(f"(j) {self.settle}s after {name} was drained, group {group_of(p)}'s "
                             f"primary {leader.name if leader else '-'} still runs "
                             f"{layer.membership}")
        node = self.node(name)
        # the node's own side only once no fault ran for the settle time and a fault's
        # longest effect (a node cut off or paused hears its removal only once back)
        quiet = self.now - self.last_fault_at >= self.settle + self.faults.outage[1] \
            + self.faults.detect[1]
        if node.alive and quiet:
            self.counts["drained_nodes_checked"] += 1
            groups = sorted(g for g in node.ha.groups if g != 0)
            if groups:
                self.violate(f"(j) {self.settle}s after {name} was drained it still runs groups "
                             f"{groups}")
            for client in self.clients:
                if self.queue_on(node, client.queue) is not None:
                    self.violate(f"(j) drained {name} still holds queue {client.queue}")
        self.counts["drains_settled"] += 1
        if self.script == "stop" and node.alive:
            self.stopped_epochs = {g: self._epoch(serving, g) for g in self.groups[1:]
                                   if (serving := self.serving_groups[g]) is not None}
            self.note(f"script: stop drained {name}")
            self.crash_node(node, self.duration)
            self.stop_check_at = self.now + self.settle

    def _stopped(self) -> None:
        if self.stopped_epochs is None or self.now < self.stop_check_at:
            return
        for group, epoch in self.stopped_epochs.items():
            serving = self.serving_groups[group]
            if serving is None or self._epoch(serving, group) != epoch:
                self.violate(f"(j) stopping the drained node changed group {group}: epoch "
                             f"{epoch} -> "
                             f"{self._epoch(serving, group) if serving else 'no primary'}")
        self.counts["stops_checked"] += 1
        self.stopped_epochs = None

    # -- the groups world's checks, with cells that move ---------------------------------

    def check_serving(self) -> None:
        """(h) of the groups world, for any table the coordinators made; the cells each
        group's checks use are those its serving primary runs."""
        for node in self.group_nodes():
            table = node.ha.table
            key = (node.name, node.incarnation)
            if table is not None and key not in self.tables_seen:
                if table.rows not in self.tables:
                    self.violate(f"(h) {node.name} made its groups of table {table}, which no "
                                 "coordinator made")
                self.tables_seen.add(key)
                self.counts["groups_made"] += 1
        super().check_serving()
        for group in self.groups[1:]:
            serving = self.serving_groups[group]
            layer = serving.ha.memberships.get(group) if serving is not None else None
            if layer is not None and list(layer.membership.everyone) != self.cells[group]:
                self.cells[group] = list(layer.membership.everyone)
                self.group_stable[group] = None

    def persist(self, node: GroupNode, group: int, epoch: int, voted_for: str | None) -> None:
        """(a) as ever; (f) only for the cells the group's serving primary runs: a node the
        group removed (a drained cell restarted, a zombie voter) changes nothing there."""
        if group == 0 or node.name in self.cells[group]:
            super().persist(node, group, epoch, voted_for)
            return
        armed, self.group_stable[group] = self.group_stable[group], None
        try:
            super().persist(node, group, epoch, voted_for)
        finally:
            self.group_stable[group] = armed

    def check_stable(self) -> None:
        """(f) of the groups world, off in a group while it moves: its membership differs
        from its leader's table row (a learner joins, a voter leaves: a leader that
        leaves hands over, an election on purpose)."""
        super().check_stable()
        for group in self.groups[1:]:
            serving = self.serving_groups[group]
            if serving is None or serving.ha.table is None:
                continue
            layer = serving.ha.memberships.get(group)
            wanted = membership_of(serving.ha.table, partition_of_group(group))
            if layer is None or set(layer.membership.voters) != set(wanted.voters) \
                    or set(layer.membership.learners) != set(wanted.learners):
                self.group_stable[group] = None

    def check_scope(self) -> None:
        """(g) with moves: a node holds a partition's queue only while it runs its group."""
        for node in self.group_nodes():
            if not node.alive:
                continue
            for client in self.clients:
                if group_of(client.partition) not in node.ha.groups \
                        and self.queue_on(node, client.queue) is not None:
                    self.violate(f"(g) {node.name} holds queue {client.queue} of partition "
                                 f"{client.partition} without its group")


def membership_table(table: PartitionTable) -> list[Membership]:
    return [membership_of(table, p) for p in range(table.partitions)]


def run_seed(seed: int, *, nodes: int = 4, duration: float = 30.0,
             faults: Faults | None = None, **kw: Any) -> SimResult:
    return run_quietly(MoveSimulation, seed, nodes=nodes, duration=duration, faults=faults,
                       **kw)


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    return run_seeds(run_seed, seeds, jobs=jobs, **kw)



