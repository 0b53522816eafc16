"""The broker: virtual hosts, users, observers, the store, memory alarm, timers."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from brokerha.broker import definitions as D
from brokerha.broker.auth import UserDatabase
from brokerha.broker.background import Background
from brokerha.broker.definitions import DefinitionChange, Definitions
from brokerha.broker.dtx import DtxBranch, DtxManager, Xid
from brokerha.broker.errors import NotAllowed
from brokerha.broker.flow import PublishFlow
from brokerha.broker.message import Entry, Message
from brokerha.broker.observers import Observers
from brokerha.broker.paging import Pager
from brokerha.broker.queue import MemoryMeter
from brokerha.broker.stats import BrokerStats
from brokerha.broker.storage import MemoryStore, PreparedBranch, Recovered, Store, prepared_branch
from brokerha.broker.transaction import Transaction
from brokerha.broker.tx_outcomes import TxOutcomes
from brokerha.broker.vhost import STANDARD_EXCHANGES, VirtualHost

if TYPE_CHECKING:
    from brokerha.broker.placement import GroupGuard

log = logging.getLogger(__name__)

Spawner = Callable[[Awaitable[Any], Callable[[BaseException | None], None]], None]


class DurabilityGate(Protocol):
    """Who may confirm at all: an HA member installs one (``ha.member.HAMember``).

    ``term`` is read when a confirm is asked for and again when its barriers
    have passed; the answer goes out only if both readings are the same term.
    """

    def term(self) -> int | None:
        """The term (epoch) in which this node serves clients now; None: confirm nothing."""

    def refused(self) -> None:
        """A confirm was refused: the node must stop serving if it still thinks it serves."""

    def lapsed(self) -> int | None:
        """The term whose lease lapsed without the role ending (yet): a confirm of that term
        waits (``defer``) rather than being refused; None when not lapsed."""

    def defer(self, release: Callable[[], None]) -> None:
        """Call ``release`` again once the lease is renewed; never, if the role ends first."""


@dataclass
class Limits:
    """Negotiation limits and resource bounds (see docs/configuration.md)."""

    frame_max: int = 131072
    channel_max: int = 2047
    heartbeat: int = 60
    max_message_size: int = 128 * 1024 * 1024
    memory_limit: int = 0  # bytes of queued content; 0 = no limit
    memory_resume_ratio: float = 0.9
    # bodies kept in memory per durable queue / per node before paging to the
    # store (persistent messages on durable queues only); 0 = unlimited
    queue_max_memory: int = 0
    node_max_memory: int = 0


class Broker:
    def __init__(
        self,
        node_name: str = "brokerha",
        *,
        limits: Limits | None = None,
        store: Store | None = None,
        clock: Callable[[], float] = time.monotonic,
        spawn: Spawner | None = None,
    ) -> None:
        self.node_name = node_name
        self.limits = limits or Limits()
        self.clock = clock
        self.observers = Observers()
        self.memory = MemoryMeter()
        # per-entry work of a purge or delete, in slices between loop turns once the
        # node installs ``background.schedule`` (broker/background.py)
        self.background = Background()
        # vhosts, users, permissions, policies (broker/definitions.py): the store keeps
        # them, the HA layer replicates them; the vhosts and users below follow them
        self.definitions = Definitions()
        self.users = UserDatabase(definitions=self.definitions)
        self.vhosts: dict[str, VirtualHost] = {}
        self.definitions.subscribe(self._definition_changed)
        self.store = store or MemoryStore()
        self.definitions.subscribe(self._store_definition)
        self.observers.add_configuration_observer(self.store)
        self.observers.add_queue_observer(self.store)
        if self.store.can_page and (self.limits.queue_max_memory or self.limits.node_max_memory):
            self.memory.pager = Pager(self.store, self.limits.queue_max_memory,
                                      self.limits.node_max_memory, background=self.background)
        self._spawn = spawn
        self._tx_ids = itertools.count(1)
        self.outcomes = TxOutcomes(self.store)
        # prepared transactions a backup holds for its primary, as the store kept them
        # (txid -> payload): the HA layer (brokerha.backup.tx_buffer) reads them
        self.ha_transactions: dict[str, bytes] = {}
        self.dtx = DtxManager(self.observers.transactions, clock)
        self.dtx.on_outcome = self._record_outcome
        self.attach_store_to_dtx()
        # resource alarms in force, name -> why: "memory", "disk" (free space under the
        # limit), "disk:store" (a store write found the disk full), "disk:<node>" (a
        # ready backup's); while any is, publishers are blocked (connection.blocked)
        self.alarms: dict[str, str] = {}
        self.alarm_listeners: list[Callable[[bool], None]] = []
        # internal back-pressure (the HA primary's): publishers are not read, not told;
        # background work (a purge's dequeues) pauses too
        self.flow = PublishFlow(clock)
        self.flow.listeners.append(self.background.flow_changed)
        # Replication barriers (the HA primary adds one): each runs a callback once
        # every ready backup holds what was done so far. See ``after_durable``.
        self.replication_barriers: list[Callable[[Callable[[], None]], None]] = []
        # None on a standalone node (its own disk is the whole promise); an HA member's
        # says whether this node may confirm anything now (see ``after_durable``)
        self.durability_gate: DurabilityGate | None = None
        # a node running partition groups (issue 35 stage 2, node/ha_groups.py): what the
        # AMQP methods ask before acting on a queue or the configuration, and the gate of a
        # queue's confirms (broker/placement.py); None: one group, every method as before
        self.groups: GroupGuard | None = None
        self.stats = BrokerStats()
        self.durable_requests = 0  # after_durable calls: confirms, commits, DTX (metrics)
        self.durable_refused = 0   # of those, never answered: the node did not serve (metrics)

    def after_durable(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once everything done so far is durable everywhere it must be.

        The durability barrier of a publisher confirm, a ``tx.commit-ok`` and a
        DTX answer: the local store has synced it and every replication barrier
        (every ready backup acknowledged it) has passed. A slow disk or a slow
        backup delays the callback; nothing makes it run early.

        On an HA member it fails closed (``durability_gate``): unless the node
        serves clients in the same term when the confirm is asked for and when
        every barrier has passed, the callback never runs (the connection is
        closed with the role, as after a failover). No path of a cluster member
        waits for its local sync alone, whatever barriers are installed.
        """
        self.after_durable_in(self.durability_gate, callback)

    def after_durable_in(self, gate: DurabilityGate | None, callback: Callable[[], None],
                         barriers: Sequence[Callable[[Callable[[], None]], None]] | None = None
                         ) -> None:
        """``after_durable`` through ``gate`` and ``barriers`` instead of the broker's own:
        a node of a partitioned cluster (docs/ha.md "Partitions") answers for data of one
        replication group through that group's gate (its member's term) and that group's
        replication barriers, not the metadata group's gate nor every group's barriers (a
        group that cannot replicate would hold the others' confirms). ``gate`` None: no
        gate; ``barriers`` None: every barrier installed."""
        self.durable_requests += 1
        release = callback
        if gate is not None:
            term = gate.term()
            if term is None:
                term = gate.lapsed()  # a stall past the lease: it may be renewed
            if term is None:
                self._refuse(gate)
                return
            release = self._in_term(gate, term, callback)
        if barriers is None:
            barriers = self.replication_barriers
        if not barriers:
            self.store.after_sync(release)
            return
        waiting = len(barriers) + 1

        def one_done() -> None:
            nonlocal waiting
            waiting -= 1
            if waiting == 0:
                release()

        self.store.after_sync(one_done)
        for barrier in list(barriers):
            barrier(one_done)

    def _in_term(self, gate: DurabilityGate, term: int,
                 callback: Callable[[], None]) -> Callable[[], None]:
        """``callback`` if the node still serves in ``term`` when it is due; else refused."""

        def release() -> None:
            if gate.term() == term:
                callback()
            elif gate.lapsed() == term:
                gate.defer(release)  # answered once the lease is renewed in ``term``
            else:
                self._refuse(gate)

        return release

    def _refuse(self, gate: DurabilityGate) -> None:
        self.durable_refused += 1
        gate.refused()

    # -- vhosts ------------------------------------------------------------------------

    def add_vhost(self, name: str) -> VirtualHost:
        """The vhost ``name``, defined (``Definitions``) with no metadata if it was not."""
        if name not in self.vhosts:
            self.definitions.apply(D.vhost_set(name))
        return self.vhosts[name]

    def _definition_changed(self, change: DefinitionChange) -> None:
        """A vhost defined exists; a vhost deleted goes with its queues and exchanges."""
        if change.kind != D.VHOST:
            return
        name = change.key[0]
        if change.value is not None:
            if name not in self.vhosts:
                self.vhosts[name] = VirtualHost(name, self.observers, self.memory, self.clock,
                                                self.background)
            return
        vhost = self.vhosts.get(name)
        if vhost is None:
            return
        for q in list(vhost.queues.values()):
            vhost.remove_queue(q)
        standard = {"", *dict(STANDARD_EXCHANGES)}
        for ex in [e for e in vhost.exchanges.values() if e.name not in standard]:
            if ex.name in vhost.exchanges:  # not auto-deleted meanwhile
                vhost.delete_exchange(ex.name)
        del self.vhosts[name]
        log.info("vhost '%s' deleted with its queues and exchanges", name)

    def _store_definition(self, change: DefinitionChange) -> None:
        if not self.definitions.restoring:
            self.store.definition_changed(change)

    def vhost(self, name: str) -> VirtualHost:
        vhost = self.vhosts.get(name)
        if vhost is None:
            raise NotAllowed(f"vhost {name} not found")
        return vhost

    # -- recovery ----------------------------------------------------------------------

    def restore(self, definitions: Recovered) -> None:
        """Rebuild durable state from the store, without telling the store again."""
        self.definitions.restore(D.DefinitionChange.from_wire(w) for w in definitions.definitions)
        for ex in definitions.exchanges:
            self.add_vhost(ex.vhost).restore_exchange(ex)
        for q in definitions.queues:
            self.add_vhost(q.vhost).restore_queue(q)
        for b in definitions.bindings:
            self.add_vhost(b.vhost).restore_binding(b)
        restored = 0
        for m in definitions.messages:
            queue = self.vhosts[m.vhost].queues.get(m.queue)
            if queue is None:
                continue
            message = Message(m.exchange, m.routing_key, m.header, m.body)
            entry = Entry(m.position, message, None)
            entry.redelivered = m.delivered
            queue.restore_entry(entry)
            restored += 1
        for branch in definitions.prepared:
            self._restore_branch(branch)
        self.ha_transactions.update(definitions.ha_transactions)
        self.outcomes.restore(definitions.outcomes)
        log.info("restored %d exchanges, %d queues, %d bindings, %d messages, "
                 "%d prepared XA branches", len(definitions.exchanges), len(definitions.queues),
                 len(definitions.bindings), restored, len(definitions.prepared))

    def _restore_branch(self, record: PreparedBranch) -> None:
        """A prepared branch holds its dequeued entries: take them off the ready list."""
        publishes = []
        for vhost, names, exchange, key, header, body in record.publishes:
            queues = [q for n in names if (q := self.add_vhost(vhost).queues.get(n)) is not None]
            publishes.append((queues, Message(exchange, key, header, body)))
        accepts = []
        for vhost, name, position in record.accepts:
            queue = self.add_vhost(vhost).queues.get(name)
            entry = queue.take_position(position) if queue is not None else None
            if queue is not None and entry is not None:
                accepts.append((queue, entry))
        self.dtx.restore_prepared(Xid.from_key(record.xid), publishes, accepts)

    def attach_store_to_dtx(self) -> None:
        """Prepared branches are written to the store; finished ones removed."""
        store = self.store

        def persist(branch: DtxBranch, done: Callable[[], None]) -> None:
            store.dtx_prepared(prepared_branch(branch.xid.key, branch.publishes,
                                               branch.accepts + [(q, e) for q, e, _ in branch.rejects]),
                               done)

        self.dtx.persist_prepared = persist
        self.dtx.forget_prepared = lambda xid: store.dtx_finished(xid.key)

    # -- transactions ------------------------------------------------------------------

    def new_transaction(self) -> Transaction:
        """A TX with a broker-unique id and the registered observers attached."""
        tx = Transaction(f"{self.node_name}:tx:{next(self._tx_ids)}", self.observers.transactions,
                         on_outcome=self._record_outcome)
        return tx

    def _record_outcome(self, tx: Transaction, outcome: str) -> None:
        """A finished transaction's outcome, in the same store batch as its effects."""
        if outcome == "preparing":
            if tx.client_id is not None:
                self.outcomes.preparing(tx.client_id)
            return
        txid = tx.replication_id or tx.id
        if tx.replication_id is None and tx.client_id is None:
            return  # neither replicated nor named: nobody can ask for it
        self.outcomes.record(txid, tx.client_id, outcome)

    def spawn(self, work: Awaitable[Any], on_done: Callable[[BaseException | None], None]) -> None:
        """Run asynchronous work (a transaction's prepare) and report how it ended."""
        if self._spawn is None:
            raise RuntimeError("broker has no spawner: run it under a node or pass spawn=")
        self._spawn(work, on_done)

    # -- timers and resources ----------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        for vhost in list(self.vhosts.values()):
            vhost.tick(now)
        self.dtx.tick(now)
        self.check_memory()

    def check_memory(self) -> None:
        """Raise or clear the memory alarm (connection.blocked/unblocked)."""
        limit = self.limits.memory_limit
        if not limit:
            return
        used = self.memory.used
        if "memory" not in self.alarms and used >= limit:
            self.set_alarm("memory", f"{used} bytes queued, limit {limit}")
        elif "memory" in self.alarms and used < limit * self.limits.memory_resume_ratio:
            self.set_alarm("memory", None)

    @property
    def memory_blocked(self) -> bool:
        return "memory" in self.alarms

    @property
    def publishers_blocked(self) -> bool:
        """Any resource alarm in force: publishing connections are not read."""
        return bool(self.alarms)

    @property
    def blocked_reason(self) -> str:
        """connection.blocked's reason, as RabbitMQ words it ("low on memory", "low on disk")."""
        kinds = sorted({name.split(":", 1)[0] for name in self.alarms})
        return "low on " + " & ".join(kinds) if kinds else ""

    def set_alarm(self, name: str, reason: str | None) -> None:
        """Raise (``reason`` given) or clear (None) the resource alarm ``name``.

        Connections are told only when publishers go from unblocked to blocked or
        back; another alarm joining or leaving while blocked changes nothing for them.
        """
        was = self.publishers_blocked
        if reason is None:
            if self.alarms.pop(name, None) is None:
                return
            log.warning("%s alarm cleared", name)
        else:
            if self.alarms.get(name) == reason:
                return
            if name not in self.alarms:
                log.warning("%s alarm set: %s", name, reason)
            self.alarms[name] = reason
        if self.publishers_blocked != was:
            for listener in list(self.alarm_listeners):
                listener(not was)
