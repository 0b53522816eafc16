"""Declarations from any node (brokerha/partition/declarations.py, issue 35 stage 3): the
asking node's requests and the leader's host alone, then ``NodeDeclarations`` over the
simulation's nodes (each the product's ``PartitionedMember`` over its broker): a queue
declared, bound, purged and deleted, an exchange declared and bound, from a node that
serves neither group, answered with the leader's answers and errors, and only once the
asking node's own copy holds what was done (read-your-writes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pamqp import commands

from brokerha.amqp.frames import unchecked
from brokerha.broker.errors import BrokerError, NotFound, PreconditionFailed
from brokerha.cluster.messages import Message as Packet
from brokerha.cluster.partition_table import hash_partition
from brokerha.cluster.replication import HA_ID
from brokerha.partition.declarations import (
    CONNECTION_FORCED,
    NOT_PRIMARY,
    Answer,
    BrokerOps,
    DeclarationHost,
    DeclarationRequests,
    MetaReply,
    MetaRequest,
    NodeDeclarations,
    ReplyWhenDurable,
    Send,
)
from brokerha.partition.group_simulation import GroupSimulation
from brokerha.partition.member import group_of
from tests.partition.test_forwarding_node import message
from tests.partition.test_group_clients import laid_out

# -- the asking node's side alone --------------------------------------------------------------


class World:
    def __init__(self) -> None:
        self.leaders: dict[int, tuple[str, int]] = {1: ("n2", 3)}
        self.copy: dict[int, tuple[int, int]] = {1: (3, 0)}

    def reached(self, group: int, epoch: int, seq: int) -> bool:
        return self.copy[group] >= (epoch, seq)

    def requests(self) -> DeclarationRequests:
        return DeclarationRequests("n1.x", leader_of=self.leaders.get, reached=self.reached,
                                   timeout=10.0, retry=0.1)


def reply(request: int, code: int = 0, result: list[Any] | None = None,
          position: tuple[int, int] = (3, 7), text: str = "") -> MetaReply:
    return MetaReply(1, "n1.x", request, code, text, result or [], list(position))


def test_an_answer_waits_for_this_nodes_copy() -> None:
    world = World()
    req = world.requests()
    rid, out = req.ask(0.0, 1, "queue.declare", ["/", "q", False, True, False, {}], [2, 5])
    assert out == [Send("n2", MetaRequest(1, "n1.x", rid, "queue.declare",
                                          ["/", "q", False, True, False, {}], [2, 5]))]
    # the leader's answer at its log's (3, 7): this node's copy is at (3, 0)
    assert req.receive(0.1, "n2", reply(rid, result=["q", 0, 0])) == []
    assert req.poll() == []
    world.copy[1] = (3, 7)
    assert req.poll() == [Answer(rid, 0, "", ["q", 0, 0])]
    assert not req.pending and req.stats.waited == 1


def test_a_copy_of_a_later_epoch_holds_the_answer() -> None:
    world = World()
    req = world.requests()
    rid, _ = req.ask(0.0, 1, "queue.bind", ["/", "q", "x", "k", {}], [-1, 0])
    world.copy[1] = (4, 1)  # a later primary's, caught up: it holds every durable answer
    assert req.receive(0.1, "n2", reply(rid)) == [Answer(rid, 0, "", [])]


def test_an_error_is_the_leaders_code_and_text_at_once() -> None:
    req = World().requests()
    rid, _ = req.ask(0.0, 1, "queue.declare", ["/", "q", False, False, False, {}], [-1, 0])
    text = "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': " \
           "received 'false' but current is 'true'"
    assert req.receive(0.1, "n2", reply(rid, 406, text=text, position=(-1, 0))) == \
        [Answer(rid, 406, text)]


def test_not_primary_is_asked_again_of_the_next_leader() -> None:
    world = World()
    req = world.requests()
    rid, _ = req.ask(0.0, 1, "queue.purge", ["/", "q"], [-1, 0])
    assert req.receive(0.1, "n2", reply(rid, NOT_PRIMARY)) == []  # nothing applied
    assert req.tick(0.15) == []  # the retry delay
    world.leaders[1] = ("n3", 4)
    out = req.tick(0.25)
    assert [(e.node, e.packet.request) for e in out if isinstance(e, Send)] == [("n3", rid)]
    assert req.stats.resent == 1


def test_a_lost_leader_resends_what_is_idempotent_and_closes_the_rest() -> None:
    world = World()
    req = world.requests()
    declare, _ = req.ask(0.0, 1, "queue.declare", ["/", "q", False, True, False, {}], [-1, 0])
    purge, _ = req.ask(0.0, 1, "queue.purge", ["/", "q"], [-1, 0])
    delete, _ = req.ask(0.0, 1, "queue.delete", ["/", "q", False, False], [-1, 0])
    world.leaders[1] = ("n3", 4)  # n2 deposed before it answered: applied or not, unknown
    out = req.tick(0.5)
    sent = [e for e in out if isinstance(e, Send)]
    answers = {e.request: e.code for e in out if isinstance(e, Answer)}
    assert [(e.node, e.packet.request) for e in sent] == [("n3", declare)]
    assert answers == {purge: CONNECTION_FORCED, delete: CONNECTION_FORCED}
    # the deposed leader's late answer is not taken
    assert req.receive(0.6, "n2", reply(declare, result=["q", 0, 0])) == []
    world.copy[1] = (4, 2)
    assert req.receive(0.7, "n3", reply(declare, result=["q", 0, 0], position=(4, 2))) == \
        [Answer(declare, 0, "", ["q", 0, 0])]


def test_a_link_lost_and_a_timeout() -> None:
    world = World()
    req = world.requests()
    purge, _ = req.ask(0.0, 1, "queue.purge", ["/", "q"], [-1, 0])
    bind, _ = req.ask(0.0, 1, "queue.bind", ["/", "q", "x", "", {}], [-1, 0])
    out = req.link_lost(0.2, "n2")
    assert [e.request for e in out if isinstance(e, Answer)] == [purge]
    assert [e.packet.request for e in out if isinstance(e, Send)] == [bind]  # same leader
    del world.leaders[1]  # no leader now: it waits, then closes at its deadline
    out = req.tick(10.5)
    assert out == [Answer(bind, CONNECTION_FORCED, out[0].text)] and "10 s" in out[0].text


# -- the leader's side alone -------------------------------------------------------------------


def test_the_host_applies_once_its_metadata_copy_reached_the_askers() -> None:
    serving = {1: True}
    meta = [(2, 3)]
    applied: list[tuple[str, list[Any]]] = []

    def apply(op: str, args: list[Any]) -> list[Any]:
        applied.append((op, args))
        if args[1] == "bad":
            raise PreconditionFailed("no")
        return ["ok"]

    host = DeclarationHost(serves=lambda g: serving.get(g, False),
                           metadata_reached=lambda e, s: meta[0] >= (e, s), apply=apply,
                           hold=5.0)
    request = MetaRequest(1, "n1.x", 1, "queue.bind", ["/", "q", "x", "", {}], [2, 9])
    assert host.receive(0.0, "n1", request) == [] and host.held  # its exchange not here yet
    meta[0] = (2, 9)
    out = host.poll(0.1)
    assert isinstance(out[0], ReplyWhenDurable) and out[0].reply.result == ["ok"]
    bad = MetaRequest(1, "n1.x", 2, "queue.declare", ["/", "bad"], [-1, 0])
    assert host.receive(0.2, "n1", bad) == [Send("n1", MetaReply(
        1, "n1.x", 2, 406, "PRECONDITION_FAILED - no", [], [-1, 0]))]
    late = MetaRequest(1, "n1.x", 3, "queue.bind", ["/", "q", "x", "", {}], [3, 1])
    host.receive(0.3, "n1", late)
    assert host.poll(5.0) == [] and host.poll(5.4)  # past ``hold``: applied anyway
    serving[1] = False
    out = host.receive(6.0, "n1", request)
    assert isinstance(out[0], Send) and out[0].packet.code == NOT_PRIMARY
    assert len(applied) == 3


# -- over the simulation's nodes ---------------------------------------------------------------


class User:
    def check(self, *args: Any) -> None:
        pass

    def check_topic(self, *args: Any) -> None:
        pass


class Conn:
    def __init__(self) -> None:
        self.failed: list[Any] = []
        self.exclusive_queues: dict[str, Any] = {}

    def fail(self, ch: Any, exc: Any) -> None:
        self.failed.append((exc.code, exc.text, exc.class_id, exc.method_id))
        ch.state = "closed"


class Channel:
    """What ``NodeDeclarations`` uses of an AMQP channel."""

    def __init__(self, vhost: Any) -> None:
        from brokerha.amqp.channel import OPEN

        self.state = OPEN
        self.number = 1
        self.vhost = vhost
        self.user = User()
        self.conn = Conn()
        self.blocked = False
        self.sent: list[Any] = []
        self.last_queue = ""

    def block(self) -> None:
        self.blocked = True

    def unblock(self) -> None:
        self.blocked = False

    def reply_unblocked(self, method: Any) -> None:
        self.sent.append(method)
        self.blocked = False


class Net:
    def __init__(self, sim: GroupSimulation) -> None:
        self.sim = sim
        self.packets: list[tuple[str, str, Packet]] = []
        self.soon: list[Callable[[], None]] = []
        self.nodes: dict[str, NodeDeclarations] = {}
        for name in ("n1", "n2", "n3"):
            self.nodes[name] = NodeDeclarations(
                sim.node(name).ha, f"{name}.1", send=self.sender(name), soon=self.soon.append,
                clock=lambda: sim.now)

    def sender(self, src: str) -> Callable[[str, Packet], None]:
        return lambda peer, packet: self.packets.append((src, peer, packet))

    def pump(self, rounds: int = 20) -> None:
        for _ in range(rounds):
            while self.soon or self.packets:
                soon, self.soon[:] = list(self.soon), []
                for callback in soon:
                    callback()
                packets, self.packets = self.packets, []
                for src, dst, packet in packets:
                    self.nodes[dst].on_packet(src, packet)
            self.sim.run_until(self.sim.now + 0.05)
            for node in self.nodes.values():
                node.moved()
                node.tick()

    def channel(self, node: str) -> Channel:
        return Channel(self.sim.node(node).broker.vhosts["/"])


def name_in(partition: int, prefix: str) -> str:
    return next(f"{prefix}-{i}" for i in range(1000)
                if hash_partition("/", f"{prefix}-{i}", 3) == partition)


@pytest.fixture(scope="module")
def net() -> Net:
    return Net(laid_out())  # n1: metadata group and partition 0; n2: 1; n3: 2


def test_a_queue_declared_from_a_node_that_does_not_lead_it(net: Net) -> None:
    name = name_in(1, "declared")  # partition 1: n2 leads it
    ch = net.channel("n3")
    net.nodes["n3"].queue_method(ch, group_of(1), commands.Queue.Declare(
        queue=name, durable=True), name)
    assert ch.blocked
    net.pump()
    assert not ch.blocked and ch.last_queue == name
    ok = ch.sent[-1]
    assert isinstance(ok, commands.Queue.DeclareOk) and \
        (ok.queue, ok.message_count, ok.consumer_count) == (name, 0, 0)
    copy = net.sim.node("n3").broker.vhosts["/"].queues[name]  # read-your-writes: here now
    leader = net.sim.node("n2").broker.vhosts["/"].queues[name]
    assert copy.arguments[HA_ID] == leader.arguments[HA_ID]
    # again with another durable: the leader's 406, its text, the method's ids
    ch = net.channel("n3")
    net.nodes["n3"].queue_method(ch, group_of(1), commands.Queue.Declare(
        queue=name, durable=False), name)
    net.pump()
    with pytest.raises(BrokerError) as direct:
        net.sim.node("n2").broker.vhosts["/"].declare_queue(name, owner=None, durable=False)
    assert ch.conn.failed == [(406, direct.value.reply_text, 50, 10)]


def test_a_utf8_name_declared_from_a_node_that_does_not_lead_it(net: Net) -> None:
    """RabbitMQ takes any UTF-8 name; pamqp's validate() holds names to ASCII: the
    declare-ok built for 'qé' raised in the reply's handler and the channel waited forever."""
    name = name_in(1, "qé ☕")  # partition 1: n2 leads it
    ch = net.channel("n3")
    declare = unchecked(commands.Queue.Declare, ticket=0, queue=name, passive=False,
                        durable=True, exclusive=False, auto_delete=False, nowait=False,
                        arguments={})
    net.nodes["n3"].queue_method(ch, group_of(1), declare, name)
    net.pump()
    assert not ch.blocked and not ch.conn.failed
    ok = ch.sent[-1]
    assert isinstance(ok, commands.Queue.DeclareOk) and ok.queue == name


