"""kombu (py-amqp transport) and a Celery worker round-tripping a task."""

from __future__ import annotations

import socket

import kombu
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

pytestmark = pytest.mark.timeout(60)


def test_kombu_producer_consumer_with_declared_exchange_and_queue(broker, names):
    exchange = Exchange(names("x"), type="direct", durable=False, auto_delete=False)
    queue = Queue(names(), exchange=exchange, routing_key="work", durable=False,
                  auto_delete=False)
    received = []
    with Connection(broker.url, connect_timeout=5) as conn:
        with conn.channel() as ch:
            producer = Producer(ch, exchange=exchange, routing_key="work",
                                serializer="json")
            queue(ch).declare()
            for i in range(5):
                producer.publish({"n": i}, headers={"attempt": 1},
                                 declare=[queue], retry=False)

            def on_message(body, message):
                received.append((body, message.headers["attempt"]))
                message.ack()

            with Consumer(ch, queues=[queue], callbacks=[on_message], accept=["json"]):
                while len(received) < 5:
                    conn.drain_events(timeout=5)
            queue(ch).delete()
            exchange(ch).delete()
    assert received == [({"n": i}, 1) for i in range(5)]


def test_kombu_simple_queue_put_get(broker, names):
    name = names()
    with Connection(broker.url, connect_timeout=5) as conn:
        sq = conn.SimpleQueue(name)
        sq.put({"hello": "world"})
        sq.put("second")
        first = sq.get(block=True, timeout=5)
        assert first.payload == {"hello": "world"}
        first.ack()
        second = sq.get(block=True, timeout=5)
        assert second.payload == "second"
        second.ack()
        with pytest.raises(sq.Empty):
            sq.get(block=True, timeout=0.3)
        sq.clear()
        sq.close()


def test_kombu_drain_events_times_out_when_idle(broker, names):
    with Connection(broker.url, connect_timeout=5) as conn:
        q = Queue(names(), exclusive=True)
        with conn.Consumer([q], callbacks=[lambda b, m: None]):
            with pytest.raises(socket.timeout):
                conn.drain_events(timeout=0.3)


def test_celery_task_round_trip_through_in_process_worker(broker, names):
    from celery import Celery
    from celery.contrib.testing.worker import start_worker

    app = Celery("brokerha_conformance", broker=broker.url, backend="rpc://",
                 set_as_current=False)
    task_queue = names("celery")
    app.conf.update(
        task_default_queue=task_queue,
        broker_connection_retry_on_startup=False,
        broker_connection_max_retries=1,
        worker_hijack_root_logger=False,
        # with heartbeats on, the worker's event loop polls for up to half the
        # heartbeat interval and then cannot stop within start_worker's timeout
        broker_heartbeat=0,
        result_expires=60,
    )

    @app.task(name="conformance.add")
    def add(x: int, y: int) -> int:
        return x + y

    with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False,
                      shutdown_timeout=10):
        results = [add.delay(i, i) for i in range(3)]
        assert [r.get(timeout=20) for r in results] == [0, 2, 4]
    with kombu.Connection(broker.url) as conn:
        conn.default_channel.queue_delete(task_queue)
