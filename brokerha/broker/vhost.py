"""A virtual host: its exchanges, queues and bindings, and routing between them."""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from brokerha.broker import arguments as A
from brokerha.broker.background import Background
from brokerha.broker.content import rewrite_properties, update_headers
from brokerha.broker.errors import (
    AccessRefused,
    CommandInvalid,
    NotFound,
    PreconditionFailed,
    ResourceLocked,
)
from brokerha.broker.exchange import EXCHANGE_CLASSES, Binding, Exchange
from brokerha.broker.message import Entry, Message
from brokerha.broker.observers import Observers
from brokerha.broker.queue import MemoryMeter, Queue

log = logging.getLogger(__name__)


class ExchangeRecordLike(Protocol):
    """What restoring reads of a stored record (read-only: the store's are frozen)."""

    @property
    def name(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def auto_delete(self) -> bool: ...
    @property
    def internal(self) -> bool: ...
    @property
    def arguments(self) -> dict[str, Any]: ...


class QueueRecordLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def auto_delete(self) -> bool: ...
    @property
    def arguments(self) -> dict[str, Any]: ...


class BindingRecordLike(Protocol):
    @property
    def source(self) -> str: ...
    @property
    def destination_kind(self) -> str: ...
    @property
    def destination(self) -> str: ...
    @property
    def routing_key(self) -> str: ...
    @property
    def arguments(self) -> dict[str, Any]: ...


STANDARD_EXCHANGES = (
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
)


class VirtualHost:
    def __init__(self, name: str, observers: Observers, memory: MemoryMeter,
                 clock: Callable[[], float] = time.monotonic,
                 background: Background | None = None) -> None:
        self.name = name
        self.observers = observers
        self.memory = memory
        self.clock = clock
        # what a purge or delete leaves to do per entry runs here, in slices
        self.background = background or Background()
        self._expiring: set[Queue] = set()  # queues with an ``Expiry`` in the background
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        self.timed_queues: set[Queue] = set()
        # its queues' contents follow another node's (an HA backup's, backup/timers.py): no
        # timers of their own, and a policy that lowers a limit trims nothing here
        self.following = False
        # the same per queue (``follows``): a partitioned node follows the queues of the
        # groups it is a backup of and leads the others of the same vhost
        self.followed: set[Queue] = set()
        self.exchanges[""] = EXCHANGE_CLASSES["direct"](name, "", durable=True)
        for ex_name, ex_type in STANDARD_EXCHANGES:
            self.exchanges[ex_name] = EXCHANGE_CLASSES[ex_type](name, ex_name, durable=True)

    # -- lookups ---------------------------------------------------------------------

    def exchange(self, name: str) -> Exchange:
        ex = self.exchanges.get(name)
        if ex is None:
            raise NotFound(f"no exchange '{name}' in vhost '{self.name}'")
        return ex

    def queue(self, name: str) -> Queue:
        q = self.queues.get(name)
        if q is None:
            raise NotFound(f"no queue '{name}' in vhost '{self.name}'")
        return q

    def queue_for(self, name: str, owner: object) -> Queue:
        """A queue the connection ``owner`` may use (exclusive queues only by their owner)."""
        q = self.queue(name)
        if q.exclusive_owner is not None and q.exclusive_owner is not owner:
            raise self._locked(name)
        return q

    def _locked(self, name: str) -> ResourceLocked:
        return ResourceLocked(
            f"cannot obtain exclusive access to locked queue '{name}' in vhost '{self.name}'. "
            "It could be originally declared on another connection or the exclusive "
            "property value does not match that of the original declaration."
        )

    # -- exchanges -------------------------------------------------------------------

    def declare_exchange(self, name: str, ex_type: str, *, passive: bool = False,
                         durable: bool = False, auto_delete: bool = False,
                         internal: bool = False, arguments: dict[str, Any] | None = None) -> Exchange:
        args = dict(arguments or {})
        existing = self.exchanges.get(name)
        if passive:
            if existing is None:
                raise NotFound(f"no exchange '{name}' in vhost '{self.name}'")
            return existing
        if name.startswith("amq.") and existing is None:
            raise AccessRefused(
                f"exchange name '{name}' contains reserved prefix 'amq.*'"
            )
        if ex_type not in EXCHANGE_CLASSES:
            raise CommandInvalid(f"unknown exchange type '{ex_type}'")
        if existing is not None:
            check = A.check_equivalent
            check("exchange", self.name, name, "type", ex_type, existing.type)
            check("exchange", self.name, name, "durable", durable, existing.durable)
            check("exchange", self.name, name, "auto_delete", auto_delete, existing.auto_delete)
            check("exchange", self.name, name, "internal", internal, existing.internal)
            check("exchange", self.name, name, "alternate-exchange",
                  args.get("alternate-exchange"), existing.arguments.get("alternate-exchange"))
            return existing
        A.validate_exchange_arguments(self.name, name, args)
        ex = EXCHANGE_CLASSES[ex_type](self.name, name, durable=durable,
                                       auto_delete=auto_delete, internal=internal,
                                       arguments=args)
        self.exchanges[name] = ex
        for obs in self.observers.configuration:
            obs.exchange_declared(ex)
        return ex

    def delete_exchange(self, name: str, *, if_unused: bool = False) -> None:
        if name == "" or name.startswith("amq.") and name in dict(STANDARD_EXCHANGES):
            raise AccessRefused("operation not permitted on the default exchange"
                                if name == "" else
                                f"deletion of system exchange '{name}' in vhost '{self.name}' "
                                "not allowed")
        ex = self.exchange(name)
        if if_unused and (ex.bindings or self._bound_as_destination(ex)):
            raise PreconditionFailed(f"exchange '{name}' in vhost '{self.name}' in use")
        self._remove_exchange(ex)

    def _bound_as_destination(self, ex: Exchange) -> bool:
        return any(b.destination is ex for e in self.exchanges.values() for b in e.bindings.values())

    def _remove_exchange(self, ex: Exchange) -> None:
        for binding in list(ex.bindings.values()):
            self._remove_binding(binding, cascade=False)
        for other in list(self.exchanges.values()):
            for binding in [b for b in other.bindings.values() if b.destination is ex]:
                self._remove_binding(binding)
        ex.deleted = True
        del self.exchanges[ex.name]
        for obs in self.observers.configuration:
            obs.exchange_deleted(ex)

    def restore_exchange(self, record: ExchangeRecordLike) -> None:
        if record.name in self.exchanges:
            return
        self.exchanges[record.name] = EXCHANGE_CLASSES[record.type](
            self.name, record.name, durable=True, auto_delete=record.auto_delete,
            internal=record.internal, arguments=record.arguments)

    # -- queues ----------------------------------------------------------------------

    def declare_queue(self, name: str, *, owner: object, passive: bool = False,
                      durable: bool = False, exclusive: bool = False,
                      auto_delete: bool = False, server_named: bool = False,
                      arguments: dict[str, Any] | None = None) -> Queue:
        """Declare (or check) a queue; ``server_named`` marks a name from new_queue_name."""
        args = dict(arguments or {})
        if passive:
            return self.queue_for(name, owner)
        if not name:
            name = self.new_queue_name()
        elif name.startswith("amq.") and not server_named:
            raise AccessRefused(f"queue name '{name}' contains reserved prefix 'amq.*'")
        durable = durable and not exclusive  # as RabbitMQ: an exclusive queue is never durable
        existing = self.queues.get(name)
        if existing is not None:
            # RabbitMQ's strict exclusive check comes before the fields: the owner a declare
            # names (this connection if exclusive, else nobody) must be the queue's (405)
            if existing.exclusive_owner is not (owner if exclusive else None):
                raise self._locked(name)
            self._check_queue_equivalent(existing, durable, auto_delete, args)
            existing.last_used = self.clock()
            return existing
        A.validate_queue_arguments(self.name, name, args)
        for obs in self.observers.configuration:
            obs.queue_declaring(self.name, name, exclusive, auto_delete, args)
        q = Queue(self.name, name, durable=durable,
                  exclusive_owner=owner if exclusive else None,
                  auto_delete=auto_delete, arguments=args,
                  hooks=self.observers.queue_hooks, memory=self.memory,
                  clock=self.clock, sink=self)
        q.on_unused = self._auto_delete_queue
        self.queues[name] = q
        if q.has_timers:
            self.timed_queues.add(q)
        for obs in self.observers.configuration:
            obs.queue_declared(q)
        return q

    def restore_queue(self, record: QueueRecordLike) -> Queue:
        q = Queue(self.name, record.name, durable=True, auto_delete=record.auto_delete,
                  arguments=record.arguments, hooks=self.observers.queue_hooks,
                  memory=self.memory, clock=self.clock, sink=self)
        q.on_unused = self._auto_delete_queue
        self.queues[record.name] = q
        if q.has_timers:
            self.timed_queues.add(q)
        return q

    def follows(self, q: Queue) -> bool:
        """Whether ``q``'s contents follow another node's (its primary's trims and expiries
        decide, not this node's timers and limits)."""
        return self.following or q in self.followed

    @staticmethod
    def new_queue_name() -> str:
        return f"amq.gen-{uuid.uuid4().hex[:22]}"

    def _check_queue_equivalent(self, q: Queue, durable: bool, auto_delete: bool,
                                args: dict[str, Any]) -> None:
        check = A.check_equivalent
        check("queue", self.name, q.name, "durable", durable, q.durable)
        check("queue", self.name, q.name, "auto_delete", auto_delete, q.auto_delete)
        for arg in A.QUEUE_EQUIVALENCE_ARGS:
            check("queue", self.name, q.name, arg, args.get(arg), q.arguments.get(arg))

    def delete_queue(self, name: str, *, owner: object, if_unused: bool = False,
                     if_empty: bool = False) -> int:
        q = self.queue_for(name, owner)
        refusal = q.ordering.refuse_delete(q) if q.ordering is not None else None
        if refusal is not None:
            raise PreconditionFailed(refusal)
        if if_unused and q.consumers:
            raise PreconditionFailed(f"queue '{name}' in vhost '{self.name}' in use")
        if if_empty and q.message_count:
            raise PreconditionFailed(f"queue '{name}' in vhost '{self.name}' not empty")
        return self.remove_queue(q)

    def remove_queue(self, q: Queue) -> int:
        if q.deleted:
            return 0
        for ex in list(self.exchanges.values()):
            for binding in [b for b in ex.bindings.values() if b.destination is q]:
                self._remove_binding(binding)
        count = q.delete(self.background)
        self.queues.pop(q.name, None)
        self.timed_queues.discard(q)
        self.followed.discard(q)
        for obs in self.observers.configuration:
            obs.queue_deleted(q)
        return count

    def _auto_delete_queue(self, q: Queue) -> None:
        self.remove_queue(q)

    def purge_queue(self, name: str, owner: object) -> int:
        """Empty the queue now; the count. What is left per entry runs in ``background``."""
        q = self.queue_for(name, owner)
        if q.ordering is not None:  # a purge is not an ordered operation
            raise PreconditionFailed(q.ordering.refuse_purge(q))
        drain = q.begin_purge()
        if drain.count:
            self.background.run(drain)
        return drain.count

    # -- bindings --------------------------------------------------------------------

    def bind(self, source: str, destination: Queue | Exchange, routing_key: str,
             arguments: dict[str, Any] | None = None) -> Binding:
        if source == "":
            raise AccessRefused("operation not permitted on the default exchange")
        ex = self.exchange(source)
        binding = Binding(ex, destination, routing_key, dict(arguments or {}))
        if ex.add_binding(binding):
            for obs in self.observers.configuration:
                obs.binding_created(binding)
        return binding

    def restore_binding(self, record: BindingRecordLike) -> None:
        source = self.exchanges.get(record.source)
        table: dict[str, Any] = self.exchanges if record.destination_kind == "exchange" else self.queues
        destination = table.get(record.destination)
        if source is None or destination is None:
            return
        source.add_binding(Binding(source, destination, record.routing_key, dict(record.arguments)))

    def has_binding(self, source: Exchange, destination: Queue | Exchange, routing_key: str,
                    arguments: dict[str, Any] | None = None) -> bool:
        key = Binding(source, destination, routing_key, dict(arguments or {})).key
        return key in source.bindings

    def unbind(self, source: str, destination: Queue | Exchange, routing_key: str,
               arguments: dict[str, Any] | None = None) -> None:
        if source == "":
            raise AccessRefused("operation not permitted on the default exchange")
        ex = self.exchange(source)
        key = Binding(ex, destination, routing_key, dict(arguments or {})).key
        binding = ex.bindings.get(key)
        if binding is not None:
            self._remove_binding(binding)

    def _remove_binding(self, binding: Binding, cascade: bool = True) -> None:
        ex = binding.source
        if ex.remove_binding(binding.key) is None:
            return
        for obs in self.observers.configuration:
            obs.binding_deleted(binding)
        if cascade and ex.auto_delete and not ex.bindings and not ex.deleted:
            self._remove_exchange(ex)

    # -- routing ---------------------------------------------------------------------

    def route(self, exchange: Exchange, message: Message) -> list[Queue]:
        """Queues the message goes to: bindings, exchange-to-exchange hops, alternates."""
        if exchange.name == "":
            q = self.queues.get(message.routing_key)
            return [q] if q is not None else []
        queues: list[Queue] = []
        seen_queues: set[int] = set()
        seen_exchanges: set[int] = set()
        self._route_into(exchange, message, queues, seen_queues, seen_exchanges)
        return queues

    def _route_into(self, ex: Exchange, message: Message, queues: list[Queue],
                    seen_q: set[int], seen_x: set[int]) -> None:
        if id(ex) in seen_x:
            return
        seen_x.add(id(ex))
        before = len(queues)
        for binding in ex.match(message.routing_key, message):
            dest = binding.destination
            if isinstance(dest, Queue):
                if id(dest) not in seen_q:
                    seen_q.add(id(dest))
                    queues.append(dest)
            else:
                self._route_into(dest, message, queues, seen_q, seen_x)
        if len(queues) == before and ex.alternate is not None:
            alt = self.exchanges.get(ex.alternate)
            if alt is not None:
                self._route_into(alt, message, queues, seen_q, seen_x)

    # -- dead-lettering ----------------------------------------------------------------

    def dead_letter(self, queue: Queue, entries: list[Entry], reason: str) -> None:
        """Republish to the queue's DLX with an x-death header, as RabbitMQ does."""
        dlx = self.exchanges.get(queue.dead_letter_exchange or "")
        if dlx is None:
            return
        for entry in entries:
            message = entry.message
            key = queue.dead_letter_routing_key or message.routing_key
            try:
                header = _dead_letter_header(message, queue, reason)
            except (ValueError, TypeError, OverflowError) as exc:  # a table pamqp cannot read
                log.warning("dead letter from queue '%s' in vhost '%s' without x-death: %s",
                            queue.name, self.name, exc)
                header = rewrite_properties(message.header, expiration=None)
            dead = Message(dlx.name, key, header, message.body)
            targets = [q for q in self.route(dlx, dead) if q is not queue or reason != "expired"]
            if self.followed:  # a partitioned node: never into a copy of another group's queue
                targets = self._led(targets, queue, dead)
            ordered = [q for q in targets if q.ordering is not None]
            if ordered:  # into ordered queues: an ordered enqueue, like a publish
                ordered[0].ordering.publish(ordered, dead)  # type: ignore[union-attr]
                targets = [q for q in targets if q.ordering is None]
            for target in targets:
                target.enqueue(dead, deduplicate=False)  # a DLX retry loop must not drop it

    def _led(self, targets: list[Queue], source: Queue, dead: Message) -> list[Queue]:
        """The dead letter's targets this node may enqueue into: on a node running
        partition groups (issue 35), not the copies of queues of groups it follows
        (``followed``): those go to their partitions' leaders through the node's
        forwarding (``observers.dead_letters_elsewhere``), at most once as RabbitMQ's
        dead-lettering (no confirm: lost if this node fails before they are applied)."""
        led = [q for q in targets if q not in self.followed]
        forward = self.observers.dead_letters_elsewhere
        if len(led) < len(targets) and forward is not None and source not in self.followed:
            forward(source, [q for q in targets if q in self.followed], dead)
        elif len(led) < len(targets):
            log.warning("dead letter from queue '%s' in vhost '%s' not routed to %s: their "
                        "partitions are led by other nodes",
                        source.name, self.name,
                        ", ".join(f"'{q.name}'" for q in targets if q in self.followed))
        return led

    # -- timers ------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Expire messages (x-message-ttl, expiration) and unused queues (x-expires).

        A slice of a queue's expired head now (``background.entries``); more goes on
        in the broker's background slices (``Expiry``), as a purge's rest: a TX of
        100,000 with a TTL expires all at once, and the loop must not stall on it."""
        budget = self.background.entries
        for q in list(self.timed_queues):
            if q.expire(now, budget) and q not in self._expiring:
                self._expiring.add(q)
                self.background.run(Expiry(q, self._expiring))
            if q.expires is not None:
                unused = q.unused_since(now)
                if unused is not None and unused * 1000.0 >= q.expires:
                    self.remove_queue(q)


class Expiry:
    """A queue's expired head dropped in the background, ``budget`` entries a step,
    until its head is live (or the queue is gone)."""

    def __init__(self, queue: Queue, running: set[Queue]) -> None:
        self.queue = queue
        self.running = running  # the vhost's: one Expiry per queue at a time

    def step(self, budget: int) -> bool:
        q = self.queue
        if not q.deleted and q.expire(q.clock(), budget):
            return False
        self.running.discard(q)
        return True


def _dead_letter_header(message: Message, queue: Queue, reason: str) -> bytes:
    headers = message.headers
    deaths = list(headers.get("x-death") or [])
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    for death in deaths:
        if (isinstance(death, dict) and death.get("queue") == queue.name
                and death.get("reason") == reason):
            death["count"] = int(death.get("count", 1)) + 1
            death["time"] = now
            deaths.remove(death)
            deaths.insert(0, death)
            break
    else:
        death = {
            "count": 1,
            "reason": reason,
            "queue": queue.name,
            "time": now,
            "exchange": message.exchange,
            "routing-keys": [message.routing_key],
        }
        if message.expiration_ms is not None:
            death["original-expiration"] = str(message.expiration_ms)
        deaths.insert(0, death)
    changes: dict[str, Any] = {"x-death": deaths}
    for name, value in (("x-first-death-reason", reason), ("x-first-death-queue", queue.name),
                        ("x-first-death-exchange", message.exchange)):
        if name not in headers:
            changes[name] = value
    # the other headers keep their octets (update_headers)
    table = update_headers(message.header, message._headers_at, changes)
    return rewrite_properties(message.header, headers=table, expiration=None)
