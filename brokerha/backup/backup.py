"""Backup: applies one primary's events to this node's broker (sans-I/O).

The node sends ``join_message()`` to the primary it follows and passes every
``Events`` packet from it to ``receive``. The primary answers the join with a
catch-up (``b`` ... ``s`` ... ``c``) and then live events; they are applied in
seq order: an old or repeated seq is ignored, a gap raises ``ReplicationError``
and events of an older epoch ``StaleEpoch`` (the caller logs it and joins
again). The catch-up's events are numbered below the join's seq (the
primary streams them, ``primary/catch_up.py``); the CaughtUp marker names the
join's seq and the applied seq moves to it. Until the marker is applied the
broker holds a mix of old and new state, so the node's position is INVALID;
from then on it is ``(epoch, applied_seq)``.

Acknowledgement contract: an ``Ack`` promises the primary that everything up
to its seq survives a crash of this node, since a confirm may go out on it.
So the caller sends ``ack_message()`` only from
``broker.store.after_sync(...)`` (the store has synced what was applied) and
after persisting ``position`` when caught up. Transient messages are held in
memory like on the primary; the backup's Store observes its broker like on any
node and keeps the persistent messages of durable queues.

A backup's broker has no clients, hence no consumers, and no ``Primary``
observing it (refused at construction), so applying an event feeds nothing
back. Its queues keep no timers (``backup.timers``): TTL and ``x-expires``
act through the primary's dequeue and delete events.

Other layers' events go to ``layers`` (event kind -> ``LayerReplica``): the
partition table's ``pt``/``ps`` to the node's ``TableReplica``
(``brokerha/partition/coordinator.py``), whose writes are the store's, synced
before any acknowledgement like the broker's.

The TxLog's ``l*`` events go to ``txlog`` (the node's ``TxLogReplica``,
``brokerha/txlog/bridge/replica.py``), which writes them into this node's TxLog
journal; the node acknowledges only once that journal is synced too.

Transactions: the ``t*`` events go to the TransactionReplicator
(``transaction_replicator.py``); a ``TxVote`` it could not give as an
acknowledgement waits in ``votes`` for the node to send (``take_votes``).

Work in slices: a big ``tc`` is applied a slice at a time (``busy``; the
caller calls ``step`` once a loop turn until it returns False). Its seq is
applied, hence acknowledged, only after the last slice, and every packet
received meanwhile waits behind it (``_held``), so the stream is applied in
order. ``settle`` ends a commit in progress at once and drops what waited
(joining again, changing role): a node never leaves a transaction half
applied. A large message's body comes as ``bp`` parts before its ``e`` or
``te`` (``cluster/replication.py``), kept in ``_parts`` until it.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from brokerha import gc_hooks
from brokerha.backup.broker_replicator import CONFIGURATION_EVENTS, BrokerReplicator
from brokerha.backup.queue_replicator import QueueReplicator
from brokerha.backup.timers import (
    hold_all_timers,
    hold_scope_timers,
    resume_scope_timers,
    resume_timers,
)
from brokerha.backup.transaction_replicator import COMMIT_SLICE, TransactionReplicator
from brokerha.broker.broker import Broker
from brokerha.broker.placement import GroupScope, scope_of
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R
from brokerha.cluster.ranges import to_ranges
from brokerha.cluster.replication import (
    Ack,
    ConfigurationMismatch,
    Events,
    Join,
    ReplicationError,
    StaleEpoch,
    TxVote,
)

log = logging.getLogger(__name__)

INVALID = (-1, -1)
# what may follow a ``bp``: another part, or the e/te whose body the parts are
_TAKES_PARTS = frozenset([R.BODY_PART, R.ENQUEUED, R.TX_ENQUEUE])
_sessions = itertools.count(1)


def as_position(position: Any) -> tuple[int, int]:
    """(epoch, seq) from an election ``Position`` or a pair."""
    if hasattr(position, "epoch"):
        return int(position.epoch), int(position.seq)
    epoch, seq = position
    return int(epoch), int(seq)


class LayerReplica(Protocol):
    """Another layer's copy of the primary's log on this backup: the TxLog's ``l*`` events
    (``txlog/bridge/replica.py``, ``TxLogReplica``)."""

    def apply(self, event: list[Any]) -> None:
        """One of its events, in log order."""

    def after_durable(self, callback: Callable[[], None]) -> None:
        """``callback`` once everything applied so far is on this node's disk."""


