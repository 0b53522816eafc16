"""Consumers on any node of a partitioned cluster (docs/ha.md "Clients on any node",
Deliveries; issue 35 stage 3), sans-I/O.

A client may consume on any node; the queue lives in a partition whose primary
may be elsewhere. Two state machines, no sockets, no asyncio, no clock:

- ``ConsumerProxy``, on the client's node, one per start of it (``origin``
  ``<node>.<incarnation>``, as ``forward.ForwardSender``): a ``basic.consume``
  on a remote queue becomes ``Consume(group, epoch, origin, consumer, attach,
  vhost, queue, prefetch, ...)`` to the group's leader (as the last
  ``forward.LeaderNotice`` named it); every delivery that comes back is handed
  to the shell (``Delivered``: the channel gives it its own delivery tag and
  keeps the ``RemoteDelivery``, i.e. group, queue, position); the channel's
  ``basic.ack``/``nack``/``reject`` go back, batched per loop turn, as
  ``Settle(group, ..., positions, how)``; ``basic.cancel`` is ``Cancel``, a
  channel's close ``Cancel(release)``; ``basic.get`` one ``Get``/``GetReply``.
- ``ConsumerHost``, on a group's primary, made for one epoch of its role
  (dropped, ``stop``, when it ends): each consumer is a ``RemoteConsumer``,
  a consumer of the broker's queue like any other (``broker.queue.Consumer``:
  its credit is the client's prefetch, counted by what it holds unsettled);
  what the queue hands it goes out, one ``Deliver`` per consumer and loop
  turn (``flush``). A settle is applied to the queue (its dequeue goes into
  the group's log as any ack's); an ack or reject is answered ``Settled`` once
  durable on the group's majority in its epoch (``SendWhenDurable``).

What is held comes back as a closed connection's does today: a channel's
close (``Cancel`` with ``release``), a lost link to the consumer's node (its
death included: ``link_lost``) and the end of the role (``stop``) requeue
what the consumer held (``redelivered`` set). Delivery state is not
replicated: after a failover the proxy *re-attaches* each consumer to the new
leader (a new ``attach``) and the new primary delivers again what the old one
had delivered and not settled; the proxy names those positions in its
``Consume`` (``redelivered``), so the new primary sets their flag. Deliveries,
settles and errors of an earlier attachment are dropped on both sides (a
late packet of a deposed primary, a settle of a tag given before the
failover: the message is redelivered, at least once as today).

A large body travels in parts, as a forwarded one (``forward.py``): a delivery
whose body is over ``PART_BYTES`` goes alone in its ``Deliver`` (or
``GetReply``) with its body empty and its size after it, its body sent before
as ``DeliverPart`` packets; and a ``Deliver`` carries at most ``MAX_BYTES`` of
headers and bodies (a consumer's prefetch of large messages would otherwise
make one packet past the link's ``MAX_PACKET``). The proxy puts the body back
together; one not whole (a part lost with a link) is sent back as a
``requeue`` (the message comes again, flagged).

The proxy's consume is answered ``Attached`` by the host before any delivery (the
channel's consume-ok waits for it); ``Credit`` carries a changed prefetch and a
no-ack consumer's window (``NO_ACK_CREDIT``) back to the host. A ``Settle``
whose ``how`` is ``tx:<how>:<gtxid>`` (``hand_how``) hands what it names to a
transaction's branch on the host's primary (``Handed``, ``release_handed``).

Packets are cluster ``Message``s, codes 40-49 and 57 (the queues' range of
``cluster/messages.py``), fields wire types in wire order; each names its
group, so the mux does not wrap them. Queues are named by ``(vhost,
x-ha-id)`` within the group (``forward_apply.BrokerForwardLog.queue``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from brokerha.broker.errors import AccessRefused
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.cluster.messages import ErrorCode, Message, packet
from brokerha.partition.forward import MAX_BYTES, PART_BYTES, LeaderNotice
from brokerha.seed_runner import UnsafeRules

ACK, REQUEUE, REJECT = "ack", "requeue", "reject"  # a Settle's ``how``
# a Settle's ``how`` that hands the positions to a transaction's branch on this primary:
# ``tx:<ack|requeue|reject>:<gtxid>`` (``hand_how``)
HAND = "tx:"
# what a branch takes a handed entry by: (vhost, queue name, position), as
# ``xtx_broker.BrokerTransactions.held``
BranchKey = tuple[str, str, int]
GETTER = 0  # the consumer id under which a proxy's basic.get deliveries are held
# a no-ack consumer's credit: what the host sends it before the client's node says it wrote
# them to its client (``Credit.granted``): a fast primary cannot flood a slow client's node
NO_ACK_CREDIT = 256
NOT_FOUND = "not-found"            # the queue is not held by the primary (another incarnation)
ACCESS_REFUSED = "access-refused"  # an exclusive consumer rules it out (403)
CANCELLED = "cancelled"            # the queue went away (a server's basic.cancel)
UNAVAILABLE = "unavailable"        # a get with no leader, or lost with its leader or link


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of remote consumers to break on purpose (simulations only): each must be caught."""

    # the host hands a consumer whatever the queue has, beyond its prefetch
    credit_ignored: bool = False
    # a lost link to the consumer's node forgets what its consumers held, without requeueing
    no_requeue_on_link_loss: bool = False
    # the host answers Settled once it applied the ack, not once durable in its epoch
    ack_before_durable: bool = False
    # the proxy does not name, when it attaches again, what it held of an earlier attachment:
    # a new primary delivers those messages again without their redelivered flag
    no_redelivered_mark: bool = False
    # the host hands a transaction's positions to its branch and keeps holding them too: a
    # lost link or a close requeues what the branch also settles or requeues
    hand_over_kept: bool = False
    # the proxy forgets a handed position at once, not when the commit is answered: a
    # failover before the commit delivers it again without its flag
    hand_over_forgotten: bool = False


# -- packets --------------------------------------------------------------------------------


@packet(40)
class Consume(Message):
    """Proxy -> a group's primary: attach consumer ``consumer`` (its ``attach``-th time) to
    the queue; ``redelivered``: positions delivered to it before and not settled."""

    group: int
    epoch: int
    origin: str
    consumer: int
    attach: int
    vhost: str
    queue: str  # x-ha-id
    prefetch: int
    no_ack: bool
    exclusive: bool
    redelivered: list[int]


