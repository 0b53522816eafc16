"""Transactions across partitions (docs/ha.md "Transactions across partitions"), sans-I/O.

A TX whose queues live in several partitions commits on all of them or on
none. Two state machines, with no sockets, no asyncio and no clock of their
own (each input carries ``now``):

- ``CrossTx``, the **coordinator**, on the node the client is connected to:
  it names the transaction (``gtxid``, time-based, unique with the node),
  sends ``XPrepare`` to every participant partition's primary, then, all
  yes, ``XDecide(commit)`` to the **decision partition** (the lowest-numbered
  participant), and once that decision is durable ``XCommit`` to the others;
  a no or ``prepare_timeout`` makes it ``XDecide(rollback)`` then
  ``XRollback``. The client hears ``Answer`` once every participant
  acknowledged. It resends what is unanswered every ``retry`` seconds and at
  once to a partition's new leader (``leader_changed``): every packet is
  idempotent by gtxid.
- ``DecisionRules``, on each partition primary, the participant's side and
  the decider's. What makes it safe:

  (a) a participant commits a cross-partition branch only on ``XCommit``
      (sent by the coordinator after the decider's durable answer) or on
      the decider's answer to ``XOutcome``: never on its own;
  (b) the decider decides each gtxid once, in its log (its branch's commit
      and outcome record *are* the decision), and before it answers any
      ``XOutcome`` for a gtxid it has not decided it *writes* an abort (a
      ``rolled back`` outcome, the tombstone), and answers once that is
      durable: a late ``XDecide(commit)`` or ``XPrepare`` is then refused,
      by this primary or any later one. Presumed abort, made explicit.

  (c) an XA transaction (a client's ``dtx`` branch over several partitions)
      is prepared for its TM once the decider wrote its **all-prepared
      record** (``XHold``, over its own prepared, undecided branch; the
      client hears ``XA_OK`` once that is durable); from then on only the TM
      decides it (``CrossTx.finish``: ``XDecide``): the decider's timeout
      does not roll it back, and ``XOutcome`` is answered ``HELD``, no
      tombstone. Before the record, rule (b) applies (the TM heard no XA_OK).

  A participant whose branch stays prepared longer than ``resolve_timeout``
  (the coordinator died, or is slow) asks the decider ``XOutcome``; the
  decider's own branch, undecided that long, is rolled back by rule (b)
  with nobody asking.

The partition's transaction machinery is behind a narrow Protocol,
``PartitionTransactions``: the state of a gtxid's branch, prepare a branch,
commit or roll it back (each with its outcome record in the same store
batch), the prepared branches. Stage 4's integration backs it with today's
``DtxManager`` (an XA branch per gtxid, ``xid_of``: ``tb``/``te``/``td``/``tp``,
the backups' votes, the prepared record, which keeps the decider and the
participants in the xid) and ``TxOutcomes`` (the outcome records, kept with
their retention). Durability is the shell's: a
``WhenDurable`` effect is carried out once everything written so far is
durable on the partition's majority (``Broker.after_durable_in`` of the
partition's gate), and the shell reports the end of a prepare with
``DecisionRules.prepared`` (XA prepare answers once its record is durable).

Outputs are effects: ``ToPartition`` (to whoever leads that partition now),
``ToNode`` (to a coordinator), ``WhenDurable`` (one of those, once durable)
and ``Answer`` (the client's ``tx.commit-ok``, or the 406 of a refused
commit). The packets are frozen dataclasses whose fields are wire types, in
wire order; they get packet codes when the integration puts them on the mux.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from brokerha.broker.dtx import XTX_FORMAT as XTX_FORMAT  # its home: broker/dtx.py
from brokerha.broker.dtx import Xid, xtx_partition
from brokerha.broker.dtx import xtx_txid as xtx_txid
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK
from brokerha.broker.tx_outcomes import HELD as TX_HELD
from brokerha.partition.forward import ForwardMessage
from brokerha.seed_runner import UnsafeRules

PREPARE_TIMEOUT = 5.0  # [cluster] tx_prepare_timeout: every vote within this, else rollback
RESOLVE_TIMEOUT = 2.0  # xtx_resolve_timeout: a prepared branch older than this asks its decider
RETRY = 0.5            # an unanswered packet is sent again after this long
HOLD_RETRY = 10.0      # a participant told "prepared" (its XA branch awaits its TM) asks again
# the decider's answer for a gtxid whose all-prepared record it holds (the record's outcome)
HELD = TX_HELD


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of cross-partition commit to break on purpose (simulations only)."""

    # rule (a): the coordinator tells the participants to commit once all prepared, with
    # its XDecide, before the decision is durable
    commit_before_decision: bool = False
    # rule (b): the decider answers XOutcome for an undecided gtxid "rolled back" without
    # writing it (no tombstone; its branch stays prepared)
    presume_without_tombstone: bool = False
    # rule (c): the decider ignores an XA transaction's all-prepared record -- its own
    # branch is rolled back by the timeout and an XOutcome writes the tombstone -- so a
    # branch the TM was told is prepared (XA_OK) is decided without the TM
    presume_held_abort: bool = False
    # bounded memory: the decider leaves an all-prepared record a failover left held though
    # decided (only the decision's own rewrite ages one out): kept apart, in memory, for good
    keep_decided_holds: bool = False


