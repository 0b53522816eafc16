"""A light AMQP 0-9-1 load generator: pre-encoded frames written to raw asyncio sockets.

Real Python clients (pika, aio-pika) cost more CPU per message than a fast
broker does, so a benchmark driven only by them measures the client. This
generator encodes every publish once with pamqp (method + content header +
body frames), then writes the same bytes again and again; replies are split
into frames by hand (type, channel, size, 0xCE end byte) and only the hot ones
(basic.deliver, content header/body, basic.ack/nack) are parsed with
``struct``; everything else goes through pamqp.

Workloads (1 KiB bodies, one publisher and one consumer connection):

- ``pipe``: non-persistent publishes, auto-ack consumer; msgs/s delivered.
- ``confirm``: confirm.select, persistent publishes to a durable queue, at most
  ``confirm_window`` unconfirmed; consumer with manual acks (prefetch,
  ``basic.ack(multiple)`` once per read); msgs/s delivered.
- ``tx``: tx.select, ``tx_size`` persistent publishes + tx.commit written
  together, wait for commit-ok, repeat; commits/s and msgs/s committed.

In every workload the publisher stays at most ``pipe_window`` messages ahead
of the consumer, so the queue stays short and the figure is a steady state,
not the speed of filling a queue.

Usage::

    python benchmarks/loadgen.py amqp://guest:guest@127.0.0.1:5672/%2F --workload pipe
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import ssl
import statistics
import struct
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypeVar
from urllib.parse import parse_qs, unquote, urlparse

from pamqp import commands, frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader, ProtocolHeader

FRAME_END = 0xCE
FRAME_HEADER = struct.Struct(">BHI")  # type, channel, size
CLASS_METHOD = struct.Struct(">I")  # class id << 16 | method id
U64 = struct.Struct(">Q")
TAG_AND_BITS = struct.Struct(">QB")
ACK_FRAME = struct.Struct(">BHIHHQBB")  # a complete basic.ack frame, end byte included

DELIVER = 60 << 16 | 60
SERVER_ACK = 60 << 16 | 80
SERVER_NACK = 60 << 16 | 120
RETURN = 60 << 16 | 50

CHANNEL = 1  # each connection of the generator uses one channel
CLIENT_PROPERTIES: dict[str, object] = {
    "product": "brokerha-loadgen",
    "capabilities": {"publisher_confirms": True, "consumer_cancel_notify": True,
                     "authentication_failure_close": True},  # a 403 rather than a bare close
}

M = TypeVar("M")


class AMQPError(Exception):
    """The broker closed a channel or the connection (or the socket went away)."""

    def __init__(self, text: str, reply_code: int = 0) -> None:
        super().__init__(f"{reply_code} {text}" if reply_code else text)
        self.reply_code = reply_code


# -- pre-encoded frames -------------------------------------------------------------


def encode_method(channel: int, method: commands.Frame) -> bytes:
    return frame.marshal(method, channel)


def encode_publish(
    channel: int, routing_key: str, body: bytes, *, persistent: bool, frame_max: int,
    exchange: str = "",
) -> bytes:
    """basic.publish + content header + body frame(s), split at frame_max - 8."""
    props = commands.Basic.Properties(delivery_mode=2 if persistent else None)
    parts = [
        frame.marshal(commands.Basic.Publish(exchange=exchange, routing_key=routing_key), channel),
        frame.marshal(ContentHeader(0, len(body), props), channel),
    ]
    chunk = frame_max - 8
    parts += [
        frame.marshal(ContentBody(body[i:i + chunk]), channel) for i in range(0, len(body), chunk)
    ]
    return b"".join(parts)


def encode_ack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """A basic.ack frame by struct; byte-identical to pamqp's (checked by ``selftest``)."""
    return ACK_FRAME.pack(1, channel, 13, 60, 80, delivery_tag, int(multiple), FRAME_END)


