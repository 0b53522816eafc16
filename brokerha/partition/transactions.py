"""A partitioned node's transactions across partitions: ``partition/xtx.py`` over the node's
groups, its links and its AMQP channels (issue 35 stage 4, docs/ha.md "Transactions across
partitions").

The node's shell (``node/ha_groups.py``) hands in how to put a packet on a link
(``send``), how to run something at the next loop turn (``soon``); the channel's
``tx.commit`` (``amqp/methods/tx.py``, through ``partition/clients.py``'s
``GroupClients.tx_commit``) hands in the commits that span partitions. What it does:

- **The coordinator** (``CrossTx``, one per start of the node, named by the
  forward sender's origin ``<node>.<incarnation>``: a restarted node's gtxids
  are new even if its clock went back): ``commit(branches, answer)`` begins a
  commit, ``answer(committed, reason)`` is called with its ``Answer``. Its clock
  is the wall clock (``time.time``: a gtxid is ``<ns since 1970>-<origin>``).
- **The rules per group this node serves** (``DecisionRules`` over a
  ``BrokerTransactions`` of the partition, made in ``serving`` for that epoch,
  dropped in ``demoted``): packets to a partition are taken only while the
  member's role is of that epoch; ``WhenDurable`` passes that group's gate and
  barriers (``Broker.after_durable_in``): never, if the role is gone by then.
  Their clock is the broker's (a prepared branch's ``since``).
- **Leaders**: every ``LeaderNotice`` (``NodeForwarding.notice_listeners``)
  names a partition's serving primary; a newer one makes the coordinator send
  what that partition owes at once (``leader_changed``). A packet to a partition
  with no leader known is dropped: the sender's retries carry it.
- **The wire**: two cluster packets, dispatched by the shell before the mux
  (they name their target themselves): ``XtxToPartition(partition, kind, args)``
  (code 63; to the partition's leader: ``XPrepare``, ``XDecide``, ``XCommit``,
  ``XRollback``, ``XOutcome``, ``XOutcomeReply``) and ``XtxToNode(kind, args)``
  (code 64; to a coordinator: ``XPrepared``, ``XDecided``, ``XFinished``);
  ``kind`` indexes ``KINDS``, ``args`` are the packet's fields in order (an
  ``XPrepare``'s branch flattened, each op ``[0, *ForwardMessage]`` or
  ``[1, vhost, queue, positions]``). A packet for this node goes in process, at
  the next loop turn.

Test hook (``BROKERHA_XTX_HOLD``, e.g. ``decide=30`` or ``commit=30``): the
coordinator keeps back, for that many seconds from the first attempt, every
``XDecide`` (``decide``) or ``XCommit``/``XRollback`` (``commit``) it would send:
``tests/failover/test_partition_transactions.py`` kills the coordinator's node
between the prepares and the decision, or between the decision and the commits;
``hold=S`` keeps back an XA prepare's ``XHold`` (``tests/failover/test_partition_xa.py``:
the decider's timeout rolls its branch back first, the prepare answers XA_RBROLLBACK).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from brokerha.broker.broker import Broker
from brokerha.broker.errors import NotImplementedByBroker
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK, UNKNOWN
from brokerha.cluster.messages import Message, packet
from brokerha.partition.forward import ForwardMessage, LeaderNotice
from brokerha.partition.member import PartitionedMember
from brokerha.partition.xtx import (
    MAX_NODE_NAME,
    PREPARE_TIMEOUT,
    RETRY,
    Answer,
    CrossTx,
    DecisionRules,
    Effect,
    Packet,
    Query,
    ToNode,
    ToPartition,
    WhenDurable,
    XBranch,
    XCommit,
    XDecide,
    XDecided,
    XDequeue,
    XFinished,
    XHeld,
    XHold,
    XOp,
    XOutcome,
    XOutcomeReply,
    XPrepare,
    XPrepared,
    XRecover,
    XRollback,
)
from brokerha.partition.xtx_broker import BrokerTransactions, Held

log = logging.getLogger("brokerha.partition")

HOLD_ENV = "BROKERHA_XTX_HOLD"
# the messages of a transaction across partitions at most (headers and bodies): a
# partition's share goes whole in one XPrepare, and a packet over the link's MAX_PACKET
# (64 MiB) would fail the link, every group's traffic with it
XTX_MAX_BYTES = 48 * 1024 * 1024
# how long the node remembers an XA transaction it prepared for its TM (so that the TM's
# commit or rollback through this node asks its decider alone, not every partition): a TM
# that finishes it through another node leaves nothing here for good. An entry is a hint,
# never the answer: the decider must still hold that gtxid under that xid (an xid reused
# once its transaction was finished elsewhere is found through every partition)
XA_KNOWN_FOR = 60.0

Answered = Callable[[bool, str], None]
# an XA transaction held for its TM: (xid key, gtxid, participants)
HeldXa = tuple[str, str, tuple[int, ...]]
# dtx.recover's answer: the held transactions of every partition, or None and why not
Recovered = Callable[[list[HeldXa] | None, str], None]


@packet(63)
class XtxToPartition(Message):
    """A cross-partition transaction's packet to ``partition``'s leader (``KINDS[kind]``)."""

    partition: int
    kind: int
    args: list[Any]


@packet(64)
class XtxToNode(Message):
    """A cross-partition transaction's packet to its coordinator (``KINDS[kind]``)."""

    kind: int
    args: list[Any]


