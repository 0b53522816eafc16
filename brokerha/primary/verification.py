"""The verification phase (NEO's VERIFYING): a new primary settles half-finished transactions.

Sans-I/O. A newly elected primary, before it accepts clients or backups,
asks every reachable node which of the transactions it holds prepared they
committed (``VerifyRequest`` -> ``VerifyReply``), waits for every node it
asked or ``verification_timeout``, and decides each of its prepared
transactions:

- committed by any node (itself included) -> committed here: applied from the
  prepared record, so this primary's state, which every backup's catch-up
  copies, holds it;
- a TX nobody committed -> rolled back (its client never had commit-ok: that
  needs a majority, and a majority's vote floor would have made a node holding
  the commit the primary);
- an XA branch nobody committed -> in doubt: it becomes a prepared branch of
  this primary's DtxManager, listed by ``recover`` and finished by the TM;
- a branch of a transaction across partitions whose outcome record here says
  rolled back (the decision came while its prepare was still open, and its
  ``tr`` did not) -> rolled back;
- a branch of a transaction across partitions (its xid's format is
  ``XTX_FORMAT``, broker/dtx.py) nobody committed -> ``resolve``: it becomes a
  prepared branch too, but no TM's (``recover`` leaves it out): the
  partition's ``DecisionRules.tick`` (partition/xtx.py) finds it in doubt
  and asks its decision partition, or, on the decider, rolls it back (rule
  b). Committed by any node, it is committed like any other: a participant
  commits only on a durable decision, and the decider's commit *is* the
  decision, which nobody heard before it was durable.

On a partitioned node (``group``) a group's verification settles only that
group's transactions (their group is in their names, ``tx_outcomes.group_of``);
the other groups' primaries on the node keep theirs.

A node that committed a transaction this primary rolls back (it received the
commit event, the majority did not) converges when it joins: its catch-up
drops what this primary does not hold, and the outcomes snapshot replaces
its outcome record. So every node ends with this primary's outcome.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from brokerha.backup.tx_buffer import TxBuffer
from brokerha.broker.broker import Broker
from brokerha.broker.dtx import State, Xid, is_xtx_txid, xtx_partition
from brokerha.broker.message import Message
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK, of_group
from brokerha.cluster.replication import VerifyReply, VerifyRequest

log = logging.getLogger(__name__)

COMMIT = "commit"
ROLLBACK = "rollback"
IN_DOUBT = "in doubt"
RESOLVE = "resolve"  # a cross-partition branch kept prepared for its DecisionRules


def _is_xtx(xid_key: str) -> bool:
    return xtx_partition(Xid.from_key(xid_key)) is not None


@dataclass
class Verification:
    epoch: int
    me: str
    prepared: dict[str, TxBuffer]    # this node's prepared transactions, by txid
    local_branches: list[str]        # txids of this node's own prepared XA branches
    asked: set[str]                  # the peers the request went to
    deadline: float
    committed_here: set[str] = field(default_factory=set)
    replies: dict[str, VerifyReply] = field(default_factory=dict)
    # cross-partition branches this node holds prepared and whose record says rolled back
    # (the decision arrived with the prepare still open: its tr was not applied here)
    rolled_back_here: set[str] = field(default_factory=set)
    group: int | None = None         # a partitioned node's group: its transactions only

    @classmethod
    def start(cls, broker: Broker, epoch: int, me: str, peers: list[str], now: float,
              timeout: float, group: int | None = None) -> Verification:
        prepared = {txid: TxBuffer.from_payload(txid, payload)
                    for txid, payload in broker.ha_transactions.items()
                    if of_group(txid, group)}
        local = [b.id for b in broker.dtx.branches.values()
                 if b.state is State.PREPARED and (group is None or b.group == group)]
        committed = {t for t in [*prepared, *local] if broker.outcomes.committed(t)}
        rolled_back = {t for t in [*prepared, *local] if is_xtx_txid(t)
                       and (r := broker.outcomes.get(t)) is not None and r[2] == ROLLED_BACK}
        return cls(epoch, me, prepared, local, set(peers), now + timeout, committed,
                   rolled_back_here=rolled_back, group=group)

    def request(self) -> VerifyRequest:
        return VerifyRequest(self.epoch, sorted({*self.prepared, *self.local_branches}))

    def receive(self, reply: VerifyReply) -> None:
        if reply.epoch == self.epoch and reply.node in self.asked:
            self.replies[reply.node] = reply

    def done(self, now: float) -> bool:
        return set(self.replies) >= self.asked or now >= self.deadline

    def committed_anywhere(self) -> set[str]:
        out = set(self.committed_here)
        for reply in self.replies.values():
            out.update(reply.committed)
        return out

    def decisions(self) -> dict[str, str]:
        committed = self.committed_anywhere()
        out: dict[str, str] = {}
        for txid, buffer in self.prepared.items():
            if txid in committed:
                out[txid] = COMMIT
            elif txid in self.rolled_back_here:
                out[txid] = ROLLBACK
            elif buffer.xid:
                out[txid] = RESOLVE if _is_xtx(buffer.xid) else IN_DOUBT
            else:
                out[txid] = ROLLBACK
        for txid in self.local_branches:
            if txid in committed:
                out[txid] = COMMIT
            elif txid in self.rolled_back_here:
                out[txid] = ROLLBACK
            else:
                out[txid] = RESOLVE if is_xtx_txid(txid) else IN_DOUBT
        return out


def answer(broker: Broker, request: VerifyRequest, me: str) -> VerifyReply:
    """A node's reply: what it holds prepared, which of the asked it committed."""
    committed = [t for t in request.txids if broker.outcomes.committed(t)]
    return VerifyReply(request.epoch, me, sorted(broker.ha_transactions), committed)