def selftest() -> None:
    """The hand-made frames equal pamqp's."""
    for tag, multiple in ((1, False), (2**40 + 3, True)):
        expected = frame.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=multiple), 7)
        assert encode_ack(7, tag, multiple) == expected, (tag, multiple)
    deliver = frame.marshal(
        commands.Basic.Deliver(consumer_tag="ctag", delivery_tag=99, exchange="", routing_key="q"),
        3,
    )
    assert _deliver_tag(deliver, 7) == 99


def _deliver_tag(buf: bytes | bytearray, payload_start: int) -> int:
    """The delivery tag of a basic.deliver payload (after class, method, consumer tag)."""
    tag_len = buf[payload_start + 4]
    return int(U64.unpack_from(buf, payload_start + 5 + tag_len)[0])


# -- the connection -----------------------------------------------------------------


class ConfirmTracker:
    """Counts publisher confirms (ack or nack) for sequential delivery tags 1, 2, ..."""

    def __init__(self) -> None:
        self.upto = 0  # every tag <= upto is confirmed
        self.sparse: set[int] = set()  # single confirms above upto
        self.nacked = 0

    @property
    def confirmed(self) -> int:
        return self.upto + len(self.sparse)

    def confirm(self, tag: int, multiple: bool, nack: bool) -> None:
        if nack:
            self.nacked += (tag - self.upto) if multiple else 1
        if multiple:
            if tag > self.upto:
                self.upto = tag
                if self.sparse:
                    self.sparse = {t for t in self.sparse if t > tag}
        elif tag == self.upto + 1:
            self.upto = tag
        elif tag > self.upto:
            self.sparse.add(tag)
        while self.sparse and self.upto + 1 in self.sparse:
            self.sparse.remove(self.upto + 1)
            self.upto += 1


