"""pika SelectConnection (callback style): a full round trip and confirms with multiple acks."""

from __future__ import annotations

import pika
import pytest

pytestmark = pytest.mark.timeout(30)


class SelectScenario:
    """Runs callback-style steps on a SelectConnection's ioloop with a deadline."""

    def __init__(self, broker, timeout: float = 10.0) -> None:
        self.error: object = None
        self.done = False
        self.conn = pika.SelectConnection(
            broker.params(), on_open_callback=self._opened,
            on_open_error_callback=lambda c, e: self.fail(e),
            on_close_callback=lambda c, e: self._closed(e))
        self.conn.ioloop.call_later(timeout, lambda: self.fail("timed out"))
        self.channel = None

    def _opened(self, conn) -> None:
        conn.channel(on_open_callback=self._channel_opened)

    def _channel_opened(self, ch) -> None:
        self.channel = ch
        ch.add_on_close_callback(lambda c, e: None if self.done else self.fail(e))
        self.start(ch)

    def start(self, ch) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def fail(self, err: object) -> None:
        self.error = self.error or err
        self.finish()

    def finish(self) -> None:
        self.done = True
        if self.conn.is_open:
            self.conn.close()
        elif self.conn.is_closed:
            self.conn.ioloop.stop()

    def _closed(self, err) -> None:
        if not self.done:
            self.error = self.error or err
        self.conn.ioloop.stop()

    def run(self) -> None:
        self.conn.ioloop.start()
        assert self.error is None, self.error


def test_select_connection_round_trip(broker, names):
    q = names()
    bodies = [b"one", b"two", b"three"]

    class RoundTrip(SelectScenario):
        received: list = []

        def start(self, ch):
            ch.queue_declare(q, exclusive=True, callback=self.declared)

        def declared(self, frame):
            self.channel.basic_consume(q, self.on_message)
            for body in bodies:
                self.channel.basic_publish(
                    "", q, body, pika.BasicProperties(content_type="text/plain"))

        def on_message(self, ch, method, props, body):
            assert props.content_type == "text/plain"
            self.received.append(body)
            ch.basic_ack(method.delivery_tag)
            if len(self.received) == len(bodies):
                self.finish()

    s = RoundTrip(broker)
    s.run()
    assert s.received == bodies


def test_select_connection_confirms_cover_every_tag_in_order(broker, names):
    q = names()
    n = 200

    class Confirms(SelectScenario):
        acks: list = []

        def start(self, ch):
            ch.queue_declare(q, exclusive=True, callback=self.declared)

        def declared(self, frame):
            self.channel.confirm_delivery(self.on_confirm)
            for i in range(n):  # pipelined: the broker may ack them with multiple=true
                self.channel.basic_publish("", q, b"%d" % i)

        def on_confirm(self, frame):
            m = frame.method
            self.acks.append((m.NAME, m.delivery_tag, m.multiple))
            if m.delivery_tag == n:
                self.finish()

    s = Confirms(broker)
    s.run()
    assert {name for name, _, _ in s.acks} == {"Basic.Ack"}
    tags = [tag for _, tag, _ in s.acks]
    assert tags == sorted(tags) and len(set(tags)) == len(tags) and tags[-1] == n
    covered: set[int] = set()
    previous = 0
    for _, tag, multiple in s.acks:
        covered.update(range(previous + 1, tag + 1) if multiple else [tag])
        previous = tag
    assert covered == set(range(1, n + 1))
