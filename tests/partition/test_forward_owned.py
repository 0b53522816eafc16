"""Publishes to another node's exclusive queue (issue 35, docs/ha.md "Exclusive queues on a
partitioned cluster"): the forward sender's owner lanes (``partition/forward.py``, lanes
keyed by the owner node, group ``OWNER_GROUP``), the owner's receiver over its broker
(``forward_apply.OwnedForwardLog``), sans-I/O; then over ``test_directory.py``'s
simulated nodes (four, P = 4, NR = 2): a publish on another node reaches the owner's
queue, in order, confirmed once the owner's gate passed; nacked while the link to the
owner is down; refused (540) inside a transaction."""

from __future__ import annotations

from typing import Any

import pytest

from brokerha.broker.broker import Broker
from brokerha.broker.errors import NotImplementedByBroker
from brokerha.broker.queue import Queue
from brokerha.partition.directory import OWNERS_LANE, Owner
from brokerha.partition.forward import (
    OWNER_GROUP,
    Forward,
    Forwarded,
    ForwardError,
    ForwardMessage,
    ForwardReceiver,
    ForwardSender,
    LeaderNotice,
    ToNode,
)
from brokerha.partition.forward_apply import OwnedForwardLog
from tests.partition.test_directory import Net, message, publish, started
from tests.partition.test_forward import confirms, durable, forwards

pytestmark = pytest.mark.timeout(60)


def to_owner(body: str, queue: str = "rpc-x") -> ForwardMessage:
    m = message("", queue, body.encode())
    return ForwardMessage("/", (queue,), "", queue, m.header, m.body)


def bodies(queue: Queue) -> list[bytes]:
    out = []
    while (entry := queue.get()) is not None:
        out.append(entry.message.body)
    return out


def up(owner: str = "b") -> ForwardSender:
    s = ForwardSender("a.1")
    s.owner_up(owner)
    return s


def test_an_owner_lane_goes_to_its_node_at_once_in_order_and_is_confirmed() -> None:
    s = up()
    assert s.publish(1, {"b": to_owner("x")}) == []
    assert s.publish(2, {"b": to_owner("y")}) == []
    sent = s.flush(0.0)
    (f,) = forwards(sent)
    assert [e.node for e in sent if isinstance(e, ToNode)] == ["b"]  # no notice needed
    assert (f.group, f.epoch, f.first_fseq, len(f.messages)) == (OWNER_GROUP, 0, 1, 2)
    origin = f.origin
    assert origin != "a.1" and origin.startswith("a.1")  # the lane's own origin
    assert confirms(s.receive(0.1, Forwarded(OWNER_GROUP, origin, 2, []), "b")) == \
        [(1, True), (2, True)]
    # an owner's answer is told apart by its node: another node's is not this lane's
    s.publish(3, {"b": to_owner("z")})
    (f,) = forwards(s.flush(0.2))
    assert confirms(s.receive(0.3, Forwarded(OWNER_GROUP, origin, 3, []), "c")) == []
    assert confirms(s.receive(0.3, Forwarded(OWNER_GROUP, origin, 3, []), "b")) == [(3, True)]
    # a leader notice never names an owner lane
    assert s.leader(0.3, LeaderNotice(OWNER_GROUP, 1, "c")) == []


def test_the_owners_link_lost_nacks_what_is_unanswered_and_a_new_lane_starts_afresh() -> None:
    s = up()
    s.publish(1, {"b": to_owner("x")})
    (old,) = forwards(s.flush(0.0))
    s.publish(2, {"b": to_owner("y")})  # not sent yet
    assert confirms(s.owner_down("b")) == [(1, False), (2, False)]
    # while the link is down: nacked at once, nothing sent, nothing held
    assert confirms(s.publish(3, {"b": to_owner("z")})) == [(3, False)]
    assert forwards(s.flush(0.1)) == [] and not s.holds(["b"])
    assert s.stats.owner_nacks == 3
    s.owner_up("b")
    s.publish(4, {"b": to_owner("w")})
    (new,) = forwards(s.flush(0.2))
    assert new.first_fseq == 1 and new.origin != old.origin  # a receiver marks it anew
    # the old lane's late answer is not this one's
    assert confirms(s.receive(0.3, Forwarded(OWNER_GROUP, old.origin, 1, []), "b")) == []
    assert confirms(s.receive(0.3, Forwarded(OWNER_GROUP, new.origin, 1, []), "b")) == \
        [(4, True)]