class Status(enum.Enum):
    """What a partition holds of a gtxid's branch (``PartitionTransactions.status``)."""

    ABSENT = "absent"          # nothing: never prepared here, or lost with a failover
    PREPARING = "preparing"    # its prepare round is under way
    PREPARED = "prepared"      # prepared (durably when ``prepared`` was reported), undecided
    COMMITTED = COMMITTED      # its outcome record: committed
    ROLLED_BACK = ROLLED_BACK  # its outcome record: rolled back (a tombstone if it had no branch)

    @property
    def decided(self) -> bool:
        return self in (Status.COMMITTED, Status.ROLLED_BACK)


# -- what a branch does ---------------------------------------------------------------------


# A message the branch enqueues on its partition's queues (one routing of one publish) is a
# ``forward.ForwardMessage``: its queues named by their incarnation's ``x-ha-id``, as a
# forwarded publish names them (a queue deleted, or declared again, since the client
# published is left out), the same six fields on the wire.


@dataclass(frozen=True)
class XDequeue:
    """Entries the branch dequeues, by position (a consumer's acknowledgements), or with
    ``how`` ``requeue`` / ``reject`` its basic.reject/nack: requeued, or rejected (dead-
    lettered) at the commit; either way back to the queue at a rollback."""

    vhost: str
    queue: str
    positions: tuple[int, ...]
    how: str = "ack"  # "ack", "requeue", "reject" (remote_consumer.ACK, REQUEUE, REJECT)


XOp = ForwardMessage | XDequeue


@dataclass(frozen=True)
class XBranch:
    """One partition's share of a cross-partition transaction; its prepared record keeps it
    all (the decider and participants are what a new primary needs to resolve it)."""

    gtxid: str
    partition: int
    decider: int
    participants: tuple[int, ...]
    coordinator: str
    ops: tuple[XOp, ...] = ()


# A cross-partition branch is an XA branch of the partition's DtxManager whose xid says all
# a new primary needs to resolve it (format ``XTX_FORMAT``, broker/dtx.py; gtrid: the gtxid;
# bqual: ``<partition>/<decider>/<participants>``), so today's prepared record keeps it
# unchanged; its transaction id (tx-queue, outcome record) is ``xtx_txid``.
MAX_NODE_NAME = 64 - 20  # a gtxid is an XA gtrid: at most 64 bytes, 20 of them the time


