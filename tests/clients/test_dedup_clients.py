"""Broker-side deduplication (x-deduplication-window) with real clients against a real node.

A client that lost the confirm of a message in a failover resends it with the
same message_id; the queue keeps one copy and the resend is confirmed too.
RabbitMQ has no such argument, so the module is skipped against BROKERHA_TEST_URL.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import aio_pika
import aiormq
import kombu
import pika
import pytest

from brokerha.testing import NodeProcess
from tests.clients.support import count_becomes, get_bodies, message_count

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(bool(os.environ.get("BROKERHA_TEST_URL")),
                       reason="x-deduplication-window is a brokerha queue argument"),
]

WINDOW = {"x-deduplication-window": 1000}


def test_pika_resend_with_the_same_message_id_is_confirmed_and_kept_once(channel, names):
    q = names()
    channel.queue_declare(q, arguments=WINDOW)
    channel.confirm_delivery()
    props = pika.BasicProperties(message_id="order-1", delivery_mode=2)
    channel.basic_publish("", q, b"order 1", props)  # raises if not acked
    channel.basic_publish("", q, b"order 1 (resent)", props)  # acked as well
    channel.basic_publish("", q, b"no id")
    channel.basic_publish("", q, b"no id")
    assert count_becomes(channel, q, 3) == 3
    assert get_bodies(channel, q) == [b"order 1", b"no id", b"no id"]
    channel.basic_publish("", q, b"order 1 after it was consumed", props)
    assert message_count(channel, q) == 0


def test_pika_header_id_and_bad_window_argument(channel, conn, names):
    q = names()
    channel.queue_declare(q, arguments=WINDOW)
    channel.confirm_delivery()
    for body in (b"a", b"b"):
        channel.basic_publish("", q, body, pika.BasicProperties(
            message_id=body.decode(), headers={"x-deduplication-id": "producer-7:1"}))
    assert get_bodies(channel, q) == [b"a"]
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        ch.queue_declare(names(), arguments={"x-deduplication-window": 0})
    assert info.value.reply_code == 406
    assert "invalid arg 'x-deduplication-window'" in info.value.reply_text


def test_aio_pika_resend_is_confirmed_and_kept_once(broker, names):
    async def main() -> list[bytes]:
        async with await aio_pika.connect(broker.url) as conn:
            ch = await conn.channel()  # publisher confirms: aio-pika's default
            q = await ch.declare_queue(names(), arguments=WINDOW)
            msg_id = str(uuid.uuid4())
            confirms = [
                await ch.default_exchange.publish(
                    aio_pika.Message(body, message_id=msg_id), routing_key=q.name)
                for body in (b"first", b"resent")
            ]
            assert all(isinstance(c, aiormq.spec.Basic.Ack) for c in confirms)
            got = []
            while (m := await q.get(fail=False, no_ack=True)) is not None:
                got.append(m.body)
            await q.delete()
            return got

    assert asyncio.run(asyncio.wait_for(main(), 20)) == [b"first"]


def test_kombu_resend_with_message_id_is_confirmed_and_kept_once(broker, names):
    queue = kombu.Queue(names(), queue_arguments=WINDOW, auto_delete=False)
    with kombu.Connection(broker.url, connect_timeout=5,
                          transport_options={"confirm_publish": True}) as conn:
        producer = conn.Producer(serializer="json")
        for attempt in (1, 2):  # confirm_publish: publish raises unless acked
            producer.publish({"order": 1, "attempt": attempt}, routing_key=queue.name,
                             declare=[queue], message_id="order-1")
        simple = conn.SimpleQueue(queue)
        first = simple.get(block=True, timeout=5)
        assert first.payload == {"order": 1, "attempt": 1}
        assert first.properties["message_id"] == "order-1"
        first.ack()
        with pytest.raises(simple.Empty):
            simple.get(block=True, timeout=0.3)
        simple.close()


def test_window_survives_a_sigkill_for_the_messages_still_queued(tmp_path):
    node = NodeProcess("dedup-restart", data_dir=tmp_path / "data")
    params = None
    try:
        node.start()
        params = pika.URLParameters(node.url)
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        ch.queue_declare("orders", durable=True, arguments=WINDOW)
        ch.confirm_delivery()
        persistent = {"delivery_mode": 2}
        for i in range(3):
            ch.basic_publish("", "orders", b"order %d" % i,
                             pika.BasicProperties(message_id=f"order-{i}", **persistent))
        node.kill()  # crash: the confirms were sent, the store holds the three messages
        node = NodeProcess("dedup-restart", port=node.port, data_dir=tmp_path / "data")
        node.start()
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        ch.queue_declare("orders", durable=True, arguments=WINDOW)
        ch.confirm_delivery()
        for i in range(3):  # the client resends what it believes unconfirmed
            ch.basic_publish("", "orders", b"order %d (resent)" % i,
                             pika.BasicProperties(message_id=f"order-{i}", **persistent))
        ch.basic_publish("", "orders", b"order 3",
                         pika.BasicProperties(message_id="order-3", **persistent))
        assert get_bodies(ch, "orders") == [b"order 0", b"order 1", b"order 2", b"order 3"]
        conn.close()
    finally:
        node.close()
