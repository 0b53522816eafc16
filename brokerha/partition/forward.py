"""Publishes forwarded to partition primaries, and their confirms (docs/ha.md "Clients on
any node", issue 35 stage 3), sans-I/O.

A client may publish on any node of a partitioned cluster; the queues a
publish is routed to live in partitions whose primaries may be elsewhere.
Two state machines, with no sockets, no asyncio and no clock of their own
(each input carries ``now``):

- ``ForwardSender``, on the client's node: one *lane* per target group.
  Every message routed to a group's queues gets the lane's next ``fseq``
  (counted per **origin** -- the node and an id of this start of it, so a
  restart is a new origin -- and per group); once per loop turn
  (``flush``) each lane sends what it holds as one ``Forward(group, epoch,
  origin, first_fseq, meta_seq, messages)`` to the group's leader (as the
  last ``LeaderNotice`` named it). A publish is confirmed (``Confirm``) when
  every group it was routed to answered for it (``Forwarded``): an ack, or
  a nack if any of them refused it (a ``reject-publish`` queue). A group
  this node leads is no exception: its forwards go to the node's own
  receiver, in process, so a failover that makes the client's node the
  leader keeps every queue's order (what was forwarded before is resent
  ahead of what comes after). What is unanswered is sent again, in order,
  to a new leader at once; to the same one, what went ``retry`` seconds ago
  and is still unanswered (from the oldest, at most a window's worth), the
  delay doubled at each retry the leader leaves unanswered (up to
  ``retry_max``); a lane holds at most ``window`` messages unanswered
  (``holds``: the shell stops reading the connections that publish to it).
- ``ForwardReceiver``, on a group's primary, made for one epoch of its
  role: it applies no forward before its node's metadata copy reached the
  forward's ``meta_seq`` (``metadata_reached``; a queue declared on another
  node exists then), takes each origin's messages in ``fseq`` order and at
  most once -- the **mark** of an origin is the highest fseq applied and
  the refused ones among them -- and answers ``Forwarded(group, origin,
  upto_fseq, refused)`` only once everything it did so far is durable on
  the majority of the group's cells in its epoch (``WhenDurable``: the
  shell runs ``Broker.after_durable_in`` with the group's gate and
  barriers, which refuses it if the role or the lease is gone by then). A
  forward of another epoch, or to a node no longer leading, is answered
  ``ForwardError(group, origin, "not-primary", ...)``: the sender waits for
  the next ``LeaderNotice``.

How the marks survive a failover is the shell's: ``ForwardLog.apply`` must
write a batch's enqueues and its mark as one event of the group's log, so
that every cell holding the enqueues holds the mark (and no cell the mark
without them); a new primary's receiver starts from the marks its store
holds (``ForwardLog.marks``). ``partition/forward_apply.py`` does it over a
``Broker``: the batch is a local transaction named ``fw:<group>:...`` (its
``tc`` carries the enqueues, its outcome record the mark).

Packets are cluster ``Message``s (codes 23-26: "election and membership",
beside the mux's 20-22), fields wire types in wire order; each names its
group, so the mux does not wrap them. A forwarded message is
``[vhost, [x-ha-id, ...], exchange, routing_key, header, body]``: queues are
named by their incarnation's ``x-ha-id``, and one the receiver does not
hold (deleted since, or declared again) is left out, as a publish routed
to a queue deleted meanwhile.

**Another node's exclusive queue** (docs/ha.md "Exclusive queues on a partitioned
cluster"): it lives on its owner node alone, in no group, and other nodes route to it
by its stand-in (the default exchange). Its messages go the same way, in a lane per
owner node (``LaneKey``: the node's name, beside the groups' ints), as forwards of
group ``OWNER_GROUP`` naming their queues by name, to the owner's one receiver (epoch
0, marks in memory: the queues die with the node's start). Such a lane has no leader
notice: it is up while the link to the owner is (``owner_up``); when the link goes
(``owner_down``: the owner's node down or cut off) every publish it holds unanswered is
nacked and the lane is dropped -- its next one starts afresh under a new origin (a
``Lane.origin`` of its own, its fseqs from 1), so nothing waits on a queue that may
be gone -- and a publish to it while the link is down is nacked at once.

A large body travels in parts, as replication's ``bp`` events do
(``cluster/replication.py``): a message whose body is over ``PART_BYTES``
goes alone in its ``Forward``, its body sent before it as ``ForwardPart``
packets of at most that many bytes (``[..., header, b"", size]`` in the
``Forward``), so no packet comes near the link's ``MAX_PACKET`` (64 MiB)
whatever the broker's ``max_message_size``. The receiver holds one body in
parts per origin and puts it back together when the ``Forward`` comes; a
body not whole then (a part lost with a link) makes that forward a gap: the
sender's retry, or its resend to a new leader, sends the parts again, and a
part of a message at or below the origin's mark is dropped (applied already).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

# a batch's transaction name, its mark: fw:<group>:<upto>:<refused>:<origin> (the outcomes
# keep the newest per group and origin apart from the clients' records)
from brokerha.broker.tx_outcomes import MARK_PREFIX as MARK_PREFIX
from brokerha.cluster.messages import ErrorCode, Message, packet
from brokerha.seed_runner import UnsafeRules

WINDOW = 512  # messages a lane holds unanswered before it holds its publishers
BATCH = 256   # messages in one Forward at most
# headers and bodies in one Forward at most (a bigger message goes alone): a packet over
# the link's MAX_PACKET (64 MiB) would fail the link, every group's traffic with it
MAX_BYTES = 8 * 1024 * 1024
RETRY = 0.5   # unanswered forwards go again to the same leader after this long ...
RETRY_MAX = 8.0  # ... doubled at each retry the leader left unanswered, up to this
# a mark names the refused fseqs above its upto - REFUSED_KEPT only: a sender resends no fseq
# that far below one applied (what it holds unanswered is contiguous and at most its window,
# which must not exceed this)
REFUSED_KEPT = 4 * WINDOW
# a body over this goes as ForwardPart packets of this size before its Forward (replication's
# BODY_PART_BYTES): a 128 MiB message whole in one packet would pass the link's MAX_PACKET
PART_BYTES = 1 << 20
# a lane whose unanswered messages hold bodies in parts retries no sooner than they take at
# this rate (2 x 60 MiB took 12.8 s to confirm at load 22: a 0.5 s retry sent 488 parts
# for 122, every one a second copy of what the leader was still applying)
RETRY_BYTES_PER_SECOND = 8 << 20
# a Forward's group to its receiving node's own exclusive queues (in no group): the lane of
# an owner node (a ``LaneKey`` that is the node's name)
OWNER_GROUP = -1

LaneKey = int | str  # a partition group, or an owner node (its exclusive queues)
Key = TypeVar("Key", bound=LaneKey)  # (a publish's targets: groups only, or mixed)


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of forwarding to break on purpose (simulations only): each must be caught."""

    # the sender confirms a publish once its forwards went, not once every group answered
    confirm_on_send: bool = False
    # the receiver ignores the marks: what a sender resends after a failover is enqueued twice
    no_dedupe: bool = False
    # the receiver answers Forwarded once it applied the batch, not once it is durable on the
    # group's majority in its epoch
    answer_before_gate: bool = False


