"""Each group's ``Primary`` answers a queue's group from what it remembers (issue 35).

A partitioned node runs one ``Primary`` per group it leads over one broker, and
every one of them sees every queue's events; each asks its ``PartitionScope``
once per queue and remembers the answer (``Primary._policies``: ``OTHER_GROUP``
for another group's). These tests fail if a queue were answered for the wrong
group: a group-2 queue's messages seen by group 1's primary, a re-declared
queue (a new ``Queue``, maybe in another partition) answered as the old one, the
metadata group observing a queue, or the scope asked on every event again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from brokerha.broker.placement import GroupScope, no_queues
from brokerha.broker.queue import Queue
from brokerha.cluster.partition_table import PartitionTable
from brokerha.partition.member import PIN, PartitionScope
from brokerha.primary.primary import OTHER_GROUP, Primary
from tests.clock import Clock
from tests.ha.harness import Node, consume, publish

P = 4


def counted(scope: Callable[[Queue], bool], asked: Counter[tuple[int, int]],
            group: int) -> Callable[[Queue], bool]:
    def holds(queue: Queue) -> bool:
        asked[(group, id(queue))] += 1
        return scope(queue)

    return holds


def setup() -> tuple[Node, dict[int, Primary], Counter[tuple[int, int]]]:
    clock = Clock()
    node = Node("A", clock)
    placement = PartitionScope(PartitionTable.empty(P, 1))
    asked: Counter[tuple[int, int]] = Counter()
    primaries = {0: Primary(node.broker, me="A", members=1, epoch=1, start_seq=0, clock=clock,
                            backup_timeout=5.0, scope=GroupScope(0, no_queues, True))}
    for p in (1, 2):  # the node leads partitions 1 and 2: groups 2 and 3
        scope = GroupScope(p + 1, counted(placement.of(p), asked, p + 1), False)
        primaries[p + 1] = Primary(node.broker, me="A", members=1, epoch=1, start_seq=0,
                                   clock=clock, backup_timeout=5.0, scope=scope)
    return node, primaries, asked


def declare(node: Node, name: str, partition: int) -> Queue:
    return node.broker.vhosts["/"].declare_queue(name, owner=None, durable=True,
                                                 arguments={PIN: partition})


def test_a_queue_of_one_group_is_never_seen_by_another_groups_primary() -> None:
    node, primaries, asked = setup()
    meta, g2, g3 = primaries[0], primaries[2], primaries[3]
    q = declare(node, "q", 2)  # partition 2: group 3's
    seqs = {g: p.seq for g, p in primaries.items()}
    for i in range(5):
        publish(node.broker, b"%d" % i, "q")
    entry = q.get()
    assert entry is not None
    assert g3.acquired_entries(q) == [entry] and g2.acquired_entries(q) == []
    q.settle(entry)
    assert consume(q) == [b"1", b"2", b"3", b"4"]
    assert g3.seq > seqs[3]  # its enqueues and dequeues are group 3's log
    assert g2.seq == seqs[2] and meta.seq == seqs[0]  # and no other group's
    assert g2._policies[q] is OTHER_GROUP and meta._policies[q] is OTHER_GROUP
    assert g3._policies[q] is not OTHER_GROUP
    # each primary asked its scope about the queue once, not per event
    assert asked[(2, id(q))] == 1 and asked[(3, id(q))] == 1


def test_a_queue_deleted_and_declared_again_in_another_partition_is_answered_anew() -> None:
    node, primaries, asked = setup()
    g2, g3 = primaries[2], primaries[3]
    old = declare(node, "q", 2)
    publish(node.broker, b"old", "q")
    assert g2._policies[old] is OTHER_GROUP
    node.broker.vhosts["/"].delete_queue("q", owner=None)
    assert old not in g2._policies and old not in g3._policies  # forgotten with the queue
    new = declare(node, "q", 1)  # the same name, now pinned to partition 1: group 2's
    seqs = g2.seq, g3.seq
    publish(node.broker, b"new", "q")
    assert consume(new) == [b"new"]
    assert g2.seq > seqs[0] and g3.seq == seqs[1]
    assert g2._policies[new] is not OTHER_GROUP and g3._policies[new] is OTHER_GROUP
    assert asked[(2, id(new))] == 1 and asked[(3, id(new))] == 1


def test_an_exclusive_queue_is_no_groups_and_a_policy_change_skips_other_groups_queues() -> None:
    node, primaries, _ = setup()
    g2, g3 = primaries[2], primaries[3]
    owner = object()
    ex = node.broker.vhosts["/"].declare_queue("ex", owner=owner, exclusive=True)
    publish(node.broker, b"x", "ex")
    assert ex.get() is not None
    assert g2.acquired_entries(ex) == [] and g3.acquired_entries(ex) == []
    mine = declare(node, "mine", 1)
    publish(node.broker, b"m", "mine")
    g2.replicate_changed("/")  # nothing changed: no queue's mode changes, none of group 3's
    g3.replicate_changed("/")
    assert g3._policies[mine] is OTHER_GROUP and g2.replicate_mode(mine) != "none"
    assert g3.replicate_mode(mine) == "none"


def test_of_name_remembers_a_pin_per_value_and_type_and_takes_no_unhashable_one() -> None:
    from decimal import Decimal

    from brokerha.cluster.partition_table import hash_partition

    scope = PartitionScope(PartitionTable.empty(P, 1))
    name = next(n for n in (f"n{i}" for i in range(100)) if hash_partition("/", n, P) != 3)
    hashed = hash_partition("/", name, P)
    for _ in range(2):  # asked, then remembered: the same answers
        assert scope.of_name("/", name, 3) == 3
        assert scope.of_name("/", name, None) == hashed
        assert scope.of_name("/", name, Decimal(3)) == hashed  # no pin's type: the hash
        assert scope.of_name("/", name, [3]) == hashed  # unhashable: no pin
        assert scope.of_name("/", name, {"p": 3}) == hashed
