"""Replication with the SQL store: what a backup keeps on disk, paged bodies on the primary."""

from __future__ import annotations

from pathlib import Path

from brokerha.backup.backup import Backup
from brokerha.broker.broker import Broker, Limits
from brokerha.broker.paging import PAGED
from brokerha.ha.simulation.transactions import contents
from brokerha.primary.primary import Primary
from brokerha.store.factory import open_store
from tests.ha.harness import Cluster, Node, carry, consume, message, publish, wire
from tests.store.harness import StoreNode


def test_a_restarted_backup_finds_its_persistent_messages_in_its_store(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'n2.db'}"
    c = Cluster(2, stores={"n2": open_store(url, tmp_path)})
    vh = c.broker.vhosts["/"]
    dq = vh.declare_queue("dq", owner=None, durable=True)
    vh.declare_queue("tq", owner=None)
    c.follow("n2")
    for i in range(4):
        publish(c.broker, b"p%d" % i, rk="dq", persistent=True)
    publish(c.broker, b"transient", rk="dq")
    publish(c.broker, b"t", rk="tq", persistent=True)
    c.pump()
    assert consume(dq, 1) == [b"p0"]
    c.pump()
    c.node("n2").broker.store.close()

    store = open_store(url, tmp_path)
    broker = Broker("n2", clock=c.clock, store=store)
    broker.restore(store.load())
    restored = broker.vhosts["/"]
    assert "tq" not in restored.queues  # not durable: gone with the restart
    primary_ids = {e.position: e.message.body for e in dq.ready}
    assert {e.position: e.message.body for e in restored.queues["dq"].ready} == {
        p: b for p, b in primary_ids.items() if b != b"transient"}

    # it joins again: only what the store could not keep is sent
    c.nodes["n2"] = Node("n2", c.clock, broker=broker)
    c.primary.backup_lost("n2", "restarted")
    c.follow("n2", position=(1, 0))
    c.pump()
    assert contents(broker) == contents(c.broker)
    catch_up = c.primary.status()["backups"]["n2"]["catch_up"]
    assert {k: catch_up[k] for k in ("sent", "skipped", "dropped")} == {
        "sent": 2, "skipped": 3, "dropped": 0}  # the transient message and the tq one
    store.close()


def test_a_joining_backup_gets_bodies_the_primary_paged_out(tmp_path: Path) -> None:
    primary_node = StoreNode(f"sqlite:///{tmp_path / 'n1.db'}",
                             limits=Limits(queue_max_memory=1000))
    try:
        broker = primary_node.broker
        primary = Primary(broker, me="n1", members=2, epoch=1, start_seq=0,
                          clock=broker.clock, backup_timeout=5.0)
        q = primary_node.call(lambda: broker.vhosts["/"].declare_queue(
            "q", owner=None, durable=True))
        for i in range(20):
            primary_node.call(lambda i=i: q.enqueue(message(b"%03d" % i * 100, persistent=True)))
        primary_node.sync()
        primary_node.spin(0.05)
        assert any(e.paged == PAGED for e in q.ready)
        backup_broker = Broker("n2")
        backup_broker.add_vhost("/")
        backup = Backup(backup_broker, me="n2", epoch=1, position=(0, 0))
        primary.backup_joined(wire(backup.join_message()))  # type: ignore[arg-type]
        while carry(primary, backup):
            pass
        bodies = [e.message.body for e in backup_broker.vhosts["/"].queues["q"].ready]
        assert bodies == [b"%03d" % i * 100 for i in range(20)]
        assert backup.caught_up
    finally:
        primary_node.close()
