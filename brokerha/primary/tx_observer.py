"""PrimaryTxObserver (seed 002): every TX and DTX transaction, replicated through a tx-queue.

The Primary registers a ``PrimaryTxObserverFactory`` with the broker; each
transaction gets a ``PrimaryTxObserver``. An XA branch pushes its operations
onto its tx-queue (``brokerha.primary.tx_queue``) as they happen, since its
backups must hold them to vote:

- publish: a ``te`` event (one per message, listing its replicated queues);
- accept: a ``td`` event per queue (positions are replication ids already);
- prepare (dtx prepare): close the tx-queue, send ``tp``, and complete
  asynchronously with the backups' votes -- the event loop never waits.

A TX (tx.commit) has no vote round: its ``tc`` below is the whole transaction,
applied atomically by each backup, and ``tx.commit-ok`` waits for the same
quorum of acknowledgements of it as a confirm does, so one backup round trip
per commit is enough (docs/ha.md, "One round trip for TX"). So a TX sends
its publishes with its commit: the ``tc`` carries their content (``e`` ops,
right after the ``tb`` if nothing opened the tx-queue before); only a message
routed to several replicated queues goes once as a ``te`` the ``tc`` refers to.
A TX whose content passes ``TC_CONTENT_BYTES`` sends the rest as ``te`` events
as it is published (issue 33: sent all at the commit, 100,000 of them held the
primary's loop 0.64 s); the ``tc`` refers to them by runs (``OpRefs``), and
each backup made their messages as they came.
A ``te`` per message ahead of the commit cost each backup a buffered copy, an
event and a record per message, for nothing it could use before the ``tc``.
Its accepts still go as ``td`` events when they happen: the backup checks
before the commit that it holds what the client acknowledged.

- applying/commit: the Primary captures what the local commit does to the
  replicated queues (enqueues with their new positions, dequeues, and side
  effects such as dead letters) instead of sending ``e``/``d`` events (the
  skip set), and sends it all as one ``tc`` event (an XA branch's enqueues
  refer to its ``te`` events: ``r`` ops);
- rollback: ``tr`` (a TX rolled back sent nothing, so it sends nothing).

A transaction that touches no replicated queue creates no tx-queue.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from brokerha.broker.dtx import DtxBranch, State
from brokerha.broker.transaction import TransactionObserver
from brokerha.broker.tx_outcomes import in_group
from brokerha.cluster import replication as R
from brokerha.primary.remote_backup import BYTES_PER_PACKET

# At most this much of a TX's content travels inside its tc (one event, so one
# packet); the rest goes ahead of it as te events the tc refers to, as an XA
# branch's does, and a transaction of any size still fits the packet limit.
TC_CONTENT_BYTES = BYTES_PER_PACKET

if TYPE_CHECKING:
    from brokerha.broker.message import Entry, Message
    from brokerha.broker.placement import GroupScope
    from brokerha.broker.queue import Queue
    from brokerha.broker.transaction import Transaction
    from brokerha.primary.events import Event
    from brokerha.primary.tx_queue import TxQueue


class Primary(Protocol):
    """What a tx-queue needs of the Primary (primary.py), which creates the factory.

    A Protocol rather than an import: primary.py imports this module.
    """

    me: str
    epoch: int
    scope: GroupScope | None  # a partitioned node's replication group; None: the broker

    def acquired(self, queue: Queue, entry: Entry) -> None: ...
    def messages_replicated(self, queue: Queue) -> bool: ...
    def tx_begin(self, name: str, xid: str | None) -> TxQueue: ...
    def tx_event(self, txq: TxQueue, event: Event) -> None: ...
    def tx_close(self, txq: TxQueue) -> None: ...
    def tx_prepare(self, txq: TxQueue, on_prepared: Callable[[bool], None]) -> None: ...
    def tx_capture(self, txq: TxQueue) -> None: ...
    def tx_commit(self, txq: TxQueue) -> None: ...
    def tx_rollback(self, txq: TxQueue) -> None: ...


class PrimaryTxObserverFactory:
    def __init__(self, primary: Primary) -> None:
        self.primary = primary
        self._numbers = itertools.count(1)

    def create(self, transaction: Transaction) -> PrimaryTxObserver:
        branch = transaction if isinstance(transaction, DtxBranch) else None
        if branch is not None:
            name = transaction.id  # dtx:<xid key>: the same on every node
        else:
            name = f"tx-{self.primary.me}-{self.primary.epoch}-{next(self._numbers)}"
            scope = self.primary.scope
            if scope is not None and scope.group:
                # a partition group's (epochs are per group: two groups' primaries on one
                # node would give the same names); the group is in the name of its outcome
                name = in_group(scope.group, name)
        observer = PrimaryTxObserver(self.primary, transaction, name,
                                     None if branch is None else branch.xid.key)
        if branch is not None and branch.state is State.PREPARED:
            observer.adopt_prepared()
        return observer


class PrimaryTxObserver(TransactionObserver):
    def __init__(self, primary: Primary, transaction: Transaction, name: str,
                 xid: str | None) -> None:
        self.primary = primary
        self.transaction = transaction
        self.name = name
        self.xid = xid
        self.queue: TxQueue | None = None
        self._last: tuple[Message, R.TxEnqueue] | None = None  # the last te, for more queues
        self._at_commit = False  # a TX published to a replicated queue: its content in its tc
        # a TX's content counted as it is published; past TC_CONTENT_BYTES the rest goes
        # as te events at once (from ``_eager``, a message), not all at the commit
        self._inline_bytes = 0
        self._counted: Message | None = None
        self._eager: Message | None = None

    @property
    def content_ahead(self) -> bool:
        """A TX whose content passed ``TC_CONTENT_BYTES``: the rest went as te events."""
        return self._eager is not None

    def _tx_queue(self) -> TxQueue:
        if self.queue is None:
            self.queue = self.primary.tx_begin(self.name, self.xid)
            self.transaction.replication_id = self.name
            scope = self.primary.scope
            tx = self.transaction
            if scope is not None and isinstance(tx, DtxBranch) and tx.group is None:
                tx.group = scope.group  # its group's demotion is what rolls it back
        return self.queue

    # -- the transaction's operations ------------------------------------------------------

    def _replicated_at_commit(self) -> None:
        """A TX published to a replicated queue: named now, the content sent in its ``tc``."""
        self._at_commit = True
        self.transaction.replication_id = self.name

    def publish(self, queue: Queue, message: Message) -> None:
        if not self.primary.messages_replicated(queue):
            return
        if self.xid is None:
            self._replicated_at_commit()
            if self._eager is None and self._counted is not message:
                self._counted = message
                self._inline_bytes += message.size
                if self._inline_bytes > TC_CONTENT_BYTES:
                    self._eager = message
            if self._eager is None:
                return
        self._send_content(queue, message)

    def _send_content(self, queue: Queue, message: Message) -> None:
        """A ``te`` for ``message`` (or ``queue`` added to the one just sent for it)."""
        last = self._last
        if last is not None and last[0] is message:
            last[1].queues.append(queue.name)  # the same publish, another queue: not sent yet
            return
        txq = self._tx_queue()
        event = R.TxEnqueue(R.TX_ENQUEUE, self.name, queue.vhost, [queue.name], message.exchange,
                            message.routing_key, message.header, message.body)
        txq.message_index[message.msg_id] = txq.messages
        self._last = (message, event)
        self.primary.tx_event(txq, event)

    def accept(self, acked: list[tuple[Queue, Entry]], unacked: list[tuple[Queue, Entry]]) -> None:
        self._last = None
        by_queue: dict[tuple[str, str], list[int]] = {}
        for queue, entry in acked:
            if self.primary.messages_replicated(queue):
                by_queue.setdefault((queue.vhost, queue.name), []).append(entry.position)
        for (vhost, name), positions in by_queue.items():
            self.primary.tx_event(self._tx_queue(),
                                  R.TxDequeue(R.TX_DEQUEUE, self.name, vhost, name, positions))

    # -- phases -----------------------------------------------------------------------------

    def prepare_needed(self) -> bool:
        """Only an XA branch's first prepare waits (for the votes); a TX commits at once."""
        return self.xid is not None and self.queue is not None and not self.queue.closed

    async def prepare(self) -> bool:
        self._last = None
        txq = self.queue
        if txq is None:
            return True  # nothing replicated: nothing to vote on
        txq.client_id = self.transaction.client_id
        if not self.prepare_needed():
            # a TX (no vote round: the tc and its acknowledgements decide), or a branch
            # prepared before (adopted after a failover)
            return True
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def done(ok: bool) -> None:
            if not future.done():
                future.set_result(ok)

        self.primary.tx_prepare(txq, done)
        return await future

    def applying(self) -> None:
        if self._at_commit:
            self._tx_queue()  # tb, right before its tc (unless a td opened it)
            # a message for several queues still goes once, as a te the tc refers to,
            # and so does what exceeds TC_CONTENT_BYTES
            room = TC_CONTENT_BYTES
            eager = self._eager
            sent = self.queue.message_index if self.queue is not None else {}
            for queues, message in self.transaction.publishes:
                if message is eager:
                    break  # from here on sent as te events when published
                if message.msg_id in sent:
                    continue
                replicated = [q for q in queues if self.primary.messages_replicated(q)]
                if not replicated:
                    continue
                size = message.size
                if len(replicated) > 1 or size > room:
                    for queue in replicated:
                        self._send_content(queue, message)
                else:
                    room -= size
            self._last = None
        if self.queue is not None:
            self.primary.tx_capture(self.queue)

    def commit(self) -> None:
        if self.queue is not None:
            self.queue.client_id = self.transaction.client_id
            self.primary.tx_commit(self.queue)

    def rollback(self) -> None:
        if self.queue is not None:
            self.queue.client_id = self.transaction.client_id
            self.primary.tx_rollback(self.queue)

    # -- a prepared branch this primary takes over ------------------------------------------

    def adopt_prepared(self) -> None:
        """A DTX branch prepared before this primary's epoch: its tx-queue, closed.

        Its held entries count as acquired, so a joining backup's catch-up
        includes them; a joining backup receives the tx-queue with its prepare.
        """
        tx = self.transaction
        for queues, message in tx.publishes:
            for queue in queues:
                self.publish(queue, message)
        self._last = None
        for queue, entry in tx.accepts:
            self.primary.acquired(queue, entry)
        self.accept(list(tx.accepts), [])
        txq = self._tx_queue()
        txq.client_id = tx.client_id
        self.primary.tx_close(txq)
