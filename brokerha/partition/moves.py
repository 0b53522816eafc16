"""Moving a partition's cells online (issue 35, stage 5), sans-I/O.

docs/ha.md "Moving partitions, checking replicas". Two halves:

**The group's side: who votes is in the group's own log.** The table
(``cluster/partition_table.py``) says what the coordinator wants; a ``pm``
event (``GroupMembership``: the voters, the learners and the ptid it was made
for) in the partition's log is what the group runs. ``MembershipChanger``,
on the group's primary, walks the group's membership towards the table's row
one cell at a time (``next_membership``):

1. a node the row lists that the group does not know joins as a **learner**
   (it receives the log and the streamed catch-up; it does not vote, stand,
   renew the lease or count for a confirm: ``Election`` learners,
   ``Primary.voters``);
2. a learner the row lists as voting (the coordinator made it UP_TO_DATE on
   its ``ReplicationDone``) becomes a voter, once the primary holds it as a
   ready backup;
3. a voter the row no longer lists as voting (FEEDING gone) is removed -- the
   primary itself hands the role over first (``Handover``) and the next
   primary removes it;
4. a learner the row no longer lists goes.

The rule (Raft's single-server change, with its fix): **a membership takes
effect on a node when the node appends its ``pm``** (the primary when it
emits it, a backup when it applies it, a joiner with the catch-up's copy),
whether or not it is committed yet; consecutive memberships differ by one
voter at most, so any majority of the old voter set and any majority of the
new one share a node, and a committed entry -- held by a majority of the
voters of the membership in force when it was confirmed -- is held by a node
of every majority that can elect later (its vote floor refuses any candidate
behind it). The primary appends the next ``pm`` only once the previous one
it appended is replicated and something of its own epoch is (``replicated()
>= 0``, quorum.py's rule: a deposed primary's uncommitted ``pm`` cannot then
be followed by a conflicting one, the bug found in Raft's single-server
changes).

A learner caught up (a ready backup of the primary that the row lists as
OUT_OF_DATE) is reported: ``ReplicationDone(partition, node, ptid)``, which
the coordinator turns into ``PartitionTable.replicated`` (one ``pt``).

**The coordinator's side: ``Mover``** (``ctl partitions drain NODE``,
undrain), stateless over the table: one partition at a time, it asks for a
``move`` (the node's cell FEEDING, a learner on the node holding fewest),
waits for the learner's ``ReplicationDone``, asks for ``replicated``, then
waits until the group's leader runs the row's membership (the drained node
out) before the next partition. A coordinator failover loses nothing: the
table says which partition is under way.

``Unsafe.two_cells`` jumps the group's membership straight to the row's (two
voters changed at once); ``Unsafe.learner_confirms`` counts learners
for a confirm. The moves simulation (``partition/move_simulation.py``) and the
scripted cases of ``tests/partition/test_moves.py`` catch each.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from brokerha.cluster import replication as R
from brokerha.cluster.partition_table import (
    CellState,
    PartitionChange,
    PartitionTable,
    PartitionTableError,
)
from brokerha.cluster.replication import ReplicationError
from brokerha.seed_runner import UnsafeRules

log = logging.getLogger("brokerha.partition")

MEMBERSHIP_KEY = "partition_membership/{group}"  # the store's meta key, per group
MEMBERSHIP_EVENTS = frozenset([R.GROUP_MEMBERSHIP])


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the moves to break on purpose (simulations only)."""

    two_cells: bool = False  # a group's membership jumps to the row's at once
    # the group's primary counts its learners' acknowledgements for a confirm (its elections
    # do not count them): a confirm held by the primary and a learner only
    learner_confirms: bool = False


