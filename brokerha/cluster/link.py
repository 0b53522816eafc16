"""Node-to-node links on asyncio: moves bytes between sockets and ``cluster.protocol``.

One connection per pair of nodes: the node whose name sorts first dials,
the other accepts, so two nodes never race to open two links. A dialer
reconnects with capped exponential backoff; an accepted link that is
identified while one to the same peer exists replaces it (the peer
restarted and the old socket has not noticed yet). Every rule about what is
accepted lives in the sans-I/O protocol; this module only logs the outcome
and closes.

Asyncio Protocols rather than streams: the replication layer sends many
small packets, and ``data_received -> codec.feed -> on_message`` has no task
switch per packet.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from brokerha.cluster.messages import Error, Message
from brokerha.cluster.protocol import (
    MAX_PACKET,
    Acceptor,
    Dialer,
    Established,
    PacketCodec,
    Ping,
    ProtocolError,
    Refused,
)
from brokerha.slices import Burst
from brokerha.tls_start import ServerTLSStart, load_ca, load_chain

log = logging.getLogger("brokerha.cluster")

BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0
HANDSHAKE_TIMEOUT = 5.0
PING_INTERVAL = 1.0
IDLE_TIMEOUT = 5.0
REPEAT_WARNING_AFTER = 30.0     # the same refusal is logged at WARNING at most this often
_LINK_CODES = range(1, 10)      # handshake and ping: never handed to on_message
# packets handled per loop turn, in seconds, over the reads of one readable event
# (``brokerha/slices.py``): past it the rest waits for the next turn with the socket not
# read (one read of 256 KiB of dequeue events took a backup 0.1-0.5 s, the heartbeats and
# the other links waiting behind it; issue 33)
DELIVER_SLICE = 0.02
_MSG_ID_WRAP = 0xFFFFFFFF

OnMessage = Callable[[str, int, Message], None]
OnPeer = Callable[[str], None]
Address = tuple[str, int]


def _addresses(value: Address | list[Address]) -> list[Address]:
    """A peer's addresses: one, or a list tried in turn (the nodes of an HA datacenter)."""
    return list(value) if isinstance(value, list) else [value]


