"""The partition table (issue 35; seed 004, NEO's): which nodes hold each partition, sans-I/O.

Pure data. ``rows[p]`` lists partition ``p``'s cells, ``Cell(node, state)``;
the first cell is the partition's *preferred leader* (whom a balance hands the
partition's primary role to; the leader itself is what the partition's group
elects, not in the table). ``ptid`` increases by exactly one per change, and a
change is a ``PartitionChange``: the whole new rows of the partitions it
touches and the new ptid, carried as a ``pt`` event in the metadata log
(``cluster/replication.py``). ``apply`` refuses a change that is not the
next ptid, so every node goes through the same tables in the same order.

Only the table coordinator decides (``partition/coordinator.py``): it asks
this module for a change (``tweak``) and applies it. Nothing routes by the
table yet (stage 3 of docs/ha.md "Partitions").

Cell states are NEO's, by their unambiguous initials:

=============  ===  ======  ================================================================
state          ch.  voting  meaning
=============  ===  ======  ================================================================
UP_TO_DATE     U    yes     holds the partition; counts for its majority, may be elected
OUT_OF_DATE    O    no      a learner: receives the partition's log, catches up (a new cell)
FEEDING        F    yes     up to date, leaving once its replacement is (a drained node's)
CORRUPTED      C    no      a check found it differs from the others
=============  ===  ======  ================================================================

Placement (``tweak``) is deterministic: the same table, nodes and exclusions
give the same change on any node, in any process (no ``hash()``, no sets
iterated unsorted).
"""

from __future__ import annotations

import enum
import json
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PIN_ARGUMENT = "x-partition"  # a queue argument pinning the queue to a partition
PRECONDITION_FAILED = 406  # the AMQP reply code of a bad pin (checked at declare, stage 3)


class CellState(enum.Enum):
    UP_TO_DATE = "U"
    OUT_OF_DATE = "O"
    FEEDING = "F"
    CORRUPTED = "C"

    @property
    def voting(self) -> bool:
        """Counts for the partition's majority and may be elected (NEO: readable)."""
        return self in (CellState.UP_TO_DATE, CellState.FEEDING)


U, OUT, F, C = (CellState.UP_TO_DATE, CellState.OUT_OF_DATE, CellState.FEEDING,
              CellState.CORRUPTED)


@dataclass(frozen=True)
class Cell:
    node: str
    state: CellState

    def as_wire(self) -> list[str]:
        return [self.node, self.state.value]

    @classmethod
    def from_wire(cls, data: Sequence[Any]) -> Cell:
        node, state = data
        return cls(str(node), CellState(state))

    def __str__(self) -> str:
        return f"{self.node}:{self.state.value}"


Row = tuple[Cell, ...]


class PartitionTableError(ValueError):
    """A change that cannot be applied (not the next ptid, a bad row), or a bad table."""


class PartitionPinError(ValueError):
    """An ``x-partition`` argument outside 0..P-1 or not an integer (AMQP 406 at declare)."""

    reply_code = PRECONDITION_FAILED


@dataclass(frozen=True)
class PartitionChange:
    """One change of the table: ``rows`` (partition -> its whole new row) at ``ptid``.

    ``partitions`` is P after the change (the first change creates every row).
    """

    ptid: int
    num_replicas: int
    partitions: int
    rows: Mapping[int, Row]

    def as_wire(self) -> list[Any]:
        """[ptid, num_replicas, partitions, [[p, [[node, state], ...]], ...]] (a ``pt``)."""
        return [self.ptid, self.num_replicas, self.partitions,
                [[p, [c.as_wire() for c in row]] for p, row in sorted(self.rows.items())]]

    @classmethod
    def from_wire(cls, ptid: int, num_replicas: int, partitions: int,
                  rows: Iterable[Sequence[Any]]) -> PartitionChange:
        return cls(int(ptid), int(num_replicas), int(partitions),
                   {int(p): tuple(Cell.from_wire(c) for c in cells) for p, cells in rows})