def xid_of(branch: XBranch) -> Xid:
    """The XA xid of a cross-partition branch on its partition's ``DtxManager``."""
    bqual = f"{branch.partition}/{branch.decider}/{','.join(map(str, branch.participants))}"
    return Xid(XTX_FORMAT, branch.gtxid.encode(), bqual.encode())


def branch_of(xid: Xid) -> XBranch | None:
    """The branch an xid names (its ops and coordinator are not in it), None if not ours."""
    if xtx_partition(xid) is None:
        return None
    partition, decider, participants = xid.bqual.decode().split("/")
    return XBranch(xid.gtrid.decode(), int(partition), int(decider),
                   tuple(int(p) for p in participants.split(",")), "")


# -- packets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class XPrepare:
    """Coordinator -> participant primary: prepare this branch, answer ``XPrepared``."""

    branch: XBranch

    @property
    def gtxid(self) -> str:
        return self.branch.gtxid


@dataclass(frozen=True)
class XPrepared:
    """Participant -> coordinator: yes once the prepare is durable on its majority, or no."""

    gtxid: str
    partition: int
    ok: bool


@dataclass(frozen=True)
class XDecide:
    """Coordinator -> decider primary: decide (commit only if every participant said yes)."""

    gtxid: str
    commit: bool
    coordinator: str


@dataclass(frozen=True)
class XDecided:
    """Decider -> coordinator: the decision, once durable (not always the one asked for)."""

    gtxid: str
    outcome: str


@dataclass(frozen=True)
class XCommit:
    """Coordinator -> participant: the decider committed durably; commit the branch."""

    gtxid: str
    coordinator: str


@dataclass(frozen=True)
class XRollback:
    """Coordinator -> participant: the decision is rollback (a tombstone if nothing is held)."""

    gtxid: str
    coordinator: str


@dataclass(frozen=True)
class XFinished:
    """Participant -> coordinator: its outcome, durable."""

    gtxid: str
    partition: int
    outcome: str


@dataclass(frozen=True)
class XOutcome:
    """Participant -> decider: what became of a branch prepared too long ago?"""

    gtxid: str
    asker: int


@dataclass(frozen=True)
class XOutcomeReply:
    """Decider -> asking participant: the decision, durable (rule b: an abort written first);
    ``HELD`` for an XA transaction awaiting its TM (rule c: no tombstone, ask again later)."""

    gtxid: str
    outcome: str


@dataclass(frozen=True)
class XHold:
    """Coordinator -> decider, instead of ``XDecide`` for an XA prepare whose participants
    all said yes: write the all-prepared record (the TM's ``xid`` key and the participants)
    over your prepared, undecided branch; answer ``XDecided(HELD)`` once durable, or the
    decision already taken."""

    gtxid: str
    xid: str
    participants: list[int]
    coordinator: str


Packet = (XPrepare | XPrepared | XDecide | XDecided | XCommit | XRollback | XFinished
          | XOutcome | XOutcomeReply | XHold)


@dataclass(frozen=True)
class XRecover:
    """A node -> every partition's leader: your XA transactions awaiting their TM
    (``dtx.recover``, or a ``commit``/``rollback`` of an xid the node does not know)."""

    asker: str
    ref: int


@dataclass(frozen=True)
class XHeld:
    """A partition's leader -> the asking node: its all-prepared records not decided yet,
    each ``[xid key, gtxid, participants]``, durable."""

    ref: int
    partition: int
    entries: list[list[Any]]


Query = XRecover | XHeld


# -- effects --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToPartition:
    """Send to whoever leads ``partition`` now (none known: dropped, the sender retries)."""

    partition: int
    packet: Packet | Query


@dataclass(frozen=True)
class ToNode:
    """Send to a coordinator's node."""

    node: str
    packet: Packet | Query


@dataclass(frozen=True)
class WhenDurable:
    """Carry out ``send`` once everything written so far is durable on the majority."""

    send: ToPartition | ToNode


