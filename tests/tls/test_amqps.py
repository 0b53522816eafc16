"""amqps: pika, aio-pika, kombu and a Celery worker over TLS; SASL EXTERNAL; every refusal.

The node asks for client certificates and checks them against its CA
(``--tls-verify-peer``); ``strict_node`` also requires one and has plain AMQP
off. Each refusal is seen by the client (the connection fails) and logged by
the node with the reason.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid

import kombu
import pika
import pika.exceptions
import pytest

from tests.tls.conftest import Certs, TLSNode

pytestmark = pytest.mark.timeout(60)


def wait_log(node: TLSNode, text: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(node.log):
            if text in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the node's log:\n{node.log_text()[-3000:]}")


def pika_params(node: TLSNode, ctx: ssl.SSLContext, **kw: object) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(port=node.amqps_port, ssl_options=pika.SSLOptions(
        ctx, "localhost"), connection_attempts=1, socket_timeout=5, **kw)  # type: ignore[arg-type]


def round_trip(conn: pika.BlockingConnection) -> bytes:
    ch = conn.channel()
    queue = ch.queue_declare("", exclusive=True).method.queue
    ch.confirm_delivery()
    ch.basic_publish("", queue, b"over tls", pika.BasicProperties(delivery_mode=2))
    _, _, body = ch.basic_get(queue, auto_ack=True)
    return body


def test_pika_over_amqps_with_a_password_and_no_client_certificate(tls_node: TLSNode) -> None:
    with pika.BlockingConnection(pika.URLParameters(tls_node.amqps_url())) as conn:
        assert round_trip(conn) == b"over tls"
    # and the plain listener is still there beside it
    with pika.BlockingConnection(pika.URLParameters(tls_node.url)) as conn:
        assert round_trip(conn) == b"over tls"


def test_tls_1_2_clients_connect_and_1_3_is_the_default(tls_node: TLSNode, certs: Certs) -> None:
    for version in (ssl.TLSVersion.TLSv1_2, None):
        ctx = certs.client_context()
        if version is not None:
            ctx.maximum_version = version
        with pika.BlockingConnection(pika_params(tls_node, ctx)) as conn:
            sock = conn._impl._transport._sock  # type: ignore[attr-defined]
            assert sock.version() == ("TLSv1.2" if version else "TLSv1.3")
            assert round_trip(conn) == b"over tls"


def test_external_login_with_a_client_certificate(tls_node: TLSNode, certs: Certs) -> None:
    params = pika_params(tls_node, certs.client_context("client-alice"),
                         credentials=pika.credentials.ExternalCredentials())
    with pika.BlockingConnection(params) as conn:
        assert round_trip(conn) == b"over tls"
        port = conn._impl._transport._sock.getsockname()[1]  # type: ignore[attr-defined]
    assert "(alice) opened vhost '/'" in wait_log(tls_node, f"127.0.0.1:{port} (alice) opened")


def test_aio_pika_over_amqps_with_a_client_certificate(tls_node: TLSNode, certs: Certs) -> None:
    import aio_pika

    async def go() -> bytes:
        conn = await aio_pika.connect(
            f"amqps://localhost:{tls_node.amqps_port}/?auth=external",
            ssl_context=certs.client_context("client-alice"), timeout=10)
        async with conn:
            ch = await conn.channel(publisher_confirms=True)
            queue = await ch.declare_queue(exclusive=True)
            await ch.default_exchange.publish(aio_pika.Message(b"aio"), routing_key=queue.name)
            message = await queue.get(timeout=5)
            await message.ack()
            return message.body

    assert asyncio.run(go()) == b"aio"


def kombu_ssl(node: TLSNode, client: str | None = "client-guest") -> dict[str, object]:
    opts: dict[str, object] = {"ca_certs": str(node.certs.pem("ca")),
                               "cert_reqs": ssl.CERT_REQUIRED, "server_hostname": "localhost"}
    if client is not None:
        opts.update(certfile=str(node.certs.pem(client)), keyfile=str(node.certs.key(client)))
    return opts


def test_kombu_over_amqps(strict_node: TLSNode) -> None:
    url = f"amqp://guest:guest@localhost:{strict_node.amqps_port}//"
    with kombu.Connection(url, ssl=kombu_ssl(strict_node), connect_timeout=5) as conn:
        name = f"kombu-tls-{uuid.uuid4().hex[:8]}"
        q = conn.SimpleQueue(name)
        q.put({"n": 1})
        msg = q.get(timeout=5)
        assert msg.payload == {"n": 1}
        msg.ack()
        q.close()
        conn.default_channel.queue_delete(name)


def test_celery_worker_over_amqps(strict_node: TLSNode) -> None:
    from celery import Celery
    from celery.contrib.testing.worker import start_worker

    url = f"amqps://guest:guest@localhost:{strict_node.amqps_port}//"
    app = Celery("brokerha_tls", broker=url, backend="rpc://", set_as_current=False)
    task_queue = f"celery-tls-{uuid.uuid4().hex[:8]}"
    app.conf.update(task_default_queue=task_queue, broker_use_ssl=kombu_ssl(strict_node),
                    broker_connection_retry_on_startup=False, broker_connection_max_retries=1,
                    worker_hijack_root_logger=False, broker_heartbeat=0, result_expires=60)

    @app.task(name="tls.mul")
    def mul(x: int, y: int) -> int:
        return x * y

    with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False,
                      shutdown_timeout=10):
        assert [mul.delay(i, 3).get(timeout=20) for i in range(3)] == [0, 3, 6]


# ---- refusals ---------------------------------------------------------------------------

def test_a_plain_client_on_the_amqps_port_is_refused(tls_node: TLSNode) -> None:
    params = pika.ConnectionParameters(port=tls_node.amqps_port, connection_attempts=1,
                                       socket_timeout=3, blocked_connection_timeout=3)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(params)
    line = wait_log(tls_node, "amqps: TLS handshake with")
    assert "connection refused" in line


def assert_tls_refused(node: TLSNode, ctx: ssl.SSLContext, reason: str) -> None:
    """The client's handshake or its first read fails; the node logs ``reason``."""
    with pytest.raises((pika.exceptions.AMQPConnectionError, ssl.SSLError, ConnectionError)):
        with pika.BlockingConnection(pika_params(node, ctx)) as conn:
            conn.channel()
    assert reason in wait_log(node, reason)