@packet(41)
class Deliver(Message):
    """Primary -> proxy: ``deliveries`` ``[position, redelivered, exchange, routing_key,
    header, body]`` each, in the order the queue gave them."""

    group: int
    epoch: int
    origin: str
    consumer: int
    attach: int
    deliveries: list[Any]


@packet(42)
class Settle(Message):
    """Proxy -> primary: ``how`` (ack, requeue, reject) the ``positions`` of ``queue`` the
    consumer holds in that attachment (``GETTER``: basic.get's)."""

    group: int
    epoch: int
    origin: str
    consumer: int
    attach: int
    vhost: str
    queue: str
    positions: list[int]
    how: str


@packet(43)
class Cancel(Message):
    """Proxy -> primary: basic.cancel (``release`` False: what it holds stays held until
    settled) or the channel's close (``release``: requeued)."""

    group: int
    epoch: int
    origin: str
    consumer: int
    attach: int
    release: bool


@packet(44)
class Get(Message):
    """Proxy -> primary: basic.get, answered by ``GetReply`` of the same ``request``."""

    group: int
    epoch: int
    origin: str
    request: int
    attach: int
    vhost: str
    queue: str
    no_ack: bool


@packet(45)
class GetReply(Message):
    """Primary -> proxy: ``delivery`` as in ``Deliver`` (empty: the queue was), or ``code``;
    ``message_count``: the queue's ready messages after the get (basic.get-ok's)."""

    group: int
    origin: str
    request: int
    delivery: list[Any]
    code: str
    message_count: int


@packet(46)
class ConsumeError(Message):
    """Primary -> proxy: the attachment is refused or ended (``not-primary``, ``not-found``,
    ``access-refused``, ``cancelled``)."""

    group: int
    origin: str
    consumer: int
    attach: int
    code: str
    message: str


@packet(47)
class Settled(Message):
    """Primary -> proxy: the acks or rejects of ``positions`` are durable on the group's
    majority in ``epoch``."""

    group: int
    epoch: int
    origin: str
    consumer: int
    vhost: str
    queue: str
    positions: list[int]


@packet(48)
class DeliverPart(Message):
    """Primary -> proxy: bytes ``offset``.. of the body (``size`` bytes in all) of the
    message at ``position`` that the ``Deliver`` (or, for ``GETTER``, the ``GetReply``)
    after the last part hands to ``consumer``."""

    group: int
    epoch: int
    origin: str
    consumer: int
    attach: int
    position: int
    size: int
    offset: int
    data: bytes


@packet(49)
class Attached(Message):
    """Primary -> proxy: the attachment is taken (the queue is there and no exclusive
    consumer rules it out): the channel's consume-ok waits for this (or a
    ``ConsumeError``), as a local consume's is given after the queue's checks. Sent
    before any ``Deliver`` of that attachment."""

    group: int
    origin: str
    consumer: int
    attach: int


@packet(57)
class Credit(Message):
    """Proxy -> primary: the consumer's credit now -- ``prefetch`` (the channel's
    ``basic.qos`` changed: its global prefetch, or the consumer's at the consume) and, for
    a no-ack consumer, ``granted`` deliveries written to the client (its window,
    ``NO_ACK_CREDIT``, opens by that many)."""

    group: int
    epoch: int
    origin: str
    consumer: int
    attach: int
    prefetch: int
    granted: int


Packet = (Consume | Deliver | Settle | Cancel | Get | GetReply | ConsumeError | Settled
          | DeliverPart | Attached | Credit)


# -- effects ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SendTo:
    """Put ``packet`` on the link to ``node`` (this node: its own host or proxy, in process)."""

    node: str
    packet: Packet


@dataclass(frozen=True)
class SendWhenDurable:
    """Carry out ``send`` once everything done so far is durable on the group's majority in
    the host's epoch (``Broker.after_durable_in`` of the group's gate: never, if the role
    ends first)."""

    group: int
    send: SendTo


@dataclass(frozen=True)
class RemoteDelivery:
    """A message as the client's node holds it: the channel's delivery tag maps to this."""

    consumer: int  # GETTER for a basic.get
    group: int
    epoch: int
    attach: int
    vhost: str
    queue: str
    position: int
    redelivered: bool
    exchange: str
    routing_key: str
    header: bytes
    body: bytes


@dataclass(frozen=True)
class Delivered:
    """Hand ``delivery`` to the consumer's channel (basic.deliver with its own tag)."""

    delivery: RemoteDelivery


@dataclass(frozen=True)
class GetAnswer:
    """basic.get-ok (``delivery``, ``message_count`` the queue's ready messages left at the
    leader), get-empty (None, ``code`` empty), or an error."""

    request: int
    delivery: RemoteDelivery | None
    code: str = ""
    message_count: int = 0


@dataclass(frozen=True)
class ConsumeAnswered:
    """The leader took the consumer's first attachment: the channel's consume-ok now."""

    consumer: int


@dataclass(frozen=True)
class Cancelled:
    """The server cancelled the consumer (its queue went, or it is refused): tell the client."""

    consumer: int
    code: str
    message: str


@dataclass(frozen=True)
class SettleAnswered:
    """The primary of ``group`` in ``epoch`` holds these acks/rejects durably."""

    group: int
    epoch: int
    consumer: int
    vhost: str
    queue: str
    positions: tuple[int, ...]


Effect = (SendTo | SendWhenDurable | Delivered | GetAnswer | Cancelled | SettleAnswered
          | ConsumeAnswered)


def hand_how(how: str, gtxid: str) -> str:
    """The ``how`` of a ``Settle`` handing positions to transaction ``gtxid``'s branch,
    settled there as ``how`` (``ACK``, ``REQUEUE``, ``REJECT``) at its commit."""
    return f"{HAND}{how}:{gtxid}"


def handed_how(how: str) -> tuple[str, str] | None:
    """``(how, gtxid)`` of a hand-over's ``how`` (None: an ordinary settle)."""
    if not how.startswith(HAND):
        return None
    kind, _, gtxid = how[len(HAND):].partition(":")
    return (kind, gtxid) if kind in (ACK, REQUEUE, REJECT) and gtxid else None


def wire_delivery(entry: Entry) -> list[Any]:
    m = entry.message
    return [entry.position, entry.redelivered, m.exchange, m.routing_key, m.header, m.body]


