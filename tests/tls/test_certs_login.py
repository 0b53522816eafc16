"""``brokerha tls make-certs``, and SASL EXTERNAL with the whole subject DN (``login_from``)."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from pathlib import Path

import pika
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from brokerha.node.tls import login_name
from brokerha.testing import NodeProcess, free_port
from tests.tls.conftest import Certs

pytestmark = pytest.mark.timeout(60)


def make_certs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "brokerha.cli", "tls", "make-certs", *args],
                          capture_output=True, text=True, timeout=60)


def test_make_certs_writes_a_ca_node_and_client_certificates_and_reuses_the_ca(
        tmp_path: Path) -> None:
    d = tmp_path / "tls"
    done = make_certs(str(d), "--name", "n1", "--client", "alice", "--host", "mq.example")
    assert done.returncode == 0, done.stderr
    assert {p.name for p in d.iterdir()} == {"ca.pem", "ca.key", "n1.pem", "n1.key",
                                             "client-alice.pem", "client-alice.key"}
    assert all((d / k).stat().st_mode & 0o777 == 0o600 for k in ("ca.key", "n1.key"))
    node = x509.load_pem_x509_certificate((d / "n1.pem").read_bytes())
    san = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"n1", "localhost", "mq.example"} <= set(san.get_values_for_type(x509.DNSName))
    ca_before = (d / "ca.pem").read_bytes()
    done = make_certs(str(d), "--name", "n2")
    assert done.returncode == 0 and (d / "ca.pem").read_bytes() == ca_before
    # every certificate chains to the one CA: a server context loads it, a client verifies it
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(d / "n2.pem", d / "n2.key")
    ctx = ssl.create_default_context(cafile=str(d / "ca.pem"))
    ctx.load_cert_chain(d / "client-alice.pem", d / "client-alice.key")


def test_login_name_is_the_cn_or_the_rfc4514_subject(certs: Certs) -> None:
    cert = x509.load_pem_x509_certificate(certs.pem("client-alice").read_bytes())
    der = cert.public_bytes(Encoding.DER)
    assert login_name(der, "common_name") == "alice"
    assert login_name(der, "distinguished_name") == "CN=alice,O=brokerha"


def test_external_with_the_distinguished_name(certs: Certs, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "dn.toml"
    config.write_text(f'''
[node]
amqps_listen = "127.0.0.1:{port}"
listen = "off"

[tls]
cert = "{certs.pem("server")}"
key = "{certs.key("server")}"
ca = "{certs.pem("ca")}"
verify_peer = true
fail_if_no_peer_cert = true
login_from = "distinguished_name"

[[users]]
name = "CN=alice,O=brokerha"
password = "unused"

[[permissions]]
user = "CN=alice,O=brokerha"
vhost = "/"
''')
    with NodeProcess("dn", extra_args=["--config", str(config), "--store", "memory"]) as node:
        params = pika.ConnectionParameters(
            port=port, connection_attempts=1,
            ssl_options=pika.SSLOptions(certs.client_context("client-alice"), "localhost"),
            credentials=pika.credentials.ExternalCredentials())
        with pika.BlockingConnection(params) as conn:
            conn.channel().queue_declare("", exclusive=True)
        deadline = time.monotonic() + 5  # the node's log is read by another thread
        while not any("(CN=alice,O=brokerha) opened vhost" in line for line in node.log):
            assert time.monotonic() < deadline, "\n".join(node.log)
            time.sleep(0.05)
