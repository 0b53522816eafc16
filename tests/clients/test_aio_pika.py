"""aio-pika (asyncio): robust connections, exchanges, queues, iterators, RPC, confirms,
channel errors and reopening. Each test runs its own event loop via asyncio.run."""

from __future__ import annotations

import asyncio
import datetime
import decimal
import functools
import uuid

import aio_pika
import aiormq
import pytest

pytestmark = pytest.mark.timeout(30)


def run_async(fn):
    """Run an ``async def test_...(broker, names)`` inside asyncio.run with a deadline."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 20))
    return wrapper


@run_async
async def test_connect_robust_exchange_queue_publish_get(broker, names):
    conn = await aio_pika.connect_robust(broker.url)
    async with conn:
        ch = await conn.channel()
        x = await ch.declare_exchange(names("x"), aio_pika.ExchangeType.TOPIC)
        q = await ch.declare_queue(names(), auto_delete=True)
        await q.bind(x, "orders.#")
        await x.publish(aio_pika.Message(b"created", content_type="text/plain"),
                        routing_key="orders.eu.created")
        await x.publish(aio_pika.Message(b"ignored"), routing_key="users.created")
        msg = await q.get(timeout=5)
        assert msg.body == b"created" and msg.content_type == "text/plain"
        assert msg.routing_key == "orders.eu.created" and msg.exchange == x.name
        await msg.ack()
        assert await q.get(fail=False) is None
        await q.unbind(x, "orders.#")
        await x.delete()


@run_async
async def test_queue_iterator_consumes_in_order(broker, names):
    async with await aio_pika.connect_robust(broker.url) as conn:
        ch = await conn.channel()
        await ch.set_qos(prefetch_count=5)
        q = await ch.declare_queue(names(), exclusive=True)
        for i in range(20):
            await ch.default_exchange.publish(aio_pika.Message(b"%d" % i), routing_key=q.name)
        got = []
        async with q.iterator() as it:
            async for message in it:
                async with message.process():
                    got.append(message.body)
                if len(got) == 20:
                    break
        assert got == [b"%d" % i for i in range(20)]


@run_async
async def test_rpc_with_reply_to_and_correlation_id(broker, names):
    async with await aio_pika.connect_robust(broker.url) as conn:
        server_ch = await conn.channel()
        rpc_q = await server_ch.declare_queue(names("rpc"), auto_delete=True)

        async def serve(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                n = int(message.body)
                await server_ch.default_exchange.publish(
                    aio_pika.Message(str(n * n).encode(), correlation_id=message.correlation_id),
                    routing_key=message.reply_to)

        await rpc_q.consume(serve)

        client_ch = await conn.channel()
        callback_q = await client_ch.declare_queue(exclusive=True)
        futures: dict[str, asyncio.Future] = {}

        async def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            futures.pop(message.correlation_id).set_result(message.body)

        await callback_q.consume(on_reply)

        async def call(n: int) -> bytes:
            cid = str(uuid.uuid4())
            futures[cid] = asyncio.get_running_loop().create_future()
            await client_ch.default_exchange.publish(
                aio_pika.Message(str(n).encode(), correlation_id=cid, reply_to=callback_q.name),
                routing_key=rpc_q.name)
            return await futures[cid]

        assert await asyncio.gather(*(call(n) for n in range(10))) == \
            [str(n * n).encode() for n in range(10)]


@run_async
async def test_publisher_confirms_are_on_by_default_and_returns_raise(broker, names):
    async with await aio_pika.connect(broker.url) as conn:
        # publisher_confirms=True is aio-pika's default
        ch = await conn.channel(on_return_raises=True)
        q = await ch.declare_queue(names(), exclusive=True)
        confirms = await asyncio.gather(*(
            ch.default_exchange.publish(aio_pika.Message(b"%d" % i), routing_key=q.name)
            for i in range(50)))
        assert all(isinstance(c, aiormq.spec.Basic.Ack) for c in confirms)
        assert (await q.declare()).message_count == 50
        with pytest.raises(aio_pika.exceptions.DeliveryError) as info:
            await ch.default_exchange.publish(aio_pika.Message(b"x"),
                                              routing_key=names("nowhere"), mandatory=True)
        assert (info.value.frame.reply_code, info.value.frame.reply_text) == (312, "NO_ROUTE")


@run_async
async def test_all_field_types_round_trip_including_float(broker, names):
    when = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    # (pamqp cannot encode bytes values; the pika test covers byte arrays)
    headers = {"s": "text", "i": 42, "big": 2**62, "neg": -7,
               "f": 1.5, "t": True, "none": None, "d": decimal.Decimal("12.345"),
               "dt": when, "nested": {"a": [1, "b", {"c": 2.25}]}, "list": [1, 2, 3]}
    async with await aio_pika.connect(broker.url) as conn:
        ch = await conn.channel()
        q = await ch.declare_queue(names(), exclusive=True)
        await ch.default_exchange.publish(
            aio_pika.Message(b"body", headers=headers, message_id="m", priority=3,
                             correlation_id="c", app_id="a", type="t",
                             delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=q.name)
        msg = await q.get(timeout=5)
        assert msg.headers == headers
        assert (msg.message_id, msg.priority, msg.correlation_id, msg.app_id, msg.type) == \
            ("m", 3, "c", "a", "t")
        assert msg.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        await msg.ack()


@run_async
async def test_channel_closed_by_error_then_reopened(broker, names):
    async with await aio_pika.connect(broker.url) as conn:
        ch = await conn.channel()
        missing = names()
        with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity) as info:
            await ch.declare_queue(missing, passive=True)
        assert info.value.args[0] == f"NOT_FOUND - no queue '{missing}' in vhost '/'"
        assert ch.is_closed
        await ch.reopen()
        q = await ch.declare_queue(names(), exclusive=True)
        await ch.default_exchange.publish(aio_pika.Message(b"after"), routing_key=q.name)
        assert (await q.get(timeout=5)).body == b"after"
        assert not conn.is_closed


@run_async
async def test_robust_channel_recovers_after_channel_error(broker, names):
    async with await aio_pika.connect_robust(broker.url) as conn:
        ch = await conn.channel()
        q = await ch.declare_queue(names(), auto_delete=False)
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed) as info:
            await ch.declare_queue(q.name, arguments={"x-max-length": 5})
        assert "inequivalent arg 'x-max-length'" in info.value.args[0]
        for _ in range(50):  # the robust channel reopens itself
            if not ch.is_closed:
                break
            await asyncio.sleep(0.05)
        await ch.default_exchange.publish(aio_pika.Message(b"ok"), routing_key=q.name)
        assert (await q.get(timeout=5)).body == b"ok"
        await q.delete()


@run_async
async def test_transaction_commit_and_rollback(broker, names):
    async with await aio_pika.connect(broker.url) as conn:
        ch = await conn.channel(publisher_confirms=False)
        q = await ch.declare_queue(names(), exclusive=True)
        tx = ch.transaction()
        await tx.select()
        await ch.default_exchange.publish(aio_pika.Message(b"a"), routing_key=q.name)
        await tx.rollback()
        await ch.default_exchange.publish(aio_pika.Message(b"b"), routing_key=q.name)
        await tx.commit()
        assert (await q.get(timeout=5)).body == b"b"
        assert await q.get(fail=False) is None


@run_async
async def test_exclusive_queue_locked_from_other_connection(broker, names):
    async with await aio_pika.connect(broker.url) as a, \
            await aio_pika.connect(broker.url) as b:
        q = await (await a.channel()).declare_queue(names(), exclusive=True)
        with pytest.raises(aiormq.exceptions.ChannelLockedResource) as info:
            await (await b.channel()).declare_queue(q.name, passive=True)
        assert info.value.args[0].startswith("RESOURCE_LOCKED - cannot obtain exclusive access")