def in_parts(wire: list[Any]) -> list[Any]:
    """A delivery whose body goes in ``DeliverPart``s as its packet names it: the body
    empty, its size after it."""
    return [*wire[:5], b"", len(wire[5])]


@dataclass
class Partial:
    """A body in parts of the delivery of ``position``: what came so far."""

    position: int
    size: int
    chunks: list[bytes] = field(default_factory=list)
    have: int = 0


# -- the primary's side ------------------------------------------------------------------------


class QueueLookup(Protocol):
    """A group's queues by incarnation (``forward_apply.BrokerForwardLog`` is one)."""

    def queue(self, vhost: str, ha_id: str) -> Queue | None: ...


@dataclass
class HostStats:
    attached: int = 0     # Consume taken
    delivered: int = 0    # messages sent in Deliver packets
    settled: int = 0      # acks and rejects applied
    requeued: int = 0     # nacks with requeue applied
    released: int = 0     # held messages requeued: a close, a lost link, a re-attach, the end
    handed: int = 0       # held messages handed to a transaction's branch
    handed_back: int = 0  # ... that no branch took, requeued here
    stale: int = 0        # packets of another attachment or epoch, dropped
    gets: int = 0         # Get answered with a message
    marked: int = 0       # positions a re-attach named, found ready and marked redelivered
    parts: int = 0        # DeliverParts sent (large bodies)


class Holder:
    """What one consumer of one origin holds unsettled at the host: (x-ha-id, position)."""

    def __init__(self, node: str, origin: str, consumer: int, attach: int) -> None:
        self.node = node
        self.origin = origin
        self.consumer = consumer
        self.attach = attach
        self.held: dict[tuple[str, int], tuple[Queue, Entry]] = {}


class RemoteConsumer(Holder):
    """A consumer of a queue of this primary on behalf of a client on another node: to the
    queue it is any consumer (``broker.queue.Consumer``), its credit the client's
    prefetch."""

    def __init__(self, host: ConsumerHost, node: str, packet: Consume, queue: Queue) -> None:
        super().__init__(node, packet.origin, packet.consumer, packet.attach)
        self.host = host
        self.queue = queue
        self.ha_id = packet.queue
        self.tag = f"{packet.origin}/{packet.consumer}"
        self.no_ack = packet.no_ack
        self.exclusive = packet.exclusive
        self.prefetch = packet.prefetch
        self.cancelled = False
        self.pending: list[list[Any]] = []  # deliveries of this loop turn
        self.outstanding = 0  # a no-ack consumer's deliveries not granted back (``Credit``)

    def can_take(self) -> bool:
        if self.cancelled or not self.host.serving():
            return False
        if self.host.unsafe.credit_ignored:
            return True
        if self.no_ack:
            return self.outstanding < NO_ACK_CREDIT
        if not self.prefetch:
            return True
        return len(self.held) < self.prefetch

    def deliver(self, queue: Queue, entry: Entry) -> None:
        if self.no_ack:
            self.outstanding += 1
        else:
            self.held[(self.ha_id, entry.position)] = (queue, entry)
        self.pending.append(wire_delivery(entry))
        self.host.wants_flush(self)

    def cancelled_by_server(self, queue: Queue) -> None:
        self.cancelled = True
        self.held.clear()  # the queue is gone, and what it held with it
        self.host.consumer_gone(self, CANCELLED, f"queue {self.ha_id} deleted")


@dataclass
class Handed:
    """Entries a consumer's node handed to transaction ``gtxid``'s branch: put in ``branch``
    (the branch's rules' ``held``, which its prepare takes them from) and released -- those
    still there requeued -- when the transaction is decided here, the link to ``node`` is
    lost, or the role ends."""

    node: str
    branch: dict[BranchKey, Entry]
    entries: list[tuple[BranchKey, Queue, Entry]] = field(default_factory=list)


