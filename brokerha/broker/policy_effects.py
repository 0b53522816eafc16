"""Policies acting on a broker's queues and exchanges, at once, as RabbitMQ's do.

``PolicyEffects`` holds the node's ``PolicyBook`` (``broker/policies.py``; the
definitions fill it, replicated to every member) and keeps every queue and
exchange set as the book says:

- a queue or exchange declared (or recovered, ``apply_all``) gets what its
  matching policy and operator policy give (``Applied``);
- a policy set or cleared re-applies its vhost's objects, as RabbitMQ's
  ``update_matched_objects``: a queue's ``message-ttl`` applies to messages
  enqueued after it (those queued keep their expiry, as RabbitMQ's), a new
  ``expires`` counts from now, a lower ``max-length``/``max-length-bytes``
  (with ``overflow`` drop-head) trims the queue's oldest messages now,
  dead-lettered as ``maxlen`` -- at once up to a slice (``SLICE_ENTRIES``), a
  bigger trim in slices of the broker's ``Background`` (the loop must not
  stall on a million drops), the queue's
  limit stepping down with it so that a publish between slices drops one
  message, not the rest of the trim;
- an exchange's ``alternate-exchange`` (its argument wins).

On an HA backup (the vhost is ``following``, or the queue is one of its
``followed`` on a partitioned node: its contents are the primary's, which
sends the dequeues of a trim and of expiries) the settings
are set all the same -- so a promoted backup acts on them at once -- but no
timer starts and nothing is trimmed here.

A global queue (``x-global``, docs/txlog.md) takes no ``message-ttl``,
``expires``, ``max-length`` or ``max-length-bytes`` from a policy: they would
drop messages in one datacenter only (its arguments refuse them for the same
reason).

``ha-replicate`` is read by the HA primary (``replicate``): when it first sees a
queue, and again for the vhost's queues after each policy change, which it
applies to them at once (``Primary.replicate_changed``); see docs/ha.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from brokerha.broker.arguments import GLOBAL_ARG, LOCAL_ONLY_ARGS
from brokerha.broker.exchange import Exchange
from brokerha.broker.observers import ConfigurationObserver
from brokerha.broker.policies import (
    HA_REPLICATE,
    KINDS,
    Applied,
    Policy,
    PolicyBook,
    from_value,
    resolve,
)
from brokerha.broker.queue import Queue


class DefinitionChangeLike(Protocol):
    """What this reads of a ``broker/definitions.py`` change."""

    @property
    def kind(self) -> str: ...
    @property
    def key(self) -> tuple[str, ...]: ...
    @property
    def value(self) -> dict[str, Any] | None: ...


if TYPE_CHECKING:
    from brokerha.broker.broker import Broker
    from brokerha.broker.vhost import VirtualHost

log = logging.getLogger(__name__)

_LOCAL_ONLY_KEYS = tuple(arg[len("x-"):] for arg in LOCAL_ONLY_ARGS)


class LengthTrim:
    """A queue brought down to its lowered length limits, ``budget`` drops a step.

    While it runs, the queue's own limits stay at its length now (so a publish
    meanwhile drops one message, not the whole excess) and step down to the
    targets with each slice.
    """

    def __init__(self, queue: Queue, max_length: int | None, max_length_bytes: int | None) -> None:
        self.queue = queue
        self.max_length = max_length
        self.max_length_bytes = max_length_bytes
        self.cancelled = False
        self.dropped = 0
        self._hold()

    def _hold(self) -> None:
        q = self.queue
        if self.max_length is not None:
            q.max_length = max(self.max_length, len(q.ready))
        if self.max_length_bytes is not None:
            q.max_length_bytes = max(self.max_length_bytes, q.ready_bytes)

    def step(self, budget: int) -> bool:
        q = self.queue
        if self.cancelled or q.deleted:
            return True
        q.max_length, q.max_length_bytes = self.max_length, self.max_length_bytes
        self.dropped += q.drop_head(budget)
        if q.over_limit():
            self._hold()
            return False
        return True


class PolicyEffects(ConfigurationObserver):
    """The broker's policies, applied (one per broker: ``PolicyEffects.of(broker)``)."""

    def __init__(self, broker: Broker, book: PolicyBook | None = None) -> None:
        self.broker = broker
        self.book = book or PolicyBook()
        self._applied: dict[Queue | Exchange, Applied] = {}
        self._trims: dict[Queue, LengthTrim] = {}
        broker.observers.add_configuration_observer(self)
        definitions = getattr(broker, "definitions", None)  # broker/definitions.py
        if definitions is not None:
            for change in definitions.changes():
                self.definition_changed(change)
            definitions.subscribe(self.definition_changed)

    @staticmethod
    def of(broker: Broker) -> PolicyEffects | None:
        """The broker's, if it has one."""
        for observer in broker.observers.configuration:
            if isinstance(observer, PolicyEffects):
                return observer
        return None

    # -- what applies --------------------------------------------------------------------

    def applied(self, obj: Queue | Exchange) -> Applied:
        """What applies to ``obj`` now (``/api/queues``' policy, operator_policy,
        effective_policy_definition)."""
        found = self._applied.get(obj)
        if found is None:
            kind = "queue" if isinstance(obj, Queue) else "exchange"
            found = self.book.applied(obj.vhost, kind, obj.name)
        return found

    def replicate(self, queue: Queue) -> str | None:
        """The queue's ``ha-replicate`` (its ``x-ha-replicate`` argument wins); None: unset."""
        value = resolve(HA_REPLICATE, queue.arguments, self.applied(queue).definition)
        return None if value is None else str(value)

    # -- changes ---------------------------------------------------------------------------

    def definition_changed(self, change: DefinitionChangeLike) -> None:
        """A listener of the broker's definitions: a policy or operator policy set or
        cleared (on every node alike: the primary's API, a backup's replication, recovery)."""
        if change.kind not in KINDS:
            return
        vhost, name = change.key
        if change.value is None:
            self.clear_policy(change.kind, vhost, name)
        else:
            self.set_policy(change.kind, from_value(vhost, name, change.value))

    def set_policy(self, kind: str, policy: Policy) -> None:
        self.book.set(kind, policy)
        self.reapply(policy.vhost)

    def clear_policy(self, kind: str, vhost: str, name: str) -> None:
        if self.book.clear(kind, vhost, name) is not None:
            self.reapply(vhost)

    def reapply(self, vhost_name: str) -> None:
        """Every queue and exchange of the vhost as its policies say now."""
        vhost = self.broker.vhosts.get(vhost_name)
        if vhost is None:
            return
        for ex in list(vhost.exchanges.values()):
            self._apply_exchange(ex)
        for q in list(vhost.queues.values()):
            self._apply_queue(vhost, q)

    def apply_all(self) -> None:
        """Every object of every vhost (after recovery, which declares without observers)."""
        for name in list(self.broker.vhosts):
            self.reapply(name)

    # -- configuration observer --------------------------------------------------------------

    def exchange_declared(self, exchange: Exchange) -> None:
        self._apply_exchange(exchange)

    def exchange_deleted(self, exchange: Exchange) -> None:
        self._applied.pop(exchange, None)

    def queue_declared(self, queue: Queue) -> None:
        vhost = self.broker.vhosts.get(queue.vhost)
        if vhost is not None:
            self._apply_queue(vhost, queue)

    def queue_deleted(self, queue: Queue) -> None:
        self._applied.pop(queue, None)
        trim = self._trims.pop(queue, None)
        if trim is not None:
            trim.cancelled = True

    # -- applying ------------------------------------------------------------------------------

    def _apply_exchange(self, ex: Exchange) -> None:
        applied = self.book.applied(ex.vhost, "exchange", ex.name)
        self._applied[ex] = applied
        value = applied.definition.get("alternate-exchange")
        ex.policy_alternate = value if isinstance(value, str) else None

    def _apply_queue(self, vhost: VirtualHost, q: Queue) -> None:
        applied = self.book.applied(q.vhost, "queue", q.name)
        self._applied[q] = applied
        definition = applied.definition
        if q.arguments.get(GLOBAL_ARG) and any(k in definition for k in _LOCAL_ONLY_KEYS):
            log.warning("global queue '%s' in vhost '%s': policy '%s' keys %s not applied "
                        "(they would drop messages in one datacenter only)", q.name, q.vhost,
                        applied.policy_name or applied.operator_policy_name,
                        ", ".join(k for k in _LOCAL_ONLY_KEYS if k in definition))
            definition = {k: v for k, v in definition.items() if k not in _LOCAL_ONLY_KEYS}
        args = q.arguments
        q.message_ttl = _int(resolve("message-ttl", args, definition))
        expires = _int(resolve("expires", args, definition))
        if expires != q.expires:
            q.last_used = q.clock()  # RabbitMQ restarts the expiry timer
        q.expires = expires
        q.overflow = str(resolve("overflow", args, definition) or "drop-head")
        dlx = resolve("dead-letter-exchange", args, definition)
        q.dead_letter_exchange = None if dlx is None else str(dlx)
        dlrk = resolve("dead-letter-routing-key", args, definition)
        q.dead_letter_routing_key = None if dlrk is None else str(dlrk)
        self._limit(vhost, q, _int(resolve("max-length", args, definition)),
                    _int(resolve("max-length-bytes", args, definition)))
        if vhost.follows(q):
            return
        if q.has_timers:
            vhost.timed_queues.add(q)
        else:
            vhost.timed_queues.discard(q)

    def _limit(self, vhost: VirtualHost, q: Queue, max_length: int | None,
               max_length_bytes: int | None) -> None:
        """Set the limits; trim the queue to them (drop-head) unless it follows a primary."""
        trim = self._trims.pop(q, None)
        if trim is not None:
            trim.cancelled = True
        q.max_length, q.max_length_bytes = max_length, max_length_bytes
        if vhost.follows(q) or q.overflow != "drop-head" or not q.over_limit():
            return
        budget = vhost.background.entries
        if q.drop_head(budget) < budget:  # the usual case: done now, before the answer
            return
        trim = LengthTrim(q, max_length, max_length_bytes)
        self._trims[q] = trim
        vhost.background.run(trim)
        if trim.cancelled or not q.over_limit():
            self._trims.pop(q, None)
        else:
            vhost.background.after(lambda: self._trim_done(trim))

    def _trim_done(self, trim: LengthTrim) -> None:
        if self._trims.get(trim.queue) is trim:
            del self._trims[trim.queue]
        if trim.dropped:
            log.info("queue '%s' in vhost '%s': %d messages dropped to its lowered length "
                     "limit", trim.queue.name, trim.queue.vhost, trim.dropped)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)
