"""A client's connection.close: close-ok, then the client closes the socket (issue 34).

The peer that receives close-ok closes the socket. A client that sends
connection.close while its publishes are still on their way behind it (amqplib's
publisher, a fast producer's ``close()``) must get its close-ok and a clean end:
RabbitMQ answers close-ok, drops whatever follows and waits for the client to
close, at most its close timeout (``?CLOSING_TIMEOUT`` in rabbit_reader.erl, 30 s,
or the heartbeat if shorter). brokerha closed at once, and the kernel answered
the unread publishes with a TCP RST: the client saw ECONNRESET or EPIPE instead.

First the state machine (no sockets), then the transport with a stand-in
socket, then real sockets: a node on each event loop, and a cluster with TLS
and relays. ``RawClient`` and the two scenarios are shared with
tests/differential/test_connection_close.py, which runs them against RabbitMQ.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import pytest
from pamqp import body as pbody
from pamqp import commands, frame, header, heartbeat

from brokerha.amqp import constants as C
from brokerha.amqp.connection import CLOSING_TIMEOUT, HANDSHAKE_TIMEOUT
from brokerha.ha.admission import ClientAdmission
from brokerha.node.transport import AMQPProtocol
from brokerha.testing import LocalCluster, NodeProcess
from tests.amqp.wire import Wire, make_broker

CLIENT_CLOSE = commands.Connection.Close(reply_code=200, reply_text="bye", class_id=0,
                                         method_id=0)


def publish_frames(channel: int, routing_key: str, body: bytes, count: int = 1) -> bytes:
    one = (frame.marshal(commands.Basic.Publish(exchange="", routing_key=routing_key), channel)
           + frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()),
                           channel)
           + frame.marshal(pbody.ContentBody(body), channel))
    return one * count


def close_frame() -> bytes:
    return frame.marshal(CLIENT_CLOSE, 0)


# -- the state machine ------------------------------------------------------------------


def lingering_after_close(w: Wire, trailing: bytes = b"") -> None:
    """The client's close (with ``trailing`` in the same read) got close-ok, nothing else."""
    w.raw(close_frame() + trailing)
    assert [type(m) for m in w.methods()] == [commands.Connection.CloseOk]
    assert w.conn.wants_close and w.conn.lingering


def test_frames_after_close_ok_are_dropped_not_answered() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.frames()
    lingering_after_close(w, publish_frames(1, "q", b"late", 3)
                          + frame.marshal(commands.Queue.Declare(queue="q2"), 1))
    # later reads: publishes, methods on channel 0 and others, heartbeats, even garbage
    for data in (publish_frames(1, "q", b"later", 5),
                 frame.marshal(commands.Channel.Open(), 2),
                 frame.marshal(CLIENT_CLOSE, 0),
                 frame.marshal(commands.Connection.CloseOk(), 0),
                 frame.marshal(heartbeat.Heartbeat(), 0),
                 b"\xff" * 64):
        w.raw(data)
        assert w.conn.data_to_send() == b""
    vhost = w.broker.vhosts["/"]
    assert vhost.queues["q"].message_count == 0 and "q2" not in vhost.queues
    assert w.conn.lingering


def test_publishes_before_the_close_are_taken_those_after_are_not() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.frames()
    w.raw(publish_frames(1, "q", b"before", 2) + close_frame() + publish_frames(1, "q", b"x"))
    assert [type(m) for m in w.methods()] == [commands.Connection.CloseOk]
    assert w.broker.vhosts["/"].queues["q"].message_count == 2


def test_a_close_followed_by_a_broken_frame_in_the_same_read_still_gets_close_ok() -> None:
    """The frames before a broken one are handled first (they were lost with the error)."""
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.frames()
    broken = b"\x01\x00\x01\x00\x00\x00\x02ab\x00"  # a method frame whose end octet is 0
    lingering_after_close(w, broken)
    # publishes ahead of the garbage are taken, and then the connection is closed with 501
    w2 = Wire().connected()
    w2.method(1, commands.Queue.Declare(queue="q"))
    w2.frames()
    w2.raw(publish_frames(1, "q", b"kept", 2) + broken)
    methods = w2.methods()
    assert [type(m) for m in methods] == [commands.Connection.Close]
    assert methods[0].reply_code == C.FRAME_ERROR
    assert w2.broker.vhosts["/"].queues["q"].message_count == 2


@pytest.mark.parametrize(("heartbeat_s", "timeout"), [(0, CLOSING_TIMEOUT), (5, 5.0),
                                                      (60, CLOSING_TIMEOUT)])
