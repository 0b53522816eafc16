"""confirm.select: publisher confirms on this channel from now on."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pamqp import commands

from brokerha.amqp.confirms import ConfirmTracker
from brokerha.broker.errors import PreconditionFailed

if TYPE_CHECKING:
    from brokerha.amqp.channel import Channel


def select(ch: Channel, m: commands.Confirm.Select) -> None:
    if ch.tx_mode:
        raise PreconditionFailed("cannot switch from tx to confirm mode")
    if ch.confirm is None:
        ch.confirm = ConfirmTracker()
    if not m.nowait:
        ch.send(commands.Confirm.SelectOk())


HANDLERS: dict[type, Callable[[Any, Any], None]] = {commands.Confirm.Select: select}
