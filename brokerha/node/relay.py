"""Any node is an entry point: a backup relays its clients' AMQP connections to the primary.

A client given one node's address (``amqp://localhost:5672``, a Kubernetes
Service, a load balancer) reaches the primary whichever role that node has.
A backup accepts the connection (and, on its amqps listener, the TLS
handshake), opens a connection to the current primary's AMQP listener (its
amqps listener, over TLS, for a client that came over amqps, when the
primary has one: plain AMQP can then be off on every member),
sends one *relay preamble* line and from then on copies the bytes both ways
unchanged: the AMQP session (handshake, SASL, heartbeats, every method) is
the client's with the primary, so every client library works as against the
primary itself. When the primary closes (deposed: 320 CONNECTION_FORCED) or
dies (reset), the relayed connection closes the same way, and the client's
reconnect through the same address reaches the new primary. While this node
knows no primary (an election), it closes accepted connections at once.

The preamble tells the primary who the client is, so that the rules that
depend on it hold through a relay: ``loopback_users`` (guest only from
loopback) sees the client's address, not the backup's, and SASL EXTERNAL
the user of the certificate the backup checked. It is authenticated with the
cluster secret (HMAC-SHA256, with a timestamp checked against
``PREAMBLE_MAX_AGE``), so only a cluster member can speak for a client; a
primary refuses a preamble it cannot verify and logs why::

    BRKHA-RELAY/1 <host> <port> <cert user|-> <cert refusal|-> <p|t> <unix time> <hmac>\\r\\n

(names base64url-encoded, ``-`` for none). The cost of a relay: one more
hop on loopback or the datacenter's network and the copy in the backup's
event loop (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from brokerha.amqp.connection import ExternalIdentity

log = logging.getLogger(__name__)

MAGIC = b"BRKHA-RELAY/1 "
MAX_PREAMBLE = 1024  # bytes, the line included
PREAMBLE_MAX_AGE = 30.0  # seconds a preamble's timestamp may lag (or lead) the primary's clock
BUFFER_LIMIT = 1 << 20  # client bytes held while the upstream connects, then reading pauses
CONNECT_TIMEOUT = 5.0


@dataclass(frozen=True)
class RelayTarget:
    """Where the primary takes clients: its AMQP listener, and its amqps one if it has one."""

    amqp: tuple[str, int]
    amqps: tuple[str, int] | None = None

    def __str__(self) -> str:
        text = f"{self.amqp[0]}:{self.amqp[1]}"
        return text if self.amqps is None else f"{text} (amqps {self.amqps[0]}:{self.amqps[1]})"


class PreambleError(ValueError):
    """A relay preamble that is malformed, stale or not signed with the cluster secret."""


@dataclass(frozen=True)
class RelayedClient:
    """Who the client of a relayed connection is (as the backup saw it)."""

    host: str
    port: int
    tls: ExternalIdentity | None = None


def _b64(text: str | None) -> str:
    return "-" if not text else base64.urlsafe_b64encode(text.encode()).decode()


def _unb64(field: str) -> str | None:
    return None if field == "-" else base64.urlsafe_b64decode(field.encode()).decode()


def _sign(secret: bytes, body: bytes) -> str:
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def encode_preamble(client: RelayedClient, secret: bytes, now: float | None = None) -> bytes:
    tls = client.tls
    fields = [client.host, str(client.port), _b64(tls.name if tls else None),
              _b64(tls.refusal if tls else None),
              "p" if tls is None else "t", str(int(time.time() if now is None else now))]
    body = MAGIC + " ".join(fields).encode()
    return body + b" " + _sign(secret, body).encode() + b"\r\n"


def decode_preamble(line: bytes, secret: bytes, now: float | None = None) -> RelayedClient:
    """Check and read one preamble line (without its CRLF); raises PreambleError."""
    body, _, mac = line.rpartition(b" ")
    if not body.startswith(MAGIC):
        raise PreambleError("not a relay preamble")
    if not hmac.compare_digest(_sign(secret, body).encode(), mac):
        raise PreambleError("relay preamble not signed with this cluster's secret")
    try:
        host, port, name, refusal, kind, stamp = body[len(MAGIC):].decode().split(" ")
        age = (time.time() if now is None else now) - int(stamp)
        client = RelayedClient(host, int(port), None if kind == "p" else
                               ExternalIdentity(_unb64(name), _unb64(refusal)))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PreambleError(f"malformed relay preamble: {exc}") from exc
    if abs(age) > PREAMBLE_MAX_AGE:
        raise PreambleError(f"relay preamble {age:.0f} s old (the nodes' clocks differ, or a "
                            "replay)")
    return client


class PreambleReader:
    """The primary's side: splits a relay preamble off the start of a connection's bytes.

    ``feed`` returns None while the line is incomplete; then ``(client, rest)``:
    the relayed client (None: no preamble, the bytes are the client's own) and
    the bytes after it. Raises PreambleError for a bad one.
    """

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.buffer = b""

    def feed(self, data: bytes) -> tuple[RelayedClient | None, bytes] | None:
        self.buffer += data
        n = min(len(self.buffer), len(MAGIC))
        if self.buffer[:n] != MAGIC[:n]:
            return None, self.buffer  # an ordinary client: AMQP's header starts with "AMQP"
        end = self.buffer.find(b"\r\n")
        if end < 0:
            if len(self.buffer) > MAX_PREAMBLE:
                raise PreambleError("relay preamble too long")
            return None
        return decode_preamble(self.buffer[:end], self.secret), self.buffer[end + 2:]


class _Upstream(asyncio.Protocol):
    """The relay's connection to the primary: what arrives goes to the client."""

    def __init__(self, relay: RelayProtocol) -> None:
        self.relay = relay

    def data_received(self, data: bytes) -> None:
        if self.relay.client is not None:
            self.relay.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay.upstream_lost()

    def pause_writing(self) -> None:
        if self.relay.client is not None:
            self.relay.client.pause_reading()

    def resume_writing(self) -> None:
        if self.relay.client is not None:
            self.relay.client.resume_reading()


class RelayProtocol(asyncio.Protocol):
    """One client connection accepted by a backup, piped to the primary's AMQP listener.

    An amqps client is relayed over TLS to the primary's amqps listener when
    the primary has one (``tls``: the backup's client context), so its bytes
    are never in clear on the network; a plain client to the plain listener.
    """

    def __init__(self, target: tuple[str, int], registry: set[RelayProtocol], secret: bytes,
                 identify: Callable[[object], ExternalIdentity | None] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.target = target
        self.tls = tls  # the upstream is the primary's amqps listener
        self.registry = registry
        self.secret = secret
        self.identify = identify
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.closed = False
        self.task: asyncio.Task[None] | None = None
        self.relayed_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = cast(asyncio.Transport, transport)
        self.registry.add(self)
        peer = transport.get_extra_info("peername") or ("?", 0)
        tls = None if self.identify is None else self.identify(
            transport.get_extra_info("ssl_object"))
        preamble = encode_preamble(RelayedClient(str(peer[0]), int(peer[1]), tls), self.secret)
        self.task = asyncio.get_running_loop().create_task(self._connect(preamble))

    async def _connect(self, preamble: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: _Upstream(self), *self.target, ssl=self.tls),
                CONNECT_TIMEOUT)
        except (TimeoutError, OSError) as exc:
            log.info("relay to the primary at %s:%d failed: %s", *self.target, exc)
            self.close()
            return
        if self.closed or transport.is_closing():
            # the client left, or the primary closed at once (it stopped serving: a
            # new primary is being elected); the client tries again
            transport.close()
            self.close()
            return
        self.upstream = transport
        self.upstream.write(preamble + b"".join(self.pending))
        self.pending.clear()
        if self.client is not None and self.pending_bytes >= BUFFER_LIMIT:
            self.client.resume_reading()
        self.pending_bytes = 0

    def data_received(self, data: bytes) -> None:
        self.relayed_bytes += len(data)
        if self.upstream is not None:
            self.upstream.write(data)
            return
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes >= BUFFER_LIMIT and self.client is not None:
            self.client.pause_reading()

    def pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client = None
        self.close()

    def upstream_lost(self) -> None:
        """The primary closed (or died): the client sees its connection end the same way."""
        self.upstream = None
        if self.client is not None:
            self.client.close()  # after what the primary sent last (its connection.close)
        self._forget()

    def close(self, abort: bool = False) -> None:
        """End both sides (the primary changed, the node stops, the upstream failed)."""
        if self.closed:
            return
        self.closed = True
        for transport in (self.client, self.upstream):
            if transport is not None:
                transport.abort() if abort else transport.close()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._forget()

    def _forget(self) -> None:
        self.registry.discard(self)


class Refuse(asyncio.Protocol):
    """A connection this node can neither serve nor relay (no primary known): closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()
