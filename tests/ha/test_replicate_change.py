"""A changed ``ha-replicate`` applies to existing queues at once (issue 34).

Before, the primary decided a queue's mode once, when it first saw the queue:
a policy changed later applied only to queues declared after it. Now a queue
that becomes replicated whole reaches each backup in a new join's catch-up (the
backups asked to join again, one at a time), its new messages at once; a queue
that no longer is is dropped from the backups (never on the primary).
"""

from __future__ import annotations

from typing import Any

from brokerha.broker.definitions import DefinitionChange
from brokerha.broker.policies import POLICY
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R
from tests.ha.harness import Cluster, consume, publish


def policy(mode: str | None, pattern: str = "^q$", name: str = "ha") -> DefinitionChange:
    value = None if mode is None else {"pattern": pattern, "apply-to": "queues", "priority": 0,
                                       "definition": {"ha-replicate": mode}}
    return DefinitionChange(POLICY, ("/", name), value)


def cluster(members: int = 3, mode: str = "none") -> Cluster:
    c = Cluster(members, policies=True)
    c.broker.definitions.apply(policy(mode))
    vh = c.broker.vhosts["/"]
    vh.declare_exchange("x", "direct")
    q = vh.declare_queue("q", owner=None, durable=True)
    vh.bind("x", q, "k")
    for name in list(c.nodes)[1:]:
        c.follow(name)
    c.pump()
    return c


def copy(c: Cluster, name: str) -> Queue | None:
    return c.node(name).broker.vhosts["/"].queues.get("q")


def bodies(q: Queue | None) -> list[bytes]:
    assert q is not None
    return [e.message.body for e in q.ready]


def test_none_to_all_brings_the_queue_and_its_messages_to_every_backup() -> None:
    c = cluster()
    for i in range(10):
        publish(c.broker, b"old %d" % i, rk="k", exchange="x")
    c.pump()
    assert copy(c, "n2") is None and copy(c, "n3") is None
    q = c.broker.vhosts["/"].queues["q"]
    assert c.primary.replicate_mode(q) == "none"
    c.broker.definitions.apply(policy("all"))
    assert c.primary.replicate_mode(q) == "all" and c.primary.replicate_pending
    assert c.primary.lacking(q) == ["n2", "n3"]
    publish(c.broker, b"new", rk="k", exchange="x")
    ready_seen: list[int] = []

    def watch(_backup: Any) -> None:  # one backup at a time: the other stays ready
        ready_seen.append(len(c.primary.ready_backups()))

    c.check = watch
    c.pump()
    want = [b"old %d" % i for i in range(10)] + [b"new"]
    assert bodies(copy(c, "n2")) == bodies(copy(c, "n3")) == bodies(q) == want
    assert min(ready_seen) == 1 and c.primary.ready_backups() == ["n2", "n3"]
    for name in ("n2", "n3"):  # with its binding, and its messages' positions
        vh = c.node(name).broker.vhosts["/"]
        assert [b.destination.name for b in vh.exchanges["x"].bindings.values()] == ["q"]
        assert [e.position for e in vh.queues["q"].ready] == [e.position for e in q.ready]
    status = c.primary.status()["replicate_changes"]
    assert not status["pending"] and status["applied_queues"] == 1
    assert status["joins_asked"] == 2 and status["backups_to_join_again"] == []
    assert c.primary.lacking(q) == []
    # and it goes on live: a consumer's acks reach the backups
    assert consume(q, 3) == want[:3]
    c.pump()
    assert bodies(copy(c, "n2")) == bodies(copy(c, "n3")) == want[3:]


def test_unacknowledged_deliveries_come_too_and_their_acks_after() -> None:
    c = cluster(mode="configuration")
    q = c.broker.vhosts["/"].queues["q"]
    for i in range(5):
        publish(c.broker, b"%d" % i, rk="q")
    held = [q.get(), q.get()]  # delivered, not acknowledged
    c.pump()
    assert bodies(copy(c, "n2")) == []
    c.broker.definitions.apply(policy("all"))
    c.pump()
    assert sorted(bodies(copy(c, "n2"))) == [b"0", b"1", b"2", b"3", b"4"]
    for entry in held:
        assert entry is not None
        q.settle(entry)
    c.pump()
    assert bodies(copy(c, "n2")) == bodies(copy(c, "n3")) == [b"2", b"3", b"4"]


