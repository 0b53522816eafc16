"""The transport joins a big content body on a thread (``AMQPProtocol._offload``): the
client's later frames wait, unread, and are handled in order once it is published."""

from __future__ import annotations

import asyncio

from pamqp import commands, frame

from brokerha.node.transport import AMQPProtocol
from tests.amqp.test_close_ok import FakeTransport, served  # noqa: F401
from tests.amqp.test_join_body import big, publish_frames

Served = tuple[AMQPProtocol, FakeTransport, asyncio.AbstractEventLoop]


def test_a_big_body_is_joined_off_the_loop_and_what_follows_waits(served: Served) -> None:  # noqa: F811
    proto, transport, loop = served
    proto.data_received(frame.marshal(commands.Confirm.Select(), 1)
                        + frame.marshal(commands.Queue.Declare(queue="q"), 1))
    transport.written = b""
    assert proto.conn is not None
    queue = proto.conn.broker.vhosts["/"].queues["q"]
    proto.data_received(publish_frames(1, big(b"big")) + publish_frames(1, b"small"))
    assert not transport.reading and queue.message_count == 0  # joining on the thread
    for _ in range(200):
        if queue.message_count == 2:
            break
        loop.run_until_complete(asyncio.sleep(0.005))
    assert queue.message_count == 2 and transport.reading
    assert [len(e.message.body) for e in queue.ready] == [len(big(b"big")), 5]
    assert b"\x00\x3c\x00\x50" in transport.written  # basic.ack: confirmed, and written