# -- packets ------------------------------------------------------------------------------


@packet(23)
class Forward(Message):
    """Sender -> a group's primary: ``messages`` are the origin's ``first_fseq``.. in order;
    apply none before this node's metadata copy reached ``meta_seq``."""

    group: int
    epoch: int
    origin: str
    first_fseq: int
    meta_seq: int
    messages: list[Any]  # [vhost, [x-ha-id, ...], exchange, routing_key, header, body] each

    @property
    def last_fseq(self) -> int:
        return self.first_fseq + len(self.messages) - 1


@packet(24)
class Forwarded(Message):
    """A group's primary -> the sender: the origin's messages up to ``upto_fseq`` are held by
    the majority of the group's cells, but the ``refused`` ones (nack them)."""

    group: int
    origin: str
    upto_fseq: int
    refused: list[int]


@packet(25)
class ForwardError(Message):
    """A forward not taken: ``code`` ``not-primary`` (another epoch, or not leading)."""

    group: int
    origin: str
    code: str
    message: str


@packet(26)
class LeaderNotice(Message):
    """``node`` leads ``group`` in ``epoch``: sent by a new group primary to every node, and
    on each link up for the groups it leads."""

    group: int
    epoch: int
    node: str


@packet(27)
class ForwardPart(Message):
    """Sender -> a group's primary: bytes ``offset``.. of the body (``size`` bytes in all) of
    the origin's message ``fseq``, whose ``Forward`` follows the last part."""

    group: int
    epoch: int
    origin: str
    fseq: int
    size: int
    offset: int
    data: bytes