@dataclass(frozen=True)
class Answer:
    """The client's answer: ``tx.commit-ok``, or a refused commit (406) and why."""

    gtxid: str
    committed: bool
    reason: str = ""
    held: bool = False  # an XA prepare: every branch prepared and the all-prepared record durable


Effect = ToPartition | ToNode | WhenDurable | Answer


# -- the partition's transaction machinery ----------------------------------------------------


@dataclass(frozen=True)
class InDoubt:
    """A prepared cross-partition branch and when it was prepared."""

    branch: XBranch
    since: float


class PartitionTransactions(Protocol):
    """What ``DecisionRules`` needs of one partition primary's transactions.

    Stage 4 backs it with ``DtxManager`` (an XA branch per gtxid, ``xid_of``;
    ``branch_of`` reads a restored prepared branch's xid back) and
    ``TxOutcomes`` (outcome records by gtxid, in the same store batch as the
    commit or rollback: ``Transaction.commit_prepared`` and ``rollback`` record
    them so once a prepare started; a tombstone is ``TxOutcomes.record`` alone).
    """

    def status(self, gtxid: str) -> Status:
        """The outcome record if there is one, else the branch's state, else ABSENT."""
        ...

    def prepare(self, branch: XBranch) -> None:
        """Start the prepare round of a new branch (ABSENT -> PREPARING); the shell reports
        its end with ``DecisionRules.prepared`` once the prepared record is durable (or no)."""
        ...

    def commit(self, gtxid: str) -> None:
        """Commit the PREPARED branch and record ``committed`` in the same store batch."""
        ...

    def rollback(self, gtxid: str) -> None:
        """Roll back whatever is held (a prepare under way fails) and record ``rolled back``
        in the same batch; with nothing held, the record alone: the tombstone."""
        ...

    def in_doubt(self) -> Iterable[InDoubt]:
        """The PREPARED cross-partition branches."""
        ...

    def hold(self, gtxid: str, xid: str, participants: Sequence[int]) -> None:
        """Write the all-prepared record of an XA transaction (the decider's, over its
        PREPARED branch): durable on the majority when a later ``WhenDurable`` is."""
        ...

    def is_held(self, gtxid: str) -> bool:
        """Whether ``gtxid`` has an all-prepared record here."""
        ...

    def held_xa(self) -> Iterable[tuple[str, str, tuple[int, ...]]]:
        """The all-prepared records whose gtxid is not decided here: (xid key, gtxid,
        participants). A read: it changes nothing (``ctl status`` and ``XRecover`` call it)."""
        ...

    def unhold_decided(self) -> list[str]:
        """Record again ``decided`` every all-prepared record whose gtxid is decided here
        (its decision's own rewrite cut short by a failover: a new primary restored the
        decision but not the rewrite), so that it ages out; the gtxids rewritten."""
        ...


# -- the coordinator ---------------------------------------------------------------------------


class Phase(enum.Enum):
    PREPARING = "preparing"  # XPrepare out, votes coming
    DECIDING = "deciding"    # XDecide out, the decider's durable answer awaited
    FINISHING = "finishing"  # XCommit / XRollback out, acknowledgements awaited


@dataclass
class CrossCommit:
    """One commit under way on the coordinator."""

    gtxid: str
    branches: dict[int, tuple[XOp, ...]]
    started: float
    phase: Phase = Phase.PREPARING
    waiting: set[int] = field(default_factory=set)  # partitions whose answer is awaited
    commit: bool = True  # what was asked of the decider
    outcome: str | None = None  # the decider's
    reason: str = ""
    sent: float = 0.0  # when the waiting packets last went
    xa: str | None = None  # an XA prepare (the TM's xid key): hold at the decider, not commit

    @property
    def participants(self) -> tuple[int, ...]:
        return tuple(sorted(self.branches))

    @property
    def decider(self) -> int:
        return min(self.branches)