class LoadConnection(asyncio.Protocol):
    """One AMQP connection: hot frames parsed by hand, the rest by pamqp.

    Counters are plain attributes so the hot path calls no callbacks per
    message; ``after_read`` runs once per chunk of bytes read (used to send
    one ``basic.ack(multiple)`` for everything delivered in that chunk).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._rpc: dict[int, asyncio.Queue[object]] = {0: asyncio.Queue(), CHANNEL: asyncio.Queue()}
        # the content being received (one channel per connection, so one at a time):
        self._remaining = -1  # body bytes still expected; -1 when no content is open
        self._counts = False  # a basic.deliver (counted) rather than a basic.return
        self._tag = 0
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.frame_max = 131072
        self.delivered = 0
        self.last_delivery_tag = 0
        self.returned = 0
        self.confirms = ConfirmTracker()
        self.blocked_notices = 0
        self.after_read: Callable[[], None] | None = None
        self._header_checked = False

    # asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(AMQPError(f"connection lost: {exc!r}" if exc else "connection closed"))
        if not self.closed.done():
            self.closed.set_result(None)
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if not self._header_checked and len(buf) >= 4:
            self._header_checked = True
            if buf[:4] == b"AMQP":  # the server's answer to a protocol header it refuses
                self._fail(AMQPError(f"server refused the protocol header: {bytes(buf[:8])!r}"))
                return
        # The hot loop: deliveries, content and confirms are parsed inline.
        pos, n = 0, len(buf)
        remaining, delivered = self._remaining, self.delivered
        while n - pos >= 8:
            ftype, channel, size = FRAME_HEADER.unpack_from(buf, pos)
            start, end = pos + 7, pos + 7 + size
            if end >= n:
                break
            pos = end + 1
            if buf[end] != FRAME_END:
                return self._fail(AMQPError(f"bad frame end byte {buf[end]:#x}"))
            if ftype == 3 or ftype == 2:  # content body / header
                if remaining < 0:
                    return self._fail(AMQPError(f"content frame without a method on {channel}"))
                remaining = U64.unpack_from(buf, start + 4)[0] if ftype == 2 else remaining - size
                if remaining <= 0 and (ftype == 3 or remaining == 0):
                    remaining = -1
                    if self._counts:
                        delivered += 1
                        self.last_delivery_tag = self._tag
                continue
            if ftype != 1:
                continue  # heartbeat
            class_method = CLASS_METHOD.unpack_from(buf, start)[0]
            if class_method == DELIVER:
                self._tag = _deliver_tag(buf, start)
                self._counts, remaining = True, 0
            elif class_method == SERVER_ACK or class_method == SERVER_NACK:
                tag, bits = TAG_AND_BITS.unpack_from(buf, start + 4)
                self.confirms.confirm(tag, bool(bits & 1), class_method == SERVER_NACK)
            elif class_method == RETURN:
                self._counts, remaining = False, 0
                self.returned += 1
            else:
                _, _, method = frame.unmarshal(bytes(buf[start - 7:end + 1]))
                self._control(channel, method)
        self._remaining, self.delivered = remaining, delivered
        if pos:
            del buf[:pos]
        if self.after_read is not None:
            self.after_read()

    def _control(self, channel: int, method: object) -> None:
        """A method frame that is not on the hot path: replies to our RPCs and closes."""
        if isinstance(method, commands.Connection.Close):
            self.write(encode_method(0, commands.Connection.CloseOk()))
            self._fail(AMQPError(f"connection closed: {method.reply_text}", method.reply_code))
        elif isinstance(method, commands.Channel.Close):
            self.write(encode_method(channel, commands.Channel.CloseOk()))
            self._rpc_queue(channel).put_nowait(
                AMQPError(f"channel closed: {method.reply_text}", method.reply_code))
        elif isinstance(method, commands.Connection.Blocked | commands.Connection.Unblocked):
            self.blocked_notices += isinstance(method, commands.Connection.Blocked)
        elif isinstance(method, commands.Basic.Cancel):
            self._fail(AMQPError(f"consumer {method.consumer_tag} cancelled by the broker"))
        else:
            self._rpc_queue(channel).put_nowait(method)

    def _rpc_queue(self, channel: int) -> asyncio.Queue[object]:
        return self._rpc.setdefault(channel, asyncio.Queue())

    def _fail(self, error: AMQPError) -> None:
        if self.error is None:
            self.error = error
        for queue in self._rpc.values():
            queue.put_nowait(error)
        if self.transport is not None:
            self.transport.close()

    # writing ----------------------------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark."""
        while self._paused and self.error is None:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained
        if self.error is not None:
            raise self.error

    # RPC --------------------------------------------------------------------------

    async def expect(self, channel: int, reply_type: type[M]) -> M:
        reply = await self._rpc_queue(channel).get()
        if isinstance(reply, BaseException):
            raise reply
        if not isinstance(reply, reply_type):
            raise AMQPError(f"expected {reply_type.__name__}, got {reply!r}")
        return reply

    async def rpc(self, channel: int, method: commands.Frame, reply_type: type[M]) -> M:
        self.write(encode_method(channel, method))
        return await self.expect(channel, reply_type)

    async def close(self, timeout: float = 5.0) -> None:
        """connection.close, wait for close-ok (bounded), then close the socket."""
        try:
            if self.error is None:
                self.write(encode_method(0, commands.Connection.Close(
                    reply_code=200, reply_text="bye", class_id=0, method_id=0)))
                await asyncio.wait_for(self.expect(0, commands.Connection.CloseOk), timeout)
        except (AMQPError, TimeoutError):
            pass
        finally:
            if self.transport is not None:
                self.transport.close()


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    user: str
    password: str
    vhost: str
    # amqps: the CA file and the name the server certificate is checked against
    tls_ca: str | None = None
    tls_hostname: str | None = None

    @classmethod
    def parse(cls, url: str) -> BrokerAddress:
        """An amqp:// or amqps:// URL; for amqps pika's ``ssl_options`` query parameter
        (``{'ca_certs': FILE, 'server_hostname': NAME}``), so one URL serves both clients."""
        u = urlparse(url)
        vhost = unquote(u.path[1:]) if len(u.path) > 1 else "/"
        tls_ca = tls_hostname = None
        if u.scheme == "amqps":
            opts = ast.literal_eval(parse_qs(u.query).get("ssl_options", ["{}"])[0]) or {}
            tls_ca = opts.get("ca_certs")
            tls_hostname = opts.get("server_hostname") or u.hostname
        return cls(u.hostname or "127.0.0.1", u.port or (5671 if tls_hostname else 5672),
                   unquote(u.username or "guest"), unquote(u.password or "guest"), vhost,
                   tls_ca, tls_hostname)

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.tls_hostname is None:
            return None
        return ssl.create_default_context(cafile=self.tls_ca)


