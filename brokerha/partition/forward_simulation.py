"""Publishes forwarded to partition primaries, simulated (issue 35, stage 3's protocol core):
``--workload forward``.

The world of the groups simulation (``partition/group_simulation.py``): every
node runs the product's ``PartitionedMember`` over its one ``Broker`` (the
metadata group and a real ``HAMember`` per partition cell, each with its
election, scoped ``Primary``/``Backup``, verification and gate), on
simulated disks and links, with crashes, pauses, network partitions, link
failures, delayed packets and handovers of single groups. On top of it each
node runs forwarding (``partition/forward.py``):

- a ``ForwardSender`` per process start (origin ``<node>.<incarnation>``),
  flushed once per loop turn, ticked with the node, told of leaders by
  ``LeaderNotice``;
- a ``ForwardReceiver`` per group the node serves, made when the group's
  member starts serving (its marks read back from the broker's outcomes,
  ``forward_apply.recover_marks``) and dropped when it stops, applying
  forwards through ``BrokerForwardLog`` (a local transaction per batch,
  whose ``tc`` carries the enqueues and the mark) and answering through
  ``Broker.after_durable_in`` with the group's gate and barriers.

A group's new primary sends ``LeaderNotice`` to every node (itself
included) and again every second (the node shell will send it on each link
up). What the shell of stage 3 will do besides -- declarations through the
metadata coordinator, routing by the directory -- is played by the world: each
partition's queues are declared by its first primary (an ``x-partition``
pin), and enter the *directory* (queue name -> ``x-ha-id``) once that
declaration is durable; routing is the client's choice of queues.

Clients (``clients``, default 6) connect to random nodes that follow the
metadata group (one that dies or stops serving: they dial another), each one
channel publishing persistent messages with confirms, every ``1/rate``
seconds on average: to the queue of one partition, or (one in four) to queues
of two partitions at once; one publish in ten goes to a partition's bounded
queue (``x-max-length``, ``reject-publish``), which refuses once full (a
nack). A connection whose sender's window to a target is full is held (the
publish waits). A consumer on each group's serving primary takes the head
of its plain queue (basic.get and ack, ``consume`` a second; consumers on
other nodes are ``remote_consume_simulation.py``'s), so marks outlive their messages: a message may be
consumed before its publisher's ack, or before a failover after which its
publisher sends it again. Faults for ``duration`` virtual seconds, then none
for ``settle`` seconds (the outages run their course, every node comes back,
no new publish, no consumer) before the final checks.

Checked:

- (a) at the end, after healing: every acknowledged message not taken by a
  consumer is in each of its target queues on the group's serving primary
  and on a majority of the group's cells;
- (b) no message twice in a queue (a message is one (origin, fseq) per
  group): at the end, on every node, none twice in a queue; and over the
  run, no message at two positions of a queue, the positions known from
  the consumers' dequeues once durable (``after_durable_in``: the enqueue
  before them committed too) and from the primaries' queues at the end;
- (c) when a publisher gets an ack, every target group's majority of cells
  holds the message durably (in its disk image: the store synced it; not
  checked for a message a consumer took already, whose records may be gone);
- (d) per channel (a connection's) and queue, the order of publishing is
  kept: the positions of (b) in order;
- (e) liveness: once the faults stop, every publish on a connection still
  open is answered (``liveness``: not with the senders' retry off);

and the groups simulation's own (a)-(h) per group (elections, leases,
scopes) all along.

``Unsafe`` (``partition.forward.Unsafe``): ``confirm_on_send`` (caught by
(c)), ``no_dedupe`` (caught by (b)) and ``answer_before_gate`` (caught by
(c)), each at a pinned seed in ``tests/partition/test_forward_simulation.py``;
``ha_unsafe`` (``world.Unsafe``) breaks the HA rules of every group's member
under the forwards.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from brokerha.broker.queue import Queue
from brokerha.cluster.messages import Message as Packet
from brokerha.cluster.replication import HA_ID
from brokerha.ha.member import HAMember
from brokerha.ha.simulation.disk import Image
from brokerha.ha.simulation.world import (
    Faults,
    SimConnection,
    SimNode,
    Violation,
    message,
)
from brokerha.ha.simulation.world import Unsafe as HAUnsafe
from brokerha.partition.forward import (
    RETRY,
    Confirm,
    Effect,
    Forward,
    Forwarded,
    ForwardError,
    ForwardMessage,
    ForwardReceiver,
    ForwardSender,
    LeaderNotice,
    ToNode,
    Unsafe,
    WhenDurable,
)
from brokerha.partition.forward_apply import BrokerForwardLog, recover_marks
from brokerha.partition.group_simulation import (
    FAULTS,
    GroupNode,
    GroupSimulation,
    SimResult,
    run_quietly,
    run_seeds,
)
from brokerha.partition.member import PIN, group_of

__all__ = ["CATCHES", "ForwardSimulation", "SimResult", "Unsafe", "run_many", "run_seed"]

CATCHES = tuple(Unsafe.names())
VHOST = "/"
BOUNDED = 20  # the bounded queues' x-max-length
NOTICE_EVERY = 1.0  # a group primary's LeaderNotice to every node, again


def queue_name(partition: int, bounded: bool = False) -> str:
    return f"{'bounded' if bounded else 'q'}{partition}"


class ForwardNode(GroupNode):
    """A partitioned node that forwards its clients' publishes and takes forwards for the
    groups it serves."""

    def __init__(self, world: GroupSimulation, name: str, incarnation: int,
                 disk: Image | None) -> None:
        super().__init__(world, name, incarnation, disk)
        self.fw = cast(ForwardSimulation, world)
        self.sender = ForwardSender(f"{name}.{incarnation}", window=self.fw.window,
                                    retry=self.fw.retry, unsafe=self.fw.fw_unsafe)
        self.fw.senders.append(self.sender)
        self.receivers: dict[int, ForwardReceiver] = {}
        self._flush_scheduled = False
        self._noticed = 0.0

    # -- the groups' role -------------------------------------------------------------------

    def serving(self, group: int, epoch: int, decisions: dict[str, str]) -> None:
        super().serving(group, epoch, decisions)
        if group == 0:
            return
        placement = self.ha.placement
        assert placement is not None
        log = BrokerForwardLog(self.broker, group, placement.of(group - 1),
                               placed=self.fw.placed)
        receiver = ForwardReceiver(group, epoch, log, marks=recover_marks(self.broker, group),
                                   meta_seq=self.meta_seq(), unsafe=self.fw.fw_unsafe)
        self.receivers[group] = receiver
        self.fw.receivers.append(receiver)
        self.fw.declare_queues(self, group)
        self.notify(group)

    def demoted(self, group: int, reason: str) -> None:
        super().demoted(group, reason)
        self.receivers.pop(group, None)

    def notify(self, group: int) -> None:
        receiver = self.receivers.get(group)
        if receiver is None:
            return
        notice = LeaderNotice(group, receiver.epoch, self.name)
        for peer in self.sim.names:
            if peer == self.name:
                self.sim.soon.append((self, partial(self.on_forward, self.name, notice)))
            else:
                self.send(peer, notice)

    def meta_seq(self) -> int:
        """How far this node's metadata copy is (its primary's seq, or what it applied)."""
        metadata = self.ha.metadata
        if metadata.primary is not None:
            return metadata.primary.seq
        backup = metadata.backup
        return backup.applied_seq if backup is not None and backup.caught_up else 0

    # -- forwarding -----------------------------------------------------------------------

    def on_forward(self, src: str, packet: Packet) -> None:
        """A forwarding packet from ``src`` (this node: from its own sender or receiver)."""
        now = self.sim.now
        out: list[Effect] = []
        if isinstance(packet, Forward):
            self.charge(self.sim.costs.client_op * len(packet.messages) / 4)
            receiver = self.receivers.get(packet.group)
            member = self.member(packet.group)
            if receiver is None or member is None or member.role_term() != receiver.epoch:
                self.fw.counts["not primary"] += 1
                out = [ToNode(src, ForwardError(packet.group, packet.origin, "not-primary",
                                                f"{self.name} does not lead group "
                                                f"{packet.group}"))]
            else:
                out = receiver.receive(src, packet)
        elif isinstance(packet, Forwarded | ForwardError):
            out = self.sender.receive(now, packet, src)
        elif isinstance(packet, LeaderNotice):
            out = self.sender.leader(now, packet)
        self.carry_out(out)

    def carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, ToNode):
                if effect.node == self.name:
                    self.sim.soon.append((self, partial(self.on_forward, self.name,
                                                        effect.packet)))
                else:
                    self.send(effect.node, effect.packet)
            elif isinstance(effect, WhenDurable):
                self._when_durable(effect)
            elif isinstance(effect, Confirm):
                self.fw.confirmed(self, effect)
        self.want_flush()

    def _when_durable(self, effect: WhenDurable) -> None:
        member = self.member(effect.group)
        if member is None:
            return
        self.broker.after_durable_in(member.durability_gate,
                                     lambda: self.carry_out([effect.send]), member.barriers())

    def want_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.sim.soon.append((self, self._flush))

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.sender.meta_seq = self.meta_seq()
        out = self.sender.flush(self.sim.now)
        if out:
            self.carry_out(out)

    def forward_tick(self) -> None:
        now = self.sim.now
        seq = self.meta_seq()
        self.sender.meta_seq = seq
        out = self.sender.tick(now)
        for receiver in list(self.receivers.values()):
            out += receiver.metadata_reached(seq)
        if now - self._noticed >= NOTICE_EVERY:
            self._noticed = now
            for group in list(self.receivers):
                self.notify(group)
        self.carry_out(out)

    def publish(self, client: Client, pid: int, targets: dict[int, ForwardMessage]) -> None:
        self.charge(self.sim.costs.client_op)
        out = self.sender.publish(pid, targets)
        for group in targets:
            self.fw.fseqs[(self.sender.origin, group, self.sender.lane(group).next_fseq - 1)] = pid
        self.carry_out(out)


@dataclass
class Client:
    """One connection with one channel publishing with confirms."""

    name: str
    conn: SimConnection | None = None
    dialled_at: float = -1.0
    dialled: int = 0  # connections made
    seq: int = 0


@dataclass
class Publish:
    client: Client
    conn: SimConnection
    body: bytes
    queues: dict[int, str]  # group -> queue name
    answered: bool = False


@dataclass
class Placement:
    """Where receivers put a message: (queue name, body) -> positions (any primary's)."""

    positions: dict[tuple[str, bytes], set[int]] = field(default_factory=dict)


class ForwardResult(SimResult):
    def summary(self) -> str:
        head = f"seed {self.seed} ({self.nodes} nodes, P = {self.partitions}): "
        if self.violation:
            return head + f"VIOLATION {self.violation}"
        s = self.stats
        return head + f"ok, {s['acks']} acked / {s['published']} published, " + self.counts()

    def counts(self) -> str:
        """What the summary says of a seed without a violation, after the acks."""
        s = self.stats
        return f"{s['failovers']} group failovers, {s['resent']} resent, {s['deduped']} deduped"


class ForwardSimulation(GroupSimulation):
    node_class = ForwardNode

    def __init__(self, seed: int, *, clients: int = 6, rate: float = 8.0,
                 consume: float = 6.0, settle: float = 15.0, window: int = 64,
                 retry: float = RETRY, liveness: bool = True,
                 unsafe: Unsafe | None = None, ha_unsafe: HAUnsafe | None = None,
                 **kw: Any) -> None:
        """``consume``: gets a second on each group's plain queue (0: none). ``retry``: the
        senders' (``ForwardSender.retry``); a long one leaves the resends to new leaders
        alone (and a lost answer unanswered: ``liveness`` False leaves (e) out). ``unsafe``: forwarding's rules broken; ``ha_unsafe``: the HA
        rules of every group's member (``world.Unsafe``), under the forwards."""
        if ha_unsafe is not None:
            kw["unsafe"] = ha_unsafe
        kw.setdefault("publish_rate", 0.0)
        kw.setdefault("consume_rate", 0.0)
        self.fw_unsafe = unsafe or Unsafe()
        self.window = window
        self.retry = retry
        self.liveness = liveness
        self.senders: list[ForwardSender] = []
        self.receivers: list[ForwardReceiver] = []
        super().__init__(seed, **kw)
        self.fw_clients = [Client(f"c{i}") for i in range(clients)]
        self.rate = rate
        self.settle = settle
        self.declared: dict[str, str] = {}  # queue name -> x-ha-id, once durably declared
        self.placement = Placement()
        self.fseqs: dict[tuple[str, int, int], int] = {}  # (origin, group, fseq) -> publish
        self.publishes: dict[int, Publish] = {}
        self.acked: dict[bytes, dict[int, str]] = {}  # body -> group -> queue
        self.consume = consume
        # queue -> position -> body: what was held there, consumed with its dequeue durable
        # or held at the end (a committed position holds one message in every lineage)
        self.seen_at: dict[str, dict[int, bytes]] = {}
        # (queue, body) a consumer took and acknowledged: gone from its queue, perhaps for
        # good (its dequeue may be durable though the gate refused to say so: the role ended)
        self.taken: set[tuple[str, bytes]] = set()
        self.publishing = True
        self.result = ForwardResult(seed, self.result.nodes, self.partitions, None, [], "")

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> SimResult:
        result = self.result
        try:
            self.start()
            for client in self.fw_clients:
                self.after(self.rng.expovariate(self.rate), partial(self._fw_publish, client))
            if self.consume > 0:
                for group in self.groups[1:]:
                    self.after(self.rng.expovariate(self.consume),
                               partial(self._fw_consume, group))
            self.run_until(self.duration)
            self.calm = True
            self.publishing = False
            self.run_until(self.duration + self.settle)
            self.final_checks()
        except Violation as exc:
            result.violation = str(exc)
            self.note(f"VIOLATION {exc}")
        self.counts["events"] = self.stats.events
        for sender in self.senders:
            for key, value in vars(sender.stats).items():
                self.counts[key] += value
        for receiver in self.receivers:
            for key, value in vars(receiver.stats).items():
                self.counts[key] += value
        result.stats = self.counts
        result.trace = list(self.trace)
        self._hash.update(repr(sorted(self.counts.items())).encode())
        result.trace_hash = self.trace_hash()
        return result

    def _tick(self, node: SimNode) -> None:
        super()._tick(node)
        fnode = cast(ForwardNode, node)
        if fnode.alive and not fnode.paused:
            fnode.run(fnode.forward_tick)

    def _receive(self, node: SimNode, src: str, gen: int, msg_id: int, packet: Packet) -> None:
        if isinstance(packet, Forward | Forwarded | ForwardError | LeaderNotice):
            if self.links[frozenset((src, node.name))].gen == gen:
                cast(ForwardNode, node).on_forward(src, packet)
            return
        super()._receive(node, src, gen, msg_id, packet)

    # -- queues: declared by each group's first primary, in the directory once durable --------

    def declare_queues(self, node: ForwardNode, group: int) -> None:
        partition = group - 1
        vhost = node.broker.vhosts[VHOST]
        member = node.member(group)
        assert member is not None
        for bounded in (False, True):
            name = queue_name(partition, bounded)
            q = vhost.queues.get(name)
            if q is None:
                args: dict[str, Any] = {PIN: partition}
                if bounded:
                    args |= {"x-max-length": BOUNDED, "x-overflow": "reject-publish"}
                q = vhost.declare_queue(name, owner=None, durable=True, arguments=args)
            ha_id = q.arguments.get(HA_ID)
            if ha_id is None:
                continue
            node.broker.after_durable_in(member.durability_gate,
                                         partial(self._declared, name, str(ha_id)),
                                         member.barriers())

    def _declared(self, name: str, ha_id: str) -> None:
        known = self.declared.get(name)
        if known is None:
            self.note(f"directory: {name} is {ha_id}")
            self.declared[name] = ha_id
        elif known != ha_id:
            self.violate(f"queue {name} declared durably twice: {known} and {ha_id}")

    def placed(self, origin: str, fseq: int, queue: Queue, position: int) -> None:
        pid = self.fseqs.get((origin, group_of(self.partition_of(queue.name)), fseq))
        if pid is None:
            return
        body = self.publishes[pid].body
        self.placement.positions.setdefault((queue.name, body), set()).add(position)

    @staticmethod
    def partition_of(name: str) -> int:
        return int(name.lstrip("abcdefghijklmnopqrstuvwxyz"))

    # -- clients ------------------------------------------------------------------------------

    def admits(self, node: ForwardNode) -> bool:
        """A node serves clients while it follows the metadata group or leads it."""
        if not node.alive or node.paused:
            return False
        metadata = node.ha.metadata
        return metadata.term() is not None or metadata.core.following is not None

    def _fw_publish(self, client: Client) -> None:
        if not self.publishing:
            return
        self.after(self.rng.expovariate(self.rate), partial(self._fw_publish, client))
        conn = client.conn
        if conn is None or not conn.usable or not self.admits(cast(ForwardNode, conn.node)):
            if conn is not None and conn.open:
                conn.open = False  # the node stopped serving clients: 320
            client.conn = None
            if self.now - client.dialled_at > 0.05:
                client.dialled_at = self.now
                self._dial(client)
            return
        node = cast(ForwardNode, conn.node)
        node.run(partial(self._fw_publish_on, client, conn, node))

    def _dial(self, client: Client) -> None:
        name = self.rng.choice(self.names)
        delay = self.faults.delay

        def accept() -> None:
            node = cast(ForwardNode, self.nodes[name])
            if self.admits(node) and (client.conn is None or not client.conn.usable):
                conn = SimConnection(self, cast(SimNode, node))
                conn.open = True
                client.conn = conn
                client.dialled += 1
                self.counts["connections"] += 1

        self.after(delay[0] + (delay[1] - delay[0]) * self.rng.random(),
                   lambda: self.nodes[name].run(accept))

    def _fw_publish_on(self, client: Client, conn: SimConnection, node: ForwardNode) -> None:
        if not conn.usable or not self.publishing:
            return
        rng = self.rng
        parts = rng.sample(range(self.partitions), 2 if rng.random() < 0.25 else 1)
        bounded = rng.random() < 0.1
        names = {group_of(p): queue_name(p, bounded and i == 0) for i, p in enumerate(parts)}
        if any(n not in self.declared for n in names.values()):
            self.counts["publish before its queues were declared"] += 1
            return
        if node.sender.holds(names):
            self.counts["held by a full window"] += 1
            return
        client.seq += 1
        # a channel is one connection's: order is kept per connection (a client that dials
        # again may see its earlier publishes, still forwarded by the old node, land later)
        body = f"{client.name}/{client.dialled}.{client.seq}".encode()
        m = message(body, persistent=True)
        targets = {g: ForwardMessage(VHOST, (self.declared[n],), "", n, m.header, body)
                   for g, n in names.items()}
        pid = len(self.publishes) + 1
        self.publishes[pid] = Publish(client, conn, body, names)
        self.counts["published"] += 1
        self.counts[f"to {len(names)} partitions"] += 1
        node.publish(client, pid, targets)

    def _fw_consume(self, group: int) -> None:
        """A consumer on the group's serving primary: basic.get and ack of the plain queue's
        head (its deliveries are local: consumers on other nodes are
        ``remote_consume_simulation.py``'s, which sets ``consume`` to 0)."""
        if not self.publishing:
            return
        self.after(self.rng.expovariate(self.consume), partial(self._fw_consume, group))
        node = cast(ForwardNode | None, self.serving_groups[group])
        if node is not None and node.serves(group):
            node.run(partial(self._fw_consume_on, node, group))

    def _fw_consume_on(self, node: ForwardNode, group: int) -> None:
        member = node.member(group)
        if member is None or not node.serves(group):
            return
        name = queue_name(group - 1)
        q = node.broker.vhosts[VHOST].queues.get(name)
        entry = q.get() if q is not None else None
        if q is None or entry is None:
            return
        node.charge(self.costs.client_op)
        q.settle(entry)
        position, body = entry.position, entry.message.body
        self.counts["consumed"] += 1
        self.taken.add((name, body))

        def durable() -> None:  # the dequeue, so the enqueue before it, on the majority
            self.counts["consumed durably"] += 1
            self.observe(name, position, body)

        node.broker.after_durable_in(member.durability_gate, durable, member.barriers())

    def observe(self, name: str, position: int, body: bytes) -> None:
        """(b): a committed position holds one message; a message, one position."""
        at = self.seen_at.setdefault(name, {})
        known = at.setdefault(position, body)
        if known != body:
            self.violate(f"(b) {name} position {position} holds {known!r} and {body!r}")

    def confirmed(self, node: ForwardNode, confirm: Confirm) -> None:
        publish = self.publishes[confirm.publish]
        if publish.answered:
            self.violate(f"publish {publish.body!r} answered twice")
        publish.answered = True
        if not publish.conn.usable or publish.conn.node is not cast(SimNode, node):
            self.counts["answer lost with its connection"] += 1
            return
        if not confirm.ack:
            self.counts["nacked"] += 1
            return
        self.counts["acked"] += 1
        if any((n, publish.body) in self.taken for n in publish.queues.values()):
            self.counts["acked once consumed"] += 1  # its disk records may be gone: no (c)
        else:
            self.check_durable(publish)
        self.acked[publish.body] = publish.queues

    # -- checks -------------------------------------------------------------------------------

    def disk_of(self, name: str) -> Image | None:
        node = self.nodes.get(name)
        if node is not None and node.alive:
            return node.store.disk
        return self.disks.get(name)

    def check_durable(self, publish: Publish) -> None:
        """(c): every target group's majority of cells holds it on disk."""
        for group, name in publish.queues.items():
            cells = self.cells[group]
            positions = self.placement.positions.get((name, publish.body), set())
            holding = []
            for cell in cells:
                disk = self.disk_of(cell)
                if disk is None:
                    continue
                for position in positions:
                    stored = disk.messages.get((VHOST, name, position))
                    if stored is not None and stored.body == publish.body:
                        holding.append(cell)
                        break
            if 2 * len(holding) <= len(cells):
                self.violate(f"(c) {publish.body!r} acknowledged while only {holding} of group "
                             f"{group}'s cells {cells} hold it in {name} on disk")

    def final_checks(self) -> None:
        down = [n for n in self.names if not self.nodes[n].alive]
        if down:
            self.violate(f"(e) nodes {down} still down {self.settle}s after the faults stopped")
        for group in self.groups[1:]:
            if self.serving_groups[group] is None:
                self.violate(f"(e) no primary of group {group} after {self.settle}s of calm")
        stuck = [p.body for p in self.publishes.values()
                 if not p.answered and p.conn.usable]
        if stuck and self.liveness:
            self.violate(f"(e) {len(stuck)} publishes unanswered {self.settle}s after the "
                         f"faults stopped, on open connections: {stuck[:3]}")
        bodies: dict[tuple[str, str], list[bytes]] = {}
        for node in self.group_nodes():
            vhost = node.broker.vhosts.get(VHOST)
            for name, q in (vhost.queues.items() if vhost is not None else ()):
                held = [e.message.body for e in q.ready]
                bodies[(node.name, name)] = held
                twice = [b for b, n in Counter(held).items() if n > 1]
                if twice:
                    self.violate(f"(b) {node.name} holds {twice[:3]} twice in {name}")
        for group in self.groups[1:]:
            serving = self.serving_groups[group]
            vhost = serving.broker.vhosts.get(VHOST) if serving is not None else None
            for name, q in (vhost.queues.items() if vhost is not None else ()):
                for e in q.ready:
                    self.observe(name, e.position, e.message.body)
        for name, at in self.seen_at.items():
            where: dict[bytes, list[int]] = {}
            for position, body in at.items():
                where.setdefault(body, []).append(position)
            moved = {b: sorted(ps) for b, ps in where.items() if len(ps) > 1}
            if moved:
                body, positions = next(iter(moved.items()))
                self.violate(f"(b) {body!r} enqueued twice in {name}, at positions {positions}")
        for body, queues in self.acked.items():
            for group, name in queues.items():
                if (name, body) in self.taken:
                    continue  # delivered and acknowledged
                cells = self.cells[group]
                holding = [c for c in cells if body in bodies.get((c, name), ())]
                primary = self.serving_groups[group]
                if primary is None or primary.name not in holding or \
                        2 * len(holding) <= len(cells):
                    self.violate(f"(a) acknowledged {body!r} of {name} held only by {holding} "
                                 f"(group {group}'s primary "
                                 f"{primary.name if primary else None})")
        for name, at in self.seen_at.items():  # (d): in position order, consumed ones too
            last: dict[str, int] = {}
            for position in sorted(at):
                body = at[position]
                client, seq = body.decode().split(".")
                if int(seq) <= last.get(client, 0):
                    self.violate(f"(d) {name} position {position}: {body!r} after "
                                 f"{client}.{last[client]}")
                last[client] = int(seq)

    def member_of(self, node: ForwardNode, group: int) -> HAMember | None:
        return node.member(group)


# ---- running many seeds ---------------------------------------------------------------------


def run_seed(seed: int, *, nodes: int = 3, duration: float = 30.0,
             faults: Faults | None = None, **kw: Any) -> SimResult:
    return run_quietly(ForwardSimulation, seed, nodes=nodes, duration=duration,
                       faults=faults or FAULTS, **kw)


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    return run_seeds(run_seed, seeds, jobs=jobs, **kw)
