"""The broker's method encoder is pamqp's, byte for byte, without pamqp's name patterns."""

from __future__ import annotations

import inspect
import struct

import pytest
from pamqp import commands

from brokerha.amqp.frames import marshal_method, unchecked


def _encodes_by_default(cls: type) -> bool:
    try:
        cls().marshal()
    except (TypeError, ValueError):  # a field without a default (None): pamqp fails too
        return False
    return True


CLASSES = [cls for outer in (commands.Connection, commands.Channel, commands.Exchange,
                             commands.Queue, commands.Basic, commands.Tx, commands.Confirm)
           for cls in vars(outer).values()
           if inspect.isclass(cls) and hasattr(cls, "index") and cls is not commands.Basic.Properties
           and _encodes_by_default(cls)]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_marshal_method_matches_pamqp(cls: type) -> None:
    method = cls()
    assert marshal_method(method) == struct.pack(">I", method.index) + method.marshal()


def test_bits_across_a_byte_and_tables_match_pamqp() -> None:
    for method in (commands.Basic.GetOk(delivery_tag=9, redelivered=True, exchange="x",
                                        routing_key="k", message_count=2),
                   commands.Basic.Deliver(consumer_tag="c", delivery_tag=1, redelivered=False,
                                          exchange="x", routing_key="k"),
                   commands.Connection.Close(reply_code=320, reply_text="t", class_id=0,
                                             method_id=0),
                   commands.Queue.Declare(queue="q", passive=True, durable=True,
                                          auto_delete=True, nowait=True, arguments={"a": 1}),
                   commands.Basic.Nack(delivery_tag=5, multiple=True, requeue=False),
                   commands.Basic.Consume(queue="q", consumer_tag="t", no_local=True,
                                          no_ack=True, exclusive=True, nowait=True)):
        assert marshal_method(method) == struct.pack(">I", method.index) + method.marshal()


def test_replies_carry_any_utf8_name() -> None:
    with pytest.raises(ValueError):
        commands.Queue.DeclareOk(queue="café", message_count=0, consumer_count=0)
    ok = unchecked(commands.Queue.DeclareOk, queue="café ☕", message_count=3, consumer_count=1)
    payload = marshal_method(ok)
    decoded = commands.Queue.DeclareOk()
    decoded.unmarshal(payload[4:])
    assert (decoded.queue, decoded.message_count, decoded.consumer_count) == ("café ☕", 3, 1)
    with pytest.raises(KeyError):
        unchecked(commands.Queue.DeclareOk, queue="q")
    with pytest.raises(TypeError):
        unchecked(commands.Queue.DeclareOk, queue="q", message_count=0, consumer_count=0, x=1)