async def connect(address: BrokerAddress, frame_max: int = 131072) -> LoadConnection:
    """Open a connection (PLAIN, no heartbeats; TLS for amqps) and channel 1 on it."""
    loop = asyncio.get_running_loop()
    ctx = address.ssl_context()
    _, conn = await loop.create_connection(
        LoadConnection, address.host, address.port, ssl=ctx,
        server_hostname=address.tls_hostname if ctx is not None else None)
    try:
        conn.write(frame.marshal(ProtocolHeader(), 0))
        start = await conn.expect(0, commands.Connection.Start)
        if "PLAIN" not in str(start.mechanisms).split():
            raise AMQPError(f"PLAIN not offered: {start.mechanisms!r}")
        conn.write(encode_method(0, commands.Connection.StartOk(
            client_properties=CLIENT_PROPERTIES,  # type: ignore[arg-type]
            mechanism="PLAIN", response=f"\0{address.user}\0{address.password}")))
        tune = await conn.expect(0, commands.Connection.Tune)
        conn.frame_max = min(frame_max, tune.frame_max) if tune.frame_max else frame_max
        conn.write(encode_method(0, commands.Connection.TuneOk(
            channel_max=tune.channel_max or 2047, frame_max=conn.frame_max, heartbeat=0)))
        await conn.rpc(0, commands.Connection.Open(virtual_host=address.vhost),
                       commands.Connection.OpenOk)
        await conn.rpc(CHANNEL, commands.Channel.Open(), commands.Channel.OpenOk)
    except BaseException:
        if conn.transport is not None:
            conn.transport.close()
        raise
    return conn


STALL_LIMIT = 30.0  # seconds a publisher waits for its broker to answer at all


class ConfirmWait:
    """Waits on a publishing connection until its broker confirmed enough -- bounded.

    It takes the connection's ``after_read``. Each read may bring confirms; when
    nothing is read for ``stall_limit`` seconds it raises a ``TimeoutError`` saying
    how many publishes were confirmed of how many awaited. A connection that failed
    raises its error: looked at each second, as a closed connection reads nothing more.
    """

    def __init__(self, conn: LoadConnection, stall_limit: float = STALL_LIMIT) -> None:
        self.conn, self.stall_limit = conn, stall_limit
        self._read = asyncio.Event()
        conn.after_read = self._read.set

    async def until(self, confirmed: int) -> None:
        """Return once ``confirmed`` publishes were confirmed (acked or nacked)."""
        conn, loop = self.conn, asyncio.get_running_loop()
        last_read = loop.time()
        while conn.confirms.confirmed < confirmed:
            self._read.clear()
            if conn.error is not None:
                raise conn.error
            silent = loop.time() - last_read
            if silent >= self.stall_limit:
                raise TimeoutError(f"nothing read for {silent:.1f} s: {conn.confirms.confirmed} "
                                   f"of {confirmed} publishes confirmed")
            try:
                await asyncio.wait_for(self._read.wait(), min(1.0, self.stall_limit - silent))
            except TimeoutError:
                continue
            last_read = loop.time()