@dataclass(frozen=True)
class Membership:
    """What a group runs: its voters and learners, and the ptid it was made for."""

    ptid: int
    voters: tuple[str, ...]
    learners: tuple[str, ...] = ()

    @property
    def everyone(self) -> tuple[str, ...]:
        return self.voters + self.learners

    def event(self) -> Any:
        return R.GroupMembership(R.GROUP_MEMBERSHIP, self.ptid, list(self.voters),
                                 list(self.learners))

    @classmethod
    def from_event(cls, event: Sequence[Any]) -> Membership:
        _, ptid, voters, learners = event
        return cls(int(ptid), tuple(map(str, voters)), tuple(map(str, learners)))

    def to_json(self) -> str:
        return json.dumps([self.ptid, list(self.voters), list(self.learners)])

    @classmethod
    def from_json(cls, text: str) -> Membership:
        ptid, voters, learners = json.loads(text)
        return cls(int(ptid), tuple(voters), tuple(learners))

    def __str__(self) -> str:
        learners = f" learners {','.join(self.learners)}" if self.learners else ""
        return f"voters {','.join(self.voters)}{learners} (ptid {self.ptid})"


def membership_of(table: PartitionTable, partition: int) -> Membership:
    """The row's membership: its voting cells (UP_TO_DATE, FEEDING) vote, its learners
    (OUT_OF_DATE) learn, a CORRUPTED cell is neither."""
    row = table.rows[partition]
    return Membership(table.ptid, tuple(c.node for c in row if c.state.voting),
                      tuple(c.node for c in row if c.state is CellState.OUT_OF_DATE))


def voter_changes(a: Membership, b: Membership) -> int:
    """How many voters differ between two memberships (the single-cell rule: <= 1)."""
    return len(set(a.voters) ^ set(b.voters))


@dataclass(frozen=True)
class Handover:
    """The primary must leave the voters: hand the role to ``target`` first."""

    target: str


@dataclass(frozen=True)
class ReplicationDone:
    """NEO's NotifyReplicationDone: ``node``'s learner cell of ``partition`` caught up
    with its group's primary (as of table ``ptid``)."""

    partition: int
    node: str
    ptid: int


def next_membership(current: Membership, target: Membership, me: str,
                    ready: Iterable[str], unsafe: Unsafe | None = None
                    ) -> Membership | Handover | None:
    """The next membership on the way from ``current`` to ``target`` (one cell), a
    ``Handover`` when the next step removes ``me`` (the primary), or None (nothing to
    do, or waiting for a learner to be ``ready``)."""
    ptid = target.ptid
    if (unsafe or Unsafe()).two_cells:
        same = (set(current.voters) == set(target.voters)
                and set(current.learners) == set(target.learners))
        if same or me not in target.voters:
            return None if same else _handover(current, target, me, ready)
        return Membership(ptid, target.voters, target.learners)
    voters, learners = list(current.voters), list(current.learners)
    ready = set(ready)
    # 1. a new node: a learner first, whatever the row says
    for node in target.everyone:
        if node not in voters and node not in learners:
            return Membership(ptid, tuple(voters), (*learners, node))
    # 2. a learner the row makes a voter, once it is a ready backup (no voter leaves before:
    #    the group never runs fewer voters than the row)
    for node in target.voters:
        if node in learners:
            if node not in ready:
                return None
            learners.remove(node)
            return Membership(ptid, (*voters, node), tuple(learners))
    # 3. a voter the row no longer lists as one: out (the primary hands over first)
    for node in voters:
        if node not in target.voters:
            if node == me:
                return _handover(current, target, me, ready)
            voters.remove(node)
            if node in target.learners:
                learners.append(node)
            return Membership(ptid, tuple(voters), tuple(learners))
    # 4. a learner the row does not list
    for node in learners:
        if node not in target.everyone:
            learners.remove(node)
            return Membership(ptid, tuple(voters), tuple(learners))
    return None


def _handover(current: Membership, target: Membership, me: str,
              ready: Iterable[str]) -> Handover | None:
    ready = set(ready)
    for node in (*target.voters, *current.voters):
        if node != me and node in current.voters and node in ready:
            return Handover(node)
    return None  # no ready voter to hand over to yet: ask again at the next tick


