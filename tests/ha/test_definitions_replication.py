"""Definitions (vhosts, users, permissions, policies) on the backups, live and at a join."""

from __future__ import annotations

from brokerha.broker import definitions as D
from brokerha.broker.auth import hash_password
from brokerha.broker.broker import Broker
from brokerha.broker.definitions import DefinitionChange
from brokerha.broker.storage import MemoryStore
from tests.ha.harness import Cluster

POLICY = {"pattern": "^pol\\.", "apply-to": "queues", "definition": {"max-length": 3},
          "priority": 0}


def define(c: Cluster) -> None:
    c.broker.definitions.apply_all([
        D.vhost_set("v", description="team v"), D.user_set("u", hash_password("secret"), ["ops"]),
        D.permission_set("u", "v", "^c", "^w", "^r"),
        D.topic_permission_set("u", "v", "amq.topic", "^t"),
        DefinitionChange(D.POLICY, ("v", "p"), POLICY)])


def joined(c: Cluster) -> Broker:
    """n2 made the primary's backup and caught up: its broker."""
    c.follow("n2")
    c.pump()
    return c.node("n2").broker


def test_a_backup_that_joins_gets_the_primarys_definitions() -> None:
    c = Cluster(2)
    define(c)
    backup = joined(c)
    assert backup.definitions.changes() == c.broker.definitions.changes()
    assert backup.users.authenticate("u", "secret", "127.0.0.1").permissions["v"].write == "^w"
    assert "v" in backup.vhosts


def test_live_changes_reach_the_backup_and_its_store() -> None:
    store = MemoryStore()
    c = Cluster(2, stores={"n2": store})
    backup = joined(c)
    define(c)
    c.broker.definitions.apply(D.user_set("u", hash_password("new")))
    c.pump()
    assert backup.definitions.changes() == c.broker.definitions.changes()
    assert backup.users.authenticate("u", "new", "127.0.0.1").name == "u"
    assert store.load().definitions == [ch.as_wire() for ch in c.broker.definitions.changes()]


def test_a_deleted_vhost_goes_with_its_queues_on_the_backup() -> None:
    c = Cluster(2)
    define(c)
    vh = c.broker.vhosts["v"]
    vh.declare_queue("q", owner=None, durable=True)
    backup = joined(c)
    assert "q" in backup.vhosts["v"].queues
    c.broker.definitions.delete(D.VHOST, "v")
    c.pump()
    assert "v" not in backup.vhosts
    assert backup.definitions.changes() == c.broker.definitions.changes()
    assert [k for k, _ in backup.definitions.permissions()] == []


def test_a_backup_that_was_away_drops_what_the_primary_deleted_meanwhile() -> None:
    c = Cluster(2)
    define(c)
    backup = joined(c)
    c.silent.add("n2")
    c.broker.definitions.delete(D.USER, "u")
    c.broker.definitions.apply(D.vhost_set("w"))
    c.silent.discard("n2")
    c.join("n2")  # joins again: the catch-up's set replaces what it had
    c.pump()
    assert backup.definitions.changes() == c.broker.definitions.changes()
    assert "u" not in backup.users.users and "w" in backup.vhosts
