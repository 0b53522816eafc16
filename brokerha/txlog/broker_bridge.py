"""The TxLog inside a broker node: global queues ordered across datacenters.

The broker knows nothing of the TxLog (style.md: data flows one way); this
module plugs into its observer interfaces:

* as a ``ConfigurationObserver`` it flags global queues (``queue.is_global``:
  argument ``x-global: true`` or a ``[[txlog.global]]`` policy) while the
  master runs on this node — the AMQP layer then turns non-transactional
  publishes and acks on them into one-operation transactions;
* as a ``TransactionObserverFactory`` it gives every transaction an observer
  that collects its publishes to global queues (enqueue operations, the message
  packed into the operation) and its acks on global queues (dequeue operations
  by global message id), submits them to the local master in ``prepare`` and
  says yes when the engine ``Confirm``s: an enqueue-only transaction once
  acquired (one phase), one with a dequeue once ordered and validated; a failed
  validation is a no, with a ``refusal`` the client sees in its 406;
* the master's ``DeliverOrdered`` actions are applied here, in order, in every
  DC including the origin: an enqueue adds the message (same global id) to the
  global queue, a dequeue removes the message with that global id wherever it
  is (ready: now; held by a consumer: when it settles or requeues it). The
  broker's local commit never applies a global queue's publishes
  (``Transaction.withhold``); its acks it settles as usual, after the dequeue
  was ordered.

The global message id is the message's ``message_id`` property, or, when the
publisher set none, a generated one written into the message's ``message_id``
(so every DC's copy carries it, and it survives a restart of the node).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote

import msgpack

from brokerha.broker.arguments import GLOBAL_ARG
from brokerha.broker.content import read_message_id, rewrite_properties
from brokerha.broker.errors import BrokerError
from brokerha.broker.message import Entry, Message
from brokerha.broker.observers import ConfigurationObserver
from brokerha.broker.queue import Queue
from brokerha.txlog.driver import TxLogDriver
from brokerha.txlog.messages import Action, Backup, DeliverOrdered, Restore
from brokerha.txlog.records import Operation
from brokerha.txlog.settings import NodeTxLog
from brokerha.txlog.validation import COMMITTED

log = logging.getLogger("brokerha.txlog")

COMMIT_TIMEOUT = 30.0  # seconds a commit waits for the TxLog's answer


def queue_key(vhost: str, name: str) -> str:
    """The queue of an operation: ``<vhost, percent-encoded>/<queue name>``."""
    return f"{quote(vhost, safe='')}/{name}"


def parse_queue_key(key: str) -> tuple[str, str]:
    vhost, sep, name = key.partition("/")
    if not sep:
        raise ValueError(f"not a queue key: {key!r}")
    return unquote(vhost), name


def pack_message(message: Message, header: bytes) -> bytes:
    return msgpack.packb([message.exchange, message.routing_key, header, message.body],
                         use_bin_type=True)


def unpack_message(data: bytes) -> Message:
    exchange, routing_key, header, body = msgpack.unpackb(data, raw=False)
    return Message(exchange, routing_key, header, body)


class Refusal(Exception):
    """Why a transaction on global queues cannot be submitted."""


class TxLogBridge(ConfigurationObserver):
    """A node's TxLog master and its global queues (see the module docstring)."""

    def __init__(self, broker: Any, config: NodeTxLog, *,
                 driver_factory: Callable[..., TxLogDriver] = TxLogDriver,
                 commit_timeout: float = COMMIT_TIMEOUT) -> None:
        self.broker = broker
        self.config = config
        self.node_id = config.settings.txlog.node_id
        self.driver_factory = driver_factory
        self.commit_timeout = commit_timeout
        self.driver: TxLogDriver | None = None
        self.reason = "not started (a cluster member runs it only while it is the primary)"
        # global queue key -> global message id -> replication id (position) of its entry
        self.index: dict[str, dict[str, int]] = {}
        self.counters = dict.fromkeys(
            ("submitted", "refused", "validation_failed", "applied_committed", "applied_failed",
             "enqueued", "dequeued", "duplicate_enqueues", "dequeued_elsewhere_while_held",
             "missing_bodies", "declared_missing_queues", "backups_ignored",
             "restores_ignored"), 0)
        broker.observers.add_transaction_observer_factory(self)
        broker.observers.add_configuration_observer(self)

    # ---- life cycle ------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.driver is not None

    async def start(self) -> None:
        """Run the master (a standalone node at start; an HA primary before it serves)."""
        if self.driver is not None:
            return
        driver = self.driver_factory(self.config.settings, on_action=self.on_action)
        self.driver = driver
        try:
            await driver.start()
        except BaseException:
            self.driver = None
            driver.journal.close()
            raise
        for vhost in self.broker.vhosts.values():
            for queue in vhost.queues.values():
                self._flag(queue)
        log.info("txlog master %s running on this node: peers on %s:%d, %d sync peer(s), "
                 "%d global queue(s), synchronised length %d", self.node_id,
                 *(driver.address or ("?", 0)), len(driver.engine.config.peers),
                 len(self.index), len(driver.engine.sync))

    async def stop(self, reason: str = "stopped") -> None:
        driver, self.driver = self.driver, None
        self.reason = reason
        for vhost in self.broker.vhosts.values():
            for queue in vhost.queues.values():
                queue.is_global = False
        self.index.clear()
        if driver is not None:
            await driver.close()
            log.info("txlog master %s stopped on this node: %s", self.node_id, reason)

    # ---- which queues are global -----------------------------------------------------

    def is_global(self, queue: Queue) -> bool:
        if queue.arguments.get(GLOBAL_ARG) is True:
            return True
        return any(p.matches(queue.vhost, queue.name) for p in self.config.policies)

    def _flag(self, queue: Queue) -> None:
        queue.is_global = self.is_global(queue)
        if not queue.is_global:
            return
        ids: dict[str, int] = {}
        for entry in queue.ready:
            gid = read_message_id(entry.message.header)
            if gid is not None:
                ids.setdefault(gid, entry.position)
        self.index[queue_key(queue.vhost, queue.name)] = ids

    def queue_declared(self, queue: Queue) -> None:
        if self.running:
            self._flag(queue)

    def queue_deleted(self, queue: Queue) -> None:
        self.index.pop(queue_key(queue.vhost, queue.name), None)

    # ---- transactions ----------------------------------------------------------------

    def create(self, transaction: Any) -> GlobalTxObserver | None:
        return GlobalTxObserver(self, transaction) if self.running else None

    def operations(self, enqueues: list[tuple[Queue, Message]],
                   dequeues: list[tuple[Queue, Entry]]) -> list[Operation]:
        ops = []
        generated: dict[int, tuple[str, bytes]] = {}  # id(message) -> (gid, header)
        for queue, message in enqueues:
            if id(message) not in generated:
                gid = read_message_id(message.header)
                header = message.header
                if gid is None:
                    gid = f"{self.node_id}.{uuid.uuid4().hex}"
                    header = rewrite_properties(header, message_id=gid)
                generated[id(message)] = (gid, header)
            gid, header = generated[id(message)]
            ops.append(Operation("enqueue", queue_key(queue.vhost, queue.name), gid,
                                 pack_message(message, header)))
        for queue, entry in dequeues:
            gid = read_message_id(entry.message.header)
            if gid is None:
                raise Refusal(f"a message of global queue '{queue.name}' has no global id "
                              "(it was queued before the queue became global)")
            ops.append(Operation("dequeue", queue_key(queue.vhost, queue.name), gid))
        return ops

    async def submit(self, ops: list[Operation]) -> str | None:
        """None when confirmed committed, else the refusal (the text of the client's 406)."""
        driver = self.driver
        if driver is None:
            self.counters["refused"] += 1
            return f"the TxLog master is not running on this node ({self.reason})"
        self.counters["submitted"] += 1
        try:
            result = await driver.submit(ops, "confirm", self.commit_timeout)
        except TimeoutError:
            self.counters["refused"] += 1
            return (f"the TxLog did not order the transaction within {self.commit_timeout:g}s "
                    "(is a datacenter unreachable?)")
        except ConnectionError as exc:
            self.counters["refused"] += 1
            return f"the TxLog master stopped: {exc}"
        if result.get("outcome") != COMMITTED:
            self.counters["validation_failed"] += 1
            return (f"TxLog transaction {result.get('tx_id')} failed validation: a message it "
                    "dequeues was consumed by an earlier transaction (in this or another "
                    "datacenter)")
        return None

    # ---- applying the synchronised order -----------------------------------------------

    def on_action(self, action: Action) -> None:
        if isinstance(action, DeliverOrdered):
            self._deliver(action)
        elif isinstance(action, Backup):
            self.counters["backups_ignored"] += 1
            log.warning("txlog: split detected; a backup of the broker state at position %d "
                        "is not taken (not implemented in broker nodes)", action.position)
        elif isinstance(action, Restore):
            self.counters["restores_ignored"] += 1
            log.warning("txlog: restore of the broker state at position %d is not "
                        "implemented in broker nodes; replayed transactions are applied on "
                        "the current state (enqueues by global id are idempotent)",
                        action.position)

    def _deliver(self, action: DeliverOrdered) -> None:
        driver = self.driver
        body = driver.engine.durable.bodies.get(action.tx_id) if driver is not None else None
        if body is None:
            self.counters["missing_bodies"] += 1
            log.error("txlog: no body for ordered transaction %s; not applied", action.tx_id)
            return
        if action.outcome != COMMITTED:
            self.counters["applied_failed"] += 1
            return  # failed validation: nothing of it applies, in any DC
        self.counters["applied_committed"] += 1
        for op in body.operations:
            try:
                if op.kind == "enqueue":
                    self._enqueue(op)
                else:
                    self._dequeue(op)
            except (BrokerError, ValueError) as exc:
                log.error("txlog: cannot apply %s of %s on %s (tx %s): %s", op.kind,
                          op.message_id, op.queue, action.tx_id, exc)

    def _queue(self, key: str, create: bool) -> Queue | None:
        vhost_name, name = parse_queue_key(key)
        vhost = self.broker.vhosts.get(vhost_name)
        if vhost is None:
            return None
        queue = vhost.queues.get(name)
        if queue is None and create:
            # declared in another DC only: declare it here so every DC holds the same
            self.counters["declared_missing_queues"] += 1
            log.warning("txlog: global queue '%s' in vhost '%s' declared here (durable) "
                        "for an ordered enqueue", name, vhost_name)
            queue = vhost.declare_queue(name, owner=None, durable=True,
                                        arguments={GLOBAL_ARG: True})
            self._flag(queue)
        return queue

    def _enqueue(self, op: Operation) -> None:
        queue = self._queue(op.queue, create=True)
        if queue is None:
            log.error("txlog: no vhost for global queue %s; enqueue of %s not applied",
                      op.queue, op.message_id)
            return
        ids = self.index.setdefault(op.queue, {})
        if op.message_id in ids:  # the same global id twice (or re-applied): held once
            self.counters["duplicate_enqueues"] += 1
            return
        message = unpack_message(op.data)
        entry = queue.add_entry(Entry(queue.next_position, message, None))
        ids[op.message_id] = entry.position
        self.counters["enqueued"] += 1

    def _dequeue(self, op: Operation) -> None:
        position = self.index.get(op.queue, {}).pop(op.message_id, None)
        queue = self._queue(op.queue, create=False)
        if position is None or queue is None:
            return
        self.counters["dequeued"] += 1
        if not queue.withdraw(position):
            self.counters["dequeued_elsewhere_while_held"] += 1

    # ---- views -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        if self.driver is None:
            return {"running": False, "reason": self.reason}
        status = self.driver.status()
        status["running"] = True
        status["global_queues"] = {key: len(ids) for key, ids in sorted(self.index.items())}
        status["bridge"] = dict(self.counters)
        return status


