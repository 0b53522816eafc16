"""A partitioned node's forwarding of publishes (brokerha/partition/forwarding.py with
partition/clients.py's ``GroupClients.publish``, issue 35 stage 3), over the simulation's
nodes (each the product's ``PartitionedMember`` over its broker): what is enqueued here,
what is forwarded and to whom, when the publisher's confirm is given."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pamqp import commands

from brokerha.broker.content import build_header
from brokerha.broker.message import Message
from brokerha.broker.placement import NotLeader
from brokerha.cluster.messages import Message as Packet
from brokerha.cluster.replication import HA_ID
from brokerha.partition.clients import GroupClients
from brokerha.partition.forward import (
    Forward,
    Forwarded,
    ForwardError,
    ForwardPart,
    ForwardSender,
    LeaderNotice,
)
from brokerha.partition.forwarding import NodeForwarding
from brokerha.partition.group_simulation import GroupSimulation
from tests.partition.test_group_clients import QUEUES, Conn, laid_out, served


class HeldConn(Conn):
    """A publishing connection that records its holds (``Connection.hold_publishing``)."""

    def __init__(self, conn: Conn) -> None:
        self.conn_id = conn.conn_id
        self.holds: set[str] = set()
        self.changes: list[bool] = []

    def hold_publishing(self, name: str, held: bool) -> None:
        (self.holds.add if held else self.holds.discard)(name)
        self.changes.append(held)


class Wires:
    """Every node's ``NodeForwarding`` over one in-memory network: packets and the
    callbacks of ``soon`` held until ``pump``."""

    def __init__(self, sim: GroupSimulation) -> None:
        self.sim = sim
        self.packets: list[tuple[str, str, Packet]] = []  # (from, to, packet)
        self.soon: list[Callable[[], None]] = []
        self.nodes: dict[str, NodeForwarding] = {}
        self.clients: dict[str, GroupClients] = {}
        self.paused: set[str] = set()  # nodes whose packets wait (as a SIGSTOPped process's)
        self.waiting: list[tuple[str, str, Packet]] = []
        for name in ("n1", "n2", "n3"):
            node = sim.node(name)
            fw = NodeForwarding(node.ha, f"{name}.1", ["n1", "n2", "n3"],
                                send=self.sender(name),
                                soon=self.soon.append, clock=lambda: sim.now)
            clients = GroupClients(node.ha, lambda n: f"amqp://{n}")
            clients.forwarding = fw
            self.nodes[name], self.clients[name] = fw, clients
            for group, member in node.ha.groups.items():
                term = member.role_term()
                if group and term is not None:
                    fw.serving(group, term)

    def sender(self, src: str) -> Callable[[str, Packet], None]:
        def send(peer: str, packet: Packet) -> None:
            self.packets.append((src, peer, packet))

        return send

    def pump(self, rounds: int = 20) -> list[tuple[str, str, Packet]]:
        """Deliver what is held, run the simulation a little (syncs, acks), tick, again."""
        seen = []
        for _ in range(rounds):
            while self.soon or self.packets:
                soon = list(self.soon)  # (the nodes hold self.soon.append)
                self.soon.clear()
                for callback in soon:
                    callback()
                packets, self.packets = self.packets, []
                if not self.paused:
                    packets, self.waiting = self.waiting + packets, []
                seen += packets
                for src, dst, packet in packets:
                    if dst in self.paused or src in self.paused:
                        self.waiting.append((src, dst, packet))
                    else:
                        self.nodes[dst].on_packet(src, packet)
            self.sim.run_until(self.sim.now + 0.1)
            for fw in self.nodes.values():  # the shell's tick: retries, notices
                fw.tick()
        return seen


@pytest.fixture()
def wires() -> Wires:
    return Wires(laid_out())  # n1: metadata group and partition 0; n2: 1; n3: 2


def message(body: bytes, routing_key: str = "") -> Message:
    return Message("", routing_key, build_header(len(body), commands.Basic.Properties(delivery_mode=2)), body)


def publish(wires: Wires, node: str, queues: list[str], body: bytes,
            conn: Conn | None = None) -> list[bool]:
    """``body`` published on ``node`` to ``queues`` (as routed there), by ``conn`` (None: a
    new connection): the confirms."""
    clients = wires.clients[node]
    if conn is None:
        _, conn = served(clients)
    vhost = wires.sim.node(node).broker.vhosts["/"]
    answers: list[bool] = []
    clients.publish(conn, "/", [vhost.queues[q] for q in queues], message(body),
                    answers.append)
    return answers


def test_a_queue_of_a_group_served_here_is_enqueued_here_the_others_forwarded(
        wires: Wires) -> None:
    own, theirs = QUEUES[1], QUEUES[0]  # partition 1 is n2's; partition 0 n1's
    before = {q: wires.sim.node(n).broker.vhosts["/"].queues[q].message_count
              for q, n in ((own, "n2"), (theirs, "n1"))}
    answers = publish(wires, "n2", [own, theirs], b"900001")
    assert wires.sim.node("n2").broker.vhosts["/"].queues[own].message_count == \
        before[own] + 1
    assert answers == []  # neither part answered yet
    seen = wires.pump()
    forwards = [(s, d, p) for s, d, p in seen if isinstance(p, Forward)]
    assert [(s, d, p.group) for s, d, p in forwards] == [("n2", "n1", 1)]
    copy = wires.sim.node("n2").broker.vhosts["/"].queues[theirs]
    assert forwards[0][2].messages[0][1] == [str(copy.arguments[HA_ID])]  # by x-ha-id
    assert wires.sim.node("n1").broker.vhosts["/"].queues[theirs].message_count == \
        before[theirs] + 1
    assert answers == [True]  # both answered: one confirm
    assert any(isinstance(p, Forwarded) and d == "n2" for _, d, p in seen)


def test_every_node_hears_who_serves_each_group(wires: Wires) -> None:
    wires.pump(1)
    for name, fw in wires.nodes.items():
        leaders = {g: lane.leader for g, lane in fw.sender.lanes.items()}
        assert leaders == {1: "n1", 2: "n2", 3: "n3"}, (name, leaders)


def test_a_forward_to_a_node_not_serving_the_group_is_answered_not_primary(
        wires: Wires) -> None:
    wires.pump(1)
    n3 = wires.nodes["n3"]
    n3.on_packet("n2", Forward(1, 1, "n2.1", 1, 0, []))  # group 1 is n1's
    assert [(d, type(p)) for _, d, p in wires.packets if not isinstance(p, LeaderNotice)] \
        == [("n2", ForwardError)]
    assert n3.stats.not_serving == 1


def test_without_forwarding_a_queue_of_another_group_is_refused_before_anything(
        wires: Wires) -> None:
    clients = wires.clients["n2"]
    clients.forwarding = None
    vhost = wires.sim.node("n2").broker.vhosts["/"]
    own = vhost.queues[QUEUES[1]]
    count = own.message_count
    _, conn = served(clients)
    with pytest.raises(NotLeader, match="led by n1"):
        clients.publish(conn, "/", [own, vhost.queues[QUEUES[0]]], message(b"900002"), None)
    assert own.message_count == count  # checked before anything was enqueued


def test_a_full_lane_holds_its_publishers_until_answered(wires: Wires) -> None:
    n2 = wires.nodes["n2"]
    n2.sender = ForwardSender("n2.2", window=2)  # no leader known yet: nothing goes
    broker = wires.sim.node("n2").broker
    conn = HeldConn(served(wires.clients["n2"])[1])
    answers = [publish(wires, "n2", [QUEUES[0]], b"%d" % i, conn) for i in range(3)]
    assert conn.holds == {"forward"} and not broker.flow.held  # the connection, not the node
    assert n2.status()["held"] == 1
    wires.pump()  # the notices name n1; it answers; the lane empties
    assert conn.holds == set() and conn.changes == [True, False] and answers == [[True]] * 3
    assert n2.status()["held"] == 0 and n2.stats.connection_holds == 1


def test_a_lane_whose_leader_is_paused_holds_its_publishers_only(wires: Wires) -> None:
    """Two publishers on n2: one to partition 0, whose leader n1 is paused (its packets
    wait), one to partition 2 (n3's): the first is held once its lane is full, the second
    goes on getting its confirms; n1 back, the first is released and confirmed."""
    wires.pump(1)
    n2 = wires.nodes["n2"]
    n2.sender.window = 4
    for lane in n2.sender.lanes.values():
        assert lane.leader is not None
    slow, fast = (HeldConn(served(wires.clients["n2"])[1]) for _ in range(2))
    wires.paused.add("n1")
    slow_answers = [publish(wires, "n2", [QUEUES[0]], b"%d" % (900100 + i), slow)
                    for i in range(4)]
    wires.pump(3)
    assert slow.holds == {"forward"} and slow_answers == [[]] * 4
    fast_answers = []
    for i in range(20):
        fast_answers.append(publish(wires, "n2", [QUEUES[2]], b"%d" % (900200 + i), fast))
        wires.pump(1)
        assert fast_answers[:-1] == [[True]] * i  # confirmed the round after
    wires.pump(1)
    assert fast.changes == [] and fast_answers == [[True]] * 20
    assert slow.holds == {"forward"} and slow_answers == [[]] * 4
    wires.paused.clear()
    wires.pump(40)  # n1's answers to what waited, then the retries' (backed off)
    assert slow.holds == set() and slow_answers == [[True]] * 4


def test_a_forward_is_confirmed_only_through_its_group_s_gate_and_applied_once(
        wires: Wires) -> None:
    """n1 applies n2's forward but its gate answers for nothing (as a leader whose lease
    is gone): no confirm; the sender's retries are dropped below n1's mark (nothing
    enqueued twice) and answered through the gate again; once the gate answers, the
    publish is confirmed once."""
    wires.pump(1)
    member = wires.sim.node("n1").ha.groups[1]
    queue = wires.sim.node("n1").broker.vhosts["/"].queues[QUEUES[0]]
    count = queue.message_count
    member.term = lambda: None  # type: ignore[method-assign]
    member.lapsed = lambda: None  # type: ignore[method-assign]
    member.refused = lambda: None  # type: ignore[method-assign]
    answers = publish(wires, "n2", [QUEUES[0]], b"900020")
    wires.pump(25)  # 2.5 s: the sender's retries (0.5 s, then 1 s later) resend twice
    receiver = wires.nodes["n1"].receivers[1]
    assert answers == [] and queue.message_count == count + 1
    assert receiver.stats.applied == 1 and receiver.stats.deduped >= 2
    del member.term, member.lapsed, member.refused  # the gate answers again
    wires.pump(30)  # the next retry (2 s after the last, the delay doubled meanwhile)
    assert answers == [True] and queue.message_count == count + 1


def test_forwards_are_bounded_in_bytes_and_a_large_body_goes_in_parts(
        wires: Wires) -> None:
    """A Forward carries at most ``max_bytes`` of headers and bodies (a bigger message
    alone): the link refuses a packet over 64 MiB, every group's traffic with it. A body
    over ``part_bytes`` goes as ForwardParts before its Forward, and the leader enqueues it
    whole, once, beside the part enqueued here."""
    wires.pump(1)
    n2 = wires.nodes["n2"]
    n2.sender.max_bytes = 2500
    answers = [publish(wires, "n2", [QUEUES[0]], b"%d" % (900030 + i) + b"0" * 1000)
               for i in range(5)]
    seen = wires.pump()
    sizes = [len(p.messages) for _, _, p in seen if isinstance(p, Forward)]
    assert sizes == [2, 2, 1] and answers == [[True]] * 5
    n2.sender.part_bytes = 1024
    own = wires.sim.node("n2").broker.vhosts["/"].queues[QUEUES[1]]
    theirs = wires.sim.node("n1").broker.vhosts["/"].queues[QUEUES[0]]
    counts = own.message_count, theirs.message_count
    body = b"900040" + b"0123456789" * 300  # 3,006 bytes (digits: the checks read them)
    big = publish(wires, "n2", [QUEUES[1], QUEUES[0]], body)
    seen = wires.pump()
    parts = [p for _, d, p in seen if isinstance(p, ForwardPart) and d == "n1"]
    assert [(len(p.data), p.offset) for p in parts] == [(1024, 0), (1024, 1024), (958, 2048)]
    assert big == [True]
    assert (own.message_count, theirs.message_count) == (counts[0] + 1, counts[1] + 1)
    assert list(theirs.ready)[-1].message.body == body == list(own.ready)[-1].message.body
    assert wires.nodes["n1"].receivers[1].stats.parts == 3


def test_parts_to_a_peer_are_spread_over_loop_turns_in_order() -> None:
    """``Paced``: at most ``per_turn`` bytes of body parts to a peer a loop turn (a 60 MiB
    body written in one turn held the loop); what follows a part held back waits behind
    it; another peer's packets go at once."""
    from brokerha.partition.forwarding import Paced

    sent: list[tuple[str, object]] = []
    turns: list[Callable[[], None]] = []
    paced = Paced(lambda node, p: sent.append((node, p)), turns.append, per_turn=10)
    parts = [ForwardPart(1, 1, "a.1", 1, 24, 4 * i, b"abcd") for i in range(6)]
    for part in parts:
        paced.send("n2", part)
    forward = Forward(1, 1, "a.1", 1, 0, [])
    paced.send("n2", forward)
    paced.send("n3", forward)
    assert sent == [("n2", p) for p in parts[:3]] + [("n3", forward)]
    sent.clear()
    while turns:
        before = len(sent)
        turns.pop(0)()
        if len(sent) > before:
            sent.append(("turn", None))
    # the next turn: three parts more (10 bytes' budget); the forward the turn after
    assert sent == [*[("n2", p) for p in parts[3:]], ("turn", None), ("n2", forward),
                    ("turn", None)]
    assert paced.turns_held == 1 and not paced.queues