def check_pin(value: Any, partitions: int) -> int:
    """The partition an ``x-partition`` argument names; ``PartitionPinError`` (406) unless
    it is an integer in 0..P-1 (a bool is not one; a long-string digit is not either)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PartitionPinError(f"PRECONDITION_FAILED - invalid arg '{PIN_ARGUMENT}' for queue: "
                                f"expected an integer, got {value!r}")
    if not 0 <= value < partitions:
        raise PartitionPinError(f"PRECONDITION_FAILED - invalid arg '{PIN_ARGUMENT}' for queue: "
                                f"{value} is not a partition (0..{partitions - 1})")
    return value


def hash_partition(vhost: str, name: str, partitions: int) -> int:
    """``crc32(vhost + NUL + name) % P``: the same in every process (``hash()`` is salted)."""
    return zlib.crc32(f"{vhost}\0{name}".encode()) % partitions


class PartitionTable:
    """NEO's partition table: ``ptid``, ``num_replicas`` (NR) and P rows of cells."""

    def __init__(self, ptid: int = 0, num_replicas: int = 0,
                 rows: Iterable[Iterable[Cell]] = ()) -> None:
        if ptid < 0 or num_replicas < 0:
            raise PartitionTableError(f"ptid {ptid} and num_replicas {num_replicas} are >= 0")
        self.ptid = ptid
        self.num_replicas = num_replicas
        self.rows: list[Row] = [tuple(row) for row in rows]
        for p, row in enumerate(self.rows):
            _check_row(p, row)

    @classmethod
    def empty(cls, partitions: int, num_replicas: int) -> PartitionTable:
        """P rows without cells (ptid 0): what ``tweak`` fills at a cluster's start."""
        return cls(0, num_replicas, [() for _ in range(partitions)])

    # -- reading -------------------------------------------------------------------------

    @property
    def partitions(self) -> int:
        return len(self.rows)

    @property
    def exists(self) -> bool:
        """Whether a table was made (a coordinator must not make another)."""
        return self.ptid > 0

    def nodes(self) -> list[str]:
        return sorted({c.node for row in self.rows for c in row})

    def preferred_leader(self, partition: int) -> str | None:
        row = self.rows[partition]
        return row[0].node if row else None

    def cells_of(self, node: str) -> list[int]:
        """The partitions ``node`` holds a cell of."""
        return [p for p, row in enumerate(self.rows) if any(c.node == node for c in row)]

    def voting(self, partition: int) -> list[str]:
        return [c.node for c in self.rows[partition] if c.state.voting]

    def partition_of(self, vhost: str, name: str, pinned: Any = None) -> int:
        """A queue's partition: its ``x-partition`` pin (``check_pin``), else the hash of
        its vhost and name. Decided once, at the queue's declaration (stage 3)."""
        if not self.rows:
            raise PartitionTableError("no partition table yet")
        if pinned is not None:
            return check_pin(pinned, self.partitions)
        return hash_partition(vhost, name, self.partitions)

    def operational(self, alive: Iterable[str]) -> list[bool]:
        """Per partition, whether a majority of its voting cells is on ``alive`` nodes (NEO)."""
        up = set(alive)
        out = []
        for p in range(self.partitions):
            voters = self.voting(p)
            out.append(bool(voters) and 2 * sum(n in up for n in voters) > len(voters))
        return out

    def stopped_by(self, node: str, alive: Iterable[str] | None = None) -> list[int]:
        """The partitions operational with ``alive`` (default: every node of the table)
        that the loss of ``node`` would stop."""
        up = set(self.nodes() if alive is None else alive)
        before = self.operational(up)
        after = self.operational(up - {node})
        return [p for p in range(self.partitions) if before[p] and not after[p]]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PartitionTable) and self.ptid == other.ptid
                and self.num_replicas == other.num_replicas and self.rows == other.rows)

    def __repr__(self) -> str:
        return (f"PartitionTable(ptid={self.ptid}, num_replicas={self.num_replicas}, "
                f"rows=[{'; '.join(' '.join(map(str, r)) for r in self.rows)}])")

    # -- changing: one ptid at a time ------------------------------------------------------

    def apply(self, change: PartitionChange) -> None:
        """Take ``change``; ``PartitionTableError`` (and nothing changed) unless its ptid is
        the next one and its rows are rows of its P partitions."""
        if change.ptid != self.ptid + 1:
            raise PartitionTableError(f"partition table change of ptid {change.ptid}: this "
                                      f"table is at ptid {self.ptid} (expects {self.ptid + 1})")
        if change.partitions < self.partitions:
            raise PartitionTableError(f"a change may not drop partitions ({self.partitions} "
                                      f"-> {change.partitions})")
        rows = self.rows + [() for _ in range(change.partitions - self.partitions)]
        for p, row in change.rows.items():
            if not 0 <= p < change.partitions:
                raise PartitionTableError(f"row {p} outside 0..{change.partitions - 1}")
            _check_row(p, row)
            rows[p] = tuple(row)
        self.rows, self.ptid, self.num_replicas = rows, change.ptid, change.num_replicas

    def replace(self, other: PartitionTable) -> None:
        """Become ``other`` whatever our ptid (a catch-up's table: the primary's wins)."""
        self.ptid, self.num_replicas, self.rows = other.ptid, other.num_replicas, list(other.rows)

    def change_to(self, rows: Sequence[Row], num_replicas: int | None = None
                  ) -> PartitionChange | None:
        """The change (next ptid) that makes our rows ``rows``; None if nothing differs."""
        nr = self.num_replicas if num_replicas is None else num_replicas
        changed = {p: tuple(row) for p, row in enumerate(rows)
                   if p >= self.partitions or self.rows[p] != tuple(row)}
        if not changed and len(rows) == self.partitions and nr == self.num_replicas:
            return None
        return PartitionChange(self.ptid + 1, nr, len(rows), changed)

    def tweak(self, nodes: Iterable[str], exclude: Iterable[str] = ()) -> PartitionChange | None:
        """The change that places every partition's cells on ``nodes`` but ``exclude``
        (NEO's TweakPartitionTable), or None if the table is placed so already.

        An empty table is filled round-robin with an offset per row: each node
        holds (NR+1) x P / N cells and is the preferred leader of P / N
        partitions (within one), every cell UP_TO_DATE (NEO: the initial
        state). A placed table keeps its cells where it can: a cell on an
        excluded (or unlisted) node becomes FEEDING if it was voting and goes
        if it was not, its replacement is a new OUT_OF_DATE cell (a learner) on
        the node holding fewest, and counts are evened out the same way. The
        preferred leader of a row is an UP_TO_DATE cell, its choice evened out
        too. Calling it again on its result changes nothing.
        """
        alive = sorted(set(nodes) - set(exclude))
        if not alive:
            raise PartitionTableError("no node left to place the partitions on")
        width = min(self.num_replicas + 1, len(alive))
        if not any(self.rows):
            rows = _fresh(self.partitions, alive, width)
        else:
            rows = _Placement(self.rows, alive, width).run()
        return self.change_to(rows)

    def replicated(self, partition: int, node: str) -> PartitionChange | None:
        """``node``'s learner cell of ``partition`` caught up (NEO's ReplicationDone):
        it becomes UP_TO_DATE and one FEEDING cell it replaces goes (all of them once no
        learner is left in the row). None if ``node`` holds no learner there."""
        row = list(self.rows[partition])
        at = next((i for i, c in enumerate(row) if c.node == node and c.state is OUT), None)
        if at is None:
            return None
        row[at] = Cell(node, U)
        feeding = [i for i, c in enumerate(row) if c.state is F]
        if feeding:
            drop = set(feeding) if not any(c.state is OUT for c in row) else {feeding[0]}
            row = [c for i, c in enumerate(row) if i not in drop]
        rows = list(self.rows)
        rows[partition] = _ordered(row)
        return self.change_to(rows)

    def move(self, partition: int, source: str, target: str) -> PartitionChange:
        """Move ``partition``'s cell from ``source`` to ``target`` (one row, one ``pt``):
        the source's voting cell becomes FEEDING (a learner of it just goes), a new
        OUT_OF_DATE learner on ``target``; ``replicated`` finishes the move. Only one
        move per row at a time: ``PartitionTableError`` if the row already feeds or
        learns, if ``source`` holds no cell there or ``target`` holds one."""
        row = list(self.rows[partition])
        if any(c.state in (F, OUT) for c in row):
            raise PartitionTableError(f"partition {partition} has a move under way: "
                                      f"{' '.join(map(str, row))}")
        at = next((i for i, c in enumerate(row) if c.node == source), None)
        if at is None:
            raise PartitionTableError(f"{source} holds no cell of partition {partition}")
        if any(c.node == target for c in row):
            raise PartitionTableError(f"{target} already holds a cell of partition {partition}")
        if row[at].state.voting:
            row[at] = Cell(source, F)
        else:
            del row[at]
        row.append(Cell(target, OUT))
        rows = list(self.rows)
        rows[partition] = _ordered(row)
        change = self.change_to(rows)
        assert change is not None
        return change

    def withdraw(self, partition: int, node: str) -> PartitionChange | None:
        """Drop ``node``'s non-voting cell (a learner, a corrupted cell) of ``partition``;
        None if it holds none there (a voting cell leaves by ``move``)."""
        row = self.rows[partition]
        keep = tuple(c for c in row if c.node != node or c.state.voting)
        if keep == row:
            return None
        rows = list(self.rows)
        rows[partition] = keep
        return self.change_to(rows)

    def move_target(self, partition: int, nodes: Iterable[str],
                    exclude: Iterable[str] = ()) -> str | None:
        """Where a cell of ``partition`` leaving goes: the node of ``nodes`` (but
        ``exclude``) without a cell in the row holding fewest cells, then the first by
        name; None if every such node holds one."""
        out = set(exclude)
        present = {c.node for c in self.rows[partition]}
        counts = Counter(c.node for row in self.rows for c in row)
        free = sorted(n for n in set(nodes) if n not in out and n not in present)
        return min(free, key=lambda n: (counts[n], n)) if free else None

    # -- the store's form ----------------------------------------------------------------------

    def as_wire(self) -> list[Any]:
        """[ptid, num_replicas, [[[node, state], ...], ...]] (a ``ps`` event, the store)."""
        return [self.ptid, self.num_replicas, [[c.as_wire() for c in row] for row in self.rows]]

    @classmethod
    def from_wire(cls, ptid: int, num_replicas: int,
                  rows: Iterable[Iterable[Sequence[Any]]]) -> PartitionTable:
        return cls(int(ptid), int(num_replicas),
                   [[Cell.from_wire(c) for c in row] for row in rows])

    def to_json(self) -> str:
        return json.dumps(self.as_wire(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PartitionTable:
        try:
            ptid, num_replicas, rows = json.loads(text)
            return cls.from_wire(ptid, num_replicas, rows)
        except (ValueError, TypeError) as exc:
            raise PartitionTableError(f"not a partition table: {text!r:.60} ({exc})") from exc

    def status(self, alive: Iterable[str] | None = None) -> dict[str, Any]:
        """What ``ctl status --json`` and ``ctl partitions`` show (``alive``: the nodes up)."""
        out: dict[str, Any] = {
            "ptid": self.ptid, "num_replicas": self.num_replicas,
            "partitions": self.partitions,
            "rows": [{"partition": p, "preferred_leader": self.preferred_leader(p),
                      "cells": [c.as_wire() for c in row]} for p, row in enumerate(self.rows)],
        }
        if alive is not None and self.rows:
            up = sorted(set(alive))
            operational = self.operational(up)
            out["alive"] = up
            out["operational"] = [p for p, ok in enumerate(operational) if ok]
            out["stopped_by"] = {n: self.stopped_by(n, up) for n in self.nodes()}
        return out


def _check_row(p: int, row: Row) -> None:
    names = [c.node for c in row]
    if len(set(names)) != len(names):
        raise PartitionTableError(f"partition {p} has two cells on one node: {names}")
    if not all(isinstance(c, Cell) and isinstance(c.state, CellState) for c in row):
        raise PartitionTableError(f"partition {p}: not cells: {row!r:.80}")


def _fresh(partitions: int, nodes: list[str], width: int) -> list[Row]:
    """Round-robin with an offset per row: row p's cells are ``width`` consecutive nodes
    from its offset, the first its preferred leader.

    The offsets run 0, 1, .., N-1 over and over; the last P mod N rows (r of
    them) take offsets spread evenly, floor(j x N / r), so that both the
    leaders (one per offset) and the cells (windows of ``width`` from each
    offset) come out within one of the ideal for any P (a mechanical word is
    balanced: any window holds floor or ceil of its share).
    """
    n = len(nodes)
    full, rest = divmod(partitions, n)
    offsets = [p % n for p in range(full * n)] + [j * n // rest for j in range(rest)]
    return [tuple(Cell(nodes[(o + k) % n], U) for k in range(width)) for o in offsets]


_ORDER = {U: 0, F: 1, OUT: 2, C: 3}


def _ordered(row: Iterable[Cell]) -> Row:
    """UP_TO_DATE cells first (the preferred leader is one), then FEEDING, then learners;
    stable within a state."""
    return tuple(sorted(row, key=lambda c: _ORDER[c.state]))


class _Placement:
    """``tweak`` of a placed table: keep cells, replace what leaves, even out the counts.

    A move under way (a FEEDING cell on a staying node, its learner beside it)
    is first undone -- the cell up to date again, the learner beyond the row's
    width dropped -- and the evening out then prefers to make that same move
    again: the counts, hence the sequence of (most, fewest) pairs, are the same
    as when the move was chosen, so calling ``tweak`` on its own result changes
    nothing, while a node back in before its learners caught up keeps its cells.
    """

    def __init__(self, rows: Sequence[Row], alive: list[str], width: int) -> None:
        self.alive = alive
        self.rank = {n: i for i, n in enumerate(alive)}
        self.width = width
        #: per row, the moves found under way: (the feeding node, its dropped learners)
        self.under_way: list[tuple[set[str], set[str]]] = []
        self.rows: list[list[Cell]] = [self._kept(row) for row in rows]

    def _kept(self, row: Row) -> list[Cell]:
        out: list[Cell] = []
        moving: set[str] = set()
        for c in row:
            if c.node not in self.rank:  # leaving: a voting cell feeds its replacement
                if c.state.voting:
                    out.append(Cell(c.node, F))
            elif c.state is C:
                continue  # replaced like a missing cell
            elif c.state is F:
                out.append(Cell(c.node, U))  # its node is back in: no need to leave
                moving.add(c.node)
            else:
                out.append(c)
        holding = [c for c in out if c.node in self.rank]
        extras = self._extras(holding)
        for extra in extras:
            out.remove(extra)
        self.under_way.append((moving, {c.node for c in extras if c.state is OUT}))
        return out

    def _extras(self, holding: list[Cell]) -> list[Cell]:
        """Cells beyond ``width`` on staying nodes: learners first, the last ones first."""
        over = len(holding) - self.width
        if over <= 0:
            return []
        order = sorted(range(len(holding)), key=lambda i: (holding[i].state is U, -i))
        return [holding[i] for i in order[:over]]

    def _holders(self, row: list[Cell]) -> list[str]:
        return [c.node for c in row if c.node in self.rank]

    def counts(self) -> Counter[str]:
        counts: Counter[str] = Counter({n: 0 for n in self.alive})
        for row in self.rows:
            counts.update(self._holders(row))
        return counts

    def run(self) -> list[Row]:
        counts = self.counts()
        n = len(self.alive)
        for p, row in enumerate(self.rows):  # missing cells: on the nodes holding fewest
            while len(self._holders(row)) < self.width:
                present = {c.node for c in row}
                node = min((m for m in self.alive if m not in present),
                           key=lambda m: (counts[m], (self.rank[m] - p) % n))
                row.append(Cell(node, OUT))
                counts[node] += 1
        self._even_out(counts)
        for p, row in enumerate(self.rows):  # nothing to feed: a leaving cell goes at once
            if sum(c.state is U and c.node in self.rank for c in row) >= self.width:
                self.rows[p] = [c for c in row if c.node in self.rank]
        rows = [_ordered(row) for row in self.rows]
        return _even_leaders(rows, self.alive)

    def _even_out(self, counts: Counter[str]) -> None:
        """Move cells from the node holding most to the one holding fewest until they are
        within one: a learner moves as it is, an up-to-date cell feeds a new learner."""
        while True:
            most = max(self.alive, key=lambda m: (counts[m], -self.rank[m]))
            least = min(self.alive, key=lambda m: (counts[m], self.rank[m]))
            if counts[most] - counts[least] <= 1:
                return
            best: tuple[Any, ...] | None = None
            for p, row in enumerate(self.rows):
                if any(c.node == least for c in row):
                    continue
                moving, learners = self.under_way[p]
                again = most in moving and least in learners  # the move found under way
                for i, c in enumerate(row):
                    if c.node == most and c.state in (U, OUT):
                        key = (not again, c.state is U, i == 0, -p)
                        if best is None or key < best[0]:
                            best = (key, p, i)
            if best is None:
                return
            _, p, i = best
            row = self.rows[p]
            cell = row[i]
            if cell.state is OUT:
                row[i] = Cell(least, OUT)
            else:
                row[i] = Cell(most, F)
                row.append(Cell(least, OUT))
            counts[most] -= 1
            counts[least] += 1


def _even_leaders(rows: list[Row], alive: list[str]) -> list[Row]:
    """Even out the preferred leaders (first cells) over ``alive`` within one, moving an
    UP_TO_DATE cell to the front of its row along a path of rows (x leads a row in which
    y is up to date: x gives that row to y, ...) from a node leading most to one leading
    at least two fewer. A row's other cells keep their order."""
    rows = list(rows)
    rank = {n: i for i, n in enumerate(alive)}

    def leads() -> Counter[str]:
        counts: Counter[str] = Counter({n: 0 for n in alive})
        counts.update(r[0].node for r in rows if r and r[0].node in rank)
        return counts

    while True:
        counts = leads()
        top = max(counts.values())
        # breadth-first from every node leading ``top``: edges are rows it leads
        parent: dict[str, tuple[str, int] | None] = {
            n: None for n in alive if counts[n] == top}
        frontier = sorted(parent, key=rank.__getitem__)
        goal = None
        while frontier and goal is None:
            nxt = []
            for x in frontier:
                for p, row in enumerate(rows):
                    if not row or row[0].node != x:
                        continue
                    for c in row[1:]:
                        if c.state is U and c.node in rank and c.node not in parent:
                            parent[c.node] = (x, p)
                            if counts[c.node] <= top - 2:
                                goal = c.node
                                break
                            nxt.append(c.node)
                    if goal is not None:
                        break
                if goal is not None:
                    break
            frontier = nxt
        if goal is None:
            return rows
        node = goal
        while parent[node] is not None:
            x, p = parent[node]  # type: ignore[misc]
            row = rows[p]
            at = next(i for i, c in enumerate(row) if c.node == node)
            rows[p] = (row[at], *row[:at], *row[at + 1:])
            node = x
