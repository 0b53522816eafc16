"""The store interface the broker writes durable state through.

A store sees the broker as an observer does (configuration and queue events)
and keeps what is durable: durable exchanges, queues and bindings, persistent
messages on durable queues, and their acknowledgements. ``after_sync`` is the
durability barrier: a publisher confirm or a tx.commit-ok is released only by
the callback, after the write that covers it is durable (group commit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from brokerha.broker.exchange import Binding, Exchange
from brokerha.broker.message import Entry
from brokerha.broker.observers import ConfigurationObserver, QueueObserver
from brokerha.broker.queue import Queue


@dataclass
class StoredMessage:
    vhost: str
    queue: str
    position: int
    exchange: str
    routing_key: str
    header: bytes
    body: bytes
    redelivered: bool = False


@dataclass
class Definitions:
    """What a store returns at start-up."""

    exchanges: dict[tuple[str, str], Exchange] = field(default_factory=dict)
    queues: dict[tuple[str, str], Queue] = field(default_factory=dict)
    bindings: dict[tuple[str, str, tuple[object, ...]], Binding] = field(default_factory=dict)
    messages: dict[tuple[str, str, int], StoredMessage] = field(default_factory=dict)


class Store(ConfigurationObserver, QueueObserver):
    """Base class: filters durable things and hands them to ``_put``/``_drop``."""

    def after_sync(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything written so far is durable."""
        raise NotImplementedError

    def load(self) -> Definitions:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release resources."""


class MemoryStore(Store):
    """Keeps durable state in memory: the default until a durable store is configured.

    Nothing survives a restart; what it records is what a durable store would
    write, which the tests use to check that the broker reports the right things.
    """

    def __init__(self) -> None:
        self.definitions = Definitions()

    def after_sync(self, callback: Callable[[], None]) -> None:
        callback()

    def load(self) -> Definitions:
        return self.definitions

    # configuration
    def exchange_declared(self, exchange: Exchange) -> None:
        if exchange.durable:
            self.definitions.exchanges[(exchange.vhost, exchange.name)] = exchange

    def exchange_deleted(self, exchange: Exchange) -> None:
        self.definitions.exchanges.pop((exchange.vhost, exchange.name), None)

    def queue_declared(self, queue: Queue) -> None:
        if queue.durable:
            self.definitions.queues[(queue.vhost, queue.name)] = queue

    def queue_deleted(self, queue: Queue) -> None:
        self.definitions.queues.pop((queue.vhost, queue.name), None)
        stale = [k for k in self.definitions.messages if k[:2] == (queue.vhost, queue.name)]
        for key in stale:
            del self.definitions.messages[key]

    def binding_created(self, binding: Binding) -> None:
        if binding.source.durable and getattr(binding.destination, "durable", False):
            self.definitions.bindings[(binding.source.vhost, binding.source.name, binding.key)] = binding

    def binding_deleted(self, binding: Binding) -> None:
        self.definitions.bindings.pop((binding.source.vhost, binding.source.name, binding.key), None)

    # messages
    def enqueued(self, queue: Queue, entry: Entry) -> None:
        if queue.durable and entry.message.persistent:
            m = entry.message
            self.definitions.messages[(queue.vhost, queue.name, entry.position)] = StoredMessage(
                queue.vhost, queue.name, entry.position, m.exchange, m.routing_key, m.header, m.body
            )

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        if queue.durable and entry.message.persistent:
            self.definitions.messages.pop((queue.vhost, queue.name, entry.position), None)