def carry_out(broker: Broker, verification: Verification) -> dict[str, str]:
    """Apply the decisions to this node's broker (the Primary observes it already)."""
    decisions = verification.decisions()
    for txid, decision in sorted(decisions.items()):
        buffer = verification.prepared.get(txid)
        if buffer is None:
            _decide_local_branch(broker, txid, decision)
        elif decision == COMMIT:
            _commit(broker, buffer)
        elif decision == ROLLBACK:
            _finish(broker, buffer, ROLLED_BACK)
        else:  # in doubt (the TM's) or resolve (its DecisionRules'): prepared here
            _adopt(broker, buffer, verification.group)
        log.warning("verification: %s %s", txid, decision)
    group = verification.group
    for branch in list(broker.dtx.branches.values()):
        if group is not None and branch.group != group:
            continue  # another group's, with another primary's observers (or none)
        if branch.state is State.PREPARED and not branch.observers:
            branch.observers = [o for f in broker.dtx.factories
                                if (o := f.create(branch)) is not None]
    return decisions


def _queues_of(broker: Broker, buffer: TxBuffer) -> tuple[list[Any], list[Any]]:
    publishes = []
    for vhost_name, names, exchange, routing_key, header, body in buffer.messages:
        vhost = broker.vhosts.get(vhost_name)
        queues = [q for n in names if vhost is not None and (q := vhost.queues.get(n))]
        publishes.append((queues, Message(exchange, routing_key, header, body)))
    accepts = []
    for vhost_name, name, positions in buffer.dequeues:
        vhost = broker.vhosts.get(vhost_name)
        q = vhost.queues.get(name) if vhost is not None else None
        for position in positions:
            entry = q.take_position(position) if q is not None else None
            if entry is not None:
                accepts.append((q, entry))
    return publishes, accepts


def _commit(broker: Broker, buffer: TxBuffer) -> None:
    publishes, accepts = _queues_of(broker, buffer)
    for queues, message in publishes:
        for q in queues:
            q.enqueue(message)
    for q, entry in accepts:
        q.settle(entry)
    _finish(broker, buffer, COMMITTED)


def _finish(broker: Broker, buffer: TxBuffer, outcome: str) -> None:
    broker.ha_transactions.pop(buffer.txid, None)
    broker.store.ha_tx_finished(buffer.txid)
    broker.outcomes.record(buffer.txid, buffer.client_id, outcome)


def _adopt(broker: Broker, buffer: TxBuffer, group: int | None = None) -> None:
    """An in-doubt XA branch becomes this primary's prepared branch (recover lists it;
    a cross-partition one, its DecisionRules' ``in_doubt``)."""
    assert buffer.xid is not None
    publishes, accepts = _queues_of(broker, buffer)
    branch = broker.dtx.restore_prepared(Xid.from_key(buffer.xid), publishes, accepts)
    branch.client_id = buffer.client_id
    if branch.group is None:
        branch.group = group
    broker.dtx.persist_prepared(branch, lambda: None)
    broker.ha_transactions.pop(buffer.txid, None)
    broker.store.ha_tx_finished(buffer.txid)


def _decide_local_branch(broker: Broker, txid: str, decision: str) -> None:
    if decision == ROLLBACK:  # a cross-partition branch whose record says so
        for xid, branch in list(broker.dtx.branches.items()):
            if branch.id == txid:
                broker.dtx.rollback(xid)
        return
    if decision != COMMIT:
        return
    for xid, branch in list(broker.dtx.branches.items()):
        if branch.id == txid:
            del broker.dtx.branches[xid]
            branch.replication_id = txid  # a restored branch: its outcome is recorded by it
            branch.commit_prepared()
            broker.dtx.forget_prepared(xid)