def test_a_publish_to_a_group_and_an_owner_waits_for_both_and_an_error_fails_closed() -> None:
    s = up()
    s.leader(0.0, LeaderNotice(1, 2, "c"))
    s.publish(1, {1: to_owner("x", "1.1"), "b": to_owner("x")})
    sent = s.flush(0.0)
    to_group, to_b = forwards(sent)
    assert (to_group.group, to_b.group) == (1, OWNER_GROUP)
    assert confirms(s.receive(0.1, Forwarded(1, "a.1", 1, []), "c")) == []
    # (an owner's receiver takes any forward: an error is not a leader change) nacked
    assert confirms(s.receive(0.1, ForwardError(OWNER_GROUP, to_b.origin, "not-primary",
                                                "?"), "b")) == [(1, False)]


def test_the_retry_resends_to_the_owner_and_its_receiver_applies_once() -> None:
    broker = Broker()
    vhost = broker.add_vhost("/")
    conn = object()
    queue = vhost.declare_queue("rpc-x", owner=conn, exclusive=True)
    log = OwnedForwardLog(broker)
    r = ForwardReceiver(OWNER_GROUP, 0, log)
    s = up()
    for i in range(3):
        s.publish(i, {"b": to_owner(f"m{i}")})
    (f,) = forwards(s.flush(0.0))
    first = durable(r.receive("a", f))  # its answer lost
    assert first == [Forwarded(OWNER_GROUP, f.origin, 3, [])]
    again = forwards(s.tick(1.0))
    assert [(g.first_fseq, len(g.messages)) for g in again] == [(1, 3)]
    assert durable(r.receive("a", again[0])) == first
    assert bodies(queue) == [b"m0", b"m1", b"m2"] and r.stats.deduped == 3
    # a queue not held as an exclusive queue of this node's (its connection closed, a plain
    # queue by that name, a stand-in of another node's) is left out
    vhost.delete_queue("rpc-x", owner=conn)
    plain = vhost.declare_queue("rpc-y", owner=conn)
    stand_in = vhost.declare_queue("rpc-z", owner=conn)
    stand_in.exclusive_owner = Owner("c")
    out = r.receive("a", Forward(OWNER_GROUP, 0, f.origin, 4, 0,
                                 [to_owner("gone").as_wire(), to_owner("p", "rpc-y").as_wire(),
                                  to_owner("s", "rpc-z").as_wire()]))
    assert durable(out) == [Forwarded(OWNER_GROUP, f.origin, 6, [])]
    assert log.unknown_queues == 3 and plain.message_count == stand_in.message_count == 0


# -- over the simulated nodes -----------------------------------------------------------------


@pytest.fixture(scope="module")
def net() -> Net:
    return started()


def pair(net: Net, skip: int = 0) -> tuple[str, str]:
    """A node serving some group (one serving none has no clients: it relays them) and
    another node."""
    holder = [n for n in net.sim.names if net.clients[n].serving_groups()][skip]
    return holder, next(n for n in reversed(net.sim.names) if n != holder)


def holding(net: Net, node: str, name: str) -> tuple[object, Any]:
    conn = object()
    queue = net.vhost(node).declare_queue(name, owner=conn, exclusive=True)
    done: list[Any] = []
    net.dirs[node].writer.record(OWNERS_LANE, [("/", name)], done.append)
    net.pump()
    assert done and done[0] is not None
    return conn, queue


def test_a_publish_on_another_node_reaches_the_owners_queue_in_order(net: Net) -> None:
    holder, other = pair(net)
    conn, queue = holding(net, holder, "rpc-1")
    stand_in = net.vhost(other).queues["rpc-1"]
    assert isinstance(stand_in.exclusive_owner, Owner)
    assert net.clients[other].routable([stand_in]) == [stand_in]  # routed: no return
    answers = [publish(net, other, "", "rpc-1", f"r{i}".encode()) for i in range(20)]
    assert answers == [[]] * 20  # not before the owner answered
    net.pump()
    assert answers == [[True]] * 20
    assert stand_in.message_count == 0
    assert bodies(queue) == [f"r{i}".encode() for i in range(20)]
    assert net.fw[holder].owned.stats.applied == 20
    net.vhost(holder).delete_queue("rpc-1", owner=conn)
    net.pump()