class ConsumerHost:
    """A group primary's remote consumers, for one epoch of its role."""

    def __init__(self, group: int, epoch: int, queues: QueueLookup, *,
                 serving: Callable[[], bool] = lambda: True,
                 soon: Callable[[], None] = lambda: None, unsafe: Unsafe = Unsafe(),
                 part_bytes: int = PART_BYTES, max_bytes: int = MAX_BYTES,
                 branches: Callable[[], dict[BranchKey, Entry] | None] = lambda: None) -> None:
        """``serving``: whether the group's member serves now (its term and lease: a host
        whose role lapsed hands out nothing); ``soon``: schedule ``flush`` at the end of
        this loop turn (called once per turn that has something to send); ``branches``:
        where this group's transaction branches (of this epoch) take handed entries from
        (None: no branch here, a hand-over is requeued at once)."""
        self.group = group
        self.part_bytes = part_bytes
        self.max_bytes = max_bytes
        self.epoch = epoch
        self.queues = queues
        self.serving = serving
        self.soon = soon
        self.unsafe = unsafe
        self.holders: dict[tuple[str, int], Holder] = {}  # (origin, consumer)
        self.outbox: list[Effect] = []
        self._flushing: dict[int, RemoteConsumer] = {}
        self._scheduled = False
        self.branches = branches
        self.handed: dict[str, Handed] = {}  # gtxid -> what was handed to its branch
        self.stats = HostStats()

    # -- inputs -------------------------------------------------------------------------------

    def receive(self, src: str, packet: Packet) -> list[Effect]:
        """A packet from node ``src`` (this node: from its own proxy)."""
        if isinstance(packet, Consume):
            self._consume(src, packet)
        elif isinstance(packet, Settle):
            self._settle(packet)
        elif isinstance(packet, Cancel):
            self._cancel(packet)
        elif isinstance(packet, Get):
            self._get(src, packet)
        elif isinstance(packet, Credit):
            self._credit(packet)
        return self._take_outbox()

    def flush(self) -> list[Effect]:
        """The end of a loop turn: each consumer's deliveries as one ``Deliver``."""
        self._scheduled = False
        flushing, self._flushing = self._flushing, {}
        for rc in flushing.values():
            if rc.pending:
                self.stats.delivered += len(rc.pending)
                self._deliver(rc.node, rc.origin, rc.consumer, rc.attach, rc.pending)
                rc.pending = []
        return self._take_outbox()

    def _deliver(self, node: str, origin: str, consumer: int, attach: int,
                 pending: list[list[Any]]) -> None:
        """``pending`` as Delivers of at most ``max_bytes`` of headers and bodies (a bigger
        delivery alone), a body over ``part_bytes`` in ``DeliverPart``s before its own."""
        at = 0
        while at < len(pending):
            take: list[list[Any]] = []
            size = 0
            for raw in pending[at:]:
                body = len(raw[5])
                if body > self.part_bytes:
                    if not take:
                        self._parts(node, origin, consumer, attach, raw)
                        take.append(in_parts(raw))
                    break
                size += len(raw[4]) + body
                if take and size > self.max_bytes:
                    break
                take.append(raw)
            at += len(take)
            self.outbox.append(SendTo(node, Deliver(self.group, self.epoch, origin, consumer,
                                                    attach, take)))

    def _parts(self, node: str, origin: str, consumer: int, attach: int,
               raw: list[Any]) -> None:
        body: bytes = raw[5]
        step = self.part_bytes
        self.stats.parts += (len(body) + step - 1) // step
        for offset in range(0, len(body), step):
            self.outbox.append(SendTo(node, DeliverPart(
                self.group, self.epoch, origin, consumer, attach, int(raw[0]), len(body),
                offset, body[offset:offset + step])))

    def link_lost(self, node: str) -> list[Effect]:
        """The link to ``node`` went down (or the node died): what its consumers held comes
        back, as a closed connection's does."""
        for key, holder in list(self.holders.items()):
            if holder.node == node:
                del self.holders[key]
                self._detach(holder, requeue=not self.unsafe.no_requeue_on_link_loss)
        # its transactions' coordinator may be gone: what no branch took comes back (a
        # prepare arriving later finds it no longer held, a no)
        self.release_handed(lambda gtxid, handed: handed.node == node)
        return self._take_outbox()

    def release_handed(self, done: Callable[[str, Handed], bool]) -> None:
        """Requeue the entries handed to the branches of the transactions ``done`` says are
        over here (decided, or their coordinator's link lost) that no branch took; forget
        those every entry of which a branch took."""
        queues: dict[int, Queue] = {}
        for gtxid, handed in list(self.handed.items()):
            over = done(gtxid, handed)
            left = [(key, queue, entry) for key, queue, entry in handed.entries
                    if handed.branch.get(key) is entry]
            if not over and left:
                continue
            del self.handed[gtxid]
            for key, queue, entry in reversed(left):
                del handed.branch[key]
                if not queue.deleted:
                    queue.requeue(entry)
                    queues[id(queue)] = queue
                self.stats.handed_back += 1
        for queue in queues.values():
            if queue.consumers and queue.message_count:
                queue.dispatch()

    def redispatch(self) -> None:
        """The queues of its consumers offer again what they hold (the shell's tick: a
        member that stopped serving for a while, its lease lapsed, and serves again hands
        out nothing until an enqueue or a settle would dispatch)."""
        queues = {id(h.queue): h.queue for h in self.holders.values()
                  if isinstance(h, RemoteConsumer) and not h.cancelled}
        for queue in queues.values():
            if queue.message_count:
                queue.dispatch()

    def stop(self) -> None:
        """The role ended: every consumer detached, what they held requeued (as the
        connections a demotion closes)."""
        holders, self.holders = list(self.holders.values()), {}
        for holder in holders:
            self._detach(holder, requeue=True)
        self.release_handed(lambda gtxid, handed: True)
        self.outbox.clear()
        self._flushing.clear()

    def held(self) -> int:
        return sum(len(h.held) for h in self.holders.values())

    # -- the packets ----------------------------------------------------------------------------

    def _consume(self, src: str, packet: Consume) -> None:
        key = (packet.origin, packet.consumer)
        old = self.holders.get(key)
        if old is not None and old.attach >= packet.attach:
            self.stats.stale += 1
            return
        if packet.epoch != self.epoch:
            self._refuse(src, packet.origin, packet.consumer, packet.attach,
                         ErrorCode.NOT_PRIMARY,
                         f"not the primary of group {self.group} in epoch {packet.epoch}")
            return
        if old is not None:
            del self.holders[key]
            self._detach(old, requeue=True)
        queue = self.queues.queue(packet.vhost, packet.queue)
        if queue is None:
            self._refuse(src, packet.origin, packet.consumer, packet.attach, NOT_FOUND,
                         f"no queue {packet.queue} in vhost {packet.vhost} in group "
                         f"{self.group}")
            return
        self._mark_redelivered(queue, packet.redelivered)
        rc = RemoteConsumer(self, src, packet, queue)
        try:
            queue.check_consumer(rc.exclusive)
        except AccessRefused as exc:
            self._refuse(src, packet.origin, packet.consumer, packet.attach, ACCESS_REFUSED,
                         exc.reply_text)
            return
        self.holders[key] = rc
        self.stats.attached += 1
        # before anything the queue hands it (its Delivers go at the turn's flush)
        self.outbox.append(SendTo(src, Attached(self.group, packet.origin, packet.consumer,
                                                packet.attach)))
        queue.add_consumer(rc)

    def _mark_redelivered(self, queue: Queue, positions: Sequence[int]) -> None:
        """Delivered by an earlier primary and not settled: the flag the client must see
        (a walk of the ready entries, at a re-attach only)."""
        wanted = set(positions)
        if not wanted:
            return
        for entry in queue.ready:
            if entry.position in wanted:
                entry.redelivered = True
                self.stats.marked += 1
                wanted.discard(entry.position)
                if not wanted:
                    break

    def _current(self, origin: str, consumer: int, attach: int, epoch: int) -> Holder | None:
        holder = self.holders.get((origin, consumer))
        if holder is None or holder.attach != attach or epoch != self.epoch:
            self.stats.stale += 1
            return None
        return holder

    def _settle(self, packet: Settle) -> None:
        holder = self._current(packet.origin, packet.consumer, packet.attach, packet.epoch)
        if holder is None:
            return
        hand = handed_how(packet.how)
        if hand is not None:
            self._hand_over(holder, packet, hand[1])
            return
        if packet.how not in (ACK, REQUEUE, REJECT):
            return
        done: list[int] = []
        queues: dict[int, Queue] = {}
        for position in packet.positions:
            held = holder.held.pop((packet.queue, position), None)
            if held is None:
                continue
            queue, entry = held
            queues[id(queue)] = queue
            if packet.how == REQUEUE:
                queue.requeue(entry)
                self.stats.requeued += 1
                continue
            if packet.how == REJECT:
                queue.reject(entry)
            else:
                queue.settle(entry)
            self.stats.settled += 1
            done.append(position)
        if isinstance(holder, RemoteConsumer) and holder.cancelled and not holder.held:
            self.holders.pop((holder.origin, holder.consumer), None)
        if done:
            answer = SendTo(holder.node, Settled(self.group, self.epoch, holder.origin,
                                                 holder.consumer, packet.vhost, packet.queue,
                                                 done))
            self.outbox.append(answer if self.unsafe.ack_before_durable
                               else SendWhenDurable(self.group, answer))
        for queue in queues.values():
            if queue.consumers and queue.message_count:
                queue.dispatch()

    def _hand_over(self, holder: Holder, packet: Settle, gtxid: str) -> None:
        """The client's channel acknowledged (rejected) these positions in a transaction
        across partitions: they leave the consumer's hold for the transaction's branch here,
        which takes them at its prepare (by name and position) and settles them at its
        commit (requeues them at its rollback); no branch of this epoch: requeued at once.
        Only entries of the queue as it is now are handed (a queue declared again since:
        left held, the branch's prepare misses them, a no)."""
        branch = self.branches()
        handed = self.handed.get(gtxid)
        if branch is not None and handed is None:
            handed = self.handed[gtxid] = Handed(holder.node, branch)
        queues: dict[int, Queue] = {}
        for position in packet.positions:
            held = holder.held.get((packet.queue, position))
            if held is None:
                continue
            queue, entry = held
            current = self.queues.queue(packet.vhost, packet.queue)
            if current is not queue:
                continue
            if not self.unsafe.hand_over_kept:
                del holder.held[(packet.queue, position)]
            queues[id(queue)] = queue
            if handed is None:  # no branch here: as a nack with requeue
                queue.requeue(entry)
                self.stats.handed_back += 1
                continue
            key = (queue.vhost, queue.name, position)
            handed.branch[key] = entry
            handed.entries.append((key, queue, entry))
            self.stats.handed += 1
        if isinstance(holder, RemoteConsumer) and holder.cancelled and not holder.held:
            self.holders.pop((holder.origin, holder.consumer), None)
        for queue in queues.values():  # the consumer's credit came back
            if queue.consumers and queue.message_count:
                queue.dispatch()

    def _credit(self, packet: Credit) -> None:
        holder = self._current(packet.origin, packet.consumer, packet.attach, packet.epoch)
        if not isinstance(holder, RemoteConsumer):
            return
        holder.prefetch = max(0, int(packet.prefetch))
        holder.outstanding = max(0, holder.outstanding - max(0, int(packet.granted)))
        queue = holder.queue
        if not holder.cancelled and queue.consumers and queue.message_count:
            queue.dispatch()

    def _cancel(self, packet: Cancel) -> None:
        holder = self._current(packet.origin, packet.consumer, packet.attach, packet.epoch)
        if holder is None:
            return
        if packet.release or not holder.held:
            del self.holders[(holder.origin, holder.consumer)]
            self._detach(holder, requeue=True)
        elif isinstance(holder, RemoteConsumer):
            holder.cancelled = True
            holder.queue.remove_consumer(holder)

    def _get(self, src: str, packet: Get) -> None:
        def reply(delivery: list[Any], code: str = "", count: int = 0) -> None:
            self.outbox.append(SendTo(src, GetReply(self.group, packet.origin, packet.request,
                                                    delivery, code, count)))

        if packet.epoch != self.epoch or not self.serving():
            reply([], ErrorCode.NOT_PRIMARY)
            return
        key = (packet.origin, GETTER)
        holder = self.holders.get(key)
        if holder is not None and holder.attach > packet.attach:
            self.stats.stale += 1
            reply([], UNAVAILABLE)
            return
        if holder is None or holder.attach < packet.attach:
            if holder is not None:
                self._detach(holder, requeue=True)
            holder = self.holders[key] = Holder(src, packet.origin, GETTER, packet.attach)
        queue = self.queues.queue(packet.vhost, packet.queue)
        if queue is None:
            reply([], NOT_FOUND)
            return
        entry = queue.get()
        if entry is None:
            reply([])
            return
        self.stats.gets += 1
        if packet.no_ack:
            queue.settle(entry)
        else:
            holder.held[(packet.queue, entry.position)] = (queue, entry)
        raw = wire_delivery(entry)
        if len(raw[5]) > self.part_bytes:
            self._parts(src, packet.origin, GETTER, packet.attach, raw)
            raw = in_parts(raw)
        reply(raw, count=queue.message_count)  # what is left ready, as a local get-ok says

    # -- steps ----------------------------------------------------------------------------------

    def wants_flush(self, rc: RemoteConsumer) -> None:
        self._flushing[id(rc)] = rc
        if not self._scheduled:
            self._scheduled = True
            self.soon()

    def consumer_gone(self, rc: RemoteConsumer, code: str, text: str) -> None:
        self.holders.pop((rc.origin, rc.consumer), None)
        self._refuse(rc.node, rc.origin, rc.consumer, rc.attach, code, text)
        if not self._scheduled:
            self._scheduled = True
            self.soon()

    def _refuse(self, node: str, origin: str, consumer: int, attach: int, code: str,
                text: str) -> None:
        self.outbox.append(SendTo(node, ConsumeError(self.group, origin, consumer, attach, code,
                                                     text)))

    def _detach(self, holder: Holder, *, requeue: bool) -> None:
        """The holder goes: off its queue, what it held requeued (last position first, as a
        channel's release) or, unsafe, forgotten."""
        if isinstance(holder, RemoteConsumer):
            holder.cancelled = True
            holder.pending = []
            self._flushing.pop(id(holder), None)
            holder.queue.remove_consumer(holder)
        held = sorted(holder.held.values(), key=lambda h: h[1].position, reverse=True)
        holder.held.clear()
        if not requeue:
            return
        queues: dict[int, Queue] = {}
        for queue, entry in held:
            queue.requeue(entry)
            queues[id(queue)] = queue
        self.stats.released += len(held)
        for queue in queues.values():
            if queue.consumers and queue.message_count:
                queue.dispatch()

    def _take_outbox(self) -> list[Effect]:
        out, self.outbox = self.outbox, []
        return out


