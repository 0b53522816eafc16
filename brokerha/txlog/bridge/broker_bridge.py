"""The TxLog inside a broker node: global queues ordered across datacenters.

The broker knows nothing of the TxLog (style.md: data flows one way); this
module plugs into its observer interfaces:

* as a ``ConfigurationObserver`` it flags global queues (``queue.is_global``:
  argument ``x-global: true`` or a ``[[txlog.global]]`` policy) while the
  master runs on this node — the AMQP layer then turns non-transactional
  publishes and acks on them into one-operation transactions;
* as a ``TransactionObserverFactory`` it gives every transaction an observer
  that collects its publishes to global queues (enqueue operations, the message
  packed into the operation) and its acks on global queues (dequeue operations
  by global message id), submits them to the local master in ``prepare`` and
  says yes when the engine ``Confirm``s: an enqueue-only transaction once
  acquired (one phase), one with a dequeue once ordered and validated; a failed
  validation is a no, with a ``refusal`` the client sees in its 406;
* the master's ``DeliverOrdered`` actions are applied here, in order, in every
  DC including the origin: an enqueue adds the message (same global id) to the
  global queue, a dequeue removes the message with that global id wherever it
  is (ready: now; held by a consumer: when it settles or requeues it). The
  broker's local commit never applies a global queue's publishes
  (``Transaction.withhold``); its acks it settles as usual, after the dequeue
  was ordered;
* the engine's ``Backup`` and ``Restore`` (split recovery, Simple/Smart) back
  the global queues up and restore them (:mod:`brokerha.txlog.bridge.broker_state`);
* operations that would change one DC's copy only are ordered or refused:
  dead letters into global queues become ordered enqueues
  (``publish_ordered``, the broker's ``ordered_publisher``), and global
  queues that would expire or be deleted locally are refused at declare
  (``queue_declaring``); purge and non-empty delete are refused by the
  broker itself.

The global message id is the message's ``message_id`` property, or, when the
publisher set none, a generated one written into the message's ``message_id``
(so every DC's copy carries it, and it survives a restart of the node).

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
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, unquote

import msgpack

from brokerha.broker.arguments import GLOBAL_ARG, LOCAL_ONLY_ARGS
from brokerha.broker.content import read_message_id, rewrite_properties
from brokerha.broker.dtx import DtxBranch
from brokerha.broker.errors import BrokerError, PreconditionFailed
from brokerha.broker.message import Entry, Message
from brokerha.broker.observers import ConfigurationObserver
from brokerha.broker.queue import Queue
from brokerha.broker.transaction import Transaction, TransactionObserver
from brokerha.cluster import replication as R
from brokerha.txlog.bridge.broker_state import SplitBackups
from brokerha.txlog.bridge.replica import PrimaryJournal, TxLogReplica, snapshot_events
from brokerha.txlog.engine.config import SplitRecovery
from brokerha.txlog.engine.messages import Action, Backup, DeliverOrdered, Restore
from brokerha.txlog.engine.records import Operation, TxBody
from brokerha.txlog.engine.validation import COMMITTED
from brokerha.txlog.master.driver import TxLogDriver, read_peers_file
from brokerha.txlog.master.settings import NodeTxLog, parse_urls

log = logging.getLogger("brokerha.txlog")

COMMIT_TIMEOUT = 30.0  # seconds a commit waits for the TxLog's answer
APPLIED_KEY = "txlog_applied"  # store meta: synchronised entries the global queues reflect
CHANGE_QUORUM_TIMEOUT = 5.0  # seconds an operator's change waits for the DC's quorum


def queue_key(vhost: str, name: str) -> str:
    """The queue of an operation: ``<vhost, percent-encoded>/<queue name>``."""
    return f"{quote(vhost, safe='')}/{name}"


def parse_queue_key(key: str) -> tuple[str, str]:
    vhost, sep, name = key.partition("/")
    if not sep:
        raise ValueError(f"not a queue key: {key!r}")
    return unquote(vhost), name


def pack_message(message: Message, header: bytes) -> bytes:
    return msgpack.packb([message.exchange, message.routing_key, header, message.body],
                         use_bin_type=True)


def unpack_message(data: bytes) -> Message:
    exchange, routing_key, header, body = msgpack.unpackb(data, raw=False)
    return Message(exchange, routing_key, header, body)


class Refusal(Exception):
    """Why a transaction on global queues cannot be submitted."""


class NotMaster(Exception):
    """An operator's TxLog change sent to a node whose master does not run (the reason)."""