def test_a_publish_while_the_link_to_the_owner_is_down_is_nacked(net: Net) -> None:
    holder, other = pair(net, 1)
    conn, queue = holding(net, holder, "rpc-2")
    net.fw[other].link_lost(holder)
    answers = publish(net, other, "", "rpc-2", b"lost")
    assert answers == [False] and queue.message_count == 0
    net.fw[other].peer_up(holder)
    answers = publish(net, other, "", "rpc-2", b"back")
    net.pump()
    assert answers == [True] and queue.message_count == 1
    net.vhost(holder).delete_queue("rpc-2", owner=conn)
    net.pump()


def test_a_transaction_publishing_to_another_nodes_exclusive_queue_is_refused_540(
        net: Net) -> None:
    holder, other = pair(net)
    conn, queue = holding(net, holder, "rpc-3")
    vhost = net.vhost(other)
    stand_in = vhost.queues["rpc-3"]
    tx = net.sim.node(other).broker.new_transaction()
    tx.publish([stand_in], message("", "rpc-3", b"t"))
    with pytest.raises(NotImplementedByBroker) as exc:
        net.clients[other].tx_commit(None, tx, lambda ok, why: None)
    assert "exclusive queue 'rpc-3'" in str(exc.value)
    assert f"on node {holder}" in str(exc.value)
    tx.rollback()
    net.pump()
    assert queue.message_count == 0
    net.vhost(holder).delete_queue("rpc-3", owner=conn)
    net.pump()


def test_an_exchange_bound_to_the_owners_queue_routes_to_it_from_another_node(
        net: Net) -> None:
    """Publish/subscribe (pika's tutorial 3): the owner's exclusive queue bound to a fanout
    exchange; the bind-ok waits for the owner entry to name the binding, so another node's
    stand-in is bound by then and a publish there through the exchange reaches the queue
    (forwarded); unbound, it routes there no more."""
    holder, other = pair(net)
    conn, queue = holding(net, holder, "sub-1")
    net.clients[holder].owners = net.dirs[holder]
    net.vhost(holder).bind("amq.fanout", queue, "", {})
    bound: list[int] = []
    net.clients[holder].after_bound(queue, lambda: bound.append(1))
    assert bound == []  # not before the directory names it
    net.pump()
    assert bound == [1]
    stand_in = net.vhost(other).queues["sub-1"]
    fanout = net.vhost(other).exchanges["amq.fanout"]
    assert [b.destination for b in fanout.bindings.values()] == [stand_in]
    answers = publish(net, other, "amq.fanout", "", b"news")
    net.pump()
    assert answers == [True] and bodies(queue) == [b"news"]
    net.vhost(holder).unbind("amq.fanout", queue, "", {})
    net.clients[holder].after_bound(queue, lambda: bound.append(2))
    net.pump()
    assert bound == [1, 2] and not fanout.bindings
    net.vhost(holder).delete_queue("sub-1", owner=conn)
    net.pump()


def test_a_dead_letter_routed_to_the_stand_in_reaches_the_owners_queue(net: Net) -> None:
    """A message rejected from a queue of another node whose dead-letter exchange routes it
    to the owner's exclusive queue (the default exchange, its name): forwarded through the
    owner lane (at most once, as a partition's dead letter), not dropped by the stand-in."""
    holder, other = pair(net)
    conn, queue = holding(net, holder, "dl-reply")
    vhost = net.vhost(other)
    assert vhost.queues["dl-reply"] in vhost.followed  # (its dead letters are forwarded)
    source = vhost.declare_queue("dl-src", owner=None, arguments={
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dl-reply"})
    source.enqueue(message("", "dl-src", b"dead"))
    entry = source.get()
    assert entry is not None
    source.reject(entry)
    net.pump()
    (dead,) = [e.message for e in [queue.get()] if e is not None]
    assert dead.body == b"dead" and b"x-death" in dead.header
    assert net.fw[other].stats.dead_letters == 1
    vhost.delete_queue("dl-src", owner=None)
    net.vhost(holder).delete_queue("dl-reply", owner=conn)
    net.pump()