def test_a_publish_after_the_change_is_confirmed_by_the_majority_rule() -> None:
    c = cluster()
    for i in range(3):
        publish(c.broker, b"old %d" % i, rk="q")
    c.broker.definitions.apply(policy("all"))
    c.silent.update({"n2", "n3"})
    publish(c.broker, b"new", rk="q")
    confirmed: list[bool] = []
    c.broker.after_durable(lambda: confirmed.append(True))
    c.pump()
    assert confirmed == []  # no backup has it yet
    c.silent.clear()
    c.pump()
    assert confirmed == [True]


def test_a_ready_backup_waits_while_the_other_catches_up() -> None:
    """One at a time: n3 is asked only once n2 holds a copy again."""
    c = cluster()
    publish(c.broker, b"old", rk="q")
    c.broker.definitions.apply(policy("all"))
    c.pump()
    asked = c.primary.rejoins_asked
    c.silent.add("n3")
    c.broker.definitions.apply(policy("configuration"))
    c.broker.definitions.apply(policy("all"))
    c.pump()  # n2 first (alphabetical), then n3 -- silent: asked, never answers
    assert c.primary.rejoins_asked == asked + 2
    assert c.primary.sessions["n3"].rejoining and c.primary.replicate_pending
    c.clock.now += 6  # past backup_timeout: asked again
    c.primary.tick(c.clock.now)
    assert c.primary.rejoins_asked == asked + 3
    c.silent.clear()
    c.pump()
    assert not c.primary.replicate_pending
    assert bodies(copy(c, "n3")) == [b"old"]


def test_all_to_configuration_and_none_drop_the_copies_only() -> None:
    c = cluster(mode="all")
    q = c.broker.vhosts["/"].queues["q"]
    for i in range(4):
        publish(c.broker, b"%d" % i, rk="q")
    c.pump()
    assert bodies(copy(c, "n2")) == [b"0", b"1", b"2", b"3"]
    c.broker.definitions.apply(policy("configuration"))
    c.pump()
    assert bodies(copy(c, "n2")) == bodies(copy(c, "n3")) == []
    vh2 = c.node("n2").broker.vhosts["/"]
    assert [b.destination.name for b in vh2.exchanges["x"].bindings.values()] == ["q"]
    assert bodies(q) == [b"0", b"1", b"2", b"3"]  # the primary's queue is untouched
    consume(q, 1)
    publish(c.broker, b"4", rk="q")
    c.pump()
    assert bodies(copy(c, "n2")) == []
    c.broker.definitions.apply(policy(None))  # cleared: the default (all) again
    c.pump()
    assert bodies(copy(c, "n2")) == bodies(copy(c, "n3")) == [b"1", b"2", b"3", b"4"]
    c.broker.definitions.apply(policy("none"))
    c.pump()
    assert copy(c, "n2") is None and copy(c, "n3") is None
    assert bodies(q) == [b"1", b"2", b"3", b"4"] and "q" in c.broker.vhosts["/"].queues
    assert not c.primary.replicate_pending


def test_a_higher_priority_policy_changes_the_mode_too() -> None:
    c = cluster(mode="none")
    publish(c.broker, b"m", rk="q")
    c.broker.definitions.apply(DefinitionChange(POLICY, ("/", "keep"), {
        "pattern": ".*", "apply-to": "queues", "priority": 5,
        "definition": {"ha-replicate": "all"}}))
    c.pump()
    assert bodies(copy(c, "n2")) == [b"m"]
    change_log = c.primary.status()["replicate_changes"]
    assert change_log["applied_queues"] == 1 and change_log["last_applied"]["queues"] == 1


def test_a_drop_waits_for_a_transaction_on_the_queue() -> None:
    """A backup checks a transaction's dequeues against its copy: dropped after the outcome."""
    c = cluster(mode="all")
    q = c.broker.vhosts["/"].queues["q"]
    publish(c.broker, b"m", rk="q")
    c.pump()
    txq = c.primary.tx_begin("tx-1", None)
    c.primary.tx_event(txq, R.TxDequeue(R.TX_DEQUEUE, "tx-1", "/", "q", [q.ready.peek().position]))  # type: ignore[union-attr]
    c.broker.definitions.apply(policy("none"))
    c.pump()
    assert bodies(copy(c, "n2")) == [b"m"] and c.primary.replicate_pending
    c.primary.tx_rollback(txq)
    c.pump()
    assert copy(c, "n2") is None and not c.primary.replicate_pending
