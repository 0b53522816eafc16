"""XA through unmodified pika, kombu and aio-pika, against a real node."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import aio_pika
import kombu
import pika
import pytest

from brokerha.client.dtx import (
    XA_OK,
    XA_RBROLLBACK,
    XA_RDONLY,
    XAER_DUPID,
    XAER_NOTA,
    XAER_PROTO,
    AioPikaXAResource,
    KombuXAResource,
    PikaXAResource,
    XAException,
    Xid,
)
from brokerha.testing import NodeProcess


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    with NodeProcess("dtx") as n:
        yield n


def new_xid() -> Xid:
    return Xid(7, uuid.uuid4().bytes, b"brokerha")


@pytest.fixture()
def channel(node: NodeProcess) -> Iterator[pika.adapters.blocking_connection.BlockingChannel]:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    yield conn.channel()
    if conn.is_open:
        conn.close()


def depth(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def test_pika_two_phase_commit_publishes_and_acks_together(channel) -> None:  # type: ignore[no-untyped-def]
    q = f"dtx-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(q)
    channel.basic_publish("", q, b"to-consume")
    xa = PikaXAResource(channel)
    xid = new_xid()
    method, _, body = channel.basic_get(q)
    assert body == b"to-consume"
    xa.start(xid)
    channel.basic_publish("", q, b"new-1")
    channel.basic_publish("", q, b"new-2")
    channel.basic_ack(method.delivery_tag)
    assert xa.end(xid) == XA_OK
    assert depth(channel, q) == 0  # nothing visible before commit
    assert xa.prepare(xid) == XA_OK
    assert xid in xa.recover()
    xa.commit(xid)
    assert xid not in xa.recover()
    bodies = [channel.basic_get(q, auto_ack=True)[2] for _ in range(2)]
    assert bodies == [b"new-1", b"new-2"]
    assert depth(channel, q) == 0  # the consumed message is gone for good


def test_pika_rollback_restores_the_consumed_message(channel) -> None:  # type: ignore[no-untyped-def]
    q = f"dtx-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(q)
    channel.basic_publish("", q, b"keep-me")
    xa = PikaXAResource(channel)
    xid = new_xid()
    method, _, _ = channel.basic_get(q)
    xa.start(xid)
    channel.basic_publish("", q, b"discarded")
    channel.basic_ack(method.delivery_tag)
    xa.end(xid)
    assert xa.prepare(xid) == XA_OK
    xa.rollback(xid)
    got = channel.basic_get(q, auto_ack=True)
    assert got[2] == b"keep-me" and got[0].redelivered
    assert depth(channel, q) == 0


def test_pika_xa_errors_arrive_as_xa_exceptions(channel) -> None:  # type: ignore[no-untyped-def]
    xa = PikaXAResource(channel)
    xid = new_xid()
    with pytest.raises(XAException) as nota:
        xa.commit(xid)
    assert nota.value.code == XAER_NOTA
    xa.start(xid)
    with pytest.raises(XAException) as dup:
        xa.start(xid)
    assert dup.value.code in (XAER_DUPID, XAER_PROTO)
    with pytest.raises(XAException) as proto:
        xa.prepare(xid)
    assert proto.value.code == XAER_PROTO
    assert xa.end(xid, fail=True) == XA_RBROLLBACK
    with pytest.raises(XAException) as rb:
        xa.prepare(xid)
    assert rb.value.code == XA_RBROLLBACK


def test_pika_one_phase_commit_and_read_only(channel) -> None:  # type: ignore[no-untyped-def]
    q = f"dtx-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(q)
    xa = PikaXAResource(channel)
    empty = new_xid()
    xa.start(empty)
    xa.end(empty)
    assert xa.prepare(empty) == XA_RDONLY
    xid = new_xid()
    xa.start(xid)
    channel.basic_publish("", q, b"1pc")
    xa.end(xid)
    xa.commit(xid, one_phase=True)
    assert channel.basic_get(q, auto_ack=True)[2] == b"1pc"


def test_pika_timeout_and_closed_channel(node: NodeProcess) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    xa = PikaXAResource(ch)
    xid = new_xid()
    xa.start(xid)
    xa.set_transaction_timeout(xid, 0.3)
    assert xa.get_transaction_timeout(xid) == pytest.approx(0.3)
    conn.sleep(0.6)
    assert xa.end(xid) in (106,)  # XA_RBTIMEOUT
    conn.close()


def test_kombu_channel(node: NodeProcess) -> None:
    q = f"dtx-{uuid.uuid4().hex[:8]}"
    with kombu.Connection(node.url) as conn:
        ch = conn.default_channel
        ch.queue_declare(queue=q)
        xa = KombuXAResource(ch)
        xid = new_xid()
        xa.start(xid)
        ch.basic_publish(ch.prepare_message(b"via-kombu"), exchange="", routing_key=q)
        xa.end(xid)
        assert xa.prepare(xid) == XA_OK
        xa.commit(xid)
        msg = ch.basic_get(queue=q, no_ack=True)
        assert msg is not None and msg.body == b"via-kombu"


def test_aio_pika_channel(node: NodeProcess) -> None:
    async def scenario() -> bytes:
        conn = await aio_pika.connect(node.url)
        async with conn:
            ch = await conn.channel()
            queue = await ch.declare_queue(f"dtx-{uuid.uuid4().hex[:8]}")
            xa = AioPikaXAResource(ch)
            xid = new_xid()
            await xa.start(xid)
            await ch.default_exchange.publish(aio_pika.Message(b"via-aio-pika"),
                                              routing_key=queue.name)
            await xa.end(xid)
            assert await xa.prepare(xid) == XA_OK
            assert xid in await xa.recover()
            await xa.commit(xid)
            msg = await queue.get(no_ack=True)
            return msg.body

    assert asyncio.run(scenario()) == b"via-aio-pika"


def test_control_message_without_reply_to_is_406(channel) -> None:  # type: ignore[no-untyped-def]
    channel.basic_publish("amq.dtx", "recover", b"{}")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        channel.queue_declare("x", passive=True)
    assert info.value.reply_code == 406
