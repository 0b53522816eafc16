"""Definitions: one change record, one apply, listeners, cascades, a whole set's diff."""

from __future__ import annotations

import pytest

from brokerha.broker import definitions as D
from brokerha.broker.auth import AuthenticationFailed, check_password, hash_password
from brokerha.broker.broker import Broker
from brokerha.broker.definitions import DefinitionChange, Definitions
from brokerha.broker.errors import AccessRefused
from brokerha.broker.storage import MemoryStore


def test_every_change_is_one_record_told_to_listeners_in_order() -> None:
    defs = Definitions()
    seen: list[tuple[str, DefinitionChange]] = []
    defs.subscribe(lambda c: seen.append(("a", c)))
    defs.subscribe(lambda c: seen.append(("b", c)))
    change = D.vhost_set("v", description="test")
    assert defs.apply(change) is None
    assert defs.vhosts == {"v": {"description": "test", "tags": []}}
    assert seen == [("a", change), ("b", change)]


def test_a_change_that_changes_nothing_tells_nobody() -> None:
    defs = Definitions()
    defs.apply(D.vhost_set("v"))
    seen: list[DefinitionChange] = []
    defs.subscribe(seen.append)
    defs.apply(D.vhost_set("v"))
    defs.apply(DefinitionChange(D.USER, ("nobody",), None))
    assert seen == []


def test_a_bad_kind_or_key_is_refused() -> None:
    with pytest.raises(ValueError):
        DefinitionChange("queue", ("q",), {})
    with pytest.raises(ValueError):
        DefinitionChange(D.PERMISSION, ("only-user",), {})


def test_deleting_a_user_takes_its_permissions_first() -> None:
    defs = Definitions()
    defs.apply_all([D.vhost_set("v"), D.user_set("u", hash_password("p")),
                    D.user_set("other", hash_password("p")),
                    D.permission_set("u", "v"), D.permission_set("other", "v"),
                    D.topic_permission_set("u", "v", "amq.topic", "^a")])
    changes = defs.deleting(D.USER, "u")
    assert [(c.kind, c.key, c.value) for c in changes] == [
        (D.PERMISSION, ("u", "v"), None),
        (D.TOPIC_PERMISSION, ("u", "v", "amq.topic"), None),
        (D.USER, ("u",), None)]
    assert defs.delete(D.USER, "u")
    assert [k for k, _ in defs.permissions()] == [("other", "v")]
    assert defs.topic_permissions() == []
    assert not defs.delete(D.USER, "u")


def test_deleting_a_vhost_takes_its_permissions_and_policies() -> None:
    defs = Definitions()
    policy = {"pattern": ".*", "apply-to": "all", "definition": {"max-length": 1}, "priority": 0}
    defs.apply_all([D.vhost_set("v"), D.vhost_set("w"), D.user_set("u", hash_password("p")),
                    D.permission_set("u", "v"), D.permission_set("u", "w"),
                    DefinitionChange(D.POLICY, ("v", "p"), policy),
                    DefinitionChange(D.OPERATOR_POLICY, ("v", "o"), policy),
                    DefinitionChange(D.POLICY, ("w", "p"), policy)])
    defs.delete(D.VHOST, "v")
    assert set(defs.vhosts) == {"w"}
    assert [k for k, _ in defs.permissions()] == [("u", "w")]
    assert [k for k, _ in defs.items(D.POLICY)] == [("w", "p")]
    assert defs.items(D.OPERATOR_POLICY) == []


def test_changes_to_a_whole_set_deletes_dependents_first_then_sets() -> None:
    defs = Definitions()
    defs.apply_all([D.vhost_set("old"), D.user_set("u", "h"), D.permission_set("u", "old")])
    target = Definitions()
    target.apply_all([D.vhost_set("new"), D.user_set("u", "h2"), D.permission_set("u", "new")])
    changes = defs.changes_to(target.changes())
    assert [(c.kind, c.key, c.value is None) for c in changes] == [
        (D.PERMISSION, ("u", "old"), True), (D.VHOST, ("old",), True),
        (D.VHOST, ("new",), False), (D.USER, ("u",), False), (D.PERMISSION, ("u", "new"), False)]
    defs.apply_all(changes)
    assert defs.changes() == target.changes()
    assert defs.changes_to(target.changes()) == []


