"""A partitioned node's remote consumers: ``partition/remote_consumer.py`` over the node's
groups and its AMQP channels (issue 35 stage 3, docs/ha.md "Clients on any node").

The node's shell (``node/ha_groups.py``) hands in how to put a packet on a link
(``send``), how to run something at the next loop turn (``soon``); the channel's
methods (``amqp/methods/basic.py``, through ``partition/clients.py``'s
``GroupClients``) hand in the consumes, gets, cancels and closes of queues of
groups this node does not serve. What it does:

- **The proxy** (``ConsumerProxy``, one per start of the node, the forward
  sender's origin): told of every ``LeaderNotice`` (``NodeForwarding``'s
  listeners) and every link down; its settles go out once per loop turn.
- **A host per group this node serves** (``ConsumerHost``, made in ``serving``
  for that epoch, stopped in ``demoted``): queues by ``x-ha-id``
  (``BrokerForwardLog``), ``serving`` while the member's role is of that epoch
  and its clients' term (lease) holds; ``Settled`` through the group's gate.
- **The channel's side**: a remote consumer is a ``ChannelConsumer`` in the
  channel's ``consumers`` whose queue is a *stand-in* (``StandIn``: a private
  ``Queue`` nothing routes to, never dispatching), and each delivery is kept in
  the channel's ``unacked`` as an ``Entry`` of that stand-in, so the channel's
  ack, nack, reject (``multiple`` too) and its release work unchanged: the
  stand-in's ``dequeued`` and ``requeued`` hooks turn them into the proxy's
  settles (an ack counts in the queue's ``acked``, a reject does not). A
  consume's ``consume-ok`` waits for the leader's ``Attached`` (a refusal
  closes the channel instead, as locally); the consumers' credit follows the
  channel's ``basic.qos`` and, for no-ack ones, what their client's connection
  took (``_credit``, ``Credit``).
- **Transactions** (``GroupClients.tx_commit``): the acks, rejects and nacks of
  remote deliveries in a transaction across partitions are handed, before its
  prepares, to the branches on the primaries that delivered them
  (``hand_over``); a host's branch takes them from ``NodeTransactions``' rules
  of its epoch (``transactions``, set by the shell), what none took is released
  at the tick once decided (docs/ha.md "Clients on any node").
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.amqp import frames as F
from brokerha.amqp.channel import OPEN
from brokerha.amqp.consumer import ChannelConsumer, Delivery
from brokerha.amqp.errors import AMQPError
from brokerha.broker.message import Entry
from brokerha.broker.message import Message as BrokerMessage
from brokerha.broker.queue import Queue, QueueHooks
from brokerha.cluster.messages import ErrorCode, Message
from brokerha.partition.forward import LeaderNotice
from brokerha.partition.forward_apply import BrokerForwardLog
from brokerha.partition.forwarding import Paced
from brokerha.partition.member import PartitionedMember
from brokerha.partition.remote_consumer import (
    ACCESS_REFUSED,
    ACK,
    CANCELLED,
    NOT_FOUND,
    REJECT,
    REQUEUE,
    UNAVAILABLE,
    Attached,
    Cancel,
    Cancelled,
    Consume,
    ConsumeAnswered,
    ConsumeError,
    ConsumerHost,
    ConsumerProxy,
    Credit,
    Deliver,
    Delivered,
    DeliverPart,
    Effect,
    Get,
    GetAnswer,
    GetReply,
    RemoteDelivery,
    SendTo,
    SendWhenDurable,
    Settle,
    Settled,
)

if TYPE_CHECKING:
    from brokerha.amqp.channel import Channel
    from brokerha.partition.remote_consumer import BranchKey, Handed
    from brokerha.partition.transactions import NodeTransactions

log = logging.getLogger("brokerha.partition")

# how long a remote consume waits for a leader to take it (none known, an election) before
# its channel is closed 404 (its consume-ok is owed the leader's answer)
CONSUME_WAIT = 30.0

PACKETS = (Consume, Deliver, Settle, Cancel, Get, GetReply, ConsumeError, Settled,  # 40-47
           DeliverPart, Attached, Credit)  # 48, 49, 57
TO_HOST = (Consume, Settle, Cancel, Get, Credit)


class StandIn:
    """The queue a channel's remote deliveries are held under: a private ``Queue`` (never
    routed to, no consumers) whose settle hooks go to the proxy."""

    def __init__(self, node: NodeConsuming, vhost: str, name: str) -> None:
        self.node = node
        self.held: dict[int, tuple[Entry, RemoteDelivery]] = {}  # id(entry) -> its delivery
        self._acked = 0
        hooks = QueueHooks()
        hooks.dequeued.append(self.dequeued)
        hooks.requeued.append(self.requeued)
        self.queue = Queue(vhost, name, hooks=hooks, clock=node.clock)

    def hold(self, d: RemoteDelivery) -> Entry:
        entry = Entry(d.position, BrokerMessage(d.exchange, d.routing_key, d.header, d.body),
                      None)
        entry.redelivered = d.redelivered
        self.held[id(entry)] = (entry, d)
        self.queue.unacked += 1
        return entry

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        how = ACK if queue.acked != self._acked else REJECT  # Queue.settle counts acks
        self._acked = queue.acked
        held = self.held.pop(id(entry), None)
        if held is not None:
            self.node.settle(held[1], how)

    def requeued(self, queue: Queue, entry: Entry) -> None:
        queue.take_position(entry.position)  # not ready here: its queue is the leader's
        queue.unacked -= 1
        held = self.held.pop(id(entry), None)
        if held is not None:
            self.node.settle(held[1], REQUEUE)


def stand_in_of(queue: Queue) -> StandIn | None:
    """The stand-in a channel's delivery of ``queue`` was held under (None: a queue of this
    node's broker): its hooks are the stand-in's."""
    for hook in queue.hooks.requeued:
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, StandIn):
            return owner
    return None


def credit_of(ch: Channel, consumer: ChannelConsumer) -> int:
    """The host's credit for a remote consumer: its prefetch (the channel's at the consume),
    at most the channel's global one (what comes beyond the channel's room waits on this
    node: ``RemoteSub.waiting``); 0: unlimited."""
    return min((p for p in (consumer.prefetch, ch.global_prefetch) if p), default=0)


class RemoteSettle:
    """A remote delivery the channel acknowledged (``ACK``) or rejected (``REQUEUE``,
    ``REJECT``) in a transaction: its stand-in, the channel's entry, what the host knows."""

    __slots__ = ("stand_in", "entry", "delivery", "how")

    def __init__(self, stand_in: StandIn, entry: Entry, delivery: RemoteDelivery,
                 how: str) -> None:
        self.stand_in = stand_in
        self.entry = entry
        self.delivery = delivery
        self.how = how