PACKETS = (XtxToPartition, XtxToNode)
KINDS: tuple[type, ...] = (XPrepare, XPrepared, XDecide, XDecided, XCommit, XRollback,
                           XFinished, XOutcome, XOutcomeReply, XHold, XRecover, XHeld)
_KIND = {kind: i for i, kind in enumerate(KINDS)}


def _op_wire(op: XOp) -> list[Any]:
    if isinstance(op, ForwardMessage):
        return [0, op.vhost, list(op.queues), op.exchange, op.routing_key, op.header, op.body]
    # a reject's (or nack's) ``how`` after the positions; an ack's left out, as before
    return [1, op.vhost, op.queue, list(op.positions), *([op.how] if op.how != "ack" else [])]


def _op_from(raw: Sequence[Any]) -> XOp:
    if int(raw[0]) == 0:
        return ForwardMessage.from_wire(list(raw[1:7]))
    _, vhost, queue, positions, *how = raw
    return XDequeue(str(vhost), str(queue), tuple(int(n) for n in positions),
                    str(how[0]) if how else "ack")


def encode(p: Packet | Query) -> tuple[int, list[Any]]:
    """``(kind, args)`` of a packet."""
    if isinstance(p, XPrepare):
        b = p.branch
        return _KIND[XPrepare], [b.gtxid, b.partition, b.decider, list(b.participants),
                                 b.coordinator, [_op_wire(op) for op in b.ops]]
    return _KIND[type(p)], [getattr(p, f.name) for f in fields(p)]


def decode(kind: int, args: list[Any]) -> Packet | Query:
    """The packet ``encode`` made; TypeError/ValueError/IndexError on a wrong shape."""
    cls = KINDS[kind]
    if cls is XPrepare:
        gtxid, partition, decider, participants, coordinator, ops = args
        return XPrepare(XBranch(str(gtxid), int(partition), int(decider),
                                tuple(int(q) for q in participants), str(coordinator),
                                tuple(_op_from(op) for op in ops)))
    names = [f.name for f in fields(cls)]
    if len(args) != len(names):
        raise TypeError(f"{cls.__name__} takes {len(names)} args, got {len(args)}")
    packet_: Packet | Query = cls(*args)
    return packet_


def node_of(coordinator: str) -> str:
    """The node of a coordinator named ``<node>.<incarnation>``."""
    return coordinator.rsplit(".", 1)[0]