# -- workloads ----------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What distinguishes the three benchmark workloads; the run loop is shared."""

    name: str
    persistent: bool
    auto_ack: bool
    confirm: bool = False
    tx_size: int = 0  # 0: no transactions
    durable_queue: bool = True
    # queue.declare arguments as (key, value) pairs, e.g. (("x-queue-type", "quorum"),)
    # for a RabbitMQ quorum queue (ha_cluster.py); empty: no arguments
    queue_arguments: tuple[tuple[str, str | int], ...] = ()
    # False: the queue exists already and is not the client's to declare or delete
    # (scale_out.py's partitioned layouts declare it on its partition's leader, where
    # a node running partition groups takes declarations)
    declare: bool = True


WORKLOADS: dict[str, Workload] = {
    "pipe": Workload("pipe", persistent=False, auto_ack=True),
    "confirm": Workload("confirm", persistent=True, auto_ack=False, confirm=True),
    "tx": Workload("tx", persistent=True, auto_ack=False, tx_size=10),
}


@dataclass(frozen=True)
class Settings:
    body_size: int = 1024
    pipe_window: int = 2000  # messages the publisher may be ahead of the consumer
    confirm_window: int = 256  # unconfirmed publishes
    prefetch: int = 256  # consumer prefetch for manual-ack workloads
    batch: int = 64  # publishes written at once (non-tx)


@dataclass
class Counts:
    t: float
    cpu: float
    published: int
    delivered: int
    confirmed: int
    commits: int
    latencies: int = 0


@dataclass
class Result:
    workload: str
    client: str
    duration: float
    published: int
    delivered: int
    confirmed: int
    commits: int
    nacked: int = 0
    returned: int = 0
    blocked_notices: int = 0
    client_cpu_s: float = 0.0
    total_delivered: int = 0  # over the whole run, warm-up and tail included (for profiles)
    # publish -> confirm (confirm workload, sampled per written batch) or tx.commit ->
    # commit-ok (tx), in ms, within the measured window; to_dict gives p50/p99 instead
    latency_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def msgs_per_s(self) -> float:
        """The headline: messages delivered to the consumer (committed, for tx) per second."""
        count = self.commits * WORKLOADS[self.workload].tx_size if self.commits else self.delivered
        return count / self.duration if self.duration else 0.0

    @property
    def commits_per_s(self) -> float:
        return self.commits / self.duration if self.duration else 0.0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("latency_ms")
        p50, p99 = percentiles_ms(self.latency_ms)
        return {**d, "msgs_per_s": self.msgs_per_s, "commits_per_s": self.commits_per_s,
                "latency_p50_ms": p50, "latency_p99_ms": p99}


def percentiles_ms(samples: Sequence[float]) -> tuple[float | None, float | None]:
    """(p50, p99) of latency samples, None without enough of them."""
    if len(samples) < 2:
        return None, None
    q = statistics.quantiles(samples, n=100)
    return q[49], q[98]


