"""The server side of one AMQP 0-9-1 connection, as a sans-I/O state machine.

Bytes in (``receive_data``), bytes out (``data_to_send``), time in (``tick``).
The transport (brokerha/node/transport.py) only moves bytes and calls these.
States follow spec 2.2.4: protocol header, start/start-ok, tune/tune-ok,
open/open-ok, then channels; closing waits for close-ok. Errors close the
channel or the connection with the reply code the spec gives them. After the
close-ok that answers a client's connection.close, the client closes the
socket: until it does (or RabbitMQ's close timeout passes) the connection
*lingers*, reading and dropping what still arrives (``_answer_close``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pamqp import commands

from brokerha import __version__
from brokerha.amqp import constants as C
from brokerha.amqp import frames as F
from brokerha.amqp.channel import CLOSING, OPEN, Channel
from brokerha.amqp.errors import AMQPError, FrameError
from brokerha.amqp.methods import HANDLERS
from brokerha.amqp.methods.basic import publish_message
from brokerha.amqp.ports import MethodHandler
from brokerha.broker.auth import AuthenticationFailed, User
from brokerha.broker.broker import Broker
from brokerha.broker.content import check_field_table
from brokerha.broker.errors import BrokerError
from brokerha.broker.queue import Queue
from brokerha.broker.vhost import VirtualHost

log = logging.getLogger(__name__)

# connection states
AWAIT_HEADER = "await-header"
AWAIT_START_OK = "await-start-ok"
AWAIT_TUNE_OK = "await-tune-ok"
AWAIT_OPEN = "await-open"
RUNNING = "running"
CLOSING_CONN = "closing"  # we sent connection.close, waiting for close-ok
CLOSED = "closed"

HANDSHAKE_TIMEOUT = 10.0
CLOSE_OK_TIMEOUT = 3.0
# After our close-ok the client closes the socket; if it does not, we do after the negotiated
# heartbeat if shorter, else after this: RabbitMQ's ?CLOSING_TIMEOUT (rabbit_reader.erl,
# close_connection/1, 30 s in 3.10 as today)
CLOSING_TIMEOUT = 30.0

SERVER_CAPABILITIES = {
    "publisher_confirms": True,
    "exchange_exchange_bindings": True,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "consumer_priorities": False,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
    "direct_reply_to": False,
}

MECHANISMS = ("PLAIN", "AMQPLAIN")
JOIN_HOLD = "join"  # the hold of a connection while a body is joined off the loop (join_body)
EXTERNAL = "EXTERNAL"  # offered on TLS connections only (RabbitMQ's rabbitmq_auth_mechanism_ssl)


@dataclass(frozen=True)
class ExternalIdentity:
    """What SASL EXTERNAL finds on a TLS connection (the transport reads the certificate).

    ``name``: the user the client certificate names; else ``refusal`` says why
    there is none, in RabbitMQ's words ("connection peer presented no TLS
    (x.509) certificate", "no name found", "TLS configuration is unsafe").
    """

    name: str | None
    refusal: str | None = None


def _response_bytes(m: commands.Connection.StartOk) -> bytes:
    """start-ok's SASL response as bytes, whatever pamqp decoded.

    pamqp annotates ``response`` as ``str`` but gives the raw ``bytes`` of a
    long string that is not UTF-8 (a PLAIN password may be anything); read
    through ``getattr`` so that the compiled module (mypyc checks annotations
    at run time) does not turn that into a TypeError and a 541.
    """
    raw: object = getattr(m, "response", b"")
    if isinstance(raw, str):  # pamqp decoded it as UTF-8: the bytes the client sent
        return raw.encode("utf-8", "surrogateescape")
    if isinstance(raw, bytes | bytearray):
        return bytes(raw)
    return b""


def _parse_plain(response: bytes) -> tuple[str, str]:
    """NUL user NUL password, as RabbitMQ reads it (rabbit_auth_mechanism_plain):
    no authorisation identity, nothing after the password."""
    parts = response.split(b"\x00")
    if len(parts) != 3 or parts[0]:
        raise ValueError("PLAIN response must be NUL user NUL password")
    return parts[1].decode("utf-8"), parts[2].decode("utf-8")


def _parse_amqplain(response: bytes) -> tuple[str, str]:
    """A field table without its leading length (RabbitMQ's and py-amqp's encoding),
    parsed as RabbitMQ parses it (any octets as field names); LOGIN and PASSWORD
    (the first of each) must be long strings."""
    found: dict[bytes, bytes] = {}
    for name, kind, start, stop in check_field_table(response, 0, len(response),
                                                     utf8_names=False):
        if name in (b"LOGIN", b"PASSWORD") and name not in found:
            if kind != 0x53:  # S
                raise ValueError(f"AMQPLAIN {name.decode()} is not a string")
            found[name] = response[start + 4 : stop]
    if len(found) != 2:
        raise ValueError("AMQPLAIN response needs LOGIN and PASSWORD")
    return found[b"LOGIN"].decode("utf-8"), found[b"PASSWORD"].decode("utf-8")


class ServerConnection:
    handlers: Mapping[type, MethodHandler] = HANDLERS  # read-only, as ConnectionPort says
    publish_handler = staticmethod(publish_message)

    def __init__(self, broker: Broker, *, peer: tuple[str, int] | None = None,
                 now: float = 0.0, conn_id: int = 0,
                 tls: ExternalIdentity | None = None) -> None:
        self.broker = broker
        self.peer = peer
        self.tls = tls  # None: a plain connection (no EXTERNAL)
        self.conn_id = conn_id
        limits = broker.limits
        self.reader = F.FrameReader(limits.frame_max)
        self.frame_max = limits.frame_max
        self.channel_max = limits.channel_max
        self.heartbeat = 0
        self.state = AWAIT_HEADER
        self.channels: dict[int, Channel] = {}
        self.exclusive_queues: dict[str, Queue] = {}
        self.user: User | None = None
        self.vhost: VirtualHost | None = None
        self.client_properties: dict[str, Any] = {}
        self.mechanism = ""
        self._out: list[bytes] = []
        self._confirm_channels: dict[int, Channel] = {}
        self.created = now
        self.last_received = now
        self.last_sent = now
        self.close_started: float | None = None  # first tick after we sent connection.close
        self.writable = True
        self.wants_close = False  # transport should close once output is flushed...
        self.lingering = False  # ...unless the client is to close first (we sent close-ok)
        self.linger_deadline = 0.0  # when the transport closes if the client has not
        self.close_reason = ""
        self.has_published = False
        self.blocked_notified = False
        self.on_output: Callable[[], None] | None = None
        self.on_read_paused: Callable[[bool], None] | None = None
        # the transport's thread for work too big for a loop step (``join_body``):
        # ``offload(work, done)`` runs ``work`` there, then ``done(result)`` on the loop,
        # ``result()`` returning what ``work`` returned or raising what it raised
        self.offload: Callable[[Callable[[], bytes], Callable[[Callable[[], bytes]], None]],
                               None] | None = None
        self._held: list[F.Frame] | None = None  # frames behind a body being joined
        self._held_error: AMQPError | None = None  # a broken frame after them
        self.reading_paused = False
        # holds of this connection alone (a partitioned node's full forward lane it publishes
        # to: partition/forwarding.py), beside the broker's flow holds and alarms
        self.publish_holds: set[str] = set()

    # -- identity ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        peer = f"{self.peer[0]}:{self.peer[1]}" if self.peer else "?"
        user = self.user.name if self.user else "-"
        return f"{peer} ({user})"

    def capability(self, name: str) -> bool:
        caps = self.client_properties.get("capabilities")
        return bool(isinstance(caps, dict) and caps.get(name))

    # -- output -----------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.state == CLOSED or self.lingering:  # nothing follows close-ok
            return
        out = self._out
        out.append(data)
        if len(out) == 1 and self.on_output is not None:
            self.on_output()

    def send_method(self, channel: int, method: Any) -> None:
        self.write(F.encode_frame(C.FRAME_METHOD, channel, F.marshal_method(method)))

    def confirms_pending(self, channel: Channel) -> None:
        if channel.number not in self._confirm_channels:
            self._confirm_channels[channel.number] = channel
            if not self._out and self.on_output is not None:
                self.on_output()

    def data_to_send(self) -> bytes:
        if self._confirm_channels:
            channels, self._confirm_channels = self._confirm_channels, {}
            for ch in channels.values():
                ch.flush_confirms()
        if not self._out:
            return b""
        data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
        self._out = []
        return data

    # -- input ------------------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float | None = None) -> None:
        if self.state == CLOSED or self.wants_close:
            return
        if now is not None:
            self.last_received = now
        reader = self.reader
        reader.feed(data)
        if self.state == AWAIT_HEADER:
            if reader.buffered() < 8:
                return
            self._check_protocol_header(reader.take(8))
            if self.wants_close:
                return
        try:
            frames = reader.frames()
        except FrameError as exc:
            frames = exc.frames  # the complete frames before the broken one: handled first
            error: AMQPError | None = exc
        else:
            error = None
        self._dispatch(frames or [], error)

    def _dispatch(self, frames: list[F.Frame], error: AMQPError | None) -> None:
        """Handle ``frames`` in order, then close on ``error`` (a broken frame after them);
        what follows a body being joined (``join_body``) is held until it is published."""
        held = self._held
        if held is not None:
            held.extend(frames)
            self._held_error = self._held_error or error
            return
        channels = self.channels
        for i, frame in enumerate(frames):
            if self.wants_close or self.state == CLOSED:
                return
            try:
                # the hot path: a frame for an open channel of a running connection
                ch = channels.get(frame.channel) if frame.channel else None
                if ch is not None and ch.state is OPEN and self.state is RUNNING:
                    ch.handle_frame(frame)
                else:
                    self._handle_frame(frame)
            except Exception as exc:
                self._failed(frame.channel, exc)
            held = self._held
            if held is not None:  # the frame completed a body joined off the loop
                held.extend(frames[i + 1:])
                self._held_error = error
                return
        if error is not None and self.state not in (CLOSED,) and not self.wants_close:
            self._close_connection(error, frame_error=True)
        self._after_input()

    def _failed(self, channel: int, exc: Exception) -> None:
        """An exception out of handling ``channel``'s input."""
        if isinstance(exc, AMQPError):
            self._error(channel, exc)
        elif isinstance(exc, BrokerError):
            self._error(channel, AMQPError(exc.code, exc.reply_text))
        else:  # a bug must not take the node down
            log.error("internal error on connection %s", self.name, exc_info=exc)
            self._error(0, AMQPError(C.INTERNAL_ERROR, f"internal error: {exc!r}"))

    def join_body(self, channel: int, parts: list[bytes],
                  then: Callable[[bytes], None]) -> None:
        """``then(b"".join(parts))``: with the transport's ``offload``, the join runs on its
        thread (``bytes.join`` lets go of the GIL over a big one: one of 50 MiB, ~400
        frames, held the loop 41-50 ms, issue 33) and every frame after the body waits,
        in order, reading paused, until ``then`` ran -- a publish on another channel
        of this connection is not routed before this one. Without: joined here and now."""
        offload = self.offload
        if offload is None or self._held is not None:  # (another one's join under way: rare)
            then(b"".join(parts))
            return
        self._held = []
        self.hold_publishing(JOIN_HOLD, True)
        offload(lambda: b"".join(parts), lambda result: self._joined(channel, then, result))

    def _joined(self, channel: int, then: Callable[[bytes], None],
                result: Callable[[], bytes]) -> None:
        frames, self._held = self._held or [], None
        error, self._held_error = self._held_error, None
        if self.state == CLOSED:
            return
        if self.state == RUNNING and not self.wants_close:  # closing: no publish goes on
            try:
                then(result())
            except Exception as exc:
                self._failed(channel, exc)
        self.hold_publishing(JOIN_HOLD, False)
        self._dispatch(frames, error)

    def _after_input(self) -> None:
        """A connection that published: memory alarm and flow holds looked at."""
        if self.has_published:
            if self.broker.limits.memory_limit:
                self.broker.check_memory()
                self._maybe_pause_reading()
            if self.broker.flow.held or self.publish_holds:
                self._set_reading_paused(True)

    def _check_protocol_header(self, header: bytes) -> None:
        if header != C.PROTOCOL_HEADER:
            # spec 4.2.2: reply with the header we support, then close the socket
            log.info("connection from %s: bad protocol header %r", self.name, header)
            self.write(C.PROTOCOL_HEADER)
            self._finish("bad protocol header")
            return
        self.state = AWAIT_START_OK
        self.send_method(0, commands.Connection.Start(
            version_major=0, version_minor=9,
            server_properties=self._server_properties(),
            mechanisms=" ".join(self._mechanisms()), locales="en_US",
        ))

    def _mechanisms(self) -> tuple[str, ...]:
        return MECHANISMS if self.tls is None else (*MECHANISMS, EXTERNAL)

    def _server_properties(self) -> dict[str, Any]:
        return {
            "product": "brokerha",
            "version": __version__,
            "platform": "Python",
            "cluster_name": self.broker.node_name,
            "copyright": "brokerha authors",
            "information": "https://brokerha.invalid/docs",
            "capabilities": dict(SERVER_CAPABILITIES),
        }

    def decode_method(self, index: int, payload: bytes) -> Any:
        if index not in commands.INDEX_MAPPING:
            raise AMQPError(C.NOT_IMPLEMENTED,
                            f"unknown method class {index >> 16} method {index & 0xFFFF}",
                            index >> 16, index & 0xFFFF)
        return F.decode_method(index, payload)

    def _handle_frame(self, frame: F.Frame) -> None:
        if frame.type == C.FRAME_HEARTBEAT:
            if frame.channel != 0:
                raise AMQPError(C.UNEXPECTED_FRAME,
                                f"heartbeat frame on channel {frame.channel}")
            return
        if self.state == CLOSING_CONN:
            self._handle_while_closing(frame)
            return
        if frame.channel == 0:
            if frame.type != C.FRAME_METHOD:
                raise AMQPError(C.UNEXPECTED_FRAME, "content frame on channel 0")
            index = F.method_index(frame.payload)
            try:
                method = self.decode_method(index, frame.payload)
            except AMQPError as exc:
                if not exc.class_id:  # RabbitMQ's reader names the method (handle_method0)
                    exc.class_id, exc.method_id = index >> 16, index & 0xFFFF
                raise
            self._handle_connection_method(method)
            return
        if self.state != RUNNING:
            raise AMQPError(C.COMMAND_INVALID,
                            f"frame on channel {frame.channel} before connection.open")
        ch = self.channels.get(frame.channel)
        if ch is None:
            self._handle_unopened_channel(frame)
            return
        if ch.state == CLOSING:
            self._handle_closing_channel(ch, frame)
            return
        self.handle_channel_frame(ch, frame)

    def handle_channel_frame(self, ch: Channel, frame: F.Frame) -> None:
        try:
            ch.handle_frame(frame)
        except AMQPError as exc:
            self.fail(ch, exc)

    def fail(self, ch: Channel, exc: AMQPError) -> None:
        """An error on a channel: soft ones close it, hard ones the connection."""
        if exc.closes_connection:
            self._close_connection(exc)
        else:
            self._close_channel(ch, exc)

    def _error(self, channel: int, exc: AMQPError) -> None:
        ch = self.channels.get(channel)
        if ch is not None and not exc.closes_connection:
            self._close_channel(ch, exc)
        else:
            self._close_connection(exc)

    # -- connection class -------------------------------------------------------------

    def _handle_connection_method(self, method: Any) -> None:
        expected: Any = {
            AWAIT_START_OK: commands.Connection.StartOk,
            AWAIT_TUNE_OK: commands.Connection.TuneOk,
            AWAIT_OPEN: commands.Connection.Open,
        }.get(self.state)
        if expected is not None and not isinstance(method, expected | commands.Connection.Close):
            raise AMQPError(C.COMMAND_INVALID,
                            f"expected '{expected.name.lower()}', got '{method.name.lower()}'")
        if isinstance(method, commands.Connection.StartOk):
            self._start_ok(method)
        elif isinstance(method, commands.Connection.TuneOk):
            self._tune_ok(method)
        elif isinstance(method, commands.Connection.Open):
            self._open(method)
        elif isinstance(method, commands.Connection.Close):
            self._answer_close("closed by client")
        elif method.index >> 16 != 10:
            raise AMQPError(C.CHANNEL_ERROR, f"{method.name} on channel 0",
                            method.index >> 16, method.index & 0xFFFF)
        elif isinstance(method, commands.Connection.UpdateSecret):
            self.send_method(0, commands.Connection.UpdateSecretOk())
        elif isinstance(method, commands.Connection.Blocked | commands.Connection.Unblocked):
            pass  # a client may tell us; nothing to do
        else:
            raise AMQPError(C.COMMAND_INVALID, f"unexpected method {method.name} on channel 0",
                            method.index >> 16, method.index & 0xFFFF)

    def _start_ok(self, m: commands.Connection.StartOk) -> None:
        self.client_properties = dict(m.client_properties or {})
        mechanism = m.mechanism
        self.mechanism = mechanism
        if mechanism not in self._mechanisms():
            known = mechanism in MECHANISMS or mechanism == EXTERNAL
            raise AMQPError(C.COMMAND_INVALID, f"{'invalid' if known else 'unknown'} "
                            f"authentication mechanism '{mechanism}'", 10, 11)
        peer_host = self.peer[0] if self.peer else None
        try:
            if mechanism == EXTERNAL:
                assert self.tls is not None
                if self.tls.name is None:
                    raise AuthenticationFailed(self.tls.refusal or "no name found")
                self.user = self.broker.users.authenticate_external(self.tls.name, peer_host)
            else:
                try:
                    username, password = (_parse_plain if mechanism == "PLAIN"
                                          else _parse_amqplain)(_response_bytes(m))
                except UnicodeDecodeError as exc:  # RabbitMQ: no such user, or a bad password
                    raise AuthenticationFailed("user name or password is not UTF-8") from exc
                except ValueError as exc:
                    # RabbitMQ closes the socket without an answer (a handshake error)
                    log.warning("connection from %s refused: malformed %s response: %s",
                                self.name, mechanism, exc)
                    self._finish(f"malformed {mechanism} response")
                    return
                self.user = self.broker.users.authenticate(username, password, peer_host)
        except AuthenticationFailed as exc:
            log.warning("connection from %s refused: %s login refused: %s", self.name,
                        mechanism, exc)
            text = (f"ACCESS_REFUSED - Login was refused using authentication mechanism "
                    f"{mechanism}. For details see the broker logfile.")
            if self.capability("authentication_failure_close"):  # no method: class 0, as RabbitMQ
                self.send_method(0, commands.Connection.Close(
                    reply_code=C.ACCESS_REFUSED, reply_text=text, class_id=0, method_id=0))
            self._finish("authentication failed")
            return
        self.state = AWAIT_TUNE_OK
        self.send_method(0, commands.Connection.Tune(
            channel_max=self.channel_max, frame_max=self.frame_max,
            heartbeat=self.broker.limits.heartbeat,
        ))

    def _tune_ok(self, m: commands.Connection.TuneOk) -> None:
        server_max = self.broker.limits.frame_max
        frame_max = m.frame_max or server_max
        if frame_max > server_max:
            raise AMQPError(C.NOT_ALLOWED, f"frame_max={frame_max} > {server_max} max size", 10, 31)
        if frame_max < C.FRAME_MIN_SIZE:
            raise AMQPError(C.NOT_ALLOWED,
                            f"frame_max={frame_max} < {C.FRAME_MIN_SIZE} min size", 10, 31)
        self.frame_max = frame_max
        self.reader.frame_max = frame_max
        if m.channel_max:
            self.channel_max = min(m.channel_max, self.channel_max)
        self.heartbeat = m.heartbeat
        self.state = AWAIT_OPEN

    def _open(self, m: commands.Connection.Open) -> None:
        assert self.user is not None
        name = m.virtual_host or "/"
        vhost = self.broker.vhosts.get(name)
        if vhost is None:
            raise AMQPError(C.NOT_ALLOWED, f"vhost {name} not found", 10, 40)
        if name not in self.user.permissions:
            raise AMQPError(C.NOT_ALLOWED,
                            f"access to vhost '{name}' refused for user '{self.user.name}'", 10, 40)
        self.vhost = vhost
        self.state = RUNNING
        self.send_method(0, commands.Connection.OpenOk())
        self.broker.alarm_listeners.append(self._resource_alarm)
        self.broker.flow.listeners.append(self._flow)
        if self.broker.publishers_blocked:
            self._resource_alarm(True)
        log.info("connection %s opened vhost '%s'", self.name, name)

    # -- channels ---------------------------------------------------------------------

    def _handle_unopened_channel(self, frame: F.Frame) -> None:
        if frame.type == C.FRAME_METHOD:
            index = F.method_index(frame.payload)
            if index == commands.Channel.Open.index:
                # RabbitMQ limits how many channels are open, not their numbers (aiormq
                # opens channel 65535 after a tune-ok of 2047): any number 1..65535
                if self.channel_max and len(self.channels) >= self.channel_max:
                    raise AMQPError(C.NOT_ALLOWED,
                                    f"number of channels opened ({len(self.channels)}) has "
                                    f"reached the negotiated channel_max ({self.channel_max})",
                                    20, 10)
                self.channels[frame.channel] = Channel(self, frame.channel)
                self.send_method(frame.channel, commands.Channel.OpenOk())
                return
            if index == commands.Channel.CloseOk.index:
                return  # late close-ok for a channel already gone
            raise AMQPError(C.CHANNEL_ERROR, "expected 'channel.open'", index >> 16, index & 0xFFFF)
        raise AMQPError(C.CHANNEL_ERROR, "expected 'channel.open'")

    def _handle_closing_channel(self, ch: Channel, frame: F.Frame) -> None:
        """After we sent channel.close: only close-ok (or a crossing close) matters."""
        if frame.type != C.FRAME_METHOD:
            return
        index = F.method_index(frame.payload)
        if index == commands.Channel.CloseOk.index:
            self.channels.pop(ch.number, None)
        elif index == commands.Channel.Close.index:
            self.send_method(ch.number, commands.Channel.CloseOk())
            self.channels.pop(ch.number, None)

    def close_channel_by_peer(self, ch: Channel) -> None:
        ch.release()
        self.channels.pop(ch.number, None)
        self._confirm_channels.pop(ch.number, None)
        self.send_method(ch.number, commands.Channel.CloseOk())

    def _close_channel(self, ch: Channel, exc: AMQPError) -> None:
        log.info("channel %d on %s closed: %s", ch.number, self.name, exc.text)
        ch.release()
        ch.state = CLOSING
        self._confirm_channels.pop(ch.number, None)
        self.send_method(ch.number, commands.Channel.Close(
            reply_code=exc.code, reply_text=exc.text,
            class_id=exc.class_id, method_id=exc.method_id))

    # -- closing -----------------------------------------------------------------------

    def _close_connection(self, exc: AMQPError, frame_error: bool = False) -> None:
        if self.state in (CLOSING_CONN, CLOSED) or self.wants_close:  # over: nothing to say
            return
        if self.state == AWAIT_START_OK:
            # Before a login RabbitMQ answers only a refused one (rabbit_reader's
            # handle_exception in state 'starting'): whatever else went wrong (an
            # unknown mechanism, a start-ok that does not decode, a broken frame,
            # another method) it closes the socket without a connection.close.
            log.warning("connection from %s refused before login: %s", self.name, exc.text)
            self._finish(exc.text)
            return
        log.warning("closing connection %s: %s", self.name, exc.text)
        self.send_method(0, commands.Connection.Close(
            reply_code=exc.code, reply_text=exc.text,
            class_id=exc.class_id, method_id=exc.method_id))
        self._release_channels()
        if frame_error or self.state != RUNNING:
            # the stream cannot be trusted or was never set up: do not wait for close-ok
            self._finish(exc.text)
            return
        self.state = CLOSING_CONN
        self.close_started = None
        self.close_reason = exc.text

    def shutdown(self, code: int = C.CONNECTION_FORCED,
                 text: str = "broker forced connection closure with reason 'shutdown'") -> None:
        """Server-initiated close (node stopping, failover)."""
        if self.wants_close:  # already over (answered, refused, timed out): the socket goes now
            self.lingering = False
            return
        if self.state == RUNNING:
            self._close_connection(AMQPError(code, text))
        else:
            self._finish(text)

    def _handle_while_closing(self, frame: F.Frame) -> None:
        if frame.channel != 0 or frame.type != C.FRAME_METHOD:
            return
        index = F.method_index(frame.payload)
        if index == commands.Connection.CloseOk.index:
            self._finish(self.close_reason)
        elif index == commands.Connection.Close.index:  # the closes crossed
            self._answer_close(self.close_reason)

    def _answer_close(self, reason: str) -> None:
        """close-ok to the client's connection.close; then the client closes the socket.

        The peer that receives close-ok closes the socket (the spec's close-ok "tells the
        recipient that it is safe to ... close the socket"; RabbitMQ leaves it to the
        client). Closing it here while the client's publishes are still
        arriving behind its close (it sent them before it saw our close-ok) would leave
        them unread, and the kernel answers unread data with a TCP RST: the client gets
        ECONNRESET or EPIPE instead of its close-ok (amqplib's close callback never
        fires). So the connection lingers: what arrives is dropped unread, and the
        transport closes when the client does or at ``linger_deadline`` (RabbitMQ's
        close timeout). Nothing is bounded by bytes: nothing is kept, and a bound would
        reset exactly the clients with the longest backlog.
        """
        self.send_method(0, commands.Connection.CloseOk())
        self._finish(reason)
        self.lingering = True
        hb = float(self.heartbeat)  # RabbitMQ: the heartbeat if shorter than its timeout
        deadline = self.last_received + (hb if 0 < hb < CLOSING_TIMEOUT else CLOSING_TIMEOUT)
        if self.vhost is None:  # not opened yet: no longer than its handshake had left
            deadline = min(deadline, self.created + HANDSHAKE_TIMEOUT)
        self.linger_deadline = deadline
        self._release_resources()  # exclusive queues go now, as RabbitMQ's before close-ok
        self._set_reading_paused(False)  # an alarm's pause would keep the backlog unread

    def _finish(self, reason: str) -> None:
        self.wants_close = True
        self.close_reason = self.close_reason or reason
        self._release_channels()

    def _release_channels(self) -> None:
        for ch in list(self.channels.values()):
            if ch.state == OPEN:
                ch.release()
                ch.state = CLOSING

    def connection_lost(self) -> None:
        """The socket is gone: release everything the connection held."""
        if self.state == CLOSED:
            return
        self._release_channels()
        self.channels.clear()
        self.state = CLOSED
        self.lingering = False
        self._release_resources()
        if self.user is not None:
            log.info("connection %s closed%s", self.name,
                     f": {self.close_reason}" if self.close_reason else "")

    def _release_resources(self) -> None:
        """What the connection holds beyond its channels: its exclusive queues (deleted
        when it closes) and its place among the alarm and flow listeners."""
        if self._resource_alarm in self.broker.alarm_listeners:
            self.broker.alarm_listeners.remove(self._resource_alarm)
        if self._flow in self.broker.flow.listeners:
            self.broker.flow.listeners.remove(self._flow)
        if self.vhost is not None:
            for queue in list(self.exclusive_queues.values()):
                self.vhost.remove_queue(queue)
        self.exclusive_queues.clear()

    # -- time ------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Heartbeats out, dead peers detected, handshake, close-ok and closing timeouts."""
        if self.lingering:
            if now >= self.linger_deadline:  # the client kept the socket open: close it
                log.info("connection %s: the client did not close the socket after "
                         "close-ok; closing it", self.name)
                self.lingering = False
            return
        if self.state == CLOSED or self.wants_close:
            return
        if self.state in (AWAIT_HEADER, AWAIT_START_OK, AWAIT_TUNE_OK, AWAIT_OPEN):
            if now - self.created > HANDSHAKE_TIMEOUT:
                log.warning("connection %s: handshake timeout", self.name)
                self._finish("handshake timeout")
            return
        if self.state == CLOSING_CONN:
            # a peer that never answers close-ok (however chatty) is dropped in bounded time
            if self.close_started is None:
                self.close_started = now
            elif now - self.close_started > CLOSE_OK_TIMEOUT:
                self._finish(self.close_reason)
            return
        hb = self.heartbeat
        if not hb:
            return
        if now - self.last_received > 2 * hb:
            log.warning("connection %s: missed heartbeats from client, timeout: %ds",
                        self.name, hb)
            self.close_reason = "missed heartbeats"
            self._finish("missed heartbeats")
            return
        if now - self.last_sent >= hb / 2:
            self.write(F.HEARTBEAT_FRAME)

    def sent(self, now: float) -> None:
        """The transport wrote data at ``now`` (any frame counts as a heartbeat)."""
        self.last_sent = now

    # -- flow control -------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        for ch in list(self.channels.values()):
            if ch.state == OPEN:
                ch.redispatch()

    def _resource_alarm(self, blocked: bool) -> None:
        if self.state != RUNNING:
            return
        if self.capability("connection.blocked") and blocked != self.blocked_notified:
            self.blocked_notified = blocked
            if blocked:
                self.send_method(0, commands.Connection.Blocked(reason=self.broker.blocked_reason))
            else:
                self.send_method(0, commands.Connection.Unblocked())
        if not blocked:
            if not self.broker.flow.held and not self.publish_holds:
                self._set_reading_paused(False)
        else:
            self._maybe_pause_reading()

    def _maybe_pause_reading(self) -> None:
        if self.broker.publishers_blocked and self.has_published:
            self._set_reading_paused(True)

    def _flow(self, held: bool) -> None:
        """Publishers held or released (``broker/flow.py``): read again unless an alarm holds."""
        if held:
            if self.has_published:
                self._set_reading_paused(True)
        elif not self.broker.publishers_blocked and not self.publish_holds:
            self._set_reading_paused(False)

    def hold_publishing(self, name: str, held: bool) -> None:
        """Hold (or release) this connection alone for ``name``: not read while held, as for
        a flow hold (no ``connection.blocked``: internal back-pressure, per connection as
        RabbitMQ's credit flow)."""
        if held:
            self.publish_holds.add(name)
            if self.state != CLOSED and not self.wants_close:
                self._set_reading_paused(True)
            return
        self.publish_holds.discard(name)
        if (not self.publish_holds and self.state != CLOSED and not self.broker.flow.held
                and not self.broker.publishers_blocked):
            self._set_reading_paused(False)

    def _set_reading_paused(self, paused: bool) -> None:
        if paused and self.lingering:  # the client's backlog is read (and dropped) to the end
            return
        if paused != self.reading_paused:
            self.reading_paused = paused
            if self.on_read_paused is not None:
                self.on_read_paused(paused)