Packet = Forward | Forwarded | ForwardError | LeaderNotice | ForwardPart


@dataclass(frozen=True)
class ForwardMessage:
    """One message as a lane forwards it: its queues in the group by ``x-ha-id`` (an owner
    lane's: by name)."""

    vhost: str
    queues: tuple[str, ...]
    exchange: str
    routing_key: str
    header: bytes
    body: bytes

    def as_wire(self) -> list[Any]:
        return [self.vhost, list(self.queues), self.exchange, self.routing_key, self.header,
                self.body]

    @staticmethod
    def in_parts(wire: list[Any]) -> list[Any]:
        """A message whose body goes in ``ForwardPart``s as its ``Forward`` names it: the
        body empty, its size after it."""
        return [*wire[:5], b"", len(wire[5])]

    @classmethod
    def from_wire(cls, raw: Sequence[Any]) -> ForwardMessage:
        vhost, queues, exchange, routing_key, header, body = raw
        return cls(str(vhost), tuple(str(q) for q in queues), str(exchange), str(routing_key),
                   bytes(header), bytes(body))


# -- effects ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToNode:
    """Put ``packet`` on the link to ``node`` (this node: to its own receiver, in process)."""

    node: str
    packet: Packet


@dataclass(frozen=True)
class WhenDurable:
    """Carry out ``send`` once everything done so far is durable on the group's majority in
    the receiver's epoch (``Broker.after_durable_in`` of the group's gate: never, if the
    role ends first)."""

    group: int
    send: ToNode


@dataclass(frozen=True)
class Confirm:
    """The publisher's answer for publish ``publish``: ``basic.ack``, or ``basic.nack``."""

    publish: int
    ack: bool


Effect = ToNode | WhenDurable | Confirm


# -- the marks ------------------------------------------------------------------------------


@dataclass
class Mark:
    """What a group holds of one origin: every fseq up to ``upto``, but ``refused``."""

    upto: int = 0
    refused: set[int] = field(default_factory=set)


def mark_name(group: int, origin: str, upto: int, refused: Iterable[int]) -> str:
    """The name a batch's record carries (the shell's transaction client id): the refused
    fseqs above ``upto - REFUSED_KEPT`` only (a resend never goes below)."""
    kept = sorted(f for f in refused if f > upto - REFUSED_KEPT)
    return f"{MARK_PREFIX}:{group}:{upto}:{','.join(map(str, kept))}:{origin}"


def marks_from(group: int, names: Iterable[str | None]) -> dict[str, Mark]:
    """The marks of ``group`` that the names of its batches' records say (a new primary's
    store: ``mark_name`` of every batch it holds)."""
    marks: dict[str, Mark] = {}
    head = f"{MARK_PREFIX}:{group}:"
    for name in names:
        if name is None or not name.startswith(head):
            continue
        upto, refused, origin = name[len(head):].split(":", 2)
        mark = marks.setdefault(origin, Mark())
        mark.upto = max(mark.upto, int(upto))
        mark.refused.update(int(f) for f in refused.split(",") if f)
    return marks


# -- the receiver ------------------------------------------------------------------------------


