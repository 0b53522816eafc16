"""``PartitionTransactions`` over a partition primary's ``Broker`` (docs/ha.md "Transactions
across partitions").

``BrokerTransactions`` is what ``DecisionRules`` of partition ``p`` runs on,
on the node that leads ``p``: the broker's ``DtxManager`` holds one XA branch
per gtxid (``xid_of``: its prepared record, a backup's ``tp``, keeps the
decider and the participants in the xid), and its ``TxOutcomes`` the
outcome records, under the branch's name ``xtx_txid(p, gtxid)`` (its
transaction id, so also its tx-queue's on the group's backups). So the
records are today's, stored and replicated today's way:

- a commit is ``DtxManager.commit_prepared``: the branch's ``tc`` carries
  the commit and its backups record ``committed`` under that name with it
  (``TransactionReplicator._finish``), in the same store batch;
- a rollback of a prepared branch is its ``tr``, recorded likewise;
- a rollback of what was never prepared on the backups (a branch still
  preparing or not replicated, or nothing at all: the decider's tombstone)
  is the record alone, sent to the group's backups as a ``to`` event of its
  own (``TxOutcomes.replicate``, which the group's HA primary emits).

Every record is written in the loop callback of the change it records,
hence in its store batch; ``DecisionRules`` answers once it is durable on
the partition's majority (``WhenDurable``, the shell's ``after_durable_in``
of the group's gate). A branch's group is in its name
(``tx_outcomes.group_of``): a partitioned node's other groups' catch-ups
and demotions leave it alone.

The node's shell (a partition group's member, ``partition/member.py``) is
not wired to it yet; ``tests/partition/test_xtx_dtx.py`` runs ``CrossTx``
and ``DecisionRules`` over two real brokers with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from brokerha.broker.broker import Broker
from brokerha.broker.dtx import XA, DtxBranch, State, XAError, xtx_partition
from brokerha.broker.message import Entry, Message
from brokerha.broker.queue import Queue
from brokerha.broker.tx_outcomes import COMMITTED, DECIDED, ROLLED_BACK, in_group
from brokerha.cluster.replication import HA_ID
from brokerha.partition.forward import ForwardMessage
from brokerha.partition.xtx import (
    HELD,
    InDoubt,
    Status,
    XBranch,
    branch_of,
    xid_of,
    xtx_txid,
)

log = logging.getLogger(__name__)

# (vhost, queue, position) of an entry a remote consumer holds for a client's channel
Held = tuple[str, str, int]

HOLD_PREFIX = "xa:"  # an all-prepared record's name after its group: g<p+1>/xa:<gtxid>


def hold_client_id(xid: str, participants: Sequence[int]) -> str:
    """The client id of an all-prepared record: ``xa:<participants>:<xid key>``."""
    return f"{HOLD_PREFIX}{','.join(map(str, participants))}:{xid}"


def parse_hold_client_id(client_id: str) -> tuple[str, tuple[int, ...]] | None:
    """(xid key, participants) of an all-prepared record's client id; None if not one."""
    if not client_id.startswith(HOLD_PREFIX):
        return None
    participants, _, xid = client_id[len(HOLD_PREFIX):].partition(":")
    try:
        return xid, tuple(int(p) for p in participants.split(","))
    except ValueError:
        return None


