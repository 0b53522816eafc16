"""A partitioned node's forwarding of publishes: ``partition/forward.py`` over the node's
groups (issue 35 stage 3, docs/ha.md "Clients on any node").

Sans-I/O as the rest of ``partition/``: the node's shell (``node/ha_groups.py``)
hands in how to put a packet on a link (``send``), how to run something at the
next loop turn (``soon``) and the clock; ``GroupClients.publish``
(``partition/clients.py``) hands in the publishes. What it does:

- **The sender** (``ForwardSender``, one per start of the node: its origin is
  ``<node>.<incarnation>``): a publish routed to queues of groups this node does
  not serve goes into the lanes of those groups; the lanes go out once per loop
  turn (``flush``, scheduled at the first publish of a turn); the publisher's
  confirm is given when every lane answered (and the local part, if any, passed
  its groups' gates: ``GroupClients``). A lane's full window holds the
  connections that publish to it, each alone (``hold_publishing(FLOW_HOLD, ...)``:
  not read, as a flow hold), until answers bring it under its window; the
  connections publishing to other partitions go on.
- **A receiver per group this node serves** (``ForwardReceiver``, made in
  ``serving`` for that epoch with the marks its store holds, dropped in
  ``demoted``): it applies forwards through ``BrokerForwardLog`` (one local TX per
  batch, its outcome record carrying the origin's mark) and answers through
  ``Broker.after_durable_in`` with that group's gate and barriers
  (``WhenDurable``): never, if the role or its lease is gone by then. A forward
  to a group this node does not serve in the forward's epoch is answered
  ``ForwardError(not-primary)``.
- **Leaders**: a group's new primary sends ``LeaderNotice`` to every node (itself
  included) when it starts serving, to a peer whose link comes up, and again
  every ``NOTICE_EVERY`` (a notice lost with a link that went down). The
  elections' heartbeats name a group's primary to its cells already, but not
  *when it serves* (after its verification): forwarding to it before would be
  answered ``not-primary``; the notice says it serves, and reaches non-cells too.
- **Another node's exclusive queue** (docs/ha.md "Exclusive queues on a
  partitioned cluster"): a publish routed here to its stand-in goes into the lane
  of its owner node (``GroupClients.publish``), up while the link to that node is
  (``peer_up``; ``link_lost`` nacks what it holds unanswered); the owner's one
  receiver (``owned``, group ``OWNER_GROUP``) enqueues it on the queue
  (``OwnedForwardLog``) and answers once it is as durable as a publish of the
  owner's own clients to it (``owned_durable``: ``GroupClients.after_durable``).
- ``meta_seq``: 0. A queue's declaration is in its partition's log (stage 2's
  layout), which the receiver, the group's primary, holds; the metadata
  directory (``qe``) that would make a receiver wait for its metadata copy is not
  built, and the metadata log's seqs are not comparable across nodes' epochs.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from brokerha.broker.broker import Broker
from brokerha.broker.message import Message as BrokerMessage
from brokerha.broker.queue import Queue
from brokerha.cluster.messages import ErrorCode, Message
from brokerha.cluster.replication import HA_ID
from brokerha.ha.member import HAMember
from brokerha.partition.directory import Owner
from brokerha.partition.forward import (
    OWNER_GROUP,
    Confirm,
    Effect,
    Forward,
    Forwarded,
    ForwardError,
    ForwardMessage,
    ForwardPart,
    ForwardReceiver,
    ForwardSender,
    Key,
    LaneKey,
    LeaderNotice,
    ToNode,
    WhenDurable,
)
from brokerha.partition.forward_apply import BrokerForwardLog, OwnedForwardLog, recover_marks
from brokerha.partition.member import PartitionedMember, group_of

log = logging.getLogger("brokerha.partition")

# codes 23-27, not mux packets
PACKETS = (Forward, Forwarded, ForwardError, LeaderNotice, ForwardPart)
NOTICE_EVERY = 1.0  # seconds: a serving group primary's LeaderNotice to every node, again
FLOW_HOLD = "forward"  # the name of a full lane's hold of a connection (hold_publishing)

# the parts of large bodies put on one peer's link in a loop turn at most (as a primary's
# outbox to a backup, primary/remote_backup.py): a 60 MiB body's 60 parts encoded and
# written in one turn held the loop 1.7 s at load 20, every group's heartbeats with it
PART_BYTES_PER_TURN = 4 << 20

Settle = Callable[[bool], None]


class Paced:
    """Packets to peers, in order per peer, at most ``per_turn`` bytes of body parts
    (``ForwardPart``, ``DeliverPart``: a ``data`` field) to each peer a loop turn; what
    follows a part held back waits behind it (the link's order is the protocol's)."""

    def __init__(self, send: Callable[[str, Message], None],
                 soon: Callable[[Callable[[], None]], Any],
                 per_turn: int = PART_BYTES_PER_TURN) -> None:
        self._send = send
        self._soon = soon
        self.per_turn = per_turn
        self.queues: dict[str, deque[Message]] = {}
        self.budget: dict[str, int] = {}  # what a peer may still take this turn
        self._scheduled = False
        self.turns_held = 0  # (statistics) turns that left parts for the next

    def send(self, node: str, packet: Message) -> None:
        queue = self.queues.get(node)
        if queue is not None:
            queue.append(packet)
            return
        size = len(getattr(packet, "data", b""))
        if not size:
            self._send(node, packet)
            return
        budget = self.budget.get(node, self.per_turn)
        if budget > 0:
            self.budget[node] = budget - size
            self._send(node, packet)
        else:
            self.queues[node] = deque([packet])
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._soon(self._turn)

    def _turn(self) -> None:
        """A new loop turn: each peer's budget again, what waited goes out within it."""
        self._scheduled = False
        self.budget.clear()
        for node, queue in list(self.queues.items()):
            budget = self.per_turn
            while queue and budget > 0:
                packet = queue.popleft()
                budget -= len(getattr(packet, "data", b""))
                self._send(node, packet)
            if queue:
                self.turns_held += 1
            else:
                del self.queues[node]
            self.budget[node] = budget
        if self.queues or self.budget:
            self._schedule()


