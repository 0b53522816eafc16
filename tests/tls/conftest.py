"""Certificates for the TLS tests, made with ``brokerha.certs`` (what ``brokerha tls make-certs`` runs).

One CA signs the node's certificate (``server``: CN and SAN localhost,
127.0.0.1) and the client certificates; a second CA signs an impostor; one
client certificate has expired.
"""

from __future__ import annotations

import datetime
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from brokerha.certs import Authority, issue, make_ca
from brokerha.testing import NodeProcess, free_port


@dataclass(frozen=True)
class Certs:
    dir: Path
    ca: Authority
    other_ca: Authority

    def pem(self, stem: str) -> Path:
        return self.dir / f"{stem}.pem"

    def key(self, stem: str) -> Path:
        return self.dir / f"{stem}.key"

    def client_context(self, stem: str | None = None, *, ca: str = "ca") -> ssl.SSLContext:
        """A client context trusting ``ca``, presenting certificate ``stem`` if given."""
        ctx = ssl.create_default_context(cafile=str(self.pem(ca)))
        if stem is not None:
            ctx.load_cert_chain(str(self.pem(stem)), str(self.key(stem)))
        return ctx


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    ca = make_ca(d)
    other = make_ca(d, "impostor CA", stem="other-ca")
    issue(ca, d, "server", hosts=("localhost", "127.0.0.1"))
    for user in ("guest", "alice", "nobody"):
        issue(ca, d, user, stem=f"client-{user}", client_only=True)
    issue(other, d, "alice", stem="client-other-ca", client_only=True)
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2)
    issue(ca, d, "alice", stem="client-expired", client_only=True,
          not_before=past - datetime.timedelta(days=30), not_after=past)
    return Certs(d, ca, other)


USERS = """
[[users]]
name = "alice"
password = "alice-secret"

[[permissions]]
user = "alice"
vhost = "/"
"""


class TLSNode(NodeProcess):
    """A node with an amqps listener (and HTTPS) on free ports."""

    def __init__(self, certs: Certs, *, require: bool = False, extra: list[str] | None = None,
                 **kw: object) -> None:
        self.amqps_port = free_port()
        self.https_port = free_port()
        self.admin_port = free_port()
        self.certs = certs
        config = certs.dir / f"users-{self.amqps_port}.toml"
        config.write_text(USERS)
        args = ["--config", str(config), "--store", "memory",
                "--amqps-listen", f"127.0.0.1:{self.amqps_port}",
                "--https-listen", f"127.0.0.1:{self.https_port}",
                "--admin", f"127.0.0.1:{self.admin_port}",
                "--tls-cert", str(certs.pem("server")), "--tls-key", str(certs.key("server")),
                "--tls-ca", str(certs.pem("ca")), "--tls-verify-peer",
                *(["--tls-fail-if-no-peer-cert"] if require else []), *(extra or [])]
        super().__init__("tls-node", extra_args=args, **kw)  # type: ignore[arg-type]

    def amqps_url(self, user: str = "guest", password: str = "guest",
                  client: str | None = None) -> str:
        """A pika URL for the amqps listener (``client``: present that client certificate)."""
        opts = {"ca_certs": str(self.certs.pem("ca")), "server_hostname": "localhost"}
        if client is not None:
            opts.update(certfile=str(self.certs.pem(client)), keyfile=str(self.certs.key(client)))
        return (f"amqps://{user}:{password}@localhost:{self.amqps_port}/%2F"
                f"?ssl_options={quote(repr(opts))}&connection_attempts=1&socket_timeout=5")

    def log_text(self) -> str:
        return "\n".join(self.log)


@pytest.fixture(scope="module")
def tls_node(certs: Certs) -> Iterator[TLSNode]:
    """Client certificates asked for and checked, not required."""
    with TLSNode(certs) as node:
        yield node


@pytest.fixture(scope="module")
def strict_node(certs: Certs) -> Iterator[TLSNode]:
    """Client certificates required (fail_if_no_peer_cert), plain AMQP off."""
    with TLSNode(certs, require=True, extra=["--listen", "off"]) as node:
        yield node
