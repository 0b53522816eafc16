"""The HA core of one node: its role's Primary or Backup, positions, acknowledgements, barriers.

Sans-I/O: the node's asyncio layer (``node/ha.py``) and the simulations
(``ha/simulation``, through ``ha/member.py``) drive the same object, so the
durability ordering rules exist once. It owns:

- the role objects: a ``Primary`` (``become_primary``) or a ``Backup``
  following a primary (``become_backup``, ``send_join``), and ``demote``;
- the node's **position** ``(epoch, seq)`` and vote floor, recorded in the
  store's next commit with the events they describe (``record_position``),
  never in a commit of their own, and reported to the election only once
  that commit is durable (``Effects.position``);
- a **backup's work in slices**: a big transaction's commit is applied a
  slice a loop turn (``Backup.step``, scheduled with ``soon``), nothing of the
  stream after it meanwhile; its stored position is invalid until the commit's
  last slice (the slices may land in several store commits), while the
  position it reports stays the one before the commit: it is applied whole
  before this node leaves the role or joins again (``Backup.settle``);
- a **backup's acknowledgements** (``schedule_ack``): what is applied is
  acknowledged only from the store's ``after_sync`` of a commit that holds it
  and the position covering it (with a TxLog replica, after its journal
  sync first); dequeue-only batches are acknowledged up to
  ``DEQUEUE_ACK_DELAY`` later or with the next event that needs a prompt ack;
- the **primary's sends** (``schedule_flush``): once per loop iteration, or up
  to ``DEQUEUE_SEND_DELAY`` later for a tail of dequeues only;
- the **primary's position barrier** (``position_barrier``, installed in
  ``Broker.replication_barriers``): a confirm waits for the primary's own
  position covering its events to be durable; the position is recorded with
  every flush of events too (``schedule_flush``), so a primary that restarts
  never claims less than its backups acknowledged (their vote floors);
- joins that arrive while a new primary verifies are held (``pending_joins``).

What the core needs from outside is ``Effects`` (sending, timers, reporting
the position); the store is the broker's. ``Unsafe`` breaks a rule on purpose:
a simulation must then report a violation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from brokerha.backup.backup import Backup, LayerReplica
from brokerha.backup.transaction_replicator import COMMIT_SLICE
from brokerha.broker.broker import Broker
from brokerha.broker.placement import METADATA_GROUP, GroupScope
from brokerha.cluster.election import Position
from brokerha.cluster.messages import Message
from brokerha.cluster.replication import ConfigurationMismatch, Events, Join
from brokerha.cluster.state import NodeState
from brokerha.primary.catch_up import Pace
from brokerha.primary.events import BODY_PART_BYTES
from brokerha.primary.policy import ReplicationPolicy
from brokerha.primary.primary import Primary
from brokerha.primary.remote_backup import EVENTS_PER_PACKET, FLUSH_BYTES
from brokerha.seed_runner import UnsafeRules

log = logging.getLogger("brokerha.ha")

# A backup acknowledges replicated dequeues, which nobody waits for, at most this
# much later (or with the next event that needs a prompt ack); until then their
# store writes need no disk sync of their own (Backup.take_ack_due).
DEQUEUE_ACK_DELAY = 0.01
# The primary sends a consumer's dequeues, which nobody waits for, at most this much
# later (or with the next event someone waits for): sent together they join into
# fewer events, packets and socket writes (Primary.take_outbox's hold_lazy).
DEQUEUE_SEND_DELAY = 0.005
POSITION_KEY = "ha_position"  # [pos_epoch, pos_seq, floor_epoch, floor_seq] in the store


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Effects(Protocol):
    """What the core asks of the layer that drives it."""

    def send(self, peer: str, message: Message) -> None: ...

    def send_many(self, peer: str, messages: Sequence[Message]) -> None: ...

    def connected(self, peer: str) -> bool: ...

    def position(self, pos: Position) -> None:
        """The node's position changed (durably): tell the election."""

    def soon(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after the current input is handled (the loop's next turn)."""

    def later(self, delay: float, callback: Callable[[], None]) -> Cancellable: ...

    def replication_failed(self, reason: str) -> None:
        """This node cannot follow the primary at all (its configuration differs): stop."""

    def joined(self, primary: str, epoch: int) -> None:
        """A join went out (the node's own reports to its primary start again)."""


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the core to break on purpose (simulations only): each must be caught."""

    early_ack: bool = False      # a backup acknowledges before its store synced
    confirm_early: bool = False  # the primary confirms once its own disk has it (no quorum)
    no_tx_trackers: bool = False  # a backup joining during a prepared transaction is ready at once
    # a join's catch-up made and sent whole at once, as it used to be (primary/catch_up.py):
    # the primary's loop stalls for as long as the queues are deep
    monolithic_catch_up: bool = False
    # a catch-up's run of enqueues (``er``) not cut at a gap in the queue's positions: the
    # backup numbers the messages after the gap as others (primary/replicating_subscription.py)
    runs_across_gaps: bool = False
    # a purge's entries not replicated (``Primary.purged`` sends the backups nothing): the
    # client has its purge-ok, and after a failover the purged messages are back
    local_purge: bool = False
    # a backup's commit in slices (Backup.step): its stored position stays valid while the
    # transaction is half applied (a crash then leaves part of it at a valid position) ...
    position_valid_mid_commit: bool = False
    # ... its seq acknowledged (and reported) at the first slice, not after the last
    ack_before_last_slice: bool = False
    # ... a backup promoted mid-commit serves without applying the rest first (no settle)
    unsettled_promotion: bool = False
    # ... an acknowledgement sent mid-commit leaves the stored vote floor below it
    floor_behind_ack: bool = False


@dataclass(frozen=True)
class PrimarySettings:
    """What a new ``Primary`` is built with (the datacenter's configuration)."""

    members: int
    backup_timeout: float = 5.0
    replicate: str = "all"
    policies: tuple[ReplicationPolicy, ...] = ()
    tx_prepare_timeout: float = 5.0
    events_per_packet: int = EVENTS_PER_PACKET  # smaller in simulations: catch-ups span packets
    backup_unheard_timeout: float = 0.5  # a backup sending nothing while another is heard
    flow_lag: float | None = 0.1  # publishers held while a backup lags more (primary.py)
    # the bounds of big work (issue 33), smaller in simulations so that their small
    # messages and transactions take these paths: a body over body_part_bytes goes in
    # parts (primary/events.py), at most flush_bytes of live events per flush
    # (primary/remote_backup.py), and a backup applies a commit commit_slice entries a
    # loop turn (backup/transaction_replicator.py)
    body_part_bytes: int = BODY_PART_BYTES
    flush_bytes: int = FLUSH_BYTES
    commit_slice: int = COMMIT_SLICE


def stored_position(raw: str) -> tuple[int, int, int, int]:
    """(pos_epoch, pos_seq, floor_epoch, floor_seq) as ``record_position`` writes them."""
    pe, ps, fe, fs = (int(v) for v in json.loads(raw))
    return pe, ps, fe, fs


def position_key(scope: GroupScope | None) -> str:
    """Where a group's position is in the store: ``ha_position`` for the one group of an
    unpartitioned cluster and for the metadata group, ``ha_position/<group>`` for a
    partition's (docs/ha.md "Partitions")."""
    if scope is None or scope.group == METADATA_GROUP:
        return POSITION_KEY
    return f"{POSITION_KEY}/{scope.group}"


def load_position(broker: Broker, state: NodeState, key: str = POSITION_KEY) -> None:
    """Our position and vote floor from the store (older nodes: the state file's)."""
    raw = broker.store.get_meta(key)
    if raw is None:
        return
    state.pos_epoch, state.pos_seq, state.floor_epoch, state.floor_seq = stored_position(raw)


class HACore:
    def __init__(self, broker: Broker, me: str, state: NodeState, effects: Effects,
                 settings: PrimarySettings, clock: Callable[[], float], *,
                 primary_factory: Callable[..., Primary] = Primary,
                 unsafe: Unsafe | None = None, scope: GroupScope | None = None) -> None:
        self.broker = broker
        # a partitioned node's replication group (broker/placement.py): its Primary and
        # Backup hold only the group's part of the broker, its position has its own key
        self.scope = scope
        self.position_key = position_key(scope)
        self.me = me
        self.state = state  # the position and floor live here (and in the store)
        self.effects = effects
        self.settings = settings
        self.clock = clock
        self.primary_factory = primary_factory
        self.unsafe = unsafe or Unsafe()
        self.primary: Primary | None = None
        self.backup: Backup | None = None
        self.following: str | None = None  # the primary this backup joined
        self.phase = "joining"              # joining | backup | verifying | primary
        self.pending_joins: dict[str, tuple[int, Join]] = {}  # held while verifying
        self._ack_pending: Backup | None = None  # the Backup whose ack waits for the disk
        self._deferred_ack: Cancellable | None = None  # dequeues only (Backup.ack_due)
        self._flush_scheduled = False
        self._lazy_flush: Cancellable | None = None  # a tail of dequeues only, sent then
        self._durable_seq = 0               # the primary's own durable position
        self._durable_waiters: list[Callable[[], None]] = []
        self._position_scheduled = False
        self._step_scheduled = False   # the backup's next slice (Backup.step) is scheduled
        # the Backup whose sliced commit made the stored position invalid (until its ack)
        self._stored_invalid: Backup | None = None
        # the position goes into the store batch of the events it covers (see position_due)
        broker.store.before_batch(self.position_due)

    # -- roles ---------------------------------------------------------------------------

    def become_primary(self, epoch: int) -> Primary:
        """A Primary numbering its events from 0 in ``epoch``; the node verifies next."""
        if self.backup is not None:
            if not self.unsafe.unsettled_promotion:
                self._settle(self.backup)
            self.backup.close()
        self.backup, self.following = None, None
        self.phase = "verifying"
        self.record_position(epoch, 0)
        self._durable_seq = 0
        self.effects.position(Position(epoch, 0))
        s = self.settings
        self.primary = self.primary_factory(
            self.broker, me=self.me, members=s.members, epoch=epoch, start_seq=0,
            clock=self.clock, backup_timeout=s.backup_timeout, replicate=s.replicate,
            policies=list(s.policies), on_output=self.schedule_flush,
            tx_prepare_timeout=s.tx_prepare_timeout, events_per_packet=s.events_per_packet,
            backup_unheard_timeout=s.backup_unheard_timeout, flow_lag=s.flow_lag,
            **({} if self.scope is None else {"scope": self.scope}),
            pace=Pace.unbounded() if self.unsafe.monolithic_catch_up else None,
            tx_trackers=not self.unsafe.no_tx_trackers,
            runs_across_gaps=self.unsafe.runs_across_gaps,
            replicate_purges=not self.unsafe.local_purge,
            body_part_bytes=s.body_part_bytes, flush_bytes=s.flush_bytes)
        if self.unsafe.confirm_early:
            self.broker.replication_barriers.remove(self.primary.barrier)
        else:
            self.broker.replication_barriers.append(self.position_barrier)
        return self.primary

    def verified(self) -> None:
        """Verification is done: serve, and take the joins held meanwhile."""
        self.phase = "primary"
        held = sorted(self.pending_joins.items())
        self.pending_joins.clear()
        for _peer, (_msg_id, join) in held:
            self.join(join)
        self.flush()

    def demote(self) -> None:
        """No longer the primary (deposed, stepped down): nothing of it is confirmed now."""
        self.pending_joins.clear()
        if self.primary is not None:
            self.primary.close()
            dropped = self.broker.dtx.primary_stopped(
                None if self.scope is None else self.scope.group)  # its group's branches
            if dropped:
                log.warning("node %s: %d XA branches not prepared are rolled back with the "
                            "primary role", self.me, len(dropped))
            if self.position_barrier in self.broker.replication_barriers:
                self.broker.replication_barriers.remove(self.position_barrier)
            self.primary = None
            self._durable_waiters.clear()  # never released: their clients are disconnected
        if self._lazy_flush is not None:
            self._lazy_flush.cancel()
            self._lazy_flush = None
        self.phase = "joining"

    def become_backup(self, epoch: int, primary: str, txlog: LayerReplica | None = None,
                      layers: Mapping[str, LayerReplica] | None = None) -> bool:
        """Follow ``primary`` of ``epoch`` (a new Backup and a join); False if we already do."""
        if self.following == primary and self.backup is not None and self.backup.epoch == epoch:
            return False
        if self.backup is not None:
            self._settle(self.backup)
            self.backup.close()
        self.phase = "backup"
        self.following = primary
        st = self.state
        self.backup = Backup(self.broker, me=self.me, epoch=epoch,
                             position=Position(st.pos_epoch, st.pos_seq), txlog=txlog,
                             layers=layers, commit_slice=self.settings.commit_slice,
                             scope=self.scope)
        self.send_join()
        return True

    def send_join(self, mixed: bool = False) -> bool:
        """Join our primary (now, or when the link comes up); True if the join went out.

        Our position stays valid until the catch-up begins (``on_events``): a join
        the primary never answers (it died, or is not the primary any more) must not
        leave this node unelectable with its state intact. It is invalidated here
        when the state is not the position's already (``mixed``: a replication that
        failed part-way) or changes with the join (XA branches this node prepared
        as a primary are released to the new one).
        """
        if self.backup is None or self.following is None:
            return False
        if not self.effects.connected(self.following):
            return False  # sent when the link comes up
        if self.backup.busy and not self._settle(self.backup):
            mixed = True
        if mixed or self.broker.dtx.branches:
            self.invalidate_position()
        self.effects.send(self.following, self.backup.join_message())
        self.effects.joined(self.following, self.backup.epoch)
        return True

    # -- the primary's side ----------------------------------------------------------------

    def on_join(self, peer: str, msg_id: int, msg: Join) -> bool:
        """A backup's join: taken, or held while we verify. False: we are not its primary."""
        if self.primary is None or msg.epoch != self.primary.epoch:
            return False
        if self.phase == "verifying":
            self.pending_joins[peer] = (msg_id, msg)  # answered once verification decided
            return True
        self.join(msg)
        return True

    def join(self, msg: Join) -> None:
        assert self.primary is not None
        log.info("backup %s joins at position (%d, %d)", msg.node, msg.pos_epoch, msg.pos_seq)
        self.primary.backup_joined(msg)

    def schedule_flush(self, lazy: bool = False) -> None:
        """Events wait to be sent: this loop iteration, or ``DEQUEUE_SEND_DELAY`` later if
        they are only dequeues (``lazy``)."""
        self.schedule_position()
        if lazy:
            if self._lazy_flush is None:
                self._lazy_flush = self.effects.later(DEQUEUE_SEND_DELAY, self._lazy_flush_due)
            return
        if self._lazy_flush is not None:
            self._lazy_flush.cancel()
            self._lazy_flush = None
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.effects.soon(self.flush)

    def _lazy_flush_due(self) -> None:
        self._lazy_flush = None
        self._send(hold_lazy=False)

    def flush(self) -> None:
        """Send every backup what the primary has for it (dequeues only: when they are due)."""
        self._flush_scheduled = False
        self._send(hold_lazy=self._lazy_flush is not None)

    def _send(self, hold_lazy: bool) -> None:
        primary = self.primary
        if primary is None:
            return
        for peer, out in primary.take_outboxes(hold_lazy).items():
            self.effects.send_many(peer, out)

    def position_barrier(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once our own position covering everything so far is durable.

        One position record per loop iteration, however many confirms wait on it.
        """
        primary = self.primary
        if primary is None:
            return
        if primary.seq <= self._durable_seq:
            callback()
            return
        self._durable_waiters.append(callback)
        self.schedule_position()

    def schedule_position(self) -> None:
        """Record the primary's position once this loop iteration, with the events of it.

        Also without a waiting confirm: a primary that crashes and comes back
        must not claim less than its backups acknowledged (their vote floors),
        or no node of a datacenter whose backups were catching up could win.
        """
        if not self._position_scheduled:
            self._position_scheduled = True
            self.effects.soon(self.position_due)

    def position_due(self) -> None:
        """Record the scheduled position: as the store hands its next batch over, or after.

        The store calls this right before it hands a batch to its writer
        (``Store.before_batch``), so the position commits with the events it
        covers and a confirm waits for one disk sync; the ``soon`` of
        ``schedule_position`` covers a loop iteration that wrote nothing.
        """
        if self._position_scheduled:
            self._record_primary_position()

    def _record_primary_position(self) -> None:
        self._position_scheduled = False
        primary = self.primary
        if primary is None:
            return
        epoch, seq = primary.epoch, primary.seq
        waiters, self._durable_waiters = self._durable_waiters, []
        self.record_position(epoch, seq)

        def durable() -> None:
            if self.primary is not primary:
                return  # deposed meanwhile: nothing of it is confirmed
            self._durable_seq = max(self._durable_seq, seq)
            self.effects.position(Position(epoch, seq))
            for callback in waiters:
                callback()

        self.broker.store.after_sync(durable)

    # -- the backup's side -----------------------------------------------------------------

    def on_events(self, peer: str, msg: Events) -> None:
        """Apply the primary's events; send its transaction votes now, acks once durable."""
        backup = self.backup
        if backup is None or peer != self.following or msg.epoch != backup.epoch:
            return
        if backup.starts_catch_up(msg):
            self.invalidate_position()
        self._advance(peer, backup, lambda: backup.receive(msg))

    def _next_slice(self) -> None:
        """The backup's next slice of a commit (``Backup.step``), a loop turn after the last."""
        self._step_scheduled = False
        backup, peer = self.backup, self.following
        if backup is None or peer is None or not backup.busy:
            return
        self._advance(peer, backup, backup.step)

    def _settle(self, backup: Backup) -> bool:
        """End ``backup``'s commit in progress now (a role change, a join); False if it failed."""
        if not backup.busy:
            return True
        try:
            backup.settle()
        except Exception as exc:
            log.error("node %s: applying a transaction's commit failed (%s)", self.me, exc)
            return False
        return True

    def _advance(self, peer: str, backup: Backup, work: Callable[[], object]) -> None:
        """Apply (``work``: a packet, or the next slice of a commit); send votes now, acks
        once durable; schedule the next slice of a commit in progress."""
        was_caught_up = backup.caught_up
        try:
            work()
        except ConfigurationMismatch as exc:
            log.error("node %s: %s; stopping", self.me, exc)
            backup.close()
            self.effects.replication_failed(str(exc))
            return
        except Exception as exc:
            log.warning("node %s: replication from %s failed (%s); joining again", self.me,
                        peer, exc)
            backup.close()
            self.backup = Backup(self.broker, me=self.me, epoch=backup.epoch,
                                 position=Position.INVALID, txlog=backup.txlog,
                                 layers=backup.layers, commit_slice=self.settings.commit_slice,
                                 scope=self.scope)
            self.send_join(mixed=True)
            return
        if backup.busy:
            if self._stored_invalid is not backup:
                self._stored_invalid = backup
                if not self.unsafe.position_valid_mid_commit:
                    self._store_position_invalid()
            if self.unsafe.ack_before_last_slice:
                backup.ack_due = True  # the commit's seq acknowledged now (schedule_ack)
            if not self._step_scheduled:
                self._step_scheduled = True
                self.effects.soon(self._next_slice)
        else:
            self._stored_invalid = None  # the ack of the commit records the position again
        if backup.caught_up and not was_caught_up:
            log.warning("node %s caught up with primary %s at seq %d: ready", self.me, peer,
                        backup.applied_seq)
        for vote in backup.take_votes():
            self.effects.send(peer, vote)
        if backup.rejoin_requested:
            # the primary's ``rj``: a queue became replicated whole, its messages come in
            # the new join's catch-up. Our state is consistent up to the event before it,
            # so our position stays valid until that catch-up begins (send_join)
            log.info("node %s: primary %s asks it to join again (a queue's ha-replicate "
                     "changed to all); joining at seq %d", self.me, peer, backup.applied_seq)
            self.send_join()
            return
        if backup.take_ack_due():
            self.schedule_ack()
        elif self._deferred_ack is None:  # only dequeues: acknowledged later, or with the next
            self._deferred_ack = self.effects.later(DEQUEUE_ACK_DELAY, self._deferred_ack_due)

    def _deferred_ack_due(self) -> None:
        self._deferred_ack = None
        self.schedule_ack()

    def schedule_ack(self) -> None:
        """Acknowledge what is applied now, once the store made it (and our position) durable.

        The seq is taken now: events applied after this call are not covered
        by the commit the callback waits for, and are acknowledged next time.
        With a TxLog the replicated journal is fsynced first (off the loop), and
        only then is the position recorded: a position never claims TxLog
        records that a crash could still lose.
        """
        if self._deferred_ack is not None:  # this acknowledgement covers what it waited for
            self._deferred_ack.cancel()
            self._deferred_ack = None
        backup = self.backup
        if backup is None or self._ack_pending is backup:
            return
        self._ack_pending = backup  # per Backup: a new one (joined again) schedules its own
        seq, caught_up, session = backup.applied_seq, backup.caught_up, backup.session
        if self.unsafe.ack_before_last_slice and backup.commit_seq is not None:
            seq = backup.commit_seq

        def durable() -> None:
            if self._ack_pending is backup:
                self._ack_pending = None
            if self.backup is not backup or self.following is None:
                return
            if backup.session != session:
                # joined again meanwhile: that seq and position were the old session's,
                # and the state is a catch-up in progress (its position INVALID)
                if backup.applying:
                    self.schedule_ack()
                return
            if caught_up:
                self.effects.position(Position(backup.epoch, seq))
            self.effects.send(self.following, backup.ack_message(seq))
            if backup.applied_seq > seq:
                self.schedule_ack()

        def journal_synced() -> None:
            if caught_up and self.backup is backup and backup.session == session:
                if not backup.busy:
                    self.record_position(backup.epoch, seq)
                elif not self.unsafe.floor_behind_ack:  # mid-commit the stored position
                    self._raise_floor(backup.epoch, seq)  # stays invalid, the floor rises
            if self.unsafe.early_ack:
                durable()
            else:
                self.broker.store.after_sync(durable)

        replica = backup.txlog
        if replica is not None:
            replica.after_durable(journal_synced)
        else:
            journal_synced()

    # -- positions -------------------------------------------------------------------------

    def invalidate_position(self) -> None:
        """From here until the caught-up marker our state is a mix, not a consistent copy
        (the store commits in order, so this is durable before any change after it)."""
        self.record_position(-1, -1)
        self.effects.position(Position.INVALID)

    def _store_position_invalid(self) -> None:
        """A commit is applied in slices: the stored position is invalid until its ack
        records it again (a crash in between leaves a node that must catch up). Written
        with the first slice's changes (the same store batch); the position reported to
        the election is unchanged: this process applies the whole commit before anything
        else (``Backup.settle``)."""
        st = self.state
        self.broker.store.put_meta(self.position_key, json.dumps(
            [-1, -1, st.floor_epoch, st.floor_seq]))

    def _raise_floor(self, epoch: int, seq: int) -> None:
        """Record a vote floor of ``(epoch, seq)`` (never lowered) with the position still
        invalid: an acknowledgement sent mid-commit promises what it covers, so that after
        a crash this node votes for no candidate without it (a transaction acknowledged,
        hence maybe answered commit-ok, would be lost; found by the simulation with small
        bounds, seed 1512)."""
        st = self.state
        if (epoch, seq) > (st.floor_epoch, st.floor_seq):
            st.floor_epoch, st.floor_seq = epoch, seq
        self._store_position_invalid()

    def record_position(self, epoch: int, seq: int) -> None:
        """Record our position into the store's next commit (with the floor, never lowered).

        Durable once an ``after_sync`` registered after this call runs; no
        extra fsync: it commits with the events it describes.
        """
        st = self.state
        st.move_to(epoch, seq)
        self.broker.store.put_meta(self.position_key, json.dumps(
            [st.pos_epoch, st.pos_seq, st.floor_epoch, st.floor_seq]))
