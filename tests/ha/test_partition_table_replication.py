"""The partition table in the metadata log (issue 35, stage 1): the coordinator on the
primary makes it as a ``pt`` event, backups apply it (and refuse a ptid out of order), a
joining backup gets it whole (``ps``) in its catch-up, and the store keeps it, so a
restarted node and a new primary hold it and never make another."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from brokerha.backup.backup import Backup
from brokerha.cluster import replication as R
from brokerha.cluster.partition_table import PartitionChange, PartitionTable
from brokerha.cluster.protocol import PacketCodec
from brokerha.cluster.replication import Events, ReplicationError
from brokerha.partition.coordinator import TABLE_KEY, StoredTable, TableCoordinator
from brokerha.primary.primary import Primary
from brokerha.store.sql import SQLStore
from tests.ha.harness import Cluster

NODES = ["n1", "n2", "n3"]


def coordinators(c: Cluster, **options: int) -> dict[str, TableCoordinator]:
    return {name: TableCoordinator(node.broker.store, NODES, **options)
            for name, node in c.nodes.items()}


def follow(c: Cluster, name: str, coordinator: TableCoordinator) -> Backup:
    node = c.nodes[name]
    node.backup = Backup(node.broker, me=name, epoch=c.epoch, position=(-1, -1),
                         layers={k: coordinator.replica for k in coordinator.kinds})
    c.join(name)
    return node.backup


def test_pt_and_ps_events_round_trip_through_the_replication_codec() -> None:
    table = PartitionTable.empty(9, 2)
    change = table.tweak(NODES)
    assert change is not None
    table.apply(change)
    events = [R.PartitionTableChanged(R.PARTITION_TABLE_CHANGED, *change.as_wire()),
              R.PartitionTableSnapshot(R.PARTITION_TABLE, *table.as_wire())]
    codec = PacketCodec()
    ((_, packet),) = PacketCodec().feed(b"".join(codec.encode_parts(3, Events(1, 5, events))))
    assert isinstance(packet, Events)
    pt, ps = packet.events
    assert isinstance(pt, R.PartitionTableChanged) and isinstance(ps, R.PartitionTableSnapshot)
    assert PartitionChange.from_wire(*pt[1:]) == change
    assert PartitionTable.from_wire(*ps[1:]) == table


def test_a_bad_pt_event_is_refused_by_the_codec() -> None:
    bad = msgpack.packb([1, Events.CODE, [1, 0, [["pt", 1, 2, 3]]]])
    with pytest.raises(Exception, match="'pt' has 4 fields"):
        PacketCodec().feed(len(bad).to_bytes(4, "big") + bad)


def test_the_primary_makes_the_table_and_every_backup_holds_the_same() -> None:
    c = Cluster(3)
    tables = coordinators(c)
    tables["n1"].attach_primary(c.primary)
    table = tables["n1"].table
    assert table.ptid == 1 and table.partitions == 9 and table.num_replicas == 2
    follow(c, "n2", tables["n2"])  # joins after: the catch-up's ps
    follow(c, "n3", tables["n3"])
    c.pump()
    assert tables["n2"].table == tables["n3"].table == table
    assert tables["n1"].status()["coordinator"] and not tables["n2"].status()["coordinator"]
    # a change goes live as a pt, one ptid on
    change = table.tweak(NODES, exclude=["n3"])
    assert change is not None
    tables["n1"].change(change)
    c.pump()
    assert tables["n2"].table.ptid == tables["n3"].table.ptid == 2
    assert tables["n2"].table == tables["n3"].table == tables["n1"].table
    # every node's store holds it
    for name in NODES:
        raw = c.nodes[name].broker.store.get_meta(TABLE_KEY)
        assert raw is not None and PartitionTable.from_json(raw) == table


def test_a_pt_that_is_not_the_next_ptid_is_refused_and_the_backup_joins_again() -> None:
    c = Cluster(2)
    tables = coordinators(c)
    tables["n1"].attach_primary(c.primary)
    backup = follow(c, "n2", tables["n2"])
    c.pump()
    table = tables["n1"].table
    skipped = PartitionChange(table.ptid + 2, table.num_replicas, table.partitions, {})
    with pytest.raises(ReplicationError, match="ptid"):
        backup.receive(Events(c.epoch, backup.applied_seq + 1, [
            R.PartitionTableChanged(R.PARTITION_TABLE_CHANGED, *skipped.as_wire())]))
    assert tables["n2"].table == table  # nothing taken
    with pytest.raises(Exception, match="ptid"):
        tables["n1"].change(skipped)  # nor on the primary: nothing emitted
    assert tables["n1"].table.ptid == 1


def test_a_catch_up_replaces_a_table_the_primary_never_committed() -> None:
    c = Cluster(2)
    tables = coordinators(c)
    tables["n1"].attach_primary(c.primary)
    # n2 holds a table of its own (a deposed primary's that never reached a majority)
    other = PartitionTable.empty(4, 1)
    other.apply(other.tweak(["n2", "x"]))  # type: ignore[arg-type]
    tables["n2"].stored.replace(other)
    follow(c, "n2", tables["n2"])
    c.pump()
    assert tables["n2"].table == tables["n1"].table


def test_a_new_primary_keeps_the_table_it_holds() -> None:
    c = Cluster(2)
    tables = coordinators(c, partitions=5)
    tables["n1"].attach_primary(c.primary)
    follow(c, "n2", tables["n2"])
    c.pump()
    held = tables["n2"].table.as_wire()
    # n2 is elected: a Primary of a later epoch on its broker; its coordinator attaches
    c.nodes["n2"].backup = None
    c.primary.close()
    new = Primary(c.nodes["n2"].broker, me="n2", members=2, epoch=2, start_seq=100,
                  clock=c.clock, backup_timeout=5.0)
    tables["n2"].attach_primary(new)
    assert tables["n2"].table.as_wire() == held and tables["n2"].changes == 0
    assert new.seq == 100  # nothing emitted: the table is not made or tweaked again


def test_the_store_keeps_the_table_across_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'node.db'}"
    store = SQLStore(url)
    store.start(None)
    stored = StoredTable(store)
    assert not stored.table.exists
    table = PartitionTable.empty(7, 2)
    change = table.tweak(NODES)
    assert change is not None
    stored.apply(change)
    drain = stored.table.tweak(NODES, exclude=["n2"])
    assert drain is not None
    stored.apply(drain)
    store.close()
    again = SQLStore(url)
    try:
        restored = StoredTable(again)
        assert restored.table == stored.table and restored.table.ptid == 2
        coordinator = TableCoordinator(again, NODES)
        assert coordinator.table == stored.table
    finally:
        again.close()


def test_a_store_value_that_is_no_table_is_taken_as_none() -> None:
    c = Cluster(1)
    c.broker.store.put_meta(TABLE_KEY, "not json")
    assert not StoredTable(c.broker.store).table.exists


def test_defaults_three_partitions_per_node_and_replicas_capped() -> None:
    c = Cluster(1)
    assert TableCoordinator(c.broker.store, ["a", "b"]).replicas == 1
    assert TableCoordinator(c.broker.store, ["a", "b"]).partitions == 6
    assert TableCoordinator(c.broker.store, NODES, partitions=4, replicas=7).replicas == 2
    solo = TableCoordinator(c.broker.store, ["a"])
    solo.attach_primary(c.primary)
    assert solo.table.partitions == 3 and solo.table.num_replicas == 0


def test_cluster_config_takes_partitions_and_partition_replicas(tmp_path: Path) -> None:
    from brokerha.node.cluster_config import parse_cluster
    from brokerha.node.config import ConfigError

    base = {"name": "dc1", "secret": "x" * 16,
            "nodes": [{"name": "n1", "amqp": "127.0.0.1:5672"}]}
    cfg = parse_cluster(dict(base), "t", tmp_path)
    assert (cfg.partitions, cfg.partition_replicas) == (None, 2)
    cfg = parse_cluster({**base, "partitions": 12, "partition_replicas": 1}, "t", tmp_path)
    assert (cfg.partitions, cfg.partition_replicas) == (12, 1)
    for bad in ({"partitions": 0}, {"partitions": "9"}, {"partition_replicas": -1},
                {"partitions": True}):
        with pytest.raises(ConfigError, match="partition"):
            parse_cluster({**base, **bad}, "t", tmp_path)