class EventLog(Protocol):
    """What the changer needs of the group's primary (``primary/primary.py``)."""

    seq: int
    members: int
    voters: frozenset[str] | None
    catch_up_providers: list[Callable[[], list[Any]]]

    def emit(self, event: Any) -> int: ...

    def replicated(self) -> int: ...

    def ready_backups(self) -> list[str]: ...


class MetaStore(Protocol):
    def put_meta(self, key: str, value: str) -> None: ...

    def get_meta(self, key: str) -> str | None: ...


class MembershipLayer:
    """A partition group's ``pm`` events (a ``StoreLayer`` of its ``HAMember``): the
    membership this node holds (kept in the store's meta), its ``replica`` applying the
    primary's, ``attach_primary`` giving a joiner the membership in its catch-up.

    ``changed(membership)`` is called whenever the membership held changes: the node
    reconfigures its election, its primary's voters, its links' filter
    (``PartitionedMember``)."""

    kinds = MEMBERSHIP_EVENTS

    def __init__(self, group: int, store: MetaStore, initial: Membership,
                 changed: Callable[[Membership], None],
                 table_ptid: Callable[[], int] = lambda: 2) -> None:
        """``table_ptid``: the node's table's ptid now -- a catch-up carries the membership
        once the table ever changed (ptid > 1); before, no group ever appended a ``pm``
        and every member runs the one of the first table: the catch-up is as before
        moves existed (the same wire, the simulations' same course)."""
        self.group = group
        self.table_ptid = table_ptid
        self.store = store
        self.key = MEMBERSHIP_KEY.format(group=group)
        self.changed = changed
        self.primary: EventLog | None = None
        self.membership = self._load() or initial
        self.pending_seq: int | None = None  # the seq of the last pm this primary emitted
        self.emitted: Callable[[Membership, Membership], None] | None = None  # (old, new)

    def _load(self) -> Membership | None:
        raw = self.store.get_meta(self.key)
        if raw is None:
            return None
        try:
            return Membership.from_json(raw)
        except (ValueError, TypeError):
            log.error("store meta %s is not a membership (%r); the table's is used", self.key,
                      raw[:80])
            return None

    @property
    def replica(self) -> MembershipLayer:
        return self

    # -- LayerReplica ------------------------------------------------------------------

    def apply(self, event: Any) -> None:
        if event[0] != R.GROUP_MEMBERSHIP:
            raise ReplicationError(f"not a membership event: {event[0]!r}")
        try:
            membership = Membership.from_event(event)
        except (TypeError, ValueError) as exc:
            raise ReplicationError(f"membership event refused: {exc}") from exc
        self.hold(membership)

    def after_durable(self, callback: Callable[[], None]) -> None:
        callback()  # in the store: its sync before the acknowledgement covers it

    # -- PrimaryLayer ------------------------------------------------------------------

    def attach_primary(self, primary: Any) -> None:
        self.primary = primary
        self.pending_seq = None
        primary.catch_up_providers.append(self.catch_up_events)
        self.changed(self.membership)

    def detach_primary(self) -> None:
        self.primary = None
        self.pending_seq = None

    def catch_up_events(self) -> list[Any]:
        """The membership, whole, for a joiner (its own, maybe a deposed primary's
        uncommitted one, is replaced): once the table or the membership moved on from
        the first table's."""
        if self.membership.ptid > 1 or self.table_ptid() > 1:
            return [self.membership.event()]
        return []

    # -- the membership held -----------------------------------------------------------

    def hold(self, membership: Membership) -> None:
        """Take ``membership`` (appended here: it is in force on this node from now)."""
        if membership == self.membership:
            return
        self.membership = membership
        self.store.put_meta(self.key, membership.to_json())
        self.changed(membership)

    def emit(self, membership: Membership) -> None:
        """The primary appends ``membership`` to the group's log and runs it at once."""
        primary = self.primary
        assert primary is not None
        old = self.membership
        self.hold(membership)
        self.pending_seq = primary.emit(membership.event())
        if self.emitted is not None:
            self.emitted(old, membership)


