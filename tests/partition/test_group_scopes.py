"""Groups on one broker: a ``Primary`` and a ``Backup`` each hold only their group's scope.

Two nodes, two partition groups: node A is the primary of group 1 (queues
``a*``) and a backup of group 2 (queues ``b*``), node B the other way round.
Each primary observes only its group's queues, each backup applies and lists
only its own, and a catch-up's end removes nothing of another group's
(``broker/placement.py``, docs/ha.md "Partitions").
"""

from __future__ import annotations

import json

import pytest

from brokerha.backup.backup import Backup
from brokerha.broker.definitions import DefinitionChange
from brokerha.broker.placement import GroupScope, no_queues, scope_of
from brokerha.broker.policies import POLICY
from brokerha.broker.policy_effects import PolicyEffects
from brokerha.broker.queue import Queue
from brokerha.broker.storage import MemoryStore
from brokerha.cluster import replication as R
from brokerha.cluster.state import NodeState
from brokerha.ha.core import POSITION_KEY, HACore, PrimarySettings, load_position, position_key
from brokerha.ha.simulation.world import wire
from brokerha.primary.primary import Primary
from tests.clock import Clock
from tests.ha.harness import Node, carry, consume, publish


def group(n: int, prefix: str) -> GroupScope:
    return GroupScope(n, lambda q: q.name.startswith(prefix), False)


G1, G2 = group(1, "a"), group(2, "b")
METADATA = GroupScope(0, no_queues, True)


def primary(node: Node, scope: GroupScope, clock: Clock) -> Primary:
    return Primary(node.broker, me=node.name, members=2, epoch=1, start_seq=0, clock=clock,
                   backup_timeout=5.0, scope=scope)


def joined(p: Primary, node: Node, scope: GroupScope) -> Backup:
    backup = Backup(node.broker, me=node.name, epoch=1, position=(-1, -1), scope=scope)
    p.backup_joined(wire(backup.join_message()))  # type: ignore[arg-type]
    carry(p, backup)
    return backup


def queue(node: Node, name: str) -> Queue:
    return node.broker.vhosts["/"].declare_queue(name, owner=None, durable=True)


def names(node: Node) -> set[str]:
    return set(node.broker.vhosts["/"].queues)


def test_two_nodes_each_the_primary_of_one_group_and_a_backup_of_the_other() -> None:
    clock = Clock()
    a, b = Node("A", clock), Node("B", clock)
    pa, pb = primary(a, G1, clock), primary(b, G2, clock)
    ba, bb = joined(pb, a, G2), joined(pa, b, G1)
    qa, qb = queue(a, "a1"), queue(b, "b1")
    for i in range(3):
        publish(a.broker, b"%d" % i, "a1")
        publish(b.broker, b"x%d" % i, "b1")
    emitted = pa.seq
    carry(pa, bb)
    carry(pb, ba)
    assert names(a) == names(b) == {"a1", "b1"}
    assert consume(b.broker.vhosts["/"].queues["a1"]) == [b"0", b"1", b"2"]
    assert consume(a.broker.vhosts["/"].queues["b1"]) == [b"x0", b"x1", b"x2"]
    # the backup copies' enqueues on A (group 2's) made no event of group 1's primary
    assert pa.seq == emitted and qa.message_count == 3 and qb.message_count == 3
    # each primary named only its group's queue, with its own identity
    assert R.HA_ID in qa.arguments and R.HA_ID in qb.arguments
    assert [q[1] for q in bb._inventory()] == ["a1"] and [q[1] for q in ba._inventory()] == ["b1"]


def test_a_catch_up_of_one_group_removes_nothing_of_another() -> None:
    """The snapshot's end deletes what the primary did not name: of its own group only."""
    clock = Clock()
    a, b = Node("A", clock), Node("B", clock)
    pa = primary(a, G1, clock)
    queue(a, "a1")
    queue(b, "b1")  # B's own (it leads group 2)
    b.broker.vhosts["/"].declare_exchange("x", "direct", durable=True)
    primary(b, G2, clock)
    joined(pa, b, G1)
    assert names(b) == {"a1", "b1"} and "x" in b.broker.vhosts["/"].exchanges


def test_a_partition_catch_up_carries_no_definitions_or_exchanges() -> None:
    clock = Clock()
    a, b = Node("A", clock), Node("B", clock)
    a.broker.vhosts["/"].declare_exchange("x", "direct", durable=True)
    qa = queue(a, "a1")
    a.broker.vhosts["/"].bind("x", qa, "k", {})
    pa = primary(a, G1, clock)
    backup = Backup(b.broker, me="B", epoch=1, position=(-1, -1), scope=G1)
    b.broker.vhosts["/"].declare_exchange("x", "direct", durable=True)  # the metadata group's
    pa.backup_joined(wire(backup.join_message()))  # type: ignore[arg-type]
    kinds = []
    for packet in pa.take_outbox("B"):
        kinds += [e.kind for e in wire(packet).events]  # type: ignore[attr-defined]
        backup.receive(wire(packet))  # type: ignore[arg-type]
    assert R.DEFINITIONS not in kinds and R.EXCHANGE_DECLARED not in kinds
    assert kinds.count(R.QUEUE_DECLARED) == 1 and kinds.count(R.BINDING_CREATED) == 1
    assert [b.routing_key for b in b.broker.vhosts["/"].exchanges["x"].bindings.values()] == ["k"]