class GlobalTxObserver:
    """One transaction's operations on global queues; ``prepare`` waits for the TxLog."""

    def __init__(self, bridge: TxLogBridge, transaction: Any) -> None:
        self.bridge = bridge
        self.transaction = transaction
        self.enqueues: list[tuple[Queue, Message]] = []
        self.dequeues: list[tuple[Queue, Entry]] = []
        self.refusal: str | None = None

    def publish(self, queue: Queue, message: Message) -> None:
        if queue.is_global:
            self.enqueues.append((queue, message))

    def accept(self, acked: list[tuple[Queue, Entry]], unacked: list[tuple[Queue, Entry]]) -> None:
        self.dequeues.extend((q, e) for q, e in acked if q.is_global)

    async def prepare(self) -> bool:
        if not self.enqueues and not self.dequeues:
            return True
        if hasattr(self.transaction, "xid"):
            self.refusal = "XA (dtx) transactions on global queues are not supported"
            return False
        try:
            ops = self.bridge.operations(self.enqueues, self.dequeues)
        except Refusal as exc:
            self.refusal = str(exc)
            return False
        self.refusal = await self.bridge.submit(ops)
        return self.refusal is None

    def applying(self) -> None:
        """The local commit leaves global queues alone: DeliverOrdered enqueues there."""
        if self.enqueues:
            mine = {id(q) for q, _ in self.enqueues}
            self.transaction.withhold(lambda q: id(q) in mine)

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass
