"""Any node is an entry point: each node's URL alone works, whatever its role.

Real processes, real clients: pika, aio-pika and kombu given one node's URL
declare, publish with confirms, consume and commit transactions; a Celery
worker runs through a backup's address; the primary is SIGKILLed while a
publisher uses a backup's address, and nothing confirmed is lost. The relay
preamble (brokerha/node/relay.py) is checked too: only a cluster member can
speak for a client.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Iterator

import pika
import pytest

from brokerha.amqp.connection import ExternalIdentity
from brokerha.node.relay import (
    PreambleError,
    PreambleReader,
    RelayedClient,
    decode_preamble,
    encode_preamble,
)
from brokerha.testing import LocalCluster
from tests.failover.clients import ConfirmedPublisher, celery_add, drain, wait_count

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3) as c:
        primary = c.wait_primary()
        for name in c.names:
            if name != primary:
                c.wait_ready(name)
        yield c


def pika_round_trip(url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.queue_declare(queue, durable=True)
        ch.confirm_delivery()
        ch.basic_publish("", queue, b"confirmed", pika.BasicProperties(delivery_mode=2))
        tx = conn.channel()
        tx.tx_select()
        for i in range(3):
            tx.basic_publish("", queue, f"tx-{i}".encode(), pika.BasicProperties(delivery_mode=2))
        tx.tx_commit()
        got = []
        for method, _, body in ch.consume(queue, inactivity_timeout=5):
            assert method is not None, f"consume through {url} stalled after {got}"
            got.append(body)
            ch.basic_ack(method.delivery_tag)
            if len(got) == 4:
                break
        ch.cancel()
        assert got == [b"confirmed", b"tx-0", b"tx-1", b"tx-2"]
    finally:
        conn.close()


async def aio_pika_round_trip(url: str, queue: str) -> None:
    import aio_pika

    conn = await aio_pika.connect(url)
    try:
        ch = await conn.channel(publisher_confirms=True)
        q = await ch.declare_queue(queue, durable=True)
        await ch.default_exchange.publish(aio_pika.Message(b"aio"), routing_key=queue)
        tx_channel = await conn.channel(publisher_confirms=False)
        tx = tx_channel.transaction()
        await tx.select()
        await tx_channel.default_exchange.publish(aio_pika.Message(b"aio-tx"), routing_key=queue)
        await tx.commit()
        got = []
        async with q.iterator(timeout=5) as messages:
            async for message in messages:
                async with message.process():
                    got.append(message.body)
                if len(got) == 2:
                    break
        assert got == [b"aio", b"aio-tx"]
    finally:
        await conn.close()


def kombu_round_trip(url: str, queue: str) -> None:
    import kombu

    with kombu.Connection(url, connect_timeout=3) as conn:
        q = conn.SimpleQueue(queue)
        q.put({"via": url})
        msg = q.get(timeout=5)
        assert msg.payload == {"via": url}
        msg.ack()
        q.close()


def test_each_nodes_url_alone_serves_pika_aio_pika_and_kombu(cluster: LocalCluster) -> None:
    primary = cluster.primary()
    for name in cluster.names:
        url = cluster.url(name)
        tag = f"{name}-{uuid.uuid4().hex[:6]}"
        pika_round_trip(url, f"pika-{tag}")
        asyncio.run(aio_pika_round_trip(url, f"aio-{tag}"))
        kombu_round_trip(url, f"kombu-{tag}")
        status = cluster.status(name)
        assert status is not None
        role = status["node"]["role"]
        assert role == ("primary" if name == primary else "backup"), status["node"]


def test_a_celery_worker_through_a_backups_address(cluster: LocalCluster) -> None:

    backup = next(n for n in cluster.names if n != cluster.primary())
    assert celery_add("celery-relay", cluster.url(backup)) == 42
    relayed = cluster.status(backup)
    assert relayed is not None and relayed["node"]["role"] == "backup"


def test_a_publisher_on_a_backups_address_loses_nothing_when_the_primary_dies(
        cluster: LocalCluster) -> None:
    primary = cluster.wait_primary()
    backup = next(n for n in cluster.names if n != primary)
    queue = f"relay-kill-{uuid.uuid4().hex[:6]}"

    def declare(ch: object) -> None:
        ch.queue_declare(queue, durable=True)  # type: ignore[attr-defined]

    publisher = ConfirmedPublisher([cluster.url(backup)], queue, declare=declare, limit=100_000)
    publisher.start()
    def confirmed() -> int:
        return len(publisher.confirmed)

    assert wait_count(confirmed, 200, 20) >= 200, publisher.error
    cluster.kill(primary)
    at_kill = confirmed()
    wait_count(confirmed, at_kill + 200, 30)
    publisher.stop_event.set()
    publisher.join(30)
    assert publisher.error is None, publisher.error
    assert len(publisher.confirmed) >= at_kill + 200, "no confirms through the backup after"
    assert publisher.reconnects >= 1
    new_primary = cluster.wait_primary(other_than=primary)
    stored = set(drain([cluster.url(new_primary)], queue))
    lost = set(publisher.confirmed) - stored
    assert not lost, f"{len(lost)} confirmed messages lost, e.g. {sorted(lost)[:5]}"
    cluster.restart(primary)


def test_only_a_cluster_member_can_name_the_client() -> None:
    secret = b"s" * 32
    client = RelayedClient("203.0.113.7", 40000, ExternalIdentity("O=x,CN=app", None))
    line = encode_preamble(client, secret, now=1000)
    assert decode_preamble(line[:-2], secret, now=1001) == client
    with pytest.raises(PreambleError, match="not signed"):
        decode_preamble(line[:-2], b"t" * 32, now=1001)
    with pytest.raises(PreambleError, match="old"):
        decode_preamble(line[:-2], secret, now=1000 + 120)
    forged = line.replace(b"203.0.113.7", b"127.0.0.1")
    with pytest.raises(PreambleError, match="not signed"):
        decode_preamble(forged[:-2], secret, now=1001)
    # the primary's reader: a preamble split over two reads, then AMQP's own bytes
    reader = PreambleReader(secret)
    stamped = encode_preamble(client, secret)
    assert reader.feed(stamped[:10]) is None
    found = reader.feed(stamped[10:] + b"AMQP\x00\x00\x09\x01")
    assert found == (client, b"AMQP\x00\x00\x09\x01")
    plain = PreambleReader(secret).feed(b"AMQP\x00\x00\x09\x01")
    assert plain == (None, b"AMQP\x00\x00\x09\x01")
    with pytest.raises(PreambleError, match="too long"):
        PreambleReader(secret).feed(b"BRKHA-RELAY/1 " + b"x" * 2000)


def test_a_forged_preamble_is_refused_by_the_primary(cluster: LocalCluster) -> None:
    """A client cannot claim to be relayed (e.g. to pass as loopback): the socket is closed."""
    primary = cluster.wait_primary()
    forged = encode_preamble(RelayedClient("127.0.0.1", 1), b"not-the-cluster-secret-0123456789")
    with socket.create_connection(("127.0.0.1", cluster.port(primary)), timeout=5) as s:
        s.sendall(forged + b"AMQP\x00\x00\x09\x01")
        s.settimeout(5)
        try:
            answer = s.recv(100)
        except ConnectionResetError:
            answer = b""
    assert answer == b"", "the primary answered a forged relay preamble"