@dataclass
class MembershipChanger:
    """The group primary's walk from the membership it runs to the table's row."""

    partition: int
    me: str
    unsafe: Unsafe = field(default_factory=Unsafe)
    reported: set[tuple[str, int]] = field(default_factory=set)

    def step(self, layer: MembershipLayer, table: PartitionTable
             ) -> tuple[Handover | None, list[ReplicationDone]]:
        """One look (each tick of a serving primary): appends the next ``pm`` if the last
        one is replicated; returns a handover to ask for and the learners caught up."""
        primary = layer.primary
        if primary is None or self.partition >= table.partitions:
            return None, []
        ready = primary.ready_backups()
        target = membership_of(table, self.partition)
        done = [ReplicationDone(self.partition, n, table.ptid) for n in target.learners
                if n in ready and n in layer.membership.learners]
        replicated = primary.replicated()
        if replicated < 0 or (layer.pending_seq is not None and replicated < layer.pending_seq):
            return None, done  # the last change is not on a majority yet
        step = next_membership(layer.membership, target, self.me, ready, self.unsafe)
        if isinstance(step, Handover):
            return step, done
        if step is not None:
            log.warning("node %s: group of partition %d: %s -> %s", self.me, self.partition,
                        layer.membership, step)
            layer.emit(step)
        return None, done


# ---- the coordinator's side ---------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """Apply this ``pt`` (the coordinator's ``TableCoordinator.change``)."""

    partition: int
    change: PartitionChange
    why: str


@dataclass(frozen=True)
class Waiting:
    partition: int
    why: str


@dataclass(frozen=True)
class Finished:
    lines: tuple[str, ...]


MoverStep = Change | Waiting | Finished


