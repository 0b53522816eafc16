"""The thin asyncio layer under one AMQP connection: bytes and time, nothing else."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import cast

from brokerha.amqp.connection import ExternalIdentity, ServerConnection
from brokerha.broker.broker import Broker
from brokerha.ha.admission import NodeAdmission
from brokerha.node.relay import PreambleError, PreambleReader
from brokerha.slices import Burst

log = logging.getLogger(__name__)

WRITE_HIGH_WATER = 4 * 1024 * 1024
# Input handled back to back (one readable event, ``brokerha/slices.py``) for at
# most this long, then the socket is not read until the next loop turn: a publisher
# writing megabytes at once held the loop 0.1-0.15 s per event (issue 33).
READ_SLICE = 0.02


class AMQPProtocol(asyncio.Protocol):
    """Feeds socket bytes to a ServerConnection and writes what it produces.

    Output produced while handling input is written once at the end; output
    produced for this connection by others (deliveries) is written on the next
    loop iteration, so one write carries everything that piled up.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, broker: Broker,
                 admission: NodeAdmission,
                 identify: Callable[[ssl.SSLObject | None], ExternalIdentity | None]
                 | None = None, relay_secret: bytes | None = None) -> None:
        self.loop = loop
        # a cluster member: a backup may relay a client here (node/relay.py), its first
        # line then says who the client is
        self._preamble = None if relay_secret is None else PreambleReader(relay_secret)
        self.identify = identify  # amqps: the client certificate's user (node/tls.py)
        self.broker = broker
        # whether the node serves this connection, decided when the transport hands it over
        # (the node may have stopped serving since the listener accepted it); its registry
        # of the connections it serves, all closed in the step that ends the role
        self.admission = admission
        self.transport: asyncio.Transport | None = None
        self.conn: ServerConnection | None = None
        self._flush_scheduled = False
        self._burst = Burst()     # input handled back to back
        self._sliced = False      # reading paused for the rest of this loop turn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if not self.admission.admit(self):  # not serving now: the client tries its next URL
            transport.abort()
            return
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        tls = (None if self.identify is None
               else self.identify(transport.get_extra_info("ssl_object")))
        self._open(peer[:2] if peer else None, tls)

    def _open(self, peer: tuple[str, int] | None, tls: ExternalIdentity | None) -> None:
        conn = ServerConnection(self.broker, peer=peer, now=self.loop.time(), conn_id=id(self),
                                tls=tls)
        conn.on_output = self._schedule_flush
        conn.on_read_paused = self._read_paused
        conn.offload = self._offload
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        if self._preamble is not None:
            try:
                found = self._preamble.feed(data)
            except PreambleError as exc:
                log.warning("connection from %s refused: %s",
                            self.transport.get_extra_info("peername") if self.transport else "?",
                            exc)
                if self.transport is not None:
                    self.transport.abort()
                return
            if found is None:
                return  # the preamble's line is not complete yet
            self._preamble = None
            client, data = found
            if client is not None:  # relayed by a backup: the client is who it says
                self._open((client.host, client.port), client.tls)
            if not data:
                return
        conn = self.conn
        assert conn is not None
        self._burst.begin()
        conn.receive_data(data, self.loop.time())
        self.flush()
        self._burst.end()
        self._slice()

    def _slice(self) -> None:
        """Past ``READ_SLICE`` of back-to-back input, stop reading until the next turn."""
        transport = self.transport
        if self._burst.spent() > READ_SLICE and not self._sliced and transport is not None \
                and not transport.is_closing():
            self._sliced = True
            self._burst.restart()
            if self.conn is None or not self.conn.reading_paused:
                transport.pause_reading()
            self.loop.call_soon(self._next_slice)

    def _next_slice(self) -> None:
        self._sliced = False
        transport, conn = self.transport, self.conn
        if transport is not None and not transport.is_closing() and \
                (conn is None or not conn.reading_paused):
            transport.resume_reading()

    def _offload(self, work: Callable[[], bytes],
                 done: Callable[[Callable[[], bytes]], None]) -> None:
        """``work`` on the loop's executor (a thread), then ``done`` on the loop with its
        result, and what that produced written."""
        def finished(future: asyncio.Future[bytes]) -> None:
            if future.cancelled():  # the loop is closing
                return
            done(future.result)
            self.flush()

        self.loop.run_in_executor(None, work).add_done_callback(finished)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        conn, transport = self.conn, self.transport
        if conn is None or transport is None or transport.is_closing():
            return
        data = conn.data_to_send()
        if data:
            transport.write(data)
            conn.sent(self.loop.time())
        if conn.wants_close and not conn.lingering:  # lingering: the client closes first
            transport.close()

    def tick(self, now: float) -> None:
        if self.conn is not None:
            self.conn.tick(now)
            self.flush()

    def eof_received(self) -> bool:
        """The client closed its side: the end of a lingering connection (it got our
        close-ok), or a client gone mid-session. Ours closes too (False: asyncio does)."""
        return False

    def _read_paused(self, paused: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if paused:
            if not self._sliced:  # else paused already
                self.transport.pause_reading()
        elif not self._sliced:  # else the next slice reads again
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.pause_writing()

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.conn.resume_writing()
            self._schedule_flush()

    def force_close(self) -> None:
        """320 CONNECTION_FORCED and the socket dropped now (the role ended: failover);
        a connection lingering after its close-ok is dropped now too."""
        if self.conn is not None:
            self.conn.shutdown()
            self.flush()
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.admission.gone(self)
        if self.conn is not None:
            self.conn.connection_lost()