def test_wire_form_round_trips() -> None:
    change = D.topic_permission_set("u", "v", "x", "^w", "^r")
    assert DefinitionChange.from_wire(change.as_wire()) == change
    gone = DefinitionChange(D.USER, ("u",), None)
    assert DefinitionChange.from_wire(gone.as_wire()) == gone


def test_broker_users_follow_the_definitions_in_place() -> None:
    broker = Broker(store=MemoryStore())
    defs = broker.definitions
    defs.apply_all([D.vhost_set("v"), D.user_set("u", hash_password("old")),
                    D.permission_set("u", "v", "^c", "^w", "^r")])
    user = broker.users.authenticate("u", "old", "127.0.0.1")
    user.check("write", "v", "queue", "w1")
    defs.apply(D.user_set("u", hash_password("new")))
    with pytest.raises(AuthenticationFailed):
        broker.users.authenticate("u", "old", "127.0.0.1")
    assert broker.users.authenticate("u", "new", "127.0.0.1") is user
    defs.apply(D.permission_set("u", "v", "^c", "^nothing", "^r"))  # a connection's User sees it
    with pytest.raises(AccessRefused):
        user.check("write", "v", "queue", "w1")
    defs.delete(D.USER, "u")
    assert user.deleted and not user.permissions
    with pytest.raises(AuthenticationFailed):
        broker.users.authenticate("u", "new", "127.0.0.1")


def test_topic_permission_checks_the_routing_key_with_variables() -> None:
    broker = Broker(store=MemoryStore())
    broker.definitions.apply_all([
        D.vhost_set("v"), D.user_set("u", hash_password("p")), D.permission_set("u", "v"),
        D.topic_permission_set("u", "v", "amq.topic", "^{username}\\.", "^public\\.")])
    user = broker.users.users["u"]
    user.check_topic("write", "v", "amq.topic", "u.orders")
    with pytest.raises(AccessRefused, match="access to topic 'x.orders' in exchange "
                                            "'amq.topic' in vhost 'v' refused for user 'u'"):
        user.check_topic("write", "v", "amq.topic", "x.orders")
    user.check_topic("read", "v", "amq.topic", "public.a")
    user.check_topic("write", "v", "other.topic", "anything")  # no topic permission: allowed


def test_broker_vhosts_follow_the_definitions() -> None:
    broker = Broker(store=MemoryStore())
    broker.definitions.apply(D.vhost_set("v"))
    vhost = broker.vhosts["v"]
    vhost.declare_exchange("x", "direct", durable=True)
    q = vhost.declare_queue("q", owner=None, durable=True)
    vhost.bind("x", q, "k")
    broker.definitions.delete(D.VHOST, "v")
    assert "v" not in broker.vhosts and q.deleted
    assert broker.store.queues == {} and broker.store.exchanges == {}  # type: ignore[attr-defined]


def test_store_keeps_the_definitions_and_restore_does_not_write_them_again() -> None:
    store = MemoryStore()
    broker = Broker(store=store)
    broker.definitions.apply_all([D.vhost_set("v"), D.user_set("u", hash_password("p")),
                                  D.permission_set("u", "v")])
    broker.definitions.delete(D.USER, "u")
    loaded = store.load()
    assert [w[0] for w in loaded.definitions] == [D.VHOST]
    again = Broker(store=MemoryStore())
    written: list[DefinitionChange] = []
    again.store.definition_changed = written.append  # type: ignore[method-assign]
    again.restore(loaded)
    assert set(again.vhosts) == {"v"} and written == []


def test_other_hashing_algorithms_of_rabbitmq() -> None:
    for algorithm in ("rabbit_password_hashing_sha512", "rabbit_password_hashing_md5"):
        hashed = hash_password("secret", algorithm=algorithm)
        assert check_password("secret", hashed, algorithm)
        assert not check_password("other", hashed, algorithm)
        assert not check_password("secret", hashed)  # read as SHA-256: the wrong length
