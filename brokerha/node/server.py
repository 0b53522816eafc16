"""A running node: the broker, its AMQP listener, timers and a clean shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

from brokerha.admin.node_view import HAView
from brokerha.broker import definitions as D
from brokerha.broker.auth import hash_password
from brokerha.broker.broker import Broker
from brokerha.broker.definitions import DefinitionChange
from brokerha.broker.policy_effects import PolicyEffects
from brokerha.broker.storage import Store
from brokerha.cluster.link import ClusterLinks, links_reload
from brokerha.cluster.ports import ADMIN_OFFSET
from brokerha.ha.admission import Admission, ClientAdmission, NodeAdmission
from brokerha.httpapi.server import AdminServer, Request, Response
from brokerha.node.cluster_config import ClusterConfig
from brokerha.node.config import NodeConfig
from brokerha.node.disk import DiskMonitor
from brokerha.node.gc_governor import GCGovernor, tune_malloc
from brokerha.node.loop_monitor import LoopMonitor
from brokerha.node.prefault import HeapPrefault
from brokerha.node.relay import Refuse, RelayProtocol, RelayTarget
from brokerha.node.tls import NodeTLS
from brokerha.node.transport import AMQPProtocol
from brokerha.primary.policy import as_policies
from brokerha.store.factory import open_store

if TYPE_CHECKING:
    from brokerha.txlog.bridge.broker_bridge import TxLogBridge

log = logging.getLogger("brokerha.node")

SHUTDOWN_GRACE = 2.0
STANDALONE_TERM = 0  # a standalone node serves in one term, from start to stop


def _log_failure(exc: BaseException | None) -> None:
    if exc is not None:
        log.error("node task failed: %s", exc)


def build_broker(config: NodeConfig, spawn: Callable[..., None] | None = None,
                 store: Store | None = None, *, seed: bool = True) -> Broker:
    """The broker model; with ``seed``, the configuration's vhosts, users and permissions
    defined at once (a node seeds after recovery instead: ``seed_definitions``)."""
    broker = Broker(config.name, limits=config.limits, store=store, spawn=spawn)
    PolicyEffects(broker)  # policies act on its queues and exchanges (broker/policy_effects.py)
    broker.users.loopback_users = set(config.loopback_users)
    if seed:
        broker.definitions.apply_all(configured_definitions(config))
    return broker


def configured_definitions(config: NodeConfig,
                           cluster: ClusterConfig | None = None) -> list[DefinitionChange]:
    """The TOML's vhosts, users (``guest`` unless ``default_user = false``),
    permissions and ``[[cluster.policies]]`` (``ha-replicate`` policies,
    ``primary/policy.py``), as the definitions they seed."""
    changes = [D.vhost_set(vhost) for vhost in config.vhosts]
    if config.default_user:
        changes += [D.user_set("guest", hash_password("guest"), ["administrator"]),
                    D.permission_set("guest", "/")]
    for user in config.users:
        password_hash = user.password_hash
        if password_hash is None:
            assert user.password is not None  # the configuration checks it
            password_hash = hash_password(user.password)
        changes.append(D.user_set(user.name, password_hash, user.tags))
    changes += [D.permission_set(p.user, p.vhost, p.configure, p.write, p.read)
                for p in config.permissions]
    if cluster is not None:
        changes += [DefinitionChange(D.POLICY, (p.vhost, p.name), p.value())
                    for p in as_policies(cluster.policies, config.vhosts)]
    return changes


SEEDED = "definitions_seeded"  # store meta: the configuration seeded its definitions once


def seed_definitions(broker: Broker, config: NodeConfig, *, reset: bool = False,
                     cluster: ClusterConfig | None = None) -> None:
    """A new store's definitions come from the configuration; then the store's win.

    Once seeded (the store's ``definitions_seeded``), the definitions are what
    the API, ``brokerha ctl`` and imports made of them, and the TOML's
    ``[[users]]``, ``[[vhosts]]`` and ``[[permissions]]`` are not read again.
    ``reset`` (``brokerha node --reset-definitions``) makes them the
    configuration's again: whatever else is defined is deleted (a vhost with
    its queues and exchanges). An HA backup takes its primary's at its join.
    """
    store, definitions = broker.store, broker.definitions
    if store.get_meta(SEEDED) is not None and not reset:
        return
    seed = configured_definitions(config, cluster)
    if reset:
        changes = definitions.changes_to(seed)
        log.warning("definitions reset to the configuration's: %d changes", len(changes))
    else:
        changes = seed
        log.info("definitions seeded from the configuration (%d)", len(changes))
    definitions.apply_all(changes)
    store.put_meta(SEEDED, "1")


# Cyclic GC thresholds of a running node (CPython's defaults: 700, 10, 10).
# The middle generation every 2 young collections: its walk stays ~60,000 objects
# (20 made it 400,000: 0.3-0.45 s pauses while a queue filled; node/gc_governor.py).
GC_THRESHOLDS = (20_000, 2, 50)


def tune_gc(governor: GCGovernor | None = None) -> None:
    """Keep the cyclic GC from re-scanning what lives as long as the node's process.

    Process-wide: the node's own process calls it once started (``brokerha
    node``), never a process that merely hosts a node (tests, tools).

    With CPython's defaults a busy node collected its youngest generation
    every 700 allocations, promoting every message still in flight, and so
    ran full collections that walked every object of the imported modules
    and of the recovered state each time. ``gc.freeze`` moves all of those
    out of the collector's sight (reference counting still frees them), and
    larger thresholds let in-flight messages die young: confirms with two
    backups ran about 15 % faster (docs/benchmarks.md). Cycles are still
    collected, after 20,000 net allocations at most. ``governor`` (the node's
    ``GCGovernor``) keeps full collections from growing with a backlog and, called on
    the node's running loop, runs every collection on it (never on a store thread).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    if tune_malloc():  # and the C heap's (node/gc_governor.py), whose new pages a thread
        HeapPrefault().start()  # faults in off the event loop (node/prefault.py)
    if governor is not None:
        governor.count_frozen()  # what the start froze (the modules, the recovered state)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (a tool): CPython's automatic collection
            loop = None
        governor.install(loop)


