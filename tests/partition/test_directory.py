"""The queue directory (brokerha/partition/directory.py, issue 35): its state and its
metadata-group layer alone, then over the simulation's nodes -- four nodes, P = 4, NR = 2,
so each node holds no cell of some partition -- each the product's ``PartitionedMember``
with the directory's layer in its metadata group, and the product's ``NodeDeclarations``,
``NodeForwarding``, ``NodeDirectory`` and ``GroupClients`` over one in-memory network: a
node outside a partition routes to its queues through the directory's stand-ins
(default exchange and a binding), forwards by ``x-ha-id``, is confirmed once the leader
holds the message; a declaration's answer waits for the directory (read-your-writes);
a deposed leader's change is fenced; what the directory does not know is refused (540)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
from pamqp import commands

from brokerha.broker.content import build_header
from brokerha.broker.errors import NotImplementedByBroker
from brokerha.broker.message import Message
from brokerha.cluster import replication as R
from brokerha.cluster.messages import Message as Packet
from brokerha.cluster.replication import HA_ID
from brokerha.ha.simulation.world import Faults
from brokerha.partition.clients import GroupClients
from brokerha.partition.declarations import PACKETS as DECLARATION_PACKETS
from brokerha.partition.declarations import NodeDeclarations
from brokerha.partition.directory import (
    UPDATE,
    Directory,
    DirectoryEntry,
    DirectoryLayer,
    DirectoryWriter,
    NodeDirectory,
    Unsafe,
    entries_of,
    items_wire,
)
from brokerha.partition.forwarding import PACKETS as FORWARD_PACKETS
from brokerha.partition.forwarding import NodeForwarding
from brokerha.partition.group_simulation import GroupSimulation
from brokerha.partition.member import group_of
from tests.partition.test_declarations import Channel

pytestmark = pytest.mark.timeout(90)

P = 4


def entry(partition: int, ha_id: str = "1.1", bindings: tuple[Any, ...] = ()) -> DirectoryEntry:
    return DirectoryEntry(partition, ha_id, True, False, R.encode_table({HA_ID: ha_id}),
                          tuple(bindings))


# -- the state and the layer alone ----------------------------------------------------------


def test_a_deposed_leaders_change_is_fenced_and_a_sync_replaces_the_partition() -> None:
    d = Directory()
    assert d.apply(1, 3, True, [(("/", "a"), entry(1)), (("/", "b"), entry(1, "1.2"))]) \
        == {("/", "a"), ("/", "b")}
    assert d.synced == {1}
    # the leader of epoch 2 (deposed) names "c" late: ignored, nothing changes
    assert d.apply(1, 2, False, [(("/", "c"), entry(1, "2.1"))]) is None
    assert set(d.entries) == {("/", "a"), ("/", "b")}
    # a sync of epoch 4 without "b": it goes; a deletion of another partition's name: kept
    d.apply(2, 1, True, [(("/", "x"), entry(2))])
    assert d.apply(1, 4, True, [(("/", "a"), entry(1))]) == {("/", "b")}
    assert d.apply(1, 4, False, [(("/", "x"), None)]) == set()
    assert set(d.entries) == {("/", "a"), ("/", "x")}
    with pytest.raises(ValueError):
        d.apply(1, 4, False, [(("/", "y"), entry(2))])


class Store:
    def __init__(self) -> None:
        self.meta: dict[str, str] = {}

    def put_meta(self, key: str, value: str) -> None:
        self.meta[key] = value

    def get_meta(self, key: str) -> str | None:
        return self.meta.get(key)


class Log:
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.catch_up_providers: list[Callable[[], list[Any]]] = []

    def emit(self, event: Any) -> int:
        self.events.append(event)
        return len(self.events)


def test_the_layer_appends_stores_and_a_backup_and_a_joiner_get_the_same() -> None:
    store, log = Store(), Log()
    layer = DirectoryLayer(store)
    layer.attach_primary(log)
    bound = entry(0, "1.4", (("amq.direct", "k", R.encode_table({})),))
    assert layer.update(0, 1, True, [(("/", "q"), bound)])
    assert not layer.update(0, 0, False, [(("/", "q"), None)])  # fenced: nothing appended
    assert len(log.events) == 1 and layer.fenced == 1
    # off the wire, as a backup receives it
    event = R.as_record(list(log.events[0]))
    backup = DirectoryLayer(Store())
    backup.replica.apply(event)
    assert backup.directory.entries == layer.directory.entries
    joiner = DirectoryLayer(Store())
    joiner.directory.apply(3, 9, True, [(("/", "stale"), entry(3))])  # replaced whole
    for e in log.catch_up_providers[0]():
        joiner.replica.apply(R.as_record(list(e)))
    assert joiner.directory.entries == {("/", "q"): bound}
    assert joiner.directory.synced == {0} and joiner.directory.epochs == {0: 1}
    # a restart reads it back from the store
    again = DirectoryLayer(store)
    assert again.directory.entries == layer.directory.entries
    assert again.directory.synced == {0}


def test_a_change_rewrites_the_buckets_of_its_names_only() -> None:
    from brokerha.partition.directory import BUCKETS, bucket_of

    writes: list[str] = []

    class Counted(Store):
        def put_meta(self, key: str, value: str) -> None:
            writes.append(key)
            super().put_meta(key, value)

    store = Counted()
    layer = DirectoryLayer(store)
    layer.attach_primary(Log())
    layer.update(0, 1, True, [(("/", f"q{i}"), entry(0, f"1.{i}")) for i in range(500)])
    assert len(writes) == BUCKETS + 1  # a sync: every bucket, and the epochs
    writes.clear()
    layer.update(0, 1, False, [(("/", "q7"), None)])
    assert writes == [f"queue_directory/{bucket_of(('/', 'q7'))}", "queue_directory"]
    again = DirectoryLayer(store)
    assert again.directory.entries == layer.directory.entries and len(again.directory.entries) == 499


def test_the_writer_sends_one_batch_at_a_time_and_the_state_when_it_leaves() -> None:
    from brokerha.broker.broker import Broker

    broker = Broker()
    vhost = broker.add_vhost("/")
    asked: list[tuple[list[Any], Callable[[int, list[int]], None]]] = []
    writer = DirectoryWriter(broker, lambda: (lambda q: 0), lambda a, d: asked.append((a, d)),
                             lambda: 0.0)
    writer.serving(1, 5)
    assert [a[0][:3] for a in asked] == [[0, 5, True]]  # the sync first
    q = vhost.declare_queue("q", owner=None, durable=True, arguments={HA_ID: "5.1"})
    done: list[Any] = []
    writer.record(1, [("/", "q")], done.append)
    assert len(asked) == 1  # one at a time
    vhost.bind("amq.direct", q, "k")
    asked[0][1](0, [1, 7])
    assert done == [] and len(asked) == 2  # the next batch: q as it is now, bound
    args = asked[1][0]
    assert args[:3] == [0, 5, False]
    assert args[3] == items_wire([(("/", "q"), DirectoryEntry(
        0, "5.1", True, False, R.encode_table({HA_ID: "5.1"}),
        (("amq.direct", "k", R.encode_table({})),)))])
    asked[1][1](0, [1, 8])
    assert done == [[1, 8]]
    # a failed batch: its waiters are told, the next one is a sync
    writer.record(1, [("/", "q")], done.append)
    asked[2][1](320, [])
    assert done[-1] is None and asked[3][0][2] is True


# -- over the simulation's nodes --------------------------------------------------------------


class DirectorySimulation(GroupSimulation):
    directory = True


class Net:
    """Every node's declarations, forwarding, directory and clients over one network."""

    def __init__(self, sim: GroupSimulation) -> None:
        self.sim = sim
        self.packets: list[tuple[str, str, Packet]] = []
        self.soon: list[Callable[[], None]] = []
        self.decl: dict[str, NodeDeclarations] = {}
        self.fw: dict[str, NodeForwarding] = {}
        self.dirs: dict[str, NodeDirectory] = {}
        self.clients: dict[str, GroupClients] = {}
        self.fenced: set[str] = set()  # nodes whose writers are not told of serving
        # packets held back (a slow link): ``hold(src, dst, packet)`` says which
        self.hold: Callable[[str, str, Packet], bool] = lambda src, dst, packet: False
        self.held: list[tuple[str, str, Packet]] = []
        self.wired: dict[str, Any] = {}  # name -> the node process the objects are of
        self.restarts = 0
        self.down: set[str] = set()
        self.links: dict[tuple[str, str], bool] = {}  # (a, b) -> connected at the last look
        for name in sim.names:
            self._wire(name)
        self.roles()

    def _wire(self, name: str) -> None:
        """The shell's objects over the node's process now (a restart: anew, as a start
        of the node makes them, with a new origin)."""
        sim, node = self.sim, self.sim.node(name)
        origin = f"{name}.{node.incarnation}"
        send = self.sender(name)
        fw = NodeForwarding(node.ha, origin, list(sim.names), send=send,
                            soon=self.soon.append, clock=lambda: sim.now)
        decl = NodeDeclarations(node.ha, origin, send=send, soon=self.soon.append,
                                clock=lambda: sim.now)
        fw.notice_listeners.append(decl.notice)
        member = node.ha

        def partition_of(member: Any = member) -> Any:
            return None if member.placement is None else member.placement.partition

        def ask(args: list[Any], done: Callable[[int, list[int]], None],
                decl: NodeDeclarations = decl) -> None:
            decl.ask_internal(0, UPDATE, args, done)

        writer = DirectoryWriter(node.broker, partition_of, ask, lambda: sim.now)
        assert node.directory_layer is not None
        nd = NodeDirectory(node.ha, node.directory_layer, writer)
        decl.directory = nd
        node.ha.group_adding = nd.stand_ins.group_adding
        clients = GroupClients(node.ha, lambda n: f"amqp://{n}")
        clients.forwarding, clients.declarations, clients.directory = fw, decl, nd
        fw.owned_durable = lambda callback: clients.after_durable((), callback)
        for peer in sim.names:  # (the links up: the shell's peer_up)
            if peer != name and self.live(peer):
                fw.peer_up(peer)
                self.fw[peer].peer_up(name)
        self.decl[name], self.fw[name], self.dirs[name] = decl, fw, nd
        self.clients[name] = clients
        self.wired[name] = node

    def live(self, name: str) -> bool:
        """The node's process is up and its objects are of it."""
        node = self.sim.nodes[name]
        return bool(node.up) and self.wired.get(name) is node

    def rewire(self) -> None:
        """Restarted processes get their objects; a process gone is a link lost to the
        others (the shell's ``_on_peer_down``)."""
        for a in self.sim.names:  # links that went down: as the shell's peer_down
            for b in self.sim.names:
                up = a == b or self.sim.connected(a, b)
                if self.links.get((a, b), True) and not up and self.live(a):
                    self.decl[a].link_lost(b)
                    self.fw[a].link_lost(b)
                elif not self.links.get((a, b), True) and up and self.live(a) and a != b:
                    self.fw[a].peer_up(b)
                self.links[(a, b)] = up
        for name in self.sim.names:
            node = self.sim.nodes[name]
            if not node.up and name not in self.down:
                self.down.add(name)
                for peer in self.sim.names:
                    if peer != name and self.live(peer):
                        self.decl[peer].link_lost(name)
                        self.fw[peer].link_lost(name)
            if node.up and self.wired.get(name) is not node:
                self._wire(name)
                self.down.discard(name)
                self.restarts += 1

    def sender(self, src: str) -> Callable[[str, Packet], None]:
        return lambda peer, packet: self.packets.append((src, peer, packet))

    def roles(self) -> None:
        """The shell's ``serving``/``demoted`` calls, from the members' roles now."""
        for name, nd in self.dirs.items():
            if not self.live(name):
                continue
            node = self.sim.node(name)
            for group, member in node.ha.groups.items():
                if not group:
                    continue
                term = member.role_term()
                fw_receiver = self.fw[name].receivers.get(group)
                if term is not None and (fw_receiver is None or fw_receiver.epoch != term):
                    self.fw[name].serving(group, term)
                lane = nd.writer.lanes.get(group)
                if name in self.fenced:
                    continue
                if term is not None and (lane is None or lane.epoch != term):
                    nd.writer.serving(group, term)
                elif term is None and lane is not None:
                    nd.writer.demoted(group)

    def pump(self, rounds: int = 20) -> list[tuple[str, str, Packet]]:
        seen = []
        for _ in range(rounds):
            while self.soon or self.packets:
                soon, self.soon[:] = list(self.soon), []
                for callback in soon:
                    callback()
                packets, self.packets = self.packets, []
                seen += packets
                for src, dst, packet in packets:
                    if not (self.live(src) and self.live(dst)):
                        continue  # a process gone: its links with it
                    if src != dst and not self.sim.connected(src, dst):
                        continue  # a link down (a network partition): lost
                    if self.hold(src, dst, packet):
                        self.held.append((src, dst, packet))
                    elif isinstance(packet, DECLARATION_PACKETS):
                        self.decl[dst].on_packet(src, packet)
                    elif isinstance(packet, FORWARD_PACKETS):
                        self.fw[dst].on_packet(src, packet)
            self.sim.run_until(self.sim.now + 0.05)
            self.rewire()
            self.roles()
            for name in self.dirs:
                if not self.live(name):
                    continue
                self.decl[name].moved()
                self.decl[name].tick()
                self.fw[name].tick()
                self.dirs[name].tick()
        return seen

    def release(self) -> None:
        self.packets += self.held
        self.held = []
        self.hold = lambda src, dst, packet: False

    def outside(self) -> tuple[str, int]:
        """A node and a partition it holds no cell of."""
        for name in self.sim.names:
            missing = [p for p in range(P) if group_of(p) not in self.sim.node(name).ha.groups]
            if missing:
                return name, missing[0]
        raise AssertionError("every node holds a cell of every partition")

    def leader(self, partition: int) -> str:
        node = self.sim.serving_groups[group_of(partition)]
        assert node is not None
        return node.name

    def vhost(self, name: str) -> Any:
        return self.sim.node(name).broker.vhosts["/"]


