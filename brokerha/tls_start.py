"""The server side of a TLS handshake on an accepted connection, without losing its first bytes.

Listeners that run the handshake themselves (``loop.start_tls`` on the
accepted transport, so each connection takes the *current* context and a
refused handshake can be logged) must not lose the ClientHello: uvloop starts
reading right after ``connection_made`` even when the protocol paused reading
in it, so the client's first bytes can reach the protocol's ``data_received``
before ``start_tls`` has taken the transport over. :class:`ServerTLSStart`
keeps those bytes and hands them to the TLS layer once it is in place.

Used by the cluster and TxLog links (``cluster/link.py``) and by the amqps
and HTTPS listeners (``node/tls.py``), as are :func:`load_chain` and
:func:`load_ca`, which name the file that does not load (OpenSSL does not).
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any


def load_chain(ctx: ssl.SSLContext, cert: Path, key: Path) -> None:
    """``ctx.load_cert_chain``; ValueError naming the files if they do not load or match."""
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"certificate {cert} with key {key}: {exc}") from exc


def load_ca(ctx: ssl.SSLContext, ca: Path) -> None:
    """``ctx.load_verify_locations``; ValueError naming the file if it does not load."""
    try:
        ctx.load_verify_locations(cafile=str(ca))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"CA file {ca}: {exc}") from exc


def _feed(protocol: Any, data: bytes) -> None:
    """Give ``data`` to ``protocol`` as if the transport had read it."""
    if hasattr(protocol, "get_buffer"):  # asyncio's and uvloop's SSLProtocol are buffered
        view = memoryview(data)
        while view:
            buf = protocol.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            protocol.buffer_updated(n)
            view = view[n:]
    else:
        protocol.data_received(data)


class ServerTLSStart:
    """One accepted connection's way into TLS.

    The protocol calls :meth:`raw` first thing in its ``data_received``: True
    means the bytes were read before TLS took over (kept here, reading
    paused), so the protocol must ignore them; afterwards ``data_received``
    gets decrypted bytes only. :meth:`start` returns the TLS transport.
    """

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.kept: list[bytes] = []

    def raw(self, protocol: asyncio.BaseProtocol, data: bytes) -> bool:
        if self.transport.get_protocol() is not protocol:
            return False  # start_tls's SSL protocol sits in between: this is plaintext
        self.kept.append(data)
        self.transport.pause_reading()
        return True

    async def start(self, protocol: asyncio.BaseProtocol, ctx: ssl.SSLContext,
                    timeout: float) -> asyncio.Transport | None:
        loop = asyncio.get_running_loop()
        starting = loop.create_task(loop.start_tls(
            self.transport, protocol, ctx, server_side=True, ssl_handshake_timeout=timeout))
        # start_tls's first step runs before this one resumes: it installs its SSL
        # protocol and queues that protocol's connection_made and the resume of
        # reading; bytes kept before then are queued right after those, in the same
        # batch of callbacks, so nothing newly read can overtake them
        await asyncio.sleep(0)
        if self.kept:
            data, self.kept = b"".join(self.kept), []
            loop.call_soon(_feed, self.transport.get_protocol(), data)
        return await starting