def test_the_socket_stays_open_until_rabbitmqs_close_timeout(heartbeat_s: int,
                                                             timeout: float) -> None:
    """RabbitMQ: the negotiated heartbeat if it is shorter than ?CLOSING_TIMEOUT (30 s)."""
    w = Wire()
    w.handshake(heartbeat_s=heartbeat_s)
    w.now = 100.0
    lingering_after_close(w)
    assert w.conn.linger_deadline == 100.0 + timeout
    w.conn.tick(100.0 + timeout - 0.01)
    assert w.conn.lingering and w.conn.data_to_send() == b""  # no heartbeat after close-ok
    w.conn.tick(100.0 + timeout)
    assert w.conn.wants_close and not w.conn.lingering  # the transport closes now


def test_a_connection_closed_before_open_lingers_no_longer_than_its_handshake() -> None:
    w = Wire()
    w.raw(C.PROTOCOL_HEADER)
    w.frames()
    w.now = 4.0
    lingering_after_close(w)
    assert w.conn.linger_deadline == HANDSHAKE_TIMEOUT


def test_a_lingering_connection_goes_at_once_when_the_broker_closes_it() -> None:
    """force_close (the role ended) and a node stopping: no 320 after close-ok, no wait."""
    w = Wire().connected()
    lingering_after_close(w)
    w.conn.shutdown()
    assert w.conn.data_to_send() == b"" and not w.conn.lingering and w.conn.wants_close


def test_exclusive_queues_go_with_the_close_ok() -> None:
    """As RabbitMQ, which deletes them before it sends close-ok: the client may reconnect
    and declare the same name before its old socket is closed."""
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="mine", exclusive=True))
    w.frames()
    lingering_after_close(w)
    assert "mine" not in w.broker.vhosts["/"].queues
    other = Wire(w.broker).connected()
    other.method(1, commands.Queue.Declare(queue="mine", exclusive=True))
    other.expect(commands.Queue.DeclareOk)


def test_reading_resumes_after_close_ok_even_under_an_alarm() -> None:
    """An alarm pauses a publisher's reading; its backlog must still be read to its end."""
    broker = make_broker()
    w = Wire(broker).connected()
    paused: list[bool] = []
    w.conn.on_read_paused = paused.append
    w.publish(1, "", "nowhere", b"x")
    broker.set_alarm("disk", "free 10 MB, limit 50 MB")
    w.frames()
    assert paused == [True]
    lingering_after_close(w, publish_frames(1, "", b"y", 3))
    assert paused == [True, False]
    broker.set_alarm("memory", "over the limit")
    broker.set_alarm("disk", None)
    broker.set_alarm("memory", None)
    assert paused == [True, False]


def test_crossing_closes_get_close_ok_and_linger() -> None:
    w = Wire().connected()
    w.conn.shutdown()
    w.expect(commands.Connection.Close)
    lingering_after_close(w, publish_frames(1, "", b"x"))


def test_a_server_initiated_close_still_ends_at_the_clients_close_ok() -> None:
    w = Wire().connected()
    w.conn.shutdown()
    w.expect(commands.Connection.Close)
    w.method(0, commands.Connection.CloseOk())
    assert w.conn.wants_close and not w.conn.lingering


def test_missed_heartbeats_still_close_at_once() -> None:
    w = Wire()
    w.handshake(heartbeat_s=2)
    w.conn.tick(5.0)
    assert w.conn.wants_close and not w.conn.lingering


# -- the transport ----------------------------------------------------------------------


