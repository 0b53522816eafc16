"""BrokerReplicator (seed 002): the primary's definitions, exchanges, queues and bindings
on a backup.

Definitions (vhosts, users, permissions, policies: ``broker/definitions.py``)
are applied with the backup's own ``Definitions.apply``, so its store keeps
them and its broker acts on them as the primary's did; at a join the
primary's whole set replaces the backup's (``ds``, first in the snapshot).

Declarations go through the backup's own VirtualHost, so its store records
the durable ones exactly as on any node. A declaration that differs from what
the backup has (another type, other arguments, another ``x-ha-id``: the queue
was deleted and declared again while the backup was away) replaces it.

During a catch-up it notes what the snapshot names; at the snapshot's end
(``s``) whatever else the backup holds is what the primary deleted meanwhile,
and goes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from brokerha.backup.timers import hold_queue_timers, hold_timers
from brokerha.broker.broker import Broker
from brokerha.broker.definitions import VHOST, DefinitionChange
from brokerha.broker.errors import BrokerError
from brokerha.broker.exchange import Exchange
from brokerha.broker.placement import GroupScope
from brokerha.broker.queue import Queue
from brokerha.broker.vhost import STANDARD_EXCHANGES, VirtualHost
from brokerha.cluster import replication as R
from brokerha.cluster.replication import ReplicationError

log = logging.getLogger(__name__)

STANDARD = frozenset(["", *dict(STANDARD_EXCHANGES)])
NO_OWNER = None


class BrokerReplicator:
    def __init__(self, broker: Broker, on_queue_gone: Callable[[Queue], None],
                 scope: GroupScope | None = None) -> None:
        self.broker = broker
        self.on_queue_gone = on_queue_gone
        # a partitioned node's group (broker/placement.py): the snapshot's end removes only
        # what of the group's the snapshot did not name; None: the whole broker
        self.scope = scope
        self._seen: set[tuple[Any, ...]] | None = None  # during a catch-up snapshot

    def apply(self, event: list[Any]) -> None:
        kind = event[0]
        try:
            getattr(self, _HANDLERS[kind])(*event[1:])
        except BrokerError as exc:
            raise ReplicationError(f"cannot apply {kind} {event[1:3]}: {exc}") from exc

    # -- the snapshot ------------------------------------------------------------------

    def snapshot_begins(self) -> None:
        self._seen = set()

    def snapshot_done(self) -> None:
        """Delete what the snapshot did not name (of the group's own, with a scope)."""
        seen = self._seen or set()
        self._seen = None
        scope = self.scope
        for vhost in list(self.broker.vhosts.values()):
            for ex in list(vhost.exchanges.values()):
                for b in list(ex.bindings.values()):
                    if scope is not None and not scope.holds_binding_to(b.destination):
                        continue
                    if (vhost.name, ex.name, b.key) not in seen and not ex.deleted:
                        vhost.unbind(ex.name, b.destination, b.routing_key, b.arguments)
            for q in list(vhost.queues.values()):
                if scope is not None and not scope.queues(q):
                    continue
                if ("q", vhost.name, q.name) not in seen:
                    log.info("queue '%s' in vhost '%s' is gone on the primary", q.name, vhost.name)
                    self._remove_queue(vhost, q)
            for ex in list(vhost.exchanges.values()) if scope is None or scope.configuration \
                    else []:
                gone = ex.name not in STANDARD and ("x", vhost.name, ex.name) not in seen
                if gone and ex.name in vhost.exchanges:  # not auto-deleted meanwhile
                    vhost.delete_exchange(ex.name)

    def _note(self, key: tuple[Any, ...]) -> None:
        if self._seen is not None:
            self._seen.add(key)

    # -- events ------------------------------------------------------------------------

    def vhost(self, name: str) -> None:
        self.broker.add_vhost(name)

    def definition_changed(self, change: list[Any]) -> None:
        self._apply_definitions([DefinitionChange.from_wire(change)])

    def definitions(self, changes: list[list[Any]]) -> None:
        """The primary's every definition at the join: this node's become the same."""
        wanted = [DefinitionChange.from_wire(c) for c in changes]
        self._apply_definitions(self.broker.definitions.changes_to(wanted))

    def _apply_definitions(self, changes: list[DefinitionChange]) -> None:
        """Applied as on the primary; a deleted vhost's queues go as the primary's do
        (``on_queue_gone``) if its deletes did not come first."""
        for change in changes:
            if change.kind == VHOST and change.value is None:
                vhost = self.broker.vhosts.get(change.key[0])
                for q in list(vhost.queues.values()) if vhost is not None else []:
                    self._remove_queue(vhost, q)  # type: ignore[arg-type]
            self.broker.definitions.apply(change)

    def exchange_declared(self, vhost_name: str, name: str, ex_type: str, durable: bool,
                          auto_delete: bool, internal: bool, arguments: bytes) -> None:
        vhost = self.broker.add_vhost(vhost_name)
        args = R.decode_table(arguments)
        ex = vhost.exchanges.get(name)
        if ex is not None and not _same_exchange(ex, ex_type, durable, auto_delete, internal,
                                                 arguments):
            vhost.delete_exchange(name)
            ex = None
        if ex is None:
            vhost.declare_exchange(name, ex_type, durable=durable, auto_delete=auto_delete,
                                   internal=internal, arguments=args)
        self._note(("x", vhost_name, name))

    def exchange_deleted(self, vhost_name: str, name: str) -> None:
        vhost = self.broker.vhosts.get(vhost_name)
        if vhost is not None and name in vhost.exchanges:
            vhost.delete_exchange(name)

    def queue_declared(self, vhost_name: str, name: str, durable: bool, auto_delete: bool,
                       arguments: bytes) -> None:
        vhost = self.broker.add_vhost(vhost_name)
        q = vhost.queues.get(name)
        if q is not None and not _same_queue(q, durable, auto_delete, arguments):
            log.info("queue '%s' in vhost '%s' was declared again on the primary: replaced",
                     name, vhost_name)
            self._remove_queue(vhost, q)
            q = None
        if q is None:
            q = vhost.declare_queue(name, owner=NO_OWNER, durable=durable, auto_delete=auto_delete,
                                    server_named=True, arguments=R.decode_table(arguments))
            if self.scope is None:
                hold_timers(vhost, q)
            else:  # the vhost may hold queues this node leads: followed per queue
                hold_queue_timers(vhost, q)
        self._note(("q", vhost_name, name))

    def queue_deleted(self, vhost_name: str, name: str) -> None:
        vhost = self.broker.vhosts.get(vhost_name)
        q = vhost.queues.get(name) if vhost is not None else None
        if q is not None:
            self._remove_queue(vhost, q)  # type: ignore[arg-type]

    def _remove_queue(self, vhost: VirtualHost, q: Queue) -> None:
        vhost.remove_queue(q)
        self.on_queue_gone(q)

    def binding_created(self, vhost_name: str, source: str, kind: str, destination: str,
                        routing_key: str, arguments: bytes) -> None:
        vhost = self.broker.vhost(vhost_name)
        binding = vhost.bind(source, self._destination(vhost, kind, destination), routing_key,
                             R.decode_table(arguments))
        self._note((vhost_name, source, binding.key))

    def binding_deleted(self, vhost_name: str, source: str, kind: str, destination: str,
                        routing_key: str, arguments: bytes) -> None:
        vhost = self.broker.vhosts.get(vhost_name)
        if vhost is None or source not in vhost.exchanges:
            return
        table: dict[str, Any] = vhost.exchanges if kind == "exchange" else vhost.queues
        dest = table.get(destination)
        if dest is not None:
            vhost.unbind(source, dest, routing_key, R.decode_table(arguments))

    @staticmethod
    def _destination(vhost: VirtualHost, kind: str, name: str) -> Queue | Exchange:
        return vhost.exchange(name) if kind == "exchange" else vhost.queue(name)


_HANDLERS = {
    R.VHOST: "vhost",
    R.DEFINITION: "definition_changed",
    R.DEFINITIONS: "definitions",
    R.EXCHANGE_DECLARED: "exchange_declared",
    R.EXCHANGE_DELETED: "exchange_deleted",
    R.QUEUE_DECLARED: "queue_declared",
    R.QUEUE_DELETED: "queue_deleted",
    R.BINDING_CREATED: "binding_created",
    R.BINDING_DELETED: "binding_deleted",
}
CONFIGURATION_EVENTS = frozenset(_HANDLERS)


def _same_exchange(ex: Exchange, ex_type: str, durable: bool, auto_delete: bool,
                   internal: bool, arguments: bytes) -> bool:
    return ((ex.type, ex.durable, ex.auto_delete, ex.internal) == (ex_type, durable, auto_delete,
                                                                   internal)
            and R.encode_table(ex.arguments) == bytes(arguments))


def _same_queue(q: Queue, durable: bool, auto_delete: bool, arguments: bytes) -> bool:
    return (q.exclusive_owner is None and (q.durable, q.auto_delete) == (durable, auto_delete)
            and R.encode_table(q.arguments) == bytes(arguments))
