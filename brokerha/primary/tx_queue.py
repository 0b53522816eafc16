"""The tx-queue (seed 002): one transaction's events in the replication log.

A tx-queue is the ordered run of a transaction's events in the primary's
log: ``tb`` (created: the backups joined now are *in the transaction*),
``te``/``td`` (its enqueues and dequeues, sent as they happen, so the cost is
spread over the transaction and the commit event stays small), ``tp`` (the
prepare: the tx-queue is *closed*, the backups in it vote), then ``tc`` or
``tr``. The events travel in the one ordered stream every backup applies, so
they keep their order with everything else the primary did.

The primary keeps the tx-queue's events until the outcome was sent: a backup
that joins while the transaction is open receives them in its catch-up and is
in the transaction (Qpid: the tx-queue keeps the data for new subscribers
until it is closed); one that joins after the close receives them, the
prepare included, without a vote, and is held back by TxTrackers.

TxReplicatingSubscription: one backup in the transaction, with its vote. A
yes is the backup's acknowledgement of the ``tp`` seq (it acknowledges only
after its store synced the prepared record); a no is an explicit ``TxVote``,
the backup's session ending (link lost, joined again), it timing out, or the
prepare timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from brokerha.cluster import replication as R

if TYPE_CHECKING:
    from brokerha.primary.events import Event
    from brokerha.primary.remote_backup import RemoteBackup


@dataclass
class TxReplicatingSubscription:
    node: str
    session: RemoteBackup
    vote: bool | None = None
    reason: str = ""


@dataclass
class TxQueue:
    name: str                          # the txid: tx-<node>-<epoch>-<n>, or dtx:<xid>
    xid: str | None                    # the XA xid key, for a DTX branch
    begin_seq: int = 0
    events: list[Event] = field(default_factory=list)  # te/td, in order
    message_index: dict[int, int] = field(default_factory=dict)  # msg_id -> te index
    members: dict[str, TxReplicatingSubscription] = field(default_factory=dict)
    client_id: str | None = None
    prepare_seq: int | None = None     # set when closed
    deadline: float | None = None      # of the pending prepare
    on_prepared: Callable[[bool], None] | None = None

    @property
    def closed(self) -> bool:
        return self.prepare_seq is not None

    @property
    def messages(self) -> int:
        return len(self.message_index)

    def begin_event(self) -> Event:
        return R.TxBegin(R.TX_BEGIN, self.name, self.xid)

    def prepare_event(self) -> Event:
        return R.TxPrepare(R.TX_PREPARE, self.name, self.client_id)

    def replay(self) -> list[Event]:
        """The tx-queue so far, for a joining backup's catch-up."""
        out: list[Event] = [self.begin_event(), *self.events]
        if self.closed:
            out.append(self.prepare_event())
        return out

    # -- votes ---------------------------------------------------------------------------

    def pending(self) -> bool:
        return self.on_prepared is not None

    def vote(self, node: str, ok: bool, reason: str = "") -> None:
        member = self.members.get(node)
        if member is None or member.vote is not None or not self.pending():
            return
        member.vote, member.reason = ok, reason
        self.settle_votes()

    def fail(self, reason: str) -> None:
        """Every vote still missing is a no (the prepare timed out, the primary stops)."""
        for member in self.members.values():
            if member.vote is None:
                member.vote, member.reason = False, reason
        self.settle_votes()

    def settle_votes(self) -> None:
        """Complete the prepare once a no arrived or every member said yes."""
        callback = self.on_prepared
        if callback is None:
            return
        votes = [m.vote for m in self.members.values()]
        if False in votes:
            outcome = False
        elif all(v is True for v in votes):
            outcome = True
        else:
            return
        self.on_prepared = None
        self.deadline = None
        callback(outcome)

    def refusals(self) -> list[str]:
        return [f"{m.node}: {m.reason}" for m in self.members.values() if m.vote is False]


def ack_votes(queues: dict[str, TxQueue], node: str, session: Any, acked: int) -> None:
    """A backup's acknowledgement is its yes to every pending prepare it covers."""
    for txq in list(queues.values()):
        member = txq.members.get(node)
        if (member is not None and txq.pending() and member.vote is None
                and member.session is session and txq.prepare_seq is not None
                and acked >= txq.prepare_seq):
            txq.vote(node, True)