class HALayer(HAView, Protocol):
    """What the node asks of its HA layer (``node/ha.py``, ``HANode``, which imports this
    module): beside what the admin endpoints read (``HAView``), its life and its status."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def add_status(self, status: dict[str, Any]) -> None: ...


class Node:
    """One broker node; with a ``[cluster]`` configuration, one member of an HA datacenter.

    A standalone node serves AMQP clients from the start. A cluster member
    serves them only while it is the primary: whether it does is its HA
    member's answer at the instant a connection is handed over
    (``admission``, ``ha/admission.py``); ``node.ha`` (node/ha.py) opens the
    node for a term with ``serve_clients`` and the member closes every
    connection in the step that ends the role.
    """

    def __init__(self, config: NodeConfig, cluster: ClusterConfig | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.reset_definitions = False  # ``brokerha node --reset-definitions``: seed_definitions
        self.loop = asyncio.get_event_loop()
        self.store = open_store(config.store.url, config.data_dir, config.store.synchronous,
                                config.store.oplog)
        self.store.on_failure = self._store_failed
        self.broker = build_broker(config, spawn=self._spawn, store=self.store, seed=False)
        self.store.on_disk_full = partial(self.broker.set_alarm, "disk:store")
        # the disk alarm: free space where this node writes, checked on the sweep
        self.disk = DiskMonitor([config.data_dir, *self.store.local_directories()],
                                config.disk_free_limit, self.broker.set_alarm)
        self.broker.definitions.subscribe(self._definition_changed)
        self.exit_code = 0
        self.servers: list[asyncio.base_events.Server] = []  # AMQP and amqps listeners
        # admission: which accepted connections are this node's clients (a standalone
        # node's always, once open; a cluster member's while its HA member says it serves:
        # node/ha.py puts the member's here); otherwise a cluster member relays them to
        # ``relay_to``, the primary's AMQP address, or closes them while it knows none
        self.admission: NodeAdmission = ClientAdmission(lambda: STANDALONE_TERM)
        self._opening = asyncio.Lock()  # opening for a term and stopping the TxLog master
        self.relay_to: RelayTarget | None = None
        self.relays: set[RelayProtocol] = set()
        self.relay_secret = cluster.secret if cluster is not None else None
        self._listen_retry_at = 0.0
        self._listening = asyncio.Lock()
        # [tls]: the amqps/HTTPS contexts; SIGHUP or POST /api/tls/reload reads the files again
        self.tls = NodeTLS(config.tls)
        self.admin = AdminServer(self.broker.users,
                                 cluster.secret if cluster is not None else None)
        self.admin.route("GET", "/api/status", self._status_page)
        self.admin.route("GET", "/api/tls", lambda _request: Response.json(self.tls.status()))
        self.admin.route("POST", "/api/tls/reload", self._reload_tls, admin=True)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()
        # lag histogram, stalls named in the log (with the cyclic GC's share of them)
        self.loop_monitor = LoopMonitor(self.loop, gc_seconds=lambda: self.gc.pause_total)
        # installed by tune_gc (the node's own process only)
        self.gc = GCGovernor(backlog=self._messages_held)
        # the HA layer (node/ha.py's HANode) attaches itself here for a cluster member;
        # the node only calls start/stop/add_status on it
        self.ha: HALayer | None = None
        self.management: Any = None  # the admin endpoints' (admin/endpoints.py)
        self.metrics: Any = None
        # with [txlog]: the TxLog master and global queues (brokerha/txlog/bridge/broker_bridge.py),
        # running exactly while this node serves clients (see serve_clients)
        self.txlog: TxLogBridge | None = None
        if config.txlog is not None:
            from brokerha.txlog.bridge.broker_bridge import TxLogBridge

            bridge = self.txlog = TxLogBridge(self.broker, config.txlog)
            link_tls = config.txlog.settings.tls
            if link_tls is not None:
                def txlog_links() -> ClusterLinks | None:
                    links = None if bridge.driver is None else bridge.driver.links
                    return links if isinstance(links, ClusterLinks) else None

                self.tls.on_reload("[txlog.tls]", links_reload(
                    link_tls.cert, link_tls.key, link_tls.ca, txlog_links))

    def _spawn(self, work: Awaitable[Any], on_done: Callable[[BaseException | None], None]) -> None:
        async def runner() -> None:
            try:
                await work
            except Exception as exc:  # reported to the caller, which closes the channel
                on_done(exc)
            else:
                on_done(None)

        task = self.loop.create_task(runner())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self, after_recovery: Callable[[], None] | None = None) -> None:
        """Recover, then serve; ``after_recovery`` runs in between (the GC's tuning).

        Recovery (millions of stored messages take seconds) runs before
        anything listens, joins a cluster or takes a lease, so its length stalls
        nobody; what it leaves behind (a full collection of the cyclic GC over
        everything recovered: 0.4 s at 1,000,000 messages) is done before too.
        """
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        # recovery finishes before anyone can connect; a store that pages streams
        # the stored messages so their bodies are not all in memory at once
        collecting = gc.isenabled()
        gc.disable()  # the recovered objects are not garbage: no collections while they come
        try:
            definitions = (self.store.load(stream_messages=True)  # type: ignore[call-arg]
                           if self.broker.memory.pager is not None else self.store.load())
            self.broker.restore(definitions)
        finally:
            if collecting:
                gc.enable()
        seed_definitions(self.broker, cfg, reset=self.reset_definitions, cluster=self.cluster)
        effects = PolicyEffects.of(self.broker)
        if effects is not None:  # recovered queues and exchanges were restored unobserved
            effects.apply_all()
        if after_recovery is not None:
            after_recovery()
        # a purge's or delete's per-entry work: in slices between loop turns from now on
        self.broker.background.schedule = self.loop.call_soon
        self.store.start(self.loop)
        self.loop_monitor.start()
        await self._start_admin()
        ticker = self.loop.create_task(self._tick_forever())
        self._tasks.add(ticker)
        listeners = ", ".join(self._listeners())
        if self.ha is None:
            await self.serve_clients(STANDALONE_TERM)
            log.info("node %s ready: AMQP 0-9-1 on %s, data in %s, store %r", cfg.name,
                     listeners, cfg.data_dir, self.store)
        else:
            try:  # open in every role: a backup relays its clients to the primary
                await self.open_listeners()
            except OSError as exc:  # the primary's turn retries (HANode._open_listener)
                log.warning("node %s: AMQP listener not open yet (%s)", cfg.name, exc)
            await self.ha.start()
            log.info("node %s ready: member of cluster %s, AMQP 0-9-1 on %s while primary, "
                     "data in %s, store %r", cfg.name, self.cluster.name if self.cluster else "",
                     listeners, cfg.data_dir, self.store)

    def _listeners(self) -> list[str]:
        cfg = self.config
        found = [f"{cfg.listen_host}:{cfg.listen_port}"] if cfg.amqp_plain else []
        if cfg.amqps_listen is not None:
            found.append(f"amqps {cfg.amqps_listen[0]}:{cfg.amqps_listen[1]}")
        return found

    def _reload_tls(self, request: Request) -> Response:
        try:
            return Response.json(self.tls.reload())
        except ValueError as exc:
            log.error("TLS reload failed, the old certificates stay in use: %s", exc)
            return Response.json({"error": f"reload failed, nothing changed: {exc}"}, 400)

    async def _start_admin(self) -> None:
        cfg = self.config
        if cfg.https_listen is not None:  # also with the plain listener off
            await self.admin.start(*cfg.https_listen,
                                   lambda protocol: self.tls.acceptor(protocol, "HTTPS"))
            log.info("admin HTTPS on https://%s:%d", *cfg.https_listen)
        if not cfg.admin_enabled:
            return
        explicit = cfg.admin_listen is not None
        host, port = cfg.admin_listen or (cfg.listen_host, cfg.listen_port + ADMIN_OFFSET)
        if port > 65535:
            log.info("admin HTTP off: AMQP port + %d is not a port (set --admin)", ADMIN_OFFSET)
            return
        try:
            await self.admin.start(host, port)
        except OSError as exc:
            if explicit:
                raise
            log.warning("admin HTTP not started on %s:%d (%s); set --admin", host, port, exc)
            return
        log.info("admin HTTP on http://%s:%d", host, port)

    def _messages_held(self) -> int:
        """Messages on the node's queues, ready or unacknowledged (the GC governor's backlog)."""
        return sum(q.message_count + q.unacked for vhost in self.broker.vhosts.values()
                   for q in vhost.queues.values())

    def _status_page(self, request: Request) -> Response:
        return Response.json(self.status())

    def status(self) -> dict[str, Any]:
        """This node's own view (the admin API's /api/status)."""
        cfg = self.config
        me = {"name": cfg.name, "role": "standalone", "epoch": None, "ready": True,
              "pid": os.getpid(), "amqp_url": f"amqp://{cfg.listen_host}:{cfg.listen_port}",
              "amqps_url": (None if cfg.amqps_listen is None
                            else f"amqps://{cfg.amqps_listen[0]}:{cfg.amqps_listen[1]}"),
              "serving": self.serving, "connections": len(self.connections),
              "relayed_connections": len(self.relays),
              "alarms": dict(self.broker.alarms), "disk": self.disk.status(),
              "memory_used": self.broker.memory.used,
              "memory_limit": self.broker.limits.memory_limit,
              "gc": {"thresholds": list(gc.get_threshold()), **self.gc.stats()}}
        status: dict[str, Any] = {"node": me, "cluster": None, "members": None}
        if self.ha is not None:
            self.ha.add_status(status)
        return status

    @property
    def serving(self) -> bool:
        """Whether this node serves AMQP clients at this instant (the admission's answer)."""
        return self.admission.serving

    @property
    def connections(self) -> list[AMQPProtocol]:
        """The client connections this node serves."""
        return [cast(AMQPProtocol, link) for link in self.admission.connections]

    async def serve_clients(self, term: int) -> bool:
        """Open the node for clients of ``term``: True once it serves them.

        With ``[txlog]`` the TxLog master starts first (global queues need it): a
        standalone node runs it from the start, an HA member while it is the
        verified, serving primary. False if the member stopped serving ``term``
        meanwhile (the master is stopped again). OSError: a listener's port is
        taken (the HA layer retries). A cluster member's listeners stay open in
        every role: its new connections are relayed (or dropped).
        """
        async with self._opening:
            if self.admission.opened == term:
                return True
            if self.txlog is not None:
                await self.txlog.start()
            await self.open_listeners()
            if not self.admission.open(term):
                if self.txlog is not None:
                    await self.txlog.stop("this node stopped serving clients")
                return False
            self.set_relay_target(None)
            return True

    def stopped_serving(self) -> None:
        """The role ended (its connections are closed by then): relays end, the TxLog
        master stops next."""
        self.set_relay_target(None)
        if self.txlog is not None:
            txlog = self.txlog

            async def stop_master() -> None:
                async with self._opening:
                    if self.admission.opened is None:
                        await txlog.stop("this node stopped serving clients")

            self._spawn(stop_master(), _log_failure)

    async def open_listeners(self) -> None:
        """The AMQP and amqps listeners (a cluster member keeps them open in every role)."""
        async with self._listening:  # the sweep's retry and the new primary's may overlap
            if self.servers:
                return
            cfg = self.config
            try:
                if cfg.amqp_plain:
                    self.servers.append(await self.loop.create_server(
                        self._plain_protocol, cfg.listen_host, cfg.listen_port,
                        reuse_address=True))
                if cfg.amqps_listen is not None:
                    self.servers.append(await self.loop.create_server(
                        self.tls.acceptor(self._amqps_protocol, "amqps"),
                        *cfg.amqps_listen, reuse_address=True))
            except OSError:
                self._close_listeners()
                raise

    def _client_protocol(self, identify: Any = None) -> asyncio.Protocol | None:
        """Serve the accepted connection here, relay it to the primary, or drop it (None).

        Served connections are admitted again when the transport hands them over
        (``AMQPProtocol.connection_made``): the node may have stopped serving since.
        """
        target, secret = self.relay_to, self.relay_secret
        decision = self.admission.decide(target is not None and secret is not None)
        if decision is Admission.SERVE:
            return AMQPProtocol(self.loop, self.broker, self.admission, identify,
                                relay_secret=self.relay_secret)
        if decision is Admission.REFUSE or target is None or secret is None:
            return None
        if identify is not None and target.amqps is not None and self.tls.member_client is not None:
            return RelayProtocol(target.amqps, self.relays, secret, identify,
                                 tls=self.tls.member_client)  # amqps stays encrypted
        return RelayProtocol(target.amqp, self.relays, secret, identify)

    def _plain_protocol(self) -> asyncio.Protocol:
        return self._client_protocol() or Refuse()

    def _amqps_protocol(self) -> asyncio.Protocol | None:
        """An amqps connection whose TLS handshake is done; None if this node can neither
        serve nor relay it now (a deposed primary during an election takes no clients)."""
        return self._client_protocol(self.tls.identity)

    def set_relay_target(self, target: RelayTarget | None) -> None:
        """Relay new connections to ``target`` (the primary changed: end the old relays)."""
        if target != self.relay_to:
            if self.relay_to is not None or target is None:
                for relay in list(self.relays):
                    relay.close(abort=True)
            self.relay_to = target
            if target is not None:
                log.info("node %s relays AMQP clients to the primary at %s", self.config.name,
                         target)

    def _close_listeners(self) -> None:
        for server in self.servers:
            server.close()
        self.servers = []

    def _definition_changed(self, change: DefinitionChange) -> None:
        """A deleted user's or vhost's connections are closed (320), as RabbitMQ's
        ``rabbit_connection_tracking``; the broker has deleted the vhost's queues by now."""
        if change.value is not None or change.kind not in (D.USER, D.VHOST):
            return
        name = change.key[0]
        text = f"{change.kind} '{name}' is deleted"
        for proto in self.connections:
            conn = proto.conn
            if conn is None:
                continue
            if (conn.user is not None and conn.user.name == name if change.kind == D.USER
                    else conn.vhost is not None and conn.vhost.name == name):
                log.info("closing connection %s: %s", conn.name, text)
                conn.shutdown(text=text)
                proto.flush()

    def close_connections(self) -> None:
        """Tell every client 320 CONNECTION_FORCED (the node stops; sockets closed after)."""
        for proto in self.connections:
            if proto.conn is not None:
                proto.conn.shutdown()
                proto.flush()

    async def _tick_forever(self) -> None:
        interval = self.config.tick_interval
        while not self._stopping.is_set():
            await asyncio.sleep(interval)
            now = self.loop.time()
            if self.ha is not None and not self.servers and now >= self._listen_retry_at:
                await self._retry_listeners(now)
            self.disk.check(now)
            self.gc.tick()
            self.broker.tick(now)
            for proto in list(self.connections):
                proto.tick(now)

    async def _retry_listeners(self, now: float) -> None:
        """A cluster member whose AMQP port was taken at start opens it once it is free."""
        self._listen_retry_at = now + 1.0
        try:
            await self.open_listeners()
        except OSError as exc:
            log.debug("node %s: AMQP listener still not open: %s", self.config.name, exc)
        else:
            log.info("node %s: AMQP listener open on %s", self.config.name,
                     ", ".join(self._listeners()))

    def _store_failed(self, exc: BaseException) -> None:
        """Fail-stop: a node that cannot persist must not keep confirming."""
        log.error("node %s: the store failed (%s); stopping, unconfirmed messages stay "
                  "unconfirmed", self.config.name, exc)
        self.exit_code = 1
        self.request_stop()

    def _sighup(self) -> None:
        try:
            self.tls.reload()
        except ValueError as exc:
            log.error("SIGHUP: TLS reload failed, the old certificates stay in use: %s", exc)

    def request_stop(self) -> None:
        self._stopping.set()

    async def run_until_stopped(self, after_recovery: Callable[[], None] | None = None) -> None:
        """The node's process: start, run until a signal or a stop request, stop.

        ``after_recovery``: called once the stored state is recovered, before the
        node serves or joins anything (``start``)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.request_stop)
        self.loop.add_signal_handler(signal.SIGHUP, self._sighup)
        await self.start(after_recovery)
        await self._stopping.wait()
        await self.stop()

    async def stop(self) -> None:
        """Close every client connection with 320 CONNECTION_FORCED, then the listener."""
        log.info("node %s stopping: closing %d connection(s)", self.config.name,
                 len(self.connections))
        self._stopping.set()
        self._close_listeners()
        self.set_relay_target(None)
        self.admin.close()
        if self.ha is not None:
            await self.ha.stop()
        self.close_connections()
        deadline = self.loop.time() + SHUTDOWN_GRACE
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for proto in list(self.connections):
            if proto.transport is not None:
                proto.transport.abort()
        if self.txlog is not None:
            await self.txlog.stop("node stopping")
        for task in list(self._tasks):
            task.cancel()
        self.loop_monitor.stop()
        self.gc.uninstall()
        self.broker.store.close()
        log.info("node %s stopped", self.config.name)