def test_a_certificate_from_another_ca_is_refused(tls_node: TLSNode, certs: Certs) -> None:
    assert_tls_refused(tls_node, certs.client_context("client-other-ca"),
                       "certificate verify failed")


def test_an_expired_certificate_is_refused(tls_node: TLSNode, certs: Certs) -> None:
    assert_tls_refused(tls_node, certs.client_context("client-expired"),
                       "certificate has expired")


def test_no_certificate_where_one_is_required_is_refused(strict_node: TLSNode,
                                                          certs: Certs) -> None:
    assert_tls_refused(strict_node, certs.client_context(), "peer did not return a certificate")


def test_plain_amqp_can_be_turned_off(strict_node: TLSNode) -> None:
    params = pika.URLParameters(strict_node.url)
    params.connection_attempts = 1
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(params)
    assert "AMQP 0-9-1 on amqps 127.0.0.1" in wait_log(strict_node, " ready")


def external_refused(node: TLSNode, ctx: ssl.SSLContext, logged: str) -> None:
    params = pika_params(node, ctx, credentials=pika.credentials.ExternalCredentials())
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as info:
        pika.BlockingConnection(params)
    assert "ACCESS_REFUSED - Login was refused using authentication mechanism EXTERNAL. " \
           "For details see the broker logfile." in str(info.value)
    assert logged in wait_log(node, logged)


def test_a_certificate_whose_subject_is_no_user_is_refused(tls_node: TLSNode,
                                                           certs: Certs) -> None:
    external_refused(tls_node, certs.client_context("client-nobody"),
                     "EXTERNAL login refused: user 'nobody' - invalid credentials")


def test_external_without_a_certificate_is_refused(tls_node: TLSNode, certs: Certs) -> None:
    external_refused(tls_node, certs.client_context(), "EXTERNAL login refused: connection "
                     "peer presented no TLS (x.509) certificate")


def test_external_is_not_offered_on_plain_amqp(tls_node: TLSNode) -> None:
    params = pika.ConnectionParameters(port=tls_node.port, connection_attempts=1,
                                       credentials=pika.credentials.ExternalCredentials())
    with pytest.raises(pika.exceptions.AuthenticationError):
        pika.BlockingConnection(params)
