"""Remote consumers, simulated (issue 35, stage 3): ``--workload remote-consume``.

The forward simulation's world (``partition/forward_simulation.py``: every node
a ``PartitionedMember`` over its ``Broker``, publishers with confirms on random
nodes forwarding to the partitions' primaries, crashes, pauses, network
partitions, link failures, late packets, handovers of single groups) where the
messages are consumed by clients on random nodes through
``partition/remote_consumer.py``:

- each node runs a ``ConsumerProxy`` per start (origin ``<node>.<incarnation>``,
  told of leaders by the forward path's ``LeaderNotice``, flushed once per loop
  turn) and a ``ConsumerHost`` per group it serves (made when its member
  serves, over the group's queues by ``x-ha-id``, handing out nothing while the
  member does not serve; ``stop`` when it is demoted: what its consumers held
  is requeued), told of every lost link (``link_lost``: a crash of the
  consumer's node included);
- consumer clients, one per queue (each partition's plain and bounded one),
  each connected to a random node that follows the metadata group, consume
  with a random prefetch (1-5) and settle each delivery after a while (ack;
  one in ten nack with requeue, one in thirty reject): the client's node goes
  through its proxy for every queue, its own partitions' too (in process, as
  the forwards); a client whose node dies or stops serving clients dials
  another (its channel closed: ``close``), and now and then closes its channel
  and consumes again elsewhere; two getters do ``basic.get`` and ack.

Faults for ``duration``, then ``settle`` seconds without faults or publishes,
consumers draining; then the consumers close their channels and the checks run.

Checked (besides the forward simulation's (a)-(e), which leave out what a
client acknowledged, and the groups' (a)-(h)):

- (A) liveness: every confirmed message was acknowledged (or rejected) by a
  client at least once by the end;
- (B) a settled message (acked, answered ``Settled`` by a primary: durable on
  its group's majority in its epoch) is never delivered again by a primary of
  that epoch or a later one;
- (C) no message lost: every confirmed message not settled by a client is
  ready in its queue on the group's serving primary at the end;
- (D) per consumer attachment, the deliveries a client holds unsettled never
  exceed its prefetch;
- (E) per consumer attachment and queue, the messages delivered for the first
  time come in position order;
- (F) a message delivered again to the consumer that holds it unsettled (after a
  lost link or a failover: another attachment) carries its redelivered flag.

``Unsafe`` (``partition.remote_consumer.Unsafe``): ``credit_ignored`` (caught
by (D)), ``no_requeue_on_link_loss`` (by (C)), ``ack_before_durable`` (by (B)),
``no_redelivered_mark`` (by (F)), each at a pinned seed in ``tests/partition/test_remote_consume_simulation.py``.

Transactions (``tx_settle`` > 0, issue 35 task F): that share of the clients'
settles goes as a transaction's would -- the client's node hands the delivery
to the transaction's branch on the primary that delivered it
(``ConsumerProxy.hand_over``: a ``Settle`` of ``how`` ``tx:<how>:<gtxid>``;
the host moves the entry from the consumer's hold to its branch's ``held``),
and a while later (unless the client's node died: its link's loss releases
it) the branch's prepare takes it from there on the primary and the
transaction commits (4 in 5) or rolls back. The branch here is the
simulation's (prepare, decision and apply in one step, settled through the
group's gate), the hand-over, the host's release of what no branch took
(``release_handed``: decided, the link lost, the role ended) and the proxy's
naming of handed positions until the commit is answered are the product's.
A handed position is the client's unsettled until its commit is answered:
(F) checks its flag when it comes again. ``hand_over_kept`` (the host keeps
holding what it handed: a close or lost link requeues a message the branch
settled) is caught by (B), ``hand_over_forgotten`` (the proxy forgets a handed
position at once: a failover before the commit delivers it unflagged) by (F).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from brokerha.broker.message import Entry
from brokerha.cluster.messages import Message as Packet
from brokerha.ha.simulation.disk import Image
from brokerha.ha.simulation.world import Faults, SimConnection, SimNode
from brokerha.partition.forward import LeaderNotice
from brokerha.partition.forward_apply import BrokerForwardLog
from brokerha.partition.forward_simulation import (
    VHOST,
    ForwardNode,
    ForwardResult,
    ForwardSimulation,
    queue_name,
)
from brokerha.partition.group_simulation import (
    FAULTS,
    GroupSimulation,
    SimResult,
    run_quietly,
    run_seeds,
)
from brokerha.partition.member import group_of
from brokerha.partition.remote_consumer import (
    ACK,
    REJECT,
    REQUEUE,
    Attached,
    BranchKey,
    Cancel,
    Cancelled,
    Consume,
    ConsumeError,
    ConsumerHost,
    ConsumerProxy,
    Deliver,
    Delivered,
    Effect,
    Get,
    GetAnswer,
    GetReply,
    RemoteDelivery,
    SendTo,
    SendWhenDurable,
    Settle,
    SettleAnswered,
    Settled,
    Unsafe,
)

__all__ = ["CATCHES", "RemoteConsumeSimulation", "SimResult", "Unsafe", "run_many",
           "run_seed"]

CATCHES = tuple(Unsafe.names())
RC_PACKETS = (Consume, Deliver, Settle, Cancel, Get, GetReply, ConsumeError, Settled, Attached)


class ConsumeNode(ForwardNode):
    """A forwarding node that also consumes remote queues for its clients and hosts the
    remote consumers of the groups it serves."""

    def __init__(self, world: GroupSimulation, name: str, incarnation: int,
                 disk: Image | None) -> None:
        super().__init__(world, name, incarnation, disk)
        self.rc = cast(RemoteConsumeSimulation, world)
        self.proxy = ConsumerProxy(f"{name}.{incarnation}", unsafe=self.rc.rc_unsafe)
        self.rc.proxies.append(self.proxy)
        self.hosts: dict[int, ConsumerHost] = {}
        self.owners: dict[int, ConsumerClient] = {}  # consumer id -> its client
        self.getting: dict[int, Getter] = {}         # get request -> its client
        self._proxy_flush = False
        # the simulated transactions' branches here: group -> the entries handed to them
        # (per epoch of the host), and the transactions decided here
        self.branch_held: dict[int, dict[BranchKey, Entry]] = {}
        self.decided: set[str] = set()

    # -- the groups' role -------------------------------------------------------------------

    def serving(self, group: int, epoch: int, decisions: dict[str, str]) -> None:
        if group != 0:
            placement = self.ha.placement
            assert placement is not None
            queues = BrokerForwardLog(self.broker, group, placement.of(group - 1))
            branch: dict[BranchKey, Entry] = {}
            self.branch_held[group] = branch
            host = ConsumerHost(group, epoch, queues,
                                serving=partial(self._serves_in, group, epoch),
                                soon=partial(self._soon_host, group),
                                unsafe=self.rc.rc_unsafe, branches=lambda: branch)
            self.hosts[group] = host
            self.rc.hosts.append(host)
        super().serving(group, epoch, decisions)

    def _serves_in(self, group: int, epoch: int) -> bool:
        member = self.member(group)
        return member is not None and self.serves(group) and member.role_term() == epoch

    def demoted(self, group: int, reason: str) -> None:
        super().demoted(group, reason)
        host = self.hosts.pop(group, None)
        if host is not None:
            host.stop()

    # -- packets ------------------------------------------------------------------------------

    def on_forward(self, src: str, packet: Packet) -> None:
        super().on_forward(src, packet)
        if isinstance(packet, LeaderNotice):
            self.carry(self.proxy.leader(packet))

    def on_rc(self, src: str, packet: Packet) -> None:
        if isinstance(packet, Consume | Settle | Cancel | Get):
            self.charge(self.sim.costs.client_op / 4)
            host = self.hosts.get(packet.group)
            if host is not None:
                self.carry(host.receive(src, packet))
            elif isinstance(packet, Consume):
                self.carry([SendTo(src, ConsumeError(packet.group, packet.origin,
                                                     packet.consumer, packet.attach,
                                                     "not-primary",
                                                     f"{self.name} does not lead group "
                                                     f"{packet.group}"))])
            elif isinstance(packet, Get):
                self.carry([SendTo(src, GetReply(packet.group, packet.origin, packet.request,
                                                 [], "not-primary", 0))])
        elif isinstance(packet, Deliver | GetReply | ConsumeError | Settled | Attached):
            self.carry(self.proxy.receive(src, packet))
            if self.proxy.pending:
                self.want_proxy_flush()

    def link_lost(self, peer: str) -> None:
        out: list[Effect] = []
        for host in list(self.hosts.values()):
            out += host.link_lost(peer)
        out += self.proxy.link_lost(peer)
        self.carry(out)

    def carry(self, effects: Sequence[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, SendTo):
                if isinstance(effect.packet, Attached):
                    # not carried: the clients here do not wait for a consume-ok (the first
                    # Deliver answers the consume too), and the pinned seeds' runs stay as
                    # they were before the packet
                    continue
                if isinstance(effect.packet, Settled) and self.rc.rc_unsafe.ack_before_durable:
                    self.rc.settle_applied(effect.packet)  # answered at once, not through the gate
                if effect.node == self.name:
                    self.sim.soon.append((self, partial(self.on_rc, self.name, effect.packet)))
                else:
                    self.send(effect.node, effect.packet)
            elif isinstance(effect, SendWhenDurable):
                if isinstance(effect.send.packet, Settled):
                    self.rc.settle_applied(effect.send.packet)
                member = self.member(effect.group)
                if member is not None:
                    self.broker.after_durable_in(member.durability_gate,
                                                 partial(self.carry, [effect.send]),
                                                 member.barriers())
            elif isinstance(effect, Delivered):
                owner = self.owners.get(effect.delivery.consumer)
                if owner is not None:
                    self.rc.delivered(self, owner, effect.delivery)
            elif isinstance(effect, GetAnswer):
                getter = self.getting.pop(effect.request, None)
                if getter is not None:
                    self.rc.got(self, getter, effect)
            elif isinstance(effect, Cancelled):
                owner = self.owners.pop(effect.consumer, None)
                if owner is not None:
                    self.rc.cancelled(owner, effect)
            elif isinstance(effect, SettleAnswered):
                self.rc.settle_answered(effect)

    def want_proxy_flush(self) -> None:
        if not self._proxy_flush:
            self._proxy_flush = True
            self.sim.soon.append((self, self._flush_proxy))

    def _flush_proxy(self) -> None:
        self._proxy_flush = False
        self.carry(self.proxy.flush())

    def forward_tick(self) -> None:
        super().forward_tick()
        for host in list(self.hosts.values()):
            host.redispatch()
            if host.handed:
                host.release_handed(lambda gtxid, handed: gtxid in self.decided)

    def _soon_host(self, group: int) -> None:
        self.sim.soon.append((self, partial(self._flush_host, group)))

    def _flush_host(self, group: int) -> None:
        host = self.hosts.get(group)
        if host is not None:
            self.carry(host.flush())


@dataclass
class ConsumerClient:
    """One connection with one channel consuming one queue."""

    name: str
    queue: str
    prefetch: int = 1
    conn: SimConnection | None = None
    consumer: int = 0
    dialled_at: float = -1.0
    tag: int = 0
    held: dict[int, RemoteDelivery] = field(default_factory=dict)  # tag -> delivery
    # (F): (origin, consumer, position) -> whether the client settled its latest delivery
    history: dict[tuple[str, int, int], bool] = field(default_factory=dict)


@dataclass
class Getter:
    name: str
    conn: SimConnection | None = None
    dialled_at: float = -1.0


class ConsumeResult(ForwardResult):
    def counts(self) -> str:
        s = self.stats
        return (f"{s['client ack']} client acks, {s['failovers']} group failovers, "
                f"{s['proxy reattaches']} re-attaches, {s['released']} requeued")


class RemoteConsumeSimulation(ForwardSimulation):
    node_class = ConsumeNode

    def __init__(self, seed: int, *, ack_delay: float = 0.05, getters: int = 2,
                 get_rate: float = 4.0, reconsume: float = 0.2, settle: float = 15.0,
                 unsafe: Unsafe | None = None, tx_settle: float = 0.0, **kw: Any) -> None:
        """``ack_delay``: a client's mean time to settle a delivery; ``reconsume``: how
        often (a second) a consumer closes its channel and consumes again elsewhere;
        ``tx_settle``: the share of the settles made in a transaction (0: none, and no
        draw of the seed's generator for it)."""
        self.rc_unsafe = unsafe or Unsafe()
        self.proxies: list[ConsumerProxy] = []
        self.hosts: list[ConsumerHost] = []
        kw.setdefault("consume", 0.0)
        super().__init__(seed, settle=settle, **kw)
        self.ack_delay = ack_delay
        self.tx_settle = tx_settle
        self.transactions = 0
        self.get_rate = get_rate
        self.reconsume = reconsume
        names = [queue_name(p, b) for p in range(self.partitions) for b in (False, True)]
        self.consumers = [ConsumerClient(f"k{i}", n, 1 + self.rng.randrange(5))
                          for i, n in enumerate(names)]
        self.getters = [Getter(f"g{i}") for i in range(getters)]
        self.consuming = True
        self.body_at: dict[tuple[str, int], bytes] = {}  # (queue, position) -> body
        self.settled_in: dict[tuple[str, bytes], int] = {}  # (B): answered Settled, epoch
        self.client_settled: set[tuple[str, bytes]] = set()
        self.settled_by_host: set[tuple[str, bytes]] = set()  # (C): an ack or reject applied
        self.first_order: dict[tuple[str, str, int, int], int] = {}  # (E)
        self.result = ConsumeResult(seed, self.result.nodes, self.partitions, None, [], "")

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> SimResult:
        for client in self.consumers:
            self.after(0.5 + self.rng.random(), partial(self._keep_consuming, client))
        for getter in self.getters:
            self.after(self.rng.expovariate(self.get_rate), partial(self._get, getter))
        result = super().run()
        for proxy in self.proxies:
            for key, value in vars(proxy.stats).items():
                self.counts[f"proxy {key}"] += value
        for host in self.hosts:
            for key, value in vars(host.stats).items():
                self.counts[f"host {key}"] += value
        self.counts["released"] = self.counts["host released"]
        result.stats = self.counts
        return result

    def final_checks(self) -> None:
        self.consuming = False
        for client in self.consumers:
            self._close(client)
        self.run_until(self.now + 1.0)  # the closes' requeues
        for body, queues in self.acked.items():
            for name in queues.values():
                if (name, body) in self.settled_by_host:
                    continue
                group = group_of(self.partition_of(name))
                primary = self.serving_groups[group]
                q = primary.broker.vhosts[VHOST].queues.get(name) \
                    if primary is not None else None
                if q is None or not any(e.message.body == body for e in q.ready):
                    self.violate(f"(C) confirmed {body!r} of {name} neither settled by a "
                                 f"client nor ready on its primary "
                                 f"{primary.name if primary else None}")
        for body, queues in self.acked.items():
            for name in queues.values():
                if (name, body) in self.client_settled:
                    continue
                group = group_of(self.partition_of(name))
                primary = self.serving_groups[group]
                q = primary.broker.vhosts[VHOST].queues.get(name) \
                    if primary is not None else None
                ready = q is not None and any(e.message.body == body for e in q.ready)
                self.violate(f"(A) confirmed {body!r} of {name} never acknowledged by a "
                             f"client ({self.settle}s of calm to drain; "
                             f"{'ready' if ready else 'not ready'} on its primary)")
        super().final_checks()

    def _receive(self, node: SimNode, src: str, gen: int, msg_id: int, packet: Packet) -> None:
        if isinstance(packet, RC_PACKETS):
            if self.links[frozenset((src, node.name))].gen == gen:
                cast(ConsumeNode, node).on_rc(src, packet)
            return
        super()._receive(node, src, gen, msg_id, packet)

    def _notice_down(self, me: str, peer: str, gen: int) -> None:
        knew = self.seen.get((me, peer)) is not None
        super()._notice_down(me, peer, gen)
        if knew and self.seen.get((me, peer)) is None:
            node = cast(ConsumeNode, self.nodes[me])
            node.run(partial(node.link_lost, peer))

    # -- consumers --------------------------------------------------------------------------

    def _usable(self, conn: SimConnection | None) -> ConsumeNode | None:
        if conn is None or not conn.usable:
            return None
        node = cast(ConsumeNode, conn.node)
        return node if self.admits(node) else None

    def _keep_consuming(self, client: ConsumerClient) -> None:
        if not self.consuming:
            return
        self.after(0.2, partial(self._keep_consuming, client))
        node = self._usable(client.conn)
        if node is not None:
            if client.consumer and self.rng.random() < self.reconsume * 0.2:
                self.counts["channels closed by clients"] += 1
                self._close(client)
            return
        self._close(client)
        if client.queue not in self.declared or self.now - client.dialled_at < 0.05:
            return
        client.dialled_at = self.now
        name = self.rng.choice(self.names)

        def accept() -> None:
            target = cast(ConsumeNode, self.nodes[name])
            if not self.consuming or not self.admits(target) or client.conn is not None:
                return
            conn = SimConnection(self, cast(SimNode, target))
            conn.open = True
            client.conn = conn
            group = group_of(self.partition_of(client.queue))
            consumer, out = target.proxy.consume(group, VHOST, self.declared[client.queue],
                                                 client.prefetch)
            client.consumer = consumer
            target.owners[consumer] = client
            self.counts["consumes"] += 1
            target.carry(out)

        delay = self.faults.delay
        self.after(delay[0] + (delay[1] - delay[0]) * self.rng.random(),
                   lambda: self.nodes[name].run(accept))

    def _close(self, client: ConsumerClient) -> None:
        """The client's channel is gone (closed, or its connection with it)."""
        conn, consumer = client.conn, client.consumer
        client.conn, client.consumer, client.held = None, 0, {}
        if conn is None or not consumer:
            return
        node = cast(ConsumeNode, conn.node)
        if node.alive and node.owners.get(consumer) is client:
            def close() -> None:
                node.owners.pop(consumer, None)
                node.carry(node.proxy.close(consumer))
            node.run(close)

    def cancelled(self, client: ConsumerClient, cancel: Cancelled) -> None:
        self.counts[f"server cancel {cancel.code}"] += 1
        client.consumer, client.held = 0, {}
        if client.conn is not None:
            client.conn.open = False
        client.conn = None

    def delivered(self, node: ConsumeNode, client: ConsumerClient, d: RemoteDelivery) -> None:
        if client.conn is None or client.conn.node is not cast(SimNode, node) or \
                client.consumer != d.consumer:
            return
        self.counts["client deliveries"] += 1
        if d.redelivered:
            self.counts["client redeliveries"] += 1
        self._seen_delivery(client.queue, d)
        current = [h for h in client.held.values() if (h.epoch, h.attach) == (d.epoch, d.attach)]
        if len(current) >= client.prefetch:
            self.violate(f"(D) {client.name} holds {len(current) + 1} deliveries of {client.queue} "
                         f"in one attachment, prefetch {client.prefetch}")
        if not d.redelivered:
            key = (client.queue, node.proxy.origin, d.consumer, d.attach)
            last = self.first_order.get(key, 0)
            if d.position <= last:
                self.violate(f"(E) {client.name}: position {d.position} of {client.queue} "
                             f"delivered first after {last}")
            self.first_order[key] = d.position
        held = (node.proxy.origin, d.consumer, d.position)
        if client.history.get(held) is False and not d.redelivered:
            self.violate(f"(F) {client.name}: position {d.position} of {client.queue} "
                         f"delivered again to the consumer that held it unsettled, without "
                         f"its redelivered flag")
        client.history[held] = False
        client.tag += 1
        tag = client.tag
        client.held[tag] = d
        self.after(self.rng.expovariate(1 / self.client_delay()),
                   partial(self._settle, client, node, tag))

    def client_delay(self) -> float:
        """A client's time to settle: shorter once the publishers stopped (the drain)."""
        return self.ack_delay if self.publishing else self.ack_delay / 5

    def _seen_delivery(self, name: str, d: RemoteDelivery) -> None:
        """(B): not a message settled in this epoch or an earlier one."""
        self.body_at[(name, d.position)] = d.body
        epoch = self.settled_in.get((name, d.body))
        if epoch is not None and d.epoch >= epoch:
            self.violate(f"(B) {d.body!r} of {name} delivered by the primary of epoch "
                         f"{d.epoch} of group {d.group} after its settle was answered in "
                         f"epoch {epoch}")

    def _settle(self, client: ConsumerClient, node: ConsumeNode, tag: int) -> None:
        d = client.held.get(tag)
        if d is None or client.conn is None or client.conn.node is not cast(SimNode, node):
            return
        roll = self.rng.random()
        how = REQUEUE if roll < 0.1 else REJECT if roll < 0.13 else ACK
        if self.tx_settle and self.rng.random() < self.tx_settle:
            node.run(partial(self._tx_settle, client, node, tag, how))
            return

        def settle() -> None:
            if client.held.pop(tag, None) is None:
                return
            client.history[(node.proxy.origin, d.consumer, d.position)] = True
            if how != REQUEUE:
                self.client_settled.add((client.queue, d.body))
                self.taken.add((client.queue, d.body))
            self.counts[f"client {how}"] += 1
            node.proxy.settle([d], how)
            node.want_proxy_flush()

        node.run(settle)

    # -- transactions (tx_settle) ---------------------------------------------------------------

    def _tx_settle(self, client: ConsumerClient, node: ConsumeNode, tag: int, how: str) -> None:
        """On the client's node: its channel's tx.commit holding this settle -- the
        delivery handed to the transaction's branch on the primary that delivered it."""
        d = client.held.pop(tag, None)
        if d is None or client.conn is None or client.conn.node is not cast(SimNode, node):
            return
        self.transactions += 1
        gtxid = f"x{self.transactions}"
        self.counts[f"client tx {how}"] += 1
        sub = node.proxy.subs.get(d.consumer)
        leader = None if sub is None else sub.node
        out = node.proxy.hand_over([d], how, gtxid)
        node.carry(out)
        if leader is None or not out:  # not handed (detached, a stale delivery): refused
            self.counts["tx not handed"] += 1
            node.proxy.handed_answered([d], False)
            return
        incarnation = node.incarnation

        def prepare() -> None:
            if self.nodes[node.name] is not cast(SimNode, node) or \
                    node.incarnation != incarnation or not node.alive:
                return  # the coordinator died: its link's loss released the hand-over
            live = cast(ConsumeNode, self.nodes[leader])
            live.run(partial(self._branch, live, node, client, d, how, gtxid))

        self.after(0.01 + self.rng.random() * 0.3, prepare)

    def _branch(self, leader: ConsumeNode, node: ConsumeNode, client: ConsumerClient,
                d: RemoteDelivery, how: str, gtxid: str) -> None:
        """On the primary: the branch's prepare takes the handed entry, the decision (4 in 5
        a commit), the branch applied; the answer to the client's node once durable."""
        leader.decided.add(gtxid)
        name = self.name_of(d.group, d.queue)
        host = leader.hosts.get(d.group)
        branch = leader.branch_held.get(d.group)
        member = leader.member(d.group)
        q = leader.broker.vhosts[VHOST].queues.get(name) if name is not None else None
        entry = None
        if host is not None and host.epoch == d.epoch and branch is not None and \
                q is not None and member is not None and leader.serves(d.group):
            entry = branch.pop((VHOST, q.name, d.position), None)
        if entry is None or q is None or member is None or name is None:
            self.counts["tx refused"] += 1  # not held there now: a no
            self._tx_answer(node, client, d, False)
            return
        if self.rng.random() < 0.2:
            self.counts["tx rolled back"] += 1
            q.requeue(entry)
            if q.consumers:
                q.dispatch()
            self._tx_answer(node, client, d, False)
            return
        self.counts["tx committed"] += 1
        if how == REQUEUE:
            q.requeue(entry)
            if q.consumers:
                q.dispatch()
        else:
            if how == REJECT:
                q.reject(entry)
            else:
                q.settle(entry)
            self.settled_by_host.add((name, d.body))
            self.taken.add((name, d.body))  # dequeued: its enqueue's records may go
            # (A) as a plain ack's: settled by the client's commit, whether or not the gate
            # says so before the role ends (the dequeue may have reached the majority)
            self.client_settled.add((name, d.body))
        epoch, body = d.epoch, d.body

        def durable() -> None:
            if how != REQUEUE:
                known = self.settled_in.get((name, body))
                if known is None or epoch < known:
                    self.settled_in[(name, body)] = epoch
                self.observe(name, d.position, body)
            self._tx_answer(node, client, d, True)

        leader.broker.after_durable_in(member.durability_gate, durable, member.barriers())

    def _tx_answer(self, node: ConsumeNode, client: ConsumerClient, d: RemoteDelivery,
                   committed: bool) -> None:
        def answer() -> None:
            node.proxy.handed_answered([d], committed)
            if committed:
                client.history[(node.proxy.origin, d.consumer, d.position)] = True
        if node.alive:
            node.run(answer)

    def name_of(self, group: int, ha_id: str) -> str | None:
        return next((n for n, i in self.declared.items()
                     if i == ha_id and group_of(self.partition_of(n)) == group), None)

    def settle_applied(self, settled: Settled) -> None:
        """(C): a host applied these acks or rejects (durable or not: a gate refuses to say
        so once the role ends, though the dequeue may have reached the majority)."""
        name = self.name_of(settled.group, settled.queue)
        for position in settled.positions if name is not None else ():
            body = self.body_at.get((cast(str, name), position))
            if body is not None:
                self.settled_by_host.add((cast(str, name), body))

    def settle_answered(self, answer: SettleAnswered) -> None:
        name = self.name_of(answer.group, answer.queue)
        if name is None:
            return
        for position in answer.positions:
            body = self.body_at.get((name, position))
            if body is None:
                continue
            self.counts["settles answered"] += 1
            known = self.settled_in.get((name, body))
            if known is None or answer.epoch < known:
                self.settled_in[(name, body)] = answer.epoch
            self.observe(name, position, body)

    # -- getters ----------------------------------------------------------------------------

    def _get(self, getter: Getter) -> None:
        if not self.consuming:
            return
        self.after(self.rng.expovariate(self.get_rate), partial(self._get, getter))
        node = self._usable(getter.conn)
        if node is None:
            getter.conn = None
            if self.now - getter.dialled_at > 0.05:
                getter.dialled_at = self.now
                target = cast(ConsumeNode, self.rng.choice(list(self.nodes.values())))
                if self.admits(target):
                    getter.conn = SimConnection(self, cast(SimNode, target))
                    getter.conn.open = True
            return
        name = self.rng.choice([c.queue for c in self.consumers])
        if name not in self.declared:
            return
        group = group_of(self.partition_of(name))

        def get() -> None:
            request, out = node.proxy.get(group, VHOST, self.declared[name])
            node.getting[request] = getter
            node.carry(out)

        node.run(get)

    def got(self, node: ConsumeNode, getter: Getter, answer: GetAnswer) -> None:
        d = answer.delivery
        if answer.code:
            self.counts[f"get {answer.code}"] += 1
        if d is None:
            return
        if getter.conn is None or getter.conn.node is not cast(SimNode, node):
            node.proxy.settle([d], REQUEUE)  # the getter's channel closed: what it held, back
            node.want_proxy_flush()
            return
        name = self.name_of(d.group, d.queue)
        if name is None:
            return
        self.counts["client gets"] += 1
        self._seen_delivery(name, d)

        def ack() -> None:
            self.client_settled.add((name, d.body))
            self.taken.add((name, d.body))
            node.proxy.settle([d], ACK)
            node.want_proxy_flush()

        self.after(self.rng.expovariate(1 / self.client_delay()), lambda: node.run(ack))


# ---- running many seeds ---------------------------------------------------------------------


def run_seed(seed: int, *, nodes: int = 3, duration: float = 20.0,
             faults: Faults | None = None, **kw: Any) -> SimResult:
    return run_quietly(RemoteConsumeSimulation, seed, nodes=nodes, duration=duration,
                       faults=faults or FAULTS, **kw)


def run_many(seeds: Sequence[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    return run_seeds(run_seed, seeds, jobs=jobs, **kw)