class Backup:
    def __init__(self, broker: Broker, *, me: str, epoch: int, position: Any,
                 txlog: LayerReplica | None = None,
                 layers: Mapping[str, LayerReplica] | None = None,
                 commit_slice: int = COMMIT_SLICE,
                 scope: GroupScope | None = None) -> None:
        for o in broker.observers.configuration:
            if getattr(o, "is_ha_primary", False) and (
                    scope is None or scope.overlaps(scope_of(o))):
                raise RuntimeError("a backup's broker must not be observed by a Primary of "
                                   "the same group: close the Primary first")
        self.broker = broker
        # a partitioned node's replication group (broker/placement.py): only its queues are
        # held, listed in a join and replaced by a catch-up; None: the whole broker
        self.scope = scope
        self.me = me
        self.epoch = epoch
        self.last_position = as_position(position)  # the last consistent one, for the Join
        self.session = 0
        self.applied_seq = -1
        self.ack_due = False  # applied something that needs a prompt acknowledgement
        # the primary asked us to join again (an ``rj`` naming us: a queue's ha-replicate
        # became ``all``, its messages come in that join's catch-up); the caller joins
        self.rejoin_requested = False
        self.caught_up = False
        self._catching_up = False
        self._valid_at: int | None = None  # the marker's: caught up once applied so far
        self.config = BrokerReplicator(broker, self._queue_gone, scope)
        self._queues: dict[tuple[str, str], QueueReplicator] = {}
        self.transactions = TransactionReplicator(broker, self._replicator, me, epoch, scope)
        # the TxLog's ``l*`` events (brokerha/txlog/bridge/replica.py: ``apply(event)``), if any
        self.txlog = txlog
        self.layers = dict(layers or {})  # other layers' events by kind (the partition table)
        self._parts: list[bytes | memoryview] = []  # ``bp`` parts of the next ``e``'s body
        # a ``tc`` of more than ``commit_slice`` entries is applied in slices (smaller in
        # simulations: PrimarySettings): (its seq, its remaining slices); packets behind it
        self.commit_slice = commit_slice
        self._commit: tuple[int, Iterator[None]] | None = None
        self._held: deque[tuple[int, list[Any]]] = deque()
        self._bulk = False  # the packet being applied held a catch-up's run (gc_governor)
        if scope is None:
            hold_all_timers(broker)
        else:
            hold_scope_timers(broker, scope)

    @property
    def applying(self) -> bool:
        """The answer to our join has begun (its catch-up, or live events after it)."""
        return self._catching_up or self.caught_up

    @property
    def busy(self) -> bool:
        """A commit is being applied in slices: call ``step`` next loop turn."""
        return self._commit is not None

    @property
    def partial_body(self) -> bool:
        """Holds ``bp`` parts of a large message whose ``e`` (or ``te``) has not come yet."""
        return bool(self._parts)

    @property
    def commit_seq(self) -> int | None:
        """The seq of the commit being applied in slices (not applied yet), or None."""
        return self._commit[0] if self._commit is not None else None

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, applied_seq) once caught up; INVALID while catching up."""
        return (self.epoch, self.applied_seq) if self.caught_up else INVALID

    def close(self) -> None:
        """Stop following: the queues keep time again (a promoted node's)."""
        if self.scope is None:
            resume_timers(self.broker, self.broker.clock())
        else:
            resume_scope_timers(self.broker, self.scope, self.broker.clock())

    # -- to the primary ----------------------------------------------------------------

    def join_message(self) -> Join:
        """Start (again) from a catch-up; nothing is applied until its answer arrives."""
        self.settle()
        if self.caught_up:
            self.last_position = self.position
        self.session = next(_sessions)
        self._parts = []
        self.applied_seq = -1
        self.caught_up = self._catching_up = False
        self.rejoin_requested = False
        self._valid_at = None
        self.transactions.release_local_branches()
        epoch, seq = self.last_position
        return Join(self.epoch, self.me, epoch, seq, self._inventory(), self.session)

    def _inventory(self) -> list[Any]:
        out: list[Any] = []
        scope = self.scope
        for vhost in self.broker.vhosts.values():
            for q in vhost.queues.values():
                if q.exclusive_owner is None and (scope is None or scope.queues(q)):
                    out.append([vhost.name, q.name, q.arguments.get(R.HA_ID),
                                to_ranges(e.position for e in q.ready)])
        return out

    def ack_message(self, seq: int | None = None) -> Ack:
        """Acknowledge ``seq`` (default: all applied); send it only once the store synced
        what it covers (see the module docstring)."""
        return Ack(self.epoch, self.me, self.applied_seq if seq is None else seq)

    def take_votes(self) -> list[TxVote]:
        """No votes to send to the primary (a yes is an Ack)."""
        votes, self.transactions.votes = self.transactions.votes, []
        return votes

    # -- from the primary --------------------------------------------------------------

    def starts_catch_up(self, msg: Events) -> bool:
        """Whether ``msg`` begins the catch-up our join asked for (our state changes from here)."""
        if self._catching_up or self.caught_up or msg.epoch != self.epoch or not msg.events:
            return False
        first = msg.events[0]
        return bool(first.kind == R.CATCH_UP_BEGINS and first.session == self.session)

    def receive(self, msg: Events) -> None:
        if msg.epoch < self.epoch:
            raise StaleEpoch(f"events of epoch {msg.epoch}; this backup follows epoch {self.epoch}")
        if msg.epoch > self.epoch:
            raise ReplicationError(f"events of epoch {msg.epoch} from a primary not joined "
                                   f"(this backup follows epoch {self.epoch})")
        events = msg.events
        if self._commit is not None:
            self._held.append((msg.first_seq, events))  # applied once the commit is
            return
        if not (self._catching_up or self.caught_up):
            if not self.starts_catch_up(msg):
                return  # an earlier session's tail, before the answer to our join
            self._catching_up = True
            self.applied_seq = msg.first_seq - 1
        self._receive_packet(msg.first_seq, events)

    def _receive_packet(self, first_seq: int, events: list[Any]) -> None:
        try:
            self._receive(first_seq, events)
        except _Rejoin:
            # what came before it is applied (a consistent copy at the seq before it):
            # the rest of this packet is the old session's, the new join's catch-up covers it
            self.rejoin_requested = True
            self._held.clear()
        if self._bulk:  # a catch-up's runs made entries by the thousand: frozen as they are
            self._bulk = False
            gc_hooks.bulk_made()

    def step(self) -> bool:
        """The next slice of the commit in progress, then what waited behind it once it is
        done; True while a commit is still in progress (call again next loop turn)."""
        commit = self._commit
        if commit is not None:
            seq, steps = commit
            for _ in steps:
                return True  # a slice done, more to come
            self._commit = None
            self._applied(seq, R.TX_COMMIT)
        held = self._held
        while held and self._commit is None and not self.rejoin_requested:
            first_seq, events = held.popleft()
            self._receive_packet(first_seq, events)
        return self._commit is not None

    def settle(self) -> None:
        """End the commit in progress now (all its slices) and drop what waited behind it.

        For a join or a change of role: a transaction is never left half applied,
        and what was not applied is not acknowledged (nothing counts on it).
        """
        commit, self._commit = self._commit, None
        self._held.clear()
        if commit is not None:
            seq, steps = commit
            for _ in steps:
                pass
            self._applied(seq, R.TX_COMMIT)

    def _receive(self, first_seq: int, events: list[Any]) -> None:
        count = len(events)
        offset = 0
        while offset < count:
            event = events[offset]
            seq = first_seq + offset
            offset += 1
            if seq <= self.applied_seq:
                continue
            if seq != self.applied_seq + 1:
                raise ReplicationError(f"gap: event {seq} after {self.applied_seq}")
            kind = event.kind
            if self._parts and kind not in _TAKES_PARTS:
                raise ReplicationError(f"event {kind!r} at {seq} after the parts of a body")
            run = _enqueue_run(events, offset - 1) if kind == R.ENQUEUED else 1
            if run > 1 and not self._parts:
                # enqueues on one queue in a row (a catch-up's, a burst of publishes):
                # one batch, the store's hooks called once (Queue.add_entries)
                self._replicator(event.vhost, event.queue).enqueue_many(
                    events[offset - 1:offset - 1 + run])
                offset += run - 1
                seq += run - 1
            elif kind == R.ENQUEUED_RUN:  # a catch-up's run: one batch, stored as it came
                self._bulk = True
                try:
                    self._replicator(event.vhost, event.queue).enqueue_packed(
                        event.first, event.length, event.contents)
                except (ValueError, TypeError) as exc:
                    raise ReplicationError(f"run of {event.length} at {seq}: {exc}") from None
            elif kind == R.TX_COMMIT:
                steps = self.transactions.commit_steps(event.txid, event.client_id, event.ops,
                                                       self.commit_slice)
                if _unfinished(steps):  # a big one: its next slices the next loop turns
                    self._commit = (seq, steps)
                    if offset < count:
                        self._held.appendleft((seq + 1, events[offset:]))
                    return
            elif kind == R.BODY_PART:
                self._parts.append(event.data)
                self.applied_seq = seq  # nothing waits for a part: no prompt ack
                continue
            elif self._parts:  # the e (or te) whose body came in parts
                self._parts.append(event.body)
                body, self._parts = b"".join(self._parts), []
                self._apply(seq, event._replace(body=body))
            else:
                self._apply(seq, event)
            self._applied(seq, kind, event)

    def _applied(self, seq: int, kind: str, event: Any = None) -> None:
        """``event`` (of ``kind``) at ``seq`` is applied (the last of a run: ``seq`` is its)."""
        # the CaughtUp marker names the join's seq: live events go on from there
        self.applied_seq = event.seq if kind == R.CAUGHT_UP else seq
        if kind != R.DEQUEUED:
            self.ack_due = True
        valid_at = self._valid_at
        if valid_at is not None and self.applied_seq >= valid_at:
            self._valid_at = None  # a consistent copy from here: our position is valid
            self.caught_up, self._catching_up = True, False

    def take_ack_due(self) -> bool:
        """Whether what was applied since the last call needs a prompt acknowledgement.

        Only replicated dequeues (a consumer's acks) need none: nothing on the
        primary waits for them -- a confirm, commit or reply waits for an event
        of its own, and acknowledging that covers the dequeues before it. A
        backup may then acknowledge them later (``ha.core.DEQUEUE_ACK_DELAY``), so
        their store writes need no disk sync of their own.
        """
        due, self.ack_due = self.ack_due, False
        return due

    def _apply(self, seq: int, event: Any) -> None:
        """One event (a ``cluster.replication`` record) at ``seq``."""
        kind = event.kind
        if kind == R.ENQUEUED:
            self._replicator(event.vhost, event.queue).enqueue(*event[3:])
        elif kind == R.DEQUEUED:
            self._replicator(event.vhost, event.queue).dequeue(event.positions)
        elif kind == R.PURGED:
            self._purge(event.vhost, event.queue, event.below)
        elif kind == R.PURGED_RANGES:
            self._purge_ranges(event.vhost, event.queue, event.ranges)
        elif kind in R.TX_EVENTS:
            self.transactions.apply(event)
        elif kind in R.TXLOG_EVENTS:
            if self.txlog is None:  # its acks would count for a quorum it does not hold
                raise ConfigurationMismatch(
                    f"the primary replicates its datacenter's TxLog but node {self.me} has no "
                    "[txlog] section: every member of an HA datacenter needs the same [txlog]")
            self.txlog.apply(event)
        elif kind in self.layers:
            self.layers[kind].apply(event)
        elif kind in CONFIGURATION_EVENTS:
            self.config.apply(event)
        elif kind == R.ACK_PROMPTLY:
            pass  # applying it is what sets ack_due
        elif kind == R.REJOIN:
            if event.node == self.me:  # another backup's changes nothing here
                raise _Rejoin
        elif kind == R.CATCH_UP_BEGINS:
            if event.session != self.session or self.caught_up:
                raise ReplicationError(f"catch-up of session {event.session} not expected")
            self.config.snapshot_begins()
            self.transactions.catch_up_begins()
        elif kind == R.SNAPSHOT_DONE:
            self.config.snapshot_done()
        elif kind == R.CAUGHT_UP:
            if event.seq < seq:
                raise ReplicationError(f"CaughtUp marker for {event.seq} at seq {seq}")
            self.transactions.caught_up()
            self._valid_at = event.valid_at  # caught up once applied that far (receive)
        else:
            raise ReplicationError(f"unknown event {kind!r}")

    def _replicator(self, vhost_name: str, name: str) -> QueueReplicator:
        vhost = self.broker.vhosts.get(vhost_name)
        q = vhost.queues.get(name) if vhost is not None else None
        if q is None:
            raise ReplicationError(f"event on unknown queue '{name}' in vhost '{vhost_name}'")
        key = (vhost_name, name)
        replicator = self._queues.get(key)
        if replicator is None or replicator.queue is not q:
            replicator = self._queues[key] = QueueReplicator(q, self.broker.clock)
        return replicator

    def _purge(self, vhost: str, name: str, below: int) -> None:
        """A ``pg``: the copy is empty at once, as the primary's queue was (``Queue.begin_purge``:
        the store records one purge), its entries let go of in the broker's background
        slices. Every entry of the copy must be below ``below`` (the primary had nothing
        else on the queue): a copy numbered at or above it is not the primary's, and
        emptying it would drop what the primary kept -- it joins again instead."""
        q = self._replicator(vhost, name).queue
        if q.next_position > below:
            raise ReplicationError(f"purge below {below} of '{name}' in vhost '{vhost}', "
                                   f"whose copy is numbered up to {q.next_position - 1}")
        drain = q.begin_purge()
        if drain.count:
            self.broker.background.run(drain)

    def _purge_ranges(self, vhost: str, name: str, ranges: list[Any]) -> None:
        """A ``pr``: the entries at ``ranges``' positions leave the copy at once, the
        others (acquired on the primary, or enqueued since) stay; the store records one
        purge, the entries are let go of in slices (``Queue.begin_purge_ranges``). A copy
        without an entry at each purged position is not the primary's: it joins again."""
        q = self._replicator(vhost, name).queue
        try:
            drain = q.begin_purge_ranges([(int(lo), int(hi)) for lo, hi in ranges])
        except ValueError as exc:
            raise ReplicationError(f"purge of '{name}' in vhost '{vhost}': {exc}") from None
        if drain.count:
            self.broker.background.run(drain)

    def _queue_gone(self, q: Queue) -> None:
        self._queues.pop((q.vhost, q.name), None)


class _Rejoin(Exception):  # noqa: N818 - not an error: the primary's ``rj`` naming this node
    pass


def _unfinished(steps: Iterator[None]) -> bool:
    """Run the first slice of ``steps``: True if more are left."""
    for _ in steps:
        return True
    return False


def _enqueue_run(events: list[Any], start: int) -> int:
    """How many events from ``start`` on are enqueues on the queue of the first."""
    first = events[start]
    vhost, queue = first.vhost, first.queue
    end = start + 1
    count = len(events)
    while end < count:
        e = events[end]
        if e.kind != R.ENQUEUED or e.queue != queue or e.vhost != vhost:
            break
        end += 1
    return end - start