class ForwardLog(Protocol):
    """What a ``ForwardReceiver`` needs of its group's primary (``partition/forward_apply.py``
    over a ``Broker``)."""

    def apply(self, origin: str, upto: int,
              messages: Sequence[tuple[int, ForwardMessage]]) -> list[int]:
        """Enqueue ``messages`` (fseq, message; fseqs ascending, ``upto`` the last) on their
        queues and record the origin's new mark (``mark_name``: ``upto`` and the fseqs
        refused) in the same event of the group's log; the fseqs a queue refused. A queue
        not held (another ``x-ha-id``) is left out."""
        ...


@dataclass
class ReceiverStats:
    applied: int = 0     # messages applied
    deduped: int = 0     # messages dropped as at or below their origin's mark ...
    deduped_recovered: int = 0  # ... of which below a mark this primary found in its store
    gaps: int = 0        # forwards dropped: they begin above the mark + 1 (an earlier one lost)
    held: int = 0        # forwards that waited for this node's metadata copy
    refused: int = 0     # messages a queue refused
    not_primary: int = 0  # forwards answered ForwardError
    parts: int = 0       # ForwardParts taken ...
    parts_deduped: int = 0  # ... or dropped: their message is at or below the mark ...
    parts_lost: int = 0  # ... or not following the part before (one lost): the body dropped
    incomplete: int = 0  # forwards dropped: a body in parts not whole (the retry resends)


@dataclass
class Partial:
    """A body in parts of an origin's message ``fseq``: what came so far."""

    fseq: int
    size: int
    chunks: list[bytes] = field(default_factory=list)
    have: int = 0


