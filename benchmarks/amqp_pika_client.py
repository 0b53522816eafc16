"""The throughput workloads driven by a real client: pika's BlockingConnection.

The same three workloads as ``loadgen.py`` (the ``Workload`` and ``Settings``
definitions are shared), written the way an application would write them:

- the consumer runs in a second process (``basic_consume``; auto-ack for the
  pipe, manual ``basic_ack(multiple=True)`` every ``prefetch // 4`` messages
  otherwise), so publisher and consumer do not share one GIL;
- the publisher uses ``basic_publish``; with ``confirm_delivery()`` each
  publish waits for its confirm (pika's blocking API has one confirm in
  flight), and for tx it calls ``tx_commit()`` after every ``tx_size``
  publishes.

As in the load generator, the publisher stays at most ``pipe_window`` messages
ahead of the consumer. Figures from here measure pika as much as the broker:
pika spends more CPU per message than either broker does.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.synchronize
import time
import uuid
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized

import pika
from loadgen import WORKLOADS, Counts, Result, Settings, Workload
from pika.adapters.blocking_connection import BlockingChannel

STARTUP_TIMEOUT = 30.0


def _declare(channel: BlockingChannel, queue: str, workload: Workload) -> None:
    channel.queue_declare(queue, durable=workload.durable_queue)


def consume(
    url: str, queue: str, workload_name: str, prefetch: int,
    delivered: Synchronized[int], ready: mp.synchronize.Event, stop: mp.synchronize.Event,
) -> None:
    """The consumer process: count deliveries into ``delivered`` until ``stop``."""
    workload = WORKLOADS[workload_name]
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        _declare(ch, queue, workload)
        ack_every = max(1, prefetch // 4)
        count = 0

        def on_message(channel: BlockingChannel, method: pika.spec.Basic.Deliver,
                       _props: pika.BasicProperties, _body: bytes) -> None:
            nonlocal count
            count += 1
            delivered.value = count
            if not workload.auto_ack and count % ack_every == 0:
                channel.basic_ack(method.delivery_tag, multiple=True)

        if not workload.auto_ack:
            ch.basic_qos(prefetch_count=prefetch)
        ch.basic_consume(queue, on_message, auto_ack=workload.auto_ack)
        ready.set()
        while not stop.is_set():
            conn.process_data_events(time_limit=0.1)
    finally:
        if conn.is_open:
            conn.close()


class PikaRun:
    """One workload with pika: publisher here, consumer in a child process."""

    def __init__(self, url: str, workload: Workload, settings: Settings) -> None:
        self.url = url
        self.workload = workload
        self.settings = settings
        self.queue = f"pika-{workload.name}-{uuid.uuid4().hex[:12]}"
        ctx = mp.get_context("spawn")
        self.delivered: Synchronized[int] = ctx.Value("q", 0, lock=False)  # type: ignore[assignment]
        self.ready = ctx.Event()
        self.stop = ctx.Event()
        self.consumer = ctx.Process(
            target=consume, name=f"pika-consumer-{workload.name}", daemon=True,
            args=(url, self.queue, workload.name, settings.prefetch, self.delivered,
                  self.ready, self.stop),
        )
        self.published = 0
        self.commits = 0

    def counts(self) -> Counts:
        return Counts(time.perf_counter(), time.process_time(), self.published,
                      self.delivered.value, self.published if self.workload.confirm else 0,
                      self.commits)

    def publish_until(self, ch: BlockingChannel, conn: pika.BlockingConnection,
                      deadline: float) -> None:
        w, window = self.workload, self.settings.pipe_window
        body = b"x" * self.settings.body_size
        props = pika.BasicProperties(delivery_mode=2 if w.persistent else None)
        while time.perf_counter() < deadline:
            if self.published - self.delivered.value >= window:
                conn.process_data_events(time_limit=0)
                time.sleep(0.0002)
                continue
            for _ in range(w.tx_size or 16):
                ch.basic_publish("", self.queue, body, props)  # waits for its confirm if any
            self.published += w.tx_size or 16
            if w.tx_size:
                ch.tx_commit()
                self.commits += 1

    def run(self, duration: float, warmup: float,
            on_window: Callable[[str], None] | None) -> tuple[Counts, Counts]:
        conn = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            ch = conn.channel()
            _declare(ch, self.queue, self.workload)
            self.consumer.start()
            if not self.ready.wait(STARTUP_TIMEOUT) or not self.consumer.is_alive():
                raise RuntimeError("pika consumer process did not start")
            if self.workload.confirm:
                ch.confirm_delivery()
            if self.workload.tx_size:
                ch.tx_select()
            self.publish_until(ch, conn, time.perf_counter() + warmup)
            if on_window:
                on_window("start")
            first = self.counts()
            self.publish_until(ch, conn, first.t + duration)
            last = self.counts()
            if on_window:
                on_window("end")
            self._stop_consumer()
            ch.queue_delete(self.queue)
            return first, last
        finally:
            self._stop_consumer()
            if conn.is_open:
                conn.close()

    def _stop_consumer(self) -> None:
        """Ask the consumer to stop; terminate it (our child, by PID) if it does not."""
        self.stop.set()
        if self.consumer.pid is None:
            return
        self.consumer.join(10)
        if self.consumer.is_alive():
            self.consumer.terminate()
            self.consumer.join(5)


def run_workload(
    url: str,
    workload: str | Workload,
    duration: float = 5.0,
    warmup: float = 1.0,
    settings: Settings | None = None,
    on_window: Callable[[str], None] | None = None,
) -> Result:
    """Run one workload with pika; same signature and result as ``loadgen.run_workload``."""
    w = WORKLOADS[workload] if isinstance(workload, str) else workload
    run = PikaRun(url, w, settings or Settings())
    first, last = run.run(duration, warmup, on_window)
    return Result(
        workload=w.name, client="pika", duration=last.t - first.t,
        published=last.published - first.published,
        delivered=last.delivered - first.delivered,
        confirmed=last.confirmed - first.confirmed,
        commits=last.commits - first.commits,
        client_cpu_s=last.cpu - first.cpu,  # the publisher process only
        total_delivered=run.delivered.value,
    )
