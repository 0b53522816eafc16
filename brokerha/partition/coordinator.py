"""The table coordinator: the metadata primary decides the partition table (issue 35).

Stage 1 of docs/ha.md "Partitions": the table exists, is the same on every
node and survives restarts and failovers; nothing routes by it yet.

- ``StoredTable``: a node's copy of the table (``cluster/partition_table.py``),
  written to the store (meta ``partition_table``, the whole table as JSON)
  with each change, so it commits with the events around it and a restart
  finds it.
- ``TableReplica``: a backup's side, the ``LayerReplica`` of the ``pt`` and
  ``ps`` events (``cluster/replication.py``). A ``pt`` that is not the next
  ptid is refused (``ReplicationError``: the backup joins again, and the
  catch-up's ``ps`` gives it the primary's table whole).
- ``TableCoordinator``: a ``PrimaryLayer`` (``ha/member.py``, like the TxLog
  bridge) attached to the metadata group's primary. With no table yet it
  creates one (P = ``[cluster] partitions``, default 3 x nodes; NR =
  ``[cluster] partition_replicas``, default 2, capped at nodes - 1) as one
  ``pt`` at ptid 1; a table that exists is never created or tweaked again by
  a new primary: a primary holds every committed ``pt`` (vote floors), and an
  uncommitted one of a deposed primary is replaced on its node by the next
  catch-up's ``ps``. A joining backup gets the table in its catch-up.

``Unsafe`` breaks a rule of this module on purpose (the table workload of the
simulation, ``partition/simulation.py``, must catch each).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from brokerha.cluster import replication as R
from brokerha.cluster.partition_table import (
    PartitionChange,
    PartitionTable,
    PartitionTableError,
)
from brokerha.cluster.replication import ReplicationError
from brokerha.seed_runner import UnsafeRules

log = logging.getLogger("brokerha.partition")

TABLE_KEY = "partition_table"  # the store's meta key
DEFAULT_REPLICAS = 2  # NR: a partition on three nodes
PARTITIONS_PER_NODE = 3  # P defaults to 3 x nodes


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the table's coordinator and replica to break on purpose (simulations only)."""

    recreate_table: bool = False  # a new primary makes a fresh table over the one it holds
    keep_own_table: bool = False  # a backup keeps its table over a catch-up's of no higher ptid


class MetaStore(Protocol):
    """What the table needs of the node's store (``broker/storage.py`` ``Store``)."""

    def put_meta(self, key: str, value: str) -> None: ...

    def get_meta(self, key: str) -> str | None: ...


class EventLog(Protocol):
    """What the coordinator needs of the primary (``primary/primary.py`` ``Primary``)."""

    catch_up_providers: list[Callable[[], list[Any]]]

    def emit(self, event: Any) -> int: ...


def default_partitions(nodes: int) -> int:
    return PARTITIONS_PER_NODE * max(1, nodes)


def change_event(change: PartitionChange) -> Any:
    return R.PartitionTableChanged(R.PARTITION_TABLE_CHANGED, *change.as_wire())


def table_event(table: PartitionTable) -> Any:
    return R.PartitionTableSnapshot(R.PARTITION_TABLE, *table.as_wire())


class StoredTable:
    """This node's copy of the partition table, kept in the store."""

    def __init__(self, store: MetaStore) -> None:
        self.store = store
        self.table = self._load()

    def _load(self) -> PartitionTable:
        raw = self.store.get_meta(TABLE_KEY)
        if raw is None:
            return PartitionTable()
        try:
            return PartitionTable.from_json(raw)
        except PartitionTableError:
            # a catch-up's ``ps`` replaces it; as a primary this node would make a new one
            log.error("store meta %s is not a partition table (%r); taken as none",
                      TABLE_KEY, raw[:80])
            return PartitionTable()

    def apply(self, change: PartitionChange) -> None:
        """``PartitionTableError`` (nothing changed) unless it is the next ptid."""
        self.table.apply(change)
        self._save()

    def replace(self, table: PartitionTable) -> None:
        if table == self.table:
            return
        self.table.replace(table)
        self._save()

    def _save(self) -> None:
        self.store.put_meta(TABLE_KEY, self.table.to_json())


