"""One AMQP channel: method dispatch, content assembly, deliveries, acks, modes.

The channel is a state machine driven by its connection (no I/O): frames in,
frames out through ``conn.write``. Work that completes later (a transaction's
prepare on every backup) blocks the channel: frames that arrive meanwhile are
kept and handled, in order, when the work is done — methods on a channel are
processed in the order they were sent.
"""

from __future__ import annotations

import logging
import struct
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.amqp import frames as F
from brokerha.amqp.confirms import ConfirmTracker
from brokerha.amqp.consumer import ChannelConsumer, Delivery
from brokerha.amqp.errors import AMQPError
from brokerha.broker.errors import BrokerError
from brokerha.broker.message import Entry

if TYPE_CHECKING:
    from brokerha.amqp.ports import ConnectionPort
    from brokerha.broker.auth import User
    from brokerha.broker.dtx import DtxBranch
    from brokerha.broker.queue import Queue
    from brokerha.broker.transaction import Transaction
    from brokerha.broker.vhost import VirtualHost

log = logging.getLogger(__name__)

OPEN, CLOSING, CLOSED = "open", "closing", "closed"
# A content body at least this big, in more than one frame, is joined off the loop
# when the connection can (``ConnectionPort.join_body``): ``bytes.join`` lets go of the
# GIL over a join this big, and a smaller one takes the loop a few ms at most.
JOIN_OFF_LOOP = 4 * 1024 * 1024


