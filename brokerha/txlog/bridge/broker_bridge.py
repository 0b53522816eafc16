"""The TxLog inside a broker node: the master hosted here, and its global queues.

The broker knows nothing of the TxLog (style.md: data flows one way);
``TxLogBridge`` plugs three parts into its observer interfaces:

* ``GlobalQueues`` (``global_queues.py``): which queues are global, the
  refusals that keep every DC's copy the same, dead letters ordered, and the
  master's ``DeliverOrdered`` actions applied to the queues;
* ``GlobalTxObserverFactory`` (``tx_observer.py``): every transaction's
  operations on global queues submitted to the master in ``prepare``;
* the master itself (``TxLogDriver``), started and stopped here (on an HA
  node: while it is the primary), whose actions this module routes: ordered
  transactions to ``GlobalQueues.apply``, the engine's ``Backup`` and
  ``Restore`` (split recovery, Simple/Smart) to the broker-state backups
  (:mod:`brokerha.txlog.bridge.broker_state`).

In an HA datacenter the master's journal is replicated to the backups
(``txlog/bridge/replica.py``). The *applied mark* (how many synchronised entries the
global queues reflect) goes into the store's meta after the effects it counts
and, on a primary, into the replication log after their queue events; when a
master starts (restart or promotion) the bridge re-applies from the mark to
what the engine executed, then makes each global queue hold exactly the
model's messages (``_bring_to_log``), so no effect is lost, doubled or
resurrected by a crash or a failover.

Operators change the running master through the node's admin API
(``add_peer``, ``remove_peer``, ``set_split_recovery``: ``brokerha ctl txlog
…``). On an HA primary the peers file goes to the backups as ``lp`` (at each
change, at the master's start and in a joiner's catch-up) and the strategy in
the journal, so a master promoted elsewhere runs with both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from brokerha.cluster import replication as R
from brokerha.primary.primary import Primary
from brokerha.seed_runner import UnsafeRules
from brokerha.txlog.bridge.broker_state import SplitBackups
from brokerha.txlog.bridge.global_queues import GlobalQueues, pack_message, unpack_message
from brokerha.txlog.bridge.replica import PrimaryJournal, TxLogReplica, snapshot_events
from brokerha.txlog.bridge.tx_observer import GlobalTxObserverFactory
from brokerha.txlog.engine.config import SplitRecovery
from brokerha.txlog.engine.messages import Action, Backup, DeliverOrdered, Restore
from brokerha.txlog.engine.records import Operation, TxBody
from brokerha.txlog.engine.validation import COMMITTED
from brokerha.txlog.master.driver import MasterIO, TxLogDriver, read_peers_file
from brokerha.txlog.master.settings import NodeTxLog, parse_urls

log = logging.getLogger("brokerha.txlog")

COMMIT_TIMEOUT = 30.0  # seconds a commit waits for the TxLog's answer
APPLIED_KEY = "txlog_applied"  # store meta: synchronised entries the global queues reflect
CHANGE_QUORUM_TIMEOUT = 5.0  # seconds an operator's change waits for the DC's quorum


class NotMaster(Exception):
    """An operator's TxLog change sent to a node whose master does not run (the reason)."""


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the bridge to break on purpose (simulations only): each must be caught."""

    no_reapply: bool = False  # a master starts without re-applying entries past the mark


class TxLogBridge:
    """A node's TxLog master and its global queues (see the module docstring)."""

    def __init__(self, broker: Any, config: NodeTxLog, *,
                 driver_factory: Callable[..., TxLogDriver] = TxLogDriver,
                 commit_timeout: float = COMMIT_TIMEOUT, io: MasterIO | None = None,
                 unsafe: Unsafe | None = None) -> None:
        self.broker = broker
        self.config = config
        self.node_id = config.settings.txlog.node_id
        self.driver_factory = driver_factory
        self.commit_timeout = commit_timeout
        self.io = io  # the master's and the replica's I/O (None: the process's)
        self.unsafe = unsafe or Unsafe()
        self.driver: TxLogDriver | None = None
        self.reason = "not started (a cluster member runs it only while it is the primary)"
        self.counters = dict.fromkeys(
            ("submitted", "refused", "validation_failed", "applied_committed", "applied_failed",
             "enqueued", "dequeued", "duplicate_enqueues", "dequeued_elsewhere_while_held",
             "missing_bodies", "declared_missing_queues", "backups", "backup_missing",
             "restores", "restore_failed", "restore_removed", "restore_rebuilt", "replayed",
             "ordered_dead_letters"), 0)
        # split recovery (Simple/Smart): undo records, the durable backup, restores
        self.recovery = SplitBackups(config.settings.data_dir, pack_message, unpack_message)
        self.counters.update(dict.fromkeys(("reapplied_at_start", "removed_at_start",
                                            "missing_at_start", "pruned_at_start"), 0))
        # HA (txlog/bridge/replica.py): this node's copy of the DC's master while the master runs
        # on another node, and the serving primary's log while it runs here (node/ha.py
        # attaches the Primary)
        self.replica = TxLogReplica(config.settings.data_dir, config.settings.txlog,
                                    on_applied=self._replicated_applied,
                                    fsync_later=(io or MasterIO()).fsync)
        self.ha_primary: Primary | None = None
        self.journal_stream: PrimaryJournal | None = None
        # how many synchronised entries the global queues' contents reflect: put in the
        # store's meta after their effects (so durable with them) and replicated as ``la``
        self.applied = self._load_applied()
        self._applied_scheduled = False
        self.queues = GlobalQueues(broker, config, self.counters, self.recovery,
                                   lambda: self.running)
        self.tx_observers = GlobalTxObserverFactory(self.queues, self.submit)
        broker.observers.add_transaction_observer_factory(self.tx_observers)

    # ---- life cycle ------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.driver is not None

    async def start(self) -> None:
        """Run the master (a standalone node at start; an HA primary before it serves).

        On an HA primary the master's journal is replicated (``txlog/bridge/replica.py``)
        and its whole state goes to the backups first. Before the master runs,
        the global queues are brought to the state of the synchronised log it
        loaded (``_bring_to_log``): a restart or a failover can leave them
        behind the log by the entries applied after the last ``applied`` mark.
        """
        if self.driver is not None:
            return
        self.replica.suspend()  # the master's journal is this directory from now on
        kwargs: dict[str, Any] = {"on_action": self.on_action}
        if self.io is not None:
            kwargs["io"] = self.io
        stream = None
        if self.ha_primary is not None:
            stream = kwargs["replication"] = PrimaryJournal(self.ha_primary)
        try:
            driver = self.driver_factory(self.config.settings, **kwargs)
        except BaseException:
            self.replica.resume()
            raise
        self.driver, self.journal_stream = driver, stream
        try:
            driver.replicate_state()
            if stream is not None:  # and the peers it runs with (the backups replace theirs)
                stream.peers(read_peers_file(self.config.settings.data_dir))
            self.queues.flag_all()
            self._bring_to_log(driver)
            await driver.start()
        except BaseException:
            self.driver, self.journal_stream = None, None
            driver.journal.close()
            self.replica.resume()
            raise
        log.info("txlog master %s running on this node: peers on %s:%d, %d sync peer(s), "
                 "%d global queue(s), synchronised length %d", self.node_id,
                 *(driver.address or ("?", 0)), len(driver.engine.config.peers),
                 len(self.queues.index), len(driver.engine.sync))

    async def stop(self, reason: str = "stopped") -> None:
        driver, self.driver = self.driver, None
        self.reason = reason
        self.queues.unflag_all()
        if self._applied_scheduled:
            self._flush_applied()
        self.journal_stream = None
        # the driver closes its journal before its first await: events from a primary this
        # node now follows (a loop iteration later at the earliest) find the directory free
        self.replica.resume()
        if driver is not None:
            await driver.close()
            log.info("txlog master %s stopped on this node: %s", self.node_id, reason)

    # ---- HA: the serving primary's log; the applied mark ---------------------------------

    def attach_primary(self, primary: Primary) -> None:
        """This node became the HA primary: a master started from now on replicates through it."""
        self.ha_primary = primary
        primary.catch_up_providers.append(self.catch_up_events)

    def detach_primary(self) -> None:
        self.ha_primary = None

    def catch_up_events(self) -> list[list[Any]]:
        """A joining backup's TxLog: the whole state now, and the applied mark of the queues now."""
        driver = self.driver
        if driver is not None:
            events = snapshot_events(driver.journal.seq, driver.engine.durable)
        else:  # primary, master not started yet: the state this node holds as a backup
            events = self.replica.catch_up_events()
        if self.recovery.path.exists():  # a split's backup: a joining node keeps a copy too
            events.append(R.TxLogBrokerBackup(R.TXLOG_BROKER_BACKUP,
                                              self.recovery.path.read_bytes()))
        # the runtime peers (None: the configuration's), so the joiner, once promoted,
        # starts its master with the same DCs as this one
        events.append(R.TxLogPeers(R.TXLOG_PEERS, read_peers_file(self.config.settings.data_dir)))
        return [*events, R.TxLogApplied(R.TXLOG_APPLIED, self.applied)]

    # ---- operator changes (admin API: /api/txlog/peers, /api/txlog/split-recovery) -----

    @staticmethod
    def check_peer_url(node_id: str, url: str) -> None:
        """``ConfigError`` unless ``url`` is a txlog URL list (before the change is tried)."""
        parse_urls(url, f"url of peer {node_id}")

    @staticmethod
    def parse_split_recovery(value: str) -> str:
        """The strategy's canonical name (``ConfigError``: not None, Simple or Smart)."""
        return SplitRecovery.parse(value).value

    async def add_peer(self, node_id: str, url: str) -> bool:
        """A sync peer added at runtime; True once the change is on the DC's quorum.

        The driver writes its peers file; on an HA primary the file goes to the
        backups (``lp``), since a master promoted elsewhere must not fall back
        to the configuration's peers. ``ConfigError``: refused by the engine
        (already a peer, this DC's own id, a bad URL), nothing changed.
        """
        await self._master().add_peer(node_id, url)
        return await self._replicate_peers()

    async def remove_peer(self, node_id: str) -> bool:
        """A sync peer removed for good (``ConfigError``: not a peer, or a vote under way)."""
        await self._master().remove_peer(node_id)
        return await self._replicate_peers()

    async def set_split_recovery(self, value: str) -> bool:
        """None|Simple|Smart (``ConfigError``: another value, or during a split).

        The strategy is durable engine state (a ``strategy`` journal record),
        so it travels to the backups in the journal (``lr``) like any record.
        """
        self._master().set_split_recovery(value)
        return await self._on_quorum()

    def _master(self) -> TxLogDriver:
        if self.driver is None:
            raise NotMaster(self.reason)
        return self.driver

    async def _replicate_peers(self) -> bool:
        if self.journal_stream is not None:
            self.journal_stream.peers(read_peers_file(self.config.settings.data_dir))
        return await self._on_quorum()

    async def _on_quorum(self, timeout: float = CHANGE_QUORUM_TIMEOUT) -> bool:
        """Whether everything emitted so far reached the DC's quorum within ``timeout``.

        A standalone node has no quorum to wait for: its files are fsynced.
        An HA primary without enough acknowledging backups still made the
        change; the operator is told it may not survive a failover yet.
        """
        stream = self.journal_stream
        if stream is None:
            return True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def replicated() -> None:
            if not done.done():
                done.set_result(None)

        stream.barrier(replicated)
        try:
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            return False
        return True

    def _load_applied(self) -> int:
        raw = self.broker.store.get_meta(APPLIED_KEY)
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            log.error("txlog: store meta %s = %r is not a count; taken as 0", APPLIED_KEY, raw)
            return 0

    def _note_applied(self, count: int) -> None:
        """The global queues now reflect ``count`` synchronised entries (written once per
        loop iteration, after the queue effects: never ahead of them)."""
        self.applied = count
        if self._applied_scheduled:
            return
        self._applied_scheduled = True
        try:
            asyncio.get_running_loop().call_soon(self._flush_applied)
        except RuntimeError:  # no loop (tools, tests): now
            self._flush_applied()

    def _flush_applied(self) -> None:
        self._applied_scheduled = False
        self.broker.store.put_meta(APPLIED_KEY, str(self.applied))
        if self.journal_stream is not None:
            self.journal_stream.applied(self.applied)

    def _replicated_applied(self, count: int) -> None:
        """An ``la`` from the primary (this node is a backup): durable with the events before it."""
        self.applied = count
        self.broker.store.put_meta(APPLIED_KEY, str(count))

    def _bring_to_log(self, driver: TxLogDriver) -> None:
        """Make the global queues exactly the state of the synchronised log the master loaded.

        1. Re-apply the entries from the applied mark up to what the engine
           executed (``model.applied``): their effects may be missing (a crash
           between the journal and the store, or a failover that replicated
           the journal further than the queue events). The mark is exact --
           written after the effects it counts, in the same store and
           replication order -- so each is applied once, in log order.
        2. Then every global queue the log knows holds exactly the messages
           the engine's model says it holds: a message the log dequeued while
           a consumer held it (``Queue.withdraw`` defers to the settle, which a
           crash can cut off) is removed, not resurrected.
        """
        durable = driver.engine.durable
        sync, target = durable.sync, durable.model.applied
        start = self.applied
        if start < sync.offset.length < target:
            self.counters["pruned_at_start"] += sync.offset.length - start
            log.error("txlog: entries %d..%d are past the retention: their effects cannot be "
                      "re-applied", start, sync.offset.length - 1)
            start = sync.offset.length
        for position in range(start, min(target, len(sync))):
            entry = sync.entries[position - sync.offset.length]
            self.counters["reapplied_at_start"] += 1
            if not self.unsafe.no_reapply:
                self.on_action(DeliverOrdered(entry.record.tx_id, position,
                                              entry.outcome or COMMITTED))
        if start < target:
            log.warning("txlog: re-applied synchronised entries %d..%d to the global queues "
                        "(their effects were not recorded before the restart or failover)",
                        start, target - 1)
            self._note_applied(target)
        for key, ids in durable.model.queues.items():
            queue = self.queues.queue(key, create=False)
            held = self.queues.index.get(key)
            if queue is None or held is None:
                continue
            for gid in [g for g in held if g not in ids]:
                queue.withdraw(held.pop(gid).position)
                self.counters["removed_at_start"] += 1
                log.warning("txlog: message %s removed from global queue %s: the log "
                            "dequeued it", gid, key)
            missing = len([g for g in ids if g not in held])
            if missing:
                self.counters["missing_at_start"] += missing
                log.error("txlog: %d message(s) of global queue %s are in the log but not in "
                          "the queue (transient, or past the retention)", missing, key)

    async def submit(self, ops: list[Operation]) -> str | None:
        """None when confirmed committed, else the refusal (the text of the client's 406)."""
        driver = self.driver
        if driver is None:
            self.counters["refused"] += 1
            return f"the TxLog master is not running on this node ({self.reason})"
        self.counters["submitted"] += 1
        try:
            result = await driver.submit(ops, "confirm", self.commit_timeout)
        except TimeoutError:
            self.counters["refused"] += 1
            return (f"the TxLog did not order the transaction within {self.commit_timeout:g}s "
                    "(is a datacenter unreachable?)")
        except ConnectionError as exc:
            self.counters["refused"] += 1
            return f"the TxLog master stopped: {exc}"
        if result.get("outcome") != COMMITTED:
            self.counters["validation_failed"] += 1
            return (f"TxLog transaction {result.get('tx_id')} failed validation: a message it "
                    "dequeues was consumed by an earlier transaction (in this or another "
                    "datacenter)")
        return None

    # ---- applying the synchronised order -----------------------------------------------

    def on_action(self, action: Action) -> None:
        if isinstance(action, DeliverOrdered):
            self._note_applying(action)
            driver = self.driver
            self.queues.apply(action, None if driver is None
                              else driver.engine.durable.bodies.get(action.tx_id))
            self._note_applied(action.position + 1)
        elif isinstance(action, Backup):
            self._back_up(action.position)
        elif isinstance(action, Restore):
            self._restore(action.position)

    # ---- split recovery (brokerha/txlog/bridge/broker_state.py) -----------------------------

    def _note_applying(self, action: DeliverOrdered) -> None:
        """Open the undo record of the transaction about to be applied; count replays."""
        driver = self.driver
        stable = driver.engine.durable.stable.applied if driver is not None else 0
        self.recovery.begin(action.position, stable)
        if action.replay:
            self.counters["replayed"] += 1

    def _back_up(self, position: int) -> None:
        """Split acknowledged (Simple/Smart): the global queues as of ``position``, on disk."""
        driver = self.driver
        if driver is None:
            return
        durable = driver.engine.durable
        queues = {}
        for key in self.queues.index:
            queue = self.queues.queue(key, create=False)
            if queue is not None:
                queues[key] = queue
        backup, missing = self.recovery.take(
            position, durable.model.applied, self.queues.index, queues,
            self._log_since, self._find_enqueue)
        if self.journal_stream is not None:  # the DC's backups keep a copy (txlog/bridge/replica.py)
            self.journal_stream.broker_backup(backup.encode())
        self.counters["backups"] += 1
        self.counters["backup_missing"] += missing
        log.warning("txlog: split: broker state backed up at synchronised position %d "
                    "(%d message(s) in %d global queue(s)%s) to %s", position, backup.messages,
                    len(backup.queues), f", {missing} NOT recoverable" if missing else "",
                    self.recovery.path)

    def _restore(self, position: int) -> None:
        """Rejoin (Simple, or a Smart loser): global queues back to the backup; the replay follows."""
        backup = self.recovery.read()
        if backup is None or backup.position != position:
            self.counters["restore_failed"] += 1
            log.error("txlog: rejoin: no broker backup at position %d (%s); the replay is "
                      "applied on the current state (as under None)", position,
                      "none on disk" if backup is None else f"backup is at {backup.position}")
            return
        result = self.recovery.restore(backup, self.queues.index, self.queues.queue)
        self.counters["restores"] += 1
        self.counters["restore_removed"] += result.removed
        self.counters["restore_rebuilt"] += result.rebuilt
        log.warning("txlog: rejoin: global queues restored to the backup at position %d "
                    "(%d message(s) removed, %d ready message(s) rebuilt, %d held by "
                    "consumers kept); the resynchronised log is replayed from there", position,
                    result.removed, result.rebuilt, result.kept_held)

    def _log_since(self, position: int) -> Iterator[tuple[int, TxBody]]:
        """Committed bodies of the retained synchronised log from ``position`` on."""
        driver = self.driver
        if driver is None:
            return
        sync, bodies = driver.engine.sync, driver.engine.durable.bodies
        for p in range(max(position, sync.offset.length), len(sync)):
            entry = sync.entries[p - sync.offset.length]
            body = bodies.get(entry.record.tx_id)
            if body is not None and entry.outcome == COMMITTED:
                yield p, body

    def _find_enqueue(self, key: str, gid: str) -> tuple[int, bytes] | None:
        """The last retained committed enqueue of ``gid`` on ``key``: (position, content)."""
        found = None
        for p, body in self._log_since(0):
            for op in body.operations:
                if op.kind == "enqueue" and op.queue == key and op.message_id == gid:
                    found = (p, op.data)
        return found

    # ---- views -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        if self.driver is None:
            return {"running": False, "reason": self.reason, "applied_mark": self.applied,
                    "replica": self.replica.status()}
        status = self.driver.status()
        status["running"] = True
        status["applied_mark"] = self.applied
        status["replicated"] = self.journal_stream is not None
        status["global_queues"] = {key: len(ids) for key, ids in sorted(self.queues.index.items())}
        status["bridge"] = dict(self.counters)
        status["recovery"] = {"last_backup": self.recovery.last_backup,
                              "last_restore": self.recovery.last_restore,
                              "undo": self.recovery.status()}
        return status
