"""A backup derives the same effective policy as its primary, follows the primary's trims and
expiries rather than making its own, and acts on the policy once promoted."""

from __future__ import annotations

from brokerha.broker.definitions import DefinitionChange
from brokerha.broker.policies import POLICY
from brokerha.broker.policy_effects import PolicyEffects
from brokerha.primary.primary import Primary
from tests.ha.harness import Cluster, consume, publish


def limits(max_length: int, ttl: int = 1000) -> DefinitionChange:
    return DefinitionChange(POLICY, ("/", "limits"), {
        "pattern": "^pol\\.", "apply-to": "queues", "priority": 0,
        "definition": {"max-length": max_length, "message-ttl": ttl}})


def test_a_backup_holds_the_primarys_effective_policy_and_its_trims() -> None:
    c = Cluster(2)
    effects = {name: PolicyEffects(node.broker) for name, node in c.nodes.items()}
    c.follow("n2")
    c.pump()
    c.broker.definitions.apply(limits(3))
    q = c.broker.vhosts["/"].declare_queue("pol.q", owner=None, durable=True)
    for i in range(10):
        publish(c.broker, str(i).encode(), rk="pol.q")
    c.pump()
    backup = c.node("n2").broker
    copy = backup.vhosts["/"].queues["pol.q"]
    assert effects["n2"].applied(copy) == effects["n1"].applied(q)
    assert (copy.max_length, copy.message_ttl) == (q.max_length, q.message_ttl) == (3, 1000)
    assert [e.message.body for e in copy.ready] == [b"7", b"8", b"9"]
    assert copy not in backup.vhosts["/"].timed_queues  # the primary's expiries decide
    c.broker.definitions.apply(limits(1))  # the primary trims; the backup follows its events
    c.pump()
    assert [e.message.body for e in copy.ready] == [b"9"] and copy.max_length == 1
    assert copy not in backup.vhosts["/"].timed_queues
    # promoted: the policy acts there (its TTL runs from now on, its limit on publishes)
    c.node("n2").backup.close()  # type: ignore[union-attr]
    Primary(backup, me="n2", members=2, epoch=2, start_seq=0, clock=c.clock, backup_timeout=5)
    assert copy in backup.vhosts["/"].timed_queues
    publish(backup, b"new", rk="pol.q")
    assert [e.message.body for e in copy.ready] == [b"new"]
    c.clock.now += 1.5
    backup.tick(c.clock())
    assert consume(copy) == []
