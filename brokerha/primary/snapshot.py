"""The configuration part of a catch-up (BrokerReplicator's input on the backup).

Every definition (vhosts, users, permissions, policies), every vhost, every exchange but the standard ones (every vhost has those),
every replicated queue and every binding whose destination is replicated. The
backup deletes whatever of its own the snapshot does not name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from brokerha.broker.broker import Broker
from brokerha.broker.exchange import Exchange
from brokerha.broker.queue import Queue
from brokerha.broker.vhost import STANDARD_EXCHANGES
from brokerha.cluster import replication as R
from brokerha.primary import events as ev
from brokerha.primary.events import Event

STANDARD = frozenset(["", *dict(STANDARD_EXCHANGES)])


def is_standard(ex: Exchange) -> bool:
    return ex.name in STANDARD


def configuration(broker: Broker, replicated: Callable[[Queue], bool],
                  definitions: bool = True) -> Iterator[Event]:
    """``definitions`` False: a partition group's snapshot (broker/placement.py), its
    queues and the bindings to them only; the definitions, exchanges and the bindings
    between exchanges are the metadata group's."""
    if definitions:
        yield ev.definitions(broker.definitions)  # first: the vhosts the rest is in, the policies
    for vhost in broker.vhosts.values():
        yield R.VhostExists(R.VHOST, vhost.name)
    for vhost in broker.vhosts.values():
        for ex in vhost.exchanges.values() if definitions else ():
            if not is_standard(ex):
                yield ev.exchange_declared(ex)
        for q in vhost.queues.values():
            if replicated(q):
                yield ev.queue_declared(q)
        for ex in vhost.exchanges.values():
            for b in ex.bindings.values():
                dest = b.destination
                if definitions if isinstance(dest, Exchange) else replicated(dest):
                    yield ev.binding(R.BINDING_CREATED, b)