class Holdable(Protocol):
    """A publishing connection (``amqp/connection.py``): not read while held."""

    def hold_publishing(self, name: str, held: bool) -> None: ...


@dataclass
class ForwardingStats:
    published: int = 0   # publishes that went into some lane
    local_in_lane: int = 0  # ... of which to a group this node serves (its lane under way)
    notices_sent: int = 0
    not_serving: int = 0  # forwards this node answered not-primary (no receiver)
    connection_holds: int = 0  # times a connection was held by a full lane
    dead_letters: int = 0  # dead letters forwarded to queues of partitions led elsewhere
    dead_letters_dropped: int = 0  # ... targets left out (no x-ha-id, no table)


class NodeForwarding:
    """The node's sender, its receivers and the publishers' confirms in between."""

    def __init__(self, member: PartitionedMember, origin: str, nodes: Iterable[str], *,
                 send: Callable[[str, Message], None], soon: Callable[[Callable[[], None]], Any],
                 clock: Callable[[], float], sender: ForwardSender | None = None) -> None:
        self.member = member
        self.broker: Broker = member.broker
        self.me = member.me
        self.nodes = sorted(nodes)
        self.paced = Paced(send, soon)
        self._send = self.paced.send
        self._soon = soon
        self.clock = clock
        self.sender = sender if sender is not None else ForwardSender(origin)
        self.receivers: dict[int, ForwardReceiver] = {}
        # this node's own exclusive queues' receiver, for its whole start (no group's)
        self.owned = ForwardReceiver(OWNER_GROUP, 0, OwnedForwardLog(self.broker))
        self.owned_from: dict[str, str] = {}  # its origins -> their node (dropped at link loss)
        # ``callback`` once what was enqueued on this node's exclusive queues is as durable
        # as its own clients' publishes to them are (the shell: GroupClients.after_durable
        # of none); None: never (fail closed)
        self.owned_durable: Callable[[Callable[[], None]], None] | None = None
        self.settles: dict[int, Settle] = {}  # publish id -> its publisher's confirm
        self._next_publish = 0
        self._flush_scheduled = False
        self._noticed = 0.0
        # the connections held, by the full lanes (groups, owner nodes) they published to
        self.held: dict[Holdable, set[LaneKey]] = {}
        self.stats = ForwardingStats()
        # told of every LeaderNotice this node takes (the node's remote consumers' proxy)
        self.notice_listeners: list[Callable[[LeaderNotice], None]] = []
        # the dead letters this node's queues route to queues of partitions led elsewhere
        self.broker.observers.dead_letters_elsewhere = self.dead_letter

    # -- the publish path (GroupClients.publish) --------------------------------------------

    def under_way(self, group: int) -> bool:
        """Whether the lane of ``group`` holds messages not answered yet: a publish to that
        group goes the same way (its order kept), even once this node serves the group."""
        lane = self.sender.lanes.get(group)
        return lane is not None and lane.load > 0

    def publish(self, targets: Mapping[Key, ForwardMessage], settle: Settle | None,
                client: object = None) -> None:
        """Forward one publish to ``targets`` (group -> the message naming that group's
        queues; owner node -> its exclusive queues', by name); ``settle(ack)`` once every
        group answered (None: no confirm asked).
        ``client``: the publishing connection, held while a lane it published to is full
        (one without ``hold_publishing``, the management API's None: not held)."""
        self._next_publish += 1
        pid = self._next_publish
        if settle is not None:
            self.settles[pid] = settle
        self.stats.published += 1
        self.stats.local_in_lane += sum(1 for g in targets
                                        if isinstance(g, int) and self._serving(g))
        self.carry_out(self.sender.publish(pid, targets))
        if hasattr(client, "hold_publishing"):
            full: set[LaneKey] = {g for g in targets if self.sender.holds([g])}
            if full:
                conn = cast(Holdable, client)
                groups = self.held.get(conn)
                if groups is None:
                    self.held[conn] = full
                    self.stats.connection_holds += 1
                    conn.hold_publishing(FLOW_HOLD, True)
                else:
                    groups |= full
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._soon(self.flush)

    def dead_letter(self, source: Queue, targets: list[Queue], message: BrokerMessage) -> None:
        """A dead letter of ``source`` (a queue this node leads: rejected, expired, dropped
        from its head) routed to ``targets``, copies of queues of partitions other nodes
        lead: forwarded to their leaders by ``x-ha-id``, without a confirm (RabbitMQ's
        at-most-once dead-lettering: the sender resends it until answered, but it is lost
        if this node fails first). A copy without ``x-ha-id`` is left out; another node's
        exclusive queue (its stand-in) goes to its owner node's lane, by name."""
        placement = self.member.placement
        remote: dict[LaneKey, list[str]] = {}
        for queue in targets:
            if isinstance(queue.exclusive_owner, Owner):
                remote.setdefault(queue.exclusive_owner.node, []).append(queue.name)
                continue
            ha_id = queue.arguments.get(HA_ID)
            if placement is None or ha_id is None:
                self.stats.dead_letters_dropped += 1
                continue
            group = group_of(placement.of_name(queue.vhost, queue.name,
                                               queue.arguments.get("x-partition")))
            remote.setdefault(group, []).append(str(ha_id))
        if not remote:
            return
        self.stats.dead_letters += 1
        self.publish({g: ForwardMessage(source.vhost, tuple(ids), message.exchange,
                                        message.routing_key, message.header, message.body)
                      for g, ids in remote.items()}, None)

    def flush(self) -> None:
        """Once per loop turn that published: each lane's new messages as one Forward."""
        self._flush_scheduled = False
        self.carry_out(self.sender.flush(self.clock()))

    # -- the groups' roles (the shell's PartitionEffects) ------------------------------------

    def serving(self, group: int, epoch: int) -> None:
        """The group's primary serves in ``epoch``: its receiver, with the marks the store
        holds (what the group's previous primaries applied and replicated), then the
        notice to every node."""
        placement = self.member.placement
        assert placement is not None
        forward_log = BrokerForwardLog(self.broker, group, placement.of(group - 1))
        self.receivers[group] = ForwardReceiver(group, epoch, forward_log,
                                                marks=recover_marks(self.broker, group))
        self.notify(group)

    def demoted(self, group: int) -> None:
        self.receivers.pop(group, None)

    def peer_up(self, peer: str) -> None:
        self.sender.owner_up(peer)  # its exclusive queues reached again (a new lane)
        for group, receiver in sorted(self.receivers.items()):
            self._notice_to(peer, LeaderNotice(group, receiver.epoch, self.me))

    def link_lost(self, peer: str) -> None:
        """The link to ``peer`` went: publishes to its exclusive queues unanswered are
        nacked (and new ones until it is back); its lanes' origins to this node's own are
        forgotten (each lane to them is dropped with the link)."""
        for origin in [o for o, node in self.owned_from.items() if node == peer]:
            del self.owned_from[origin]
            self.owned.marks.pop(origin, None)
            self.owned.partial.pop(origin, None)
        self.carry_out(self.sender.owner_down(peer))
        if self.held:
            self._release(peer)

    def notify(self, group: int) -> None:
        receiver = self.receivers.get(group)
        if receiver is None:
            return
        notice = LeaderNotice(group, receiver.epoch, self.me)
        for node in self.nodes:
            self._notice_to(node, notice)

    def _notice_to(self, node: str, notice: LeaderNotice) -> None:
        self.stats.notices_sent += 1
        self.carry_out([ToNode(node, notice)])

    def tick(self) -> None:
        now = self.clock()
        out = self.sender.tick(now)
        if now - self._noticed >= NOTICE_EVERY:
            self._noticed = now
            for group in sorted(self.receivers):
                self.notify(group)
        self.carry_out(out)

    # -- packets -----------------------------------------------------------------------------

    def on_packet(self, src: str, packet: Message) -> None:
        """A forwarding packet from ``src`` (this node: from its own sender or receiver)."""
        out: list[Effect]
        if isinstance(packet, Forward):
            out = self._forward(src, packet)
        elif isinstance(packet, ForwardPart):
            receiver = self.owned if packet.group == OWNER_GROUP else \
                self.receivers.get(packet.group)
            # no receiver: dropped (its Forward, after it, is answered not-primary)
            out = [] if receiver is None else receiver.part(src, packet)
        elif isinstance(packet, Forwarded | ForwardError):
            out = self.sender.receive(self.clock(), packet, src)
            if self.held:
                self._release(src if packet.group == OWNER_GROUP else packet.group)
        elif isinstance(packet, LeaderNotice):
            out = self.sender.leader(self.clock(), packet)
            for listener in self.notice_listeners:
                listener(packet)
        else:
            return
        self.carry_out(out)

    def _release(self, group: LaneKey) -> None:
        """The connections held by ``group``'s lane go on once it is under its window (and
        no other full lane holds them)."""
        if self.sender.holds([group]):
            return
        for client, groups in list(self.held.items()):
            if group in groups:
                groups.discard(group)
                if not groups:
                    del self.held[client]
                    client.hold_publishing(FLOW_HOLD, False)

    def _forward(self, src: str, packet: Forward) -> list[Effect]:
        if packet.group == OWNER_GROUP:  # this node's own exclusive queues
            self.owned_from[packet.origin] = src
            return self.owned.receive(src, packet)
        receiver = self.receivers.get(packet.group)
        member = self.member.groups.get(packet.group)
        if receiver is None or member is None or member.role_term() != receiver.epoch:
            self.stats.not_serving += 1
            return [ToNode(src, ForwardError(packet.group, packet.origin, ErrorCode.NOT_PRIMARY,
                                             f"{self.me} does not lead group {packet.group}"))]
        return receiver.receive(src, packet)

    # -- effects -------------------------------------------------------------------------------

    def carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, ToNode):
                self._to_node(effect)
            elif isinstance(effect, WhenDurable):
                self._when_durable(effect)
            elif isinstance(effect, Confirm):
                settle = self.settles.pop(effect.publish, None)
                if settle is not None:
                    settle(effect.ack)

    def _to_node(self, effect: ToNode) -> None:
        if effect.node == self.me:  # this node's own receiver or sender: at the next turn
            packet = effect.packet
            self._soon(lambda: self.on_packet(self.me, packet))
        else:
            self._send(effect.node, effect.packet)

    def _when_durable(self, effect: WhenDurable) -> None:
        send = effect.send
        if effect.group == OWNER_GROUP:
            if self.owned_durable is not None:
                self.owned_durable(lambda: self._to_node(send))
            return
        member = self.member.groups.get(effect.group)
        if member is None:
            return
        self.broker.after_durable_in(member.durability_gate, lambda: self._to_node(send),
                                     member.barriers())

    def _serving(self, group: int) -> bool:
        member: HAMember | None = self.member.groups.get(group)
        return member is not None and member.clients.term() is not None

    def status(self) -> dict[str, Any]:
        """For ``ctl status --json`` (the node's ``forwarding``)."""
        lanes = {str(g): {"leader": lane.leader, "epoch": lane.epoch,
                          "unanswered": len(lane.unanswered), "unsent": len(lane.unsent)}
                 for g, lane in self.sender.lanes.items()}
        return {"origin": self.sender.origin, "lanes": dict(sorted(lanes.items())),
                "receivers": {str(g): r.epoch for g, r in sorted(self.receivers.items())},
                "owned": vars(self.owned.stats).copy(),
                "sender": vars(self.sender.stats).copy(), "node": vars(self.stats).copy(),
                "held": len(self.held)}
