"""Helpers shared by the client conformance tests."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest
from pamqp import commands, frame
from pamqp.heartbeat import Heartbeat

# --------------------------------------------------------------------------- pika


@contextlib.contextmanager
def closed_by_broker(code: int, *fragments: str,
                     exc: type[Exception] = pika.exceptions.ChannelClosedByBroker) -> Iterator[None]:
    """Expect a broker-initiated channel (default) or connection close with ``code``.

    Each ``fragment`` must occur in the reply text (RabbitMQ's texts start with the
    reply-code name, e.g. ``NOT_FOUND - no queue 'x' in vhost '/'``).
    """
    with pytest.raises(exc) as info:
        yield
    err = info.value
    assert err.reply_code == code, err.reply_text
    for fragment in fragments:
        assert fragment in err.reply_text, (fragment, err.reply_text)


def channel_error(code: int, *fragments: str) -> contextlib.AbstractContextManager[None]:
    return closed_by_broker(code, *fragments)


def connection_error(code: int, *fragments: str) -> contextlib.AbstractContextManager[None]:
    return closed_by_broker(code, *fragments, exc=pika.exceptions.ConnectionClosedByBroker)


def get_bodies(ch, queue: str, *, ack: bool = True) -> list[bytes]:
    """basic.get until get-empty; the bodies in order."""
    out = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=ack)
        if method is None:
            return out
        out.append(body)


def wait_for(conn, predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
    """Pump a BlockingConnection until ``predicate()`` is truthy; return its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        conn.process_data_events(time_limit=0.05)


def message_count(ch, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def count_becomes(ch, queue: str, expected: int, timeout: float = 3.0) -> int:
    """The queue's ready-message count once it equals ``expected`` (or after ``timeout``).

    RabbitMQ answers a passive queue.declare ahead of deliveries still in its queue
    process's mailbox (its stat call has priority), so a count read right after a
    publish may lag; wait for it to settle.
    """
    deadline = time.monotonic() + timeout
    while (n := message_count(ch, queue)) != expected and time.monotonic() < deadline:
        ch.connection.sleep(0.02)
    return n


def queue_exists(conn, queue: str) -> bool:
    ch = conn.channel()
    try:
        ch.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == 404, e
        return False
    ch.close()
    return True


def exchange_exists(conn, exchange: str) -> bool:
    ch = conn.channel()
    try:
        ch.exchange_declare(exchange, passive=True)
    except pika.exceptions.ChannelClosedByBroker as e:
        assert e.reply_code == 404, e
        return False
    ch.close()
    return True


def assert_broker_alive(broker) -> None:
    """A fresh connection can still declare, publish and get."""
    conn = pika.BlockingConnection(broker.params(socket_timeout=5))
    try:
        ch = conn.channel()
        q = ch.queue_declare("", exclusive=True).method.queue
        ch.basic_publish("", q, b"alive")
        assert get_bodies(ch, q) == [b"alive"]
    finally:
        conn.close()


# --------------------------------------------------------------------------- raw AMQP

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_END = b"\xce"


def raw_frame(frame_type: int, channel: int, payload: bytes, end: bytes = FRAME_END) -> bytes:
    return struct.pack(">BHI", frame_type, channel, len(payload)) + payload + end


def method_payload(class_id: int, method_id: int, args: bytes = b"") -> bytes:
    return struct.pack(">HH", class_id, method_id) + args


class RawClient:
    """A blocking AMQP client on a bare socket, with pamqp as the codec.

    It does only what a test tells it to, so tests can send bytes no real client would.
    """

    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buf = bytearray()
        self.start: commands.Connection.Start | None = None
        self.tune: commands.Connection.Tune | None = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bytes
    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_frame(self, value: Any, channel: int = 0) -> None:
        self.sock.sendall(frame.marshal(value, channel))

    def _fill(self, deadline: float) -> bool:
        """Read more bytes into the buffer; False on EOF/reset."""
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return False
        if not data:
            return False
        self.buf += data
        return True

    def recv_exact(self, n: int, timeout: float = 5.0) -> bytes:
        deadline = time.monotonic() + timeout
        while len(self.buf) < n:
            if not self._fill(deadline):
                break
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def read_to_eof(self, timeout: float = 5.0) -> bytes:
        """Everything until the peer closes; raises TimeoutError if it does not."""
        deadline = time.monotonic() + timeout
        while self._fill(deadline):
            pass
        out = bytes(self.buf)
        self.buf.clear()
        return out

    def recv_raw(self, timeout: float = 5.0) -> tuple[int, int, bytes] | None:
        """(frame type, channel, payload) of the next frame, or None on EOF."""
        deadline = time.monotonic() + timeout
        while len(self.buf) < 7 or len(self.buf) < 8 + struct.unpack_from(">I", self.buf, 3)[0]:
            if not self._fill(deadline):
                return None
        ftype, channel, size = struct.unpack_from(">BHI", self.buf)
        raw = bytes(self.buf[:size + 8])
        del self.buf[:size + 8]
        assert raw[-1:] == FRAME_END, raw
        return ftype, channel, raw[7:-1]

    def recv_frame(self, timeout: float = 5.0, skip_heartbeats: bool = True):
        """(channel, decoded frame) or None on EOF."""
        while True:
            got = self.recv_raw(timeout)
            if got is None:
                return None
            ftype, channel, payload = got
            if ftype == 8:
                if skip_heartbeats:
                    continue
                return channel, Heartbeat()
            _, ch, value = frame.unmarshal(raw_frame(ftype, channel, payload))
            return ch, value

    def expect(self, kind: type, timeout: float = 5.0):
        got = self.recv_frame(timeout)
        assert got is not None, f"connection closed while waiting for {kind.__name__}"
        assert isinstance(got[1], kind), got
        return got[1]

    # -- protocol
    def handshake(self, *, user: str = "guest", password: str = "guest", vhost: str = "/",
                  frame_max: int | None = None, heartbeat: int = 0,
                  channel_max: int | None = None) -> None:
        self.send(PROTOCOL_HEADER)
        self.start = self.expect(commands.Connection.Start)
        self.send_frame(commands.Connection.StartOk(
            client_properties={"product": "brokerha-raw-test",
                               "capabilities": {"authentication_failure_close": True}},
            mechanism="PLAIN", response=f"\0{user}\0{password}"))
        self.tune = self.expect(commands.Connection.Tune)
        self.send_frame(commands.Connection.TuneOk(
            channel_max=self.tune.channel_max if channel_max is None else channel_max,
            frame_max=self.tune.frame_max if frame_max is None else frame_max,
            heartbeat=heartbeat))
        self.send_frame(commands.Connection.Open(virtual_host=vhost))
        self.expect(commands.Connection.OpenOk)

    def open_channel(self, channel: int = 1) -> None:
        self.send_frame(commands.Channel.Open(), channel)
        got = self.recv_frame()
        assert got is not None and isinstance(got[1], commands.Channel.OpenOk), got

    def expect_connection_close(self, code: int, *fragments: str,
                                timeout: float = 5.0) -> commands.Connection.Close:
        """Read until connection.close; check it, answer close-ok, expect EOF."""
        while True:
            got = self.recv_frame(timeout)
            assert got is not None, f"socket closed without connection.close (wanted {code})"
            if isinstance(got[1], commands.Connection.Close):
                break
        close = got[1]
        got_close = (close.reply_code, close.reply_text, close.class_id, close.method_id)
        assert close.reply_code == code, got_close
        for fragment in fragments:
            assert fragment in close.reply_text, (fragment, got_close)
        with contextlib.suppress(OSError):
            self.send_frame(commands.Connection.CloseOk())
        return close
