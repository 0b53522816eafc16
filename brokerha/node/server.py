"""A running node: the broker, its AMQP listener, timers and a clean shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from brokerha.broker.broker import Broker
from brokerha.broker.storage import Store
from brokerha.node.config import NodeConfig
from brokerha.node.transport import AMQPProtocol
from brokerha.store.factory import open_store

log = logging.getLogger("brokerha.node")

SHUTDOWN_GRACE = 2.0


def build_broker(config: NodeConfig, spawn: Callable[..., None] | None = None,
                 store: Store | None = None) -> Broker:
    """The broker model with vhosts, users and permissions from the configuration."""
    broker = Broker(config.name, limits=config.limits, store=store, spawn=spawn)
    broker.users.loopback_users = set(config.loopback_users)
    for vhost in config.vhosts:
        broker.add_vhost(vhost)
    if config.default_user:
        broker.users.add_user("guest", "guest", tags=["administrator"])
        broker.users.set_permissions("guest", "/")
    for user in config.users:
        broker.users.add_user(user.name, user.password, password_hash=user.password_hash,
                              tags=user.tags)
    for p in config.permissions:
        broker.users.set_permissions(p.user, p.vhost, p.configure, p.write, p.read)
    return broker


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.loop = asyncio.get_event_loop()
        self.store = open_store(config.store.url, config.data_dir, config.store.synchronous)
        self.store.on_failure = self._store_failed
        self.broker = build_broker(config, spawn=self._spawn, store=self.store)
        self.exit_code = 0
        self.connections: set[AMQPProtocol] = set()
        self.server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = asyncio.Event()

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

    async def start(self) -> None:
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        # recovery finishes before anyone can connect; a store that pages streams
        # the stored messages so their bodies are not all in memory at once
        definitions = (self.store.load(stream_messages=True)  # type: ignore[call-arg]
                       if self.broker.memory.pager is not None else self.store.load())
        self.broker.restore(definitions)
        self.store.start(self.loop)
        self.server = await self.loop.create_server(
            lambda: AMQPProtocol(self.loop, self.broker, self.connections), cfg.listen_host, cfg.listen_port, reuse_address=True)
        ticker = self.loop.create_task(self._tick_forever())
        self._tasks.add(ticker)
        log.info("node %s ready: AMQP 0-9-1 on %s:%d, data in %s, store %r", cfg.name,
                 cfg.listen_host, cfg.listen_port, cfg.data_dir, self.store)

    async def _tick_forever(self) -> None:
        interval = self.config.tick_interval
        while not self._stopping.is_set():
            await asyncio.sleep(interval)
            now = self.loop.time()
            self.broker.tick(now)
            for proto in list(self.connections):
                proto.tick(now)

    def _store_failed(self, exc: BaseException) -> None:
        """Fail-stop: a node that cannot persist must not keep confirming."""
        log.error("node %s: the store failed (%s); stopping, unconfirmed messages stay "
                  "unconfirmed", self.config.name, exc)
        self.exit_code = 1
        self.request_stop()

    def request_stop(self) -> None:
        self._stopping.set()

    async def run_until_stopped(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        await self._stopping.wait()
        await self.stop()

    async def stop(self) -> None:
        """Close every client connection with 320 CONNECTION_FORCED, then the listener."""
        log.info("node %s stopping: closing %d connection(s)", self.config.name,
                 len(self.connections))
        self._stopping.set()
        if self.server is not None:
            self.server.close()
        for proto in list(self.connections):
            if proto.conn is not None:
                proto.conn.shutdown()
                proto.flush()
        deadline = self.loop.time() + SHUTDOWN_GRACE
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for proto in list(self.connections):
            if proto.transport is not None:
                proto.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        self.broker.store.close()
        log.info("node %s stopped", self.config.name)