def test_an_answer_that_cannot_be_made_closes_rather_than_hangs(
        net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    name = name_in(1, "unanswerable")
    ch = net.channel("n3")
    monkeypatch.setattr(commands.Queue, "PurgeOk", None)  # makes the answer raise
    net.nodes["n3"].queue_method(ch, group_of(1), commands.Queue.Declare(
        queue=name, durable=True), name)
    net.pump()
    ch = net.channel("n3")
    net.nodes["n3"].queue_method(ch, group_of(1), commands.Queue.Purge(queue=name), name)
    net.pump()
    assert len(ch.conn.failed) == 1
    code, text, class_id, method_id = ch.conn.failed[0]
    assert (code, class_id, method_id) == (541, 50, 30)
    assert text.startswith("INTERNAL_ERROR - answering queue.purge failed")


def test_an_exchange_from_a_node_off_the_metadata_group_then_a_binding(net: Net) -> None:
    name = name_in(2, "bound")  # partition 2: n3 leads it
    ch = net.channel("n2")
    net.nodes["n2"].exchange_method(ch, commands.Exchange.Declare(
        exchange="dx", exchange_type="direct", durable=True))
    net.pump()
    assert isinstance(ch.sent[-1], commands.Exchange.DeclareOk)
    assert "dx" in net.sim.node("n2").broker.vhosts["/"].exchanges  # its own copy holds it
    ch = net.channel("n1")  # n1: the metadata group's leader, not partition 2's
    net.nodes["n1"].queue_method(ch, group_of(2), commands.Queue.Declare(
        queue=name, durable=True), name)
    net.pump()
    ch = net.channel("n2")
    net.nodes["n2"].queue_method(ch, group_of(2), commands.Queue.Bind(
        queue=name, exchange="dx", routing_key="k"), name)
    net.pump()
    assert isinstance(ch.sent[-1], commands.Queue.BindOk)
    for node in ("n1", "n2", "n3"):
        vhost = net.sim.node(node).broker.vhosts["/"]
        assert vhost.has_binding(vhost.exchanges["dx"], vhost.queues[name], "k", {}), node
    # a binding to a missing exchange: the leader's 404
    ch = net.channel("n2")
    net.nodes["n2"].queue_method(ch, group_of(2), commands.Queue.Bind(
        queue=name, exchange="nope", routing_key="k"), name)
    net.pump()
    assert ch.conn.failed and ch.conn.failed[0][:1] == (404,)
    assert ch.conn.failed[0][1] == "NOT_FOUND - no exchange 'nope' in vhost '/'"


def test_purge_and_delete_answer_the_leaders_counts(net: Net) -> None:
    name = name_in(1, "purged")  # not one of the simulation's queues (its checks read them)
    leader = net.sim.node("n2").broker.vhosts["/"]
    queue = leader.queues.get(name) or leader.declare_queue(name, owner=None, durable=True)
    for i in range(3):
        queue.enqueue(message(b"m%d" % i))
    ch = net.channel("n1")
    net.nodes["n1"].queue_method(ch, group_of(1), commands.Queue.Purge(queue=name), name)
    net.pump()
    assert ch.sent[-1].message_count == 3
    queue.enqueue(message(b"again"))
    ch = net.channel("n1")
    net.nodes["n1"].queue_method(ch, group_of(1), commands.Queue.Delete(
        queue=name, if_empty=True), name)
    net.pump()
    assert ch.conn.failed[0][0] == 406
    ch = net.channel("n1")
    net.nodes["n1"].queue_method(ch, group_of(1), commands.Queue.Delete(queue=name), name)
    net.pump()
    assert ch.sent[-1].message_count == 1
    assert name not in net.sim.node("n1").broker.vhosts["/"].queues  # read-your-writes


def test_broker_ops_answer_as_the_vhost() -> None:
    from brokerha.broker.broker import Broker

    broker = Broker()
    broker.add_vhost("/")
    ops = BrokerOps(broker)
    assert ops.apply("queue.declare", ["/", "q", False, True, False, {}]) == ["q", 0, 0]
    with pytest.raises(NotFound):
        ops.apply("queue.declare", ["/", "none", True, False, False, {}])
    with pytest.raises(NotFound):
        ops.apply("queue.bind", ["/", "q", "x", "k", {}])
    ops.apply("exchange.declare", ["/", "x", "fanout", False, True, False, False, {}])
    ops.apply("queue.bind", ["/", "q", "x", "k", {}])
    ops.apply("queue.unbind", ["/", "q", "x", "k", {}])
    ops.apply("queue.unbind", ["/", "q", "x", "k", {}])  # idempotent
    assert ops.apply("queue.delete", ["/", "missing", False, False]) == [0]
    ops.apply("exchange.delete", ["/", "x", False])
    ops.apply("exchange.delete", ["/", "x", False])  # a missing one: ok, as RabbitMQ 3.x


def test_the_management_apis_request_is_a_future_of_the_leaders_answer(net: Net) -> None:
    """``NodeDeclarations.request`` (the management API's, no channel): the leader's
    result, or ``LeaderRefused`` with its code and text."""
    import asyncio

    from brokerha.partition.declarations import LeaderRefused

    name = name_in(2, "api")  # partition 2: n3 leads it; asked on n1
    node = net.nodes["n1"]

    async def ask(args: list[Any]) -> Any:
        future = node.request(group_of(2), "queue.declare", args)
        net.pump()
        return await future

    assert asyncio.run(ask(["/", name, False, True, False, {}])) == [name, 0, 0]
    assert name in net.sim.node("n1").broker.vhosts["/"].queues  # read-your-writes
    with pytest.raises(LeaderRefused) as refused:
        asyncio.run(ask(["/", name, False, False, False, {}]))
    assert refused.value.code == 406 and refused.value.reply_text.startswith(
        "PRECONDITION_FAILED - inequivalent arg 'durable'")
