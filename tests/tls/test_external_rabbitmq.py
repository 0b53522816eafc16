"""SASL EXTERNAL as RabbitMQ does it: the same client certificates against a private RabbitMQ
node (rabbitmq_auth_mechanism_ssl, ``ssl_cert_login_from = distinguished_name``) and a
brokerha node configured alike; the mechanisms offered on amqps, the reply to each
refusal and the logged reason must be the same.
"""

from __future__ import annotations

import socket
import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
from pamqp import frame

from tests.tls.conftest import Certs, TLSNode

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from rabbitmq_ref import RabbitMQRef, available  # noqa: E402

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120),
              pytest.mark.skipif(not available(), reason="rabbitmq-server is not installed")]


class Rabbit:
    def __init__(self, ref: RabbitMQRef) -> None:
        self.ref = ref
        assert ref.ssl_port is not None
        self.amqps_port = ref.ssl_port

    def log_text(self) -> str:
        assert self.ref.base is not None
        return "\n".join(f.read_text(errors="replace") for f in (self.ref.base / "log").iterdir()
                         if f.is_file())


@pytest.fixture(scope="module")
def rabbit(certs: Certs) -> Iterator[Rabbit]:
    ref = RabbitMQRef(tls=(certs.pem("server"), certs.key("server"), certs.pem("ca")),
                      verify_peer=True, plugins=("rabbitmq_auth_mechanism_ssl",),
                      extra_config="auth_mechanisms.1 = PLAIN\nauth_mechanisms.2 = AMQPLAIN\n"
                                   "auth_mechanisms.3 = EXTERNAL\n"
                                   "ssl_cert_login_from = distinguished_name\n")
    with ref:
        yield Rabbit(ref)


@pytest.fixture(scope="module")
def dn_node(certs: Certs) -> Iterator[TLSNode]:
    with TLSNode(certs, extra=["--tls-login-from", "distinguished_name"]) as node:
        yield node


def mechanisms(port: int, ctx: ssl.SSLContext) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(b"AMQP\x00\x00\x09\x01")
            data = b""
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                data += tls.recv(65536)
                try:
                    _, _, start = frame.unmarshal(data)
                    return str(start.mechanisms)
                except Exception:  # noqa: BLE001 - not the whole frame yet
                    continue
    raise AssertionError("no connection.start")


def external_refusal(port: int, ctx: ssl.SSLContext) -> str:
    params = pika.ConnectionParameters(port=port, connection_attempts=1, ssl_options=pika.SSLOptions(
        ctx, "localhost"), credentials=pika.credentials.ExternalCredentials())
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as info:
        pika.BlockingConnection(params)
    return str(info.value)


def logged(read: object, text: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in read():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_external_offers_and_refusals_match_rabbitmq(rabbit: Rabbit, dn_node: TLSNode,
                                                     certs: Certs) -> None:
    brokers = {"RabbitMQ": (rabbit.amqps_port, rabbit.log_text),
               "brokerha": (dn_node.amqps_port, dn_node.log_text)}
    for name, (port, log_text) in brokers.items():
        # the same set (RabbitMQ's order follows its registry table, not its configuration)
        offered = mechanisms(port, certs.client_context()).split()
        assert sorted(offered) == ["AMQPLAIN", "EXTERNAL", "PLAIN"], (name, offered)
        # the DN of alice's certificate names no user on either broker
        reply = external_refusal(port, certs.client_context("client-alice"))
        assert "(403) 'ACCESS_REFUSED - Login was refused using authentication mechanism " \
               "EXTERNAL. For details see the broker logfile.'" in reply, name
        assert logged(log_text, "EXTERNAL login refused: user 'CN=alice,O=brokerha' - "
                                "invalid credentials"), name
        reply = external_refusal(port, certs.client_context())
        assert "ACCESS_REFUSED - Login was refused using authentication mechanism EXTERNAL" \
               in reply, name
        assert logged(log_text, "EXTERNAL login refused: connection peer presented no TLS "
                                "(x.509) certificate"), name
