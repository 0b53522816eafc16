"""TransactionReplicator (seed 002): the tx-queues of one primary, applied on a backup.

``tb`` creates a TxBuffer (DtxBuffer for an XA branch), ``te``/``td`` fill it,
``tp`` (XA branches only: a TX has no vote round) prepares it durably (a store record, synced before the backup's
acknowledgement, which is its yes vote) or refuses (a ``TxVote`` no, when the
backup cannot apply what the transaction dequeues), ``tc`` applies the
commit's whole effect, with the outcome record and without the prepared
record, and ``tr`` drops it.

A commit is applied in slices of at most ``COMMIT_SLICE`` entries
(``commit_steps``, one slice a loop turn: a TX of 100,000 messages applied in
one step held a loaded backup's loop 0.2-0.45 s, issue 33). The backup
applies nothing after the ``tc`` until its last slice, acknowledges the ``tc``
only after it, and its stored position is invalid meanwhile
(``ha/core.py``): its store may commit the slices in several batches, so a
crash in the middle leaves a node that must catch up, never one that holds a
proper subset of a transaction at a valid position.

Open buffers live only in this object: a backup that follows another
primary, or joins again, starts a new one, so every open transaction of a
failed primary is aborted. Prepared ones are in the store (and mirrored in
``broker.ha_transactions``) until an outcome, a new primary's catch-up or the
verification phase decides them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from brokerha.backup.queue_replicator import QueueReplicator
from brokerha.backup.tx_buffer import TxBuffer, new_buffer
from brokerha.broker.broker import Broker
from brokerha.broker.placement import GroupScope
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK, of_group
from brokerha.cluster import replication as R
from brokerha.cluster.replication import ReplicationError, TxVote

log = logging.getLogger(__name__)

Replicators = Callable[[str, str], QueueReplicator]

# entries (an enqueue, a dequeued position) a commit applies per slice: 4,096 x 512 B took
# 10-20 ms of a backup's loop (a tenth of the 100,000 commit's step, under load)
COMMIT_SLICE = 4096


class _Budget:
    """A commit's slices: ``step`` entries each (0: one slice), counted across its ops."""

    def __init__(self, step: int) -> None:
        self.step = self.room = step

    def spend(self, entries: int) -> bool:
        """True when the slice is full: the caller yields, the next one begins."""
        self.room -= entries
        if self.step and self.room <= 0:
            self.room = self.step
            return True
        return False

    def pieces(self, length: int) -> Iterator[tuple[int, int, bool]]:
        """(done, take, full) over 0..length in pieces that fill the slices: the caller
        applies ``take`` entries from ``done``, then yields if the slice is ``full``."""
        done = 0
        while done < length:
            take = length - done if not self.step else min(self.room, length - done)
            yield done, take, self.spend(take)
            done += take


class TransactionReplicator:
    def __init__(self, broker: Broker, replicator: Replicators, me: str, epoch: int,
                 scope: GroupScope | None = None) -> None:
        self.broker = broker
        # a partitioned node's replication group: its catch-up replaces, and its join
        # releases, only that group's prepared records, outcomes and branches (their group
        # is in their names, tx_outcomes.group_of); None: the whole broker's
        self.group = None if scope is None else scope.group
        self.replicator = replicator
        self.me = me
        self.epoch = epoch
        self.buffers: dict[str, TxBuffer] = {}
        self.votes: list[TxVote] = []  # no votes for the node to send
        self._refused: set[str] = set()
        self._outcomes_seen: set[str] | None = None

    # -- events ------------------------------------------------------------------------

    def apply(self, event: Any) -> None:
        """A transaction event (a ``cluster.replication`` record: ``tb`` ... ``to``)."""
        kind = event.kind
        if kind == R.TX_BEGIN:
            self.buffers[event.txid] = new_buffer(event.txid, event.xid)
        elif kind == R.TX_ENQUEUE:
            self._buffer(event.txid).enqueue(*event[2:])
        elif kind == R.TX_DEQUEUE:
            self._buffer(event.txid).dequeue(*event[2:])
        elif kind == R.TX_PREPARE:
            self.prepare(event.txid, event.client_id)
        elif kind == R.TX_COMMIT:
            self.commit(event.txid, event.client_id, event.ops)
        elif kind == R.TX_ROLLBACK:
            self.rollback(event.txid, event.client_id)
        elif kind == R.TX_OUTCOMES:
            self.outcomes(event.records)

    def _buffer(self, txid: str) -> TxBuffer:
        buffer = self.buffers.get(txid)
        if buffer is None:
            raise ReplicationError(f"event of unknown transaction {txid}")
        return buffer

    def prepare(self, txid: str, client_id: str | None) -> None:
        buffer = self._buffer(txid)
        buffer.client_id = client_id
        problem = self._cannot_apply(buffer)
        if problem is not None:
            log.warning("cannot prepare %s: %s; voting no", txid, problem)
            self._refused.add(txid)
            self.votes.append(TxVote(self.epoch, self.me, txid, False, problem))
            return
        buffer.prepared = True
        payload = buffer.payload()
        self.broker.ha_transactions[txid] = payload
        self.broker.store.ha_tx_prepared(txid, payload, lambda: None)

    def _cannot_apply(self, buffer: TxBuffer) -> str | None:
        """Why the commit could not be applied here, or None."""
        for vhost_name, name, positions in buffer.dequeues:
            vhost = self.broker.vhosts.get(vhost_name)
            q = vhost.queues.get(name) if vhost is not None else None
            if q is None:
                return f"no queue '{name}' in vhost '{vhost_name}'"
            missing = q.missing_positions(positions)
            if missing:
                return f"queue '{name}' lacks positions {missing[:5]}"
        return None

    def commit(self, txid: str, client_id: str | None, ops: list[Any]) -> None:
        """The whole effect of the primary's commit, in this one call."""
        for _ in self.commit_steps(txid, client_id, ops, None):
            pass

    def commit_steps(self, txid: str, client_id: str | None, ops: list[Any],
                     per_slice: int | None = COMMIT_SLICE) -> Iterator[None]:
        """The commit's effect, yielding after each ``per_slice`` entries (None: never).

        The caller runs it to its end before anything else of the stream: the
        queues it touches are in between states until then.
        """
        buffer = self.buffers.pop(txid, None)
        if buffer is None or txid in self._refused:
            raise ReplicationError(f"commit of transaction {txid} this backup does not hold")
        if not buffer.prepared:  # a TX: no vote round, so check here what tp checks
            problem = self._cannot_apply(buffer)
            if problem is not None:  # diverged from the primary: join again (a catch-up)
                raise ReplicationError(f"cannot commit {txid}: {problem}")
        budget = _Budget(per_slice or 0)
        for op in ops:  # OpRef(s), Enqueued and Dequeued records
            kind = op.kind
            if kind == R.OP_REFS:  # a run of te messages, made when they arrived
                run = buffer.built[op.message:op.message + op.length]
                if len(run) != op.length or op.message < 0:
                    raise ReplicationError(f"commit of {txid} refers to te events this "
                                           f"backup does not hold")
                replicator = self.replicator(op.vhost, op.queue)
                for done, take, full in budget.pieces(op.length):
                    replicator.enqueue_run(op.position + done, run[done:done + take])
                    if full:
                        yield
                continue
            if kind == R.DEQUEUED:
                replicator = self.replicator(op.vhost, op.queue)
                for done, take, full in budget.pieces(len(op.positions)):
                    replicator.dequeue(op.positions[done:done + take])
                    if full:
                        yield
                continue
            if kind == R.OP_REF:  # the te's message, made when it arrived
                self.replicator(op.vhost, op.queue).add(op.position, buffer.built[op.message],
                                                        op.expires_in)
            elif kind == R.ENQUEUED:
                self.replicator(op.vhost, op.queue).enqueue(*op[3:])
            else:
                raise ReplicationError(f"unknown commit op {kind!r} in {txid}")
            if budget.spend(1):
                yield
        self._finish(buffer, client_id, COMMITTED)

    def rollback(self, txid: str, client_id: str | None) -> None:
        buffer = self.buffers.pop(txid, None)
        self._refused.discard(txid)
        if buffer is not None and buffer.prepared:
            self._finish(buffer, client_id, ROLLED_BACK)

    def _finish(self, buffer: TxBuffer, client_id: str | None, outcome: str) -> None:
        if buffer.prepared:
            self.broker.ha_transactions.pop(buffer.txid, None)
            self.broker.store.ha_tx_finished(buffer.txid)
        self.broker.outcomes.record(buffer.txid, client_id, outcome)

    # -- catch-up ------------------------------------------------------------------------

    def catch_up_begins(self) -> None:
        """The primary sends every unfinished transaction again: start from nothing."""
        self.buffers.clear()
        self._refused.clear()
        self._outcomes_seen = set()

    def outcomes(self, records: list[Any]) -> None:
        outcomes = self.broker.outcomes
        seen = self._outcomes_seen
        for txid, client_id, outcome, at in records:
            if seen is not None:
                seen.add(txid)
            current = outcomes.get(txid)
            if current is None or current[1:3] != (client_id, outcome):
                outcomes.record(txid, client_id, outcome, at)

    def caught_up(self) -> None:
        """Prepared records the primary did not send again are decided: drop them."""
        for txid in [t for t in self.broker.ha_transactions
                     if t not in self.buffers and of_group(t, self.group)]:
            del self.broker.ha_transactions[txid]
            self.broker.store.ha_tx_finished(txid)
        if self._outcomes_seen is not None:
            self.broker.outcomes.keep_only(self._outcomes_seen, self.group)
            self._outcomes_seen = None

    def release_local_branches(self) -> None:
        """XA branches this node prepared as a primary go: the new primary holds them.

        Their held entries go back on the ready lists before the join's
        inventory is taken, so the catch-up keeps or drops them like any other.
        """
        dtx = self.broker.dtx
        for xid, branch in list(dtx.branches.items()):
            if self.group is not None and branch.group != self.group:
                continue  # another group's (this node may lead it)
            del dtx.branches[xid]
            for queue, entry in branch.accepts:
                if not queue.deleted:
                    queue.requeue(entry)
            self.broker.store.dtx_finished(xid.key)
