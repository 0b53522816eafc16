"""TLS for a node: contexts from the configured files, the amqps acceptor, reload without restart.

One :class:`NodeTLS` per node holds the current contexts:

* ``server``: the amqps and HTTPS listeners' (``[tls]``: TLS 1.2 or later,
  the node's certificate, client certificates asked for and checked against
  ``ca`` with ``verify_peer``, required with ``fail_if_no_peer_cert``);
* the node-to-node links of ``[cluster.tls]`` and the TxLog links of
  ``[txlog.tls]`` register themselves with :meth:`NodeTLS.on_reload`.

:meth:`NodeTLS.reload` (SIGHUP, ``POST /api/tls/reload``) reads every file
again and swaps the contexts in one step; a file that does not load leaves
everything as it was and says which file. Connections already open keep the
certificate they were made with; every handshake after the reload uses the
new files (the listeners take the current context per connection: the
acceptor below runs the handshake itself rather than ``create_server(ssl=)``,
which would fix one context for the listener's life, and so also logs every
refused handshake, which asyncio only does in debug mode).

SASL EXTERNAL: :meth:`NodeTLS.identity` reads the client certificate of an
accepted connection and names the user it logs in as (its subject's CN, or
the whole subject as an RFC 4514 string, RabbitMQ's ``ssl_cert_login_from``),
or the reason it cannot, in RabbitMQ's words.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from cryptography import x509
from cryptography.x509.oid import NameOID

from brokerha.amqp.connection import ExternalIdentity
from brokerha.node.config import ConfigError, TLSConfig
from brokerha.tls_start import ServerTLSStart, load_ca, load_chain

log = logging.getLogger("brokerha.tls")

HANDSHAKE_TIMEOUT = 10.0
REPEAT_WARNING_AFTER = 30.0  # the same refusal from the same host: WARNING at most this often


def server_context(cert: Path, key: Path, ca: Path | None = None, *,
                   verify_peer: bool = False, require_peer_cert: bool = False) -> ssl.SSLContext:
    """A TLS 1.2+ server context; ``verify_peer`` asks for a client certificate signed by ``ca``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain(ctx, cert, key)
    if ca is not None:
        load_ca(ctx, ca)
    if verify_peer:
        ctx.verify_mode = ssl.CERT_REQUIRED if require_peer_cert else ssl.CERT_OPTIONAL
    return ctx


def member_client_context(cert: Path, key: Path, ca: Path | None) -> ssl.SSLContext:
    """A member's client context towards another member's amqps or HTTPS listener.

    Used by a backup relaying an amqps client to the primary, and to read
    another member's status over HTTPS. It presents the node certificate (a
    listener that requires client certificates takes it; a relayed client's
    own identity travels in the relay preamble) and checks the other's
    against ``ca`` (the system's CAs without one). No hostname check:
    members are configured by address (and the preamble is authenticated
    with the cluster secret).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca is not None:
        load_ca(ctx, ca)
    else:
        ctx.load_default_certs()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    load_chain(ctx, cert, key)
    return ctx


def certificate_facts(path: Path) -> dict[str, Any]:
    """Subject, issuer, serial and validity of the first certificate in a PEM file."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return {"file": str(path), "subject": cert.subject.rfc4514_string(),
            "issuer": cert.issuer.rfc4514_string(), "serial": format(cert.serial_number, "x"),
            "not_after": cert.not_valid_after_utc.isoformat(),
            "not_after_ts": cert.not_valid_after_utc.timestamp()}


