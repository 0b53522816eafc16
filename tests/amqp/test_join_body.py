"""A big content body joined off the loop (``ServerConnection.join_body``, issue 33): the
connection's later frames wait for it, in order, and nothing is lost or reordered."""

from __future__ import annotations

from collections.abc import Callable

from pamqp import body as pbody
from pamqp import commands, frame, header

from brokerha.amqp import constants as C
from brokerha.amqp.channel import JOIN_OFF_LOOP
from tests.amqp.wire import Wire

FRAME_MAX = 131072
Work = tuple[Callable[[], bytes], Callable[[Callable[[], bytes]], None]]


class Offload:
    """The transport's thread, run when the test says (``run``)."""

    def __init__(self) -> None:
        self.pending: list[Work] = []

    def __call__(self, work: Callable[[], bytes],
                 done: Callable[[Callable[[], bytes]], None]) -> None:
        self.pending.append((work, done))

    def run(self) -> None:
        work, done = self.pending.pop(0)
        try:
            result = work()
        except Exception as exc:
            error = exc

            def raise_it() -> bytes:
                raise error
            done(raise_it)
        else:
            done(lambda: result)


def publish_frames(channel: int, body: bytes, routing_key: str = "q") -> bytes:
    """basic.publish, its header and its body in frames of FRAME_MAX, as one read."""
    step = FRAME_MAX - 8
    return b"".join([
        frame.marshal(commands.Basic.Publish(exchange="", routing_key=routing_key), channel),
        frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), channel),
        *(frame.marshal(pbody.ContentBody(body[i:i + step]), channel)
          for i in range(0, len(body), step))])


def big(tag: bytes) -> bytes:
    return tag.ljust(16, b".") * (JOIN_OFF_LOOP // 16)


def wired(offload: Offload | None, channels: tuple[int, ...] = (1, 2)) -> Wire:
    w = Wire()
    w.handshake(frame_max=FRAME_MAX)
    for channel in channels:
        w.open_channel(channel)
        w.method(channel, commands.Confirm.Select())
        w.expect(commands.Confirm.SelectOk)
    w.method(1, commands.Queue.Declare(queue="q"))
    w.expect(commands.Queue.DeclareOk)
    w.conn.offload = offload
    return w


def bodies(w: Wire, queue: str = "q") -> list[bytes]:
    """Every message of ``queue``, taken with basic.get (no ack), their bodies' first 16 bytes."""
    out: list[bytes] = []
    while True:
        w.method(1, commands.Basic.Get(queue=queue, no_ack=True))
        frames = w.frames()
        if any(isinstance(v, commands.Basic.GetEmpty) for _, v in frames):
            return out
        out.append(b"".join(v.value for _, v in frames if isinstance(v, pbody.ContentBody))[:16])


def queued(w: Wire) -> int:
    return w.broker.vhosts["/"].queues["q"].message_count


def acks(w: Wire) -> dict[int, int]:
    """The highest delivery tag confirmed on each channel (confirms are coalesced)."""
    out: dict[int, int] = {}
    for ch, v in w.frames():
        if isinstance(v, commands.Basic.Ack):
            assert v.multiple or v.delivery_tag == out.get(ch, 0) + 1
            out[ch] = v.delivery_tag
    return out


def test_later_frames_of_every_channel_wait_for_the_joined_body() -> None:
    offload = Offload()
    w = wired(offload)
    w.raw(publish_frames(1, big(b"big"))
          + publish_frames(2, b"two".ljust(16, b"."))
          + publish_frames(1, b"one".ljust(16, b".")))
    assert len(offload.pending) == 1 and w.conn.reading_paused
    assert queued(w) == 0 and acks(w) == {}
    w.raw(publish_frames(2, b"late".ljust(16, b".")))  # read before the pause took effect
    assert queued(w) == 0
    offload.run()
    assert not w.conn.reading_paused
    assert acks(w) == {1: 2, 2: 2}
    assert bodies(w) == [b"big".ljust(16, b"."), b"two".ljust(16, b"."),
                         b"one".ljust(16, b"."), b"late".ljust(16, b".")]


def test_a_held_body_after_a_joined_one_is_joined_in_turn() -> None:
    offload = Offload()
    w = wired(offload)
    w.raw(publish_frames(1, big(b"first")) + publish_frames(2, big(b"second")))
    offload.run()
    assert len(offload.pending) == 1 and w.conn.reading_paused  # the second's join
    offload.run()
    assert acks(w) == {1: 1, 2: 1} and not w.conn.reading_paused
    assert bodies(w) == [b"first".ljust(16, b"."), b"second".ljust(16, b".")]


def test_without_a_thread_the_body_is_joined_at_once() -> None:
    w = wired(None)
    w.raw(publish_frames(1, big(b"big")) + publish_frames(2, b"two".ljust(16, b".")))
    assert acks(w) == {1: 1, 2: 1}
    assert bodies(w) == [b"big".ljust(16, b"."), b"two".ljust(16, b".")]


def test_a_connection_lost_meanwhile_publishes_nothing() -> None:
    offload = Offload()
    w = wired(offload)
    w.raw(publish_frames(1, big(b"big")))
    w.conn.connection_lost()
    offload.run()
    assert queued(w) == 0


def test_a_broken_frame_after_the_body_closes_the_connection_after_its_publish() -> None:
    offload = Offload()
    w = wired(offload)
    w.raw(publish_frames(1, big(b"big")) + b"\x01\x00\x01\x00\x00\x00\x00\xff")  # bad end
    assert not w.conn.wants_close and w.conn.state == "running"
    offload.run()
    assert queued(w) == 1
    close = w.expect(commands.Connection.Close)
    assert close.reply_code == C.FRAME_ERROR


def test_a_failed_join_closes_the_connection() -> None:
    offload = Offload()
    w = wired(offload)
    w.raw(publish_frames(1, big(b"big")))
    work, done = offload.pending.pop()

    def no_memory() -> bytes:
        raise MemoryError
    offload.pending.append((no_memory, done))
    offload.run()
    assert w.expect(commands.Connection.Close).reply_code == C.INTERNAL_ERROR
    assert queued(w) == 0
