"""Channel methods, one module per AMQP class; HANDLERS maps pamqp types to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from brokerha.amqp.methods import basic, channel, confirm, exchange, queue, tx

HANDLERS: dict[type, Callable[[Any, Any], None]] = {
    **channel.HANDLERS,
    **exchange.HANDLERS,
    **queue.HANDLERS,
    **basic.HANDLERS,
    **tx.HANDLERS,
    **confirm.HANDLERS,
}