def login_name(der: bytes, login_from: str) -> str | None:
    """The user name a client certificate logs in as; None if it has no such name."""
    subject = x509.load_der_x509_certificate(der).subject
    if login_from == "distinguished_name":
        return subject.rfc4514_string() or None
    # several CNs are joined with "," as RabbitMQ does (use the DN to be exact)
    names = [str(a.value) for a in subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return ",".join(names) or None


class NodeTLS:
    """The node's current TLS contexts and what to do when the files are read again."""

    def __init__(self, config: TLSConfig) -> None:
        self.config = config
        self.server: ssl.SSLContext | None = None
        # towards other members: a backup's relays to the primary's amqps, status over HTTPS
        self.member_client: ssl.SSLContext | None = None
        self.certificate: dict[str, Any] | None = None  # facts of the loaded one
        self.loaded_at: float | None = None
        self.reloads = 0
        self._hooks: list[tuple[str, Callable[[], Callable[[], None]]]] = []
        self._warned: dict[str, float] = {}
        if config.configured:
            try:
                self.server, self.member_client, self.certificate = self._build()
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise ConfigError(f"tls: {exc}") from exc
            self.loaded_at = time.time()

    def _build(self) -> tuple[ssl.SSLContext, ssl.SSLContext, dict[str, Any]]:
        cfg = self.config
        assert cfg.cert is not None and cfg.key is not None
        return (server_context(cfg.cert, cfg.key, cfg.ca, verify_peer=cfg.verify_peer,
                               require_peer_cert=cfg.fail_if_no_peer_cert),
                member_client_context(cfg.cert, cfg.key, cfg.ca),
                certificate_facts(cfg.cert))

    def on_reload(self, what: str, prepare: Callable[[], Callable[[], None]]) -> None:
        """On every reload call ``prepare()`` (reads files, may raise), then what it returns
        (swaps; must not fail). ``what`` names it in errors and in :meth:`status`."""
        self._hooks.append((what, prepare))

    def reload(self) -> dict[str, Any]:
        """Read every certificate, key and CA file again; swap only if all of them load.

        Raises ValueError naming the part and the file that failed (nothing swapped).
        """
        swaps: list[Callable[[], None]] = []
        server = None
        try:
            if self.config.configured:
                server, member_client, facts = self._build()
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ValueError(f"[tls] (amqps/HTTPS): {exc}") from exc
        for what, prepare in self._hooks:
            try:
                swaps.append(prepare())
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise ValueError(f"{what}: {exc}") from exc
        if server is not None:
            self.server, self.member_client, self.certificate = server, member_client, facts
        for swap in swaps:
            swap()
        self.reloads += 1
        self.loaded_at = time.time()
        status = self.status()
        log.info("TLS certificates reloaded (%s)", ", ".join(
            [*(["amqps/HTTPS"] if server is not None else []), *(w for w, _ in self._hooks)])
            or "nothing configured")
        return status

    def status(self) -> dict[str, Any]:
        """What is in use (not what the files hold now): the node certificate's facts, the
        reload count and time."""
        cfg = self.config
        cert = None
        if self.certificate is not None:
            cert = {**self.certificate, "expires_in_days": round(
                (self.certificate["not_after_ts"] - time.time()) / 86400, 1)}
        return {"configured": cfg.configured, "certificate": cert,
                "ca": None if cfg.ca is None else str(cfg.ca), "verify_peer": cfg.verify_peer,
                "fail_if_no_peer_cert": cfg.fail_if_no_peer_cert, "login_from": cfg.login_from,
                "reloads": self.reloads, "loaded_at": self.loaded_at,
                "links": [what for what, _ in self._hooks]}

    # -- SASL EXTERNAL ------------------------------------------------------------------

    def identity(self, ssl_object: ssl.SSLObject | None) -> ExternalIdentity | None:
        """What SASL EXTERNAL sees on a connection (None: not a TLS connection)."""
        if ssl_object is None:
            return None
        if not self.config.verify_peer:
            return ExternalIdentity(None, "TLS configuration is unsafe")
        der = ssl_object.getpeercert(binary_form=True)
        if not der:
            return ExternalIdentity(None, "connection peer presented no TLS (x.509) certificate")
        try:
            name = login_name(der, self.config.login_from)
        except ValueError:
            name = None
        if name is None:
            return ExternalIdentity(None, "no name found")
        return ExternalIdentity(name, None)

    # -- accepting -----------------------------------------------------------------------

    def acceptor(self, make_protocol: Callable[[], asyncio.Protocol | None],
                 what: str) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``create_server``: TLS with the current context first.

        ``make_protocol`` is called once the handshake is done; None (the listener
        was closed meanwhile: the node stopped serving) drops the connection."""
        return lambda: _TLSAccept(self, make_protocol, what)

    def warn(self, line: str, key: str, level: int = logging.WARNING) -> None:
        """Log at ``level``, but the same ``key`` only every REPEAT_WARNING_AFTER s (DEBUG
        between), so a client retrying a refused handshake does not flood the log."""
        now = time.monotonic()
        if now - self._warned.get(key, -REPEAT_WARNING_AFTER) >= REPEAT_WARNING_AFTER:
            if len(self._warned) > 1000:
                self._warned.clear()
            self._warned[key] = now
            log.log(level, "%s", line)
        else:
            log.debug("%s", line)


class _TLSAccept(asyncio.Protocol):
    """One accepted TCP connection until its TLS handshake is done; then the real protocol."""

    def __init__(self, tls: NodeTLS, make_protocol: Callable[[], asyncio.Protocol | None],
                 what: str) -> None:
        self.tls = tls
        self.make_protocol = make_protocol
        self.what = what
        self.start: ServerTLSStart | None = None
        self.early: list[bytes] = []
        self.app: asyncio.Protocol | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        ctx = self.tls.server
        if ctx is None:  # no [tls]: the listener is not opened (a reload cannot remove it)
            stream.abort()
            return
        self.start = ServerTLSStart(stream)
        self.task = asyncio.get_running_loop().create_task(self._handshake(stream, ctx))

    async def _handshake(self, transport: asyncio.Transport, ctx: ssl.SSLContext) -> None:
        assert self.start is not None
        peer = transport.get_extra_info("peername")
        where = f"{peer[0]}:{peer[1]}" if peer else "?"
        try:
            tls = await self.start.start(self, ctx, HANDSHAKE_TIMEOUT)
        except Exception as exc:  # ssl.SSLError, ConnectionError, TimeoutError...
            reason = str(exc) or type(exc).__name__
            if isinstance(exc, ssl.SSLError):  # refused: certificate, protocol, plain client
                self.tls.warn(f"{self.what}: TLS handshake with {where} failed, connection "
                              f"refused: {reason}",
                              key=f"{self.what} {peer[0] if peer else ''} {reason}")
            else:  # the client went away or stalled (a port probe, a load balancer's check)
                self.tls.warn(f"{self.what}: connection from {where} closed during the TLS "
                              f"handshake: {reason}", key=f"{self.what} {reason}",
                              level=logging.INFO)
            transport.abort()
            return
        if tls is None or tls.is_closing():
            return
        app = self.make_protocol()
        if app is None:
            tls.abort()
            return
        self.app = app
        tls.set_protocol(app)
        app.connection_made(tls)
        early, self.early = self.early, []
        for data in early:
            app.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.app is not None:
            self.app.data_received(data)
        elif self.start is not None and not self.start.raw(self, data):
            # decrypted bytes that came with the handshake's last flight, before
            # start_tls returned: the real protocol gets them first thing
            self.early.append(data)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.app is not None:
            self.app.connection_lost(exc)