class FakeTransport:
    """What AMQPProtocol calls on its transport, recorded."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False
        self.aborted = False
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


@pytest.fixture
def served() -> Iterator[tuple[AMQPProtocol, FakeTransport, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    admission = ClientAdmission(lambda: 1)
    assert admission.open(1)
    proto = AMQPProtocol(loop, make_broker(), admission)
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    login = [C.PROTOCOL_HEADER]
    for method in (commands.Connection.StartOk(client_properties={}, mechanism="PLAIN",
                                               response="\x00guest\x00guest", locale="en_US"),
                   commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0),
                   commands.Connection.Open(virtual_host="/")):
        login.append(frame.marshal(method, 0))
    login.append(frame.marshal(commands.Channel.Open(), 1))
    proto.data_received(b"".join(login))
    assert transport.written.endswith(frame.marshal(commands.Channel.OpenOk(), 1))
    transport.written = b""
    yield proto, transport, loop
    loop.close()


def test_the_transport_stays_open_until_the_client_closes(
        served: tuple[AMQPProtocol, FakeTransport, asyncio.AbstractEventLoop]) -> None:
    proto, transport, loop = served
    proto.data_received(publish_frames(1, "", b"x", 2) + close_frame()
                        + publish_frames(1, "", b"y", 2))
    assert transport.written == frame.marshal(commands.Connection.CloseOk(), 0)
    assert not transport.closed
    proto.data_received(publish_frames(1, "", b"z", 100))
    proto.tick(loop.time() + 1.0)
    assert not transport.closed and transport.reading
    assert transport.written == frame.marshal(commands.Connection.CloseOk(), 0)
    assert proto.eof_received() is False  # the client closed: asyncio closes ours
    proto.connection_lost(None)
    assert proto.conn is not None and proto.conn.state == "closed"


def test_the_transport_closes_at_the_close_timeout(
        served: tuple[AMQPProtocol, FakeTransport, asyncio.AbstractEventLoop]) -> None:
    proto, transport, loop = served
    proto.data_received(close_frame())
    proto.tick(loop.time() + CLOSING_TIMEOUT - 1.0)
    assert not transport.closed
    proto.tick(loop.time() + CLOSING_TIMEOUT + 1.0)
    assert transport.closed and transport.written == frame.marshal(
        commands.Connection.CloseOk(), 0)


def test_force_close_drops_a_lingering_connection_at_once(
        served: tuple[AMQPProtocol, FakeTransport, asyncio.AbstractEventLoop]) -> None:
    proto, transport, _ = served
    proto.data_received(close_frame())
    proto.force_close()
    assert transport.aborted
    assert transport.written == frame.marshal(commands.Connection.CloseOk(), 0)  # no 320


# -- real sockets -----------------------------------------------------------------------


class RawClient:
    """An AMQP client on a bare socket: frames out, frames in, no library's own close."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    @classmethod
    def connect(cls, url: str, context: ssl.SSLContext | None = None) -> RawClient:
        parts = urlparse(url)
        sock = socket.create_connection((parts.hostname, parts.port or 5672), timeout=10)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname="localhost")
        return cls(sock)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next_frame(self) -> Any | None:
        """The next frame's value (methods, heartbeats...); None at EOF. Raises
        ConnectionResetError on a reset, TimeoutError when nothing comes."""
        while True:
            if len(self.buf) >= 8 and len(self.buf) >= 8 + struct.unpack(">I", self.buf[3:7])[0]:
                used, _, value = frame.unmarshal(self.buf)
                self.buf = self.buf[used:]
                return value
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk

    def expect(self, cls: type) -> Any:
        value = self.next_frame()
        assert isinstance(value, cls), f"expected {cls.__name__}, got {value!r}"
        return value

    def login(self, heartbeat_s: int = 0) -> None:
        """Connection handshake as guest on vhost '/', then channel 1 open."""
        self.send(C.PROTOCOL_HEADER)
        self.expect(commands.Connection.Start)
        self.send(frame.marshal(commands.Connection.StartOk(
            client_properties={"product": "raw"}, mechanism="PLAIN",
            response="\x00guest\x00guest", locale="en_US"), 0))
        self.expect(commands.Connection.Tune)
        self.send(frame.marshal(commands.Connection.TuneOk(
            channel_max=2047, frame_max=131072, heartbeat=heartbeat_s), 0)
            + frame.marshal(commands.Connection.Open(virtual_host="/"), 0)
            + frame.marshal(commands.Channel.Open(), 1))
        self.expect(commands.Connection.OpenOk)
        self.expect(commands.Channel.OpenOk)

    def probe(self, wait: float) -> str:
        """Whether the broker still leaves the socket to us: 'open' if nothing comes
        within ``wait`` s, else 'eof', 'reset' or what it sent."""
        self.sock.settimeout(wait)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return "open"
        except ConnectionResetError:
            return "reset"
        finally:
            self.sock.settimeout(10)
        return f"sent {data!r}" if data else "eof"

    def end(self, wait: float) -> str:
        """Close our sending side, then how the broker ends: 'eof' (clean), 'reset', or
        'open' (nothing within ``wait`` s). Anything it still sends is an error."""
        sock = self.sock
        sock.settimeout(wait)
        try:
            if isinstance(sock, ssl.SSLSocket):
                sock = sock.unwrap()  # close_notify, and the broker's in answer
            sock.shutdown(socket.SHUT_WR)
            while True:
                data = sock.recv(65536)
                if not data:
                    return "eof"
                raise AssertionError(f"the broker sent {data!r} after close-ok")
        except ConnectionResetError:
            return "reset"
        except TimeoutError:
            return "open"
        except ssl.SSLError as exc:  # the broker closed the TCP connection without TLS's end
            return f"tls: {exc.reason}"
        except OSError as exc:  # ENOTCONN: the connection was reset already
            return f"{type(exc).__name__} {exc.errno}"
        finally:
            sock.close()


