"""What of a queue is replicated: ``x-ha-replicate``, else the first matching policy, else
the node's default (``[cluster] replicate`` and ``[[cluster.policies]]``, docs/ha.md).

Exclusive queues are never replicated: they die with their connection, and a
failover closes every connection.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from brokerha.broker.arguments import (
    HA_REPLICATE,
    POLICIES,
    REPLICATE_ALL,
    REPLICATE_NONE,
)
from brokerha.broker.queue import Queue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicationPolicy:
    """Queues whose name matches ``pattern`` (in ``vhost``, or any) replicate ``replicate``."""

    pattern: re.Pattern[str]
    replicate: str
    vhost: str | None = None

    def applies_to(self, queue: Queue) -> bool:
        return ((self.vhost is None or self.vhost == queue.vhost)
                and self.pattern.search(queue.name) is not None)


def queue_policy(queue: Queue, default: str,
                 policies: Sequence[ReplicationPolicy] = ()) -> str:
    """``all`` | ``configuration`` | ``none`` for ``queue``."""
    if queue.exclusive_owner is not None:
        return REPLICATE_NONE
    if HA_REPLICATE not in queue.arguments:
        for policy in policies:
            if policy.applies_to(queue):
                return policy.replicate
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
