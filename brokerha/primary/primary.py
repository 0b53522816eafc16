"""Primary: what the primary node tells its backups, and when a confirm may go.

Sans-I/O. It observes the primary's broker (configuration and queue events),
numbers every replicated event with the next ``seq`` and queues it for every
joined backup; the node takes each backup's packets with ``take_outbox`` and
feeds back ``backup_joined`` / ``backup_acked`` / ``backup_lost`` / ``tick``.
As a replication barrier of ``Broker.after_durable`` it holds a confirm until
``replicated()`` (``cluster.quorum.replicated_seq`` over the joined backups)
reaches the seq of everything done before it.

Positions are the replication ids, so no two primaries may give one id to two
messages: a primary of ``epoch`` numbers new entries from ``epoch << 40`` up
(at least; above every id it holds), so what a deposed primary enqueued
without replicating can never be mistaken, on its return, for something else.

A changed ``ha-replicate`` (a policy set or cleared) applies to the existing
queues at once (``replicate_changed``): a queue no longer replicated whole is
dropped from the backups (deleted there, or emptied); a queue now replicated
whole is declared there and its messages reach each backup in a new join's
catch-up, the backups asked to join again (``rj``) one at a time. The change is
*applied* (``status()["replicate_changes"]``) once every backup in session
joined since it and caught up, and a majority holds an event emitted after that.

Transactions (``tx_observer``, ``tx_queue``, ``tx_tracker``): every TX and DTX
gets a tx-queue in this log; while the local commit runs (``tx_capture``) the
queue events it triggers are collected into the one ``tc`` event instead of
being sent as ``e``/``d`` events (the skip set), so a backup applies a
transaction whole.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from brokerha.backup.timers import resume_scope_timers, resume_timers
from brokerha.broker.arguments import REPLICATE_ALL, REPLICATE_CONFIGURATION, REPLICATE_NONE
from brokerha.broker.broker import Broker
from brokerha.broker.definitions import OPERATOR_POLICY, POLICY, DefinitionChange
from brokerha.broker.exchange import Binding, Exchange
from brokerha.broker.message import Entry
from brokerha.broker.observers import ConfigurationObserver, QueueObserver
from brokerha.broker.placement import GroupScope
from brokerha.broker.policy_effects import PolicyEffects
from brokerha.broker.queue import Queue
from brokerha.broker.tx_outcomes import group_of
from brokerha.cluster import replication as R
from brokerha.cluster.quorum import majority, replicated_seq
from brokerha.cluster.ranges import RangeSet
from brokerha.cluster.replication import Events, Join, ReplicationError
from brokerha.primary import events as ev
from brokerha.primary.catch_up import CATCH_UP_SPAN, CatchUp, Pace
from brokerha.primary.events import Event
from brokerha.primary.policy import ReplicationPolicy, check_default, decided_by, queue_policy
from brokerha.primary.queue_guard import QueueGuard
from brokerha.primary.remote_backup import EVENTS_PER_PACKET, FLUSH_BYTES, RemoteBackup
from brokerha.primary.replicating_subscription import ReplicatingSubscription, queue_entries
from brokerha.primary.snapshot import configuration
from brokerha.primary.tx_observer import PrimaryTxObserverFactory
from brokerha.primary.tx_queue import TxQueue, TxReplicatingSubscription, ack_votes
from brokerha.primary.tx_tracker import trackers_for

log = logging.getLogger(__name__)

POSITION_EPOCH_SHIFT = 40
OUTCOMES_PER_EVENT = 4096
DEFAULT_TX_PREPARE_TIMEOUT = 5.0
DEFAULT_BACKUP_UNHEARD_TIMEOUT = 0.5
# publishers are held (broker/flow.py) while a backup holding a copy has not
# acknowledged, for this long, live events sent to it: a quarter of the shipped
# lease, so that heartbeats queued behind replication still arrive in time
DEFAULT_FLOW_LAG = 0.1
FLOW = "replication"
#: ``Primary._policies``' mark of a queue of another replication group (a partitioned node's:
#: broker/placement.py), answered ``REPLICATE_NONE`` without asking the scope again
OTHER_GROUP = "other-group"
CHANGES_SHOWN = 20  # queues listed in status()["replicate_changes"]
# a ``pr`` only while a backup's copy holds at most this many entries outside the purge's
# last range, which it scans in one step (``ReadyList.take_ranges``; ~10 ms at this size)
PURGE_RANGES_SCAN = 65_536


@dataclass
class ReplicateChange:
    """One existing queue's ``ha-replicate`` changed (``Primary.replicate_changed``)."""

    vhost: str
    queue: str
    old: str
    new: str
    why: str    # what decides it now (a policy's name, the default...)
    gen: int    # the primary's count of changes at this one
    seq: int    # the seq of its first event, if any (the drop on the backups, a declaration)
    at: float   # when (the primary's clock)
    messages: int  # on the queue then

    def describe(self) -> str:
        return f"'{self.queue}' in vhost '{self.vhost}': {self.old} -> {self.new} ({self.why})"


