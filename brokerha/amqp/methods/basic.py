"""basic.*: publish, consume, cancel, get, ack/nack/reject, qos, recover."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.amqp import frames as F
from brokerha.amqp.consumer import ChannelConsumer, Delivery
from brokerha.amqp.dtx_control import DTX_EXCHANGE, handle_control
from brokerha.amqp.errors import AMQPError
from brokerha.broker.content import check_content_header
from brokerha.broker.errors import (
    AccessRefused,
    NotAllowed,
    NotFound,
    NotImplementedByBroker,
    PreconditionFailed,
)
from brokerha.broker.message import Message

if TYPE_CHECKING:
    from brokerha.amqp.channel import Channel
    from brokerha.broker.placement import GroupGuard
    from brokerha.broker.queue import Queue

log = logging.getLogger(__name__)


def message_from_publish(publish: F.Publish, header: bytes, body: bytes) -> Message:
    """The broker's Message; a malformed property list is a frame error.

    So is a headers table that does not parse: RabbitMQ decodes the properties of
    every publish, and its channel crashes on such a table (541 INTERNAL_ERROR);
    here the table (and the properties ``Message`` does not read) is checked
    once, so that wherever it is decoded later (a headers exchange, a
    transaction, a dead letter) it decodes.
    """
    try:
        message = Message(publish.exchange, publish.routing_key, header, body,
                          route=publish.route)
    except ValueError as exc:
        code = C.PRECONDITION_FAILED if "expiration" in str(exc) else C.FRAME_ERROR
        raise AMQPError(code, str(exc), 60, 40) from exc
    if message._headers_at >= 0 or header[13] & 0x0C:  # a headers table, app-id, cluster-id
        try:
            check_content_header(header)
        except ValueError as exc:
            raise AMQPError(C.FRAME_ERROR, f"content header does not parse: {exc}",
                            60, 40) from exc
    return message


def publish_message(ch: Channel, publish: F.Publish, header: bytes, body: bytes) -> None:
    if publish.immediate:  # removed in RabbitMQ 3.0: a connection error, nothing routed
        raise AMQPError(C.NOT_IMPLEMENTED, "immediate=true", 60, 40)
    vhost = ch.vhost
    name = publish.exchange
    if name not in ch.writable_exchanges:
        ch.user.check("write", vhost.name, "exchange", name)
        ch.writable_exchanges.add(name)
    groups = ch.conn.broker.groups
    if name == DTX_EXCHANGE:
        manager = groups.check_transactions(ch.conn) if groups is not None else None
        handle_control(ch, publish.routing_key, header, body, manager)
        if ch.confirm is not None:  # a control message is confirmed like any publish
            ch.settle_confirm(ch.confirm.issue(), True)
        return
    exchange = vhost.exchanges.get(name)
    if exchange is None:
        raise NotFound(f"no exchange '{name}' in vhost '{vhost.name}'")
    if exchange.internal:
        raise AccessRefused(f"cannot publish to internal exchange '{name}' in vhost '{vhost.name}'")
    if exchange.type == "topic" and ch.user.topic_permissions:  # RabbitMQ's topic authorisation
        ch.user.check_topic("write", vhost.name, name, publish.routing_key)
    message = message_from_publish(publish, header, body)
    if message.user_id is not None and message.user_id != ch.user.name:
        raise PreconditionFailed(f"user_id property set to '{message.user_id}' but "
                                 f"authenticated user was '{ch.user.name}'")
    ch.conn.has_published = True
    queues = vhost.route(exchange, message)
    if groups is not None:  # a partitioned node: forwards to the partitions' leaders (stage 3)
        _publish_grouped(ch, publish, groups, queues, message)
        return
    if not queues and publish.mandatory:
        ch.send(F.unchecked(commands.Basic.Return, reply_code=C.NO_ROUTE, reply_text="NO_ROUTE",
                          exchange=name, routing_key=publish.routing_key))
        ch.send_content(header, body)
    confirm = ch.confirm
    if ch.tx_mode or ch.dtx_branch is not None:
        ch.transaction().publish(queues, message)
        if confirm is not None:  # accepted into the XA branch (tx mode has no confirms)
            ch.settle_confirm(confirm.issue(), True)
        return
    for queue in queues:
        if queue.ordered:
            _publish_ordered(ch, queues, message)
            return
    if confirm is None:
        for queue in queues:
            queue.enqueue(message)
        return
    tag = confirm.issue()
    accepted = True
    for queue in queues:
        accepted = queue.enqueue(message) and accepted
    if not accepted:
        ch.settle_confirm(tag, False)
    else:
        ch.conn.broker.after_durable(lambda: ch.settle_confirm(tag, True))


def _publish_grouped(ch: Channel, publish: F.Publish, groups: GroupGuard, queues: list[Any],
                     message: Message) -> None:
    """A publish on a node running partition groups (``Broker.groups``): the queues of
    groups it serves enqueued here, the others' forwarded to their leaders; the confirm
    once every target answered. In tx mode the publish is the channel's transaction's,
    its commit decides where it goes (``GroupGuard.tx_commit``), and so in an XA branch its
    prepare (``partition/xa.py``)."""
    queues = groups.routable(queues)
    if not queues and publish.mandatory:
        ch.send(F.unchecked(commands.Basic.Return, reply_code=C.NO_ROUTE, reply_text="NO_ROUTE",
                          exchange=publish.exchange, routing_key=publish.routing_key))
        ch.send_content(message.header, message.body)
    if ch.tx_mode or ch.dtx_branch is not None:
        ch.transaction().publish(queues, message)
        if ch.confirm is not None and ch.dtx_branch is not None:  # accepted into the branch
            ch.settle_confirm(ch.confirm.issue(), True)
        return
    confirm = ch.confirm
    if confirm is None:
        groups.publish(ch.conn, ch.vhost.name, queues, message, None)
        return
    groups.publish(ch.conn, ch.vhost.name, queues, message,
                   partial(ch.settle_confirm, confirm.issue()))


def _publish_ordered(ch: Channel, queues: list[Any], message: Message) -> None:
    """A publish that reaches a global queue: a one-publish transaction (docs/txlog.md).

    Its commit waits until the TxLog acquired it (enqueue-only: one phase); the
    confirm (if any) follows, a nack if the TxLog refused it.
    """
    broker = ch.conn.broker
    tag = ch.confirm.issue() if ch.confirm is not None else None
    tx = broker.new_transaction()
    tx.publish(queues, message)

    def done(exc: BaseException | None) -> None:
        if exc is not None:
            log.warning("publish to a global queue not accepted: %s", exc)
        if tag is None:
            return
        if exc is None:
            broker.after_durable(lambda: ch.settle_confirm(tag, True))
        else:
            ch.settle_confirm(tag, False)

    broker.spawn(tx.commit(), done)


def guard_queue(ch: Channel, queue: Queue) -> None:
    """On a node running partition groups: ``NotLeader`` (404) unless it serves the group
    holding ``queue`` now (``Broker.groups``, broker/placement.py)."""
    groups = ch.conn.broker.groups
    if groups is not None:
        groups.check_queue(ch.conn, queue.vhost, queue.name, queue.arguments,
                           queue.exclusive_owner is not None)


def _no_ack_on_ordered(queue: Queue, method: str) -> None:
    if queue.ordering is not None:
        raise PreconditionFailed(queue.ordering.refuse_no_ack(queue, method))


def qos(ch: Channel, m: commands.Basic.Qos) -> None:
    if m.prefetch_size:
        raise NotImplementedByBroker(f"prefetch_size!=0 ({m.prefetch_size})")
    if m.global_:
        ch.global_prefetch = m.prefetch_count
    else:
        ch.prefetch_count = m.prefetch_count
    ch.send(commands.Basic.QosOk())
    ch.redispatch()


def consume(ch: Channel, m: commands.Basic.Consume) -> None:
    vhost = ch.vhost
    name = ch.resolve_queue(m.queue)
    ch.user.check("read", vhost.name, "queue", name)
    queue = vhost.queue_for(name, ch.conn)
    tag = m.consumer_tag or f"amq.ctag-{uuid.uuid4().hex[:22]}"
    groups = ch.conn.broker.groups
    if groups is not None:  # a partitioned node: a queue led elsewhere is consumed there
        if tag in ch.consumers:
            raise NotAllowed(f"attempt to reuse consumer tag '{tag}'")
        if groups.consume_remote(ch, queue, tag, m.no_ack, m.exclusive, m.nowait):
            return
    guard_queue(ch, queue)
    if tag in ch.consumers:
        raise NotAllowed(f"attempt to reuse consumer tag '{tag}'")
    queue.check_consumer(m.exclusive)
    if m.no_ack:
        _no_ack_on_ordered(queue, "basic.consume")
    consumer = ChannelConsumer(ch, queue, tag, no_ack=m.no_ack, exclusive=m.exclusive,
                               prefetch=ch.prefetch_count, arguments=dict(m.arguments or {}))
    if not m.nowait:
        ch.send(commands.Basic.ConsumeOk(consumer_tag=tag))
    ch.consumers[tag] = consumer
    queue.add_consumer(consumer)


def cancel(ch: Channel, m: commands.Basic.Cancel) -> None:
    consumer = ch.consumers.pop(m.consumer_tag or "", None)
    if not m.nowait:
        ch.send(commands.Basic.CancelOk(consumer_tag=m.consumer_tag))
    if consumer is not None:
        consumer.queue.remove_consumer(consumer)
        groups = ch.conn.broker.groups
        if groups is not None:  # a remote consumer's cancel goes to its queue's leader
            groups.cancel_remote(ch, consumer.tag)


def get(ch: Channel, m: commands.Basic.Get) -> None:
    vhost = ch.vhost
    name = ch.resolve_queue(m.queue)
    ch.user.check("read", vhost.name, "queue", name)
    queue = vhost.queue_for(name, ch.conn)
    groups = ch.conn.broker.groups
    if groups is not None and groups.get_remote(ch, queue, m.no_ack):
        return  # asked of the queue's leader: answered when it answers
    guard_queue(ch, queue)
    if m.no_ack:
        _no_ack_on_ordered(queue, "basic.get")
    entry = queue.get()
    if entry is None:
        ch.send(commands.Basic.GetEmpty())
        return
    tag = ch.next_tag()
    message = entry.message
    ch.conn.write(F.encode_get_ok(ch.number, tag, entry.redelivered, message.exchange,
                                  message.routing_key, queue.message_count))
    ch.send_content(message.header, message.body)
    if m.no_ack:
        queue.settle(entry)
    else:
        ch.unacked[tag] = Delivery(queue, entry, None)


def ack(ch: Channel, m: commands.Basic.Ack) -> None:
    ch.ack(m.delivery_tag, m.multiple)


def reject(ch: Channel, m: commands.Basic.Reject) -> None:
    ch.reject(m.delivery_tag or 0, False, m.requeue)


def nack(ch: Channel, m: commands.Basic.Nack) -> None:
    ch.reject(m.delivery_tag, m.multiple, m.requeue)


def _recover(ch: Channel, requeue: bool) -> None:
    if not requeue:  # as RabbitMQ: redelivery to the original consumer is not offered
        raise NotImplementedByBroker("requeue=false")
    ch.requeue_all_unacked()


def recover(ch: Channel, m: commands.Basic.Recover) -> None:
    _recover(ch, m.requeue)
    ch.send(commands.Basic.RecoverOk())


def recover_async(ch: Channel, m: commands.Basic.RecoverAsync) -> None:
    _recover(ch, m.requeue)


HANDLERS: dict[type, Callable[[Any, Any], None]] = {
    commands.Basic.Qos: qos,
    commands.Basic.Consume: consume,
    commands.Basic.Cancel: cancel,
    commands.Basic.Get: get,
    commands.Basic.Ack: ack,
    commands.Basic.Reject: reject,
    commands.Basic.Nack: nack,
    commands.Basic.Recover: recover,
    commands.Basic.RecoverAsync: recover_async,
}