def name_in(partition: int, prefix: str) -> str:
    from brokerha.cluster.partition_table import hash_partition

    return next(f"{prefix}-{i}" for i in range(1000)
                if hash_partition("/", f"{prefix}-{i}", P) == partition)


def message(exchange: str, key: str, body: bytes) -> Message:
    return Message(exchange, key, build_header(
        len(body), commands.Basic.Properties(delivery_mode=2)), body)


def publish(net: Net, node: str, exchange: str, key: str, body: bytes) -> list[bool]:
    """As ``amqp/methods/basic.py`` does: routed by the node's vhost, handed to
    ``GroupClients.publish``; the confirms."""
    vhost = net.vhost(node)
    msg = message(exchange, key, body)
    queues = vhost.route(vhost.exchanges[exchange], msg)
    answers: list[bool] = []
    net.clients[node].publish(None, "/", queues, msg, answers.append)
    return answers


def started(unsafe: Unsafe | None = None) -> Net:
    sim = DirectorySimulation(0, nodes=4, partitions=P, replicas=2, faults=Faults.none(),
                              publish_rate=0.0, consume_rate=0.0)
    if unsafe is not None:
        sim.directory_unsafe = unsafe
    sim.start()
    sim.run_until(8.0)
    assert all(n is not None for n in sim.serving_groups.values()), sim.serving_groups
    net = Net(sim)
    net.pump()
    return net