class Primary(ConfigurationObserver, QueueObserver):
    is_ha_primary = True  # a Backup refuses a broker that still has one registered

    def __init__(self, broker: Broker, *, me: str, members: int, epoch: int, start_seq: int,
                 clock: Callable[[], float], backup_timeout: float,
                 replicate: str = REPLICATE_ALL,
                 policies: Sequence[ReplicationPolicy] = (),
                 on_output: Callable[[bool], None] | None = None,
                 tx_prepare_timeout: float = DEFAULT_TX_PREPARE_TIMEOUT,
                 events_per_packet: int = EVENTS_PER_PACKET,
                 backup_unheard_timeout: float = DEFAULT_BACKUP_UNHEARD_TIMEOUT,
                 pace: Pace | None = None, tx_trackers: bool = True,
                 flow_lag: float | None = DEFAULT_FLOW_LAG,
                 body_part_bytes: int = ev.BODY_PART_BYTES,
                 flush_bytes: int = FLUSH_BYTES,
                 runs_across_gaps: bool = False,
                 replicate_purges: bool = True,
                 scope: GroupScope | None = None) -> None:
        self.broker = broker
        # core.Unsafe.runs_across_gaps (simulations only): a catch-up's run of enqueues is
        # not cut where the queue's positions have a gap (replicating_subscription.py)
        self.runs_across_gaps = runs_across_gaps
        # core.Unsafe.local_purge (simulations only): ``purged`` sends the backups nothing
        self.replicate_purges = replicate_purges
        # a body over body_part_bytes goes in parts, at most flush_bytes of live events go
        # per flush (events.py, remote_backup.py; smaller in simulations: PrimarySettings)
        self.body_part_bytes, self.flush_bytes = body_part_bytes, flush_bytes
        # a partitioned node's replication group (broker/placement.py): only its queues (and,
        # for the metadata group, the configuration) are observed; None: the whole broker
        self.scope = scope
        # the flow hold is this group's own: another group's primary on the node releases its
        self.flow_name = FLOW if scope is None else f"{FLOW}:{scope.group}"
        self.flow_lag = flow_lag  # None: publishers never held for the backups' sake
        # False: core.Unsafe.no_tx_trackers (simulations only; a backup admitted while a
        # transaction it did not vote on is prepared is ready at once)
        self.tx_trackers = tx_trackers
        self.pace = pace or Pace()  # how a join's catch-up is streamed (catch_up.py)
        self.backup_unheard_timeout = backup_unheard_timeout
        self.events_per_packet = events_per_packet  # a replication packet's bound (and bytes)
        # called when events wait to be sent and none did before, with whether they
        # are only dequeues (``lazy``): the I/O layer schedules one flush
        # (take_outbox) per loop iteration from it, or a later one for dequeues
        self.on_output = on_output
        self.me = me
        self.members = members
        # a partition group's voters (partition/moves.py): only their acknowledgements count
        # for the majority, ``members`` is their number; None: every backup is a voter
        self.voters: frozenset[str] | None = None
        self.epoch = epoch
        self.seq = start_seq
        self.clock = clock
        self.backup_timeout = backup_timeout
        self.default_policy = check_default(replicate)
        self.policies = tuple(policies)
        self.sessions: dict[str, RemoteBackup] = {}
        self._tail: list[tuple[int, Event]] = []  # emitted, not yet in the outboxes
        self._tail_lazy = False  # the tail holds only dequeues: nobody waits for them
        self._waiters: deque[tuple[int, Callable[[], None]]] = deque()
        self._dequeue_seq = -1  # the seq of the last dequeue event (backups ack those late)
        self._policies: dict[Queue, str] = {}
        # ha-replicate changes of existing queues (replicate_changed): counted, the last one
        # that made a queue replicated whole, the count applied, each pending queue's change
        self._replicate_gen = 0
        self._rejoin_gen = 0
        self._replicate_done = 0
        self._replicate_marker = 0  # the count whose marker's barrier is waited for
        self._changes: dict[Queue, ReplicateChange] = {}
        self._drops_waiting: dict[Queue, str] = {}  # dropped on the backups after a transaction
        self._asked: tuple[str, RemoteBackup, float] | None = None  # asked to join again, when
        self.replicate_changes_applied = 0  # queues whose change was applied (status)
        self.rejoins_asked = 0
        self._last_applied: dict[str, Any] | None = None
        # entries delivered and not acknowledged, of every queue that may be replicated (one
        # that becomes replicated whole sends them in a catch-up too)
        self._acquired: dict[Queue, dict[int, Entry]] = {}
        self.tx_prepare_timeout = tx_prepare_timeout
        self.tx_queues: dict[str, TxQueue] = {}  # unfinished transactions, by txid
        # the seq of the last outcome of a prepared transaction (a timed-out backup is
        # guarded again only once it acknowledged it: it was not there to vote)
        self._prepared_outcome_seq = -1
        self._capture: tuple[TxQueue, list[Event]] | None = None  # a local commit running
        # other layers' state in a join's catch-up (the TxLog's, brokerha/txlog/bridge/replica.py):
        # each returns events that bring a backup to their state at this seq
        self.catch_up_providers: list[Callable[[], list[Event]]] = []
        self.closed = False
        self._take_over()
        # first, so a new queue's x-ha-id is set before the store records it
        broker.observers.configuration.insert(0, self)
        broker.observers.add_queue_observer(self)
        broker.replication_barriers.append(self.barrier)
        self.tx_factory = PrimaryTxObserverFactory(self)
        broker.observers.add_transaction_observer_factory(self.tx_factory)
        # an outcome record no tc or tr carries (a cross-partition tombstone) goes as a to
        broker.outcomes.listeners.append(self._outcome_replicated)
        # definitions changed here (the API, ctl, an import) go to the backups as they are
        # applied, after the broker acted on them (a deleted vhost's queues went first)
        self._unsubscribe_definitions: Callable[[], None] = (
            broker.definitions.subscribe(self._definition_changed)
            if self._configuration else _nothing)

    def _take_over(self) -> None:
        """Make the broker a primary's: own timers, epoch-unique ids, queue identities."""
        scope = self.scope
        if scope is None:
            resume_timers(self.broker, self.clock())
        else:
            resume_scope_timers(self.broker, scope, self.clock())
        floor = self.epoch << POSITION_EPOCH_SHIFT
        for vhost in self.broker.vhosts.values():
            for q in vhost.queues.values():
                if scope is not None and not scope.queues(q):
                    continue  # another group's (this node may follow its primary)
                q.next_position = max(q.next_position, floor)
                if self._policy(q) != REPLICATE_NONE and R.HA_ID not in q.arguments:
                    q.arguments[R.HA_ID] = f"{self.epoch}.{self.seq}.{q.name}"
                    self.broker.store.queue_declared(q)  # an upsert: the store keeps the id
        # entries held by prepared XA branches that survived the role change are still on
        # their queues: a join's catch-up sends them (found by the simulation)
        for branch in self.broker.dtx.branches.values():
            held = [*branch.accepts, *((q, e) for q, e, _ in branch.rejects)]
            for q, entry in held:
                if q.exclusive_owner is None:
                    self._acquired.setdefault(q, {})[entry.position] = entry

    def close(self) -> None:
        """Unregister from the broker; pending confirms are never released."""
        observers = self.broker.observers
        if self in observers.configuration:
            observers.configuration.remove(self)
        hooks = observers.queue_hooks
        for name in hooks.EVENTS:
            methods = getattr(hooks, name)
            methods[:] = [m for m in methods if getattr(m, "__self__", None) is not self]
        if self.barrier in self.broker.replication_barriers:
            self.broker.replication_barriers.remove(self.barrier)
        if self.tx_factory in observers.transactions:
            observers.transactions.remove(self.tx_factory)
        if self._outcome_replicated in self.broker.outcomes.listeners:
            self.broker.outcomes.listeners.remove(self._outcome_replicated)
        self._unsubscribe_definitions()
        self.closed = True
        self.broker.flow.release(self.flow_name)
        for txq in list(self.tx_queues.values()):
            txq.fail("the primary stopped")
        self.tx_queues.clear()
        self._waiters.clear()
        self.sessions.clear()
        self._tail.clear()
        self._tail_lazy = False

    # -- policy ------------------------------------------------------------------------

    @property
    def _configuration(self) -> bool:
        """Whether the definitions and exchanges are this group's (not a partition's)."""
        return self.scope is None or self.scope.configuration

    def _policy(self, q: Queue) -> str:
        policy = self._policies.get(q)
        if policy is None:
            policy = self._decide(q)
        return REPLICATE_NONE if policy is OTHER_GROUP else policy

    def _decide(self, q: Queue) -> str:
        """A queue seen for the first time: ``OTHER_GROUP`` if another group's (the scope
        asked once: a queue's group is fixed for its life, a re-declared queue is a new
        ``Queue``), else its policy; remembered until the queue is deleted."""
        scope = self.scope
        if scope is not None and not scope.queues(q):
            policy = OTHER_GROUP  # another group's queue: none of this log
        else:
            policy = queue_policy(q, self.default_policy, self.policies,
                                  PolicyEffects.of(self.broker))
        self._policies[q] = policy
        return policy

    def _replicated(self, q: Queue) -> bool:
        return self._policy(q) != REPLICATE_NONE

    def _messages_replicated(self, q: Queue) -> bool:
        return self._policy(q) == REPLICATE_ALL

    messages_replicated = _messages_replicated

    def replicate_mode(self, q: Queue) -> str:
        """``all`` | ``configuration`` | ``none``: what of ``q`` this primary replicates now."""
        return self._policy(q)

    # -- ha-replicate changed on existing queues -----------------------------------------

    def replicate_changed(self, vhost_name: str) -> None:
        """The policies of ``vhost_name`` changed: each queue whose ``ha-replicate`` did
        changes now, on a running cluster (docs/ha.md "Replication").

        - no longer replicated whole: the backups delete their copy (``qx``), and
          declare it again, empty, for ``configuration`` (``qd`` and its bindings):
          nothing on the primary changes. With a transaction open on the queue the
          drop waits for its outcome (the backups check its dequeues against their
          copy);
        - replicated from ``none``: declared on the backups (a new ``x-ha-id``: a new
          incarnation there) with its bindings;
        - replicated whole from now: its live events go to every backup at once (a
          publish after the change is confirmed by the usual rule), and what it held
          before reaches each backup in a join's catch-up: the backups in session
          are asked to join again, one at a time (``_advance_changes``).
        """
        vhost = self.broker.vhosts.get(vhost_name)
        if vhost is None or self.closed:
            return
        effects = PolicyEffects.of(self.broker)
        for q in list(vhost.queues.values()):
            old = self._policies.get(q)
            if old is None or old is OTHER_GROUP:
                continue  # never seen: decided when it is (its declaration); another group's
            new = queue_policy(q, self.default_policy, self.policies, effects)
            if new != old:
                self._change_mode(q, old, new, decided_by(q, self.default_policy, self.policies,
                                                          effects))
        self._advance_changes()

    def _change_mode(self, q: Queue, old: str, new: str, why: str) -> None:
        self._replicate_gen += 1
        gen = self._replicate_gen
        self._policies[q] = new
        first = self.seq + 1
        if new == REPLICATE_ALL:
            self._rejoin_gen = gen
            self._drops_waiting.pop(q, None)  # a join's catch-up makes the copies right
        if old == REPLICATE_ALL or q in self._drops_waiting:
            if new != REPLICATE_ALL:
                if self._tx_touches(q):
                    self._drops_waiting[q] = new
                else:
                    self._drops_waiting.pop(q, None)
                    self._drop_copies(q, new)
        elif old == REPLICATE_NONE:  # to configuration or all: the backups get the queue
            self._declare_on_backups(q, new_id=True)
        elif new == REPLICATE_NONE:  # from configuration
            self._emit(ev.queue_deleted(q))
        change = ReplicateChange(q.vhost, q.name, old, new, why, gen, first, self.clock(),
                                 q.message_count + len(self._acquired.get(q, ())))
        self._changes[q] = change
        if new == REPLICATE_ALL:
            log.info("queue '%s' in vhost '%s': ha-replicate %s -> %s (%s): its %d messages "
                     "reach the backups as they join again, one at a time; its new ones go "
                     "to them at once", q.name, q.vhost, old, new, why, change.messages)
        else:
            log.info("queue '%s' in vhost '%s': ha-replicate %s -> %s (%s): the backups %s",
                     q.name, q.vhost, old, new, why,
                     "drop their copy" if new == REPLICATE_NONE
                     else "hold its declaration and bindings" if old == REPLICATE_NONE
                     else "drop its messages")

    def _drop_copies(self, q: Queue, new: str) -> None:
        """The backups delete their copy; an empty one again for ``configuration``."""
        self._emit(ev.queue_deleted(q))
        if new == REPLICATE_CONFIGURATION and not q.deleted:
            self._declare_on_backups(q, new_id=False)

    def _declare_on_backups(self, q: Queue, new_id: bool) -> None:
        if new_id:
            q.arguments[R.HA_ID] = f"{self.epoch}.{self.seq + 1}"
            self.broker.store.queue_declared(q)  # an upsert: the store keeps the id
        self._emit(ev.queue_declared(q))
        vhost = self.broker.vhosts.get(q.vhost)
        for ex in list(vhost.exchanges.values()) if vhost is not None else []:
            for b in list(ex.bindings.values()):
                if b.destination is q:
                    self._emit(ev.binding(R.BINDING_CREATED, b))

    def _tx_touches(self, q: Queue) -> bool:
        """An open transaction sent events on ``q`` (its te/td)."""
        for txq in self.tx_queues.values():
            for event in txq.events:
                kind = event[0]
                if kind == R.TX_DEQUEUE and event.queue == q.name and event.vhost == q.vhost:
                    return True
                if kind == R.TX_ENQUEUE and event.vhost == q.vhost and q.name in event.queues:
                    return True
        return False

    @property
    def replicate_pending(self) -> bool:
        """An ha-replicate change of an existing queue is not applied yet."""
        return self._replicate_done < self._replicate_gen

    def replicate_change(self, q: Queue) -> ReplicateChange | None:
        """``q``'s change not applied yet, if any."""
        return self._changes.get(q)

    def lacking(self, q: Queue) -> list[str]:
        """The backups in session that have yet to join again to hold ``q``'s messages."""
        change = self._changes.get(q)
        if change is None or change.new != REPLICATE_ALL:
            return []
        return sorted(n for n, s in self.sessions.items() if s.replicate_gen < change.gen)

    def _advance_changes(self) -> None:
        """The next step of applying the changes: a backup asked to join again, or the
        marker whose replication says they are applied.

        A change is applied once every backup in session joined after the last change
        that made a queue replicated whole (its catch-up held the queue's messages) and
        caught up (one that timed out is not waited for), and a majority holds an event
        emitted after that (the marker, ``a``): any node that can be elected from then
        on holds that seq (``cluster/quorum.py``), so it was in such a session -- one
        that left before the marker was emitted never held it, and one that joined
        later had every queue in its own catch-up.
        """
        if self._replicate_done >= self._replicate_gen or self.closed:
            return
        for q, new in list(self._drops_waiting.items()):
            if not self._tx_touches(q):
                del self._drops_waiting[q]
                self._drop_copies(q, new)
        if self._drops_waiting:
            return
        stale = [n for n, s in self.sessions.items() if s.replicate_gen < self._rejoin_gen]
        if stale:
            self._ask_rejoin(stale)
            return
        if any(not s.holds_copy and not s.timed_out for s in self.sessions.values()):
            return  # applied when every backup holds it (one that timed out is not waited for)
        gen = self._replicate_gen
        if self._replicate_marker >= gen:
            return  # its marker is out: the barrier below says when it is replicated
        self._replicate_marker = gen
        self._emit(R.AckPromptly(R.ACK_PROMPTLY))
        marker = self.seq
        self.barrier(lambda: self._changes_applied(gen, marker))

    def _ask_rejoin(self, stale: list[str]) -> None:
        """Ask one stale backup to join again; the next once it holds a copy again.

        A backup that holds no copy now (catching up, timed out) first: confirms do
        not wait for it. A ready one leaves the guarded set while it catches up,
        so it goes only while the other ready backups keep a majority with the
        primary, or when waiting would not make more of them ready (nobody else
        catches up): then confirms wait for its catch-up. Never while a prepare it
        votes in is pending (leaving would be its no); it leaves the transactions
        not yet prepared, and joins them again when it is admitted (``_readmit``),
        as any joining backup.
        """
        now = self.clock()
        asked = self._asked
        if asked is not None:
            node, session, at = asked
            current = self.sessions.get(node)
            if current is session and now - at < self.backup_timeout:
                return  # its join is on its way
            if current is not None and current is not session and not current.holds_copy \
                    and not current.timed_out:
                return  # joined again: catching up
            if current is session:
                log.warning("backup %s has not joined again %.1fs after it was asked: asking "
                            "again", node, now - at)
            self._asked = None
        sessions = self.sessions
        node = min(stale, key=lambda n: (sessions[n].holds_copy, n))
        session = sessions[node]
        if any(txq.pending() and node in txq.members for txq in self.tx_queues.values()):
            return  # after the votes
        holding = sum(1 for s in sessions.values() if s.holds_copy)
        if session.holds_copy and holding < majority(self.members):
            if any(not s.holds_copy and not s.timed_out and not s.rejoining
                   for s in sessions.values()):
                return  # another backup catches up: it keeps the majority once ready
            log.warning("backup %s joins again while no other backup is ready: confirms wait "
                        "for its catch-up", node)
        self._emit(R.Rejoin(R.REJOIN, node))
        session.rejoining = True
        self.rejoins_asked += 1
        self._asked = (node, session, now)
        for txq in self.tx_queues.values():
            member = txq.members.get(node)
            if member is not None and member.session is session and not txq.closed:
                del txq.members[node]
        log.info("backup %s asked to join again: its catch-up brings the queues now "
                 "replicated whole (%s)", node,
                 ", ".join(c.describe() for c in list(self._changes.values())[:CHANGES_SHOWN]
                           if c.new == REPLICATE_ALL) or "-")
        self._release()
        self._check_flow(now)

    def _changes_applied(self, gen: int, marker: int) -> None:
        if self.closed or gen <= self._replicate_done:
            return
        self._replicate_done = gen
        done = [c for c in self._changes.values() if c.gen <= gen]
        self._changes = {q: c for q, c in self._changes.items() if c.gen > gen}
        self.replicate_changes_applied += len(done)
        now = self.clock()
        took = max((now - c.at for c in done), default=0.0)
        self._last_applied = {"queues": len(done), "seconds": round(took, 3),
                              "marker_seq": marker, "joins_asked": self.rejoins_asked}
        if done:
            log.info("ha-replicate change applied on every backup in %.1fs (%d queues%s): %s",
                     took, len(done),
                     f", {self.rejoins_asked} joins again so far" if self.rejoins_asked else "",
                     "; ".join(c.describe() for c in done[:CHANGES_SHOWN]))

    def replicate_status(self) -> dict[str, Any]:
        """``status()["replicate_changes"]``: what of the ha-replicate changes is applied."""
        asked = self._asked
        return {
            "pending": self.replicate_pending,
            "generation": self._replicate_gen,
            "applied_generation": self._replicate_done,
            "queues": [c.describe() for c in list(self._changes.values())[:CHANGES_SHOWN]],
            "queues_pending": len(self._changes),
            "backups_to_join_again": sorted(n for n, s in self.sessions.items()
                                            if s.replicate_gen < self._rejoin_gen),
            "joining_again": asked[0] if asked is not None else None,
            "applied_queues": self.replicate_changes_applied,
            "joins_asked": self.rejoins_asked,
            "last_applied": self._last_applied,
        }

    # -- the log -----------------------------------------------------------------------

    def _emit(self, event: Event, lazy: bool = False) -> None:
        """Append ``event`` to the log; ``lazy``: nobody waits for it (a consumer's dequeue).

        A tail of lazy events only may wait (``take_outbox(hold_lazy=True)``):
        dequeues sent together join into fewer events, packets and writes.
        """
        self.seq += 1
        if self.sessions:
            tail = self._tail
            if self.on_output is not None and (not tail or (self._tail_lazy and not lazy)):
                self.on_output(lazy)
            self._tail_lazy = lazy and (not tail or self._tail_lazy)
            tail.append((self.seq, event))

    def emit(self, event: Event) -> int:
        """Another layer's event in this log (the TxLog's ``l*``); returns its seq.

        It is ordered with the broker's events, acknowledged with them and
        confirmed by the same rule: ``barrier`` after it waits for it.
        """
        self._emit(event)
        return self.seq

    def _flush_tail(self) -> None:
        if not self._tail:
            return
        for session in self.sessions.values():
            session.outbox.extend(self._tail)
        self._tail = []
        self._tail_lazy = False

    # -- configuration observer ----------------------------------------------------------

    def _definition_changed(self, change: DefinitionChange) -> None:
        self._emit(ev.definition_changed(change))
        if change.kind in (POLICY, OPERATOR_POLICY):  # the broker's PolicyEffects acted first
            self.replicate_changed(change.key[0])

    def exchange_declared(self, exchange: Exchange) -> None:
        if self._configuration:
            self._emit(ev.exchange_declared(exchange))

    def exchange_deleted(self, exchange: Exchange) -> None:
        if self._configuration:
            self._emit(ev.exchange_deleted(exchange))

    def queue_declared(self, queue: Queue) -> None:
        if not self._replicated(queue):
            return
        queue.arguments[R.HA_ID] = f"{self.epoch}.{self.seq + 1}"
        self._emit(ev.queue_declared(queue))

    def queue_deleted(self, queue: Queue) -> None:
        replicated = self._replicated(queue)
        self._policies.pop(queue, None)
        self._acquired.pop(queue, None)
        self._changes.pop(queue, None)
        if self._drops_waiting.pop(queue, None) is not None:
            replicated = True  # the backups still hold it
        if replicated:
            self._emit(ev.queue_deleted(queue))

    def binding_created(self, binding: Binding) -> None:
        if self._binding_replicated(binding):
            self._emit(ev.binding(R.BINDING_CREATED, binding))

    def binding_deleted(self, binding: Binding) -> None:
        if self._binding_replicated(binding):
            self._emit(ev.binding(R.BINDING_DELETED, binding))

    def _binding_replicated(self, binding: Binding) -> bool:
        dest = binding.destination
        return self._configuration if isinstance(dest, Exchange) else self._replicated(dest)

    # -- queue observer ------------------------------------------------------------------

    def enqueued(self, queue: Queue, entry: Entry) -> None:
        # ``_messages_replicated`` inlined: every group's primary on a node sees every event
        if (self._policies.get(queue) or self._decide(queue)) == REPLICATE_ALL:
            now = self.clock() if entry.expires_at is not None else 0.0
            if self._capture is not None:
                self._capture_enqueue(queue, entry, now)
                return
            event = ev.enqueued(queue, entry, now)
            if len(event.body) > self.body_part_bytes:
                self._emit_in_parts(event)
            else:
                self._emit(event)

    def enqueued_many(self, queue: Queue, entries: list[Entry]) -> None:
        """A transaction's batch (``Queue.enqueue_many``): one policy check, one clock read."""
        if not self._messages_replicated(queue):
            return
        now = self.clock()
        if self._capture is not None:
            self._capture_many(queue, entries, now)
            return
        for entry in entries:
            event = ev.enqueued(queue, entry, now if entry.expires_at is not None else 0.0)
            if len(event.body) > self.body_part_bytes:
                self._emit_in_parts(event)
            else:
                self._emit(event)

    def _emit_in_parts(self, event: Event) -> None:
        """A large message's ``e`` (or ``te``): its body's ``bp`` parts, then itself
        (consecutive seqs)."""
        for part in ev.in_parts(event, self.body_part_bytes):
            self._emit(part)

    def acquired(self, queue: Queue, entry: Entry) -> None:
        # the others may become replicated whole; another group's are not this log's
        if queue.exclusive_owner is None and (
                self.scope is None
                or (self._policies.get(queue) or self._decide(queue)) is not OTHER_GROUP):
            self._acquired.setdefault(queue, {})[entry.position] = entry

    def acquired_entries(self, queue: Queue) -> list[Entry]:
        """``queue``'s entries delivered and not acknowledged: on its backups' copies they are
        ready (a replica check, ``ha/check.py``, counts them as the backups do)."""
        return list(self._acquired.get(queue, {}).values())

    def requeued(self, queue: Queue, entry: Entry) -> None:
        held = self._acquired.get(queue)
        if held:
            held.pop(entry.position, None)

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        held = self._acquired.get(queue)
        if held:
            held.pop(entry.position, None)
        if queue.deleted or (self._policies.get(queue) or self._decide(queue)) != REPLICATE_ALL:
            return  # a deleted queue goes as a whole; ``_messages_replicated`` inlined
        if self._capture is not None:
            ops = self._capture[1]
            if not (ops and ev.join_dequeue(ops[-1], queue, entry.position)):
                ops.append(ev.dequeued(queue, [entry.position]))
            return
        tail = self._tail
        # joined to the last event if that is a dequeue on this queue not sent yet (one seq)
        if not (tail and tail[-1][0] == self.seq
                and ev.join_dequeue(tail[-1][1], queue, entry.position)):
            self._emit_dequeue(ev.dequeued(queue, [entry.position]))

    def _emit_dequeue(self, event: Event) -> None:
        """A ``d`` event: nobody waits for it (``barrier`` adds an ``a`` when one does)."""
        self._emit(event, lazy=True)
        self._dequeue_seq = self.seq

    def purged(self, queue: Queue, ranges: list[tuple[int, int]]) -> None:
        """A purge's entries in one call (``broker/drain.py``), instead of a ``dequeued`` each.

        When they are every position below the queue's next and nothing is left on
        the queue (no acquired entry), each backup's copy holds purged entries only,
        all below that position: one ``pg`` event, which a backup applies as the
        primary did (its whole copy off at once, the entries let go of in slices).
        Issue 33: as ``d`` events, a purge of 1,000,000 was 1,000,000 dequeues
        applied one by one on each backup, ~2.2 s of CPU each beside the primary's
        own on this 2-core machine, its loop waiting for a core. A purge made while
        entries were acquired (a consumer's unacknowledged deliveries: the ranges
        leave their positions out) goes as one ``pr`` when a backup can take it at
        little cost (``_backup_can_take``). Otherwise ``d`` events of the ranges'
        positions, ``DEQUEUES_PER_EVENT`` each.
        """
        if (queue.deleted or not self.replicate_purges
                or (self._policies.get(queue) or self._decide(queue)) != REPLICATE_ALL):
            return
        below = queue.next_position
        if self._capture is None:
            if queue.unacked == 0 and not len(queue.ready) and ranges == [(0, below - 1)]:
                self._emit(R.Purged(R.PURGED, queue.vhost, queue.name, below))
                return
            if _backup_can_take(queue, ranges):
                self._emit(R.PurgedRanges(R.PURGED_RANGES, queue.vhost, queue.name,
                                          [list(r) for r in ranges]))
                return
        step = ev.DEQUEUES_PER_EVENT
        for first, last in ranges:
            for start in range(first, last + 1, step):
                event = ev.dequeued(queue, list(range(start, min(start + step, last + 1))))
                if self._capture is not None:
                    self._capture[1].append(event)
                else:
                    self._emit_dequeue(event)

    # -- transactions (tx_observer.py calls these) -----------------------------------------

    def tx_begin(self, name: str, xid: str | None) -> TxQueue:
        """Create a tx-queue: the backups joined now are in the transaction.

        A backup not guarded now (catching up, or timed out) is not: like a
        confirm, the transaction does not wait for it; it joins the open
        transactions once it is guarded (``_readmit``).
        """
        txq = TxQueue(name, xid)
        self._emit(txq.begin_event())
        txq.begin_seq = self.seq
        txq.members = {n: TxReplicatingSubscription(n, s) for n, s in self.sessions.items()
                       if s.guarded}
        self.tx_queues[name] = txq
        return txq

    def tx_event(self, txq: TxQueue, event: Event) -> None:
        txq.events.append(event)
        if event[0] == R.TX_ENQUEUE and len(event.body) > self.body_part_bytes:
            # its body's parts first, as an ``e``'s (the te keeps its index: parts are no te;
            # its queue list is the same list object, so a queue added to it still counts)
            self._emit_in_parts(event)
        else:
            self._emit(event)

    def tx_close(self, txq: TxQueue) -> None:
        """Send the prepare: from here a joining backup is not in the transaction."""
        self._emit(txq.prepare_event())
        txq.prepare_seq = self.seq

    def tx_prepare(self, txq: TxQueue, on_prepared: Callable[[bool], None]) -> None:
        """Close the tx-queue and collect the votes; ``on_prepared(ok)`` completes it."""
        self.tx_close(txq)
        txq.on_prepared = on_prepared
        txq.deadline = self.clock() + self.tx_prepare_timeout
        for node, member in txq.members.items():
            session = self.sessions.get(node)
            if session is not member.session:
                member.vote, member.reason = False, "left before the prepare"
            elif not session.guarded:
                member.vote, member.reason = False, "timed out"
        txq.settle_votes()
        if self.closed:
            txq.fail("the primary stopped")

    def tx_vote(self, node: str, txid: str, ok: bool, reason: str) -> None:
        """An explicit vote (a no: the backup could not prepare)."""
        txq = self.tx_queues.get(txid)
        if txq is not None:
            log.warning("backup %s refuses to prepare %s: %s", node, txid, reason)
            txq.vote(node, ok, reason)

    def tx_capture(self, txq: TxQueue) -> None:
        """The local commit starts: its queue events go into the commit event."""
        self._capture = (txq, [])

    def _capture_enqueue(self, queue: Queue, entry: Entry, now: float) -> None:
        assert self._capture is not None
        txq, ops = self._capture
        index = txq.message_index.get(entry.message.msg_id)
        if index is None:  # content the tx-queue does not hold (a dead letter)
            ops.append(ev.enqueued(queue, entry, now))
            return
        expires_in = None
        if entry.expires_at is not None:
            expires_in = max(0, int((entry.expires_at - now) * 1000))
        ops.append(R.OpRef(R.OP_REF, queue.vhost, queue.name, entry.position, index, expires_in))

    def _capture_many(self, queue: Queue, entries: list[Entry], now: float) -> None:
        """``_capture_enqueue`` for a batch: runs of te content without expiry as one op.

        A TX past ``TC_CONTENT_BYTES`` sent its messages as te events in order,
        so its batch for a queue is one run: one ``OpRefs`` instead of 100,000
        ``OpRef`` (made, sent, decoded and applied one by one on each backup).
        """
        assert self._capture is not None
        txq, ops = self._capture
        for op in ev.te_runs(queue, entries, txq.message_index):
            if isinstance(op, Entry):
                self._capture_enqueue(queue, op, now)
            else:
                ops.append(op)

    def tx_commit(self, txq: TxQueue) -> None:
        """After the local commit: everything it did, as one event."""
        ops: list[Event] = []
        if self._capture is not None and self._capture[0] is txq:
            ops = self._capture[1]
        self._capture = None
        self._emit(R.TxCommit(R.TX_COMMIT, txq.name, txq.client_id, ops))
        self._tx_finished(txq)

    def tx_rollback(self, txq: TxQueue) -> None:
        self._emit(R.TxRollback(R.TX_ROLLBACK, txq.name, txq.client_id))
        self._tx_finished(txq)

    def _tx_finished(self, txq: TxQueue) -> None:
        """The outcome is in the log: the tx-queue is gone, its trackers clear on the ack."""
        self.tx_queues.pop(txq.name, None)
        if self._drops_waiting:
            self._advance_changes()
        if txq.closed:
            self._prepared_outcome_seq = self.seq
        txq.on_prepared = None
        for session in self.sessions.values():
            for tracker in session.tx_trackers:
                if tracker.txid == txq.name:
                    tracker.clear_seq = self.seq

    def _tx_session_ended(self, node: str, session: RemoteBackup, reason: str) -> None:
        for txq in list(self.tx_queues.values()):
            member = txq.members.get(node)
            if member is not None and member.session is session:
                txq.vote(node, False, reason)

    # -- backups -------------------------------------------------------------------------

    def backup_joined(self, join: Join) -> None:
        """Answer a join: configuration, per-queue catch-up, the CaughtUp marker.

        The answer is the state at ``self.seq`` (the join's seq): the
        configuration, the transactions and other layers' state are taken now
        (small); each queue's messages are made as they are sent, below the
        queue's position now (``catch_up.py``: what changes on a queue after
        the join goes out live behind the catch-up, and converges with it).
        The backup is admitted to the guarded set once it caught up
        (``_readmit``): it joins the open transactions then.
        """
        if join.epoch != self.epoch:
            raise ReplicationError(f"join of epoch {join.epoch}; this primary is of {self.epoch}")
        self._flush_tail()  # those events are in the snapshot: not for the newcomer
        old = self.sessions.pop(join.node, None)
        if old is not None:
            log.info("backup %s joins again: its previous session ends", join.node)
            self._tx_session_ended(join.node, old, "joined again")
        now = self.clock()
        held = {(v, q): (ha_id, ranges) for v, q, ha_id, ranges in join.inventory}
        head: list[Event] = [R.CatchUpBegins(R.CATCH_UP_BEGINS, join.session)]
        head.extend(configuration(self.broker, self._replicated, self._configuration))
        head.append(R.SnapshotDone(R.SNAPSHOT_DONE))
        join_seq = self.seq
        guards: list[QueueGuard] = []
        queues: list[tuple[QueueGuard, Iterable[Event | None]]] = []
        subscriptions = []
        for vhost in self.broker.vhosts.values():
            for q in vhost.queues.values():
                if not self._replicated(q):
                    continue
                guard = QueueGuard(q.vhost, q.name, q.next_position, join_seq)
                guards.append(guard)
                if not self._messages_replicated(q):
                    guard.ready_seq = join_seq - CATCH_UP_SPAN  # nothing to send: the first
                    continue
                ha_id, ranges = held.get((q.vhost, q.name), (None, []))
                if ha_id != q.arguments.get(R.HA_ID):
                    ranges = []  # another incarnation: the backup replaces it, empty
                pace = self.pace
                sub = ReplicatingSubscription(q, RangeSet(ranges), pace.run_min, pace.run_max,
                                              pace.run_bytes, self.runs_across_gaps,
                                              self.body_part_bytes)
                subscriptions.append(sub)
                queues.append((guard, self._queue_catch_up(sub, q.next_position)))
        tail = self._outcome_events()
        for txq in self.tx_queues.values():
            for event in txq.replay():  # a large te in parts, as it went live
                tail.extend(ev.in_parts(event, self.body_part_bytes)
                            if event[0] == R.TX_ENQUEUE else [event])
        for provider in self.catch_up_providers:
            tail.extend(provider())
        catch_up = CatchUp(join_seq, head, queues, tail, lambda: self.seq)
        session = RemoteBackup(join.node, catch_up, now, self.events_per_packet, self.pace,
                               self.flush_bytes)
        session.subscriptions = subscriptions
        session.guards = guards
        session.replicate_gen = self._replicate_gen  # its catch-up holds every change so far
        self.sessions[join.node] = session
        log.info("backup %s joined at seq %d: streaming its catch-up (%d queues, %d messages "
                 "on them)", join.node, join_seq, len(guards),
                 sum(s.queue.message_count for s in subscriptions))
        if self.on_output is not None:
            self.on_output(False)
        if self._replicate_done < self._replicate_gen:
            self._advance_changes()

    def _queue_catch_up(self, sub: ReplicatingSubscription,
                        below: int) -> Iterator[Event | None]:
        """The queue's catch-up events, from the queue as it is when its turn comes."""
        q = sub.queue
        if q.deleted or not self._messages_replicated(q):
            return  # the live delete follows (of the queue, or of its copy: replicate_changed)
        acquired = list(self._acquired.get(q, {}).values())
        entries = queue_entries(q, acquired, below)
        yield from sub.events(entries, self.clock, self.broker.store.read_bodies)

    def _outcome_replicated(self, record: tuple[str, str | None, str, float]) -> None:
        """``TxOutcomes.replicate``: a record of this group's goes to the backups as a ``to``."""
        if self.scope is None or group_of(record[0]) == self.scope.group:
            self._emit(R.TxOutcomes(R.TX_OUTCOMES, [list(record)]))

    def _outcome_events(self) -> list[Event]:
        """The outcomes in a join's catch-up: this group's (every one without a scope)."""
        group = None if self.scope is None else self.scope.group
        records = [list(r) for r in self.broker.outcomes.snapshot(group)]
        if not records:
            return [R.TxOutcomes(R.TX_OUTCOMES, [])]
        return [R.TxOutcomes(R.TX_OUTCOMES, records[i:i + OUTCOMES_PER_EVENT])
                for i in range(0, len(records), OUTCOMES_PER_EVENT)]

    def backup_acked(self, node: str, seq: int) -> None:
        session = self.sessions.get(node)
        if session is None:
            return
        was_caught_up = session.caught_up
        if not session.ack(seq, self.clock()):
            return
        if session.caught_up and not was_caught_up:
            log.info("backup %s caught up at seq %d%s", node, session.join_seq,
                     f" (blocked by {len(session.tx_trackers)} TxTrackers)"
                     if session.tx_trackers else ": ready")
        if self.tx_queues:
            ack_votes(self.tx_queues, node, session, seq)
        if not session.guarded:
            self._readmit(node, session)
        self._release()
        if self._replicate_done < self._replicate_gen:
            self._advance_changes()
        if session.wants_catch_up_slice and self.on_output is not None:
            self.on_output(False)  # its window opened: the next slice
        self._check_flow(self.clock())

    def _readmit(self, node: str, session: RemoteBackup) -> None:
        """A backup that caught up (after its join, or after it timed out) is guarded.

        A joined backup is admitted once it acknowledged its catch-up's marker
        and what was confirmed meanwhile; until then confirms do not wait for
        it, so a long catch-up holds nobody's confirms. A timed-out backup
        stayed in the session: it got every event in order and its
        acknowledgements still counted for the majority. Once it caught up,
        holds everything that may have been confirmed (``replicated()``) and the
        outcome of every prepared transaction decided since (it did not vote on
        them), it is a copy like any other backup, and confirms wait for it again.
        Its link may never close (a stall shorter than the link's idle timeout),
        so waiting for it to join again could leave it out for good. The
        transactions it missed are handled as at a join: it joins the open ones,
        and TxTrackers hold its readiness for the prepared ones it did not vote on.
        """
        if session.rejoining or not (
                session.caught_up and session.progress >= self._prepared_outcome_seq
                and session.progress >= self.replicated()):
            return  # (asked to join again: out until its new session is admitted)
        again = session.admitted
        session.admitted, session.timed_out = True, False
        for txq in self.tx_queues.values():
            member = txq.members.get(node)
            voting = member is not None and member.session is session and member.vote is not False
            if voting:
                continue
            if txq.closed:  # prepared without its vote: blocked until the outcome reached it
                if self.tx_trackers:
                    session.tx_trackers.extend(trackers_for(txq.name, txq.events))
            else:  # it has the tx-queue so far (it got every event): in the transaction
                txq.members[node] = TxReplicatingSubscription(node, session)
        log.info("backup %s caught up%s (acknowledged seq %d): it is guarded%s, confirms "
                 "wait for it", node, " again" if again else "", session.progress,
                 " again" if again else "")

    def backup_lost(self, node: str, reason: str) -> None:
        session = self.sessions.pop(node, None)
        if session is not None:
            self._tx_session_ended(node, session, reason)
            log.warning("backup %s lost (%s): confirms no longer wait for it", node, reason)
            self._release()
            self._check_flow(self.clock())
            if self._replicate_done < self._replicate_gen:
                self._advance_changes()

    def backup_heard(self, node: str, now: float) -> None:
        """A packet of any kind came from ``node`` (its heartbeat acks flow every tick)."""
        session = self.sessions.get(node)
        if session is not None:
            session.heard_at = now

    def tick(self, now: float) -> None:
        """Drop from the guarded set a backup that owes an acknowledgement for too long.

        Too long is ``backup_timeout`` for a backup that is heard but slow (a big
        catch-up to apply), and ``backup_unheard_timeout`` for one that owes an
        acknowledgement and sent nothing at all for that long while another backup
        was heard meanwhile: its link stalls (a cut that drops packets), and
        confirms would wait for it. When no backup is heard the primary's own loop
        stalled, or it is cut off itself: its lease decides, not this. A timed-out
        backup is guarded again when it has caught up (``_readmit``).
        """
        changed = False
        limit = self.backup_unheard_timeout
        heard = [s for s in self.sessions.values() if s.guarded and now - s.heard_at <= limit / 2]
        for node, session in self.sessions.items():
            if not session.guarded:
                continue
            silent = session.silent_for(now)
            unheard = now - session.heard_at
            cut = (silent > 0 and unheard > limit
                   and any(other is not session for other in heard))
            if silent > self.backup_timeout or cut:
                session.timed_out = True
                changed = True
                if cut:
                    log.warning("backup %s unheard for %.1fs while another backup is heard "
                                "(backup_unheard_timeout %.1fs): it leaves the guarded set "
                                "until it joins again", node, unheard, limit)
                else:
                    log.warning("backup %s silent for %.1fs (backup_timeout %.1fs): it leaves "
                                "the guarded set until it joins again", node, silent,
                                self.backup_timeout)
                self._tx_session_ended(node, session, "timed out")
        for txq in list(self.tx_queues.values()):
            if txq.deadline is not None and now >= txq.deadline:
                log.warning("prepare of %s timed out after %.1fs", txq.name,
                            self.tx_prepare_timeout)
                txq.fail(f"no vote within tx_prepare_timeout {self.tx_prepare_timeout}s")
        if changed:
            self._release()
        self._check_flow(now)
        if self._replicate_done < self._replicate_gen:
            self._advance_changes()

    def _check_flow(self, now: float) -> None:
        """Hold publishers while a backup holding a copy lags by more than ``flow_lag``.

        Back-pressure (``broker/flow.py``), as RabbitMQ's credit flow: a backup
        applies what a publisher without confirms sends at most as fast as the
        primary takes it; without a bound the replication link fills up, and
        the heartbeats behind it (and the confirms waiting for it) come later
        and later, until the lease runs out. Released at half the lag. While held,
        the hold is renewed with the backup lagging most (the flow's cause: metrics,
        and the WARNING of a hold that lasts).
        """
        limit = self.flow_lag
        if limit is None:
            return
        lag, node = max(((s.ack_lag(now), n) for n, s in self.sessions.items() if s.holds_copy),
                        default=(0.0, ""))
        flow, name = self.broker.flow, self.flow_name
        held = name in flow.holds
        if held and lag <= limit / 2:
            flow.release(name)
        elif held or lag > limit:
            flow.hold(name, f"backup {node} has not acknowledged for {lag:.2f}s (flow_lag "
                      f"{limit}s)", cause=node)

    def take_outbox(self, node: str, hold_lazy: bool = False) -> list[Events]:
        """The packets for ``node``; ``hold_lazy``: a tail of dequeues only stays for later."""
        return self.take_outboxes(hold_lazy, [node]).get(node, [])

    def take_outboxes(self, hold_lazy: bool = False,
                      nodes: Iterable[str] | None = None) -> dict[str, list[Events]]:
        """The packets for every backup (or ``nodes``), those with any.

        Backups that are up to date get the same packets, the very same
        ``Events`` objects, so the link packs each once for all of them
        (``Events.ENCODE_ONCE``); nothing of it is kept here once taken.
        """
        if not (hold_lazy and self._tail_lazy):
            self._flush_tail()
        now = self.clock()
        shared: dict[tuple[int, int, int, int], Events] = {}
        out: dict[str, list[Events]] = {}
        more = False
        for node in list(self.sessions) if nodes is None else nodes:
            session = self.sessions.get(node)
            if session is not None:
                packets = session.take_outbox(self.epoch, now, shared)
                if packets:
                    out[node] = packets
                if session.wants_catch_up_slice or session.more_to_send:
                    more = True
        if more and self.on_output is not None:
            # the next slice of a catch-up, or live events past FLUSH_BYTES: the next turn
            self.on_output(False)
        if out:
            self._check_flow(now)
        return out

    def ready_backups(self) -> list[str]:
        return sorted(n for n, s in self.sessions.items() if s.ready)

    # -- the confirm barrier -------------------------------------------------------------

    def replicated(self) -> int:
        """The highest seq replicated by the quorum rule (``cluster/quorum.py``).

        A backup still catching up holds no consistent copy, so it does not count
        for the majority, and nothing waits for it: it is guarded once admitted
        (``_readmit``), holding everything that may have been confirmed by then.
        """
        acked = {n: s.acked for n, s in self.sessions.items() if s.acked is not None}
        guarded = [n for n, s in self.sessions.items() if s.holds_copy]
        voters = self.voters
        if voters is None:
            return replicated_seq(self.seq, acked, guarded, self.members)
        # a partition group's learners are waited for as any guarded backup, never counted
        counted = {n: seq for n, seq in acked.items() if n in voters}
        return min(replicated_seq(self.seq, counted, (), self.members),
                   replicated_seq(self.seq, acked, guarded, 1))

    def barrier(self, callback: Callable[[], None]) -> None:
        """A replication barrier: ``callback`` once everything emitted so far is replicated.

        If the last event is a dequeue, which backups acknowledge late (a
        consumer's acks: nobody waits for them), an ``a`` event follows it so
        that this wait is acknowledged promptly.
        """
        target = self.seq
        if not self._waiters and target <= self.replicated():
            callback()
            return
        if target == self._dequeue_seq and self.sessions:
            self._emit(R.AckPromptly(R.ACK_PROMPTLY))
            target = self.seq
        self._waiters.append((target, callback))

    def _release(self) -> None:
        waiters = self._waiters
        if not waiters:
            return
        done = self.replicated()
        while waiters and waiters[0][0] <= done:
            _, callback = waiters.popleft()
            callback()

    # -- status --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "seq": self.seq,
            "replicated": self.replicated(),
            "members": self.members,
            "replicate": self.default_policy,
            "waiting_confirms": len(self._waiters),
            **self.broker.flow.status(),  # publishers_held, publisher_holds, ...
            "transactions": len(self.tx_queues),
            "ready_backups": self.ready_backups(),
            "backups": {n: s.status(self.seq) for n, s in sorted(self.sessions.items())},
            "replicate_changes": self.replicate_status(),
        }


def _backup_can_take(queue: Queue, ranges: list[tuple[int, int]]) -> bool:
    """Whether a backup applies this purge as one ``pr`` at little cost: a queue without
    priorities (its copy in position order), the ranges ascending, and few entries
    outside the last range -- the purged ones of the others and the acquired ones
    (``PURGE_RANGES_SCAN``); the last range is taken off whole, however long."""
    if queue.ready.prioritised or not ranges:
        return False
    if any(ranges[i][1] >= ranges[i + 1][0] for i in range(len(ranges) - 1)):
        return False
    return ranges[-1][0] - ranges[0][0] + queue.unacked <= PURGE_RANGES_SCAN


def _nothing() -> None:
    """No definitions subscription to end (a partition group's primary)."""