def tls_contexts(cert: Path, key: Path, ca: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts for mutual TLS: each side presents ``cert`` and
    requires the other's to be signed by ``ca`` (and only by ``ca``)."""
    # SSLContext(...), not create_default_context: that would trust the system's CAs too
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load_ca(server, ca)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    load_ca(client, ca)
    # No hostname check: peers are configured by address and identified by the
    # cluster handshake (name + shared secret), not by DNS names in certificates.
    client.check_hostname = False
    client.verify_mode = ssl.CERT_REQUIRED
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        load_chain(ctx, cert, key)
    return server, client


def certificate_names(peercert: dict[str, Any] | None) -> set[str]:
    """The common names and DNS names of a verified peer certificate (``getpeercert()``)."""
    if not peercert:
        return set()
    names = {value for rdn in peercert.get("subject", ()) for key, value in rdn
             if key == "commonName"}
    return names | {value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS"}


def links_reload(cert: Path, key: Path, ca: Path,
                 links: Callable[[], ClusterLinks | None]) -> Callable[[], Callable[[], None]]:
    """A certificate reload for links (node/tls.py's ``NodeTLS.on_reload``, a standalone
    TxLog master's SIGHUP): ``prepare()`` reads the files (and may raise), what it
    returns gives ``links()`` (the links running now, if any) the new contexts."""
    def prepare() -> Callable[[], None]:
        server, client = tls_contexts(cert, key, ca)

        def swap() -> None:
            current = links()
            if current is not None:
                current.ssl_server, current.ssl_client = server, client
        return swap
    return prepare


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: handshake first, then packets to ``on_message``."""

    def __init__(self, links: ClusterLinks, handshake: Dialer | Acceptor, remote: str,
                 tls_server: ssl.SSLContext | None = None) -> None:
        self.links = links
        self.handshake = handshake
        self.remote = remote
        self.tls_server = tls_server
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.codec: PacketCodec | None = None
        self.closed = False
        self.established = False
        self.last_rx = time.monotonic()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._next_id = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tls_task: asyncio.Task[None] | None = None
        self._tls_start: ServerTLSStart | None = None
        self._early: list[bytes] | None = None   # data decrypted before start_tls returned
        # decoded packets not handled yet (``DELIVER_SLICE``), the socket paused meanwhile
        self._inbox: deque[tuple[int, Message]] = deque()
        self._inbox_error: ProtocolError | None = None
        self._paused = False
        self._burst = Burst()  # the time spent on this readable event's reads so far

    # -- set-up ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if not self.remote:
            peername = transport.get_extra_info("peername")
            self.remote = f"{peername[0]}:{peername[1]}" if peername else "?"
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.links.handshake_timeout, self._handshake_timed_out)
        self.links._pending.add(self)
        if self.tls_server is not None:
            # TLS by hand (not create_server(ssl=...)) so a refused certificate
            # is logged here; asyncio only logs it in debug mode.
            self._tls_start = ServerTLSStart(transport)
            self._early = []
            self._tls_task = loop.create_task(self._start_tls(self.tls_server))
        else:
            transport.write(self.handshake.start())

    async def _start_tls(self, ctx: ssl.SSLContext) -> None:
        assert self.transport is not None
        try:
            assert self._tls_start is not None
            tls = await self._tls_start.start(self, ctx, self.links.handshake_timeout)
        except Exception as exc:  # ssl.SSLError, ConnectionError, TimeoutError...
            if not self.links._closing:
                self.links._warn(f"cluster link from {self.remote}: TLS handshake failed: "
                                 f"{exc}", key=f"tls {exc}")
            self.transport.abort()
            self._cleanup()
            return
        early, self._early = self._early or [], None
        if self.closed or tls is None:
            return
        self.transport = tls  # type: ignore[assignment]
        tls.write(self.handshake.start())
        for data in early:
            self.data_received(data)

    def _handshake_timed_out(self) -> None:
        self.links._warn(f"cluster link {self._label()}: no identification within "
                         f"{self.links.handshake_timeout:g}s; closing")
        self.abort()

    # -- bytes in ----------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self._tls_start is not None and self._tls_start.raw(self, data):
            return  # the ClientHello, read before start_tls took over: it gets it
        if self._early is not None:
            # the peer spoke right after the TLS handshake, before start_tls
            # handed us the TLS transport: answering now would go out in clear
            self._early.append(data)
            return
        self.last_rx = time.monotonic()
        if self.codec is not None:
            self._deliver(data)
            return
        step = self.handshake.receive(data)
        assert self.transport is not None
        if step.out:
            self.transport.write(step.out)
        outcome = step.outcome
        if isinstance(outcome, Refused):
            self.links._warn(f"cluster link {self._label()} refused: {outcome.reason}",
                             key=outcome.reason)
            self.close()
        elif isinstance(outcome, Established):
            if self.links.check_peer_name and not self._certificate_names(outcome.peer):
                return
            if self._timer is not None:
                self._timer.cancel()
            self.codec = PacketCodec(self.links.max_packet)
            self.peer = outcome.peer
            self.established = True
            self.links._established(self)
            if outcome.leftover:
                self._deliver(outcome.leftover)

    def _certificate_names(self, peer: str) -> bool:
        """Whether the peer's certificate names ``peer``; if not, log, refuse and close."""
        assert self.transport is not None
        names = certificate_names(self.transport.get_extra_info("peercert"))
        if peer in names:
            return True
        self.links._warn(f"cluster link {self._label()} refused: its TLS certificate names "
                         f"{', '.join(sorted(names)) or 'nothing'}, not {peer}",
                         key=f"names {peer} {sorted(names)}")
        self.close()
        return False

    def _deliver(self, data: bytes) -> None:
        assert self.codec is not None and self.peer is not None
        try:
            packets = self.codec.feed(data)
        except ProtocolError as exc:
            packets, self._inbox_error = exc.decoded, exc
        self._inbox.extend(packets)
        if not self._paused:
            self._handle_inbox()

    def _handle_inbox(self) -> None:
        """Hand the decoded packets to ``on_message``, for at most ``DELIVER_SLICE`` a turn
        (over the reads of one readable event, ``brokerha/slices.py``).

        Past the slice the socket stops being read and the rest waits for the
        next loop turn, in order: timers, heartbeats and other links go first.
        """
        assert self.peer is not None
        burst = self._burst
        burst.begin()
        try:
            stopped = self._handle_slice()
        finally:
            burst.end()
        if stopped:
            burst.restart()
            return
        if self._paused:
            self._paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
        error, self._inbox_error = self._inbox_error, None
        if error is not None and not self.closed:
            self.links._warn(f"cluster link with {self.peer} ({self.remote}): {error.reason}; "
                             f"closing")
            self.write_packet(0, Error(error.code, error.reason))
            self.close()

    def _handle_slice(self) -> bool:
        """Handle the inbox until it is empty (False); True when it stopped before: the
        link closed, or past the slice (reading paused, the rest handled next turn)."""
        assert self.peer is not None
        inbox = self._inbox
        on_message = self.links.on_message
        burst = self._burst
        while inbox:
            if self.closed:
                inbox.clear()
                return True
            msg_id, msg = inbox.popleft()
            if msg.CODE in _LINK_CODES:
                continue
            try:
                on_message(self.peer, msg_id, msg)
            except Exception:
                log.exception("cluster link with %s: handling %s failed", self.peer,
                              type(msg).__name__)
            if inbox and burst.spent() > DELIVER_SLICE and not self.closed:
                if not self._paused:
                    self._paused = True
                    if self.transport is not None:
                        self.transport.pause_reading()
                asyncio.get_running_loop().call_soon(self._handle_inbox)
                return True
        return False

    # -- bytes out ---------------------------------------------------------------------

    def next_id(self) -> int:
        self._next_id = self._next_id % _MSG_ID_WRAP + 1  # 1..2**32-1: 0 is falsy
        return self._next_id

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def writelines(self, parts: list[bytes]) -> None:
        assert self.transport is not None
        self.transport.writelines(parts)

    def write_packet(self, msg_id: int, message: Message) -> None:
        self.write(self.links._encoder.encode(msg_id, message))

    # -- tear-down ---------------------------------------------------------------------

    def close(self) -> None:
        """Close after flushing what was written (e.g. an Error packet)."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.established and not self.closed and exc is not None:
            level = logging.WARNING if isinstance(exc, ssl.SSLError) else logging.INFO
            log.log(level, "cluster link %s lost during identification: %s",
                    self._label(), exc)
        self.closed = True
        self._cleanup()
        self.links._lost(self, exc)

    def _cleanup(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self.links._pending.discard(self)
        if not self.lost.done():
            self.lost.set_result(None)

    def _label(self) -> str:
        if isinstance(self.handshake, Dialer):
            return f"to {self.handshake.peer_expected} at {self.remote}"
        who = self.peer or self.handshake.peer
        return f"from {who} at {self.remote}" if who else f"from {self.remote}"


class ClusterLinks:
    """The links of one node to all its configured peers."""

    def __init__(self, cluster: str, me: str, peers: dict[str, Address | list[Address]],
                 listen: tuple[str, int], secret: bytes, on_message: OnMessage,
                 on_peer_up: OnPeer, on_peer_down: OnPeer,
                 ssl_server: ssl.SSLContext | None = None,
                 ssl_client: ssl.SSLContext | None = None, *,
                 check_peer_name: bool = False,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT,
                 ping_interval: float = PING_INTERVAL, idle_timeout: float = IDLE_TIMEOUT,
                 max_packet: int = MAX_PACKET) -> None:
        if me in peers:
            raise ValueError(f"node {me!r} lists itself as a peer")
        self.cluster = cluster
        self.me = me
        self.peers = dict(peers)
        self.listen = listen
        self.secret = secret
        self.on_message = on_message
        self.on_peer_up = on_peer_up
        self.on_peer_down = on_peer_down
        # each new link uses the contexts set here (a certificate reload replaces them)
        self.ssl_server = ssl_server
        self.ssl_client = ssl_client
        # with TLS: the peer's certificate must name the peer (CN or DNS name)
        self.check_peer_name = check_peer_name
        self.handshake_timeout = handshake_timeout
        self.ping_interval = ping_interval
        self.idle_timeout = idle_timeout
        self.max_packet = max_packet
        self.address: tuple[str, int] | None = None   # bound address, once started
        self._encoder = PacketCodec(max_packet)
        self._ping = self._encoder.encode(0, Ping())
        self._conns: dict[str, _Connection] = {}
        self._pending: set[_Connection] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._server: asyncio.Server | None = None
        self._closing = False
        self._started = False
        self._dials: dict[str, asyncio.Task[None]] = {}
        self._warned: dict[str, float] = {}

    # -- life cycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Listen, then dial every peer whose name sorts after ours."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, self.listen[0], self.listen[1],
                                                reuse_address=True)
        self.address = self._server.sockets[0].getsockname()[:2]
        self._started = True
        for peer in sorted(self.peers):
            self._dial(peer)
        self._tasks.append(loop.create_task(self._keepalive()))

    def _dial(self, peer: str) -> None:
        if peer > self.me:  # one link per pair: the name that sorts first dials
            task = asyncio.get_running_loop().create_task(self._dial_forever(peer))
            self._dials[peer] = task
            self._tasks.append(task)

    def add_peer(self, peer: str, address: Address | list[Address]) -> None:
        """Configure a new peer at runtime (dialed at once if we dial it)."""
        if peer == self.me or peer in self.peers:
            raise ValueError(f"peer {peer!r}: already configured")
        self.peers[peer] = address
        if self._started:
            self._dial(peer)

    def remove_peer(self, peer: str) -> None:
        """Forget a peer: stop dialing it and drop its link; it is refused from now on."""
        self.peers.pop(peer, None)
        task = self._dials.pop(peer, None)
        if task is not None:
            task.cancel()
        conn = self._conns.get(peer)
        if conn is not None:
            conn.abort()

    async def close(self) -> None:
        """Stop dialing and listening, close every link; no callbacks from here on."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()
        conns = [*self._conns.values(), *self._pending]
        for conn in conns:
            conn.abort()
        self._conns.clear()
        waits = [*self._tasks, *(c.lost for c in conns)]
        if waits:
            await asyncio.wait(waits, timeout=1.0)
        if self._server is not None:
            await self._server.wait_closed()

    # -- sending -----------------------------------------------------------------------

    def send(self, peer: str, message: Message, msg_id: int | None = None) -> int | None:
        """Queue ``message`` for ``peer``; never blocks. Returns the msg_id used (a
        fresh one unless a response passes its request's), or None if not connected."""
        conn = self._conns.get(peer)
        if conn is None or conn.closed:
            return None
        if msg_id is None:
            msg_id = conn.next_id()
        conn.write(self._encoder.encode(msg_id, message))
        return msg_id

    def send_many(self, peer: str, messages: Iterable[Message]) -> list[int] | None:
        """Several messages in one write; their msg_ids, or None if not connected."""
        conn = self._conns.get(peer)
        if conn is None or conn.closed:
            return None
        packets = [(conn.next_id(), message) for message in messages]
        if packets:
            conn.writelines(self._encoder.encode_many(packets))
        return [msg_id for msg_id, _ in packets]

    def connected(self, peer: str) -> bool:
        conn = self._conns.get(peer)
        return conn is not None and not conn.closed

    def peers_up(self) -> set[str]:
        return {peer for peer, conn in self._conns.items() if not conn.closed}

    def buffered(self, peer: str) -> int:
        """Bytes written to ``peer`` that the kernel has not taken yet (backpressure)."""
        conn = self._conns.get(peer)
        if conn is None or conn.transport is None:
            return 0
        return conn.transport.get_write_buffer_size()

    # -- connections -------------------------------------------------------------------

    def _accept(self) -> _Connection:
        acceptor = Acceptor(self.cluster, self.me, frozenset(self.peers), self.secret,
                            max_packet=self.max_packet)
        return _Connection(self, acceptor, "", tls_server=self.ssl_server)

    async def _dial_forever(self, peer: str) -> None:
        """Dial ``peer`` until closed; with several addresses, try them in turn.

        A peer given as a list is a datacenter whose serving node is the only
        one listening (the TxLog master of an HA primary): a refused or lost
        address moves on to the next one at once, and the backoff grows only
        after a whole round of them failed. A link that comes up stays on its
        address until it is lost.
        """
        loop = asyncio.get_running_loop()
        addresses = _addresses(self.peers[peer])
        index = 0
        delay = BACKOFF_MIN
        while not self._closing:
            host, port = addresses[index]
            conn = _Connection(self, Dialer(self.cluster, self.me, peer, self.secret,
                                            max_packet=self.max_packet), f"{host}:{port}")
            try:
                await asyncio.wait_for(
                    loop.create_connection(lambda c=conn: c, host, port, ssl=self.ssl_client),
                    self.handshake_timeout)
            except ssl.SSLError as exc:
                self._warn(f"cluster link to {peer} at {host}:{port}: TLS refused: {exc}")
            except (TimeoutError, OSError) as exc:
                log.debug("cluster link to %s at %s:%d: %s", peer, host, port, exc or "timeout")
            else:
                await conn.lost
                if conn.established:
                    delay = BACKOFF_MIN
            index = (index + 1) % len(addresses)
            if index and len(addresses) > 1:
                await asyncio.sleep(BACKOFF_MIN / 5)  # the next node of the same round
                continue
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, BACKOFF_MAX)

    async def _keepalive(self) -> None:
        """Ping every link; close one that has been silent for ``idle_timeout``
        (a vanished host sends no RST, so TCP alone would notice only much later)."""
        while True:
            await asyncio.sleep(self.ping_interval)
            now = time.monotonic()
            for peer, conn in list(self._conns.items()):
                if now - conn.last_rx > self.idle_timeout:
                    self._warn(f"cluster link with {peer}: silent for "
                               f"{now - conn.last_rx:.1f}s; closing")
                    conn.abort()
                elif not conn.closed:
                    conn.write(self._ping)

    def _established(self, conn: _Connection) -> None:
        assert conn.peer is not None
        self._pending.discard(conn)
        if self._closing:
            conn.abort()
            return
        peer = conn.peer
        old = self._conns.get(peer)
        self._conns[peer] = conn
        log.info("cluster link %s up", conn._label())
        if old is not None:
            log.info("cluster link with %s: the new link replaces the old one", peer)
            old.abort()
            self._call(self.on_peer_down, peer)
        self._call(self.on_peer_up, peer)

    def _lost(self, conn: _Connection, exc: Exception | None) -> None:
        peer = conn.peer
        if peer is None or self._conns.get(peer) is not conn:
            return
        del self._conns[peer]
        if self._closing:
            return
        log.info("cluster link with %s down%s", peer, f": {exc}" if exc else "")
        self._call(self.on_peer_down, peer)

    def _call(self, callback: OnPeer, peer: str) -> None:
        try:
            callback(peer)
        except Exception:
            log.exception("cluster link callback %s(%s) failed", callback, peer)

    def _warn(self, line: str, key: str | None = None) -> None:
        """WARNING, but the same ``key`` (default: the line) repeated by a retrying
        peer only every REPEAT_WARNING_AFTER seconds; DEBUG in between."""
        now = time.monotonic()
        key = line if key is None else key
        if now - self._warned.get(key, -REPEAT_WARNING_AFTER) >= REPEAT_WARNING_AFTER:
            self._warned[key] = now
            if len(self._warned) > 1000:
                self._warned.clear()
            log.warning("%s", line)
        else:
            log.debug("%s", line)