class ForwardReceiver:
    """A group primary's side, for one epoch of its role: made when it serves, dropped when
    it stops (what it holds in memory a new primary rebuilds from its store)."""

    def __init__(self, group: int, epoch: int, log: ForwardLog, *,
                 marks: Mapping[str, Mark] | None = None, meta_seq: int = 0,
                 unsafe: Unsafe = Unsafe()) -> None:
        self.group = group
        self.epoch = epoch
        self.log = log
        self.marks: dict[str, Mark] = {o: Mark(m.upto, set(m.refused))
                                       for o, m in (marks or {}).items()}
        self.recovered = {o: m.upto for o, m in self.marks.items()}  # (statistics)
        self.meta_seq = meta_seq
        self.unsafe = unsafe
        self.waiting: list[tuple[str, Forward]] = []  # (sender, forward) until meta_seq
        # per origin, the body in parts of its next message in parts (one at a time: the
        # sender sends each one's parts then its Forward, in order on the link)
        self.partial: dict[str, Partial] = {}
        self.stats = ReceiverStats()

    def part(self, sender: str, part: ForwardPart) -> list[Effect]:
        """A part of a large body: held until its ``Forward`` (nothing to answer)."""
        if part.group != self.group or part.epoch != self.epoch:
            return []  # its Forward is answered not-primary
        mark = self.marks.get(part.origin)
        if mark is not None and part.fseq <= mark.upto and not self.unsafe.no_dedupe:
            self.stats.parts_deduped += 1  # a resend of a message applied: not held again
            self.partial.pop(part.origin, None)
            return []
        held = self.partial.get(part.origin)
        if part.offset == 0:  # a first part: what was held of another body is lost
            held = self.partial[part.origin] = Partial(part.fseq, part.size)
        elif held is None or (held.fseq, held.size, held.have) != \
                (part.fseq, part.size, part.offset):
            self.stats.parts_lost += 1  # one before it lost: the body is not whole
            self.partial.pop(part.origin, None)
            return []
        data = bytes(part.data)
        held.chunks.append(data)
        held.have += len(data)
        self.stats.parts += 1
        return []

    def _assembled(self, forward: Forward) -> Forward | None:
        """``forward`` with its bodies in parts put back together (each message in parts
        is alone in its Forward); cut before one not whole (None: nothing left)."""
        if not any(len(raw) > 6 for raw in forward.messages):
            return forward
        mark = self.marks.get(forward.origin)
        upto = -1 if mark is None or self.unsafe.no_dedupe else mark.upto
        messages: list[Any] = []
        for i, raw in enumerate(forward.messages):
            fseq = forward.first_fseq + i
            if len(raw) > 6 and fseq > upto:  # (one at or below the mark is skipped)
                held = self.partial.get(forward.origin)
                if held is None or held.fseq != fseq or held.have != held.size or \
                        held.size != raw[6]:
                    self.stats.incomplete += 1
                    break
                del self.partial[forward.origin]
                raw = [*raw[:5], b"".join(held.chunks)]
            messages.append(raw[:6])
        if not messages:
            return None
        return Forward(forward.group, forward.epoch, forward.origin, forward.first_fseq,
                       forward.meta_seq, messages)

    def receive(self, sender: str, forward: Forward) -> list[Effect]:
        if forward.group != self.group or forward.epoch != self.epoch:
            self.stats.not_primary += 1
            return [self.not_primary(sender, forward)]
        whole = self._assembled(forward)
        if whole is None:  # as a gap: the sender sends the parts again
            return []
        forward = whole
        if forward.meta_seq > self.meta_seq:
            self.stats.held += 1
            self.waiting.append((sender, forward))
            return []
        return self._apply(sender, forward)

    def not_primary(self, sender: str, forward: Forward) -> ToNode:
        return ToNode(sender, ForwardError(forward.group, forward.origin, ErrorCode.NOT_PRIMARY,
                                           f"not the primary of group {forward.group} in epoch "
                                           f"{forward.epoch}"))

    def metadata_reached(self, seq: int) -> list[Effect]:
        """This node's metadata copy reached ``seq``: the forwards that waited for it."""
        self.meta_seq = max(self.meta_seq, seq)
        ready = [(s, f) for s, f in self.waiting if f.meta_seq <= self.meta_seq]
        self.waiting = [(s, f) for s, f in self.waiting if f.meta_seq > self.meta_seq]
        out: list[Effect] = []
        for sender, forward in ready:
            out += self._apply(sender, forward)
        return out

    def _apply(self, sender: str, forward: Forward) -> list[Effect]:
        mark = self.marks.setdefault(forward.origin, Mark())
        if forward.first_fseq > mark.upto + 1:
            self.stats.gaps += 1  # an earlier forward was lost: the sender's retry resends it
            return []
        skip = 0  # the messages at or below the mark: applied already
        if not self.unsafe.no_dedupe:
            skip = min(len(forward.messages), mark.upto + 1 - forward.first_fseq)
            recovered = self.recovered.get(forward.origin, 0)
            self.stats.deduped += skip
            self.stats.deduped_recovered += max(0, min(skip, recovered + 1 - forward.first_fseq))
        fresh = [(forward.first_fseq + i, ForwardMessage.from_wire(forward.messages[i]))
                 for i in range(skip, len(forward.messages))]
        if fresh:
            upto = max(mark.upto, fresh[-1][0])
            refused = self.log.apply(forward.origin, upto, fresh)
            self.stats.applied += len(fresh)
            self.stats.refused += len(refused)
            mark.upto = upto
            mark.refused.update(refused)
            if mark.refused:  # below upto - REFUSED_KEPT no resend comes (nor in the mark)
                mark.refused = {f for f in mark.refused if f > upto - REFUSED_KEPT}
        answer = ToNode(sender, Forwarded(
            self.group, forward.origin, min(mark.upto, forward.last_fseq),
            sorted(f for f in mark.refused if forward.first_fseq <= f <= forward.last_fseq)))
        if self.unsafe.answer_before_gate:
            return [answer]
        return [WhenDurable(self.group, answer)]


# -- the sender --------------------------------------------------------------------------------


@dataclass
class Queued:
    """A message of a lane: its fseq, its publish, what goes on the wire."""

    fseq: int
    publish: int
    wire: list[Any]
    sent: float = 0.0  # when it last went