# -- the client's node's side ------------------------------------------------------------------


@dataclass
class Subscription:
    """A channel's consumer of a remote queue: where it is attached, what it holds."""

    consumer: int
    group: int
    vhost: str
    queue: str
    prefetch: int
    no_ack: bool
    exclusive: bool
    attach: int = 0
    node: str | None = None  # attached to (None: waiting for a leader)
    epoch: int = -1
    cancelled: bool = False  # basic.cancel: no more deliveries, held ones may be settled
    held: dict[int, int] = field(default_factory=dict)  # position -> attach it came in
    answered: bool = False  # a leader took it (``Attached``): the consume-ok was given


@dataclass
class GetLane:
    """basic.get to one group: the attachment its held messages belong to."""

    attach: int = 1
    node: str | None = None
    epoch: int = -1


@dataclass
class ProxyStats:
    attaches: int = 0      # Consume sent
    reattaches: int = 0    # ... to a new leader, or the same after a lost link
    delivered: int = 0     # messages handed to channels
    stale_deliveries: int = 0  # messages of an earlier attachment, dropped
    stale_settles: int = 0     # settles of a delivery of an earlier attachment, dropped
    returned: int = 0      # delivered after a basic.cancel: sent back to the queue
    settles: int = 0       # positions sent in Settle packets
    gets: int = 0          # Get sent
    gets_failed: int = 0   # answered unavailable (no leader, or lost)
    refused: int = 0       # ConsumeError taken
    parts: int = 0         # DeliverParts taken (large bodies) ...
    parts_lost: int = 0    # ... or not following the part before: that body dropped
    incomplete: int = 0    # deliveries whose body in parts was not whole: sent back (requeue)
    handed: int = 0        # positions handed to a transaction's branch (tx.commit)


