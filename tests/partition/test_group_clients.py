"""A partitioned node's clients (brokerha/partition/clients.py, issue 35 stage 2): which
connections it serves, which queues a client may use there, and through which gate its
confirms pass -- over the simulation's nodes, each the product's ``PartitionedMember``
(the node's shell, node/ha_groups.py, installs the same object as its admission and as
``Broker.groups``)."""

from __future__ import annotations

from functools import partial

import pytest

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header
from brokerha.broker.message import Message
from brokerha.broker.placement import NotLeader
from brokerha.ha.admission import Admission
from brokerha.ha.simulation.world import Faults
from brokerha.partition.clients import GroupClients
from brokerha.partition.group_simulation import GroupNode, GroupSimulation, queue_names

QUEUES = queue_names(3)  # q<p>-<i>: one name per partition


class Link:
    """A client connection as the admission sees it."""

    def __init__(self) -> None:
        self.closed = False

    def force_close(self) -> None:
        self.closed = True


class Conn:
    """The AMQP connection of ``link`` (``ServerConnection.conn_id`` is its transport's id)."""

    def __init__(self, link: Link) -> None:
        self.conn_id = id(link)


def laid_out() -> GroupSimulation:
    """Three nodes, P = 3, no faults; the metadata group and partition 0 led by n1,
    partition 1 by n2, partition 2 by n3 (handed over where the elections put them
    elsewhere)."""
    sim = GroupSimulation(0, faults=Faults.none(), publish_rate=0.0, consume_rate=0.0)
    sim.start()
    sim.run_until(5.0)
    for group, name in {0: "n1", 1: "n1", 2: "n2", 3: "n3"}.items():
        current = sim.serving_groups[group]
        assert current is not None
        if current.name != name:
            sim.promote_group(current, group, name)
            sim.run_until(sim.now + 3.0)
    assert {g: n.name if n else None for g, n in sim.serving_groups.items()} == \
        {0: "n1", 1: "n1", 2: "n2", 3: "n3"}
    for client in sim.clients:  # each partition's queue, declared on its leader
        leader = sim.serving_groups[client.partition + 1]
        assert leader is not None
        leader.run(partial(sim.client_queue, leader, client))
    sim.run_until(sim.now + 1.0)
    return sim


def clients_of(node: GroupNode) -> GroupClients:
    return GroupClients(node.ha, lambda name: f"amqp://{name}")


def served(clients: GroupClients) -> tuple[Link, Conn]:
    link = Link()
    assert clients.admit(link)
    return link, Conn(link)


@pytest.fixture(scope="module")
def sim() -> GroupSimulation:
    return laid_out()


def test_a_node_serves_connections_while_it_leads_any_group(sim: GroupSimulation) -> None:
    n2 = clients_of(sim.node("n2"))  # leads partition 1 only, follows the metadata group
    assert n2.serving_groups() == [2] and n2.decide(True) is Admission.SERVE
    assert n2.opened is None  # the listener's term is the metadata group's
    link, _ = served(n2)
    assert link in n2.connections
    n2.gone(link)
    assert link not in n2.connections


def test_a_queue_is_served_on_its_partition_s_leader_only(sim: GroupSimulation) -> None:
    n2 = clients_of(sim.node("n2"))
    link, conn = served(n2)
    n2.check_queue(conn, "/", QUEUES[1], {}, False)  # partition 1: n2 leads it
    member = sim.node("n2").ha.groups[2]
    assert link in member.clients.connections  # closed with group 2's role
    with pytest.raises(NotLeader) as refused:  # partition 0: n1's
        n2.check_queue(conn, "/", QUEUES[0], {}, False)
    assert refused.value.code == 404
    assert "partition 0" in refused.value.text and "led by n1" in refused.value.text
    assert "amqp://n1" in refused.value.text
    n2.check_queue(conn, "/", QUEUES[0], {}, True)  # an exclusive queue is in no partition
    with pytest.raises(NotLeader, match="metadata group.*led by n1"):
        n2.check_configuration(conn, "declare exchange 'x'")
    pinned = {"x-partition": 1}  # pinned into partition 1, whatever the name hashes to
    n2.check_queue(conn, "/", QUEUES[0], pinned, False)
    n2.gone(link)