class LoadRun:
    """One workload against one broker: a publisher and a consumer connection."""

    def __init__(self, address: BrokerAddress, workload: Workload, settings: Settings,
                 queue: str | None = None) -> None:
        self.address = address
        self.workload = workload
        self.settings = settings
        self.queue = queue or f"loadgen-{workload.name}-{uuid.uuid4().hex[:12]}"
        self.published = 0
        self.commits = 0
        self.stopping = False
        self._progress = asyncio.Event()
        self.pub: LoadConnection | None = None
        self.cons: LoadConnection | None = None
        self._acked_tag = 0  # the consumer has acked every delivery tag up to this one
        self._sent: deque[tuple[int, float]] = deque()  # (last tag of a written batch, when)
        self.latencies: list[float] = []  # ms: per confirmed batch, or per commit

    async def setup(self) -> None:
        w, s = self.workload, self.settings
        self.pub = pub = await connect(self.address)
        self.cons = cons = await connect(self.address)
        if w.declare:
            await pub.rpc(CHANNEL, commands.Queue.Declare(
                queue=self.queue, durable=w.durable_queue,
                arguments=dict(w.queue_arguments) if w.queue_arguments else None),
                commands.Queue.DeclareOk)
        if not w.auto_ack:
            await cons.rpc(CHANNEL, commands.Basic.Qos(prefetch_count=s.prefetch),
                           commands.Basic.QosOk)
        cons.after_read = self._after_consumer_read
        pub.after_read = self._after_publisher_read
        await cons.rpc(CHANNEL, commands.Basic.Consume(
            queue=self.queue, consumer_tag="loadgen", no_ack=w.auto_ack), commands.Basic.ConsumeOk)
        if w.confirm:
            await pub.rpc(CHANNEL, commands.Confirm.Select(), commands.Confirm.SelectOk)
        if w.tx_size:
            await pub.rpc(CHANNEL, commands.Tx.Select(), commands.Tx.SelectOk)

    def _after_consumer_read(self) -> None:
        cons = self.cons
        assert cons is not None
        if not self.workload.auto_ack and cons.last_delivery_tag > self._acked_tag:
            self._acked_tag = cons.last_delivery_tag
            cons.write(encode_ack(CHANNEL, self._acked_tag, multiple=True))
        self._progress.set()

    def _after_publisher_read(self) -> None:
        assert self.pub is not None
        sent, upto = self._sent, self.pub.confirms.upto
        if sent and sent[0][0] <= upto:
            now = time.perf_counter()
            while sent and sent[0][0] <= upto:
                self.latencies.append(1e3 * (now - sent.popleft()[1]))
        self._progress.set()

    def _allowance(self) -> int:
        """How many more messages the publisher may send now."""
        assert self.pub is not None and self.cons is not None
        allowed = self.settings.pipe_window - (self.published - self.cons.delivered)
        if self.workload.confirm:
            unconfirmed = self.published - self.pub.confirms.confirmed
            allowed = min(allowed, self.settings.confirm_window - unconfirmed)
        return allowed

    async def publish_loop(self) -> None:
        pub, w, s = self.pub, self.workload, self.settings
        assert pub is not None
        one = encode_publish(CHANNEL, self.queue, b"x" * s.body_size,
                             persistent=w.persistent, frame_max=pub.frame_max)
        if w.tx_size:
            batch_size = w.tx_size
            batch = memoryview(one * w.tx_size + encode_method(CHANNEL, commands.Tx.Commit()))
        else:
            batch_size = s.batch
            batch = memoryview(one * s.batch)
        while not self.stopping:
            allowed = self._allowance()
            if allowed < (batch_size if w.tx_size else 1):
                self._progress.clear()
                await self._progress.wait()
                continue
            n = batch_size if w.tx_size else min(allowed, batch_size)
            sent = time.perf_counter()
            pub.write(batch if n == batch_size else batch[:n * len(one)])
            self.published += n
            if w.confirm:
                self._sent.append((self.published, sent))
            if w.tx_size:
                await pub.expect(CHANNEL, commands.Tx.CommitOk)
                self.commits += 1
                self.latencies.append(1e3 * (time.perf_counter() - sent))
            await pub.drain()

    def counts(self) -> Counts:
        assert self.pub is not None and self.cons is not None
        return Counts(time.perf_counter(), time.process_time(), self.published,
                      self.cons.delivered, self.pub.confirms.confirmed, self.commits,
                      len(self.latencies))

    async def teardown(self) -> None:
        """Cancel the consumer, delete the queue, close both connections (bounded)."""
        self.stopping = True
        self._progress.set()
        try:
            if self.cons is not None and self.cons.error is None:
                await asyncio.wait_for(self._delete_queue(self.cons), 10)
        except (AMQPError, TimeoutError):
            pass
        finally:
            for conn in (self.pub, self.cons):
                if conn is not None:
                    await conn.close()

    async def _delete_queue(self, conn: LoadConnection) -> None:
        await conn.rpc(CHANNEL, commands.Basic.Cancel(consumer_tag="loadgen"),
                       commands.Basic.CancelOk)
        if self.workload.declare:
            await conn.rpc(CHANNEL, commands.Queue.Delete(queue=self.queue),
                           commands.Queue.DeleteOk)


