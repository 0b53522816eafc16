"""A node holding no cell of some partition refuses (540) what it cannot route completely
when the queue directory does not give it that partition (docs/ha.md "Routing on a node
outside a partition: the queue directory"; here ``GroupClients`` with no directory, the
fallback's own case: tests/partition/test_directory.py has the directory's): it does not
know that partition's queues nor their bindings, so a publish it routes could miss them
and be confirmed and dropped. Over the simulation's nodes (the product's ``PartitionedMember``)
and the product's ``GroupClients``: four nodes, P = 4, NR = 2 (each partition on three
of the four)."""

from __future__ import annotations

from functools import partial

import pytest
from pamqp import commands

from brokerha.broker.content import build_header
from brokerha.broker.errors import NotImplementedByBroker
from brokerha.broker.message import Message
from brokerha.ha.simulation.world import Faults
from brokerha.partition.clients import GroupClients
from brokerha.partition.group_simulation import GroupNode, GroupSimulation, queue_names
from brokerha.partition.member import group_of

pytestmark = pytest.mark.timeout(60)

P = 4
QUEUES = queue_names(P)  # q<p>-<i>: one name per partition


def declare(sim: GroupSimulation, leader: GroupNode, partition: int) -> None:
    sim.client_queue(leader, sim.clients[partition])


def started(nodes: int) -> GroupSimulation:
    sim = GroupSimulation(0, nodes=nodes, partitions=P, replicas=2, faults=Faults.none(),
                          publish_rate=0.0, consume_rate=0.0)
    sim.start()
    sim.run_until(8.0)
    assert all(n is not None for n in sim.serving_groups.values()), sim.serving_groups
    for client in sim.clients:  # each partition's queue, declared on its leader
        leader = sim.serving_groups[client.partition + 1]
        assert leader is not None
        leader.run(partial(declare, sim, leader, client.partition))
    sim.run_until(sim.now + 2.0)
    return sim


@pytest.fixture(scope="module")
def sim() -> GroupSimulation:
    return started(4)


def outside(sim: GroupSimulation) -> tuple[GroupNode, int, int]:
    """A node, a partition it holds no cell of, and one it leads (or holds)."""
    for node in sim.group_nodes():
        missing = [p for p in range(P) if group_of(p) not in node.ha.groups]
        held = [p for p in range(P) if group_of(p) in node.ha.groups]
        if missing and held:
            return node, missing[0], held[0]
    raise AssertionError("every node holds a cell of every partition")


def message(exchange: str, key: str) -> Message:
    return Message(exchange, key, build_header(3, commands.Basic.Properties(delivery_mode=2)), b"abc")


def depths(sim: GroupSimulation) -> dict[tuple[str, str], int]:
    return {(n.name, q.name): q.message_count for n in sim.group_nodes()
            for q in n.broker.vhosts["/"].queues.values()}


def test_a_node_outside_a_partition_knows_none_of_its_queues(sim: GroupSimulation) -> None:
    node, missing, held = outside(sim)
    queues = node.broker.vhosts["/"].queues
    assert QUEUES[missing] not in queues  # the gap itself: declared on its leader only
    assert QUEUES[held] in queues
    assert GroupClients(node.ha).unknown_partitions() == \
        [p for p in range(P) if group_of(p) not in node.ha.groups]


def test_an_unknown_queue_on_the_default_exchange_is_refused_not_confirmed(
        sim: GroupSimulation) -> None:
    node, missing, _ = outside(sim)
    clients = GroupClients(node.ha)
    before = depths(sim)
    settled: list[bool] = []
    with pytest.raises(NotImplementedByBroker) as refused:
        clients.publish(None, "/", [], message("", QUEUES[missing]), settled.append)
    assert refused.value.code == 540
    text = str(refused.value)
    unknown = clients.unknown_partitions()
    assert missing in unknown
    cells = "s " if len(unknown) > 1 else " "
    assert f"holds no cell of partition{cells}{', '.join(map(str, unknown))} " in text, text
    assert "default exchange" in text and node.name in text
    sim.run_until(sim.now + 1.0)
    assert settled == [] and depths(sim) == before
    assert clients.unroutable_refused == 1


def test_an_exchange_publish_is_refused_even_when_it_routes_to_a_known_queue(
        sim: GroupSimulation) -> None:
    node, _, held = outside(sim)
    clients = GroupClients(node.ha)
    copy = node.broker.vhosts["/"].queues[QUEUES[held]]
    before = depths(sim)
    settled: list[bool] = []
    with pytest.raises(NotImplementedByBroker, match="exchange 'amq.direct'"):
        clients.publish(None, "/", [copy], message("amq.direct", QUEUES[held]),
                        settled.append)
    sim.run_until(sim.now + 1.0)
    assert settled == [] and depths(sim) == before


def test_a_known_queue_on_the_default_exchange_passes(sim: GroupSimulation) -> None:
    node, _, held = outside(sim)
    clients = GroupClients(node.ha)
    copy = node.broker.vhosts["/"].queues[QUEUES[held]]
    clients.check_route("/", "", [copy])  # routed completely: a name is one queue
    assert clients.unroutable_refused == 0


def test_a_transaction_publishing_what_it_cannot_route_is_refused_at_commit(
        sim: GroupSimulation) -> None:
    node, _, held = outside(sim)
    clients = GroupClients(node.ha)
    copy = node.broker.vhosts["/"].queues[QUEUES[held]]
    before = depths(sim)
    tx = node.broker.new_transaction()
    tx.publish([copy], message("amq.fanout", ""))
    answers: list[tuple[bool, str]] = []
    with pytest.raises(NotImplementedByBroker, match="exchange 'amq.fanout'"):
        clients.tx_commit(None, tx, lambda ok, why: answers.append((ok, why)))
    sim.run_until(sim.now + 1.0)
    assert answers == [] and depths(sim) == before


def test_a_node_holding_every_partition_refuses_nothing() -> None:
    sim = started(3)  # NR = 2 on three nodes: every node holds a cell of every partition
    for node in sim.group_nodes():
        clients = GroupClients(node.ha)
        assert clients.unknown_partitions() == []
        clients.check_route("/", "amq.direct", [])  # unroutable, as RabbitMQ: not refused
        clients.check_route("/", "", [])
        assert clients.unroutable_refused == 0
