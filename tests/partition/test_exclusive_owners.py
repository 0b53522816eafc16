"""Exclusive queues on a partitioned cluster (issue 35 task I, docs/ha.md "Exclusive queues
on a partitioned cluster"): the queue directory names each exclusive queue's owner node
(``EXCLUSIVE`` entries, written by the owner's own lane), every other node holds a
stand-in no connection owns (its vhost answers 405 RESOURCE_LOCKED, as RabbitMQ for
another connection's exclusive queue), and the entry goes when the queue does, at the
owner's restart, or when the owner's link has been down ``OWNER_GRACE``. The state and
the writer alone, then over ``test_directory.py``'s simulated nodes (four, P = 4, NR = 2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from brokerha.broker.broker import Broker
from brokerha.broker.errors import ResourceLocked
from brokerha.cluster import replication as R
from brokerha.partition.declarations import PACKETS as DECLARATION_PACKETS
from brokerha.partition.directory import (
    EXCLUSIVE,
    OWNER_GRACE,
    OWNERS_LANE,
    Directory,
    DirectoryEntry,
    DirectoryWriter,
    Owner,
    items_from_wire,
)
from tests.partition.test_directory import Net, entry, started

pytestmark = pytest.mark.timeout(60)


def owner(node: str) -> DirectoryEntry:
    return DirectoryEntry(EXCLUSIVE, node, False, False, R.encode_table({}), ())


def test_owner_entries_are_neither_fenced_nor_dropped_by_a_partitions_sync() -> None:
    d = Directory()
    assert d.apply(EXCLUSIVE, 0, False, [(("/", "ex"), owner("n1"))]) == {("/", "ex")}
    d.apply(0, 3, True, [(("/", "q"), entry(0))])  # partition 0's whole: ex stays
    assert d.entries[("/", "ex")] == owner("n1") and EXCLUSIVE not in d.epochs
    assert EXCLUSIVE not in d.synced
    assert d.owned_by("n1") == {("/", "ex"): owner("n1")} and d.owned_by("n2") == {}
    # a partition's None for that name (an exclusive queue hashing into it) leaves it
    assert d.apply(0, 3, False, [(("/", "ex"), None)]) == set()
    assert d.apply(EXCLUSIVE, 0, True, [(("/", "ex"), None)]) == {("/", "ex")}
    assert d.entries == {("/", "q"): entry(0)}
    with pytest.raises(ValueError):
        d.apply(EXCLUSIVE, 0, False, [(("/", "x"), entry(1))])


Asked = list[tuple[list[Any], Callable[[int, list[int]], None]]]


def writer_of(broker: Broker, d: Directory, me: str = "n1") -> tuple[DirectoryWriter, Asked]:
    asked: Asked = []
    w = DirectoryWriter(broker, lambda: (lambda q: 0), lambda a, done: asked.append((a, done)),
                        lambda: 0.0, resync=0.0)
    w.owners(me, d)
    return w, asked


def test_the_owners_lane_sends_a_declared_queue_then_its_close_and_nothing_when_idle() -> None:
    broker = Broker()
    vhost = broker.add_vhost("/")
    d = Directory()
    w, asked = writer_of(broker, d)
    w.tick()
    assert asked == []  # none here, none in the directory: no request at all
    conn = object()
    vhost.declare_queue("ex", owner=conn, exclusive=True)
    done: list[Any] = []
    w.record(OWNERS_LANE, [("/", "ex")], done.append)
    (args, answer), = asked
    assert args[:3] == [EXCLUSIVE, 0, False]
    assert items_from_wire(args[3]) == [(("/", "ex"), owner("n1"))]
    d.apply(args[0], args[1], args[2], items_from_wire(args[3]))
    answer(0, [1, 4])
    assert done == [[1, 4]]
    w.tick()
    assert len(asked) == 1  # nothing changed (the periodic check finds the directory right)
    vhost.delete_queue("ex", owner=conn)  # its connection closed
    w.tick()
    args = asked[1][0]
    assert items_from_wire(args[3]) == [(("/", "ex"), None)]


def test_after_a_restart_the_first_batch_drops_the_nodes_stale_entries() -> None:
    broker = Broker()
    vhost = broker.add_vhost("/")
    d = Directory()
    d.apply(EXCLUSIVE, 0, False, [(("/", "old"), owner("n1")), (("/", "theirs"), owner("n2"))])
    vhost.declare_queue("new", owner=object(), exclusive=True)
    _, asked = writer_of(broker, d)
    (args, _), = asked
    assert sorted(items_from_wire(args[3])) == [(("/", "new"), owner("n1")),
                                                (("/", "old"), None)]  # n2's not touched


def test_a_failed_batch_leaves_the_declare_unanswered_and_the_next_is_the_whole() -> None:
    broker = Broker()
    vhost = broker.add_vhost("/")
    d = Directory()
    w, asked = writer_of(broker, d)
    vhost.declare_queue("ex", owner=object(), exclusive=True)
    done: list[Any] = []
    w.record(OWNERS_LANE, [("/", "ex")], done.append)
    asked[0][1](320, [])
    assert done == [None]
    assert asked[1][0][2] is True and items_from_wire(asked[1][0][3]) == [
        (("/", "ex"), owner("n1"))]


# -- over the simulated nodes -----------------------------------------------------------------


@pytest.fixture(scope="module")
def net() -> Net:
    return started()


def declare_exclusive(net: Net, node: str, name: str) -> tuple[object, list[Any]]:
    conn = object()
    net.vhost(node).declare_queue(name, owner=conn, exclusive=True)
    done: list[Any] = []
    net.dirs[node].writer.record(OWNERS_LANE, [("/", name)], done.append)
    net.pump()
    return conn, done


def test_every_other_node_answers_405_for_an_exclusive_queue_and_not_once_it_is_gone(
        net: Net) -> None:
    holder = net.sim.names[0]
    conn, done = declare_exclusive(net, holder, "ex-a")
    assert done and done[0] is not None
    for name in net.sim.names:
        q = net.vhost(name).queues["ex-a"]
        if name == holder:
            assert q.exclusive_owner is conn and not net.dirs[name].stand_ins.is_stand_in(q)
            continue
        assert isinstance(q.exclusive_owner, Owner) and q.exclusive_owner.node == holder
        for who in (None, object()):
            with pytest.raises(ResourceLocked) as exc:
                net.vhost(name).queue_for("ex-a", who)
            assert "cannot obtain exclusive access to locked queue 'ex-a'" in str(exc.value)
        with pytest.raises(ResourceLocked):  # declared exclusive here too
            net.vhost(name).declare_queue("ex-a", owner=object(), exclusive=True)
    net.vhost(holder).delete_queue("ex-a", owner=conn)  # the connection closed
    net.pump()
    assert all("ex-a" not in net.vhost(name).queues for name in net.sim.names)
    assert all(("/", "ex-a") not in nd.layer.directory.entries for nd in net.dirs.values())


def test_the_metadata_primary_drops_a_node_s_entries_once_its_link_is_down_long_enough(
        net: Net) -> None:
    primary = next(n for n, nd in net.dirs.items() if nd.layer.primary is not None)
    holder = next(n for n in net.sim.names if n != primary)
    declare_exclusive(net, holder, "ex-b")
    nd = net.dirs[primary]
    assert ("/", "ex-b") in nd.layer.directory.entries
    nd.peer_down(holder)
    nd.tick()
    assert ("/", "ex-b") in nd.layer.directory.entries  # not before OWNER_GRACE
    nd.down_since[holder] -= OWNER_GRACE
    nd.tick()
    net.pump()
    assert nd.owners_dropped == 1
    others = [n for n in net.sim.names if n != holder]
    assert all(("/", "ex-b") not in net.dirs[n].layer.directory.entries for n in others)
    assert all("ex-b" not in net.vhost(n).queues for n in others)
    nd.peer_up(holder)
    # the holder (only cut off) sends its whole again at its lane's next check
    net.dirs[holder].writer.lanes[OWNERS_LANE].checked_at -= 60
    net.pump()
    assert isinstance(net.vhost(primary).queues["ex-b"].exclusive_owner, Owner)


@pytest.mark.parametrize("unsafe", [False, True])
def test_the_declare_ok_waits_until_every_other_node_answers_405(unsafe: bool) -> None:
    """``GroupClients.after_durable`` (the declare-ok's path) of an exclusive queue: when
    it answers, every other node already holds the owner's stand-in; with ``Unsafe``
    ``answer_exclusive_before_directory`` the check catches the answer sent before."""
    from brokerha.partition.clients import GroupClients
    from brokerha.partition.directory import Unsafe

    net = started(Unsafe(answer_exclusive_before_directory=unsafe))
    holder = net.sim.names[1]
    clients = GroupClients(net.sim.node(holder).ha, lambda n: f"amqp://{n}")
    clients.owners = net.dirs[holder]
    queue = net.vhost(holder).declare_queue("ex-c", owner=object(), exclusive=True)
    lacking: list[list[str]] = []

    def answered() -> None:  # who would not answer 405 at the declare-ok
        lacking.append([n for n in net.sim.names if n != holder
                        and not isinstance(getattr(net.vhost(n).queues.get("ex-c"),
                                                   "exclusive_owner", None), Owner)])

    # the owners lane's request held back (a slow link to the metadata leader)
    net.hold = lambda src, dst, packet: src == holder and isinstance(packet,
                                                                      DECLARATION_PACKETS)
    clients.after_durable([queue], answered)
    net.pump()
    if unsafe:  # answered while no other node knows: caught
        assert lacking == [[n for n in net.sim.names if n != holder]]
    else:
        assert lacking == []  # not answered while the directory does not hold it
    net.release()
    net.pump()
    assert lacking[-1] == [] or unsafe
    assert all(isinstance(net.vhost(n).queues["ex-c"].exclusive_owner, Owner)
               for n in net.sim.names if n != holder)


def test_a_publish_on_another_node_to_the_stand_in_leaves_the_owner_entry(net: Net) -> None:
    """A message routed on another node to the owner's stand-in (the default exchange) is
    not enqueued there (it is forwarded to the owner: tests/partition/test_forward_owned.py),
    and never makes that node's lane write a None for another node's entry (which would
    drop it everywhere)."""
    from tests.partition.test_directory import publish

    holder, other = net.sim.names[2], net.sim.names[3]
    conn, done = declare_exclusive(net, holder, "ex-d")
    assert done and done[0] is not None
    net.clients[other].owners = net.dirs[other]
    stand_in = net.vhost(other).queues["ex-d"]
    answers = publish(net, other, "", "ex-d", b"x")
    net.pump()
    assert answers == [True] and stand_in.message_count == 0
    net.dirs[other].writer.record(OWNERS_LANE, [("/", "ex-d")], lambda position: None)
    net.pump()
    assert all(isinstance(net.vhost(n).queues["ex-d"].exclusive_owner, Owner)
               for n in net.sim.names if n != holder)
    assert all(nd.layer.directory.entries[("/", "ex-d")].ha_id == holder
               for nd in net.dirs.values())
    net.vhost(holder).delete_queue("ex-d", owner=conn)
    net.pump()


def test_a_failed_owner_entry_closes_the_owners_connection_320() -> None:
    """The lane's batch fails (no metadata leader took it): the declare-ok is never sent
    and the owner's connection is closed 320 (whether another node says 405 is unknown);
    its queues then go, as at any close."""
    from brokerha.partition.clients import GroupClients

    net = started()
    holder = next(n for n, nd in net.dirs.items()  # serving a group: its gate answers
                  if nd.layer.primary is None and net.clients[n].serving_groups())
    clients = GroupClients(net.sim.node(holder).ha, lambda n: f"amqp://{n}")
    clients.owners = net.dirs[holder]

    class Conn:
        def __init__(self) -> None:
            self.failed: list[Any] = []

        def fail(self, ch: Any, exc: Any) -> None:
            self.failed.append(exc)

    conn = Conn()
    queue = net.vhost(holder).declare_queue("ex-e", owner=conn, exclusive=True)
    answered: list[bool] = []
    net.hold = lambda src, dst, packet: src == holder and isinstance(packet,
                                                                      DECLARATION_PACKETS)
    clients.after_durable([queue], lambda: answered.append(True))
    net.pump()
    writer = net.dirs[holder].writer
    assert writer.lanes[OWNERS_LANE].in_flight is not None and answered == []
    writer._answered(OWNERS_LANE, 0, 320, [])  # as the request machinery fails it
    assert answered == [] and [e.code for e in conn.failed] == [320]
    assert "CONNECTION_FORCED" in str(conn.failed[0])