def test_a_dead_letter_routed_to_another_partition_s_queue_is_forwarded_to_its_leader(
        wires: Wires) -> None:
    """A message rejected (requeue=false) from a queue n2 leads, its dead-letter exchange
    routing it to a queue of partition 0 (n1 leads it; n2 holds a copy it follows):
    forwarded to n1 by ``x-ha-id``, without a confirm, enqueued there once with its
    x-death; before, it was dropped with a warning."""
    wires.pump(1)
    vhost = wires.sim.node("n2").broker.vhosts["/"]
    target = QUEUES[0]
    assert vhost.queues[target] in vhost.followed  # a copy of n1's queue
    source = vhost.declare_queue("dl-source", owner=None, durable=True, arguments={
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": target})
    theirs = wires.sim.node("n1").broker.vhosts["/"].queues[target]
    count = theirs.message_count
    source.enqueue(message(b"900050"))
    entry = source.get()
    assert entry is not None
    source.reject(entry)
    seen = wires.pump()
    forwards = [p for s, d, p in seen if isinstance(p, Forward) and (s, d) == ("n2", "n1")]
    assert len(forwards) == 1 and forwards[0].messages[0][3] == target
    assert theirs.message_count == count + 1
    dead = list(theirs.ready)[-1].message
    assert dead.body == b"900050" and b"x-death" in dead.header and b"rejected" in dead.header
    assert wires.nodes["n2"].stats.dead_letters == 1
