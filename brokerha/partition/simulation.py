"""The partition table's coordinator in the HA simulation (issue 35): ``--workload table``.

The datacenter of ``ha/simulation/world.py`` (the product's ``HAMember`` per
node, its ``Broker`` on a simulated disk, crashes, pauses, link failures,
partitions, manual failovers) where every node runs, as ``node/ha.py`` does,
the product's ``TableCoordinator`` in its member's ``layers``, over its
store's meta ``partition_table``. The first primary makes the table (ptid 1);
now and then an operator, on the serving primary, makes the changes stage 5
of docs/ha.md "Partitions" will make, always through
``TableCoordinator.change``: drain a node (``tweak(nodes, exclude=drained)``),
bring one back (``tweak`` without it), a learner caught up
(``replicated(p, node)``). After each change, and when a primary starts
serving, it asks the broker's durability barrier (``Broker.after_durable``,
the rule of a publisher confirm: the primary's store synced, a majority of
the members acknowledged everything emitted so far, the node still serving
in the same term): when that answers, the table the primary held when it
asked is **committed**. Lives here, not in ``ha/simulation``: the
coordinator is a floor above ``ha`` (``tests/test_import_layers.py``).

What is promised, and checked after every event that changed anything:

- (a) agreement: a committed ptid has one table. Two commits of one ptid are
  the same table; a node that follows a primary of the epoch of a ptid's
  commit or a later one (it is that primary, or its caught-up backup) and
  holds that ptid holds that table; and a caught-up backup of epoch ``e``
  that applied the log up to seq ``s`` holds exactly the table the primary
  of ``e`` held at ``s`` (the catch-up's ``ps`` is the table at the join's
  seq, each ``pt`` after it in order). A node that follows nobody yet, or a
  deposed primary and its backups, may hold an uncommitted table at a
  committed ptid: (c) says how it goes.
- (b) durability: every primary of an epoch after a commit's starts (its
  table at seq 0 of its epoch, before it makes anything) from a table that
  *extends* the committed one: the same one, or one made from it by
  ``pt`` changes, one ptid at a time (every change any coordinator made is
  recorded with the table it was made from; extending is following those
  links down).
- (c) a node's ptid never goes down, and its table never leaves its line,
  except by a catch-up's ``ps`` that replaces an uncommitted change of a
  deposed primary. Checked on each node's table in memory (between two
  events of one process; a restart begins from its disk) and on its disk
  image (at each completed sync: what a crash keeps): a table that is not
  an extension of the one before must be a backup's (a ``ps``), the table
  it replaced not committed, and made by a primary of an epoch older than
  the one the backup follows.
- (d) after the run (no new faults, every node back, every backup caught
  up): every node holds the serving primary's table.
- (e) the table is made once: a change no operator asked for is only a
  creation, from no table (a new primary holding one never makes or tweaks
  it, ``TableCoordinator.attach_primary``). A second creation happens only
  when the first was never committed (its primary deposed before its ``pt``
  reached a majority; about one seed in a hundred): a new primary without
  a table while one is committed fails (b).

Beside the world's own (a), (b), (e), (f) of ``world.py``. ``Unsafe``: the
HA rules of ``world.Unsafe`` and the coordinator's (``coordinator.Unsafe``):
``recreate_table`` (a new primary places a fresh table over the one it
holds: (e)) and ``keep_own_table`` (a backup keeps its table over a
catch-up's of no higher ptid, as if ptids only went up: a deposed
primary's uncommitted change survives its catch-up, (a) or (d)).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from brokerha import seed_runner
from brokerha.cluster.partition_table import OUT, PartitionChange, PartitionTable
from brokerha.ha.simulation import world as w
from brokerha.ha.simulation.world import AsyncWorld, Faults, SimNode, SimProcess, SimResult
from brokerha.partition import coordinator
from brokerha.partition.coordinator import TABLE_KEY, TableCoordinator
from brokerha.primary.primary import Primary

__all__ = ["CATCHES", "SimResult", "TableSimulation", "Unsafe", "run_many", "run_seed"]

CATCHES = ("recreate_table", "keep_own_table", "confirm_early", "early_ack")
FAULTS = Faults(rate=0.4, outage=(0.3, 4.0))
CHANGE_RATE = 2.0  # operator changes per virtual second (on the serving primary)
EMPTY = PartitionTable().to_json()  # a node's table before any (store meta absent)


@dataclass(frozen=True)
class Unsafe(w.Unsafe):
    """The HA rules of ``world.Unsafe`` and the coordinator's, each in its product module."""

    recreate_table: bool = False  # a new primary places a fresh table over the one it holds
    keep_own_table: bool = False  # a backup keeps its table over a catch-up's of no higher ptid

    def coordinator(self) -> coordinator.Unsafe:
        return self._part(coordinator.Unsafe)  # type: ignore[no-any-return]


