"""TX transactions: the TxBuffer of seed 002 on the primary's side.

Publishes and acknowledgements are buffered and take effect all together at
commit, or not at all at rollback. Each TransactionObserverFactory registered
with the broker may attach a TransactionObserver; commit first awaits every
observer's ``prepare`` (phase one, e.g. every ready backup holds the data) and
only then applies locally and tells the observers to commit.

A client may name its transaction: the header ``x-tx-id`` on a message
published in it (the first one wins) becomes ``client_id``, under which the
outcome is recorded (``brokerha.broker.tx_outcomes``) in the same loop
callback as the local commit, so in the same store batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from brokerha import gc_hooks
from brokerha.slices import release_later

if TYPE_CHECKING:
    from brokerha.broker.message import Entry, Message
    from brokerha.broker.queue import Queue

# A commit of at least this many messages made their entries in bulk, objects that live
# as long as the messages are queued: frozen at once (``gc_hooks.bulk_made``, as a
# backup's catch-up packet), not walked by a young collection right after the commit's
# step (100,000 messages: ~115,000 objects, 7-12 ms of the primary's loop; issue 33)
BULK_COMMIT = 8192


class TransactionObserver:
    """Follows one transaction (TX or DTX) from its first operation to its outcome.

    A base class, not a Protocol: the optional hooks have their defaults here, so
    the broker calls them directly instead of probing with ``getattr``.
    """

    #: why ``prepare`` said no; it becomes the text of the TransactionAborted (and so
    #: of the client's 406 on tx.commit)
    refusal: str | None = None

    def publish(self, queue: Queue, message: Message) -> None:
        """A message the transaction will enqueue on ``queue``."""
        raise NotImplementedError

    def accept(self, acked: list[tuple[Queue, Entry]], unacked: list[tuple[Queue, Entry]]) -> None:
        """Entries the transaction will dequeue (``acked``) and those it still holds."""
        raise NotImplementedError

    def prepare_needed(self) -> bool:
        """False when ``prepare`` would say yes at once.

        When no observer needs it, tx.commit applies in the same loop callback (no
        task, no extra loop iteration): the "one round trip for TX" of docs/ha.md.
        The default is the safe answer: always awaited.
        """
        return True

    async def prepare(self) -> bool:
        """Phase one: True when every participant can commit; the broker waits on it."""
        raise NotImplementedError

    def applying(self) -> None:
        """Called right before the local commit applies the transaction."""

    def commit(self) -> None:
        """After the local commit, in the same loop callback."""

    def rollback(self) -> None:
        """The transaction was rolled back (or refused); nothing of it was applied."""


class TransactionObserverFactory(Protocol):
    def create(self, transaction: Transaction) -> TransactionObserver | None:
        """An observer for ``transaction``, or None to leave it alone."""
        ...


class TransactionAborted(Exception):
    """A participant refused to prepare; nothing of the transaction was applied."""


TX_ID_HEADER = "x-tx-id"

OutcomeRecorder = Callable[["Transaction", str], None]


class Transaction:
    def __init__(self, tx_id: str, factories: list[TransactionObserverFactory], *,
                 on_outcome: OutcomeRecorder | None = None) -> None:
        self.id = tx_id
        self.client_id: str | None = None     # x-tx-id of the first message that had one
        self.replication_id: str | None = None  # the tx-queue's name, set by the HA primary
        self.on_outcome = on_outcome
        self.prepare_started = False
        self.publishes: list[tuple[list[Queue], Message]] = []
        # the publishes by queue, kept as they come (the commit's batches, ``apply``);
        # valid while it covers ``_grouped`` publishes and that is all of them
        self._by_queue: dict[Queue, list[Message]] = {}
        self._grouped = 0
        self.accepts: list[tuple[Queue, Entry]] = []
        self.rejects: list[tuple[Queue, Entry, bool]] = []
        self.observers: list[TransactionObserver] = []
        for factory in factories:
            observer = factory.create(self)
            if observer is not None:
                self.observers.append(observer)

    @property
    def empty(self) -> bool:
        return not (self.publishes or self.accepts or self.rejects)

    def publish(self, queues: list[Queue], message: Message) -> None:
        self.publishes.append((queues, message))
        if self._grouped == len(self.publishes) - 1:
            self._grouped += 1
            by_queue = self._by_queue
            for queue in queues:
                batch = by_queue.get(queue)
                if batch is None:
                    by_queue[queue] = [message]
                else:
                    batch.append(message)
        if self.client_id is None and message._headers_at >= 0:  # it has a headers table
            named = message.headers.get(TX_ID_HEADER)
            if named is not None:
                self.client_id = (named.decode("utf-8", "replace")
                                  if isinstance(named, bytes | bytearray) else str(named))
        for observer in self.observers:
            for queue in queues:
                observer.publish(queue, message)

    def accept(self, acked: list[tuple[Queue, Entry]], unacked: list[tuple[Queue, Entry]]) -> None:
        """Acknowledged entries, to be dequeued at commit; ``unacked`` stay held."""
        self.accepts.extend(acked)
        for observer in self.observers:
            observer.accept(acked, unacked)

    def reject(self, entries: list[tuple[Queue, Entry]], requeue: bool) -> None:
        """basic.reject/nack inside a transaction takes effect at commit too."""
        self.rejects.extend((q, e, requeue) for q, e in entries)
        if not requeue:
            for observer in self.observers:
                observer.accept(entries, [])

    def needs_prepare(self) -> bool:
        """Whether phase one must be awaited (some observer may say no, or later)."""
        return any(observer.prepare_needed() for observer in self.observers)

    async def prepare(self) -> bool:
        """Phase one on every observer; all must say yes."""
        self.prepare_started = True
        self._outcome("preparing")
        votes = [await observer.prepare() for observer in self.observers]
        return all(votes)

    async def commit(self) -> None:
        """Prepare, then apply everything at once; raises TransactionAborted on a no vote."""
        if self.observers and not await self.prepare():
            reasons = [o.refusal for o in self.observers if o.refusal]
            self.rollback()
            raise TransactionAborted("; ".join(reasons) if reasons else
                                     f"transaction {self.id} could not be prepared on every node")
        self.commit_prepared()

    def withhold(self, owned: Callable[[Queue], bool]) -> None:
        """Leave the publishes to ``owned`` queues out of the local commit.

        For an observer that applies them itself, later (the TxLog bridge enqueues
        on global queues once the datacenters agreed on the order). Acks stay:
        their entries are settled here as usual.
        """
        kept = []
        for queues, message in self.publishes:
            local = [q for q in queues if not owned(q)]
            if local:
                kept.append((local, message))
        self.publishes[:] = kept
        self._grouped = -1  # regrouped at the commit

    def commit_prepared(self) -> None:
        """Phase two: the local commit and its outcome record, then the observers'."""
        for observer in self.observers:
            observer.applying()
        self.apply()
        self._outcome("committed")
        for observer in self.observers:
            observer.commit()
        bulk = len(self.publishes) >= BULK_COMMIT
        self._clear()
        if bulk:
            gc_hooks.bulk_made()

    def _outcome(self, outcome: str) -> None:
        if self.on_outcome is not None:
            self.on_outcome(self, outcome)

    def apply(self) -> None:
        """The local commit: enqueue, dequeue, requeue, in the order the client asked.

        When every queue published to takes its messages as a batch (no limit,
        no deduplication: nothing one enqueue does changes another queue), each
        gets its messages in one ``enqueue_many``, the order per queue kept;
        grouped as they were published, so the commit does the least it can
        in its one loop callback. Otherwise message by message.
        """
        by_queue = self._batches()
        if all(queue.batchable for queue in by_queue):
            for queue, messages in by_queue.items():
                if not queue.deleted:
                    queue.enqueue_many(messages)
        else:
            for queues, message in self.publishes:
                for queue in queues:
                    if not queue.deleted:
                        queue.enqueue(message)
        for queue, entry in self.accepts:
            queue.settle(entry)
        for queue, entry, requeue in self.rejects:
            if requeue:
                queue.requeue(entry)
            else:
                queue.reject(entry)

    def _batches(self) -> dict[Queue, list[Message]]:
        """The publishes by queue (regrouped if they changed other than by ``publish``)."""
        if self._grouped != len(self.publishes):
            self._by_queue = {}
            for queues, message in self.publishes:
                for queue in queues:
                    self._by_queue.setdefault(queue, []).append(message)
            self._grouped = len(self.publishes)
        return self._by_queue

    def rollback(self) -> None:
        """Discard publishes; acked entries stay unacknowledged (AMQP 0-9-1 tx.rollback)."""
        for observer in self.observers:
            observer.rollback()
        if self.prepare_started:
            self._outcome("rolled back")
        self._clear()

    def _clear(self) -> None:
        """Forget what was committed or rolled back; a big transaction's lists are freed
        over the next loop turns (``release_later``), not in the commit's step."""
        release_later(self.publishes)
        self.publishes = []
        by_queue, self._by_queue = self._by_queue, {}
        for messages in by_queue.values():
            release_later(messages)
        self._grouped = 0
        release_later(self.accepts)
        self.accepts = []
        self.rejects.clear()