def test_the_metadata_group_replicates_exchanges_and_no_queue() -> None:
    clock = Clock()
    a, b = Node("A", clock), Node("B", clock)
    pm = primary(a, METADATA, clock)
    backup = joined(pm, b, METADATA)
    before = pm.seq
    a.broker.vhosts["/"].declare_exchange("x", "fanout", durable=True)
    queue(a, "a1")
    publish(a.broker, b"m", "a1")
    assert pm.seq == before + 1  # the exchange only
    carry(pm, backup)
    assert "x" in b.broker.vhosts["/"].exchanges and "a1" not in names(b)


def test_a_backup_refuses_a_broker_observed_by_a_primary_of_its_own_group_only() -> None:
    clock = Clock()
    a = Node("A", clock)
    pa = primary(a, G1, clock)
    assert scope_of(pa) is G1
    Backup(a.broker, me="A", epoch=1, position=(-1, -1), scope=G2)  # another group: fine
    with pytest.raises(RuntimeError, match="same group"):
        Backup(a.broker, me="A", epoch=1, position=(-1, -1), scope=G1)
    with pytest.raises(RuntimeError):
        Backup(a.broker, me="A", epoch=1, position=(-1, -1))  # the whole broker


def test_each_groups_flow_hold_is_its_own() -> None:
    clock = Clock()
    a = Node("A", clock)
    p1, p2 = primary(a, G1, clock), primary(a, G2, clock)
    assert p1.flow_name != p2.flow_name
    a.broker.flow.hold(p1.flow_name, "lagging")
    p2.close()
    assert p1.flow_name in a.broker.flow.holds


def test_each_group_keeps_its_position_under_its_own_key() -> None:
    clock = Clock()
    a = Node("A", clock, MemoryStore())
    assert position_key(None) == position_key(METADATA) == POSITION_KEY
    assert position_key(G2) == f"{POSITION_KEY}/2"
    core = HACore(a.broker, "A", NodeState(), object(), PrimarySettings(2),  # type: ignore[arg-type]
                  clock, scope=G2)
    core.record_position(3, 17)
    assert json.loads(a.broker.store.get_meta("ha_position/2") or "[]") == [3, 17, 3, 17]
    assert a.broker.store.get_meta(POSITION_KEY) is None
    state = NodeState()
    load_position(a.broker, state, position_key(G2))
    assert (state.pos_epoch, state.pos_seq) == (3, 17)


def test_a_policy_trims_the_queues_a_node_leads_and_not_those_it_follows() -> None:
    """``VirtualHost.followed``: per queue what ``following`` is per vhost. A leads group 1
    and follows group 2 on the same vhost: a policy's limit and TTL act on its own queue,
    while its copy of group 2's queue keeps what its primary sends."""
    clock = Clock()
    a, b = Node("A", clock), Node("B", clock)
    effects = PolicyEffects(a.broker)
    pa, pb = primary(a, G1, clock), primary(b, G2, clock)
    ba = joined(pb, a, G2)
    qa, qb = queue(a, "a1"), queue(b, "b1")
    for i in range(10):
        publish(a.broker, b"%d" % i, "a1")
        publish(b.broker, b"%d" % i, "b1")
    carry(pb, ba)
    vhost = a.broker.vhosts["/"]
    copy = vhost.queues["b1"]
    assert not vhost.following and vhost.follows(copy) and not vhost.follows(qa)
    a.broker.definitions.apply(DefinitionChange(POLICY, ("/", "limits"), {
        "pattern": "^", "apply-to": "queues", "priority": 0,
        "definition": {"max-length": 3, "message-ttl": 1000}}))
    assert effects.applied(qa) == effects.applied(copy)
    assert (copy.max_length, copy.message_ttl) == (3, 1000)
    assert [e.message.body for e in qa.ready] == [b"7", b"8", b"9"]  # trimmed here
    assert copy.message_count == 10 and qb.message_count == 10  # its primary decides
    assert qa in vhost.timed_queues and copy not in vhost.timed_queues
    ba.close()  # promoted in group 2: the copy keeps time and follows nothing
    assert not vhost.follows(copy) and copy in vhost.timed_queues
    assert pa.scope is G1