@dataclass
class Lane:
    """The sender's state for one group (or one owner node's exclusive queues: ``group``
    ``OWNER_GROUP``): what waits to go, what is unanswered, its leader."""

    group: int
    origin: str  # whose fseqs: the sender's (an owner lane's: its own, one per lane made)
    next_fseq: int = 1
    unsent: list[Queued] = field(default_factory=list)
    unanswered: dict[int, Queued] = field(default_factory=dict)  # fseq -> queued, in order
    leader: str | None = None
    epoch: int = -1
    delay: float = RETRY  # the retry's delay now (the sender's retry, doubled while unanswered)

    @property
    def load(self) -> int:
        return len(self.unsent) + len(self.unanswered)


@dataclass
class Publish:
    """A publish awaiting its groups' answers."""

    waiting: set[LaneKey]
    ack: bool = True


@dataclass
class SenderStats:
    forwards: int = 0   # Forward packets sent
    resent: int = 0     # messages sent again to a new leader
    retried: int = 0    # messages sent again to the same leader after ``retry`` ...
    retries: int = 0    # ... in this many retries
    acks: int = 0
    nacks: int = 0
    errors: int = 0     # ForwardError answers
    parts: int = 0      # ForwardParts sent (a large body's)
    owner_nacks: int = 0  # messages to an owner's exclusive queues nacked: its link down


