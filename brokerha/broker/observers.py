"""The plugin layer the HA and TxLog code hook into.

The broker model calls these interfaces and never imports their
implementations (style.md: data flows one way). Seed 002 names the
transaction hooks: the primary registers a TransactionObserverFactory, which
gives every transaction a TransactionObserver that sees its publishes and
accepts, and whose ``prepare`` the broker awaits before it commits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from brokerha.broker.exchange import Binding, Exchange
    from brokerha.broker.message import Entry, Message
    from brokerha.broker.queue import Queue
    from brokerha.broker.transaction import Transaction


class ConfigurationObserver:
    """Sees exchanges, queues and bindings come and go (BrokerReplicator's input)."""

    def exchange_declared(self, exchange: Exchange) -> None: ...
    def exchange_deleted(self, exchange: Exchange) -> None: ...
    def queue_declared(self, queue: Queue) -> None: ...
    def queue_deleted(self, queue: Queue) -> None: ...
    def binding_created(self, binding: Binding) -> None: ...
    def binding_deleted(self, binding: Binding) -> None: ...


class QueueObserver:
    """Sees every message event on every queue (ReplicatingSubscription's input).

    enqueued: the entry is on the queue; acquired: handed to a consumer or
    basic.get; dequeued: gone for good (acked, expired, dropped, purged);
    requeued: back on the queue after a reject, nack, recover or lost consumer.
    """

    def enqueued(self, queue: Queue, entry: Entry) -> None: ...
    def acquired(self, queue: Queue, entry: Entry) -> None: ...
    def dequeued(self, queue: Queue, entry: Entry) -> None: ...
    def requeued(self, queue: Queue, entry: Entry) -> None: ...


class TransactionObserver(Protocol):
    """Follows one transaction (TX or DTX) from its first operation to its outcome."""

    def publish(self, queue: Queue, message: Message) -> None:
        """A message the transaction will enqueue on ``queue``."""

    def accept(self, acked: list[tuple[Queue, Entry]], unacked: list[tuple[Queue, Entry]]) -> None:
        """Entries the transaction will dequeue (``acked``) and those it still holds."""

    async def prepare(self) -> bool:
        """Phase one: True when every participant can commit; the broker waits on it."""
        ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...


class TransactionObserverFactory(Protocol):
    def create(self, transaction: Transaction) -> TransactionObserver | None:
        """An observer for ``transaction``, or None to leave it alone."""
        ...


class QueueHooks:
    """Per-event lists of bound methods, holding only the methods an observer overrides.

    Queues call these on every message, so a no-op default costs nothing.
    """

    EVENTS = ("enqueued", "acquired", "dequeued", "requeued")

    def __init__(self) -> None:
        self.enqueued: list[Callable[[Queue, Entry], None]] = []
        self.acquired: list[Callable[[Queue, Entry], None]] = []
        self.dequeued: list[Callable[[Queue, Entry], None]] = []
        self.requeued: list[Callable[[Queue, Entry], None]] = []

    def add(self, observer: QueueObserver) -> None:
        for event in self.EVENTS:
            if getattr(type(observer), event) is not getattr(QueueObserver, event):
                getattr(self, event).append(getattr(observer, event))


class Observers:
    """The broker's registry; each list is walked only when it is not empty."""

    def __init__(self) -> None:
        self.configuration: list[ConfigurationObserver] = []
        self.queue_hooks = QueueHooks()
        self.transactions: list[TransactionObserverFactory] = []

    def add_configuration_observer(self, observer: ConfigurationObserver) -> None:
        self.configuration.append(observer)

    def add_queue_observer(self, observer: QueueObserver) -> None:
        self.queue_hooks.add(observer)

    def add_transaction_observer_factory(self, factory: TransactionObserverFactory) -> None:
        self.transactions.append(factory)