class Channel:
    def __init__(self, conn: ConnectionPort, number: int) -> None:
        self.conn = conn
        self.number = number
        self.state = OPEN
        vhost, user = conn.vhost, conn.user
        assert vhost is not None and user is not None, "a channel opens after connection.open"
        self.vhost: VirtualHost = vhost
        self.user: User = user
        self.consumers: dict[str, ChannelConsumer] = {}
        self.unacked: dict[int, Delivery] = {}
        self.next_delivery_tag = 1
        self.prefetch_count = 0  # for consumers created later (basic.qos global=false)
        self.global_prefetch = 0  # for the whole channel (basic.qos global=true)
        self.confirm: ConfirmTracker | None = None
        self.tx_mode = False
        self.tx: Transaction | None = None  # created at the first operation in tx mode
        self.dtx_branch: DtxBranch | None = None  # the XA branch this channel works for
        self.tx_acked: dict[int, Delivery] = {}
        self.last_queue = ""
        self.writable_exchanges: set[str] = set()  # write permission already checked
        # content being assembled: (publish, header, expected size, body parts, received)
        self._publish: F.Publish | None = None
        self._header = b""
        self._body_size = 0
        self._body: list[bytes] = []
        self._body_received = 0
        self._blocked = False
        self._deferred: deque[F.Frame] = deque()

    # -- frames in -----------------------------------------------------------------------

    def handle_frame(self, frame: F.Frame) -> None:
        if self._blocked:
            self._deferred.append(frame)
            return
        ftype = frame.type
        if ftype == C.FRAME_BODY:
            self._handle_body(frame.payload)
        elif ftype == C.FRAME_METHOD:
            self._handle_method_frame(frame.payload)
        elif ftype == C.FRAME_HEADER:
            self._handle_header(frame.payload)
        else:
            raise AMQPError(C.UNEXPECTED_FRAME, f"heartbeat frame on channel {self.number}")

    def _handle_method_frame(self, payload: bytes) -> None:
        index = F.method_index(payload)
        if self._publish is not None:
            raise AMQPError(
                C.UNEXPECTED_FRAME,
                "expected content header for class 60, got non content header frame instead"
                if not self._header else "expected content body, got non content body frame instead",
            )
        if index == F.BASIC_PUBLISH:
            try:
                self._publish = F.decode_publish(payload)
            except (IndexError, struct.error):
                raise F.cannot_decode(index, payload) from None
            return
        if index == F.BASIC_ACK:
            try:
                tag, multiple = F.decode_ack(payload)
            except (IndexError, struct.error):
                raise F.cannot_decode(index, payload) from None
            self._run(lambda: self.ack(tag, multiple), 60, 80)
            return
        method = self.conn.decode_method(index, payload)
        handler = self.conn.handlers.get(type(method))
        if handler is None:
            raise AMQPError(C.COMMAND_INVALID, f"unimplemented method {method.name}",
                            index >> 16, index & 0xFFFF)
        self._run(lambda: handler(self, method), index >> 16, index & 0xFFFF)

    def _run(self, work: Callable[[], None], class_id: int, method_id: int) -> None:
        """Run a handler; broker errors become channel or connection exceptions."""
        try:
            work()
        except BrokerError as exc:
            raise AMQPError(exc.code, exc.reply_text, class_id, method_id) from exc
        except AMQPError as exc:
            if not exc.class_id:
                exc.class_id, exc.method_id = class_id, method_id
            raise

    def _handle_header(self, payload: bytes) -> None:
        if self._publish is None or self._header:
            raise AMQPError(C.UNEXPECTED_FRAME, "expected method frame, got non method frame instead")
        try:
            class_id, size = F.header_body_size(payload)
        except struct.error as exc:
            raise AMQPError(C.FRAME_ERROR, "malformed content header") from exc
        if class_id != C.BASIC_CLASS:
            raise AMQPError(C.UNEXPECTED_FRAME, "expected content header for class 60, got one "
                            f"for class {class_id} instead", 60, 40)
        limit = self.conn.broker.limits.max_message_size
        if size > limit:
            self._reset_content()
            raise AMQPError(C.PRECONDITION_FAILED,
                            f"message size {size} is larger than configured max size {limit}", 60, 40)
        self._header = payload
        self._body_size = size
        if size == 0:
            self._complete_publish()

    def _handle_body(self, payload: bytes) -> None:
        if self._publish is None or not self._header:
            raise AMQPError(C.UNEXPECTED_FRAME, "expected method frame, got non method frame instead")
        self._body.append(payload)
        self._body_received += len(payload)
        if self._body_received >= self._body_size:
            if self._body_received > self._body_size:
                raise AMQPError(C.FRAME_ERROR,
                                f"content body exceeds the declared size {self._body_size}")
            self._complete_publish()

    def _reset_content(self) -> None:
        self._publish = None
        self._header = b""
        self._body = []
        self._body_size = self._body_received = 0

    def _complete_publish(self) -> None:
        publish, header, parts, size = self._publish, self._header, self._body, self._body_size
        self._reset_content()
        assert publish is not None
        if len(parts) > 1 and size >= JOIN_OFF_LOOP and self.state == OPEN:
            # joined on a thread (one 50 MiB join held the loop 41-50 ms, issue 33): this
            # channel's later frames wait (``block``), the connection's too (``join_body``)
            self.block()
            self.conn.join_body(self.number, parts,
                                lambda body: self._publish_joined(publish, header, body))
            return
        self._publish_content(publish, header, parts[0] if len(parts) == 1 else b"".join(parts))

    def _publish_joined(self, publish: F.Publish, header: bytes, body: bytes) -> None:
        """A body joined off the loop: published, then the frames that waited behind it."""
        if self.state != OPEN:  # closed meanwhile (the connection lost, a failover)
            return
        self._publish_content(publish, header, body)
        self.unblock()

    def _publish_content(self, publish: F.Publish, header: bytes, body: bytes) -> None:
        try:
            self.conn.publish_handler(self, publish, header, body)
        except BrokerError as exc:
            raise AMQPError(exc.code, exc.reply_text, 60, 40) from exc

    def resolve_queue(self, name: str) -> str:
        """An empty queue name means the last queue declared on the channel (spec 1.7.2)."""
        if name:
            return name
        if not self.last_queue:
            raise AMQPError(C.NOT_FOUND, "no previously declared queue")
        return self.last_queue

    # -- deliveries --------------------------------------------------------------------

    def can_deliver(self, no_ack: bool) -> bool:
        if self.state != OPEN or not self.conn.writable:
            return False
        if no_ack or not self.global_prefetch:
            return True
        return len(self.unacked) + len(self.tx_acked) < self.global_prefetch

    def next_tag(self) -> int:
        tag = self.next_delivery_tag
        self.next_delivery_tag = tag + 1
        return tag

    def deliver(self, consumer: ChannelConsumer, queue: Queue, entry: Entry) -> None:
        tag = self.next_tag()
        if not consumer.no_ack:
            self.unacked[tag] = Delivery(queue, entry, consumer)
            consumer.unacked += 1
        message = entry.message
        conn = self.conn
        conn.write(F.encode_delivery(self.number, consumer.packed_tag, tag, entry.redelivered,
                                     message.route, message.header, message.body,
                                     conn.frame_max))

    def send_content(self, header: bytes, body: bytes) -> None:
        self.conn.write(F.encode_content(self.number, header, body, self.conn.frame_max))

    def consumer_cancelled_by_server(self, consumer: ChannelConsumer) -> None:
        """The queue went away: drop the consumer and tell a client that can hear it."""
        self.consumers.pop(consumer.tag, None)
        if self.state == OPEN and self.conn.capability("consumer_cancel_notify"):
            self.send(commands.Basic.Cancel(consumer_tag=consumer.tag, nowait=True))

    # -- acknowledgements ----------------------------------------------------------------

    def _take_deliveries(self, tag: int, multiple: bool) -> dict[int, Delivery]:
        """Remove and return the deliveries an ack/nack/reject names, by tag."""
        unacked = self.unacked
        if multiple and tag == 0:
            taken = unacked
            self.unacked = {}
            return taken
        if tag not in unacked:
            raise AMQPError(C.PRECONDITION_FAILED, f"unknown delivery tag {tag}")
        if not multiple:
            return {tag: unacked.pop(tag)}
        taken = {}
        while unacked:
            first = next(iter(unacked))
            if first > tag:
                break
            taken[first] = unacked.pop(first)
        return taken

    def ack(self, tag: int, multiple: bool) -> None:
        taken = self._take_deliveries(tag, multiple)
        deliveries = list(taken.values())
        if self.dtx_branch is not None:
            self.dtx_branch.accept([(d.queue, d.entry) for d in deliveries], [])
            self._credit_returned(deliveries)  # the branch holds them now
            return
        if self.tx_mode:
            self.tx_acked.update(taken)
            self.transaction().accept([(d.queue, d.entry) for d in deliveries],
                           [(d.queue, d.entry) for d in self.unacked.values()])
            return
        for d in deliveries:
            if d.queue.ordered:
                self._settle_ordered(d, "ack")
            else:
                d.queue.settle(d.entry)
        self._credit_returned(deliveries)

    def reject(self, tag: int, multiple: bool, requeue: bool) -> None:
        taken = self._take_deliveries(tag, multiple)
        deliveries = list(taken.values())
        if self.dtx_branch is not None:
            self.dtx_branch.reject([(d.queue, d.entry) for d in deliveries], requeue)
            self._credit_returned(deliveries)  # the branch holds them now
            return
        if self.tx_mode:
            self.tx_acked.update(taken)
            self.transaction().reject([(d.queue, d.entry) for d in deliveries], requeue)
            return
        for d in deliveries:
            if requeue:
                d.queue.requeue(d.entry)
            elif d.queue.ordered:
                self._settle_ordered(d, "reject")
            else:
                d.queue.reject(d.entry)
        self._credit_returned(deliveries)

    def _settle_ordered(self, d: Delivery, kind: str) -> None:
        """An ack (or reject) on a global queue outside a transaction: a one-dequeue transaction.

        The entry stays acquired until the TxLog ordered the dequeue. If the
        dequeue fails validation (another datacenter consumed the message first)
        the ack is void: the message is gone everywhere all the same. If it could
        not be ordered at all, the message is requeued here (redelivered).
        """
        queue, entry = d.queue, d.entry
        tx = self.conn.broker.new_transaction()
        if kind == "ack":
            tx.accept([(queue, entry)], [])
        else:
            tx.reject([(queue, entry)], False)

        def done(exc: BaseException | None) -> None:
            if exc is None:
                return
            if queue.withdrawn(entry):
                log.warning("basic.%s on global queue '%s' void: the message was consumed "
                            "by an earlier transaction (%s)", kind, queue.name, exc)
                queue.settle(entry)
            else:
                log.warning("basic.%s on global queue '%s' not ordered (%s): requeued", kind,
                            queue.name, exc)
                queue.requeue(entry)
                if queue.consumers:
                    queue.dispatch()

        self.conn.broker.spawn(tx.commit(), done)

    def _credit_returned(self, deliveries: list[Delivery]) -> None:
        """Consumers got credit back: let their queues dispatch again."""
        queues: dict[int, Queue] = {}
        for d in deliveries:
            if d.consumer is not None:
                d.consumer.unacked -= 1
            queues[id(d.queue)] = d.queue
        for queue in queues.values():
            if queue.consumers and queue.message_count:
                queue.dispatch()

    def redispatch(self) -> None:
        """Capacity came back (qos raised, connection writable again)."""
        seen: set[int] = set()
        for consumer in list(self.consumers.values()):
            queue = consumer.queue
            if id(queue) not in seen:
                seen.add(id(queue))
                queue.dispatch()

    def requeue_all_unacked(self) -> None:
        deliveries = list(self.unacked.values())
        self.unacked.clear()
        for d in deliveries:
            d.queue.requeue(d.entry)
        self._credit_returned(deliveries)

    # -- transactions -------------------------------------------------------------------

    def transaction(self) -> Transaction:
        if self.dtx_branch is not None:
            return self.dtx_branch
        if self.tx is None:
            self.tx = self.conn.broker.new_transaction()
        return self.tx

    def finish_transaction(self, committed: bool) -> None:
        """After commit the acks are done; after rollback they are outstanding again."""
        acked, self.tx_acked = self.tx_acked, {}
        deliveries = list(acked.values())
        if committed:
            self._credit_returned(deliveries)
            return
        self.unacked = dict(sorted({**self.unacked, **acked}.items()))

    def block(self) -> None:
        self._blocked = True

    def reply_unblocked(self, method: Any) -> None:
        """The answer of asynchronous work (a commit, a durable declare), then the frames
        that waited behind it."""
        if self.state == OPEN:
            self.send(method)
            self.unblock()

    def reply_when_durable(self, method: Any, queues: list[Queue] | None = None) -> None:
        """Answer a change the client may rely on surviving a failover (a durable
        declare) once it is durable everywhere it must be: on an HA member, replicated
        by the serving primary (``Broker.after_durable``; never, if the role ends first:
        the connection is closed). The channel's later frames wait their turn.
        ``queues``: the change is of these queues' (on a node running partition groups,
        their groups' gates answer for it, ``Broker.groups``)."""
        broker = self.conn.broker
        if broker.durability_gate is None and broker.groups is None:
            self.send(method)  # a standalone node: answered at once, as before
            return
        self.block()
        self._after_durable(method, queues)

    def _after_durable(self, method: Any, queues: list[Queue] | None) -> None:
        broker = self.conn.broker
        groups = broker.groups
        if groups is not None and queues is not None:
            groups.after_durable(queues, lambda: self.reply_unblocked(method))
        else:
            broker.after_durable(lambda: self.reply_unblocked(method))

    def reply_when_done(self, method: Any, queues: list[Queue] | None = None) -> None:
        """Answer once the broker's background work handed over so far is done (what a
        purge left to do per entry: on an HA primary its dequeues reach the backups
        then), and durable where it must be (``reply_when_durable``). The channel's later
        frames wait their turn."""
        background = self.conn.broker.background
        if not background.pending:
            self.reply_when_durable(method, queues)
            return
        self.block()
        background.after(lambda: self._reply_durable_unblocked(method, queues))

    def _reply_durable_unblocked(self, method: Any, queues: list[Queue] | None) -> None:
        broker = self.conn.broker
        if broker.durability_gate is None and broker.groups is None:
            self.reply_unblocked(method)
        else:
            self._after_durable(method, queues)

    def unblock(self) -> None:
        """Asynchronous work done: handle the frames that waited, in order."""
        self._blocked = False
        while self._deferred and not self._blocked and self.state == OPEN:
            self.conn.handle_channel_frame(self, self._deferred.popleft())

    # -- output ---------------------------------------------------------------------------

    def send(self, method: Any) -> None:
        self.conn.send_method(self.number, method)

    def settle_confirm(self, tag: int, ok: bool) -> None:
        if self.confirm is not None and self.state == OPEN:
            self.confirm.settle(tag, ok)
            self.conn.broker.stats.confirms += 1
            self.conn.confirms_pending(self)

    def flush_confirms(self) -> None:
        if self.confirm is None or self.state != OPEN:
            return
        write = self.conn.write
        for tag, multiple, ok in self.confirm.drain():
            write(F.encode_confirm(self.number, tag, multiple, ok))

    # -- closing --------------------------------------------------------------------------

    def release(self) -> None:
        """The channel is gone: cancel consumers, requeue what was unacked, roll back."""
        if self.state == CLOSED:
            return
        self.state = CLOSED
        self._deferred.clear()
        if self.tx is not None:
            self.tx.rollback()
            self.finish_transaction(False)
            self.tx = None
        if self.dtx_branch is not None:
            self.conn.broker.dtx.owner_gone(self)
            self.dtx_branch = None
        for consumer in list(self.consumers.values()):
            consumer.queue.remove_consumer(consumer)
        self.consumers.clear()
        groups = self.conn.broker.groups
        if groups is not None:  # remote consumers closed before their unacked are requeued
            groups.channel_closed(self)
        deliveries = list(self.unacked.values())
        self.unacked.clear()
        for d in sorted(deliveries, key=lambda d: d.entry.position, reverse=True):
            d.queue.requeue(d.entry)
        for d in deliveries:
            if d.consumer is not None:
                d.consumer.unacked -= 1
        for queue in {id(d.queue): d.queue for d in deliveries}.values():
            if queue.consumers:
                queue.dispatch()