class CrossTx:
    """The coordinator of one node's cross-partition commits (docs/ha.md, steps 1-3)."""

    def __init__(self, node: str, *, prepare_timeout: float = PREPARE_TIMEOUT,
                 retry: float = RETRY, unsafe: Unsafe = Unsafe()) -> None:
        if not node or len(node.encode()) > MAX_NODE_NAME:
            raise ValueError(f"a coordinator's name is 1-{MAX_NODE_NAME} bytes (a gtxid is an "
                             "XA gtrid)")
        self.node = node
        self.prepare_timeout = prepare_timeout
        self.retry = retry
        self.unsafe = unsafe
        self.commits: dict[str, CrossCommit] = {}
        self._last_ns = 0

    def new_gtxid(self, now: float) -> str:
        """``<ns>-<node>``: nanoseconds, strictly increasing on this node (NEO's TID)."""
        ns = max(int(now * 1e9), self._last_ns + 1)
        self._last_ns = ns
        return f"{ns:019d}-{self.node}"

    def begin(self, now: float, branches: Mapping[int, Sequence[XOp]], *,
              xa: str | None = None) -> tuple[str, list[Effect]]:
        """Start committing ``branches`` (partition -> its ops): the XPrepare round.
        ``xa``: an XA prepare of the TM's xid (its key): all yes makes the decider hold the
        transaction for the TM (``XHold``) instead of committing it; ``Answer(held=True)``."""
        if not branches:
            raise ValueError("a cross-partition commit needs at least one partition")
        gtxid = self.new_gtxid(now)
        tx = CrossCommit(gtxid, {p: tuple(ops) for p, ops in branches.items()}, now, xa=xa)
        tx.waiting = set(tx.branches)
        self.commits[gtxid] = tx
        return gtxid, self._send_waiting(tx, now)

    def finish(self, now: float, gtxid: str, participants: Sequence[int],
               commit: bool) -> list[Effect]:
        """The TM's commit or rollback of an XA transaction held for it (steps 2-3), from
        any node: ``XDecide`` to the decider, then ``XCommit``/``XRollback`` to the others;
        ``Answer`` once all finished (``committed`` says the outcome)."""
        if gtxid in self.commits:
            raise ValueError(f"{gtxid} is under way on this coordinator")
        if not participants:
            raise ValueError("a transaction has at least one participant")
        tx = CrossCommit(gtxid, {p: () for p in participants}, now)
        self.commits[gtxid] = tx
        return self._decide(tx, now, commit, "" if commit else "rolled back by its TM")

    # -- inputs -------------------------------------------------------------------------------

    def receive(self, now: float, packet: Packet | Query) -> list[Effect]:
        if isinstance(packet, XRecover | XHeld):
            return []  # a recover's: the node's (``NodeTransactions``), not a commit's
        tx = self.commits.get(packet.gtxid)
        if tx is None:
            return []  # finished, or another incarnation's: nothing to do
        if isinstance(packet, XPrepared) and tx.phase is Phase.PREPARING:
            if packet.partition not in tx.waiting:
                return []
            if not packet.ok:
                return self._decide(tx, now, False, f"partition {packet.partition} refused to "
                                                    "prepare")
            tx.waiting.discard(packet.partition)
            return [] if tx.waiting else self._decide(tx, now, True, "")
        if isinstance(packet, XDecided) and tx.phase is Phase.DECIDING:
            if packet.outcome == HELD:
                if tx.xa is None or not tx.commit:
                    return []  # not what was asked: cannot be (a hold is asked only so)
                del self.commits[tx.gtxid]  # the TM's now: nothing of it lives here
                return [Answer(tx.gtxid, False, "", held=True)]
            return self._finish(tx, now, packet.outcome)
        if isinstance(packet, XFinished) and tx.phase is Phase.FINISHING:
            tx.waiting.discard(packet.partition)
            return [] if tx.waiting else self._done(tx)
        return []

    def tick(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        for tx in list(self.commits.values()):
            if tx.phase is Phase.PREPARING and now - tx.started >= self.prepare_timeout:
                out += self._decide(tx, now, False, "the prepare timed out ("
                                    f"partitions {sorted(tx.waiting)} did not answer)")
            elif now - tx.sent >= self.retry:
                out += self._send_waiting(tx, now)
        return out

    def leader_changed(self, now: float, partition: int) -> list[Effect]:
        """A new primary leads ``partition``: what it owes us goes to it at once."""
        out: list[Effect] = []
        for tx in self.commits.values():
            if partition in tx.waiting:
                out += self._send_waiting(tx, now, only=partition)
        return out

    # -- steps --------------------------------------------------------------------------------

    def _decide(self, tx: CrossCommit, now: float, commit: bool, reason: str) -> list[Effect]:
        tx.phase, tx.commit, tx.reason = Phase.DECIDING, commit, reason
        tx.waiting = {tx.decider}
        out = self._send_waiting(tx, now)
        if commit and self.unsafe.commit_before_decision and tx.xa is None:
            out += [ToPartition(p, XCommit(tx.gtxid, self.node))
                    for p in tx.participants if p != tx.decider]
        return out

    def _finish(self, tx: CrossCommit, now: float, outcome: str) -> list[Effect]:
        tx.phase, tx.outcome = Phase.FINISHING, outcome
        if tx.commit and outcome != COMMITTED:
            tx.reason = "the decision partition had rolled it back (its coordinator was late)"
        tx.waiting = {p for p in tx.participants if p != tx.decider}
        return self._send_waiting(tx, now) if tx.waiting else self._done(tx)

    def _done(self, tx: CrossCommit) -> list[Effect]:
        del self.commits[tx.gtxid]
        committed = tx.outcome == COMMITTED
        return [Answer(tx.gtxid, committed, "" if committed else tx.reason)]

    def _send_waiting(self, tx: CrossCommit, now: float, only: int | None = None) -> list[Effect]:
        tx.sent = now
        out: list[Effect] = []
        for p in sorted(tx.waiting):
            if only is not None and p != only:
                continue
            packet: Packet
            if tx.phase is Phase.PREPARING:
                packet = XPrepare(XBranch(tx.gtxid, p, tx.decider, tx.participants, self.node,
                                          tx.branches[p]))
            elif tx.phase is Phase.DECIDING and tx.xa is not None and tx.commit:
                packet = XHold(tx.gtxid, tx.xa, list(tx.participants), self.node)
            elif tx.phase is Phase.DECIDING:
                packet = XDecide(tx.gtxid, tx.commit, self.node)
            elif tx.outcome == COMMITTED:
                packet = XCommit(tx.gtxid, self.node)
            else:
                packet = XRollback(tx.gtxid, self.node)
            out.append(ToPartition(p, packet))
        return out


# -- the partition primary's side ----------------------------------------------------------------


class DecisionRules:
    """A partition primary's rules for cross-partition branches: participant and decider.

    Holds nothing that must survive the primary: what a new primary needs is
    in its store (the prepared records and the outcomes); what is lost here
    (a reply waiting for a prepare, when a query last went) is asked again by
    the coordinator's retries and the next ``tick``.
    """

    def __init__(self, partition: int, txs: PartitionTransactions, *,
                 resolve_timeout: float = RESOLVE_TIMEOUT, retry: float = RETRY,
                 hold_retry: float = HOLD_RETRY, unsafe: Unsafe = Unsafe()) -> None:
        self.partition = partition
        self.txs = txs
        self.resolve_timeout = resolve_timeout
        self.retry = retry
        self.hold_retry = hold_retry
        self.unsafe = unsafe
        self._preparing: dict[str, XBranch] = {}  # prepares under way: whom to answer
        self._asked: dict[str, float] = {}        # gtxid -> when its decider was last asked
        self._swept: float | None = None          # when decided holds were last looked for

    def receive(self, now: float, packet: Packet | Query) -> list[Effect]:
        if isinstance(packet, XRecover):
            return self._recover(packet)
        if isinstance(packet, XHold):
            return self._hold(packet)
        if isinstance(packet, XPrepare):
            return self._prepare(packet.branch)
        if isinstance(packet, XCommit):
            return self._commit(packet)
        if isinstance(packet, XRollback):
            return self._rollback(packet)
        if isinstance(packet, XOutcomeReply):
            return self._resolved(now, packet)
        if isinstance(packet, XDecide):
            return self._decide(packet)
        if isinstance(packet, XOutcome):
            return self._outcome(packet)
        return []  # a coordinator's packet: not ours

    def prepared(self, gtxid: str, ok: bool) -> list[Effect]:
        """The shell: the prepare round of ``gtxid`` ended (yes: its record is durable)."""
        branch = self._preparing.pop(gtxid, None)
        status = self.txs.status(gtxid)
        if not ok and status in (Status.PREPARING, Status.PREPARED):
            self.txs.rollback(gtxid)
        if branch is None:
            return []  # a primary before this one asked for it: the coordinator asks again
        yes = ok and status is Status.PREPARED
        return [self._vote(branch, yes)]

    def tick(self, now: float) -> list[Effect]:
        """Prepared branches older than ``resolve_timeout``: ask their decider (rule b)."""
        out: list[Effect] = []
        if self._swept is None or now - self._swept >= self.hold_retry:
            # what a failover left held though decided goes (as the participants ask again)
            self._swept = now
            self._unhold_decided()
        doubtful: set[str] = set()
        for doubt in list(self.txs.in_doubt()):
            branch = doubt.branch
            if now - doubt.since < self.resolve_timeout:
                continue
            if branch.decider == self.partition:
                if self._held(branch.gtxid):
                    continue  # rule (c): an XA transaction prepared for its TM, who decides
                # our own decision, still not taken: nobody will take it but us
                self.txs.rollback(branch.gtxid)
                continue
            doubtful.add(branch.gtxid)
            asked = self._asked.get(branch.gtxid)
            if asked is None or now - asked >= self.retry:
                self._asked[branch.gtxid] = now
                out.append(ToPartition(branch.decider, XOutcome(branch.gtxid, self.partition)))
        self._asked = {g: t for g, t in self._asked.items() if g in doubtful}
        return out

    # -- participant ------------------------------------------------------------------------

    def _vote(self, branch: XBranch, yes: bool) -> Effect:
        vote = ToNode(branch.coordinator, XPrepared(branch.gtxid, self.partition, yes))
        return WhenDurable(vote) if yes else vote  # a no is always safe to say

    def _prepare(self, branch: XBranch) -> list[Effect]:
        status = self.txs.status(branch.gtxid)
        if status is Status.ABSENT:
            self.txs.prepare(branch)
            self._preparing[branch.gtxid] = branch
            return []
        if status is Status.PREPARING:
            self._preparing[branch.gtxid] = branch  # answered when it ends
            return []
        # prepared or committed: yes again; rolled back (a tombstone, a no): no again
        return [self._vote(branch, status is not Status.ROLLED_BACK)]

    def _commit(self, packet: XCommit) -> list[Effect]:
        status = self.txs.status(packet.gtxid)
        if status is Status.PREPARED:
            self.txs.commit(packet.gtxid)
            status = Status.COMMITTED
        elif not status.decided:
            return []  # nothing prepared to commit (cannot happen after a durable yes)
        return [WhenDurable(ToNode(packet.coordinator,
                                   XFinished(packet.gtxid, self.partition, status.value)))]

    def _rollback(self, packet: XRollback) -> list[Effect]:
        status = self.txs.status(packet.gtxid)
        if not status.decided:
            self._preparing.pop(packet.gtxid, None)
            self.txs.rollback(packet.gtxid)
            status = Status.ROLLED_BACK
        return [WhenDurable(ToNode(packet.coordinator,
                                   XFinished(packet.gtxid, self.partition, status.value)))]

    def _resolved(self, now: float, packet: XOutcomeReply) -> list[Effect]:
        if packet.outcome == HELD:  # awaiting its TM (rule c): keep it, ask again later
            self._asked[packet.gtxid] = now + self.hold_retry - self.retry
            return []
        self._asked.pop(packet.gtxid, None)
        if self.txs.status(packet.gtxid) is Status.PREPARED:
            if packet.outcome == COMMITTED:
                self.txs.commit(packet.gtxid)
            else:
                self.txs.rollback(packet.gtxid)
        return []

    # -- decider ----------------------------------------------------------------------------

    def _decide(self, packet: XDecide) -> list[Effect]:
        status = self.txs.status(packet.gtxid)
        if not status.decided:
            if packet.commit and status is Status.PREPARING:
                return []  # our yes was never said: the coordinator cannot mean it yet
            if packet.commit and status is Status.PREPARED:
                self.txs.commit(packet.gtxid)  # its tc and outcome record: the decision
                status = Status.COMMITTED
            else:
                self._preparing.pop(packet.gtxid, None)
                self.txs.rollback(packet.gtxid)
                status = Status.ROLLED_BACK
        elif self.txs.is_held(packet.gtxid):  # decided by a primary before this one
            self._unhold_decided()
        return [WhenDurable(ToNode(packet.coordinator, XDecided(packet.gtxid, status.value)))]

    def _unhold_decided(self) -> None:
        if not self.unsafe.keep_decided_holds:
            self.txs.unhold_decided()

    def _held(self, gtxid: str) -> bool:
        """Rule (c): an all-prepared record holds ``gtxid`` for its TM."""
        return self.txs.is_held(gtxid) and not self.unsafe.presume_held_abort

    def _hold(self, packet: XHold) -> list[Effect]:
        status = self.txs.status(packet.gtxid)
        if status is Status.PREPARING:
            return []  # our yes was never said: the coordinator cannot mean it yet
        if status is Status.PREPARED:
            if not self.txs.is_held(packet.gtxid):
                self.txs.hold(packet.gtxid, packet.xid, tuple(packet.participants))
            return [WhenDurable(ToNode(packet.coordinator, XDecided(packet.gtxid, HELD)))]
        if not status.decided:  # nothing prepared: as an XDecide(commit) finding nothing
            self._preparing.pop(packet.gtxid, None)
            self.txs.rollback(packet.gtxid)
            status = Status.ROLLED_BACK
        return [WhenDurable(ToNode(packet.coordinator, XDecided(packet.gtxid, status.value)))]

    def _recover(self, packet: XRecover) -> list[Effect]:
        entries: list[list[Any]] = [[xid, gtxid, list(participants)]
                                    for xid, gtxid, participants in self.txs.held_xa()]
        return [WhenDurable(ToNode(packet.asker, XHeld(packet.ref, self.partition, entries)))]

    def _outcome(self, packet: XOutcome) -> list[Effect]:
        status = self.txs.status(packet.gtxid)
        if not status.decided:
            if self._held(packet.gtxid):  # rule (c): no tombstone; the TM decides
                return [WhenDurable(ToPartition(packet.asker,
                                                XOutcomeReply(packet.gtxid, HELD)))]
            if self.unsafe.presume_without_tombstone:
                return [ToPartition(packet.asker, XOutcomeReply(packet.gtxid, ROLLED_BACK))]
            self._preparing.pop(packet.gtxid, None)
            self.txs.rollback(packet.gtxid)  # the tombstone: a late XDecide(commit) is refused
            status = Status.ROLLED_BACK
        elif self.txs.is_held(packet.gtxid):  # a participant asking again: decided since
            self._unhold_decided()
        return [WhenDurable(ToPartition(packet.asker, XOutcomeReply(packet.gtxid, status.value)))]