class Mover:
    """``ctl partitions drain NODE`` (``undrain=False``) or its undoing (``undrain=True``:
    cells moved onto NODE until it holds within one of the most loaded), one partition
    at a time, decided from the table alone (a coordinator failover resumes it).

    ``step(table, memberships, done)``: ``memberships`` -- per partition, the membership
    its group's leader runs, if known; ``done`` -- the ``ReplicationDone`` reports
    received. Returns what to do now."""

    def __init__(self, node: str, nodes: Iterable[str], undrain: bool = False,
                 every_group: bool = False) -> None:
        """``every_group``: a drain is over only once every partition's leader was seen
        running a membership without the node (the node's endpoint; the simulation sees
        only the leaders linked to the coordinator)."""
        self.node = node
        self.nodes = sorted(nodes)
        self.undrain = undrain
        self.every_group = every_group
        self.lines: dict[int, str] = {}
        self.skipped: dict[int, str] = {}
        self.moved: dict[int, tuple[str, str]] = {}  # partition -> (from, to)

    def step(self, table: PartitionTable, memberships: Mapping[int, Membership | None],
             done: Iterable[ReplicationDone]) -> MoverStep:
        reports = {(d.partition, d.node) for d in done}
        # a move under way (a learner or a feeding cell in a row): finish it first
        for p, row in enumerate(table.rows):
            learners = [c.node for c in row if c.state is CellState.OUT_OF_DATE]
            feeding = [c.node for c in row if c.state is CellState.FEEDING]
            if not learners and not feeding:
                continue
            for node in learners:
                if node == self.node and not self.undrain:
                    change = table.withdraw(p, node)
                    if change is not None:
                        return Change(p, change, f"{node}'s learner of partition {p} goes")
                if (p, node) in reports:
                    change = table.replicated(p, node)
                    if change is not None:
                        return Change(p, change, f"{node} caught up with partition {p}")
            if learners:
                return Waiting(p, f"partition {p}: {', '.join(learners)} catching up")
            return Waiting(p, f"partition {p}: {', '.join(feeding)} feeding, no learner")
        # the group runs the row's membership before the next partition moves
        for p in range(table.partitions):
            running = memberships.get(p)
            wanted = membership_of(table, p)
            if running is not None and (set(running.voters) != set(wanted.voters)
                                        or set(running.learners) != set(wanted.learners)):
                if p in self.moved or self.node in running.everyone:
                    return Waiting(p, f"partition {p}: group runs {running}, table wants "
                                      f"{wanted}")
        for p in self.moved:
            self.lines.setdefault(p, f"partition {p}: moved from {self.moved[p][0]} to "
                                     f"{self.moved[p][1]}")
        nxt = self._next(table)
        if nxt is None:
            unseen = [p for p in range(table.partitions) if memberships.get(p) is None]
            if self.every_group and not self.undrain and unseen:
                return Waiting(unseen[0], f"partition {unseen[0]}: no leader serving it seen")
            return Finished(tuple(self.lines[p] for p in sorted(self.lines)))
        p, source, target = nxt
        self.moved[p] = (source, target)
        return Change(p, table.move(p, source, target), f"partition {p}: {source} -> {target}")

    def _next(self, table: PartitionTable) -> tuple[int, str, str] | None:
        if not self.undrain:
            for p in table.cells_of(self.node):
                if p in self.skipped:
                    continue
                target = table.move_target(p, self.nodes, exclude=[self.node])
                if target is None:
                    self.skipped[p] = "no node without a cell of it"
                    self.lines[p] = f"partition {p}: skipped (every other node holds a cell)"
                    continue
                return p, self.node, target
            return None
        counts = Counter({n: 0 for n in self.nodes})
        counts.update(c.node for row in table.rows for c in row if c.node in counts)
        for source in sorted(self.nodes, key=lambda n: (-counts[n], n)):
            if counts[source] - counts[self.node] <= 1:
                return None
            for p, row in enumerate(table.rows):
                names = [c.node for c in row]
                if source in names and self.node not in names and p not in self.moved:
                    return p, source, self.node
        return None


def observe(nodes: Sequence[Mapping[str, Any]]
            ) -> tuple[dict[int, Membership | None], list[ReplicationDone]]:
    """From the nodes' status entries (``node/ha_groups.py`` ``group_status``: each
    group's ``serving``, ``epoch``, ``voters``, ``learners``, ``caught_up``): per
    partition, the membership its serving leader of the highest epoch runs, and the
    learners its leader reports caught up."""
    best: dict[int, tuple[int, Membership, list[str]]] = {}
    for node in nodes:
        for group, g in (node.get("groups") or {}).items():
            if int(group) == 0 or not g.get("serving") or "voters" not in g:
                continue
            p, epoch = int(group) - 1, int(g["epoch"])
            if p not in best or epoch > best[p][0]:
                m = Membership(0, tuple(g["voters"]), tuple(g.get("learners") or ()))
                best[p] = (epoch, m, list(g.get("caught_up") or ()))
    memberships: dict[int, Membership | None] = {p: m for p, (_, m, _) in best.items()}
    done = [ReplicationDone(p, n, 0) for p, (_, _, caught) in best.items() for n in caught]
    return memberships, done


def held_membership(store: MetaStore, group: int) -> Membership | None:
    """The membership a node's store holds for ``group`` (None: none yet)."""
    raw = store.get_meta(MEMBERSHIP_KEY.format(group=group))
    if raw is None:
        return None
    try:
        return Membership.from_json(raw)
    except (ValueError, TypeError):
        return None


__all__ = ["Change", "Finished", "Handover", "Membership", "MembershipChanger",
           "MembershipLayer", "Mover", "PartitionTableError", "ReplicationDone", "Unsafe",
           "Waiting", "held_membership", "membership_of", "next_membership", "observe",
           "voter_changes"]
