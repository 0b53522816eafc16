"""Any valid UTF-8 name (up to 255 bytes) and field table round-trips, as RabbitMQ's do.

Hypothesis draws exchange, queue, routing-key and consumer-tag names and
argument/header tables; each goes through declare, bind, publish, get and
consume on an in-process connection, and every reply must carry it back
unchanged. pamqp's client-side classes hold names to an ASCII pattern, so the
test builds its methods with a placeholder name and sets the real one before
encoding (``brokerha.amqp.frames.marshal_method`` skips the pattern).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.amqp import frames as F
from tests.amqp.wire import Wire


def fits(text: str) -> bool:
    return 0 < len(text.encode()) <= 255 and not text.startswith("amq.")


NAMES = st.text(min_size=1, max_size=80).filter(fits)
TABLES = st.dictionaries(st.text(min_size=1, max_size=20).filter(lambda k: len(k.encode()) < 128),
                         st.one_of(st.integers(-2**31, 2**31 - 1), st.text(max_size=30),
                                   st.booleans()), max_size=4)


def send(w: Wire, channel: int, method: Any, **names: str) -> None:
    """``method`` with ``names`` set after pamqp built it with placeholders."""
    for field, value in names.items():
        setattr(method, field, value)
    w.raw(F.encode_frame(C.FRAME_METHOD, channel, F.marshal_method(method)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exchange=NAMES, queue=NAMES, key=NAMES, tag=NAMES, arguments=TABLES, headers=TABLES)
def test_utf8_names_and_tables_round_trip(exchange: str, queue: str, key: str, tag: str,
                                          arguments: dict[str, Any],
                                          headers: dict[str, Any]) -> None:
    w = Wire().connected()
    send(w, 1, commands.Exchange.Declare(exchange="x", exchange_type="direct"), exchange=exchange)
    w.expect(commands.Exchange.DeclareOk)
    send(w, 1, commands.Queue.Declare(queue="q", arguments={}), queue=queue)
    declared = w.expect(commands.Queue.DeclareOk)
    assert declared.queue == queue
    send(w, 1, commands.Queue.Bind(queue="q", exchange="x", routing_key="k",
                                   arguments=arguments), queue=queue, exchange=exchange,
         routing_key=key)
    w.expect(commands.Queue.BindOk)

    props = commands.Basic.Properties(headers=headers, delivery_mode=2)
    send(w, 1, commands.Basic.Publish(exchange="x", routing_key="k"), exchange=exchange,
         routing_key=key)
    w.content(1, b"one", props)
    send(w, 1, commands.Basic.Get(queue="q", no_ack=True), queue=queue)
    frames = w.frames()
    got = [v for _, v in frames if isinstance(v, commands.Basic.GetOk)]
    assert got and (got[0].exchange, got[0].routing_key) == (exchange, key)
    header = next(v for _, v in frames if hasattr(v, "properties"))
    assert (header.properties.headers or {}) == headers

    send(w, 1, commands.Basic.Consume(queue="q", consumer_tag="t"), queue=queue,
         consumer_tag=tag)
    assert w.expect(commands.Basic.ConsumeOk).consumer_tag == tag
    send(w, 1, commands.Basic.Publish(exchange="x", routing_key="k"), exchange=exchange,
         routing_key=key)
    w.content(1, b"two", props)
    deliver = w.expect(commands.Basic.Deliver)
    assert (deliver.consumer_tag, deliver.exchange, deliver.routing_key) == (tag, exchange, key)

    send(w, 1, commands.Queue.Unbind(queue="q", exchange="x", routing_key="k",
                                     arguments=arguments), queue=queue, exchange=exchange,
         routing_key=key)
    w.expect(commands.Queue.UnbindOk)
    assert not any(isinstance(m, commands.Connection.Close | commands.Channel.Close)
                   for m in w.methods())