@dataclass
class CloseOutcome:
    """What a client that closed behind its publishes saw.

    All but ``end`` is the same on RabbitMQ. ``end`` is how the broker answered our
    own close: RabbitMQ resets (its listeners' ``{linger, {true, 0}}``, deps/rabbit/
    Makefile: every close of its sockets is a RST), brokerha closes cleanly.
    """

    before_close_ok: list[str] = field(default_factory=list)  # frames ahead of close-ok
    close_ok: bool = False
    sending: str = "ok"  # sending, before close-ok and after it: 'ok' or the error
    after_sending: str = ""  # then, before we close: 'open' (the socket left to us)
    end: str = ""  # after our side closed: 'eof', 'reset', 'open' (no end in 5 s)


def close_behind_publishes(client: RawClient, trailing: int = 4 << 20,
                           after: int = 256 << 10) -> CloseOutcome:
    """Publishes, connection.close and ``trailing`` bytes of publishes in one write; once
    close-ok is read, ``after`` bytes more, and a few more later; then our side closes."""
    outcome = CloseOutcome()
    client.login()
    body = b"p" * 1000
    per_publish = len(publish_frames(1, "nowhere", body))
    try:
        client.send(publish_frames(1, "nowhere", body, 20) + close_frame()
                    + publish_frames(1, "nowhere", body, trailing // per_publish))
        while True:
            value = client.next_frame()
            if value is None or isinstance(value, commands.Connection.CloseOk):
                outcome.close_ok = value is not None
                break
            outcome.before_close_ok.append(type(value).__name__)
        time.sleep(0.1)  # as a publisher whose writes were still queued
        client.send(publish_frames(1, "nowhere", body, after // per_publish))
        time.sleep(0.2)
        client.send(publish_frames(1, "nowhere", body, 10))
    except OSError as exc:
        outcome.sending = type(exc).__name__
    outcome.after_sending = client.probe(0.5)
    outcome.end = client.end(wait=5.0)
    return outcome


CLEAN_CLOSE = CloseOutcome(before_close_ok=[], close_ok=True, sending="ok",
                           after_sending="open", end="eof")


def close_and_stay(client: RawClient, heartbeat_s: int) -> tuple[str, float]:
    """close, close-ok, then never close: how (and how many seconds after close-ok) the
    broker ends the connection. Heartbeats it sends meanwhile are skipped."""
    client.login(heartbeat_s)
    client.send(close_frame())
    while not isinstance(client.next_frame(), commands.Connection.CloseOk):
        pass
    start = time.monotonic()
    client.sock.settimeout(heartbeat_s + 10.0)
    try:
        while True:
            value = client.next_frame()
            if value is None:
                return "eof", time.monotonic() - start
            if not isinstance(value, heartbeat.Heartbeat):
                return f"sent {value!r}", time.monotonic() - start
    except ConnectionResetError:
        return "reset", time.monotonic() - start
    finally:
        client.sock.close()


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def node(request: pytest.FixtureRequest) -> Iterator[NodeProcess]:
    with NodeProcess("close-ok", extra_args=["--event-loop", request.param]) as n:
        yield n


@pytest.mark.timeout(60)
def test_a_close_behind_publishes_gets_close_ok_and_no_reset(node: NodeProcess) -> None:
    assert close_behind_publishes(RawClient.connect(node.url)) == CLEAN_CLOSE


@pytest.mark.timeout(60)
def test_a_client_that_never_closes_is_closed_after_the_heartbeat(node: NodeProcess) -> None:
    how, after = close_and_stay(RawClient.connect(node.url), heartbeat_s=1)
    assert how == "eof" and 0.8 <= after <= 3.0, (how, after)


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, tls=True) as c:
        primary = c.wait_primary()
        for name in c.names:
            if name != primary:
                c.wait_ready(name)
        yield c


@pytest.mark.timeout(120)
@pytest.mark.parametrize("entry", ["primary amqps", "backup amqp (relayed)",
                                   "backup amqps (relayed over TLS)"])
def test_tls_and_relayed_connections_end_cleanly_too(tls_cluster: LocalCluster,
                                                     entry: str) -> None:
    primary = tls_cluster.wait_primary()
    backup = next(name for name in tls_cluster.names if name != primary)
    node = primary if entry.startswith("primary") else backup
    amqps = "amqps" in entry
    port = tls_cluster.port(node) + (len(tls_cluster.names) if amqps else 0)
    context = (ssl.create_default_context(cafile=str(tls_cluster.data_dir / "tls" / "ca.pem"))
               if amqps else None)
    client = RawClient.connect(f"amqp://127.0.0.1:{port}", context)
    assert close_behind_publishes(client) == CLEAN_CLOSE