class RemoteSub:
    """A channel's consumer of a remote queue; ``waiting``: deliveries come while the
    channel's global prefetch (``basic.qos global``) was full, written as acks free it."""

    def __init__(self, channel: Channel, consumer: ChannelConsumer, stand_in: StandIn,
                 since: float, answer: bool) -> None:
        self.channel = channel
        self.consumer = consumer
        self.stand_in = stand_in
        self.waiting: deque[RemoteDelivery] = deque()
        # the consume-ok (or the 404/403 closing the channel) waits for the leader's
        # answer: ``answer`` while it is owed (not nowait), asked at ``since``
        self.since = since
        self.answer = answer
        self.credit = 0   # the prefetch the host was told (``credit_of``)
        self.written = 0  # no-ack deliveries written to the client, not granted back yet


class NodeConsuming:
    """The node's consumer proxy, its hosts and the channels in between."""

    def __init__(self, member: PartitionedMember, origin: str, *,
                 send: Callable[[str, Message], None], soon: Callable[[Callable[[], None]], Any],
                 clock: Callable[[], float]) -> None:
        self.member = member
        self.me = member.me
        self.paced = Paced(send, soon)  # a large delivery's parts spread over loop turns
        self._send = self.paced.send
        self._send_now = send  # a hand-over: before the coordinator's prepares, not paced
        self._soon = soon
        self.clock = clock
        self.proxy = ConsumerProxy(origin)
        self.hosts: dict[int, ConsumerHost] = {}
        self.subs: dict[int, RemoteSub] = {}  # consumer id -> its channel's consumer
        self.by_channel: dict[int, dict[str, int]] = {}  # id(channel) -> tag -> consumer id
        self.gets: dict[int, tuple[Channel, StandIn, bool]] = {}  # request -> channel ...
        self._flush_scheduled = False
        # the node's transactions (the shell sets it): its served groups' branches take the
        # entries a consumer's node hands over (None: a hand-over is requeued at once)
        self.transactions: NodeTransactions | None = None

    # -- the channel's calls (GroupClients) ---------------------------------------------------

    def consume(self, ch: Channel, queue: Queue, group: int, ha_id: str, tag: str, *,
                no_ack: bool, exclusive: bool, nowait: bool) -> None:
        stand_in = StandIn(self, queue.vhost, queue.name)
        consumer = ChannelConsumer(ch, stand_in.queue, tag, no_ack=no_ack, exclusive=exclusive,
                                   prefetch=ch.prefetch_count, arguments={})
        credit = credit_of(ch, consumer)
        cid, out = self.proxy.consume(group, queue.vhost, ha_id, credit,
                                      no_ack=no_ack, exclusive=exclusive)
        sub = self.subs[cid] = RemoteSub(ch, consumer, stand_in, self.clock(), not nowait)
        sub.credit = credit
        self.by_channel.setdefault(id(ch), {})[tag] = cid
        ch.consumers[tag] = consumer
        if not nowait:  # the consume-ok once the leader took it: its later frames wait
            ch.block()
        self.carry_out(out)

    def get(self, ch: Channel, queue: Queue, group: int, ha_id: str, no_ack: bool) -> None:
        request, out = self.proxy.get(group, queue.vhost, ha_id, no_ack=no_ack)
        self.gets[request] = (ch, StandIn(self, queue.vhost, queue.name), no_ack)
        ch.block()  # the channel's later frames wait for the answer
        self.carry_out(out)

    def cancel(self, ch: Channel, tag: str) -> None:
        cid = self.by_channel.get(id(ch), {}).get(tag)
        if cid is not None:
            sub = self.subs.get(cid)
            if sub is not None and sub.waiting:  # never written: back to the queue
                self.proxy.settle(sub.waiting, REQUEUE)
                sub.waiting.clear()
                self._want_flush()
            self.carry_out(self.proxy.cancel(cid))

    def channel_closed(self, ch: Channel) -> None:
        """Before the channel requeues its unacked: the consumers' close (the host requeues
        what they held); the gets' deliveries come back as requeue settles after this."""
        for cid in self.by_channel.pop(id(ch), {}).values():
            self.subs.pop(cid, None)
            self.carry_out(self.proxy.close(cid))

    def settle(self, d: RemoteDelivery, how: str) -> None:
        self.proxy.settle([d], how)
        self._want_flush()

    # -- a transaction's acks and rejects of remote deliveries (GroupClients.tx_commit) --------

    @staticmethod
    def remote_settles(accepts: list[tuple[Queue, Entry]],
                       rejects: list[tuple[Queue, Entry, bool]]
                       ) -> tuple[list[RemoteSettle], list[tuple[Queue, Entry]],
                                  list[tuple[Queue, Entry, bool]]]:
        """A transaction's acks and rejects split: those of remote deliveries (held by the
        primary that delivered them), and the rest (this node's queues)."""
        remote: list[RemoteSettle] = []
        local_accepts: list[tuple[Queue, Entry]] = []
        local_rejects: list[tuple[Queue, Entry, bool]] = []
        for queue, entry in accepts:
            stand_in = stand_in_of(queue)
            held = None if stand_in is None else stand_in.held.get(id(entry))
            if stand_in is None or held is None:
                local_accepts.append((queue, entry))
            else:
                remote.append(RemoteSettle(stand_in, entry, held[1], ACK))
        for queue, entry, requeue in rejects:
            stand_in = stand_in_of(queue)
            held = None if stand_in is None else stand_in.held.get(id(entry))
            if stand_in is None or held is None:
                local_rejects.append((queue, entry, requeue))
            else:
                remote.append(RemoteSettle(stand_in, entry, held[1],
                                           REQUEUE if requeue else REJECT))
        return remote, local_accepts, local_rejects

    def hand_over(self, gtxid: str, remote: list[RemoteSettle]) -> None:
        """Transaction ``gtxid`` is named, its prepares not sent yet: the channel lets go of
        these deliveries (its stand-ins forget them: no settle of theirs follows) and each
        primary that delivered them hands them to the transaction's branch there -- its
        ``Settle`` sent now, ahead of the prepare on the same link (docs/ha.md "Clients
        on any node", the transaction's hand-over)."""
        by_how: dict[str, list[RemoteDelivery]] = {}
        for r in remote:
            if r.stand_in.held.pop(id(r.entry), None) is not None:
                r.stand_in.queue.unacked -= 1
            by_how.setdefault(r.how, []).append(r.delivery)
        for how, deliveries in by_how.items():
            for effect in self.proxy.hand_over(deliveries, how, gtxid):
                if isinstance(effect, SendTo):
                    if effect.node == self.me:  # in process, ahead of the prepare too
                        self._soon(partial(self.on_packet, self.me, effect.packet))
                    else:
                        self._send_now(effect.node, effect.packet)

    def handed_answered(self, remote: list[RemoteSettle], committed: bool) -> None:
        self.proxy.handed_answered([r.delivery for r in remote], committed)

    def flush(self) -> None:
        self._flush_scheduled = False
        self.carry_out(self.proxy.flush())
        self._write_waiting()  # an ack made room on its channel
        self._credit()

    def _credit(self) -> None:
        """Each consumer's credit to its host: its prefetch again if the channel's
        ``basic.qos`` changed it (the global one, at once for every consumer of the
        channel, as locally), and a no-ack consumer's deliveries written to its client,
        granted back while the client's connection takes writes (a slow client's node
        holds at most ``NO_ACK_CREDIT`` more of them). At a flush and at the HA tick."""
        for cid, sub in self.subs.items():
            ch = sub.channel
            if ch.state != OPEN:
                continue
            credit = credit_of(ch, sub.consumer)
            granted = sub.written if ch.conn.writable else 0
            if credit == sub.credit and not granted:
                continue
            sub.credit = credit
            sub.written -= granted
            self.carry_out(self.proxy.credit(cid, credit, granted))

    def _want_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._soon(self.flush)

    # -- the groups' roles (the shell's PartitionEffects) ------------------------------------

    def serving(self, group: int, epoch: int) -> None:
        placement = self.member.placement
        assert placement is not None
        old = self.hosts.pop(group, None)
        if old is not None:
            old.stop()
        queues = BrokerForwardLog(self.member.broker, group, placement.of(group - 1))
        host: ConsumerHost

        def serves() -> bool:
            member = self.member.groups.get(group)
            return member is not None and member.role_term() == epoch and \
                member.clients.term() is not None

        def soon() -> None:
            self._soon(lambda: self.carry_out(host.flush()))

        def branches() -> dict[BranchKey, Entry] | None:
            transactions = self.transactions
            own = None if transactions is None else transactions.rules.get(group)
            return None if own is None or own.epoch != epoch else own.txs.held

        host = ConsumerHost(group, epoch, queues, serving=serves, soon=soon, branches=branches)
        self.hosts[group] = host

    def demoted(self, group: int) -> None:
        host = self.hosts.pop(group, None)
        if host is not None:
            host.stop()

    def leader(self, notice: LeaderNotice) -> None:
        self.carry_out(self.proxy.leader(notice))

    def link_lost(self, peer: str) -> None:
        out: list[Effect] = []
        for host in list(self.hosts.values()):
            out += host.link_lost(peer)
        out += self.proxy.link_lost(peer)
        self.carry_out(out)

    def tick(self) -> None:
        for host in list(self.hosts.values()):
            host.redispatch()
            if host.handed:
                host.release_handed(partial(self._decided, host.group, host.epoch))
        self._write_waiting()
        self._credit()  # a basic.qos changed since, a slow client's connection writable again
        self._unanswered()

    def _decided(self, group: int, epoch: int, gtxid: str, handed: Handed) -> bool:
        """Whether transaction ``gtxid``'s branch here is past taking what was handed to it:
        decided, or its rules (of this epoch) gone."""
        transactions = self.transactions
        own = None if transactions is None else transactions.rules.get(group)
        if own is None or own.epoch != epoch or own.txs.held is not handed.branch:
            return True
        return own.txs.status(gtxid).decided

    def _unanswered(self) -> None:
        """A consume no leader answered within ``CONSUME_WAIT`` (none known, or each refused
        it as not its primary): the channel is closed 404, as RabbitMQ answers a consume of
        a queue whose home node is down (fail closed: never a consume-ok first)."""
        now = self.clock()
        for cid, sub in list(self.subs.items()):
            if sub.answer and now - sub.since > CONSUME_WAIT and sub.channel.state == OPEN:
                self._cancelled(Cancelled(cid, UNAVAILABLE, ""))

    def _write_waiting(self) -> None:
        """Deliveries that waited for the channel's global prefetch, written as it has room
        (at a remote ack, and at the HA tick for room a local consumer's ack made). A
        remote ack gives the channel's local consumers their turn too (the channel's own
        credit return offers only the acked message's queue, here the stand-in): one
        waiting delivery of each remote consumer, then the local queues, then the rest."""
        channels: dict[int, list[RemoteSub]] = {}
        for sub in self.subs.values():
            if sub.channel.global_prefetch:
                channels.setdefault(id(sub.channel), []).append(sub)
            while sub.waiting and sub.channel.can_deliver(False) and \
                    not sub.channel.global_prefetch:
                self._write(sub, sub.waiting.popleft())
        for subs in channels.values():
            ch = subs[0].channel
            for sub in subs:
                if sub.waiting and ch.can_deliver(False):
                    self._write(sub, sub.waiting.popleft())
            if ch.state == OPEN and ch.can_deliver(False):
                ch.redispatch()
            for sub in subs:
                while sub.waiting and ch.can_deliver(False):
                    self._write(sub, sub.waiting.popleft())

    # -- packets -------------------------------------------------------------------------------

    def on_packet(self, src: str, packet: Message) -> None:
        if isinstance(packet, TO_HOST):
            host = self.hosts.get(packet.group)
            if host is not None:
                self.carry_out(host.receive(src, packet))
            elif isinstance(packet, Consume):
                self.carry_out([SendTo(src, ConsumeError(
                    packet.group, packet.origin, packet.consumer, packet.attach,
                    ErrorCode.NOT_PRIMARY, f"{self.me} does not lead group {packet.group}"))])
            elif isinstance(packet, Get):
                self.carry_out([SendTo(src, GetReply(packet.group, packet.origin,
                                                     packet.request, [],
                                                     ErrorCode.NOT_PRIMARY, 0))])
        elif isinstance(packet, Deliver | GetReply | ConsumeError | Settled | DeliverPart
                        | Attached):
            self.carry_out(self.proxy.receive(src, packet))
            if self.proxy.pending:
                self._want_flush()

    # -- effects -------------------------------------------------------------------------------

    def carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, SendTo):
                self._to_node(effect)
            elif isinstance(effect, SendWhenDurable):
                member = self.member.groups.get(effect.group)
                if member is not None:
                    self.member.broker.after_durable_in(
                        member.durability_gate, partial(self._to_node, effect.send),
                        member.barriers())
            elif isinstance(effect, Delivered):
                self._delivered(effect.delivery)
            elif isinstance(effect, GetAnswer):
                self._got(effect)
            elif isinstance(effect, Cancelled):
                self._cancelled(effect)
            elif isinstance(effect, ConsumeAnswered):
                self._consume_ok(effect.consumer)

    def _to_node(self, effect: SendTo) -> None:
        packet = effect.packet
        if effect.node == self.me:  # this node's own host or proxy: at the next turn
            self._soon(lambda: self.on_packet(self.me, packet))
        else:
            self._send(effect.node, packet)

    def _delivered(self, d: RemoteDelivery) -> None:
        sub = self.subs.get(d.consumer)
        if sub is None:
            return
        ch = sub.channel
        if ch.state != OPEN:
            return
        if sub.waiting or (ch.global_prefetch and not ch.can_deliver(sub.consumer.no_ack)):
            sub.waiting.append(d)  # the channel's global prefetch is full: in order, later
            return
        self._write(sub, d)

    def _write(self, sub: RemoteSub, d: RemoteDelivery) -> None:
        ch = sub.channel
        if ch.state != OPEN:
            return
        entry = sub.stand_in.hold(d)
        tag = ch.next_tag()
        consumer = sub.consumer
        if consumer.no_ack:
            sub.stand_in.held.pop(id(entry), None)
            sub.stand_in.queue.unacked -= 1
            sub.written += 1  # granted back at the turn's end, if the client takes writes
            self._want_flush()
        else:
            ch.unacked[tag] = Delivery(sub.stand_in.queue, entry, None)
        conn = ch.conn
        conn.write(F.encode_delivery(ch.number, consumer.packed_tag, tag, d.redelivered,
                                     entry.message.route, d.header, d.body, conn.frame_max))

    def _got(self, answer: GetAnswer) -> None:
        pending = self.gets.pop(answer.request, None)
        if pending is None:
            return
        ch, stand_in, no_ack = pending
        d = answer.delivery
        if ch.state != OPEN:
            if d is not None and not no_ack:
                self.settle(d, REQUEUE)
            return
        if d is None:
            if answer.code == NOT_FOUND:  # as RabbitMQ (and a single node) words it
                q = stand_in.queue
                ch.conn.fail(ch, AMQPError(C.NOT_FOUND, f"no queue '{q.name}' in vhost "
                                           f"'{q.vhost}'", 60, 70))
                return
            ch.send(commands.Basic.GetEmpty())  # empty, or no leader serving it now
            ch.unblock()
            return
        entry = stand_in.hold(d)
        tag = ch.next_tag()
        ch.conn.write(F.encode_get_ok(ch.number, tag, d.redelivered, d.exchange,
                                      d.routing_key, answer.message_count))
        ch.send_content(d.header, d.body)
        if no_ack:
            stand_in.held.pop(id(entry), None)
        else:
            ch.unacked[tag] = Delivery(stand_in.queue, entry, None)
        ch.unblock()

    def _consume_ok(self, cid: int) -> None:
        sub = self.subs.get(cid)
        if sub is None or not sub.answer:
            return
        sub.answer = False
        ch = sub.channel
        if ch.state == OPEN:
            ch.send(commands.Basic.ConsumeOk(consumer_tag=sub.consumer.tag))
            ch.unblock()

    def _cancelled(self, effect: Cancelled) -> None:
        sub = self.subs.pop(effect.consumer, None)
        if sub is None:
            return
        ch = sub.channel
        tag = sub.consumer.tag
        self.by_channel.get(id(ch), {}).pop(tag, None)
        ch.consumers.pop(tag, None)
        if ch.state != OPEN:
            return
        q = sub.stand_in.queue
        if sub.answer:  # refused before its consume-ok: the channel closes, as locally
            self.carry_out(self.proxy.close(effect.consumer))
            if effect.code == ACCESS_REFUSED:
                text = f"queue '{q.name}' in vhost '{q.vhost}' in exclusive use"
                ch.conn.fail(ch, AMQPError(C.ACCESS_REFUSED, text, 60, 20))
                return
            if effect.code in (NOT_FOUND, CANCELLED):
                text = f"no queue '{q.name}' in vhost '{q.vhost}'"
            else:
                text = (f"home node of durable queue '{q.name}' in vhost '{q.vhost}' is down "
                        f"or inaccessible (no leader of its partition took the consumer "
                        f"within {CONSUME_WAIT:.0f} s)")
            ch.conn.fail(ch, AMQPError(C.NOT_FOUND, text, 60, 20))
            return
        if effect.code == NOT_FOUND:  # the texts a single node (and RabbitMQ) gives
            ch.conn.fail(ch, AMQPError(C.NOT_FOUND, f"no queue '{q.name}' in vhost "
                                       f"'{q.vhost}'", 60, 20))
        elif effect.code == ACCESS_REFUSED:
            ch.conn.fail(ch, AMQPError(C.ACCESS_REFUSED, f"queue '{q.name}' in vhost "
                                       f"'{q.vhost}' in exclusive use", 60, 20))
        elif ch.conn.capability("consumer_cancel_notify"):
            ch.send(commands.Basic.Cancel(consumer_tag=tag, nowait=True))

    def status(self) -> dict[str, Any]:
        return {"origin": self.proxy.origin, "consumers": len(self.proxy.subs),
                "proxy": vars(self.proxy.stats).copy(),
                "hosts": {str(g): {"epoch": h.epoch, "held": h.held(),
                                   **vars(h.stats)} for g, h in sorted(self.hosts.items())}}