class TxLogBridge(ConfigurationObserver):
    """A node's TxLog master and its global queues (see the module docstring)."""

    def __init__(self, broker: Any, config: NodeTxLog, *,
                 driver_factory: Callable[..., TxLogDriver] = TxLogDriver,
                 commit_timeout: float = COMMIT_TIMEOUT) -> None:
        self.broker = broker
        self.config = config
        self.node_id = config.settings.txlog.node_id
        self.driver_factory = driver_factory
        self.commit_timeout = commit_timeout
        self.driver: TxLogDriver | None = None
        self.reason = "not started (a cluster member runs it only while it is the primary)"
        # global queue key -> global message id -> its entry (ready, or held by a consumer)
        self.index: dict[str, dict[str, Entry]] = {}
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
                                    on_applied=self._replicated_applied)
        self.ha_primary: Any = None
        self.journal_stream: PrimaryJournal | None = None
        # how many synchronised entries the global queues' contents reflect: put in the
        # store's meta after their effects (so durable with them) and replicated as ``la``
        self.applied = self._load_applied()
        self._applied_scheduled = False
        broker.observers.add_transaction_observer_factory(self)
        broker.observers.add_configuration_observer(self)
        broker.observers.ordered_publisher = self.publish_ordered

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
            for vhost in self.broker.vhosts.values():
                for queue in vhost.queues.values():
                    self._flag(queue)
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
                 len(self.index), len(driver.engine.sync))

    async def stop(self, reason: str = "stopped") -> None:
        driver, self.driver = self.driver, None
        self.reason = reason
        for vhost in self.broker.vhosts.values():
            for queue in vhost.queues.values():
                queue.is_global = False
        self.index.clear()
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

    def attach_primary(self, primary: Any) -> None:
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
            events.append([R.TXLOG_BROKER_BACKUP, self.recovery.path.read_bytes()])
        # the runtime peers (None: the configuration's), so the joiner, once promoted,
        # starts its master with the same DCs as this one
        events.append([R.TXLOG_PEERS, read_peers_file(self.config.settings.data_dir)])
        return [*events, [R.TXLOG_APPLIED, self.applied]]

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
            self.on_action(DeliverOrdered(entry.record.tx_id, position,
                                          entry.outcome or COMMITTED))
        if start < target:
            log.warning("txlog: re-applied synchronised entries %d..%d to the global queues "
                        "(their effects were not recorded before the restart or failover)",
                        start, target - 1)
            self._note_applied(target)
        for key, ids in durable.model.queues.items():
            queue = self._queue(key, create=False)
            held = self.index.get(key)
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

    # ---- which queues are global -----------------------------------------------------

    def is_global(self, queue: Queue) -> bool:
        if queue.arguments.get(GLOBAL_ARG) is True:
            return True
        return any(p.matches(queue.vhost, queue.name) for p in self.config.policies)

    def _flag(self, queue: Queue) -> None:
        queue.is_global = self.is_global(queue)
        if not queue.is_global:
            return
        ids: dict[str, Entry] = {}
        for entry in queue.ready:
            gid = read_message_id(entry.message.header)
            if gid is not None:
                ids.setdefault(gid, entry)
        self.index[queue_key(queue.vhost, queue.name)] = ids

    def queue_declared(self, queue: Queue) -> None:
        if self.running:
            self._flag(queue)

    def queue_declaring(self, vhost: str, name: str, exclusive: bool, auto_delete: bool,
                        arguments: dict[str, Any]) -> None:
        """Refuse a global queue that would lose messages in one datacenter only.

        ``x-global`` with expiry or limits is refused by the argument checks
        already; a policy makes a queue global whatever its arguments, so the
        same rule is applied here. An exclusive or auto-delete queue is deleted
        by one DC's connection or consumer going away.
        """
        if not self.running:
            return
        by_policy = any(p.matches(vhost, name) for p in self.config.policies)
        if arguments.get(GLOBAL_ARG) is not True and not by_policy:
            return
        where = f"queue '{name}' in vhost '{vhost}'"
        if exclusive or auto_delete:
            raise PreconditionFailed(
                f"{where} is a global queue: it cannot be {'exclusive' if exclusive else 'auto-delete'}"
                " (it would be deleted in this datacenter only)")
        for local_only in LOCAL_ONLY_ARGS:
            if local_only in arguments:
                raise PreconditionFailed(
                    f"invalid arg '{local_only}' for {where}: a global queue (by a [[txlog.global]] "
                    "policy) drops messages only through ordered dequeues")

    def publish_ordered(self, queues: list[Queue], message: Message) -> None:
        """An enqueue the broker makes itself (a dead letter) into global queues: ordered.

        One enqueue-only TxLog transaction, as for a publish without confirms;
        if the TxLog refuses it (not running, no answer), the dead letter is lost
        in every DC alike and the refusal is logged.
        """
        self.counters["ordered_dead_letters"] += 1
        tx = self.broker.new_transaction()
        tx.publish(queues, message)

        def done(exc: BaseException | None) -> None:
            if exc is not None:
                log.warning("txlog: dead letter into global queue(s) %s not ordered: %s",
                            ", ".join(q.name for q in queues), exc)

        self.broker.spawn(tx.commit(), done)

    def queue_deleted(self, queue: Queue) -> None:
        self.index.pop(queue_key(queue.vhost, queue.name), None)

    # ---- transactions ----------------------------------------------------------------

    def create(self, transaction: Transaction) -> GlobalTxObserver | None:
        return GlobalTxObserver(self, transaction) if self.running else None

    def operations(self, enqueues: list[tuple[Queue, Message]],
                   dequeues: list[tuple[Queue, Entry]]) -> list[Operation]:
        ops = []
        generated: dict[int, tuple[str, bytes]] = {}  # id(message) -> (gid, header)
        for queue, message in enqueues:
            if id(message) not in generated:
                gid = read_message_id(message.header)
                header = message.header
                if gid is None:
                    gid = f"{self.node_id}.{uuid.uuid4().hex}"
                    header = rewrite_properties(header, message_id=gid)
                generated[id(message)] = (gid, header)
            gid, header = generated[id(message)]
            ops.append(Operation("enqueue", queue_key(queue.vhost, queue.name), gid,
                                 pack_message(message, header)))
        for queue, entry in dequeues:
            gid = read_message_id(entry.message.header)
            if gid is None:
                raise Refusal(f"a message of global queue '{queue.name}' has no global id "
                              "(it was queued before the queue became global)")
            ops.append(Operation("dequeue", queue_key(queue.vhost, queue.name), gid))
        return ops

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
            self._deliver(action)
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
        for key in self.index:
            queue = self._queue(key, create=False)
            if queue is not None:
                queues[key] = queue
        backup, missing = self.recovery.take(
            position, durable.model.applied, self.index, queues,
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
        result = self.recovery.restore(backup, self.index, self._queue)
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

    def _deliver(self, action: DeliverOrdered) -> None:
        driver = self.driver
        body = driver.engine.durable.bodies.get(action.tx_id) if driver is not None else None
        if body is None:
            self.counters["missing_bodies"] += 1
            log.error("txlog: no body for ordered transaction %s; not applied", action.tx_id)
            return
        if action.outcome != COMMITTED:
            self.counters["applied_failed"] += 1
            return  # failed validation: nothing of it applies, in any DC
        self.counters["applied_committed"] += 1
        for op in body.operations:
            try:
                if op.kind == "enqueue":
                    self._enqueue(op)
                else:
                    self._dequeue(op)
            except (BrokerError, ValueError) as exc:
                log.error("txlog: cannot apply %s of %s on %s (tx %s): %s", op.kind,
                          op.message_id, op.queue, action.tx_id, exc)

    def _queue(self, key: str, create: bool) -> Queue | None:
        vhost_name, name = parse_queue_key(key)
        vhost = self.broker.vhosts.get(vhost_name)
        if vhost is None:
            return None
        queue = vhost.queues.get(name)
        if queue is None and create:
            # declared in another DC only: declare it here so every DC holds the same
            self.counters["declared_missing_queues"] += 1
            log.warning("txlog: global queue '%s' in vhost '%s' declared here (durable) "
                        "for an ordered enqueue", name, vhost_name)
            queue = vhost.declare_queue(name, owner=None, durable=True,
                                        arguments={GLOBAL_ARG: True})
            self._flag(queue)
        return queue

    def _enqueue(self, op: Operation) -> None:
        queue = self._queue(op.queue, create=True)
        if queue is None:
            log.error("txlog: no vhost for global queue %s; enqueue of %s not applied",
                      op.queue, op.message_id)
            return
        ids = self.index.setdefault(op.queue, {})
        if op.message_id in ids:  # the same global id twice (or re-applied): held once
            self.counters["duplicate_enqueues"] += 1
            return
        message = unpack_message(op.data)
        entry = queue.add_entry(Entry(queue.next_position, message, None))
        ids[op.message_id] = entry
        self.recovery.enqueued(op.queue, op.message_id)
        self.counters["enqueued"] += 1

    def _dequeue(self, op: Operation) -> None:
        entry = self.index.get(op.queue, {}).pop(op.message_id, None)
        queue = self._queue(op.queue, create=False)
        if entry is None or queue is None:
            return
        self.counters["dequeued"] += 1
        self.recovery.dequeued(op.queue, op.message_id, entry)
        if not queue.withdraw(entry.position):
            self.counters["dequeued_elsewhere_while_held"] += 1

    # ---- views -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        if self.driver is None:
            return {"running": False, "reason": self.reason, "applied_mark": self.applied,
                    "replica": self.replica.status()}
        status = self.driver.status()
        status["running"] = True
        status["applied_mark"] = self.applied
        status["replicated"] = self.journal_stream is not None
        status["global_queues"] = {key: len(ids) for key, ids in sorted(self.index.items())}
        status["bridge"] = dict(self.counters)
        status["recovery"] = {"last_backup": self.recovery.last_backup,
                              "last_restore": self.recovery.last_restore,
                              "undo": self.recovery.status()}
        return status


class GlobalTxObserver(TransactionObserver):
    """One transaction's operations on global queues; ``prepare`` waits for the TxLog."""

    def __init__(self, bridge: TxLogBridge, transaction: Transaction) -> None:
        self.bridge = bridge
        self.transaction = transaction
        self.enqueues: list[tuple[Queue, Message]] = []
        self.dequeues: list[tuple[Queue, Entry]] = []
        self.refusal: str | None = None

    def publish(self, queue: Queue, message: Message) -> None:
        if queue.is_global:
            if message.expiration_ms is not None and self.refusal is None:
                # a per-message TTL would expire the message in each DC at its own time
                self.refusal = (f"a message with an expiration (per-message TTL) cannot go to "
                                f"global queue '{queue.name}': it would expire in each "
                                "datacenter separately")
            self.enqueues.append((queue, message))

    def accept(self, acked: list[tuple[Queue, Entry]], unacked: list[tuple[Queue, Entry]]) -> None:
        self.dequeues.extend((q, e) for q, e in acked if q.is_global)

    def prepare_needed(self) -> bool:
        """Only a transaction that touches a global queue waits for the TxLog.

        The others keep the one-round-trip commit of a node without ``[txlog]``.
        """
        return bool(self.enqueues or self.dequeues)

    async def prepare(self) -> bool:
        if not self.prepare_needed():
            return True
        if self.refusal is not None:
            return False
        if isinstance(self.transaction, DtxBranch):
            self.refusal = "XA (dtx) transactions on global queues are not supported"
            return False
        try:
            ops = self.bridge.operations(self.enqueues, self.dequeues)
        except Refusal as exc:
            self.refusal = str(exc)
            return False
        self.refusal = await self.bridge.submit(ops)
        return self.refusal is None

    def applying(self) -> None:
        """The local commit leaves global queues alone: DeliverOrdered enqueues there.

        Its rejects (requeue=false) on global queues were ordered as dequeues and
        withdrew the entries; the withdrawal is this transaction's own, so the
        local reject dead-letters as usual (in this DC only, like the consumer's
        decision; a dead letter into a global queue is ordered in turn).
        """
        for queue, entry, requeue in self.transaction.rejects:
            if not requeue and queue.is_global:
                queue.own_withdrawal(entry)
        if self.enqueues:
            mine = {id(q) for q, _ in self.enqueues}
            self.transaction.withhold(lambda q: id(q) in mine)


