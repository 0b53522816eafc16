"""Client loops for failover tests: what an application does with a multi-URL list."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions

RETRYABLE = (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError,
             pika.exceptions.StreamLostError, ConnectionError, OSError)


def connect_any(urls: list[str], deadline: float) -> pika.BlockingConnection:
    """The first URL that accepts a connection (backups refuse), retrying until ``deadline``."""
    last: BaseException | None = None
    while time.monotonic() < deadline:
        for url in urls:
            params = pika.URLParameters(url)
            params.connection_attempts = 1
            params.socket_timeout = 2
            params.blocked_connection_timeout = 10
            try:
                return pika.BlockingConnection(params)
            except RETRYABLE as exc:
                last = exc
        time.sleep(0.1)
    raise TimeoutError(f"no node accepted a connection: {last}")


class ConfirmedPublisher(threading.Thread):
    """Publishes numbered persistent messages with confirms; resends after a failover.

    ``confirmed`` holds the ids the broker confirmed; a message whose confirm
    did not arrive is sent again on the next connection (as pika users do),
    so duplicates are possible unless the queue deduplicates.
    """

    def __init__(self, urls: list[str], queue: str, *, declare: Callable[[object], None],
                 limit: int = 10_000, pause: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.urls, self.queue, self.declare, self.limit, self.pause = urls, queue, declare, limit, pause
        self.confirmed: list[int] = []
        self.confirmed_at: list[float] = []  # monotonic time of each confirm
        self.reconnects = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.gaps: list[float] = []  # seconds from a lost connection to the next confirm

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported to the test
            self.error = exc

    def _run(self) -> None:
        n = 0
        lost_at: float | None = None
        while not self.stop_event.is_set() and n < self.limit:
            conn = connect_any(self.urls, time.monotonic() + 30)
            try:
                ch = conn.channel()
                self.declare(ch)
                ch.confirm_delivery()
                while not self.stop_event.is_set() and n < self.limit:
                    ch.basic_publish("", self.queue, str(n).encode(),
                                     pika.BasicProperties(delivery_mode=2, message_id=str(n)),
                                     mandatory=False)
                    self.confirmed.append(n)
                    self.confirmed_at.append(time.monotonic())
                    if lost_at is not None:
                        self.gaps.append(time.monotonic() - lost_at)
                        lost_at = None
                    n += 1
                    if self.pause:
                        time.sleep(self.pause)
                conn.close()
            except RETRYABLE:
                self.reconnects += 1
                lost_at = lost_at or time.monotonic()
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - the connection is gone anyway
                    pass


def wait_rejoined(cluster: object, name: str, timeout: float = 30.0) -> None:
    """Until ``name`` reports itself a ready backup (a deposed primary came back)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = cluster.status(name)  # type: ignore[attr-defined]
        if st and st["node"]["role"] == "backup" and st["node"]["ready"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} did not rejoin as a ready backup: {cluster.status(name)}")  # type: ignore[attr-defined]


def drain(urls: list[str], queue: str, timeout: float = 30.0) -> list[int]:
    """Every message left on ``queue`` (acked), as ids."""
    conn = connect_any(urls, time.monotonic() + timeout)
    ch = conn.channel()
    got: list[int] = []
    while True:
        method, _, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        got.append(int(body))
    conn.close()
    return got


class AioPikaConsumer(threading.Thread):
    """An aio-pika consumer (manual acks) that reconnects across the URL list."""

    def __init__(self, urls: list[str], queue: str) -> None:
        super().__init__(daemon=True)
        self.urls, self.queue = urls, queue
        self.consumed: list[int] = []
        self.reconnects = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        import asyncio

        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported to the test
            self.error = exc

    async def _run(self) -> None:
        import asyncio

        import aio_pika

        while not self.stop_event.is_set():
            conn = None
            for url in self.urls:
                try:
                    conn = await aio_pika.connect(url, timeout=2)
                    break
                except (TimeoutError, ConnectionError, OSError, aio_pika.exceptions.AMQPConnectionError):
                    continue
            if conn is None:
                await asyncio.sleep(0.1)
                continue
            try:
                async with conn:
                    ch = await conn.channel()
                    await ch.set_qos(prefetch_count=50)
                    q = await ch.declare_queue(self.queue, durable=True)
                    async with q.iterator() as it:
                        stopper = asyncio.create_task(self._close_when_stopped(it))
                        try:
                            async for message in it:
                                self.consumed.append(int(message.body))
                                await message.ack()
                                if self.stop_event.is_set():
                                    break
                        finally:
                            stopper.cancel()
            except (TimeoutError, ConnectionError, OSError, asyncio.CancelledError, aio_pika.exceptions.AMQPError, RuntimeError):
                self.reconnects += 1
                await asyncio.sleep(0.05)


    async def _close_when_stopped(self, it: Any) -> None:
        """Ends the ``async for`` once asked to stop, though no further message comes (it
        waited for one: a test's ``join(10)`` took its whole 10 s). Messages taken from
        the queue but not yet handed out are not consumed: they go back with the channel."""
        import asyncio

        while not self.stop_event.is_set():
            await asyncio.sleep(0.05)
        await it.close()


def stop_all_and_read(cluster: object, queues: list[str]) -> dict[str, dict[str, list[bytes]]]:
    """Stop every node (backups first, the primary last) and read their SQLite stores.

    Returns {node: {queue: [message body, ...]}} in position order.
    """
    from brokerha.store.factory import open_store

    primary = cluster.primary()  # type: ignore[attr-defined]
    names: list[str] = list(cluster.names)  # type: ignore[attr-defined]
    for name in [n for n in names if n != primary] + ([primary] if primary else []):
        cluster.nodes[name].stop()  # type: ignore[attr-defined]
    found: dict[str, dict[str, list[bytes]]] = {}
    for name in names:
        store = open_store(None, cluster.data_dir / name)  # type: ignore[attr-defined]
        try:
            rows = list(store.load().messages)
        finally:
            store.close()
        found[name] = {q: [m.body for m in rows if m.queue == q] for q in queues}
    return found


def celery_add(name: str, broker: str | list[str], **conf: Any) -> int:
    """20 + 22 by a Celery task, through ``broker``, run by an in-process worker."""
    import uuid

    from celery import Celery
    from celery.contrib.testing.worker import start_worker

    app = Celery(name, broker=broker, backend="rpc://", set_as_current=False)
    app.conf.update(task_default_queue=f"{name}-{uuid.uuid4().hex[:8]}",
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                    broker_heartbeat=0, result_expires=60, **conf)

    @app.task(name=f"{name}.add")
    def add(x: int, y: int) -> int:
        return x + y

    try:
        with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False,
                          shutdown_timeout=10):
            return int(add.delay(20, 22).get(timeout=30))
    finally:
        # the rpc:// result consumer's connection and the producer pool's: left open (the
        # app's close() leaves them), they kept the node's stop waiting out its 2 s grace
        # for their Close-Ok
        with contextlib.suppress(AttributeError):  # no result consumer started
            app.backend.result_consumer.stop()
        app.pool.force_close_all()
        app.close()


def wait_count(count: Callable[[], int], target: int, timeout: float,
               pause: float = 0.05) -> int:
    """Until ``count()`` reaches ``target`` or ``timeout`` s pass; the last count."""
    deadline = time.monotonic() + timeout
    while (n := count()) < target and time.monotonic() < deadline:
        time.sleep(pause)
    return n
