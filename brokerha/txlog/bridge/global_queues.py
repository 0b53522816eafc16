"""Global queues on a broker node: which queues are global, and the TxLog's order applied.

``GlobalQueues`` is the ordering policy of the node's global queues, which
``TxLogBridge`` (``broker_bridge.py``) installs while the master runs here:

* as a ``ConfigurationObserver`` it installs itself as the ``QueueOrdering``
  (``broker/queue.py``) of every global queue (argument ``x-global: true``
  or a ``[[txlog.global]]`` policy) — the AMQP layer then turns
  non-transactional publishes and acks on them into one-operation
  transactions — and refuses, at declare, a global queue that would expire or
  be deleted in one datacenter only (``queue_declaring``);
* as that ``QueueOrdering`` it refuses what would change one DC's copy only
  (a purge, deleting a non-empty global queue, no-ack, a management ``get``)
  and makes dead letters into global queues ordered enqueues (``publish``);
* ``operations`` turns a transaction's publishes and acks on global queues
  into TxLog operations (``tx_observer.py`` submits them);
* ``apply`` carries out the master's ``DeliverOrdered`` actions, in order, in
  every DC including the origin: an enqueue adds the message (same global id)
  to the global queue, a dequeue removes the message with that global id
  wherever it is (ready: now; held by a consumer: when it settles or requeues
  it). ``index`` maps each global queue to its messages by global id.

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

from brokerha.broker.arguments import GLOBAL_ARG, LOCAL_ONLY_ARGS
from brokerha.broker.content import read_message_id, rewrite_properties
from brokerha.broker.errors import BrokerError, PreconditionFailed
from brokerha.broker.message import Entry, Message
from brokerha.broker.observers import ConfigurationObserver
from brokerha.broker.queue import Queue, QueueOrdering
from brokerha.txlog.bridge.broker_state import SplitBackups
from brokerha.txlog.engine.messages import DeliverOrdered
from brokerha.txlog.engine.records import Operation, TxBody
from brokerha.txlog.engine.validation import COMMITTED
from brokerha.txlog.master.settings import NodeTxLog

log = logging.getLogger("brokerha.txlog")


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


class GlobalQueues(ConfigurationObserver, QueueOrdering):
    """The global queues of one broker and the TxLog's order applied to them."""

    def __init__(self, broker: Any, config: NodeTxLog, counters: dict[str, int],
                 recovery: SplitBackups, running: Callable[[], bool]) -> None:
        self.broker = broker
        self.config = config
        self.node_id = config.settings.txlog.node_id
        self.counters = counters  # the bridge's (its status)
        self.recovery = recovery  # split recovery's undo records of what is applied
        self._running = running
        # global queue key -> global message id -> its entry (ready, or held by a consumer)
        self.index: dict[str, dict[str, Entry]] = {}
        broker.observers.add_configuration_observer(self)

    @property
    def running(self) -> bool:
        return self._running()

    def flag_all(self) -> None:
        """The master starts here: every existing queue flagged (and indexed) if global."""
        for vhost in self.broker.vhosts.values():
            for queue in vhost.queues.values():
                self.flag(queue)

    def unflag_all(self) -> None:
        """The master stopped here: no queue is global on this node now."""
        for vhost in self.broker.vhosts.values():
            for queue in vhost.queues.values():
                if queue.ordering is self:
                    queue.ordering = None
        self.index.clear()

    def is_global(self, queue: Queue) -> bool:
        if queue.arguments.get(GLOBAL_ARG) is True:
            return True
        return any(p.matches(queue.vhost, queue.name) for p in self.config.policies)

    def flag(self, queue: Queue) -> None:
        """Order ``queue`` (and index its messages by global id) if it is global."""
        if not self.is_global(queue):
            if queue.ordering is self:
                queue.ordering = None
            return
        queue.ordering = self
        ids: dict[str, Entry] = {}
        for entry in queue.ready:
            gid = read_message_id(entry.message.header)
            if gid is not None:
                ids.setdefault(gid, entry)
        self.index[queue_key(queue.vhost, queue.name)] = ids

    def queue_declared(self, queue: Queue) -> None:
        if self.running:
            self.flag(queue)

    def queue_declaring(self, vhost: str, name: str, exclusive: bool, auto_delete: bool,
                        arguments: dict[str, Any]) -> None:
        """Refuse a global queue that would lose messages in one datacenter only.

        ``x-global`` with expiry or limits is refused by the argument checks
        already; a policy makes a queue global whatever its arguments, so the
        same rule is applied here. An exclusive or auto-delete queue is deleted
        by one DC's connection or consumer going away.
        """
        if not self.running:
            return
        by_policy = any(p.matches(vhost, name) for p in self.config.policies)
        if arguments.get(GLOBAL_ARG) is not True and not by_policy:
            return
        where = f"queue '{name}' in vhost '{vhost}'"
        if exclusive or auto_delete:
            raise PreconditionFailed(
                f"{where} is a global queue: it cannot be {'exclusive' if exclusive else 'auto-delete'}"
                " (it would be deleted in this datacenter only)")
        for local_only in LOCAL_ONLY_ARGS:
            if local_only in arguments:
                raise PreconditionFailed(
                    f"invalid arg '{local_only}' for {where}: a global queue (by a [[txlog.global]] "
                    "policy) drops messages only through ordered dequeues")

    # ---- the QueueOrdering of the global queues (broker/queue.py) ---------------------

    def publish(self, queues: list[Queue], message: Message) -> None:
        """An enqueue the broker makes itself (a dead letter) into global queues: ordered.

        One enqueue-only TxLog transaction, as for a publish without confirms;
        if the TxLog refuses it (not running, no answer), the dead letter is lost
        in every DC alike and the refusal is logged.
        """
        self.counters["ordered_dead_letters"] += 1
        tx = self.broker.new_transaction()
        tx.publish(queues, message)

        def done(exc: BaseException | None) -> None:
            if exc is not None:
                log.warning("txlog: dead letter into global queue(s) %s not ordered: %s",
                            ", ".join(q.name for q in queues), exc)

        self.broker.spawn(tx.commit(), done)

    def refuse_purge(self, queue: Queue) -> str:
        return (f"queue.purge not supported on global queue '{queue.name}' in vhost "
                f"'{queue.vhost}' (it would drop the messages in this datacenter only; consume "
                "and acknowledge them: each acknowledgement is ordered across datacenters)")

    def refuse_delete(self, queue: Queue) -> str | None:
        if not (queue.message_count or queue.unacked):
            return None
        # the other datacenters keep their copies: deleting one would make them differ
        return (f"queue '{queue.name}' in vhost '{queue.vhost}' is a global queue and not empty "
                f"({queue.message_count} ready, {queue.unacked} unacknowledged): deleting it "
                "would drop its messages in this datacenter only; consume and acknowledge them "
                "first")

    def refuse_no_ack(self, queue: Queue, method: str) -> str:
        return (f"{method} with no-ack on global queue '{queue.name}' (its dequeues are "
                "ordered across datacenters: acknowledge)")

    def refuse_get(self, queue: Queue) -> str:
        return ("get is not offered on a global queue (its dequeues are ordered across "
                "datacenters): consume it over AMQP")

    def queue_deleted(self, queue: Queue) -> None:
        self.index.pop(queue_key(queue.vhost, queue.name), None)

    # ---- transactions ----------------------------------------------------------------

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

    # ---- applying the synchronised order -----------------------------------------------

    def apply(self, action: DeliverOrdered, body: TxBody | None) -> None:
        """Apply one ordered transaction (``body``: its operations, None if it was lost)."""
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

    def queue(self, key: str, create: bool) -> Queue | None:
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
            self.flag(queue)
        return queue

    def _enqueue(self, op: Operation) -> None:
        queue = self.queue(op.queue, create=True)
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
        ids[op.message_id] = entry
        self.recovery.enqueued(op.queue, op.message_id)
        self.counters["enqueued"] += 1

    def _dequeue(self, op: Operation) -> None:
        entry = self.index.get(op.queue, {}).pop(op.message_id, None)
        queue = self.queue(op.queue, create=False)
        if entry is None or queue is None:
            return
        self.counters["dequeued"] += 1
        self.recovery.dequeued(op.queue, op.message_id, entry)
        if not queue.withdraw(entry.position):
            self.counters["dequeued_elsewhere_while_held"] += 1
