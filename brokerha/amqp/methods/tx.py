"""tx.select, tx.commit, tx.rollback.

Commit runs the transaction's two phases: every TransactionObserver's prepare
is awaited (the channel is blocked meanwhile, so later methods wait their
turn), then the local commit, then commit-ok once the store has made it durable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.amqp.errors import AMQPError
from brokerha.broker.errors import PreconditionFailed
from brokerha.broker.transaction import TransactionAborted

if TYPE_CHECKING:
    from brokerha.amqp.channel import Channel
    from brokerha.broker.placement import GroupGuard
    from brokerha.broker.queue import Queue
    from brokerha.broker.transaction import Transaction


def select(ch: Channel, m: commands.Tx.Select) -> None:
    if ch.confirm is not None:
        raise PreconditionFailed("cannot switch from confirm to tx mode")
    ch.tx_mode = True
    ch.send(commands.Tx.SelectOk())


def _require_tx(ch: Channel) -> None:
    if not ch.tx_mode:
        raise PreconditionFailed("channel is not transactional")


def commit(ch: Channel, m: commands.Tx.Commit) -> None:
    _require_tx(ch)
    tx, ch.tx = ch.tx, None
    broker = ch.conn.broker
    groups = broker.groups
    started = broker.clock()

    def commit_ok() -> None:
        broker.stats.committed(broker.clock() - started)
        ch.reply_unblocked(commands.Tx.CommitOk())

    if groups is not None:  # a partitioned node: its groups' gates, or across partitions
        if tx is not None:
            tx = _grouped(ch, groups, tx, commit_ok)
            if tx is None:
                return  # the node's coordinator answers
        queues = [] if tx is None else _queues(tx)

        def durable(callback: Callable[[], None]) -> None:
            groups.after_durable(queues, callback)
    else:
        durable = broker.after_durable
    ch.block()

    def committed() -> None:
        ch.finish_transaction(True)
        durable(commit_ok)

    if tx is None:
        durable(commit_ok)
        return
    if not tx.needs_prepare():
        tx.commit_prepared()  # applies and records a named transaction's outcome
        committed()
        return

    def done(exc: BaseException | None) -> None:
        if ch.state != "open":
            return
        if exc is None:
            committed()
            return
        ch.finish_transaction(False)
        if isinstance(exc, TransactionAborted):
            error = AMQPError(C.PRECONDITION_FAILED, str(exc), 90, 20)
        else:
            error = AMQPError(C.INTERNAL_ERROR, f"commit failed: {exc!r}", 90, 20)
        ch.conn.fail(ch, error)

    broker.spawn(tx.commit(), done)


def _queues(tx: Transaction) -> list[Queue]:
    """The queues a transaction touches (their groups' gates answer its commit)."""
    return [*(q for queues, _ in tx.publishes for q in queues),
            *(q for q, _ in tx.accepts), *(q for q, _, _ in tx.rejects)]


def _grouped(ch: Channel, groups: GroupGuard, tx: Transaction,
             commit_ok: Callable[[], None]) -> Transaction | None:
    """tx.commit on a node running partition groups (``GroupGuard.tx_commit``): the
    transaction to commit here, or None: it spans partitions, the node's coordinator
    commits it and answers (commit-ok, or 406 with the reason) through ``commit_ok``."""

    def answered(committed: bool, reason: str) -> None:
        if ch.state != "open":
            return
        # the acknowledged entries were handed to the partitions' branches: settled by
        # the commit, or requeued by the rollback -- never the channel's unacked again
        ch.finish_transaction(True)
        if committed:
            commit_ok()
        else:
            ch.conn.fail(ch, AMQPError(C.PRECONDITION_FAILED, reason or "transaction across "
                                       "partitions rolled back", 90, 20))

    try:
        local = groups.tx_commit(ch.conn, tx, answered)
    except BaseException:
        tx.rollback()
        ch.finish_transaction(False)
        raise
    if local is None:
        ch.block()
    return local


def rollback(ch: Channel, m: commands.Tx.Rollback) -> None:
    _require_tx(ch)
    tx, ch.tx = ch.tx, None
    if tx is not None:
        tx.rollback()
    ch.finish_transaction(False)
    ch.send(commands.Tx.RollbackOk())


HANDLERS: dict[type, Callable[[Any, Any], None]] = {
    commands.Tx.Select: select,
    commands.Tx.Commit: commit,
    commands.Tx.Rollback: rollback,
}
