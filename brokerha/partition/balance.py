"""Leaders back to their preferred cells (``brokerha ctl partitions balance``, issue 35).

Sans-I/O. Each partition's preferred leader is the first cell of its row
(``PartitionTable.preferred_leader``); at a start the preferred cells stand first, so
leaders are spread, but after a node dies and returns the partitions it led stay where
they were elected. ``Balancer`` decides, from what the cluster answers (each partition
group's leader, epoch, and each member's role, readiness and epoch), which partition to
hand over next, and follows each hand-over to its end:

- a partition whose leader is its preferred cell is *balanced*;
- one whose preferred cell is down, not a backup of the group in the leader's epoch, or
  not ready (catching up) is *skipped*, the reason said; so is one with no serving
  leader (an election under way);
- otherwise it is *moved*: its leader is asked to hand over (``Promote``: the group's
  ``TransferPrimary``, ``POST /api/promote {"node", "group"}`` on the leader), and the
  next partition waits until the preferred cell serves the group in a newer epoch
  (one move at a time). A refused request (the leader has not heard the cell ready
  yet: ``el.PromoteRefused``, 409) is asked again until the move's ``timeout``; a move
  not finished by then is *skipped* with the last reason.

Each partition is decided once per run, in partition order, on the observation of the
step that reaches it. What drives it (asks the nodes, sends the requests, waits) is the
table's coordinator, the metadata primary: ``node/partition_balance.py`` answers
``POST /api/partitions/balance`` (``ctl partitions balance``) with the report.
``observe`` makes the observation from the nodes' own status answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MOVED, BALANCED, SKIPPED = "moved", "balanced", "skipped"
RETRY = 0.2  # a refused hand-over is asked again this long after


@dataclass(frozen=True)
class CellView:
    """One member of a partition group, as it answered (``ctl status``'s ``groups``)."""

    role: str  # primary, backup, none
    epoch: int
    serving: bool = False
    ready: bool = False


@dataclass(frozen=True)
class GroupView:
    """A partition group: its serving leader (None: none answered serving) and epoch, and
    each member that answered."""

    leader: str | None
    epoch: int | None
    cells: Mapping[str, CellView] = field(default_factory=dict)


@dataclass(frozen=True)
class Promote:
    """Ask ``leader`` to hand partition ``partition``'s group over to ``target``."""

    partition: int
    leader: str
    target: str

    @property
    def group(self) -> int:
        return self.partition + 1


@dataclass(frozen=True)
class Wait:
    """Nothing to send now: observe again (a hand-over under way)."""

    partition: int


@dataclass(frozen=True)
class Done:
    report: list[Line]


@dataclass
class Line:
    """One partition's outcome."""

    partition: int
    status: str  # moved, balanced, skipped
    preferred: str
    leader: str | None  # before the run's move (or now, when not moved)
    epoch: int | None
    new_epoch: int | None = None
    seconds: float | None = None
    reason: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"partition": self.partition, "status": self.status,
                "preferred": self.preferred, "leader": self.leader, "epoch": self.epoch,
                "new_epoch": self.new_epoch, "seconds": self.seconds, "reason": self.reason}

    def text(self) -> str:
        if self.status == MOVED:
            return (f"partition {self.partition}: moved {self.leader} -> {self.preferred} "
                    f"(epoch {self.epoch} -> {self.new_epoch}, {self.seconds:.2f} s)")
        if self.status == BALANCED:
            return (f"partition {self.partition}: already balanced (led by {self.preferred}, "
                    f"epoch {self.epoch})")
        return f"partition {self.partition}: skipped: {self.reason}"


def observe(nodes: Sequence[Mapping[str, Any]]) -> dict[int, GroupView]:
    """Per partition, its group as the nodes answered (each node's status entry: ``name``
    and ``groups``, ``node/ha_groups.py`` ``group_status``): its leader is the member
    that says it *serves* the group (a primary whose lease lapsed, or not verified yet,
    is no leader to hand over from), in the highest epoch; the group's epoch is that
    leader's, else the highest any member holds."""
    out: dict[int, GroupView] = {}
    cells: dict[int, dict[str, CellView]] = {}
    for node in nodes:
        for group, g in (node.get("groups") or {}).items():
            if int(group) == 0:  # the metadata group: not a partition
                continue
            cells.setdefault(int(group) - 1, {})[str(node["name"])] = CellView(
                str(g["role"]), int(g["epoch"]), bool(g.get("serving")), bool(g.get("ready")))
    for p, members in cells.items():
        serving = [(c.epoch, name) for name, c in members.items()
                   if c.role == "primary" and c.serving]
        if serving:
            epoch, leader = max(serving)
            out[p] = GroupView(leader, epoch, members)
        else:
            out[p] = GroupView(None, max(c.epoch for c in members.values()), members)
    return out


def why_not(preferred: str, group: GroupView | None) -> str | None:
    """None when partition's ``group`` may be handed to ``preferred`` now; else why not.
    (Not asked of a balanced partition.)"""
    if group is None:
        return "no partition group answered (the nodes run no partition groups?)"
    if group.leader is None:
        return "no leader serving it (an election under way, or no majority of its cells up)"
    cell = group.cells.get(preferred)
    if cell is None:
        return f"its preferred cell {preferred} is down (did not answer)"
    if cell.role != "backup":
        return f"its preferred cell {preferred} is not a backup of the group (role {cell.role})"
    if cell.epoch != group.epoch:
        return (f"its preferred cell {preferred} is in epoch {cell.epoch}, the leader "
                f"{group.leader} in {group.epoch}")
    if not cell.ready:
        return f"its preferred cell {preferred} is catching up (not ready)"
    return None


@dataclass
class _Move:
    partition: int
    leader: str
    target: str
    epoch: int
    started: float
    asked: float | None = None  # when the request was last sent (None: to send again)
    retry_at: float = 0.0
    refused: str = ""


class Balancer:
    """One run of ``balance``: ``step`` with each new observation until ``Done``."""

    def __init__(self, preferred: Sequence[str], timeout: float = 15.0) -> None:
        self.preferred = list(preferred)  # per partition
        self.timeout = timeout
        self.report: dict[int, Line] = {}
        self.move: _Move | None = None

    def step(self, now: float, groups: Mapping[int, GroupView]) -> Promote | Wait | Done:
        """``groups``: per partition, its group as observed now."""
        move = self.move
        if move is not None:
            action = self._follow(now, move, groups.get(move.partition))
            if action is not None:
                return action
        for p, preferred in enumerate(self.preferred):
            if p in self.report:
                continue
            group = groups.get(p)
            if group is not None and group.leader == preferred:
                self.report[p] = Line(p, BALANCED, preferred, preferred, group.epoch)
                continue
            reason = why_not(preferred, group)
            if reason is not None:
                self.report[p] = Line(p, SKIPPED, preferred,
                                      None if group is None else group.leader,
                                      None if group is None else group.epoch, reason=reason)
                continue
            assert group is not None and group.leader is not None and group.epoch is not None
            self.move = _Move(p, group.leader, preferred, group.epoch, now, asked=now)
            return Promote(p, group.leader, preferred)
        return Done([self.report[p] for p in sorted(self.report)])

    def _follow(self, now: float, move: _Move, group: GroupView | None) -> Promote | Wait | None:
        """The move under way: finished (None: go on), or what to do for it."""
        p = move.partition
        if group is not None and group.leader == move.target and group.epoch is not None \
                and group.epoch > move.epoch:
            self.report[p] = Line(p, MOVED, move.target, move.leader, move.epoch,
                                  new_epoch=group.epoch, seconds=now - move.started)
            self.move = None
            return None
        if now - move.started > self.timeout:
            leader = None if group is None else group.leader
            why = f"; last refusal: {move.refused}" if move.refused else ""
            self.report[p] = Line(
                p, SKIPPED, move.target, move.leader, move.epoch,
                new_epoch=None if group is None else group.epoch,
                reason=f"not served by {move.target} within {self.timeout:g} s (leader now "
                       f"{leader or 'none'}){why}")
            self.move = None
            return None
        if move.asked is None and now >= move.retry_at:
            # asked again: the leader refused (it had not heard the cell ready yet), or the
            # group's leader changed meanwhile (ask the one serving now)
            if group is not None and group.leader not in (None, move.target) \
                    and why_not(move.target, group) is None:
                assert group.leader is not None and group.epoch is not None
                move.leader, move.epoch, move.asked = group.leader, group.epoch, now
                return Promote(p, group.leader, move.target)
        return Wait(p)

    def refused(self, now: float, partition: int, reason: str) -> None:
        """The leader refused the hand-over (409: not a ready backup as it sees it yet, or
        not its primary any more): asked again after ``RETRY``, until the timeout."""
        move = self.move
        if move is None or move.partition != partition:
            return
        move.refused = reason
        move.asked = None
        move.retry_at = now + RETRY

    def unbalanced(self) -> list[int]:
        return sorted(p for p, line in self.report.items() if line.status == SKIPPED)