@pytest.fixture(scope="module")
def net() -> Net:
    return started()


def stale(net: Net) -> list[tuple[str, Any]]:
    """Entries of every node's directory that differ from what the partitions' leaders
    hold (the directory's invariant once calm)."""
    truth: dict[Any, Any] = {}
    for p in range(P):
        leader = net.sim.node(net.leader(p))
        of = leader.ha.placement
        assert of is not None
        truth.update(dict(entries_of(leader.broker, of.partition, p)))
    return [(name, key) for name, nd in net.dirs.items()
            for key in set(truth) | set(nd.layer.directory.entries)
            if truth.get(key) != nd.layer.directory.entries.get(key)]


def test_every_node_holds_every_partitions_sync(net: Net) -> None:
    for name, nd in net.dirs.items():
        assert nd.layer.directory.synced == set(range(P)), name
        assert net.clients[name].unknown_partitions() == [], name


def test_a_queue_declared_outside_its_partition_routes_there_by_the_directory(
        net: Net) -> None:
    node, missing = net.outside()
    leader = net.leader(missing)
    name = name_in(missing, "dir")
    ch = Channel(net.vhost(node))
    net.decl[node].queue_method(ch, group_of(missing), commands.Queue.Declare(
        queue=name, durable=True), name)
    net.pump()
    assert isinstance(ch.sent[-1], commands.Queue.DeclareOk)
    ch = Channel(net.vhost(node))
    net.decl[node].queue_method(ch, group_of(missing), commands.Queue.Bind(
        queue=name, exchange="amq.direct", routing_key="rk"), name)
    net.pump()
    assert isinstance(ch.sent[-1], commands.Queue.BindOk)
    here = net.vhost(node).queues[name]  # the stand-in, bound as on the leader
    assert net.dirs[node].stand_ins.is_stand_in(here)
    assert here.arguments[HA_ID] == net.vhost(leader).queues[name].arguments[HA_ID]
    assert net.vhost(node).has_binding(net.vhost(node).exchanges["amq.direct"], here, "rk")
    assert net.clients[node].unknown_partitions() == []
    answers = [publish(net, node, "", name, b"by-name"),
               publish(net, node, "amq.direct", "rk", b"by-binding")]
    assert here.message_count == 0  # nothing enqueued on the stand-in
    net.pump()
    assert answers == [[True], [True]]
    queue = net.vhost(leader).queues[name]
    assert [e.message.body for e in list(queue.ready)] == [b"by-name", b"by-binding"]


