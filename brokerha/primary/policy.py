"""What of a queue is replicated: its ``x-ha-replicate`` argument, else the ``ha-replicate``
key of the policy that applies to it (``broker/policies.py``: the vhost's policies, set with
``PUT /api/policies`` or ``brokerha ctl set_policy``, replicated with the definitions), else
the node's default (``[cluster] replicate``, docs/ha.md).

``[[cluster.policies]]`` of the TOML are policies too: ``as_policies`` makes them
``ha-replicate`` policies that seed a new cluster's definitions.

Exclusive queues are never replicated: they die with their connection, and a
failover closes every connection.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from brokerha.broker.arguments import (
    HA_REPLICATE,
    POLICIES,
    REPLICATE_ALL,
    REPLICATE_NONE,
)
from brokerha.broker.policies import HA_REPLICATE as HA_REPLICATE_KEY
from brokerha.broker.policies import Policy
from brokerha.broker.policy_effects import PolicyEffects
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
                 policies: Sequence[ReplicationPolicy] = (),
                 effects: PolicyEffects | None = None) -> str:
    """``all`` | ``configuration`` | ``none`` for ``queue``.

    ``effects``: the broker's policies (the argument, else the policy's
    ``ha-replicate``); ``policies``: TOML entries not seeded as policies (a broker
    without ``PolicyEffects``: tests and simulations), first match.
    """
    if queue.exclusive_owner is not None:
        return REPLICATE_NONE
    value = effects.replicate(queue) if effects is not None else queue.arguments.get(HA_REPLICATE)
    if value is None:
        value = next((p.replicate for p in policies if p.applies_to(queue)), default)
    if isinstance(value, bytes | bytearray):
        value = value.decode("utf-8", "replace")
    if value not in POLICIES:
        # the safe reading of a typo: replicate everything
        log.warning("queue '%s' in vhost '%s': unknown %s %r, replicating all",
                    queue.name, queue.vhost, HA_REPLICATE, value)
        return REPLICATE_ALL
    return str(value)


def decided_by(queue: Queue, default: str, policies: Sequence[ReplicationPolicy] = (),
               effects: PolicyEffects | None = None) -> str:
    """What decides ``queue_policy`` for ``queue``, in words (the log line of a change)."""
    if queue.exclusive_owner is not None:
        return "an exclusive queue"
    if HA_REPLICATE in queue.arguments:
        return f"its {HA_REPLICATE} argument"
    if effects is not None:
        applied = effects.applied(queue)
        if HA_REPLICATE_KEY in applied.definition:
            return f"policy '{applied.policy_name}'"
        return f"no policy with {HA_REPLICATE_KEY}: the default '{default}'"
    policy = next((p for p in policies if p.applies_to(queue)), None)
    if policy is not None:
        return f"[[cluster.policies]] pattern '{policy.pattern.pattern}'"
    return f"the default '{default}'"


def as_policies(policies: Sequence[ReplicationPolicy], vhosts: Iterable[str]) -> list[Policy]:
    """The TOML's ``[[cluster.policies]]`` as the ``ha-replicate`` policies they seed.

    Each is ``cluster-policy-<n>`` (from 1) in its vhost, or in each of ``vhosts`` when it
    names none, applying to queues; priorities ``-n`` keep the first match winning, below a
    policy set with the default priority 0.
    """
    out = []
    for n, policy in enumerate(policies, 1):
        for vhost in [policy.vhost] if policy.vhost is not None else vhosts:
            out.append(Policy(vhost, f"cluster-policy-{n}", policy.pattern.pattern,
                              {HA_REPLICATE_KEY: policy.replicate}, -n, "queues"))
    return out


def check_default(default: str) -> str:
    if default not in POLICIES:
        raise ValueError(f"replicate must be one of {', '.join(POLICIES)}, not {default!r}")
    return default
