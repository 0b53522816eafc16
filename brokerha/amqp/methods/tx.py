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


def select(ch: Channel, m: commands.Tx.Select) -> None:
    if ch.confirm is not None:
        raise PreconditionFailed("cannot switch from confirm to tx mode")
    if ch.conn.broker.groups is not None:
        ch.conn.broker.groups.check_transactions()
    ch.tx_mode = True
    ch.send(commands.Tx.SelectOk())


def _require_tx(ch: Channel) -> None:
    if not ch.tx_mode:
        raise PreconditionFailed("channel is not transactional")


def commit(ch: Channel, m: commands.Tx.Commit) -> None:
    _require_tx(ch)
    tx, ch.tx = ch.tx, None
    broker = ch.conn.broker
    ch.block()
    started = broker.clock()

    def commit_ok() -> None:
        broker.stats.committed(broker.clock() - started)
        ch.reply_unblocked(commands.Tx.CommitOk())

    def committed() -> None:
        ch.finish_transaction(True)
        broker.after_durable(commit_ok)

    if tx is None:
        broker.after_durable(commit_ok)
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
