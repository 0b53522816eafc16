"""exchange.declare, delete, bind, unbind."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.broker.errors import AccessRefused

if TYPE_CHECKING:
    from brokerha.amqp.channel import Channel


def remote_configuration(ch: Channel, m: Any) -> bool:
    """On a node running partition groups that does not serve the metadata group: True if
    the method went to that group's leader, which answers it (partition/declarations.py)."""
    groups = ch.conn.broker.groups
    return groups is not None and groups.configuration_remote(ch, m)


def guard_configuration(ch: Channel, what: str) -> None:
    """On a node running partition groups: ``NotLeader`` (404) unless it serves the
    metadata group now, whose log holds the exchanges (``Broker.groups``)."""
    groups = ch.conn.broker.groups
    if groups is not None:
        groups.check_configuration(ch.conn, what)


def declare(ch: Channel, m: commands.Exchange.Declare) -> None:
    if m.exchange == "":  # passive too, as RabbitMQ answers
        raise AccessRefused("operation not permitted on the default exchange")
    # on a node running partition groups, declaring an exchange that exists (the same
    # again, or 406) changes nothing: any node answers it; a new one is the metadata group's
    again = ch.conn.broker.groups is not None and m.exchange in ch.vhost.exchanges
    if not m.passive:
        ch.user.check("configure", ch.vhost.name, "exchange", m.exchange)
        if not again:
            if remote_configuration(ch, m):
                return
            guard_configuration(ch, f"declare exchange '{m.exchange}'")
    exchange = ch.vhost.declare_exchange(
        m.exchange, m.exchange_type, passive=m.passive, durable=m.durable,
        auto_delete=m.auto_delete, internal=m.internal, arguments=m.arguments,
    )
    if not m.nowait:
        if exchange.durable and not m.passive and not again:
            ch.reply_when_durable(commands.Exchange.DeclareOk())
        else:
            ch.send(commands.Exchange.DeclareOk())


def delete(ch: Channel, m: commands.Exchange.Delete) -> None:
    ch.user.check("configure", ch.vhost.name, "exchange", m.exchange)
    if m.exchange == "":  # on any node, as RabbitMQ answers (not the metadata group's 404)
        raise AccessRefused("operation not permitted on the default exchange")
    if m.exchange in ch.vhost.exchanges:
        if remote_configuration(ch, m):
            return
        guard_configuration(ch, f"delete exchange '{m.exchange}'")
        ch.vhost.delete_exchange(m.exchange, if_unused=m.if_unused)
    # deleting a missing exchange succeeds, as in RabbitMQ 3.x
    if not m.nowait:
        ch.send(commands.Exchange.DeleteOk())


def _bind_args(ch: Channel, m: commands.Exchange.Bind | commands.Exchange.Unbind) -> tuple:
    vhost = ch.vhost
    ch.user.check("write", vhost.name, "exchange", m.destination)
    ch.user.check("read", vhost.name, "exchange", m.source)
    destination = vhost.exchange(m.destination)
    source = vhost.exchange(m.source)
    if source.type == "topic":
        ch.user.check_topic("read", vhost.name, source.name, m.routing_key)
    return destination, m.routing_key, m.arguments


def bind(ch: Channel, m: commands.Exchange.Bind) -> None:
    destination, key, args = _bind_args(ch, m)
    if remote_configuration(ch, m):
        return
    guard_configuration(ch, f"bind exchange '{m.destination}'")
    ch.vhost.bind(m.source, destination, key, args)
    if not m.nowait:
        ch.send(commands.Exchange.BindOk())


def unbind(ch: Channel, m: commands.Exchange.Unbind) -> None:
    """Idempotent, as in RabbitMQ: a missing source, destination or binding is unbound."""
    vhost = ch.vhost
    ch.user.check("write", vhost.name, "exchange", m.destination)
    ch.user.check("read", vhost.name, "exchange", m.source)
    destination = vhost.exchanges.get(m.destination)
    source = vhost.exchanges.get(m.source)
    if source is not None and source.type == "topic":
        ch.user.check_topic("read", vhost.name, source.name, m.routing_key)
    if destination is not None and m.source in vhost.exchanges:
        if remote_configuration(ch, m):
            return
        guard_configuration(ch, f"unbind exchange '{m.destination}'")
        vhost.unbind(m.source, destination, m.routing_key, m.arguments)
    if not m.nowait:
        ch.send(commands.Exchange.UnbindOk())


HANDLERS: dict[type, Callable[[Any, Any], None]] = {
    commands.Exchange.Declare: declare,
    commands.Exchange.Delete: delete,
    commands.Exchange.Bind: bind,
    commands.Exchange.Unbind: unbind,
}