def test_a_declare_on_the_leader_answers_once_every_node_routes_to_it(net: Net) -> None:
    node, missing = net.outside()
    leader = net.leader(missing)
    name = name_in(missing, "led")
    seen: list[bool] = []  # the stand-in on the node outside, as each answer is sent

    class Answered(Channel):
        def reply_unblocked(self, method: Any) -> None:
            super().reply_unblocked(method)
            seen.append(name in net.vhost(node).queues)

    ch = Answered(net.vhost(leader))  # the leader's own client: through its own host
    assert net.clients[leader]._listed(commands.Queue.Declare(queue=name, durable=True))
    net.decl[leader].queue_method(ch, group_of(missing), commands.Queue.Declare(
        queue=name, durable=True), name)
    while not ch.sent:
        net.pump(1)
    # never the answer before the directory holds it on the node outside (a ready
    # backup of the metadata group: the metadata barrier waits for it)
    assert isinstance(ch.sent[-1], commands.Queue.DeclareOk) and seen == [True]
    # deleted on the leader: gone from the node outside by the delete-ok
    ch = Answered(net.vhost(leader))
    net.decl[leader].queue_method(ch, group_of(missing), commands.Queue.Delete(
        queue=name), name)
    while not ch.sent:
        net.pump(1)
    assert isinstance(ch.sent[-1], commands.Queue.DeleteOk) and seen == [True, False]
    assert net.dirs[leader].writer.stats.failed == 0