def coordinator_name(origin: str) -> str | None:
    """The coordinator's name from the node's origin ``<node>.<incarnation>``: its
    incarnation shortened to fit a gtxid (``MAX_NODE_NAME`` bytes, at least 6 hex digits
    of it kept), None if the node's name is too long for that."""
    node, _, incarnation = origin.rpartition(".")
    room = MAX_NODE_NAME - len(node.encode()) - 1
    if room < min(6, len(incarnation)):
        return None
    return f"{node}.{incarnation[:room]}"


def parse_hold(text: str) -> dict[type, float]:
    """``BROKERHA_XTX_HOLD``: ``decide=S``, ``commit=S`` and/or ``hold=S`` (an XA prepare's
    ``XHold``), comma-separated."""
    hold: dict[type, float] = {}
    for part in filter(None, (t.strip() for t in text.split(","))):
        what, _, seconds = part.partition("=")
        if what == "decide":
            hold[XDecide] = float(seconds)
        elif what == "commit":
            hold[XCommit] = hold[XRollback] = float(seconds)
        elif what == "hold":
            hold[XHold] = float(seconds)
        else:
            raise ValueError(f"{HOLD_ENV}: {part!r} is not decide=S, commit=S or hold=S")
    return hold


class _Recover:
    """A ``dtx.recover`` under way: the partitions yet to answer, what the others hold."""

    __slots__ = ("answer", "waiting", "started", "sent", "held")

    def __init__(self, answer: Recovered, waiting: set[int], started: float) -> None:
        self.answer = answer
        self.waiting = waiting
        self.started = started
        self.sent = started
        self.held: dict[str, HeldXa] = {}


class _Rules:
    """One served group's rules, for the epoch they were made in."""

    __slots__ = ("group", "epoch", "rules", "txs")

    def __init__(self, group: int, epoch: int, rules: DecisionRules,
                 txs: BrokerTransactions) -> None:
        self.group = group
        self.epoch = epoch
        self.rules = rules
        self.txs = txs


# entries of a served group's queues a client's channel acknowledged in a transaction
# across partitions: handed to that group's branch (``BrokerTransactions.held``)
Acked = Sequence[tuple[Queue, Entry]]


