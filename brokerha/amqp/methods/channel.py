"""channel.close, channel.close-ok, channel.flow (channel.open is the connection's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.amqp.errors import AMQPError

if TYPE_CHECKING:
    from brokerha.amqp.channel import Channel


def open_again(ch: Channel, method: commands.Channel.Open) -> None:
    raise AMQPError(C.CHANNEL_ERROR, "second 'channel.open' seen", 20, 10)


def close(ch: Channel, method: commands.Channel.Close) -> None:
    ch.conn.close_channel_by_peer(ch)


def flow(ch: Channel, method: commands.Channel.Flow) -> None:
    # RabbitMQ 3.x dropped client-requested flow stops; it answers active=false
    # with 540, and so do we (clients use basic.qos or basic.cancel instead).
    if not method.active:
        raise AMQPError(C.NOT_IMPLEMENTED, "active=false", 20, 20)
    ch.send(commands.Channel.FlowOk(active=True))


def flow_ok(ch: Channel, method: commands.Channel.FlowOk) -> None:
    """The server never sends channel.flow, so nothing waits for this."""


HANDLERS: dict[type, Callable[[Any, Any], None]] = {
    commands.Channel.Open: open_again,
    commands.Channel.Close: close,
    commands.Channel.Flow: flow,
    commands.Channel.FlowOk: flow_ok,
}