def test_a_dead_letter_to_a_stand_in_is_forwarded_to_its_leader(net: Net) -> None:
    """A message rejected from a queue a node leads, its dead-letter exchange routing it
    to a queue of a partition that node holds no cell of (a stand-in there): forwarded by
    ``x-ha-id``, enqueued once on that partition's leader, nothing on the stand-in."""
    node, missing = next(
        (n, p) for p in range(P) for n in net.sim.names
        if group_of(p) not in net.sim.node(n).ha.groups
        and any(net.leader(q) == n for q in range(P)))
    led = next(q for q in range(P) if net.leader(q) == node)
    target = name_in(missing, "dlt")
    ch = Channel(net.vhost(node))
    net.decl[node].queue_method(ch, group_of(missing), commands.Queue.Declare(
        queue=target, durable=True), target)
    net.pump()
    vhost = net.vhost(node)
    assert vhost.queues[target] in vhost.followed  # a stand-in: never enqueued here
    source = vhost.declare_queue(name_in(led, "dls"), owner=None, durable=True, arguments={
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": target})
    source.enqueue(message("", source.name, b"dead"))
    entry = source.get()
    assert entry is not None
    source.reject(entry)
    net.pump()
    theirs = net.vhost(net.leader(missing)).queues[target]
    assert [e.message.body for e in list(theirs.ready)] == [b"dead"]
    assert vhost.queues[target].message_count == 0


def test_a_node_refuses_what_the_directory_does_not_give_it(net: Net) -> None:
    node, missing = net.outside()
    clients = net.clients[node]
    directory = net.dirs[node].layer.directory
    directory.synced.discard(missing)  # as before the partition's first sync reached it
    try:
        assert clients.unknown_partitions() == [missing]
        with pytest.raises(NotImplementedByBroker):
            publish(net, node, "amq.direct", "rk", b"refused")
        clients.directory = None  # no directory at all: as before it
        with pytest.raises(NotImplementedByBroker):
            publish(net, node, "amq.direct", "rk", b"refused")
    finally:
        directory.synced.add(missing)
        clients.directory = net.dirs[node]
    assert clients.unknown_partitions() == []


def test_a_learner_fails_closed_until_it_votes(net: Net) -> None:
    """A node that gains a cell of a partition is its group's learner while it catches up
    (its copy may lack queues and bindings, and its stand-ins went): the partition counts
    as unknown there (``check_route`` refuses what it cannot route completely) until its
    membership makes it a voter."""
    from types import SimpleNamespace

    node = next(n for n in net.sim.names if any(
        group_of(p) in net.sim.node(n).ha.groups for p in range(P)))
    ha = net.sim.node(node).ha
    p = next(q for q in range(P) if group_of(q) in ha.groups)
    stand_ins = net.dirs[node].stand_ins
    stand_ins.group_adding(p)  # as PartitionedMember._add_partition calls it
    assert p in net.clients[node].unknown_partitions()
    with pytest.raises(NotImplementedByBroker):
        publish(net, node, "amq.direct", "rk", b"refused")
    real = ha.memberships[group_of(p)]
    ha.memberships[group_of(p)] = cast(Any, SimpleNamespace(
        membership=SimpleNamespace(voters=(), learners=(node,))))
    try:
        stand_ins.tick()
        assert stand_ins.learning == {p}  # still catching up
    finally:
        ha.memberships[group_of(p)] = real
    stand_ins.tick()  # its membership: a voter
    assert stand_ins.learning == set() and net.clients[node].unknown_partitions() == []


def test_a_group_left_is_unknown_until_its_stand_ins_are_made(net: Net) -> None:
    """A node whose group of a partition left (its cell moved away: its queues went with
    the group) holds no stand-in of that partition until its next tick: unknown
    meanwhile (as if the group had been there at the last reconcile)."""
    node, missing = net.outside()
    stand_ins = net.dirs[node].stand_ins
    stand_ins._groups = stand_ins._groups | {group_of(missing)}
    assert missing in net.clients[node].unknown_partitions()
    stand_ins.tick()
    assert net.clients[node].unknown_partitions() == []


def test_a_stand_in_of_a_vhost_not_here_yet_is_made_once_it_is(net: Net) -> None:
    node, missing = net.outside()
    nd = net.dirs[node]
    key = ("/late", "q")
    nd.layer.directory.entries[key] = entry(missing, "9.9")
    try:
        nd.stand_ins.reconcile({key})
        assert key in nd.stand_ins.unbound and key not in nd.stand_ins.held
        net.sim.node(node).broker.add_vhost("/late")
        nd.stand_ins.tick()
        assert key in nd.stand_ins.held and key not in nd.stand_ins.unbound
        assert net.sim.node(node).broker.vhosts["/late"].queues["q"].arguments[HA_ID] == "9.9"
    finally:
        del nd.layer.directory.entries[key]
        nd.stand_ins.reconcile({key})
    assert "q" not in net.sim.node(node).broker.vhosts["/late"].queues


def test_a_server_named_queue_and_the_management_apis_declare_on_the_leader(
        net: Net) -> None:
    """On a partition's leader, a server-named declare (the ``amq.gen-`` name the node drew)
    and the management API's declare go through its own host too: answered once the
    node outside the partition routes to the queue."""
    import asyncio

    node, missing = net.outside()
    leader = net.leader(missing)
    gen = next(f"amq.gen-{i:022d}" for i in range(1000)
               if hash_partition_of(f"amq.gen-{i:022d}") == missing)
    ch = Channel(net.vhost(leader))
    method = commands.Queue.Declare(queue="", durable=True)
    assert net.clients[leader]._listed(method)
    net.decl[leader].queue_method(ch, group_of(missing), method, gen)
    while not ch.sent:
        net.pump(1)
    assert ch.sent[-1].queue == gen and gen in net.vhost(node).queues
    api = name_in(missing, "api")

    async def declare() -> Any:
        future = net.clients[leader].queue_request("/", api, {}, "queue.declare",
                                                   ["/", api, False, True, False, {}])
        assert future is not None  # through the leader's own host
        net.pump()
        return await future

    assert asyncio.run(declare()) == [api, 0, 0]
    assert api in net.vhost(node).queues
    # a purge changes no entry: answered here, as before
    assert net.clients[leader].queue_request("/", api, {}, "queue.purge", ["/", api]) is None


def hash_partition_of(name: str) -> int:
    from brokerha.cluster.partition_table import hash_partition

    return hash_partition("/", name, P)


def test_a_periodic_check_resyncs_what_no_method_reported(net: Net) -> None:
    node, missing = net.outside()
    leader = net.leader(missing)
    name = name_in(missing, "quiet")
    net.vhost(leader).declare_queue(name, owner=None, durable=True)  # not through the host
    net.pump(int(12 / 0.05))  # past the writer's RESYNC (10 s)
    assert name in net.vhost(node).queues
    assert net.dirs[leader].writer.stats.resyncs >= 1


def declared_then_routed(net: Net, prefix: str) -> bool:
    """A queue of a partition declared from a node outside it, then, right at its
    declare-ok, a publish there to the default exchange naming it: routed (to the
    stand-in)?"""
    node, missing = net.outside()
    name = name_in(missing, prefix)
    vhost = net.vhost(node)
    routed: list[bool] = []

    class Answered(Channel):
        def reply_unblocked(self, method: Any) -> None:  # the declare-ok, as it is sent
            super().reply_unblocked(method)
            routed.append(bool(vhost.route(vhost.exchanges[""], message("", name, b"x"))))

    ch = Answered(vhost)
    net.decl[node].queue_method(ch, group_of(missing), commands.Queue.Declare(
        queue=name, durable=True), name)
    while not ch.sent:
        net.pump(1)
    assert isinstance(ch.sent[-1], commands.Queue.DeclareOk)
    return routed == [True]


def test_read_your_writes_and_answer_before_directory_is_caught() -> None:
    assert declared_then_routed(started(), "ryw")
    assert not declared_then_routed(started(Unsafe(answer_before_directory=True)), "ryw")


def fence_scenario(net: Net) -> list[tuple[str, Any]]:
    """Partition p's leader L declares q, its directory change held on the way to the
    coordinator; p handed over to L2, which deletes q (its sync, then its deletion, in the
    directory); then L's late change arrives. The directory must not hold q."""
    node, p = net.outside()
    leader = net.leader(p)
    coordinator = net.leader(-1)
    name = name_in(p, "late")
    net.hold = lambda src, dst, packet: src == leader and dst == coordinator and \
        getattr(packet, "op", "") == UPDATE
    ch = Channel(net.vhost(leader))
    net.decl[leader].queue_method(ch, group_of(p), commands.Queue.Declare(
        queue=name, durable=True), name)
    net.pump(10)
    assert net.held and not ch.sent  # applied in p, not in the directory yet
    group = group_of(p)
    target = next(n for n in net.sim.table.voting(p) if n != leader)
    net.sim.promote_group(net.sim.node(leader), group, target)
    for _ in range(100):
        net.pump(1)
        if net.leader(p) == target and group in net.dirs[target].writer.lanes \
                and net.dirs[target].writer.lanes[group].in_flight is None:
            break
    assert net.leader(p) == target
    net.hold = lambda src, dst, packet: src == leader and dst == coordinator and \
        getattr(packet, "op", "") == UPDATE  # L's only
    ch2 = Channel(net.vhost(target))
    net.decl[target].queue_method(ch2, group, commands.Queue.Delete(queue=name), name)
    while not ch2.sent:
        net.pump(1)
    assert name not in net.vhost(node).queues
    net.release()  # L's late change
    net.pump()
    return stale(net)


def test_a_deposed_leaders_late_change_is_fenced_and_no_fence_is_caught() -> None:
    assert fence_scenario(started()) == []
    assert fence_scenario(started(Unsafe(no_fence=True))) != []


# -- a seeded run: random declarations from any node, handovers, slow links ------------------


POOL = [name_in(p, f"pool{i}") for p in range(P) for i in range(3)]


class Step(Channel):
    """One client method, checked as its answer is sent: the asking node routes as the
    method left the queue (read-your-writes)."""

    def __init__(self, net: Net, node: str, name: str, op: str, key: str,
                 violations: list[str]) -> None:
        super().__init__(net.vhost(node))
        self.net, self.node, self.name, self.op, self.key = net, node, name, op, key
        self.violations = violations

    def reply_unblocked(self, method: Any) -> None:
        super().reply_unblocked(method)
        vhost = self.net.vhost(self.node)
        by_name = [q.name for q in vhost.route(vhost.exchanges[""], message("", self.name, b""))]
        by_key = [q.name for q in vhost.route(vhost.exchanges["amq.direct"],
                                              message("amq.direct", self.key, b""))]
        ok = {"declare": self.name in by_name, "delete": self.name not in by_name,
              "bind": self.name in by_key, "unbind": self.name not in by_key}[self.op]
        if not ok:
            self.violations.append(f"{self.node} {self.op} {self.name} {self.key}: answered, "
                                   f"not so on {self.node} (by name {by_name}, by key "
                                   f"{by_key})")


def lanes_agree(net: Net) -> list[str]:
    """(c) For each partition, the lane of its newest leader with nothing under way holds
    what the coordinator's directory holds of it (what it last sent, as answered)."""
    serving = net.sim.serving_groups[0]
    if serving is None or not net.live(serving.name):
        return []  # no coordinator now
    coordinator = net.dirs[serving.name].layer.directory
    out = []
    for p in range(P):
        lanes = [(lane.epoch, name, lane) for name, nd in net.dirs.items() if net.live(name)
                 for g, lane in nd.writer.lanes.items() if g == group_of(p)]
        if not lanes:
            continue
        epoch, name, lane = max(lanes, key=lambda t: t[0])
        if lane.in_flight is None and epoch == coordinator.epochs.get(p) \
                and coordinator.of(p) != lane.sent:
            out.append(f"partition {p}: the directory differs from what {name}'s lane "
                       f"(epoch {epoch}) sent")
    return out


def seeded_run(seed: int, steps: int = 60, unsafe: Unsafe | None = None,
               crashes: bool = False,
               partitions: bool = False) -> tuple[list[str], dict[str, int]]:
    """Random declares, binds, unbinds and deletes of a pool of queue names (one method
    under way per name) from random nodes, handovers of random partitions, the directory
    requests of a random partition leader held back a while: (a) each answer ok holds on
    the asking node as it is sent; (b) once calm, every node's directory is what the
    partitions' leaders hold and every node outside a partition routes to its queues by
    name and by binding as the leader does; (c) after each step, ``lanes_agree``.
    ``crashes``: besides, a random node crashes now and then (one at a time, down 0.5-2
    s of the simulation's time; its store's synced image is what it restarts from).
    ``partitions``: besides, the network is cut in two now and then for 0.5-2 s (the
    simulation's ``partition``: its links fail, the packets across are lost)."""
    import random

    rng = random.Random(seed)
    net = started(unsafe)
    violations: list[str] = []
    busy: dict[str, Step] = {}
    counts = {"ok": 0, "refused": 0, "handovers": 0, "holds": 0}
    names = list(net.sim.names)
    held_until = slow_p = 0
    for i in range(steps):
        if crashes and rng.random() < 0.04 and all(net.live(n) for n in names) \
                and all(g is not None for g in net.sim.serving_groups.values()):
            victim = rng.choice(names)
            net.sim.crash_node(net.sim.node(victim), rng.uniform(0.5, 2.0))
            counts["crashes"] = counts.get("crashes", 0) + 1
            for name, step in list(busy.items()):  # its clients' connections went with it
                if step.node == victim:
                    del busy[name]
        if partitions and rng.random() < 0.04 and all(net.live(n) for n in names) \
                and all(g is not None for g in net.sim.serving_groups.values()):
            net.sim.partition(rng.uniform(0.5, 2.0))
            counts["cuts"] = counts.get("cuts", 0) + 1
        for name, step in list(busy.items()):
            if step.sent or step.conn.failed:
                counts["ok" if step.sent else "refused"] += 1
                if step.conn.failed:
                    code = f"refused {step.conn.failed[0][0]}"
                    counts[code] = counts.get(code, 0) + 1
                del busy[name]
        roll = rng.random()
        if (crashes or partitions) and not (all(net.live(n) for n in names) and all(
                g is not None for g in net.sim.serving_groups.values())):
            roll = 1.0  # a method only, from a node that is up (below)
        if roll < 0.06:
            # half the time the partition whose leader's requests are held (its late
            # request then comes from a deposed leader)
            p = slow_p if net.held and rng.random() < 0.5 else rng.randrange(P)
            if net.held and p == slow_p:  # the held requests arrive once its successor acted
                held_until = max(held_until, i + 20)
            leader = net.leader(p)
            target = rng.choice([n for n in net.sim.table.voting(p) if n != leader])
            net.sim.promote_group(net.sim.node(leader), group_of(p), target)
            counts["handovers"] += 1
        elif roll < 0.12 and not net.held and held_until <= i:
            slow_p = rng.randrange(P)
            slow, coordinator = net.leader(slow_p), net.leader(-1)
            def hold(src: str, dst: str, packet: Packet, slow: str = slow,
                     to: str = coordinator) -> bool:
                return src == slow and dst == to and getattr(packet, "op", "") == UPDATE

            net.hold = hold
            held_until = i + rng.randint(2, 8)
            counts["holds"] += 1
        else:
            free = [n for n in POOL if n not in busy]
            up = [n for n in names if net.live(n)]
            if not free:  # every name's method under way (waiting out a failover)
                net.pump(1)
                continue
            slow_names = [n for n in free if POOL.index(n) // 3 == slow_p]
            # while a leader's requests are held, mostly its partition's names
            name = rng.choice(slow_names if net.held and slow_names and rng.random() < 0.6
                              else free)
            node = rng.choice(up) if crashes or partitions else rng.choice(names)
            op = rng.choice(["declare", "declare", "bind", "unbind", "delete"])
            key = f"k{rng.randrange(3)}"
            step = Step(net, node, name, op, key, violations)
            method: Any = {
                "declare": commands.Queue.Declare(queue=name, durable=True),
                "delete": commands.Queue.Delete(queue=name),
                "bind": commands.Queue.Bind(queue=name, exchange="amq.direct", routing_key=key),
                "unbind": commands.Queue.Unbind(queue=name, exchange="amq.direct",
                                                routing_key=key)}[op]
            placement = net.sim.node(node).ha.placement
            assert placement is not None
            net.decl[node].queue_method(step, group_of(placement.of_name("/", name, None)),
                                        method, name)
            busy[name] = step
        if held_until <= i and net.held:
            net.release()
        net.pump(rng.randint(1, 3))
        violations += lanes_agree(net)
    net.release()
    net.pump(int(3 / 0.05))
    for _ in range(200):  # every node back, every group led
        if all(net.live(n) for n in names) and all(
                g is not None for g in net.sim.serving_groups.values()):
            break
        net.pump(2)
    net.pump(int(2 / 0.05))
    counts["restarts"] = net.restarts
    counts["ok"] += sum(1 for s in busy.values() if s.sent)
    violations += [f"stale {key} on {node}" for node, key in stale(net)]
    for p in range(P):
        leader = net.vhost(net.leader(p))
        for name in POOL:
            q = leader.queues.get(name)
            scope = net.sim.node(net.leader(p)).ha.placement
            if q is None or scope is None or scope.partition(q) != p:
                continue
            keys = sorted(b.routing_key for b in leader.exchanges["amq.direct"].bindings.values()
                          if b.destination is q)
            for node in names:
                vhost = net.vhost(node)
                here = vhost.queues.get(name)
                if here is None or here.arguments.get(HA_ID) != q.arguments.get(HA_ID):
                    violations.append(f"{name} (partition {p}) not routable on {node}")
                    continue
                routed = sorted(k for k in ("k0", "k1", "k2") if here in vhost.route(
                    vhost.exchanges["amq.direct"], message("amq.direct", k, b"")))
                if routed != keys:
                    violations.append(f"{name} bound by {routed} on {node}, {keys} on its "
                                      "leader")
    return violations, counts


@pytest.mark.parametrize("seed", range(4))
def test_seeded_declarations_handovers_and_slow_links_keep_every_node_routing(
        seed: int) -> None:
    violations, counts = seeded_run(seed)
    assert violations == [], (violations[:5], counts)
    assert counts["ok"] > 20 and counts["handovers"] + counts["holds"] > 0, counts


@pytest.mark.parametrize("seed", range(2))
def test_seeded_with_crashes_every_node_routing_again_after_its_restart(seed: int) -> None:
    violations, counts = seeded_run(seed, steps=100, crashes=True)
    assert violations == [], (violations[:5], counts)
    assert counts.get("crashes", 0) >= 1 and counts["restarts"] == counts["crashes"], counts


@pytest.mark.parametrize("seed", range(2))
def test_seeded_with_network_cuts_and_crashes(seed: int) -> None:
    violations, counts = seeded_run(seed, steps=100, crashes=True, partitions=True)
    assert violations == [], (violations[:5], counts)
    assert counts.get("cuts", 0) + counts.get("crashes", 0) >= 1, counts


def test_the_seeded_run_catches_answer_before_directory_and_no_fence() -> None:
    violations, _ = seeded_run(0, unsafe=Unsafe(answer_before_directory=True))
    assert any("answered, not so" in v for v in violations), violations[:3]
    violations, _ = seeded_run(10, steps=100, unsafe=Unsafe(no_fence=True))
    assert any("differs from what" in v for v in violations), violations[:3]