class NodeTransactions:
    """The node's coordinator, its rules per served group, and the channels' answers."""

    def __init__(self, member: PartitionedMember, origin: str, *,
                 send: Callable[[str, Message], None], soon: Callable[[Callable[[], None]], Any],
                 wall: Callable[[], float] = time.time,
                 hold: Mapping[type, float] | None = None) -> None:
        self.member = member
        self.broker: Broker = member.broker
        self.me = member.me
        self._send = send
        self._soon = soon
        self.wall = wall
        # None: the node's name leaves no room for an incarnation in a gtxid (an XA gtrid,
        # 64 bytes): a commit across partitions is refused (540) on this node
        name = coordinator_name(origin)
        self.coordinator: CrossTx | None = None if name is None else CrossTx(name)
        self.rules: dict[int, _Rules] = {}
        self.leaders: dict[int, tuple[int, str]] = {}  # group -> (epoch, node) serving it
        self.answers: dict[str, Answered] = {}
        # per commit under way, the entries it handed to served groups' branches: what no
        # branch took by its answer (or by the group's demotion) goes back to its queue
        self._handed: dict[str, list[tuple[BrokerTransactions, Held, Queue]]] = {}
        self.hold = dict(hold if hold is not None else parse_hold(os.environ.get(HOLD_ENV, "")))
        self._held: dict[tuple[str, type], float] = {}  # (gtxid, packet type) -> held until
        self.stats: dict[str, int] = {"begun": 0, "committed": 0, "refused": 0, "held": 0,
                                      "not_serving": 0, "no_leader": 0, "xa_prepared": 0,
                                      "xa_finished": 0, "xa_recovers": 0, "xa_known_stale": 0}
        # XA (docs/ha.md "XA over partitions"): the prepares under way (gtxid -> the TM's
        # xid key), the transactions this node prepared for their TM (xid key -> gtxid,
        # participants: its commit or rollback needs no recover), the recovers under way
        self._xa_prepares: dict[str, str] = {}
        self._participants: dict[str, tuple[int, ...]] = {}
        self._finishing: set[str] = set()  # the TM's finishes under way (not commits begun)
        self.xa_known: dict[str, tuple[str, tuple[int, ...], float]] = {}
        self._recovers: dict[int, _Recover] = {}
        self._ref = 0

    # -- the channel's side (GroupClients.tx_commit) ---------------------------------------

    def commit(self, branches: Mapping[int, Sequence[XOp]], answer: Answered,
               acked: Mapping[int, Acked] | None = None, *, xa: str | None = None,
               rejected: Mapping[int, Sequence[tuple[Queue, Entry, bool]]] | None = None,
               hand_over: Callable[[str], None] | None = None) -> str:
        """Commit ``branches`` (partition -> its ops) across their partitions; ``answer
        (committed, reason)`` once the coordinator has its ``Answer``. ``acked``: per
        group this node serves, the entries the client acknowledged (acquired by its
        channel's deliveries): dequeued by that partition's branch (``XDequeue``, added
        here), which holds them from its prepare (requeued by its rollback); those no
        branch took when the answer comes are requeued here. ``xa``: an XA prepare of the
        TM's xid (its key): ``answer(True, "")`` once every branch prepared and the decider
        holds it for the TM (``XA_OK``), ``answer(False, why)`` once rolled back.
        ``rejected``: as ``acked``, the entries the client rejected or nacked (requeue or
        not), settled so by the branch at its commit. ``hand_over(gtxid)``: called once the
        commit is named, before any prepare is sent (a remote consumer's node hands what
        the client settled to the branches on the primaries that delivered it, on the same
        links: ``partition/consuming.py``)."""
        if self.coordinator is None:
            raise NotImplementedByBroker(
                f"a transaction across partitions on node {self.me}: its name is too long "
                f"for a transaction id (at most {MAX_NODE_NAME - 7} bytes)")
        acked = acked or {}
        rejected = rejected or {}
        for group in [*acked, *rejected]:
            if group not in self.rules:  # checked first: nothing handed over if refused
                raise NotImplementedByBroker(f"acknowledgements of group {group}'s messages "
                                             "in a transaction: this node does not lead it")
        ops = {p: list(o) for p, o in branches.items()}
        handed: list[tuple[BrokerTransactions, Held, Queue]] = []
        settled = {g: [(q, e, "ack") for q, e in entries] for g, entries in acked.items()}
        for group, rejects in rejected.items():
            settled.setdefault(group, []).extend(
                (q, e, "requeue" if requeue else "reject") for q, e, requeue in rejects)
        for group, entries_how in settled.items():
            own = self.rules[group]
            positions: dict[tuple[str, str, str], list[int]] = {}
            for queue, entry, how in entries_how:
                key = (queue.vhost, queue.name, entry.position)
                own.txs.held[key] = entry
                handed.append((own.txs, key, queue))
                positions.setdefault((queue.vhost, queue.name, how), []).append(entry.position)
            ops.setdefault(group - 1, []).extend(
                XDequeue(vhost, name, tuple(ns), how)
                for (vhost, name, how), ns in positions.items())
        gtxid, effects = self.coordinator.begin(self.wall(), ops, xa=xa)
        if hand_over is not None:
            hand_over(gtxid)
        self.answers[gtxid] = answer
        if xa is not None:
            self._xa_prepares[gtxid] = xa
            self._participants[gtxid] = tuple(sorted(ops))
        if handed:
            self._handed[gtxid] = handed
        self.stats["begun"] += 1
        self.carry_out(effects)
        return gtxid

    # -- XA held for its TM (docs/ha.md "XA over partitions") ---------------------------------

    def xa_finish(self, xid: str, commit: bool, answer: Callable[[str, str], None]) -> None:
        """The TM's commit (or rollback) of the XA transaction of ``xid`` (its key) held
        for it: ``answer(outcome, why)`` -- ``committed``/``rolled back`` once every
        participant finished durably, ``unknown`` when no partition holds it, ``failed``
        when that cannot be told now (a partition without a leader or an answer)."""
        def found(held: list[HeldXa] | None, why: str) -> None:
            if held is None:
                answer("failed", why)
                return
            for key, gtxid, participants in held:
                if key == xid:
                    self._xa_finish(xid, gtxid, participants, commit, answer)
                    return
            answer(UNKNOWN, f"no partition holds xid {xid} prepared")

        known = self.xa_known.get(xid)
        if known is None or not known[1]:
            self.xa_recover(found)
            return
        gtxid, participants = known[0], known[1]

        def checked(held: list[HeldXa] | None, why: str) -> None:
            # what this node prepared, still held under that xid by its decider: finish it;
            # else (finished through another node, the xid since reused for another
            # transaction) the entry is stale: dropped, the partitions asked
            if held is not None and any(k == xid and g == gtxid for k, g, _ in held):
                self._xa_finish(xid, gtxid, participants, commit, answer)
                return
            if self.xa_known.get(xid) == known:
                del self.xa_known[xid]
            if held is None:
                answer("failed", why)
                return
            self.stats["xa_known_stale"] += 1
            self.xa_recover(found)

        # asked of the decider alone (one round trip to one leader, not to every
        # partition's): a TM may reuse an xid once its transaction is finished, and one
        # finished through another node left its entry here
        self._recover_from((min(participants),), checked)

    def _xa_finish(self, xid: str, gtxid: str, participants: tuple[int, ...], commit: bool,
                   answer: Callable[[str, str], None]) -> None:
        coordinator = self.coordinator
        if coordinator is None or gtxid in coordinator.commits:
            answer("failed", f"xid {xid} is being finished on this node already")
            return

        def done(committed: bool, why: str) -> None:
            self.xa_known.pop(xid, None)
            self.stats["xa_finished"] += 1
            answer(COMMITTED if committed else ROLLED_BACK, why)

        self.answers[gtxid] = done
        self._finishing.add(gtxid)
        self.carry_out(coordinator.finish(self.wall(), gtxid, participants, commit))

    def xa_recover(self, answer: Recovered) -> None:
        """Every partition's XA transactions held for their TM (``XRecover`` to each
        leader): ``answer(held, "")`` once all answered, ``answer(None, why)`` after
        ``PREPARE_TIMEOUT`` without (never a short list)."""
        table = self.member.table
        if self.coordinator is None or table is None:
            answer(None, "this node has no coordinator or no partition table")
            return
        self.stats["xa_recovers"] += 1
        self._recover_from(range(table.partitions), answer)

    def _recover_from(self, partitions: Sequence[int], answer: Recovered) -> None:
        """``XRecover`` to the leaders of ``partitions``; ``answer`` as ``xa_recover``'s."""
        if self.coordinator is None:
            answer(None, "this node has no coordinator")
            return
        self._ref += 1
        now = self.wall()
        recover = self._recovers[self._ref] = _Recover(answer, set(partitions), now)
        self._ask_recover(self._ref, recover, now)

    def _ask_recover(self, ref: int, recover: _Recover, now: float) -> None:
        assert self.coordinator is not None
        recover.sent = now
        for p in sorted(recover.waiting):
            self._send_to_partition(ToPartition(p, XRecover(self.coordinator.node, ref)),
                                    coordinator=True)

    def _recovered(self, reply: XHeld) -> None:
        recover = self._recovers.get(reply.ref)
        if recover is None or reply.partition not in recover.waiting:
            return
        recover.waiting.discard(reply.partition)
        for xid, gtxid, participants in reply.entries:
            recover.held[str(gtxid)] = (str(xid), str(gtxid), tuple(int(p) for p in participants))
        if not recover.waiting:
            del self._recovers[reply.ref]
            recover.answer(sorted(recover.held.values()), "")

    def _tick_recovers(self, now: float) -> None:
        for ref, recover in list(self._recovers.items()):
            if now - recover.started >= PREPARE_TIMEOUT:
                del self._recovers[ref]
                recover.answer(None, f"partitions {sorted(recover.waiting)} did not answer "
                                     f"within {PREPARE_TIMEOUT:.0f} s (no leader?)")
            elif now - recover.sent >= RETRY:
                self._ask_recover(ref, recover, now)

    # -- the groups' roles (the shell) -----------------------------------------------------

    def serving(self, group: int, epoch: int) -> None:
        placement = self.member.placement
        assert placement is not None
        partition = group - 1
        holder: list[_Rules] = []

        def prepared(gtxid: str, ok: bool) -> None:
            own = holder[0]
            if self.rules.get(group) is own:  # else demoted since: the coordinator asks again
                self.carry_out(own.rules.prepared(gtxid, ok), group)

        txs = BrokerTransactions(self.broker, partition, prepared, placement.of(partition))
        own = _Rules(group, epoch, DecisionRules(partition, txs), txs)
        holder.append(own)
        self.rules[group] = own

    def demoted(self, group: int) -> None:
        own = self.rules.pop(group, None)
        if own is not None:  # entries handed over and not taken: back to their queues
            for handed in self._handed.values():
                self._requeue([h for h in handed if h[0] is own.txs])

    def leader(self, notice: LeaderNotice) -> None:
        """A group's serving primary (``NodeForwarding``'s notices)."""
        known = self.leaders.get(notice.group)
        if known is not None and known[0] > notice.epoch:
            return
        self.leaders[notice.group] = (notice.epoch, notice.node)
        if known != (notice.epoch, notice.node) and self.coordinator is not None:
            self.carry_out(self.coordinator.leader_changed(self.wall(), notice.group - 1))

    def tick(self) -> None:
        out: list[tuple[Effect, int | None]] = []
        if self.coordinator is not None:
            out += [(e, None) for e in self.coordinator.tick(self.wall())]
        wall = self.wall()
        self._tick_recovers(wall)
        for xid in [x for x, known in self.xa_known.items() if wall - known[2] > XA_KNOWN_FOR]:
            del self.xa_known[xid]
        now = self.broker.clock()
        for own in list(self.rules.values()):
            out += [(e, own.group) for e in own.rules.tick(now)]
        for effect, group in out:
            self.carry_out([effect], group)

    # -- packets -----------------------------------------------------------------------------

    def on_packet(self, src: str, message: Message) -> None:
        try:
            if isinstance(message, XtxToPartition):
                self._to_partition(int(message.partition), decode(message.kind, message.args))
            elif isinstance(message, XtxToNode):
                self._to_coordinator(decode(message.kind, message.args))
        except (TypeError, ValueError, IndexError) as exc:
            log.warning("a malformed cross-partition transaction packet from %s: %s", src, exc)

    def _to_partition(self, partition: int, p: Packet | Query) -> None:
        group = partition + 1
        own = self.rules.get(group)
        member = self.member.groups.get(group)
        if own is None or member is None or member.role_term() != own.epoch:
            self.stats["not_serving"] += 1  # the sender retries, to the next leader
            return
        self.carry_out(own.rules.receive(self.broker.clock(), p), group)

    def _to_coordinator(self, p: Packet | Query) -> None:
        if isinstance(p, XHeld):
            self._recovered(p)
        elif isinstance(p, XRecover):
            return  # a partition's packet: not a coordinator's
        elif self.coordinator is not None:
            self.carry_out(self.coordinator.receive(self.wall(), p))

    # -- effects -------------------------------------------------------------------------------

    def carry_out(self, effects: Sequence[Effect], group: int | None = None) -> None:
        """``group``: the served group whose rules made these effects (its gate answers
        their ``WhenDurable``); None: the coordinator's."""
        for effect in effects:
            if isinstance(effect, WhenDurable):
                self._when_durable(effect.send, group)
            elif isinstance(effect, ToPartition):
                self._send_to_partition(effect, coordinator=group is None)
            elif isinstance(effect, ToNode):
                self._send_to_node(effect)
            elif isinstance(effect, Answer):
                self._answer(effect)

    def _when_durable(self, send: ToPartition | ToNode, group: int | None) -> None:
        member = None if group is None else self.member.groups.get(group)
        if member is None:
            return
        self.broker.after_durable_in(member.durability_gate, lambda: self.carry_out([send]),
                                     member.barriers())

    def _send_to_partition(self, effect: ToPartition, coordinator: bool) -> None:
        p = effect.packet
        if coordinator and not isinstance(p, XRecover | XHeld) and self._holding(p):
            return
        leader = self.leaders.get(effect.partition + 1)
        if leader is None:
            self.stats["no_leader"] += 1
            return
        node = leader[1]
        if node == self.me:
            partition = effect.partition
            self._soon(lambda: self._to_partition(partition, p))
            return
        kind, args = encode(p)
        self._send(node, XtxToPartition(effect.partition, kind, args))

    def _send_to_node(self, effect: ToNode) -> None:
        node, p = node_of(effect.node), effect.packet
        if node == self.me:
            self._soon(lambda: self._to_coordinator(p))
            return
        kind, args = encode(p)
        self._send(node, XtxToNode(kind, args))

    def _holding(self, p: Packet) -> bool:
        """The test hook: keep this packet back (its retries carry it once the hold ends)."""
        seconds = self.hold.get(type(p))
        if seconds is None:
            return False
        now = time.monotonic()
        key = (p.gtxid, type(p))
        until = self._held.get(key)
        if until is None:
            until = self._held[key] = now + seconds
            self.stats["held"] += 1
            log.warning("node %s holds back %s of %s for %.1f s (%s)", self.me,
                        type(p).__name__, p.gtxid, seconds, HOLD_ENV)
        return now < until

    def _requeue(self, handed: list[tuple[BrokerTransactions, Held, Queue]]) -> None:
        for txs, key, queue in handed:
            entry = txs.held.pop(key, None)
            if entry is not None and not queue.deleted:
                queue.requeue(entry)
                if queue.consumers:
                    queue.dispatch()

    def _answer(self, effect: Answer) -> None:
        xa = self._xa_prepares.pop(effect.gtxid, None)
        if xa is not None and (effect.held or effect.committed):
            # held for the TM (or, a TM's commit raced ahead, committed): its finish here
            # needs no recover
            self.stats["xa_prepared"] += 1
            participants = self._participants.pop(effect.gtxid, ())
            if effect.held:
                self.xa_known[xa] = (effect.gtxid, participants, self.wall())
            answer = self.answers.pop(effect.gtxid, None)
            self._requeue(self._handed.pop(effect.gtxid, []))
            for key in [k for k in self._held if k[0] == effect.gtxid]:
                del self._held[key]
            if answer is not None:
                answer(True, "")
            return
        self._participants.pop(effect.gtxid, None)
        if effect.gtxid in self._finishing:  # counted in xa_finished
            self._finishing.discard(effect.gtxid)
        else:
            self.stats["committed" if effect.committed else "refused"] += 1
        self._requeue(self._handed.pop(effect.gtxid, []))
        for key in [k for k in self._held if k[0] == effect.gtxid]:
            del self._held[key]
        answer = self.answers.pop(effect.gtxid, None)
        if answer is not None:
            answer(effect.committed, effect.reason)

    def status(self) -> dict[str, Any]:
        """For ``ctl status --json`` (the node's ``transactions``)."""
        coordinator = self.coordinator
        commits = {gtxid: {"phase": tx.phase.value, "participants": list(tx.participants),
                           "waiting": sorted(tx.waiting)}
                   for gtxid, tx in (coordinator.commits if coordinator else {}).items()}
        in_doubt = {str(g): len(list(own.txs.in_doubt()))
                    for g, own in sorted(self.rules.items())}
        # XA transactions held for their TM whose decider is a group served here
        xa_held = {str(g): len(list(own.txs.held_xa())) for g, own in sorted(self.rules.items())}
        return {"coordinator": coordinator and coordinator.node, "commits": commits,
                "in_doubt": in_doubt, "xa_held": xa_held, "xa_known": len(self.xa_known),
                "rules": {str(g): own.epoch for g, own in sorted(self.rules.items())},
                **self.stats}
