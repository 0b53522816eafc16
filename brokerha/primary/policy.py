"""What of a queue is replicated: ``x-ha-replicate`` or the node's ``[ha] replicate``.

Exclusive queues are never replicated: they die with their connection, and a
failover closes every connection.
"""

from __future__ import annotations

import logging

from brokerha.broker.arguments import (
    HA_REPLICATE,
    POLICIES,
    REPLICATE_ALL,
    REPLICATE_NONE,
)
from brokerha.broker.queue import Queue

log = logging.getLogger(__name__)


def queue_policy(queue: Queue, default: str) -> str:
    """``all`` | ``configuration`` | ``none`` for ``queue``."""
    if queue.exclusive_owner is not None:
        return REPLICATE_NONE
    value = queue.arguments.get(HA_REPLICATE, default)
    if isinstance(value, bytes | bytearray):
        value = value.decode("utf-8", "replace")
    if value not in POLICIES:
        # the safe reading of a typo: replicate everything
        log.warning("queue '%s' in vhost '%s': unknown %s %r, replicating all",
                    queue.name, queue.vhost, HA_REPLICATE, value)
        return REPLICATE_ALL
    return str(value)


def check_default(default: str) -> str:
    if default not in POLICIES:
        raise ValueError(f"replicate must be one of {', '.join(POLICIES)}, not {default!r}")
    return default