class WatchedCoordinator(TableCoordinator):
    """The product's coordinator; the simulation hears of each change it makes."""

    sim: TableSimulation
    node: SimNode

    def change(self, change: PartitionChange) -> None:
        before = self.table.to_json()
        super().change(change)
        self.sim.made(self, before)


@dataclass
class Commit:
    epoch: int  # of the primary whose barrier said durable
    key: str    # the table (its JSON, as in the store)


class TableSimulation(AsyncWorld):
    def __init__(self, seed: int, *, nodes: int = 3, duration: float = 30.0,
                 change_rate: float = CHANGE_RATE, partitions: int | None = None,
                 trace: bool = False, **kw: Any) -> None:
        kw.setdefault("faults", FAULTS)
        kw.setdefault("stability", True)
        unsafe = kw.setdefault("unsafe", Unsafe())
        if not isinstance(unsafe, Unsafe):
            raise TypeError("the table workload takes its own Unsafe (the coordinator's rules)")
        self.rules = unsafe
        self.partitions = partitions
        super().__init__(seed, nodes=nodes, duration=duration,
                         trace_tail=None if trace else w.TRACE_TAIL, **kw)
        self.change_rate = change_rate
        self.coordinators: dict[str, WatchedCoordinator] = {}
        self.tables: dict[str, PartitionTable] = {EMPTY: PartitionTable()}  # key -> table
        self.parents: dict[str, set[str]] = {}   # a table made -> the tables it was made from
        self.made_in: dict[str, int] = {}        # a table made -> the first epoch that made it
        # per epoch: its primary's table from seq 0 on, (seq, key) at each change
        self.history: dict[int, list[tuple[int, str]]] = {}
        self.chain: dict[int, Commit] = {}       # ptid -> the committed table (a line down)
        self.last: dict[str, str] = {}           # node -> its table in memory when last checked
        self.durable: dict[str, str] = dict.fromkeys(self.names, EMPTY)  # on its disk
        self.drained: list[str] = []             # the operator's drained nodes
        self.operating = False
        self.replaced: set[str] = set()  # nodes whose catch-up replaced a table since a sync

    # -- the nodes' coordinators ---------------------------------------------------------

    def make_layers(self, node: SimNode) -> list[TableCoordinator]:
        coord = WatchedCoordinator(node.store, self.names, partitions=self.partitions,
                                   unsafe=self.rules.coordinator())
        coord.sim, coord.node = self, node
        self.coordinators[node.name] = coord
        return [coord]

    def make_primary(self, *args: Any, **kw: Any) -> Primary:
        """The primary's table at seq 0 of its epoch (before its coordinator is attached)."""
        broker = kw.get("broker", args[0] if args else None)
        node = next(n for n in self.nodes.values() if n.broker is broker)
        epoch = kw["epoch"]
        key = self.key(node)
        self.history[epoch] = [(0, key)]
        top = self.top()
        if top is not None and not self.extends(key, top.key):
            self.violate(f"(b) {node.name}, primary of epoch {epoch}, starts from ptid "
                         f"{self.ptid(key)}, not from the committed ptid {self.ptid(top.key)} "
                         f"(epoch {top.epoch}) or one made from it")
        return super().make_primary(*args, **kw)

    def made(self, coord: WatchedCoordinator, before: str) -> None:
        """``coord`` changed its table (the one path, ``TableCoordinator.change``)."""
        primary = coord.primary
        assert isinstance(primary, Primary)
        key = self.remember(coord.table.to_json())
        self.parents.setdefault(key, set()).add(before)
        self.made_in.setdefault(key, primary.epoch)
        self.history[primary.epoch].append((primary.seq, key))
        self.counts["changes"] += 1
        if not self.operating:
            if self.ptid(before) != 0:
                self.violate(f"(e) {coord.node.name}, primary of epoch {primary.epoch}, changed "
                             f"the table it holds (ptid {self.ptid(before)} -> "
                             f"{coord.table.ptid}) with no operator asking")
            self.counts["created"] += 1
            self.note(f"{coord.node.name} creates the partition table (epoch {primary.epoch})")

    # -- the operator ----------------------------------------------------------------------

    def start(self) -> None:
        super().start()
        if self.change_rate > 0:
            self.after(self.rng.expovariate(self.change_rate), self._operate)

    def _operate(self) -> None:
        if self.calm:
            return
        self.after(self.rng.expovariate(self.change_rate), self._operate)
        node = self.serving_now
        if node is not None:
            node.run(lambda: self._operate_on(node))

    def _operate_on(self, node: SimNode) -> None:
        coord = self.coordinators[node.name]
        if node.primary is None or coord.primary is None or not node.serves_clients():
            return
        node.charge(self.costs.client_op)
        table = coord.table
        if not table.exists:
            return
        change, what = self._next_change(table)
        if change is None:
            self.counts["no change"] += 1
            return
        self.operating = True
        try:
            coord.change(change)
        finally:
            self.operating = False
        self.counts[what.split()[0]] += 1
        self.note(f"operator on {node.name}: {what} (ptid {change.ptid})")
        self.ask_commit(node)

    def _next_change(self, table: PartitionTable) -> tuple[PartitionChange | None, str]:
        """What the operator does next: a learner caught up, a node back, a node drained."""
        rng = self.rng
        learners = [(p, c.node) for p, row in enumerate(table.rows) for c in row
                    if c.state is OUT]
        r = rng.random()
        if learners and r < 0.5:
            p, name = rng.choice(learners)
            return table.replicated(p, name), f"replicated {p} on {name}"
        if self.drained and (r < 0.75 or len(self.drained) >= len(self.names) - 2):
            name = self.drained.pop(rng.randrange(len(self.drained)))
            return table.tweak(self.names, exclude=self.drained), f"back {name}"
        if len(self.drained) >= len(self.names) - 2:
            return None, "nothing"
        name = rng.choice([n for n in self.names if n not in self.drained])
        self.drained.append(name)
        return table.tweak(self.names, exclude=self.drained), f"drain {name}"

    # -- commits ---------------------------------------------------------------------------

    def ask_commit(self, node: SimNode) -> None:
        """The table the serving primary holds now is committed once its barrier answers."""
        primary = node.primary
        if primary is None or not node.serves_clients():
            return
        epoch, key = primary.epoch, self.key(node)
        node.broker.after_durable(lambda: self.committed(epoch, key))

    def on_serving(self, node: SimNode, epoch: int, decisions: dict[str, str]) -> None:
        self.ask_commit(node)

    def committed(self, epoch: int, key: str) -> None:
        ptid = self.ptid(key)
        if ptid == 0:
            return
        known = self.chain.get(ptid)
        if known is not None:
            if known.key != key:
                self.violate(f"(a) ptid {ptid} committed twice, two tables: epoch "
                             f"{known.epoch} {self.tables[known.key]!r} and epoch {epoch} "
                             f"{self.tables[key]!r}")
            return
        top = self.top()
        line = self.line(key, top.key if top is not None else EMPTY)
        if line is None:
            assert top is not None
            self.violate(f"(b) the table committed at ptid {ptid} (epoch {epoch}) is not made "
                         f"from the one committed at ptid {self.ptid(top.key)} (epoch "
                         f"{top.epoch})")
        for k in line or ():
            self.chain[self.ptid(k)] = Commit(epoch, k)
        self.counts["committed"] = ptid  # the highest ptid committed
        for later, entries in sorted(self.history.items()):
            if later > epoch and not self.extends(entries[0][1], key):
                self.violate(f"(b) the primary of epoch {later} started from ptid "
                             f"{self.ptid(entries[0][1])}, not from ptid {ptid} committed in "
                             f"epoch {epoch} nor one made from it")

    def top(self) -> Commit | None:
        return self.chain[max(self.chain)] if self.chain else None

    def is_committed(self, key: str) -> bool:
        commit = self.chain.get(self.ptid(key))
        return commit is not None and commit.key == key

    # -- tables and their lines ------------------------------------------------------------

    def key(self, node: SimProcess) -> str:
        return self.remember(node.store.get_meta(TABLE_KEY) or EMPTY)

    def remember(self, key: str) -> str:
        if key not in self.tables:
            self.tables[key] = PartitionTable.from_json(key)
        return key

    def ptid(self, key: str) -> int:
        return self.tables[key].ptid

    def line(self, new: str, old: str) -> list[str] | None:
        """The tables from ``new`` down to ``old`` (``old`` excluded) along the changes made,
        or None if ``new`` is not made from ``old``."""
        if new == old:
            return []
        low = self.ptid(old)
        came: dict[str, str | None] = {new: None}
        frontier = [new]
        while frontier:
            nxt = []
            for k in frontier:
                for p in sorted(self.parents.get(k, ())):
                    if p in came:
                        continue
                    came[p] = k
                    if p == old:
                        out, at = [], came[p]
                        while at is not None:
                            out.append(at)
                            at = came[at]
                        return out
                    if self.ptid(p) > low:
                        nxt.append(p)
            frontier = nxt
        return None

    def extends(self, new: str, old: str) -> bool:
        return self.line(new, old) is not None

    # -- the checks ------------------------------------------------------------------------

    def signature(self) -> tuple[Any, ...]:
        out: list[Any] = [len(self.chain), self.serving_now and self.serving_now.name]
        for node in self.nodes.values():
            primary, backup = node.primary, node.ha.backup
            out += [node.incarnation, node.alive, node.ha.phase, node.store.get_meta(TABLE_KEY),
                    primary.seq if primary is not None else None,
                    (backup.epoch, backup.applied_seq, backup.caught_up)
                    if backup is not None else None]
        return tuple(out)

    def check(self) -> None:
        for node in self.nodes.values():
            if not node.alive:
                continue
            key = self.key(node)
            before = self.last.get(node.name)
            if before is not None and before != key:
                self.moved(node, before, key)
            self.last[node.name] = key
            self.agreement(node, key)

    def agreement(self, node: SimNode, key: str) -> None:
        """(a) on one node: its log's table; a committed ptid's table if it follows a primary
        of the commit's epoch or a later one."""
        primary, backup = node.primary, node.ha.backup
        epoch = None
        if primary is not None:
            epoch = primary.epoch
        elif backup is not None and backup.caught_up and node.ha.core.following is not None:
            epoch = backup.epoch
            entries = self.history.get(epoch)
            if entries:
                at = bisect.bisect_right(entries, (backup.applied_seq, "\uffff")) - 1
                if at >= 0 and entries[at][1] != key:
                    self.violate(f"(a) {node.name}, backup of epoch {epoch} at seq "
                                 f"{backup.applied_seq}, holds ptid {self.ptid(key)}; the "
                                 f"primary held ptid {self.ptid(entries[at][1])} at seq "
                                 f"{entries[at][0]}: {self.tables[key]!r} vs "
                                 f"{self.tables[entries[at][1]]!r}")
        commit = self.chain.get(self.ptid(key))
        if epoch is not None and commit is not None and commit.key != key \
                and epoch >= commit.epoch:
            self.violate(f"(a) {node.name} ({node.ha.phase}, epoch {epoch}) holds at ptid "
                         f"{self.ptid(key)} a table other than the one committed in epoch "
                         f"{commit.epoch}")

    def moved(self, node: SimNode, before: str, key: str) -> None:
        """(c) a node's table in memory went from ``before`` to ``key``."""
        if self.extends(key, before):
            return
        backup = node.ha.backup
        what = f"{node.name}'s table went from ptid {self.ptid(before)} to {self.ptid(key)}"
        if backup is None:
            self.violate(f"(c) {what}, not by a catch-up (it follows nobody)")
            return
        self.kept_committed(before, key, what)
        if self.made_in.get(before, backup.epoch) >= backup.epoch:
            self.violate(f"(c) {what}: the table replaced was not a deposed primary's (made "
                         f"in epoch {self.made_in.get(before)}; it follows epoch "
                         f"{backup.epoch})")
        self.replaced.add(node.name)
        self.counts["replaced"] += 1
        self.note(f"{what} (a catch-up replaced an uncommitted change)")

    def kept_committed(self, before: str, key: str, what: str) -> None:
        """``before`` is not committed, and ``key`` extends every committed table it does."""
        if self.is_committed(before) or any(
                not self.extends(key, c.key) for c in self.chain.values()
                if self.ptid(c.key) <= self.ptid(before) and self.extends(before, c.key)):
            self.violate(f"(c) {what}: a committed table replaced")

    def on_sync(self, node: SimProcess) -> None:
        """(c) on the disk, what a crash now keeps: a move that is no extension is one the
        node made in memory since its last sync, by a catch-up (checked there)."""
        if not isinstance(node, SimNode) or self.nodes.get(node.name) is not node:
            return
        key = self.remember(node.store.disk.meta.get(TABLE_KEY) or EMPTY)
        before = self.durable[node.name]
        if key != before and not self.extends(key, before):
            what = (f"{node.name}'s table on disk went from ptid {self.ptid(before)} to "
                    f"{self.ptid(key)}")
            if node.name not in self.replaced:
                self.violate(f"(c) {what}, no catch-up replaced it since the last sync")
            self.kept_committed(before, key, what)
        self.durable[node.name] = key
        self.replaced.discard(node.name)

    def restart(self, name: str) -> None:
        super().restart(name)
        node = self.nodes[name]
        key = self.key(node)
        if key != self.durable[name]:
            self.violate(f"{name} restarted with ptid {self.ptid(key)}, its disk holds "
                         f"{self.ptid(self.durable[name])}")
        self.last[name] = key
        self.replaced.discard(name)  # what it did in memory is gone with the process

    # -- the end of a run ------------------------------------------------------------------

    calm_note = "no new faults; the operator stops"

    def final_checks(self, serving: SimNode) -> None:
        """(d) every node holds the serving primary's table."""
        self.check()
        expected = self.key(serving)
        for node in self.nodes.values():
            key = self.key(node)
            if key != expected:
                self.violate(f"(d) {node.name} holds ptid {self.ptid(key)} at the end, the "
                             f"primary {serving.name} ptid {self.ptid(expected)}: "
                             f"{self.tables[key]!r} vs {self.tables[expected]!r}")
        self.counts["final ptid"] = self.ptid(expected)
        self.counts["tables made"] = len(self.parents)


# -- running seeds ---------------------------------------------------------------------------


def run_seed(seed: int, **kw: Any) -> SimResult:
    logging.disable(logging.CRITICAL)  # the nodes' warnings and errors: the trace tells
    try:
        return asyncio.run(TableSimulation(seed, **kw).run())
    finally:
        logging.disable(logging.NOTSET)


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    """``brokerha cluster simulate --workload table``: every seed of this workload."""
    return seed_runner.run_many(run_seed, seeds, jobs=jobs, **kw)