class ConsumerProxy:
    """A node's remote consumers and gets, for one origin (this start)."""

    def __init__(self, origin: str, *, unsafe: Unsafe = Unsafe()) -> None:
        self.origin = origin
        self.unsafe = unsafe
        self.leaders: dict[int, tuple[str, int]] = {}  # group -> (node, epoch)
        self.subs: dict[int, Subscription] = {}
        self.lanes: dict[int, GetLane] = {}
        self.gets: dict[int, tuple[int, str, str, str]] = {}  # request -> group, node, vhost, queue
        self.settles: dict[tuple[int, int, str, str, str], list[int]] = {}
        # a body in parts per (node, group, consumer): its parts, then its Deliver or GetReply
        self.partial: dict[tuple[str, int, int], Partial] = {}
        self._next = 1
        self.stats = ProxyStats()

    # -- the channel's calls ----------------------------------------------------------------

    def consume(self, group: int, vhost: str, queue: str, prefetch: int, *,
                no_ack: bool = False, exclusive: bool = False) -> tuple[int, list[Effect]]:
        """basic.consume on ``queue`` (x-ha-id) of ``group``: the consumer's id, and the
        ``Consume`` if the group's leader is known (else at its notice)."""
        consumer = self._next
        self._next += 1
        sub = self.subs[consumer] = Subscription(consumer, group, vhost, queue, prefetch,
                                                 no_ack, exclusive)
        return consumer, self._attach(sub)

    def cancel(self, consumer: int) -> list[Effect]:
        """basic.cancel: no more deliveries; what it holds may still be settled. The
        consumer is kept until its channel closes: a delivery already on its way when the
        host took the cancel is sent back (a ``requeue`` settle), not left held there."""
        sub = self.subs.get(consumer)
        if sub is None or sub.cancelled:
            return []
        sub.cancelled = True
        return self._to_leader(sub, release=False)

    def close(self, consumer: int) -> list[Effect]:
        """The consumer's channel closed: what it holds goes back to the queue."""
        sub = self.subs.pop(consumer, None)
        return [] if sub is None else self._to_leader(sub, release=True)

    def settle(self, deliveries: Iterable[RemoteDelivery], how: str) -> None:
        """basic.ack (``ACK``), nack/reject with requeue (``REQUEUE``) or without
        (``REJECT``) of deliveries the channel held; sent at ``flush``. One of an earlier
        attachment is dropped: the message comes again, or came already."""
        for d in deliveries:
            if d.consumer == GETTER:
                lane = self.lanes.get(d.group)
                current = lane is not None and lane.attach == d.attach and \
                    lane.epoch == d.epoch and lane.node is not None
            else:
                sub = self.subs.get(d.consumer)
                current = sub is not None and sub.attach == d.attach and \
                    sub.epoch == d.epoch and sub.node is not None
                # a settle that cannot reach the primary that delivered it (detached, or of
                # an earlier attachment) keeps its position named at the next attach: that
                # message comes again flagged redelivered; so does an ack or reject until
                # answered Settled (a primary killed before it made the ack durable)
                if current and how == REQUEUE and sub is not None and \
                        sub.held.get(d.position) == d.attach:
                    del sub.held[d.position]
            if not current:
                self.stats.stale_settles += 1
                continue
            key = (d.group, d.consumer, d.vhost, d.queue, how)
            self.settles.setdefault(key, []).append(d.position)

    def get(self, group: int, vhost: str, queue: str, *,
            no_ack: bool = False) -> tuple[int, list[Effect]]:
        """basic.get: the request's id; its ``GetAnswer`` comes (at once if no leader is
        known)."""
        request = self._next
        self._next += 1
        leader = self.leaders.get(group)
        if leader is None:
            self.stats.gets_failed += 1
            return request, [GetAnswer(request, None, UNAVAILABLE)]
        lane = self.lanes.setdefault(group, GetLane())
        if (lane.node, lane.epoch) != leader:
            lane.attach += 1
            lane.node, lane.epoch = leader
        self.gets[request] = (group, leader[0], vhost, queue)
        self.stats.gets += 1
        return request, [SendTo(leader[0], Get(group, leader[1], self.origin, request,
                                               lane.attach, vhost, queue, no_ack))]

    def credit(self, consumer: int, prefetch: int, granted: int = 0) -> list[Effect]:
        """The consumer's credit changed: its ``prefetch`` (kept for the next attach too)
        and, for a no-ack consumer, ``granted`` deliveries written to its client."""
        sub = self.subs.get(consumer)
        if sub is None:
            return []
        sub.prefetch = prefetch
        if sub.node is None or sub.cancelled:
            return []  # the next Consume carries the prefetch, and a fresh window
        return [SendTo(sub.node, Credit(sub.group, sub.epoch, self.origin, consumer,
                                        sub.attach, prefetch, granted))]

    def hand_over(self, deliveries: Iterable[RemoteDelivery], how: str,
                  gtxid: str) -> list[Effect]:
        """The channel's tx.commit across partitions acknowledged (``ACK``) or rejected
        (``REQUEUE``, ``REJECT``) these deliveries: one ``Settle`` per consumer and queue
        handing them to transaction ``gtxid``'s branch on the primary that delivered them,
        sent now -- before the coordinator's prepares, on the same link -- not at
        ``flush``. A delivery of an earlier attachment is not handed (its message comes
        again, flagged; the branch's prepare misses it: a no). The positions stay named
        for the next attach until ``handed_answered`` says the commit took them."""
        by: dict[tuple[int, int, str, str], list[int]] = {}
        at: dict[tuple[int, int, str, str], tuple[str, int, int]] = {}
        for d in deliveries:
            target = self._current_of(d)
            if target is None:
                self.stats.stale_settles += 1
                continue
            key = (d.group, d.consumer, d.vhost, d.queue)
            by.setdefault(key, []).append(d.position)
            at[key] = target
            if self.unsafe.hand_over_forgotten and d.consumer != GETTER:
                sub = self.subs.get(d.consumer)
                if sub is not None:
                    sub.held.pop(d.position, None)
        out: list[Effect] = []
        for (group, consumer, vhost, queue), positions in by.items():
            node, epoch, attach = at[(group, consumer, vhost, queue)]
            self.stats.handed += len(positions)
            out.append(SendTo(node, Settle(group, epoch, self.origin, consumer, attach, vhost,
                                           queue, positions, hand_how(how, gtxid))))
        return out

    def handed_answered(self, deliveries: Iterable[RemoteDelivery], committed: bool) -> None:
        """The transaction the deliveries were handed to is answered: committed, its
        branches settled them durably (no primary delivers them again); otherwise they
        come again and stay named (flagged at a re-attach)."""
        if not committed:
            return
        for d in deliveries:
            sub = self.subs.get(d.consumer) if d.consumer != GETTER else None
            if sub is not None and sub.held.get(d.position) == d.attach:
                del sub.held[d.position]

    def _current_of(self, d: RemoteDelivery) -> tuple[str, int, int] | None:
        """Where a delivery's settle goes (node, epoch, attach): None if not of the
        current attachment."""
        if d.consumer == GETTER:
            lane = self.lanes.get(d.group)
            if lane is None or lane.node is None or (lane.attach, lane.epoch) != \
                    (d.attach, d.epoch):
                return None
            return lane.node, lane.epoch, lane.attach
        sub = self.subs.get(d.consumer)
        if sub is None or sub.node is None or (sub.attach, sub.epoch) != (d.attach, d.epoch):
            return None
        return sub.node, sub.epoch, sub.attach

    @property
    def pending(self) -> bool:
        """Settles wait for ``flush`` (the shell flushes at the end of such a turn)."""
        return bool(self.settles)

    def flush(self) -> list[Effect]:
        """The end of a loop turn: the settles as one ``Settle`` per consumer, queue, how."""
        out: list[Effect] = []
        settles, self.settles = self.settles, {}
        for (group, consumer, vhost, queue, how), positions in settles.items():
            if consumer == GETTER:
                lane = self.lanes.get(group)
                if lane is None or lane.node is None:
                    continue
                node, epoch, attach = lane.node, lane.epoch, lane.attach
            else:
                sub = self.subs.get(consumer)
                if sub is None:  # closed since: the close requeues it all
                    continue
                if sub.node is None:
                    continue
                node, epoch, attach = sub.node, sub.epoch, sub.attach
            self.stats.settles += len(positions)
            out.append(SendTo(node, Settle(group, epoch, self.origin, consumer, attach, vhost,
                                           queue, positions, how)))
        return out

    # -- the cluster's inputs -----------------------------------------------------------------

    def leader(self, notice: LeaderNotice) -> list[Effect]:
        """A ``LeaderNotice`` (``forward.py``'s): the group's consumers attach to a new
        leader, or again to the same after a lost link or an error."""
        known = self.leaders.get(notice.group)
        if known is not None and notice.epoch < known[1]:
            return []
        self.leaders[notice.group] = (notice.node, notice.epoch)
        out: list[Effect] = []
        for sub in self.subs.values():
            if sub.group == notice.group and not sub.cancelled and \
                    (sub.node, sub.epoch) != (notice.node, notice.epoch):
                out += self._attach(sub)
        lane = self.lanes.get(notice.group)
        if lane is not None and (lane.node, lane.epoch) != (notice.node, notice.epoch):
            lane.node, lane.epoch = None, -1
            out += self._fail_gets(lambda g, n: g == notice.group)
        return out

    def link_lost(self, node: str) -> list[Effect]:
        """The link to ``node`` went down: its host requeued what we held there; attach
        again at the next notice."""
        for group, (leader, _) in list(self.leaders.items()):
            if leader == node:
                del self.leaders[group]
        for sub in self.subs.values():
            if sub.node == node:
                sub.node, sub.epoch = None, -1
        for lane in self.lanes.values():
            if lane.node == node:
                lane.node, lane.epoch = None, -1
        return self._fail_gets(lambda g, n: n == node)

    def receive(self, src: str, packet: Packet) -> list[Effect]:
        if isinstance(packet, DeliverPart):
            self._part(src, packet)
            return []
        if isinstance(packet, Deliver):
            return self._delivered(src, packet)
        if isinstance(packet, GetReply):
            return self._got(src, packet)
        if isinstance(packet, ConsumeError):
            return self._refused(src, packet)
        if isinstance(packet, Attached):
            sub = self.subs.get(packet.consumer)
            if sub is None or (sub.node, sub.attach) != (src, packet.attach):
                return []
            return self._answered(sub)
        if isinstance(packet, Settled):
            sub = self.subs.get(packet.consumer)
            if sub is not None:  # durable: no primary of its epoch or later delivers it again
                for position in packet.positions:
                    sub.held.pop(position, None)
            return [SettleAnswered(packet.group, packet.epoch, packet.consumer, packet.vhost,
                                   packet.queue, tuple(packet.positions))]
        return []

    # -- steps ----------------------------------------------------------------------------------

    def _attach(self, sub: Subscription) -> list[Effect]:
        leader = self.leaders.get(sub.group)
        if leader is None:
            sub.node, sub.epoch = None, -1
            return []
        if sub.attach:
            self.stats.reattaches += 1
        sub.attach += 1
        sub.node, sub.epoch = leader
        self.stats.attaches += 1
        return [SendTo(sub.node, Consume(sub.group, sub.epoch, self.origin, sub.consumer,
                                         sub.attach, sub.vhost, sub.queue, sub.prefetch,
                                         sub.no_ack, sub.exclusive,
                                         [] if self.unsafe.no_redelivered_mark
                                         else sorted(sub.held)))]

    def _to_leader(self, sub: Subscription, *, release: bool) -> list[Effect]:
        if sub.node is None:
            return []
        return [SendTo(sub.node, Cancel(sub.group, sub.epoch, self.origin, sub.consumer,
                                        sub.attach, release))]

    def _part(self, src: str, packet: DeliverPart) -> None:
        key = (src, packet.group, packet.consumer)
        held = self.partial.get(key)
        if packet.offset == 0:  # a first part: what was held of another body is lost
            held = self.partial[key] = Partial(packet.position, packet.size)
        elif held is None or (held.position, held.size, held.have) != \
                (packet.position, packet.size, packet.offset):
            self.stats.parts_lost += 1
            self.partial.pop(key, None)
            return
        data = bytes(packet.data)
        held.chunks.append(data)
        held.have += len(data)
        self.stats.parts += 1

    def _whole(self, src: str, group: int, consumer: int,
               raw: Sequence[Any]) -> Sequence[Any] | None:
        """A delivery as it came, or with its body in parts put back together (None: not
        whole, a part lost)."""
        if len(raw) <= 6:
            return raw
        held = self.partial.pop((src, group, consumer), None)
        if held is None or held.position != int(raw[0]) or held.size != raw[6] or \
                held.have != held.size:
            self.stats.incomplete += 1
            return None
        return [*raw[:5], b"".join(held.chunks)]

    def _delivered(self, src: str, packet: Deliver) -> list[Effect]:
        sub = self.subs.get(packet.consumer)
        if sub is None or (sub.node, sub.epoch, sub.attach) != \
                (src, packet.epoch, packet.attach):
            self.stats.stale_deliveries += len(packet.deliveries)
            self.partial.pop((src, packet.group, packet.consumer), None)
            return []
        out: list[Effect] = self._answered(sub)  # (its Attached came first on the link)
        if sub.cancelled:  # sent before the host took the cancel: back to the queue
            self.stats.returned += len(packet.deliveries)
            self.partial.pop((src, packet.group, packet.consumer), None)
            if not sub.no_ack:
                key = (sub.group, sub.consumer, sub.vhost, sub.queue, REQUEUE)
                self.settles.setdefault(key, []).extend(int(d[0]) for d in packet.deliveries)
            return out
        for sent in packet.deliveries:
            raw = self._whole(src, sub.group, sub.consumer, sent)
            if raw is None:  # back to the queue: it comes again, flagged
                if not sub.no_ack:
                    key = (sub.group, sub.consumer, sub.vhost, sub.queue, REQUEUE)
                    self.settles.setdefault(key, []).append(int(sent[0]))
                continue
            d = self._delivery(sub.consumer, sub.group, packet.epoch, packet.attach, sub.vhost,
                               sub.queue, raw)
            if not sub.no_ack:
                sub.held[d.position] = packet.attach
            out.append(Delivered(d))
            self.stats.delivered += 1
        return out

    def _got(self, src: str, packet: GetReply) -> list[Effect]:
        raw: Sequence[Any] | None = packet.delivery
        if raw:
            raw = self._whole(src, packet.group, GETTER, raw)
        pending = self.gets.pop(packet.request, None)
        if pending is None:
            return []  # failed already (its leader lost)
        group, _, vhost, queue = pending
        lane = self.lanes.get(group)
        if packet.code or lane is None:
            self.stats.gets_failed += 1
            return [GetAnswer(packet.request, None, packet.code or UNAVAILABLE)]
        if not packet.delivery:
            return [GetAnswer(packet.request, None)]
        if raw is None:  # its body not whole: back to the queue (a no-ack get's is lost)
            self.stats.gets_failed += 1
            key = (group, GETTER, vhost, queue, REQUEUE)
            self.settles.setdefault(key, []).append(int(packet.delivery[0]))
            return [GetAnswer(packet.request, None, UNAVAILABLE)]
        d = self._delivery(GETTER, group, lane.epoch, lane.attach, vhost, queue, raw)
        return [GetAnswer(packet.request, d, message_count=int(packet.message_count))]

    def _refused(self, src: str, packet: ConsumeError) -> list[Effect]:
        sub = self.subs.get(packet.consumer)
        if sub is None or (sub.node, sub.attach) != (src, packet.attach):
            return []
        self.stats.refused += 1
        if packet.code == ErrorCode.NOT_PRIMARY:
            sub.node, sub.epoch = None, -1  # wait for the next notice
            if self.leaders.get(sub.group, ("", 0))[0] == src:
                del self.leaders[sub.group]
            return []
        del self.subs[packet.consumer]
        return [Cancelled(packet.consumer, packet.code, packet.message)]

    def _answered(self, sub: Subscription) -> list[Effect]:
        if sub.answered:
            return []
        sub.answered = True
        return [ConsumeAnswered(sub.consumer)]

    def _fail_gets(self, lost: Callable[[int, str], bool]) -> list[Effect]:
        out: list[Effect] = []
        for request, (group, node, _, _) in list(self.gets.items()):
            if lost(group, node):
                del self.gets[request]
                self.stats.gets_failed += 1
                out.append(GetAnswer(request, None, UNAVAILABLE))
        return out

    @staticmethod
    def _delivery(consumer: int, group: int, epoch: int, attach: int, vhost: str, queue: str,
                  raw: Sequence[Any]) -> RemoteDelivery:
        position, redelivered, exchange, routing_key, header, body = raw
        return RemoteDelivery(consumer, group, epoch, attach, vhost, queue, int(position),
                              bool(redelivered), str(exchange), str(routing_key),
                              bytes(header), bytes(body))
