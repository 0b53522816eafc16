"""Declarations from any node of a partitioned cluster (issue 35 stage 3, docs/ha.md
"Clients on any node", **Declarations**).

Sans-I/O. A client on a node that does not serve a queue's group (or, for an
exchange, the metadata group) declares, binds, unbinds, purges and deletes
it all the same: the node asks the group's leader (``MetaRequest``), which
applies the operation on its broker exactly as its own AMQP methods would
(``BrokerOps``: the same ``VirtualHost`` calls, so the same answers and the
same errors), and answers (``MetaReply``) once what it did is durable through
that group's gate and barriers, with the group's log position at that
moment. The asking node answers its client only once *its own* copy of that
group reached that position (read-your-writes: a publish routed on this node
right after a declare-ok finds the queue's copy and its ``x-ha-id``). Every
error is the leader's broker's, its AMQP code and text carried back.

- **Which group**: a queue's operations go to its partition's group (the
  queue's declaration, bindings and life are in its partition's log: stage 2's
  layout); exchanges and exchange-to-exchange bindings go to the metadata
  group (0). A request names the asking node's metadata position (``after``):
  the leader applies it only once its own metadata copy reached it (bounded
  by ``hold``), so a binding to an exchange declared through another node a
  moment ago finds it.
- **Answers**: ``code`` 0 and ``result`` (declare: name, message count,
  consumer count; purge and delete: the message count), or the AMQP reply
  code and text of the leader's refusal, or ``NOT_PRIMARY`` (-1: not applied,
  asked again at the next leader).
- **A lost leader** (a newer leader, the link down, the leader not serving):
  a request not answered may have been applied or not. Those whose second
  application changes nothing a client could tell (``IDEMPOTENT``: declare,
  bind, unbind, exchange declare, delete, bind, unbind) are asked again of
  the next leader; a purge or a queue delete is not: the connection is closed
  (``Answer(code=CONNECTION_FORCED)``), so a client is never answered ok for
  something that did not happen. A request still unanswered after ``timeout``
  closes the connection too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from brokerha.broker.broker import Broker
from brokerha.broker.errors import AccessRefused, BrokerError, NotAllowed
from brokerha.cluster.messages import Message, packet

log = logging.getLogger("brokerha.partition")

NOT_PRIMARY = -1  # MetaReply.code: the node does not serve the group; nothing applied
CONNECTION_FORCED = 320  # Answer.code: the connection is closed (the outcome is unknown)

QUEUE_OPS = ("queue.declare", "queue.bind", "queue.unbind", "queue.purge", "queue.delete")
EXCHANGE_OPS = ("exchange.declare", "exchange.delete", "exchange.bind", "exchange.unbind")
# asked again of a new leader when the outcome of the first ask is unknown: applying them
# twice leaves what applying them once leaves, and answers the same
IDEMPOTENT = frozenset(("queue.declare", "queue.bind", "queue.unbind", "exchange.declare",
                        "exchange.delete", "exchange.bind", "exchange.unbind",
                        "directory.update"))
# the queue methods that change what the queue directory holds of a queue (its entry,
# its bindings, its life): a purge changes none of it
DIRECTORY_OPS = frozenset(("queue.declare", "queue.bind", "queue.unbind", "queue.delete"))


@packet(50)
class MetaRequest(Message):
    """Apply ``op`` (``QUEUE_OPS``, ``EXCHANGE_OPS``) with ``args`` on the leader of
    ``group``, once its metadata copy reached ``after`` ([epoch, seq] of the asking node's;
    [-1, 0]: nothing to wait for). ``request`` numbers it within ``origin``."""

    group: int
    origin: str
    request: int
    op: str
    args: list[Any]
    after: list[int]


@packet(51)
class MetaReply(Message):
    """The answer: ``code`` 0 and ``result``, an AMQP reply code and ``text``, or
    ``NOT_PRIMARY``; ``position`` [epoch, seq]: the group's log when it was durable, then
    (a queue's method with the queue directory) [epoch, seq] of the metadata log holding
    the directory's change."""

    group: int
    origin: str
    request: int
    code: int
    text: str
    result: list[Any]
    position: list[int]


PACKETS = (MetaRequest, MetaReply)


class LeaderRefused(BrokerError):
    """The group's leader refused a request (its AMQP code and reply text), or the
    connection's answer was forced (``CONNECTION_FORCED``): what the management API's
    request gets (``NodeDeclarations.request``)."""

    def __init__(self, code: int, reply_text: str) -> None:
        name, _, text = reply_text.partition(" - ")
        super().__init__(text or reply_text)
        self.code = code
        self.name = name if text else "ERROR"


# -- effects ------------------------------------------------------------------------------------


@dataclass
class Send:
    node: str
    packet: Message


@dataclass
class Answer:
    """Answer the client's method ``request``: ``code`` 0 with ``result``, an AMQP error
    (``code``, ``text``), or ``CONNECTION_FORCED`` (close the connection)."""

    request: int
    code: int
    text: str = ""
    result: list[Any] = field(default_factory=list)
    position: list[int] = field(default_factory=list)  # the metadata log's, if any


@dataclass
class ReplyWhenDurable:
    """Send ``reply`` to ``node`` once what the group's leader did so far is durable through
    the group's gate and barriers (never, if its role ends first), its ``position`` filled
    in then."""

    group: int
    node: str
    reply: MetaReply
    # the queues whose directory entries the method changed (a partition's queue method
    # with the queue directory: the reply also waits for the directory to hold them)
    names: list[tuple[str, str]] = field(default_factory=list)


Effect = Send | Answer | ReplyWhenDurable

# reached(group, epoch, seq): this node's copy of ``group`` holds the log of the primary of
# ``epoch`` up to ``seq`` (or is of a later epoch, caught up); True if it holds no copy
Reached = Callable[[int, int, int], bool]
# leader_of(group): (node, epoch) of the group's leader as this node knows it, or None
LeaderOf = Callable[[int], "tuple[str, int] | None"]


@dataclass
class _Pending:
    group: int
    op: str
    args: list[Any]
    after: list[int]
    deadline: float
    sent_to: tuple[str, int] | None = None  # (node, epoch) asked, unanswered
    retry_at: float = 0.0
    waiting: tuple[int, int] | None = None  # answered ok: this node's copy must reach it
    meta: tuple[int, int] | None = None  # and its metadata copy this (the directory's)
    result: list[Any] = field(default_factory=list)
    asks: int = 0


@dataclass
class RequestStats:
    asked: int = 0
    answered: int = 0
    refused: int = 0
    resent: int = 0
    not_primary: int = 0
    forced: int = 0
    waited: int = 0  # answers that waited for this node's copy


class DeclarationRequests:
    """The asking node's side: one per start of the node (``origin``)."""

    def __init__(self, origin: str, *, leader_of: LeaderOf, reached: Reached,
                 timeout: float = 15.0, retry: float = 0.1) -> None:
        self.origin = origin
        self.leader_of = leader_of
        self.reached = reached
        self.timeout = timeout
        self.retry = retry
        self.pending: dict[int, _Pending] = {}
        self._next = 0
        self.stats = RequestStats()

    def ask(self, now: float, group: int, op: str, args: list[Any],
            after: list[int]) -> tuple[int, list[Effect]]:
        self._next += 1
        request = self._next
        self.pending[request] = _Pending(group, op, list(args), list(after),
                                         now + self.timeout)
        self.stats.asked += 1
        return request, self._send(now, request)

    def _send(self, now: float, request: int) -> list[Effect]:
        p = self.pending[request]
        leader = self.leader_of(p.group)
        if leader is None or now < p.retry_at:
            return []  # at a tick, once a leader is known
        p.sent_to = leader
        p.asks += 1
        if p.asks > 1:
            self.stats.resent += 1
        return [Send(leader[0], MetaRequest(p.group, self.origin, request, p.op, p.args,
                                            p.after))]

    def receive(self, now: float, src: str, reply: MetaReply) -> list[Effect]:
        p = self.pending.get(reply.request)
        if p is None or reply.origin != self.origin or p.sent_to is None \
                or p.sent_to[0] != src or p.waiting is not None:
            return []  # late: a resend's answer came first, or one from a deposed leader
        if reply.code == NOT_PRIMARY:  # nothing applied: ask again (its next leader)
            self.stats.not_primary += 1
            p.sent_to = None
            p.retry_at = now + self.retry
            return []
        if reply.code != 0:
            del self.pending[reply.request]
            self.stats.refused += 1
            return [Answer(reply.request, reply.code, reply.text)]
        epoch, seq = reply.position[:2]
        p.waiting = (epoch, seq)
        if len(reply.position) >= 4:
            p.meta = (reply.position[2], reply.position[3])
        p.result = list(reply.result)
        return self._check(reply.request)

    def _check(self, request: int) -> list[Effect]:
        p = self.pending[request]
        assert p.waiting is not None
        if not self.reached(p.group, *p.waiting):
            return []
        if p.meta is not None and not self.reached(0, *p.meta):
            return []  # the queue directory's change: this node's metadata copy too
        del self.pending[request]
        self.stats.answered += 1
        return [Answer(request, 0, "", p.result,
                       list(p.waiting) if p.group == 0 else [])]

    def poll(self) -> list[Effect]:
        """This node's copies moved: the answers waiting for them."""
        out: list[Effect] = []
        for request, p in list(self.pending.items()):
            if p.waiting is not None:
                before = len(out)
                out += self._check(request)
                if len(out) == before:
                    continue
                self.stats.waited += 1
        return out

    def link_lost(self, now: float, peer: str) -> list[Effect]:
        return self._lost(now, lambda p: p.sent_to is not None and p.sent_to[0] == peer,
                          f"the link to {peer}, which was asked, was lost")

    def tick(self, now: float) -> list[Effect]:
        out = self.poll()

        def moved(p: _Pending) -> bool:
            return p.sent_to is not None and self.leader_of(p.group) not in (None, p.sent_to)

        out += self._lost(now, moved, "its group's leader changed")
        for request, p in list(self.pending.items()):
            if now >= p.deadline:
                del self.pending[request]
                self.stats.forced += 1
                out.append(Answer(request, CONNECTION_FORCED, f"no answer from partition "
                                  f"group {p.group}'s leader in {self.timeout:g} s to {p.op}"))
            elif p.sent_to is None and p.waiting is None:
                out += self._send(now, request)
        return out

    def _lost(self, now: float, which: Callable[[_Pending], bool], why: str) -> list[Effect]:
        """Requests asked and unanswered whose answer will not come: asked again if
        ``IDEMPOTENT``, else the connection closed (their outcome is unknown)."""
        out: list[Effect] = []
        for request, p in list(self.pending.items()):
            if p.waiting is not None or not which(p):
                continue
            if p.op in IDEMPOTENT:
                p.sent_to = None
                out += self._send(now, request)
                continue
            del self.pending[request]
            self.stats.forced += 1
            out.append(Answer(request, CONNECTION_FORCED,
                              f"{p.op} was asked of partition group {p.group}'s leader and "
                              f"{why} before it answered: its outcome is unknown"))
        return out

    def status(self) -> dict[str, Any]:
        return {"pending": len(self.pending), **vars(self.stats)}


# -- the leader's side --------------------------------------------------------------------------


Apply = Callable[[str, list[Any]], list[Any]]  # raises BrokerError


@dataclass
class HostStats:
    applied: int = 0
    refused: int = 0
    not_primary: int = 0
    held: int = 0


class DeclarationHost:
    """The leader's side for every group the node serves: ``serves(group)`` whether it
    serves that group now; ``metadata_reached(epoch, seq)`` its metadata copy's; ``apply``
    the operation on its broker (``BrokerOps.apply``)."""

    def __init__(self, *, serves: Callable[[int], bool],
                 metadata_reached: Callable[[int, int], bool], apply: Apply,
                 hold: float = 5.0) -> None:
        self.serves = serves
        self.metadata_reached = metadata_reached
        self.apply = apply
        self.hold = hold
        self.held: list[tuple[float, str, MetaRequest]] = []
        self.stats = HostStats()

    def receive(self, now: float, src: str, request: MetaRequest) -> list[Effect]:
        if not self.serves(request.group):
            self.stats.not_primary += 1
            return [Send(src, MetaReply(request.group, request.origin, request.request,
                                        NOT_PRIMARY, "not the group's leader", [], [-1, 0]))]
        epoch, seq = request.after
        if epoch >= 0 and not self.metadata_reached(epoch, seq):
            self.stats.held += 1
            self.held.append((now + self.hold, src, request))
            return []
        return self._apply(src, request)

    def _apply(self, src: str, request: MetaRequest) -> list[Effect]:
        try:
            result = self.apply(request.op, request.args)
        except BrokerError as exc:
            self.stats.refused += 1
            # nothing changed: answered at once (RabbitMQ's errors come before any change)
            return [Send(src, MetaReply(request.group, request.origin, request.request,
                                        exc.code, exc.reply_text, [], [-1, 0]))]
        self.stats.applied += 1
        names = [(request.args[0], request.args[1])] \
            if request.group and request.op in DIRECTORY_OPS \
            and not (request.op == "queue.declare" and request.args[2]) else []
        return [ReplyWhenDurable(request.group, src, MetaReply(
            request.group, request.origin, request.request, 0, "", result, [-1, 0]), names)]

    def poll(self, now: float) -> list[Effect]:
        """The metadata copy moved (or time passed): the held requests due now (past
        ``hold`` they are applied anyway: the leader's broker answers what it holds)."""
        out: list[Effect] = []
        held, self.held = self.held, []
        for due, src, request in held:
            epoch, seq = request.after
            if now < due and not self.metadata_reached(epoch, seq):
                self.held.append((due, src, request))
            elif not self.serves(request.group):
                out.append(Send(src, MetaReply(request.group, request.origin,
                                               request.request, NOT_PRIMARY,
                                               "not the group's leader", [], [-1, 0])))
            else:
                out += self._apply(src, request)
        return out

    def status(self) -> dict[str, Any]:
        return {"held": len(self.held), **vars(self.stats)}


# -- the operations on a broker, as the AMQP methods do them -----------------------------------


class BrokerOps:
    """``apply(op, args)`` on ``broker``: what ``amqp/methods/queue.py`` and
    ``exchange.py`` do after their permission checks, with no connection (a queue
    another connection holds exclusively here is 405, as for any other connection)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def apply(self, op: str, args: list[Any]) -> list[Any]:
        handler = getattr(self, "_" + op.replace(".", "_"), None)
        if handler is None or op not in QUEUE_OPS + EXCHANGE_OPS:
            raise AccessRefused(f"{op} is not a declaration")
        vhost = self.broker.vhosts.get(args[0])
        if vhost is None:
            raise NotAllowed(f"vhost {args[0]} not found")
        result: list[Any] = handler(vhost, *args[1:])
        return result

    @staticmethod
    def _queue_declare(vhost: Any, name: str, passive: bool, durable: bool, auto_delete: bool,
                       arguments: Mapping[str, Any] | None,
                       server_named: bool = False) -> list[Any]:
        """``server_named``: the asking node drew the ``amq.gen-`` name for a declare with
        no name (the prefix is refused otherwise, as on one node)."""
        queue = vhost.declare_queue(name, owner=None, passive=passive, durable=durable,
                                    exclusive=False, auto_delete=auto_delete,
                                    arguments=dict(arguments or {}),
                                    server_named=bool(server_named))
        return [queue.name, queue.message_count, queue.consumer_count]

    @staticmethod
    def _queue_bind(vhost: Any, name: str, exchange: str, key: str,
                    arguments: Mapping[str, Any] | None) -> list[Any]:
        queue = vhost.queue_for(name, None)
        vhost.exchange(exchange)  # 404 for a missing exchange, as the channel's
        vhost.bind(exchange, queue, key, dict(arguments or {}))
        return []

    @staticmethod
    def _queue_unbind(vhost: Any, name: str, exchange: str, key: str,
                      arguments: Mapping[str, Any] | None) -> list[Any]:
        queue, ex = vhost.queues.get(name), vhost.exchanges.get(exchange)
        args = dict(arguments or {})
        if queue is not None and ex is not None and vhost.has_binding(ex, queue, key, args):
            vhost.unbind(exchange, vhost.queue_for(name, None), key, args)
        return []

    @staticmethod
    def _queue_purge(vhost: Any, name: str) -> list[Any]:
        vhost.queue_for(name, None)
        return [vhost.purge_queue(name, None)]

    @staticmethod
    def _queue_delete(vhost: Any, name: str, if_unused: bool, if_empty: bool) -> list[Any]:
        if name not in vhost.queues:
            return [0]  # deleting a missing queue succeeds, as in RabbitMQ 3.x
        return [vhost.delete_queue(name, owner=None, if_unused=if_unused, if_empty=if_empty)]

    @staticmethod
    def _exchange_declare(vhost: Any, name: str, type_: str, passive: bool, durable: bool,
                          auto_delete: bool, internal: bool,
                          arguments: Mapping[str, Any] | None) -> list[Any]:
        vhost.declare_exchange(name, type_, passive=passive, durable=durable,
                               auto_delete=auto_delete, internal=internal,
                               arguments=dict(arguments or {}))
        return []

    @staticmethod
    def _exchange_delete(vhost: Any, name: str, if_unused: bool) -> list[Any]:
        if name in vhost.exchanges:
            vhost.delete_exchange(name, if_unused=if_unused)
        return []

    @staticmethod
    def _exchange_bind(vhost: Any, destination: str, source: str, key: str,
                       arguments: Mapping[str, Any] | None) -> list[Any]:
        dest = vhost.exchange(destination)
        vhost.exchange(source)
        vhost.bind(source, dest, key, dict(arguments or {}))
        return []

    @staticmethod
    def _exchange_unbind(vhost: Any, destination: str, source: str, key: str,
                         arguments: Mapping[str, Any] | None) -> list[Any]:
        dest = vhost.exchanges.get(destination)
        if dest is not None and source in vhost.exchanges:
            vhost.unbind(source, dest, key, dict(arguments or {}))
        return []


def copy_reached(member: Any, epoch: int, seq: int) -> bool:
    """Whether an ``HAMember``'s copy holds the log of the primary of ``epoch`` up to
    ``seq``: its primary's (of a later epoch, or of that one at or past ``seq``), or its
    caught-up backup's. A later epoch's copy holds it: the answer was sent once durable,
    so every later primary's log has it. None (no copy on this node): True."""
    if member is None:
        return True
    primary = member.primary
    if primary is not None:
        return bool(primary.epoch > epoch or (primary.epoch == epoch and primary.seq >= seq))
    backup = member.backup
    if backup is None or not backup.caught_up:
        return False
    return bool(backup.epoch > epoch or (backup.epoch == epoch and backup.applied_seq >= seq))


def copy_position(member: Any) -> list[int]:
    """[epoch, seq] of an ``HAMember``'s copy ([-1, 0] when it holds none valid)."""
    if member is None:
        return [-1, 0]
    primary = member.primary
    if primary is not None:
        return [primary.epoch, primary.seq]
    backup = member.backup
    if backup is None or not backup.caught_up:
        return [-1, 0]
    return [backup.epoch, backup.applied_seq]



# -- the node's wiring: its AMQP channels, its groups (node/ha_groups.py makes it) -------------


_METHOD_IDS = {"queue.declare": (50, 10), "queue.bind": (50, 20), "queue.purge": (50, 30),
               "queue.delete": (50, 40), "queue.unbind": (50, 50),
               "exchange.declare": (40, 10), "exchange.delete": (40, 20),
               "exchange.bind": (40, 30), "exchange.unbind": (40, 40)}


class NodeDeclarations:
    """A partitioned node's declarations: ``DeclarationRequests`` for its channels'
    methods of groups it does not serve, ``DeclarationHost`` for the groups it does."""

    def __init__(self, member: Any, origin: str, *, send: Callable[[str, Message], None],
                 soon: Callable[[Callable[[], None]], Any], clock: Callable[[], float]) -> None:
        self.member = member
        self.me: str = member.me
        self._send = send
        self._soon = soon
        self.clock = clock
        self.notices: dict[int, tuple[str, int]] = {}  # group -> (leader, epoch) announced
        self.requests = DeclarationRequests(origin, leader_of=self.leader_of,
                                            reached=self.reached)
        self.ops = BrokerOps(member.broker)
        self.host = DeclarationHost(serves=self.serves, metadata_reached=self._meta_reached,
                                    apply=self._apply)
        # the queue directory (partition/directory.py; the shell sets it): None, a queue's
        # method answers once its partition holds it, as before the directory
        self.directory: Any = None
        # the same, kept for the exclusive queues' owners alone when no partition's queues
        # are in it (N <= NR + 1: directory None); takes the owners' ``directory.update``
        self.owners: Any = None
        # request -> what asked it of this node itself (the directory's writer)
        self.internal: dict[int, Callable[[int, list[int]], None]] = {}
        # request -> (channel, answer(result) -> the method to send or None, op)
        self.channels: dict[int, tuple[Any, Callable[[list[Any]], Any], str]] = {}
        # request -> the management API's future (``request``)
        self.futures: dict[int, Any] = {}

    # -- what the core asks ----------------------------------------------------------------

    def leader_of(self, group: int) -> tuple[str, int] | None:
        member = self.member.groups.get(group)
        if member is not None:
            leader = member.election.primary
            return None if leader is None else (leader, member.election.epoch)
        return self.notices.get(group)

    def reached(self, group: int, epoch: int, seq: int) -> bool:
        return copy_reached(self.member.groups.get(group), epoch, seq)

    def _meta_reached(self, epoch: int, seq: int) -> bool:
        return copy_reached(self.member.metadata, epoch, seq)

    def serves(self, group: int) -> bool:
        member = self.member.groups.get(group)
        return member is not None and member.clients.term() is not None

    def _apply(self, op: str, args: list[Any]) -> list[Any]:
        if op == "directory.update":
            directory = self.directory if self.directory is not None else self.owners
            if directory is None:
                raise AccessRefused("this node keeps no queue directory")
            result: list[Any] = directory.apply(args)
            return result
        return self.ops.apply(op, args)

    def ask_internal(self, group: int, op: str, args: list[Any],
                     done: Callable[[int, list[int]], None]) -> None:
        """Ask ``op`` of the group's leader for this node itself: ``done(code, position)``
        (``position``: the group's log holding it, reached by this node's copy)."""
        request, out = self.requests.ask(self.clock(), group, op, args, [-1, 0])
        self.internal[request] = done
        self.carry_out(out)

    # -- the channels' methods (GroupClients.queue_remote, configuration_remote) --------------

    def queue_method(self, ch: Any, group: int, m: Any, name: str) -> None:
        from pamqp import commands

        from brokerha.amqp.frames import unchecked

        vhost = ch.vhost.name
        if isinstance(m, commands.Queue.Declare):
            op, args = "queue.declare", [vhost, name, m.passive, m.durable, m.auto_delete,
                                         dict(m.arguments or {})]
            if not m.queue and not m.passive:  # a name this node drew (``amq.gen-``)
                args.append(True)

            def answer(result: list[Any]) -> Any:
                ch.last_queue = result[0]
                # unchecked: pamqp holds names to ASCII, RabbitMQ takes any UTF-8
                return None if m.nowait else unchecked(
                    commands.Queue.DeclareOk, queue=result[0], message_count=result[1],
                    consumer_count=result[2])
        elif isinstance(m, commands.Queue.Bind | commands.Queue.Unbind):
            key = m.routing_key if (m.routing_key or m.queue) else name
            exchange = ch.vhost.exchanges.get(m.exchange)
            if exchange is not None and exchange.type == "topic":
                ch.user.check_topic("read", vhost, exchange.name, key)
            bind = isinstance(m, commands.Queue.Bind)
            op = "queue.bind" if bind else "queue.unbind"
            args = [vhost, name, m.exchange, key, dict(m.arguments or {})]
            nowait = bool(getattr(m, "nowait", False))

            def answer(result: list[Any]) -> Any:
                if nowait:
                    return None
                return commands.Queue.BindOk() if bind else commands.Queue.UnbindOk()
        elif isinstance(m, commands.Queue.Purge):
            op, args = "queue.purge", [vhost, name]

            def answer(result: list[Any]) -> Any:
                return None if m.nowait else commands.Queue.PurgeOk(message_count=result[0])
        elif isinstance(m, commands.Queue.Delete):
            op, args = "queue.delete", [vhost, name, m.if_unused, m.if_empty]

            def answer(result: list[Any]) -> Any:
                ch.conn.exclusive_queues.pop(name, None)
                return None if m.nowait else commands.Queue.DeleteOk(message_count=result[0])
        else:
            raise TypeError(f"not a queue method: {m!r}")
        self._ask(ch, group, op, args, answer)

    def exchange_method(self, ch: Any, m: Any) -> None:
        from pamqp import commands

        vhost = ch.vhost.name
        if isinstance(m, commands.Exchange.Declare):
            op, args = "exchange.declare", [vhost, m.exchange, m.exchange_type, m.passive,
                                            m.durable, m.auto_delete, m.internal,
                                            dict(m.arguments or {})]
            ok: Any = commands.Exchange.DeclareOk()
        elif isinstance(m, commands.Exchange.Delete):
            op, args = "exchange.delete", [vhost, m.exchange, m.if_unused]
            ok = commands.Exchange.DeleteOk()
        elif isinstance(m, commands.Exchange.Bind | commands.Exchange.Unbind):
            bind = isinstance(m, commands.Exchange.Bind)
            op = "exchange.bind" if bind else "exchange.unbind"
            args = [vhost, m.destination, m.source, m.routing_key, dict(m.arguments or {})]
            ok = commands.Exchange.BindOk() if bind else commands.Exchange.UnbindOk()
        else:
            raise TypeError(f"not an exchange method: {m!r}")
        nowait = bool(getattr(m, "nowait", False))
        self._ask(ch, 0, op, args, lambda result: None if nowait else ok)

    def _ask(self, ch: Any, group: int, op: str, args: list[Any],
             answer: Callable[[list[Any]], Any]) -> None:
        after = copy_position(self.member.metadata) if group else [-1, 0]
        request, out = self.requests.ask(self.clock(), group, op, args, after)
        self.channels[request] = (ch, answer, op)
        ch.block()  # the channel's later frames wait for the answer, in order
        self.carry_out(out)

    def request(self, group: int, op: str, args: list[Any]) -> Any:
        """The management API's request (no channel): an ``asyncio.Future`` of the leader's
        result, or of ``LeaderRefused``."""
        import asyncio

        future = asyncio.get_running_loop().create_future()
        after = copy_position(self.member.metadata) if group else [-1, 0]
        request, out = self.requests.ask(self.clock(), group, op, args, after)
        self.futures[request] = future
        self.carry_out(out)
        return future

    # -- the shell's calls ------------------------------------------------------------------

    def notice(self, notice: Any) -> None:
        """A ``LeaderNotice`` (``NodeForwarding``'s listeners): the leader of a group this
        node holds no copy of."""
        held = self.notices.get(notice.group)
        if held is None or notice.epoch >= held[1]:
            self.notices[notice.group] = (notice.node, notice.epoch)

    def on_packet(self, src: str, packet: Message) -> None:
        now = self.clock()
        if isinstance(packet, MetaRequest):
            self.carry_out(self.host.receive(now, src, packet))
        elif isinstance(packet, MetaReply):
            self.carry_out(self.requests.receive(now, src, packet))

    def moved(self) -> None:
        """Packets of the groups were applied: answers waiting for this node's copies, and
        requests held for its metadata copy."""
        if self.requests.pending:
            self.carry_out(self.requests.poll())
        if self.host.held:
            self.carry_out(self.host.poll(self.clock()))

    def tick(self) -> None:
        now = self.clock()
        if self.requests.pending:
            self.carry_out(self.requests.tick(now))
        if self.host.held:
            self.carry_out(self.host.poll(now))

    def link_lost(self, peer: str) -> None:
        self.carry_out(self.requests.link_lost(self.clock(), peer))

    # -- effects ----------------------------------------------------------------------------

    def carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Send):
                self._to_node(effect.node, effect.packet)
            elif isinstance(effect, ReplyWhenDurable):
                self._when_durable(effect)
            elif isinstance(effect, Answer):
                self._answer(effect)

    def _to_node(self, node: str, packet: Message) -> None:
        if node == self.me:  # this node's own host or requests: at the next turn
            self._soon(lambda: self.on_packet(self.me, packet))
        else:
            self._send(node, packet)

    def _when_durable(self, effect: ReplyWhenDurable) -> None:
        member = self.member.groups.get(effect.group)
        if member is None:
            return
        broker = self.member.broker
        reply = effect.reply

        def send() -> None:
            reply.position = copy_position(member)
            directory = self.directory
            if not effect.names or directory is None:
                self._to_node(effect.node, reply)
                return
            if directory.layer.unsafe.answer_before_directory:  # (unsafe) not waited for
                directory.writer.record(effect.group, effect.names, lambda meta: None)
                self._to_node(effect.node, reply)
                return

            def listed(meta: list[int] | None) -> None:
                if meta is None:  # the directory may lack it: the asker closes (320)
                    reply.code, reply.text = CONNECTION_FORCED, (
                        "the queue directory did not take the change "
                        f"of partition group {effect.group} (its leader changed): its "
                        "outcome is unknown")
                    reply.result = []
                else:
                    reply.position = reply.position[:2] + list(meta)
                self._to_node(effect.node, reply)

            directory.writer.record(effect.group, effect.names, listed)

        def durable() -> None:  # what a purge left to do per entry, then the gate
            broker.after_durable_in(member.durability_gate, send, member.barriers())

        if broker.background.pending:
            broker.background.after(durable)
        else:
            durable()

    def _answer(self, effect: Answer) -> None:
        from brokerha.amqp.channel import OPEN
        from brokerha.amqp.constants import INTERNAL_ERROR
        from brokerha.amqp.errors import AMQPError

        done = self.internal.pop(effect.request, None)
        if done is not None:
            done(effect.code, effect.position)
            return
        future = self.futures.pop(effect.request, None)
        if future is not None:
            if future.done():
                return
            if effect.code == 0:
                future.set_result(effect.result)
            else:
                future.set_exception(LeaderRefused(effect.code, effect.text))
            return
        held = self.channels.pop(effect.request, None)
        if held is None:
            return
        ch, answer, op = held
        if ch.state != OPEN:
            return  # the channel went meanwhile; what was asked happened or not
        class_id, method_id = _METHOD_IDS.get(op, (0, 0))
        if effect.code == 0:
            try:
                method = answer(effect.result)
            except Exception as exc:  # never a channel left blocked forever on a reply
                log.exception("answering %s on channel %s failed", op, ch.number)
                ch.conn.fail(ch, AMQPError(INTERNAL_ERROR, f"INTERNAL_ERROR - answering {op} "
                                           f"failed: {exc}", class_id, method_id))
                return
            if method is None:
                ch.unblock()
            else:
                ch.reply_unblocked(method)
            return
        if effect.code == CONNECTION_FORCED:
            class_id = method_id = 0
        ch.conn.fail(ch, AMQPError(effect.code, effect.text, class_id, method_id))

    def status(self) -> dict[str, Any]:
        return {"requests": self.requests.status(), "host": self.host.status()}