class TableReplica:
    """A backup's side: the primary's ``pt``/``ps`` events applied to the stored copy."""

    def __init__(self, stored: StoredTable, unsafe: Unsafe | None = None) -> None:
        self.stored = stored
        self.unsafe = unsafe or Unsafe()

    def apply(self, event: Any) -> None:
        kind = event[0]
        try:
            if kind == R.PARTITION_TABLE_CHANGED:
                self.stored.apply(PartitionChange.from_wire(*event[1:]))
            elif kind == R.PARTITION_TABLE:
                table = PartitionTable.from_wire(*event[1:])
                if self.unsafe.keep_own_table and table.ptid <= self.stored.table.ptid:
                    return  # (unsafe) "a ptid never goes down": a deposed change survives
                self.stored.replace(table)
            else:
                raise ReplicationError(f"not a partition table event: {kind!r}")
        except (PartitionTableError, TypeError, ValueError) as exc:
            raise ReplicationError(f"partition table event refused: {exc}") from exc

    def after_durable(self, callback: Callable[[], None]) -> None:
        callback()  # written to the store: its sync before the acknowledgement covers it


class TableCoordinator:
    """The metadata primary's decider of the partition table (a ``StoreLayer``)."""

    kinds = R.PARTITION_EVENTS

    def __init__(self, store: MetaStore, nodes: Iterable[str], *,
                 partitions: int | None = None, replicas: int = DEFAULT_REPLICAS,
                 unsafe: Unsafe | None = None) -> None:
        self.nodes = sorted(nodes)
        if not self.nodes:
            raise ValueError("a partition table needs nodes")
        self.partitions = partitions or default_partitions(len(self.nodes))
        self.replicas = max(0, min(replicas, len(self.nodes) - 1))
        self.unsafe = unsafe or Unsafe()
        self.stored = StoredTable(store)
        self.replica = TableReplica(self.stored, self.unsafe)
        self.primary: EventLog | None = None
        self.changes = 0  # changes this node decided (since it started)

    @property
    def table(self) -> PartitionTable:
        return self.stored.table

    # -- PrimaryLayer ----------------------------------------------------------------------

    def attach_primary(self, primary: EventLog) -> None:
        """This node is the metadata primary: a joiner gets the table; none yet, make it."""
        self.primary = primary
        primary.catch_up_providers.append(self.catch_up_events)
        if not self.table.exists:
            self.create()
        elif self.unsafe.recreate_table:
            self._recreate()
        elif self.table.nodes() != self.nodes:
            log.warning("partition table (ptid %d) places cells on %s; the cluster's nodes are "
                        "%s: kept as it is (moves are stage 5 of docs/ha.md Partitions)",
                        self.table.ptid, ", ".join(self.table.nodes()), ", ".join(self.nodes))

    def detach_primary(self) -> None:
        self.primary = None

    def catch_up_events(self) -> list[Any]:
        """The table as it is at the join (the backup's becomes it)."""
        return [table_event(self.table)]

    # -- changes -----------------------------------------------------------------------------

    def create(self) -> None:
        change = PartitionTable.empty(self.partitions, self.replicas).tweak(self.nodes)
        assert change is not None and change.ptid == 1
        self.change(change)
        log.warning("partition table created: %d partitions on %d nodes, %d replicas each "
                    "(ptid 1)", self.partitions, len(self.nodes), self.replicas)

    def _recreate(self) -> None:
        """(unsafe) A fresh placement over the table this new primary holds."""
        fresh = PartitionTable.empty(self.partitions, self.replicas)
        first = fresh.tweak(self.nodes)
        assert first is not None
        fresh.apply(first)
        change = self.table.change_to(fresh.rows, fresh.num_replicas)
        if change is not None:
            self.change(change)

    def change(self, change: PartitionChange) -> None:
        """Apply ``change`` here and put it in the metadata log: the one path of every change
        (``PartitionTableError`` unless it is the next ptid; nothing emitted then)."""
        if self.primary is None:
            raise PartitionTableError("only the metadata primary changes the partition table")
        self.stored.apply(change)
        self.primary.emit(change_event(change))
        self.changes += 1

    def status(self) -> dict[str, Any]:
        """This node's copy, compact (``ctl status --json`` per node)."""
        ptid, num_replicas, rows = self.table.as_wire()
        return {"ptid": ptid, "num_replicas": num_replicas, "partitions": len(rows),
                "rows": rows, "coordinator": self.primary is not None}
