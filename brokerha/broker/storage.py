"""The storage interface the broker writes durable state through (the store package implements it).

A store sees the broker as an observer does (configuration and queue events)
and keeps what is durable: durable exchanges, queues and bindings, persistent
messages on durable queues, whether they were delivered, and their removal.
``after_sync`` is the durability barrier: a publisher confirm or a
tx.commit-ok is released only by its callback, after the write that covers it
is durable (group commit). ``load`` returns plain records for recovery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from brokerha.broker.definitions import KINDS, DefinitionChange
from brokerha.broker.exchange import Binding, Exchange
from brokerha.broker.message import Entry
from brokerha.broker.observers import ConfigurationObserver, QueueObserver
from brokerha.broker.queue import Queue


@dataclass(frozen=True)
class ExchangeRecord:
    vhost: str
    name: str
    type: str
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class QueueRecord:
    vhost: str
    name: str
    auto_delete: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BindingRecord:
    vhost: str
    source: str
    destination_kind: str  # "queue" or "exchange"
    destination: str
    routing_key: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class StoredMessage:
    vhost: str
    queue: str
    position: int
    exchange: str
    routing_key: str
    header: bytes
    body: bytes
    delivered: bool = False  # acquired at least once: comes back redelivered=true


@dataclass
class PreparedBranch:
    """A prepared XA branch as stored: what it will enqueue and which entries it dequeues.

    ``publishes``: (vhost, [queue names], exchange, routing_key, header, body);
    ``accepts``: (vhost, queue name, position) of entries the branch holds.
    """

    xid: str
    publishes: list[tuple[str, list[str], str, str, bytes, bytes]] = field(default_factory=list)
    accepts: list[tuple[str, str, int]] = field(default_factory=list)


@dataclass
class Recovered:
    """What a store returns at start-up, in the order it must be applied."""

    exchanges: list[ExchangeRecord] = field(default_factory=list)
    queues: list[QueueRecord] = field(default_factory=list)
    bindings: list[BindingRecord] = field(default_factory=list)
    # by queue, then position; an iterator when a store streams them (SQLStore.load)
    messages: Iterable[StoredMessage] = field(default_factory=list)
    prepared: list[PreparedBranch] = field(default_factory=list)
    # transactions a backup prepared for its primary: (txid, payload), brokerha.backup.tx_buffer
    ha_transactions: list[tuple[str, bytes]] = field(default_factory=list)
    # (txid, client id, outcome, at): brokerha.broker.tx_outcomes
    outcomes: list[tuple[str, str | None, str, float]] = field(default_factory=list)
    # vhosts, users, permissions, policies: DefinitionChange.as_wire() of each one defined
    # (brokerha.broker.definitions), in KINDS order
    definitions: list[list[Any]] = field(default_factory=list)


def prepared_branch(xid: str, publishes: list[tuple[list[Queue], Any]],
                    accepts: list[tuple[Queue, Entry]]) -> PreparedBranch:
    """The record of a prepared branch (from a DtxBranch's buffers)."""
    record = PreparedBranch(xid)
    for queues, m in publishes:
        names = [q.name for q in queues]
        vhost = queues[0].vhost if queues else ""
        record.publishes.append((vhost, names, m.exchange, m.routing_key, m.header, m.body))
    for q, e in accepts:
        record.accepts.append((q.vhost, q.name, e.position))
    return record


def stored_definitions(changes: Iterable[DefinitionChange]) -> list[list[Any]]:
    """The definitions a store holds, as ``Recovered.definitions`` lists them."""
    order = {kind: i for i, kind in enumerate(KINDS)}
    return [c.as_wire() for c in sorted(changes, key=lambda c: (order[c.kind], c.key))]


def exchange_record(ex: Exchange) -> ExchangeRecord:
    return ExchangeRecord(ex.vhost, ex.name, ex.type, ex.auto_delete, ex.internal,
                          dict(ex.arguments))


def queue_record(q: Queue) -> QueueRecord:
    return QueueRecord(q.vhost, q.name, q.auto_delete, dict(q.arguments))


def binding_record(b: Binding) -> BindingRecord:
    kind = "exchange" if isinstance(b.destination, Exchange) else "queue"
    return BindingRecord(b.source.vhost, b.source.name, kind, b.destination.name,
                         b.routing_key, dict(b.arguments))


def binding_key(r: BindingRecord) -> tuple[str, ...]:
    """A hashable identity for a binding record (arguments included)."""
    return (r.vhost, r.source, r.destination_kind, r.destination, r.routing_key,
            repr(sorted(r.arguments.items())))


def is_durable_binding(b: Binding) -> bool:
    return b.source.durable and bool(getattr(b.destination, "durable", False))


def stored(queue: Queue, entry: Entry) -> StoredMessage:
    m = entry.message
    return StoredMessage(queue.vhost, queue.name, entry.position, m.exchange, m.routing_key,
                         m.header, m.body, entry.delivery_count > 0 or entry.redelivered)


def keeps(queue: Queue, entry: Entry) -> bool:
    """Only persistent messages on durable queues are stored."""
    return queue.durable and entry.message.persistent


class Store(ConfigurationObserver, QueueObserver):
    """Base class of every store."""

    # Set by the node: called (on the loop thread) when the store can no longer
    # persist; the node stops rather than keep confirming (fail-stop).
    on_failure: Callable[[BaseException], None] | None = None
    # Set by the node: called (on the loop thread) with why, when a write found the disk
    # full (the store retries it; nothing is lost or reordered), and with None once a
    # retry succeeded. The node raises the disk alarm meanwhile.
    on_disk_full: Callable[[str | None], None] | None = None

    def local_directories(self) -> list[Path]:
        """Directories this store writes to on this machine (the disk alarm watches them)."""
        return []

    # Whether bodies of stored messages can be dropped from memory and read
    # back with ``read_bodies`` (brokerha.broker.paging); a MemoryStore cannot.
    can_page = False

    def read_bodies(self, vhost: str, queue: str,
                    positions: list[int]) -> dict[int, tuple[bytes, bytes]]:
        """(header, body) of committed stored messages, by position (loop thread)."""
        raise NotImplementedError

    def start(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Begin writing; callbacks of ``after_sync`` run on ``loop``."""

    def after_sync(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything written so far is durable."""
        raise NotImplementedError

    def after_readable(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything written so far can be read back (``read_bodies``).

        The same as ``after_sync`` unless the store makes writes durable in a
        log first and applies them to what it reads from later (the SQLite
        store's operation log).
        """
        self.after_sync(callback)

    def before_batch(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` (loop thread) right before each batch of writes is handed over.

        What the hook records joins that batch: the HA primary writes its
        position there, so a confirm waits for one commit, not two in a row.
        A store without batches (memory) writes at once and needs no hook.
        """

    def load(self) -> Recovered:
        raise NotImplementedError

    def dtx_prepared(self, record: PreparedBranch, done: Callable[[], None]) -> None:
        """Write a prepared XA branch durably, then call ``done`` (on the loop)."""
        raise NotImplementedError

    def dtx_finished(self, xid: str) -> None:
        """The branch was committed, rolled back or forgotten: drop its record."""
        raise NotImplementedError

    def ha_tx_prepared(self, txid: str, payload: bytes, done: Callable[[], None]) -> None:
        """A backup's prepared transaction (an opaque record of the HA layer), then ``done``."""
        raise NotImplementedError

    def ha_tx_finished(self, txid: str) -> None:
        """The prepared transaction was committed or rolled back: drop its record."""
        raise NotImplementedError

    def tx_outcome(self, txid: str, client_id: str | None, outcome: str, at: float) -> None:
        """Record a transaction's outcome (an upsert)."""
        raise NotImplementedError

    def tx_outcome_deleted(self, txid: str) -> None:
        raise NotImplementedError

    def definition_changed(self, change: DefinitionChange) -> None:
        """A vhost, user, permission or policy set or deleted (``broker/definitions.py``).

        Written in order with everything else; ``load`` returns what is defined.
        """
        raise NotImplementedError

    def put_meta(self, key: str, value: str) -> None:
        """Record a small named value, written with everything recorded before it.

        It is durable when an ``after_sync`` registered after this call runs:
        the HA layer keeps its replication position here so that the position
        and the data it covers become durable in the same commit.
        """
        raise NotImplementedError

    def get_meta(self, key: str) -> str | None:
        """A value written by ``put_meta`` (read at start-up, before ``start``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush what is pending and release resources."""


class MemoryStore(Store):
    """Keeps durable state in memory: the default until a durable store is configured.

    Nothing survives a restart; what it records is what a durable store would
    write, which the tests use to check that the broker reports the right things.
    """

    def __init__(self) -> None:
        self.exchanges: dict[tuple[str, str], ExchangeRecord] = {}
        self.queues: dict[tuple[str, str], QueueRecord] = {}
        self.bindings: dict[tuple[str, ...], BindingRecord] = {}
        self.messages: dict[tuple[str, str, int], StoredMessage] = {}
        self.prepared: dict[str, PreparedBranch] = {}
        self.ha_transactions: dict[str, bytes] = {}
        self.outcomes: dict[str, tuple[str, str | None, str, float]] = {}
        self.meta: dict[str, str] = {}
        self.definitions: dict[tuple[str, tuple[str, ...]], DefinitionChange] = {}

    def definition_changed(self, change: DefinitionChange) -> None:
        if change.value is None:
            self.definitions.pop((change.kind, change.key), None)
        else:
            self.definitions[(change.kind, change.key)] = change

    def put_meta(self, key: str, value: str) -> None:
        self.meta[key] = value

    def get_meta(self, key: str) -> str | None:
        return self.meta.get(key)

    def ha_tx_prepared(self, txid: str, payload: bytes, done: Callable[[], None]) -> None:
        self.ha_transactions[txid] = payload
        done()

    def ha_tx_finished(self, txid: str) -> None:
        self.ha_transactions.pop(txid, None)

    def tx_outcome(self, txid: str, client_id: str | None, outcome: str, at: float) -> None:
        self.outcomes[txid] = (txid, client_id, outcome, at)

    def tx_outcome_deleted(self, txid: str) -> None:
        self.outcomes.pop(txid, None)

    def dtx_prepared(self, record: PreparedBranch, done: Callable[[], None]) -> None:
        self.prepared[record.xid] = record
        done()

    def dtx_finished(self, xid: str) -> None:
        self.prepared.pop(xid, None)

    def after_sync(self, callback: Callable[[], None]) -> None:
        callback()

    def load(self) -> Recovered:
        return Recovered(list(self.exchanges.values()), list(self.queues.values()),
                           list(self.bindings.values()),
                           sorted(self.messages.values(),
                                  key=lambda m: (m.vhost, m.queue, m.position)),
                           list(self.prepared.values()), list(self.ha_transactions.items()),
                           list(self.outcomes.values()), stored_definitions(
                               self.definitions.values()))

    def exchange_declared(self, exchange: Exchange) -> None:
        if exchange.durable:
            self.exchanges[(exchange.vhost, exchange.name)] = exchange_record(exchange)

    def exchange_deleted(self, exchange: Exchange) -> None:
        self.exchanges.pop((exchange.vhost, exchange.name), None)

    def queue_declared(self, queue: Queue) -> None:
        if queue.durable:
            self.queues[(queue.vhost, queue.name)] = queue_record(queue)

    def queue_deleted(self, queue: Queue) -> None:
        self.queues.pop((queue.vhost, queue.name), None)
        for key in [k for k in self.messages if k[:2] == (queue.vhost, queue.name)]:
            del self.messages[key]

    def binding_created(self, binding: Binding) -> None:
        if is_durable_binding(binding):
            record = binding_record(binding)
            self.bindings[binding_key(record)] = record

    def binding_deleted(self, binding: Binding) -> None:
        self.bindings.pop(binding_key(binding_record(binding)), None)

    def enqueued(self, queue: Queue, entry: Entry) -> None:
        if keeps(queue, entry):
            self.messages[(queue.vhost, queue.name, entry.position)] = stored(queue, entry)

    def enqueued_many(self, queue: Queue, entries: list[Entry]) -> None:
        for entry in entries:
            self.enqueued(queue, entry)

    def acquired(self, queue: Queue, entry: Entry) -> None:
        if keeps(queue, entry):
            record = self.messages.get((queue.vhost, queue.name, entry.position))
            if record is not None:
                record.delivered = True

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        # of a deleted queue: gone with it (and a queue of the same name may use the position)
        if keeps(queue, entry) and not queue.deleted:
            self.messages.pop((queue.vhost, queue.name, entry.position), None)

    def purged(self, queue: Queue, ranges: list[tuple[int, int]]) -> None:
        if not queue.durable:
            return
        key = (queue.vhost, queue.name)
        if sum(hi - lo + 1 for lo, hi in ranges) <= len(self.messages):  # a slice: by position
            for lo, hi in ranges:
                for position in range(lo, hi + 1):
                    self.messages.pop((*key, position), None)
            return
        for k in [k for k in self.messages
                  if k[:2] == key and any(lo <= k[2] <= hi for lo, hi in ranges)]:
            del self.messages[k]
