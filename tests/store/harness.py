"""A broker with an SQLStore driven on a private event loop, for the store tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from pamqp import commands

from brokerha.broker.broker import Broker, Limits
from brokerha.broker.content import build_header
from brokerha.broker.message import Message
from brokerha.broker.paging import PAGED
from brokerha.broker.queue import Queue
from brokerha.broker.vhost import VirtualHost
from brokerha.store.sql import SQLStore

# paging tests: a queue limit of 16 bodies of 1000 bytes
LIMIT = 16 * 1024
SIZE = 1000


def body(i: int) -> bytes:
    """A numbered body of SIZE bytes."""
    return (b"%08d" % i) * (SIZE // 8)


def resident(q: Queue) -> int:
    """Bytes of bodies really held by the ready entries."""
    return sum(len(e.message.body) for e in q.ready if e.paged != PAGED)


def message(body: bytes, rk: str = "q", persistent: bool = True) -> Message:
    props = commands.Basic.Properties(delivery_mode=2 if persistent else 1)
    return Message("", rk, build_header(len(body), props), body)


class StoreNode:
    """Broker + SQLStore; broker calls made from the test thread, which runs the loop.

    Calls made between two ``run``/``sync`` calls behave like one loop
    callback: they are handed to the writer together.
    """

    def __init__(self, url: str, limits: Limits | None = None, **options: Any) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.store = SQLStore(url, **options)
        self.broker = Broker("t", store=self.store, limits=limits)
        self.broker.restore(self.store.load())
        self.store.start(self.loop)
        # defined (a store record) on a new store: written with the first batch
        self.vhost: VirtualHost = self.broker.add_vhost("/")
        self.loop_thread = threading.get_ident()

    def queue(self, name: str = "q", durable: bool = True) -> Queue:
        return self.vhost.declare_queue(name, owner=None, durable=durable)

    def barrier(self, record: list[str] | None = None, tag: str = "synced") -> asyncio.Future[None]:
        """A future resolved by an ``after_sync`` callback (which also appends ``tag``)."""
        fut: asyncio.Future[None] = self.loop.create_future()

        def done() -> None:
            assert threading.get_ident() == self.loop_thread, "callback off the loop thread"
            if record is not None:
                record.append(tag)
            if not fut.done():
                fut.set_result(None)

        self.store.after_sync(done)
        return fut

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until everything recorded so far is committed."""
        self.wait(self.barrier(), timeout)

    def wait(self, fut: asyncio.Future[Any], timeout: float = 10.0) -> None:
        self.loop.run_until_complete(asyncio.wait_for(asyncio.shield(fut), timeout))

    def spin(self, seconds: float) -> None:
        """Run the loop for a while (callbacks that are due run)."""
        self.loop.run_until_complete(asyncio.sleep(seconds))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` as one loop callback."""
        async def wrapped() -> Any:
            return fn()

        return self.loop.run_until_complete(wrapped())

    def close(self) -> None:
        self.store.close()
        self.spin(0.01)
        self.loop.close()

    def reopen(self) -> StoreNode:
        self.close()
        return StoreNode(self.url)