def test_whether_a_queue_is_served_is_asked_without_a_connection(sim: GroupSimulation
                                                                 ) -> None:
    """``serves_queue``: a server-named queue gets a name whose partition the node leads."""
    n2 = clients_of(sim.node("n2"))
    assert n2.serves_queue("/", QUEUES[1], {}, False)
    assert not n2.serves_queue("/", QUEUES[0], {}, False)
    assert n2.serves_queue("/", QUEUES[0], {}, True)  # exclusive: in no partition


def test_a_connection_never_admitted_is_served_nothing(sim: GroupSimulation) -> None:
    n2 = clients_of(sim.node("n2"))
    with pytest.raises(NotLeader):
        n2.check_queue(Conn(Link()), "/", QUEUES[1], {}, False)


def test_a_confirm_passes_the_gate_of_its_queue_s_group_only(sim: GroupSimulation) -> None:
    node = sim.node("n2")
    n2 = clients_of(node)
    vhost = node.broker.vhosts["/"]
    own, copy = vhost.queues[QUEUES[1]], vhost.queues[QUEUES[0]]  # led here; n1's copy
    done: list[str] = []
    refused = node.broker.durable_refused
    node.run(lambda: n2.after_durable([own], partial(done.append, "own")))
    node.run(lambda: n2.after_durable([copy], partial(done.append, "copy")))
    node.run(lambda: n2.after_durable([own, copy], partial(done.append, "both")))
    node.run(lambda: n2.after_durable([], partial(done.append, "unrouted")))
    sim.run_until(sim.now + 1.0)
    assert sorted(done) == ["own", "unrouted"]  # group 1's gate is n1's, shut here
    assert node.broker.durable_refused == refused + 2


def test_a_group_s_failover_closes_its_clients_and_no_other_s() -> None:
    sim = laid_out()
    n1 = clients_of(sim.node("n1"))  # the metadata group and partition 0
    queue_client, queue_conn = served(n1)
    meta_client, meta_conn = served(n1)
    n1.check_queue(queue_conn, "/", QUEUES[0], {}, False)
    n1.check_configuration(meta_conn, "declare exchange 'x'")
    sim.promote_group(sim.node("n1"), 1, "n2")  # partition 0 moves to n2
    sim.run_until(sim.now + 3.0)
    assert sim.serving_groups[1] is sim.node("n2")
    assert queue_client.closed and not meta_client.closed
    assert n1.serving_groups() == [0] and n1.lost_groups() == []


def test_a_node_that_serves_no_group_closes_every_connection() -> None:
    sim = laid_out()
    n3 = clients_of(sim.node("n3"))  # partition 2 only
    idle, _ = served(n3)  # touched no group
    sim.promote_group(sim.node("n3"), 3, "n1")
    sim.run_until(sim.now + 3.0)
    assert n3.serving_groups() == [] and n3.decide(True) is Admission.RELAY
    assert n3.lost_groups() == [idle] and idle.closed
    assert not n3.admit(Link()) and n3.refused == 1


def test_a_dead_letter_goes_to_the_queues_this_node_leads_only() -> None:
    """On a partitioned node a queue of a group it follows is a copy (``followed``): a dead
    letter of a queue it leads is not enqueued into it (stage 3 forwards it instead)."""
    broker = Broker("n1")
    vh = broker.add_vhost("/")
    source = vh.declare_queue("work", owner=None,
                              arguments={"x-dead-letter-exchange": "amq.fanout"})
    led, copy = (vh.declare_queue(name, owner=None) for name in ("dead-here", "dead-there"))
    for q in (led, copy):
        vh.bind("amq.fanout", q, "")
    vh.followed.add(copy)  # a scoped Backup marks its group's queues so (backup/timers.py)
    source.enqueue(Message("", "work", build_header(3), b"job"))
    entry = source.get()
    assert entry is not None
    source.reject(entry)
    assert led.message_count == 1 and copy.message_count == 0
