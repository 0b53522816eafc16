"""queue.declare, bind, unbind, purge, delete."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.amqp.frames import unchecked
from brokerha.amqp.methods.basic import guard_queue
from brokerha.broker.errors import AccessRefused

if TYPE_CHECKING:
    from brokerha.amqp.channel import Channel
    from brokerha.broker.queue import Queue


SERVER_NAME_TRIES = 64  # names drawn for a server-named queue on a partitioned node


def _server_name(ch: Channel, m: commands.Queue.Declare) -> str:
    """``amq.gen-...``; on a node running partition groups, one whose partition this node
    leads (of P partitions it leads k: a name drawn at random is one in P/k tries)."""
    vhost = ch.vhost
    groups = ch.conn.broker.groups
    name = vhost.new_queue_name()
    if groups is None:
        return name
    for _ in range(SERVER_NAME_TRIES):
        if groups.serves_queue(vhost.name, name, m.arguments, m.exclusive):
            break
        name = vhost.new_queue_name()
    return name  # none served here after so many: check_queue says who leads its partition


def declare(ch: Channel, m: commands.Queue.Declare) -> None:
    vhost = ch.vhost
    name = m.queue
    server_named = not name and not m.passive
    if not m.passive:
        name = name or _server_name(ch, m)
        ch.user.check("configure", vhost.name, "queue", name)
    groups = ch.conn.broker.groups
    if groups is not None and groups.queue_remote(  # its group's leader answers
            ch, m, ch.resolve_queue(name) if m.passive else name):
        return
    if groups is not None and not m.passive:  # before the queue exists: never on a copy
        groups.check_queue(ch.conn, vhost.name, name, m.arguments, m.exclusive)
    queue = vhost.declare_queue(
        ch.resolve_queue(name) if m.passive else name, server_named=server_named,
        owner=ch.conn, passive=m.passive, durable=m.durable,
        exclusive=m.exclusive, auto_delete=m.auto_delete, arguments=m.arguments,
    )
    if groups is not None and m.passive:
        guard_queue(ch, queue)
    if queue.exclusive_owner is ch.conn:
        ch.conn.exclusive_queues[queue.name] = queue
    ch.last_queue = queue.name
    if not m.nowait:
        ok = unchecked(commands.Queue.DeclareOk, queue=queue.name,
                       message_count=queue.message_count, consumer_count=queue.consumer_count)
        # (on a partitioned node an exclusive queue's answer waits for the queue directory
        # to name its owner: another node answers 405 from then on)
        if (queue.durable or (groups is not None and queue.exclusive_owner is ch.conn)) \
                and not m.passive:
            ch.reply_when_durable(ok, [queue])
        else:
            ch.send(ok)


def _binding(ch: Channel, m: commands.Queue.Bind | commands.Queue.Unbind) -> tuple:
    vhost = ch.vhost
    name = ch.resolve_queue(m.queue)
    ch.user.check("write", vhost.name, "queue", name)
    ch.user.check("read", vhost.name, "exchange", m.exchange)
    queue = vhost.queue_for(name, ch.conn)
    guard_queue(ch, queue)
    exchange = vhost.exchange(m.exchange)
    key = m.routing_key if (m.routing_key or m.queue) else name
    if exchange.type == "topic":
        ch.user.check_topic("read", vhost.name, exchange.name, key)
    return queue, key, m.arguments


def bind(ch: Channel, m: commands.Queue.Bind) -> None:
    groups = ch.conn.broker.groups
    if groups is not None:
        name = ch.resolve_queue(m.queue)
        ch.user.check("write", ch.vhost.name, "queue", name)
        ch.user.check("read", ch.vhost.name, "exchange", m.exchange)
        if groups.queue_remote(ch, m, name):  # its group's leader answers
            return
    queue, key, args = _binding(ch, m)
    ch.vhost.bind(m.exchange, queue, key, args)
    _reply_bound(ch, queue, None if m.nowait else commands.Queue.BindOk())


def _reply_bound(ch: Channel, queue: Queue | None, ok: Any) -> None:
    """bind-ok / unbind-ok (``ok``; None: nowait). On a partitioned node a change of the
    connection's own exclusive queue's bindings is answered once the queue directory
    names them (another node's stand-in routes by them: a publish there reaches the queue,
    forwarded to this node; docs/ha.md "Exclusive queues on a partitioned cluster")."""
    groups = ch.conn.broker.groups
    if groups is None or queue is None or queue.exclusive_owner is not ch.conn:
        if ok is not None:
            ch.send(ok)
        return
    if ok is None:
        groups.after_bound(queue, lambda: None)
        return
    ch.block()
    groups.after_bound(queue, lambda: ch.reply_unblocked(ok))


def unbind(ch: Channel, m: commands.Queue.Unbind) -> None:
    """Idempotent, as in RabbitMQ: a missing queue, exchange or binding is unbound.

    (A queue another connection holds exclusively is still 405, the default
    exchange still 403: those are refusals, not things already gone.)
    """
    vhost = ch.vhost
    name = ch.resolve_queue(m.queue)
    if m.exchange == "":
        raise AccessRefused("operation not permitted on the default exchange")
    ch.user.check("write", vhost.name, "queue", name)
    ch.user.check("read", vhost.name, "exchange", m.exchange)
    queue, exchange = vhost.queues.get(name), vhost.exchanges.get(m.exchange)
    key = m.routing_key if (m.routing_key or m.queue) else name
    if exchange is not None and exchange.type == "topic":
        ch.user.check_topic("read", vhost.name, exchange.name, key)
    groups = ch.conn.broker.groups
    if groups is not None and groups.queue_remote(ch, m, name):  # its group's leader answers
        return
    if queue is not None and exchange is not None and \
            vhost.has_binding(exchange, queue, key, m.arguments):
        guard_queue(ch, queue)
        vhost.unbind(m.exchange, vhost.queue_for(name, ch.conn), key, m.arguments)
        _reply_bound(ch, queue, commands.Queue.UnbindOk())
        return
    ch.send(commands.Queue.UnbindOk())


def purge(ch: Channel, m: commands.Queue.Purge) -> None:
    """The queue is empty at once, for every client, and the count is known at once.

    What the purge leaves to do per entry runs in slices (``broker/drain.py``);
    purge-ok follows it, durable where it must be (on an HA member: on the backups).
    """
    name = ch.resolve_queue(m.queue)
    ch.user.check("read", ch.vhost.name, "queue", name)
    groups = ch.conn.broker.groups
    if groups is not None and groups.queue_remote(ch, m, name):  # its group's leader answers
        return
    queue = ch.vhost.queue_for(name, ch.conn)
    guard_queue(ch, queue)
    count = ch.vhost.purge_queue(name, ch.conn)
    if not m.nowait:
        ch.reply_when_done(commands.Queue.PurgeOk(message_count=count), [queue])


def delete(ch: Channel, m: commands.Queue.Delete) -> None:
    """Gone at once (its ready entries are let go of in slices); delete-ok of a durable
    queue once that is durable where it must be, as its declare-ok."""
    name = ch.resolve_queue(m.queue)
    ch.user.check("configure", ch.vhost.name, "queue", name)
    groups = ch.conn.broker.groups
    if groups is not None and groups.queue_remote(ch, m, name):  # its group's leader answers
        return
    queue = ch.vhost.queues.get(name)
    if queue is not None:
        guard_queue(ch, queue)
        count = ch.vhost.delete_queue(name, owner=ch.conn, if_unused=m.if_unused,
                                      if_empty=m.if_empty)
        ch.conn.exclusive_queues.pop(name, None)
    else:
        count = 0  # deleting a missing queue succeeds, as in RabbitMQ 3.x
    if not m.nowait:
        ok = commands.Queue.DeleteOk(message_count=count)
        if queue is not None and queue.durable:
            ch.reply_when_durable(ok, [queue])
        else:
            ch.send(ok)


HANDLERS: dict[type, Callable[[Any, Any], None]] = {
    commands.Queue.Declare: declare,
    commands.Queue.Bind: bind,
    commands.Queue.Unbind: unbind,
    commands.Queue.Purge: purge,
    commands.Queue.Delete: delete,
}
