"""The TxLog's transaction observer: a transaction's operations on global queues, ordered.

Every transaction of a node whose master runs gets a ``GlobalTxObserver``
(``GlobalTxObserverFactory``, registered by ``TxLogBridge``). It collects the
transaction's publishes to global queues (enqueue operations, the message
packed into the operation) and its acks on global queues (dequeue operations
by global message id); in ``prepare`` it submits them to the local master and
says yes when the engine confirms: an enqueue-only transaction once acquired
(one phase), one with a dequeue once ordered and validated; a failed
validation is a no, with a ``refusal`` the client sees in its 406. A
transaction that touches no global queue keeps the one-round-trip commit
(``prepare_needed``). The local commit never applies a global queue's
publishes (``Transaction.withhold``): the ordered ``DeliverOrdered`` does, in
every DC (``global_queues.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from brokerha.broker.dtx import DtxBranch
from brokerha.broker.message import Entry, Message
from brokerha.broker.queue import Queue
from brokerha.broker.transaction import Transaction, TransactionObserver
from brokerha.txlog.bridge.global_queues import GlobalQueues, Refusal
from brokerha.txlog.engine.records import Operation

# submits operations to the master: None once committed, else the refusal's text
Submit = Callable[[list[Operation]], Awaitable[str | None]]


class GlobalTxObserverFactory:
    """Registered with the broker: an observer for every transaction while the master runs."""

    def __init__(self, queues: GlobalQueues, submit: Submit) -> None:
        self.queues = queues
        self.submit = submit

    def create(self, transaction: Transaction) -> GlobalTxObserver | None:
        if not self.queues.running:
            return None
        return GlobalTxObserver(self.queues, self.submit, transaction)


class GlobalTxObserver(TransactionObserver):
    """One transaction's operations on global queues; ``prepare`` waits for the TxLog."""

    def __init__(self, queues: GlobalQueues, submit: Submit, transaction: Transaction) -> None:
        self.queues = queues
        self.submit = submit
        self.transaction = transaction
        self.enqueues: list[tuple[Queue, Message]] = []
        self.dequeues: list[tuple[Queue, Entry]] = []
        self.refusal: str | None = None

    def publish(self, queue: Queue, message: Message) -> None:
        if queue.ordered:
            if message.expiration_ms is not None and self.refusal is None:
                # a per-message TTL would expire the message in each DC at its own time
                self.refusal = (f"a message with an expiration (per-message TTL) cannot go to "
                                f"global queue '{queue.name}': it would expire in each "
                                "datacenter separately")
            self.enqueues.append((queue, message))

    def accept(self, acked: list[tuple[Queue, Entry]], unacked: list[tuple[Queue, Entry]]) -> None:
        self.dequeues.extend((q, e) for q, e in acked if q.ordered)

    def prepare_needed(self) -> bool:
        """Only a transaction that touches a global queue waits for the TxLog.

        The others keep the one-round-trip commit of a node without ``[txlog]``.
        """
        return bool(self.enqueues or self.dequeues)

    async def prepare(self) -> bool:
        if not self.prepare_needed():
            return True
        if self.refusal is not None:
            return False
        if isinstance(self.transaction, DtxBranch):
            self.refusal = "XA (dtx) transactions on global queues are not supported"
            return False
        try:
            ops = self.queues.operations(self.enqueues, self.dequeues)
        except Refusal as exc:
            self.refusal = str(exc)
            return False
        self.refusal = await self.submit(ops)
        return self.refusal is None

    def applying(self) -> None:
        """The local commit leaves global queues alone: DeliverOrdered enqueues there.

        Its rejects (requeue=false) on global queues were ordered as dequeues and
        withdrew the entries; the withdrawal is this transaction's own, so the
        local reject dead-letters as usual (in this DC only, like the consumer's
        decision; a dead letter into a global queue is ordered in turn).
        """
        for queue, entry, requeue in self.transaction.rejects:
            if not requeue and queue.ordered:
                queue.own_withdrawal(entry)
        if self.enqueues:
            mine = {id(q) for q, _ in self.enqueues}
            self.transaction.withhold(lambda q: id(q) in mine)