async def run_workload(
    url: str,
    workload: str | Workload,
    duration: float = 5.0,
    warmup: float = 1.0,
    settings: Settings | None = None,
    on_window: Callable[[str], None] | None = None,
) -> Result:
    """Run one workload; measure for ``duration`` seconds after ``warmup``.

    ``on_window("start")`` and ``on_window("end")`` are called at the edges of
    the measured window (the benchmark samples the broker's CPU there).
    """
    return (await run_workloads([(url, None)], workload, duration, warmup, settings,
                                on_window))[0]


async def run_workloads(
    targets: Sequence[tuple[str, str | None]],
    workload: str | Workload,
    duration: float = 5.0,
    warmup: float = 1.0,
    settings: Settings | None = None,
    on_window: Callable[[str], None] | None = None,
) -> list[Result]:
    """One workload on several queues at once, all measured over the same window.

    ``targets`` are (url, queue name or None for a fresh one) pairs: one
    publisher and one consumer connection each, all in this event loop.
    """
    w = WORKLOADS[workload] if isinstance(workload, str) else workload
    runs = [LoadRun(BrokerAddress.parse(url), w, settings or Settings(), queue)
            for url, queue in targets]
    publishers: list[asyncio.Task[None]] = []
    try:
        for outcome in await asyncio.gather(*(r.setup() for r in runs), return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome
        publishers = [asyncio.create_task(r.publish_loop()) for r in runs]
        await _sleep_or_fail_all(runs, publishers, warmup)
        if on_window:
            on_window("start")
        first = [r.counts() for r in runs]
        await _sleep_or_fail_all(runs, publishers, duration)
        last = [r.counts() for r in runs]
        if on_window:
            on_window("end")
    finally:
        for run in runs:
            run.stopping = True
        for publisher in publishers:
            publisher.cancel()
        await asyncio.gather(*publishers, return_exceptions=True)
        await asyncio.gather(*(r.teardown() for r in runs), return_exceptions=True)
    results = []
    for run, a, b in zip(runs, first, last, strict=True):
        assert run.pub is not None and run.cons is not None
        results.append(Result(
            workload=w.name, client="loadgen", duration=b.t - a.t,
            published=b.published - a.published,
            delivered=b.delivered - a.delivered,
            confirmed=b.confirmed - a.confirmed,
            commits=b.commits - a.commits,
            nacked=run.pub.confirms.nacked, returned=run.cons.returned + run.pub.returned,
            blocked_notices=run.pub.blocked_notices + run.cons.blocked_notices,
            client_cpu_s=b.cpu - a.cpu,
            total_delivered=run.cons.delivered,
            latency_ms=run.latencies[a.latencies:b.latencies],
        ))
    return results


async def _sleep_or_fail(run: LoadRun, publisher: asyncio.Task[None], seconds: float) -> None:
    """Sleep, but raise at once if the publisher or a connection failed."""
    await _sleep_or_fail_all([run], [publisher], seconds)


async def _sleep_or_fail_all(runs: Sequence[LoadRun], publishers: Sequence[asyncio.Task[None]],
                             seconds: float) -> None:
    """Sleep, but raise at once if a publisher or a connection failed."""
    done, _ = await asyncio.wait(publishers, timeout=seconds,
                                 return_when=asyncio.FIRST_COMPLETED)
    for publisher in done:
        publisher.result()  # raises its error
        raise AMQPError("publisher stopped early")
    for run in runs:
        for conn in (run.pub, run.cons):
            if conn is not None and conn.error is not None:
                raise conn.error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="pipe")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    selftest()
    result = asyncio.run(run_workload(args.url, args.workload, args.duration, args.warmup))
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        cpu = 1e6 * result.client_cpu_s / max(1, result.delivered or result.published)
        print(f"{result.workload}: {result.msgs_per_s:,.0f} msgs/s"
              + (f", {result.commits_per_s:,.0f} commits/s" if result.commits else "")
              + f" (published {result.published}, delivered {result.delivered}, "
              f"confirmed {result.confirmed}; loadgen CPU {cpu:.1f} µs/msg)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