class ForwardSender:
    """A node's forwarding of its clients' publishes, for one origin (this start)."""

    def __init__(self, origin: str, *, window: int = WINDOW, batch: int = BATCH,
                 retry: float = RETRY, unsafe: Unsafe = Unsafe(),
                 max_bytes: int = MAX_BYTES, retry_max: float = RETRY_MAX,
                 part_bytes: int = PART_BYTES) -> None:
        # (a window over REFUSED_KEPT, benchmarks/forward_path.py's: a message refused more
        # than REFUSED_KEPT below the mark and resent would be acked)
        self.origin = origin
        self.window = window
        self.batch = batch
        self.max_bytes = max_bytes
        self.part_bytes = part_bytes
        self.retry = retry
        self.retry_max = max(retry, retry_max)
        self.unsafe = unsafe
        self.meta_seq = 0  # this node's metadata copy: what a receiver must have applied
        self.lanes: dict[LaneKey, Lane] = {}
        self.owners_up: set[str] = set()  # owner nodes whose link is up (``owner_up``)
        self._owner_lanes = 0  # owner lanes made (each its own origin)
        self.publishes: dict[int, Publish] = {}
        self.stats = SenderStats()

    def lane(self, key: LaneKey) -> Lane:
        lane = self.lanes.get(key)
        if lane is None:
            if isinstance(key, str):  # an owner's: up with its link, a new origin each
                self._owner_lanes += 1
                lane = Lane(OWNER_GROUP, f"{self.origin}~{self._owner_lanes}",
                            delay=self.retry)
                if key in self.owners_up:
                    lane.leader, lane.epoch = key, 0
            else:
                lane = Lane(key, self.origin, delay=self.retry)
            self.lanes[key] = lane
        return lane

    def holds(self, groups: Iterable[LaneKey]) -> bool:
        """Whether a publisher to ``groups`` must wait: some lane's window is full."""
        return any(self.lane(g).load >= self.window for g in groups)

    # -- inputs -------------------------------------------------------------------------------

    def publish(self, publish: int, targets: Mapping[Key, ForwardMessage]) -> list[Effect]:
        """A publish routed to queues of ``targets`` (group -> the message with that group's
        queues; an owner node -> its exclusive queues'); none: confirmed at once (the
        shell's unroutable rules came first). An owner whose link is down: nacked."""
        if not targets:
            return [Confirm(publish, True)]
        if publish in self.publishes:
            raise ValueError(f"publish {publish} is under way already")
        waiting: set[LaneKey] = set(targets)
        self.publishes[publish] = Publish(waiting)
        out: list[Effect] = []
        for key, message in sorted(targets.items(), key=_in_order):
            lane = self.lane(key)
            if lane.group == OWNER_GROUP and lane.leader is None:
                self.stats.owner_nacks += 1
                out += self._answered(publish, key, False)
                continue
            lane.unsent.append(Queued(lane.next_fseq, publish, message.as_wire()))
            lane.next_fseq += 1
        return out

    def flush(self, now: float) -> list[Effect]:
        """The end of a loop turn: each lane's new messages as one forward to its leader."""
        out: list[Effect] = []
        for lane in self.lanes.values():
            out += self._send(lane, now)
        return out

    def owner_up(self, node: str) -> None:
        """The link to ``node`` is up: its exclusive queues' lane is made up (one made while
        the link was down held nothing: it is dropped, the next one starts afresh)."""
        self.owners_up.add(node)
        lane = self.lanes.get(node)
        if lane is not None and lane.leader is None:
            del self.lanes[node]

    def owner_down(self, node: str) -> list[Effect]:
        """The link to ``node`` went (the node down, or cut off): what its exclusive queues'
        lane holds unanswered is nacked (fail closed: the queues may be gone with it) and
        the lane dropped."""
        self.owners_up.discard(node)
        return self._drop_owner_lane(node)

    def _drop_owner_lane(self, node: str) -> list[Effect]:
        lane = self.lanes.pop(node, None)
        if lane is None:
            return []
        out: list[Effect] = []
        for queued in [*lane.unanswered.values(), *lane.unsent]:
            self.stats.owner_nacks += 1
            out += self._answered(queued.publish, node, False)
        return out

    def leader(self, now: float, notice: LeaderNotice) -> list[Effect]:
        """A ``LeaderNotice``: a new leader gets what is unanswered, in order, at once."""
        if notice.group == OWNER_GROUP:
            return []  # (an owner lane follows its link)
        lane = self.lane(notice.group)
        if notice.epoch < lane.epoch or (notice.epoch == lane.epoch
                                         and lane.leader == notice.node):
            return []
        lane.leader, lane.epoch = notice.node, notice.epoch
        lane.delay = self.retry
        return self._resend(lane, now)

    def receive(self, now: float, packet: Forwarded | ForwardError,
                src: str | None = None) -> list[Effect]:
        """An answer from node ``src`` (None: unknown; an owner lane's answer names it)."""
        key: LaneKey = packet.group
        if packet.group == OWNER_GROUP:
            if src is None:
                return []
            key = src
        lane = self.lanes.get(key)
        if lane is None or packet.origin != lane.origin:
            return []  # an answer to an earlier start of this node (or owner lane)
        if isinstance(packet, ForwardError):
            self.stats.errors += 1
            if isinstance(key, str):  # (its owner takes any forward): fail closed
                return self._drop_owner_lane(key)
            if src is None or src == lane.leader:
                lane.leader = None  # not the leader any more: wait for the next notice
            return []
        out: list[Effect] = []
        refused = set(packet.refused)
        for fseq in [f for f in lane.unanswered if f <= packet.upto_fseq]:
            queued = lane.unanswered.pop(fseq)
            lane.delay = self.retry  # the leader answers: no backoff
            out += self._answered(queued.publish, key, fseq not in refused)
        return out + self._send(lane, now)

    def tick(self, now: float) -> list[Effect]:
        """A lane whose oldest unanswered message went ``delay`` seconds ago (``retry``,
        doubled at each retry the leader left unanswered, up to ``retry_max``; at least the
        time its bodies in parts take at ``RETRY_BYTES_PER_SECOND``): what is unanswered
        and that old goes again to the same leader, from the oldest on (one lost forward
        makes the next ones gaps), at most a window's worth."""
        out: list[Effect] = []
        for lane in self.lanes.values():
            oldest = next(iter(lane.unanswered.values()), None)
            if oldest is None or lane.leader is None:
                continue
            delay = max(lane.delay, self._in_parts(lane) / RETRY_BYTES_PER_SECOND)
            if now - oldest.sent < delay:
                continue
            cutoff = now - delay
            again: list[Queued] = []
            for queued in lane.unanswered.values():
                if queued.sent > cutoff or len(again) >= self.window:
                    break
                again.append(queued)
            self.stats.retries += 1
            self.stats.retried += len(again)
            lane.delay = min(lane.delay * 2, self.retry_max)
            out += self._forwards(lane, again, now)
        return out

    # -- steps --------------------------------------------------------------------------------

    def _answered(self, publish: int, group: LaneKey, ack: bool) -> list[Effect]:
        pending = self.publishes.get(publish)
        if pending is None or group not in pending.waiting:
            return []
        pending.waiting.discard(group)
        pending.ack = pending.ack and ack
        if pending.waiting:
            return []
        del self.publishes[publish]
        if pending.ack:
            self.stats.acks += 1
        else:
            self.stats.nacks += 1
        return [Confirm(publish, pending.ack)]

    def _resend(self, lane: Lane, now: float) -> list[Effect]:
        """A new leader: everything unanswered goes back ahead of what waits, and out again
        in order, at once."""
        again = list(lane.unanswered.values())
        self.stats.resent += len(again)
        lane.unsent[:0] = again
        lane.unanswered.clear()
        return self._send(lane, now)

    def _send(self, lane: Lane, now: float) -> list[Effect]:
        if lane.leader is None or not lane.unsent:
            return []
        room = self.window - len(lane.unanswered)
        if room <= 0:
            return []
        take = lane.unsent[:room]
        del lane.unsent[:len(take)]
        for queued in take:
            lane.unanswered[queued.fseq] = queued
        return self._forwards(lane, take, now)

    def _forwards(self, lane: Lane, queued: list[Queued], now: float) -> list[Effect]:
        """``queued`` (in fseq order, contiguous) to the lane's leader as Forwards of at most
        ``batch`` messages and ``max_bytes`` (a bigger message alone); a body over
        ``part_bytes`` goes in ``ForwardPart``s, its message alone in the Forward after."""
        assert lane.leader is not None
        out: list[Effect] = []
        at = 0
        while at < len(queued):
            take = queued[at:at + self.batch]
            size = 0
            for i, q in enumerate(take):  # wire: [.., header, body]
                body = len(q.wire[5])
                if body > self.part_bytes:
                    take = take[:i or 1]
                    break
                size += len(q.wire[4]) + body
                if i and size > self.max_bytes:
                    take = take[:i]
                    break
            at += len(take)
            for q in take:
                q.sent = now
            wires = [q.wire for q in take]
            if len(take) == 1 and len(take[0].wire[5]) > self.part_bytes:
                out += self._parts(lane, take[0])
                wires = [ForwardMessage.in_parts(take[0].wire)]
            out.append(ToNode(lane.leader, Forward(lane.group, lane.epoch, lane.origin,
                                                   take[0].fseq, self.meta_seq, wires)))
            self.stats.forwards += 1
            if self.unsafe.confirm_on_send:
                for q in take:
                    out += self._answered(q.publish, _key(lane), True)
        return out

    def _in_parts(self, lane: Lane) -> int:
        """The bytes of the lane's unanswered bodies that go in parts."""
        return sum(len(q.wire[5]) for q in lane.unanswered.values()
                   if len(q.wire[5]) > self.part_bytes)

    def _parts(self, lane: Lane, queued: Queued) -> list[Effect]:
        """A large body's ``ForwardPart``s, in order (its Forward follows them)."""
        assert lane.leader is not None
        body: bytes = queued.wire[5]
        size = len(body)
        self.stats.parts += (size + self.part_bytes - 1) // self.part_bytes
        return [ToNode(lane.leader, ForwardPart(lane.group, lane.epoch, lane.origin, queued.fseq,
                                                size, offset,
                                                body[offset:offset + self.part_bytes]))
                for offset in range(0, size, self.part_bytes)]


def _key(lane: Lane) -> LaneKey:
    """The key of a lane that has a leader: its group, or its owner node."""
    if lane.group == OWNER_GROUP:
        assert lane.leader is not None
        return lane.leader
    return lane.group


def _in_order(item: tuple[LaneKey, ForwardMessage]) -> tuple[bool, int, str]:
    """Lanes in a deterministic order: groups by number, then owner nodes by name."""
    key = item[0]
    return (True, 0, key) if isinstance(key, str) else (False, key, "")
