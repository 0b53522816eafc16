"""The plugin layer the HA and TxLog code hook into.

The broker model calls these interfaces and never imports their
implementations (style.md: data flows one way). Seed 002 names the
transaction hooks: the primary registers a TransactionObserverFactory, which
gives every transaction a TransactionObserver that sees its publishes and
accepts, and whose ``prepare`` the broker awaits before it commits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from brokerha.broker.queue import QueueHooks, noop_hook
from brokerha.broker.transaction import TransactionObserver, TransactionObserverFactory

if TYPE_CHECKING:
    from brokerha.broker.exchange import Binding, Exchange
    from brokerha.broker.message import Entry, Message
    from brokerha.broker.queue import Queue

__all__ = [
    "ConfigurationObserver", "Observers", "QueueObserver", "TransactionObserver",
    "TransactionObserverFactory",
]


class ConfigurationObserver:
    """Sees exchanges, queues and bindings come and go (BrokerReplicator's input)."""

    def exchange_declared(self, exchange: Exchange) -> None: ...
    def exchange_deleted(self, exchange: Exchange) -> None: ...
    def queue_declared(self, queue: Queue) -> None: ...

    def queue_declaring(self, vhost: str, name: str, exclusive: bool, auto_delete: bool,
                        arguments: dict[str, Any]) -> None:
        """Before a new queue is created: raise a BrokerError (e.g. 406) to refuse it."""

    def queue_deleted(self, queue: Queue) -> None: ...
    def binding_created(self, binding: Binding) -> None: ...
    def binding_deleted(self, binding: Binding) -> None: ...


class QueueObserver:
    """Sees every message event on every queue (ReplicatingSubscription's input).

    enqueued: the entry is on the queue; acquired: handed to a consumer or
    basic.get; dequeued: gone for good (acked, expired, dropped, purged);
    requeued: back on the queue after a reject, nack, recover or lost consumer;
    enqueued_many: ``enqueued`` for a batch, the entries of one call in order.
    The ready entries of a deleted queue get no ``dequeued``: ``queue_deleted``
    (a ConfigurationObserver's) covers them.

    purged: a queue.purge in one call, instead of a ``dequeued`` per purged
    entry (an observer that overrides it gets none for them): ``ranges`` are
    (first, last) positions, inclusive, that hold every purged entry and no
    entry still on the queue (acquired ones); positions of entries settled
    before may be in them. Not called if the queue was deleted before the
    purge's ranges were known (``broker/drain.py``).
    """

    @noop_hook
    def enqueued(self, queue: Queue, entry: Entry) -> None: ...
    @noop_hook
    def acquired(self, queue: Queue, entry: Entry) -> None: ...
    @noop_hook
    def dequeued(self, queue: Queue, entry: Entry) -> None: ...
    @noop_hook
    def requeued(self, queue: Queue, entry: Entry) -> None: ...
    @noop_hook
    def purged(self, queue: Queue, ranges: list[tuple[int, int]]) -> None: ...
    @noop_hook
    def enqueued_many(self, queue: Queue, entries: list[Entry]) -> None:
        """A batch of enqueues (a transaction's, in order) in one call: an observer that
        overrides it gets no ``enqueued`` for them."""


class Observers:
    """The broker's registry; each list is walked only when it is not empty."""

    def __init__(self) -> None:
        self.configuration: list[ConfigurationObserver] = []
        self.queue_hooks = QueueHooks()
        self.transactions: list[TransactionObserverFactory] = []
        # a dead letter routed to queues whose partitions other nodes lead (a partitioned
        # node's copies: ``VirtualHost.followed``): (source, targets, message) handed to the
        # node's forwarding (partition/forwarding.py); None: dropped with a warning
        self.dead_letters_elsewhere: Callable[[Queue, list[Queue], Message], None] | None = \
            None

    def add_configuration_observer(self, observer: ConfigurationObserver) -> None:
        self.configuration.append(observer)

    def add_queue_observer(self, observer: QueueObserver) -> None:
        self.queue_hooks.add(observer)

    def add_transaction_observer_factory(self, factory: TransactionObserverFactory) -> None:
        self.transactions.append(factory)