class BrokerTransactions:
    """``PartitionTransactions`` of partition ``partition`` over ``broker``.

    ``prepared(gtxid, ok)`` is the shell's report that a prepare round ended
    (``DecisionRules.prepared``, carried out): yes once the prepared record
    is durable, as XA ``prepare`` answers. ``held`` is what the remote
    consumers of this partition's queues hold by (vhost, queue, position):
    an ``XDequeue`` accepts those entries; one no longer held (a failover
    requeued it) ends the branch ``fail``, a no.
    """

    def __init__(self, broker: Broker, partition: int,
                 prepared: Callable[[str, bool], None],
                 in_partition: Callable[[Queue], bool] | None = None) -> None:
        """``in_partition``: whether a queue is this partition's (``PartitionScope.of``): a
        publish names its queues by ``x-ha-id``, unique within the partition's group only
        (None: every queue of the broker, a broker holding one partition)."""
        self.broker = broker
        self.partition = partition
        self.prepared = prepared
        self.in_partition = in_partition
        self.held: dict[Held, Entry] = {}
        self._owner = object()  # the "channel" a branch is associated with while it is built
        # gtxids whose rollback was decided while their prepare ran: rolled back when it ends
        self._doomed: set[str] = set()

    def txid(self, gtxid: str) -> str:
        """The branch's transaction id and the name of its outcome record."""
        return xtx_txid(self.partition, gtxid)

    def _branch(self, gtxid: str) -> DtxBranch | None:
        want = gtxid.encode()
        for xid, branch in self.broker.dtx.branches.items():
            if xid.gtrid == want and xtx_partition(xid) == self.partition:
                return branch
        return None

    # -- PartitionTransactions ----------------------------------------------------------

    def status(self, gtxid: str) -> Status:
        record = self.broker.outcomes.get(self.txid(gtxid))
        if record is not None:
            return Status.COMMITTED if record[2] == COMMITTED else Status.ROLLED_BACK
        branch = self._branch(gtxid)
        if branch is None:
            return Status.ABSENT
        return Status.PREPARED if branch.state is State.PREPARED else Status.PREPARING

    def prepare(self, branch: XBranch) -> None:
        dtx, xid = self.broker.dtx, xid_of(branch)
        work = dtx.start(xid, self._owner)
        missing = False
        by_id: dict[str, dict[str, Queue]] = {}  # vhost -> x-ha-id -> queue, once a prepare
        for op in branch.ops:
            vhost = self.broker.vhosts.get(op.vhost)
            if isinstance(op, ForwardMessage):
                held = by_id.get(op.vhost)
                if held is None:
                    held = by_id[op.vhost] = self._by_ha_id(op.vhost)
                queues = [q for i in op.queues if (q := held.get(i)) is not None]
                if queues:  # a queue deleted meanwhile: the message routed to none there
                    work.publish(queues, Message(op.exchange, op.routing_key, op.header,
                                                 op.body))
                continue
            queue = vhost.queues.get(op.queue) if vhost is not None else None
            keys = [(op.vhost, op.queue, n) for n in op.positions]
            if queue is None:
                missing = True
                continue
            taken = [(queue, self.held.pop(k)) for k in keys if k in self.held]
            missing |= len(taken) != len(keys)
            if taken and op.how == "ack":
                work.accept(taken, [])
            elif taken:  # a reject or nack: requeued, or rejected (dead-lettered), at commit
                work.reject(taken, op.how == "requeue")
        dtx.end(xid, self._owner, fail=missing)
        outcome: list[XA] = []

        async def prepare() -> None:
            outcome.append(await dtx.prepare(xid))

        def ended(error: BaseException | None) -> None:
            ok = error is None and outcome == [XA.OK]
            if error is not None and not isinstance(error, XAError):
                log.error("prepare of %s failed: %r", self.txid(branch.gtxid), error)
            if branch.gtxid in self._doomed:  # rolled back meanwhile: a no, whatever it was
                self._doomed.discard(branch.gtxid)
                self._roll_back_branch(branch.gtxid)
                ok = False
            self.prepared(branch.gtxid, ok)

        self.broker.spawn(prepare(), ended)

    def commit(self, gtxid: str) -> None:
        work = self._branch(gtxid)
        if work is None or work.state is not State.PREPARED:
            raise XAError(XA.ER_PROTO, f"commit of {self.txid(gtxid)}, not prepared here")
        self.broker.dtx.commit_prepared(work.xid)  # its tc, its outcome record
        self._record(gtxid, COMMITTED, replicate=False)
        self._unhold(gtxid)

    def rollback(self, gtxid: str) -> None:
        work = self._branch(gtxid)
        if work is not None and work.preparing:
            # its prepare round is under way (the votes, the record): it ends first and
            # the branch goes then; the decision is this record, now
            self._doomed.add(gtxid)
        elif work is not None:
            self._roll_back_branch(gtxid)
        self._record(gtxid, ROLLED_BACK, replicate=True)
        self._unhold(gtxid)

    def in_doubt(self) -> Iterable[InDoubt]:
        out = []
        for xid, work in self.broker.dtx.branches.items():
            if work.state is not State.PREPARED or xtx_partition(xid) != self.partition:
                continue
            branch = branch_of(xid)
            if branch is not None and self.broker.outcomes.get(work.id) is None:
                out.append(InDoubt(branch, work.started))
        return out

    def hold_txid(self, gtxid: str) -> str:
        """The name of the all-prepared record of an XA transaction whose decider this
        partition is (rule c, ``partition/xtx.py``): ``g<p+1>/xa:<gtxid>``."""
        return in_group(self.partition + 1, f"{HOLD_PREFIX}{gtxid}")

    def hold(self, gtxid: str, xid: str, participants: Sequence[int]) -> None:
        """The all-prepared record: an outcome record ``HELD`` whose client id names the
        TM's xid and the participants, sent to the group's backups as a ``to`` (no ``tc``
        carries it), so durable on the majority once ``WhenDurable`` answers."""
        outcomes, txid = self.broker.outcomes, self.hold_txid(gtxid)
        outcomes.record(txid, hold_client_id(xid, participants), HELD)
        outcomes.replicate(txid)

    def is_held(self, gtxid: str) -> bool:
        record = self.broker.outcomes.get(self.hold_txid(gtxid))
        return record is not None and record[2] == HELD

    def held_xa(self) -> Iterable[tuple[str, str, tuple[int, ...]]]:
        """The held records of undecided gtxids. A read, side-effect free (``ctl status``
        counts them): what a failover left held though decided is rewritten by
        ``unhold_decided`` (the rules' tick), never by a reader."""
        out = []
        for gtxid, client_id in self.holds():
            if self.status(gtxid).decided:
                continue
            parsed = parse_hold_client_id(client_id)
            if parsed is not None:
                out.append((parsed[0], gtxid, parsed[1]))
        return out

    def unhold_decided(self) -> list[str]:
        decided = [gtxid for gtxid, _ in self.holds() if self.status(gtxid).decided]
        for gtxid in decided:
            self._unhold(gtxid)
        return decided

    # -- helpers ----------------------------------------------------------------------------

    def _by_ha_id(self, vhost: str) -> dict[str, Queue]:
        """The partition's queues of ``vhost`` by their incarnation's ``x-ha-id``."""
        host = self.broker.vhosts.get(vhost)
        if host is None:
            return {}
        return {str(ha_id): q for q in host.queues.values()
                if (ha_id := q.arguments.get(HA_ID)) is not None and not q.deleted
                and (self.in_partition is None or self.in_partition(q))}

    def _roll_back_branch(self, gtxid: str) -> None:
        work = self._branch(gtxid)
        if work is None:
            return
        if work.state is State.ACTIVE:  # not ended (cannot happen: prepare ends it)
            self.broker.dtx.end(work.xid, self._owner, fail=True)
        self.broker.dtx.rollback(work.xid)  # its held entries requeued; a tr if replicated

    def holds(self) -> list[tuple[str, str]]:
        """(gtxid, client id) of this partition's ``HELD`` records: the outcomes' ``held``
        (kept apart from the retention: a few, not every outcome record)."""
        prefix = self.hold_txid("")
        return [(txid[len(prefix):], record[1])
                for txid, record in self.broker.outcomes.held.items()
                if txid.startswith(prefix) and record[2] == HELD and record[1] is not None]

    def _unhold(self, gtxid: str) -> None:
        """A decided transaction's all-prepared record is recorded again ``DECIDED`` (and
        replicated), so that it ages out with the outcomes' retention (a ``HELD`` one is
        kept apart from it: ``TxOutcomes.held``)."""
        outcomes, txid = self.broker.outcomes, self.hold_txid(gtxid)
        record = outcomes.get(txid)
        if record is not None and record[2] == HELD:
            outcomes.record(txid, record[1], DECIDED)
            outcomes.replicate(txid)

    def _record(self, gtxid: str, outcome: str, *, replicate: bool) -> None:
        """The outcome record, in this loop callback (the change's store batch) unless the
        branch's own commit or rollback wrote it already; ``replicate``: sent to the
        group's backups as a ``to`` too (no ``tc``/``tr`` may carry it)."""
        outcomes, txid = self.broker.outcomes, self.txid(gtxid)
        record = outcomes.get(txid)
        if record is None or record[2] != outcome:
            outcomes.record(txid, None, outcome)
        if replicate:
            outcomes.replicate(txid)

