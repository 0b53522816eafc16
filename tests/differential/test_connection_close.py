"""Differential: a client's connection.close with its publishes still arriving behind it.

The same bare-socket steps (tests/amqp/test_close_ok.py: ``close_behind_publishes``,
``close_and_stay``) against RabbitMQ 3.10 and brokerha (issue 34: amqplib's
publisher got ECONNRESET from brokerha where RabbitMQ answered close-ok and let it
close). What a client can observe is compared: close-ok arrives, nothing before
or after it, more publishes after it go through and the broker leaves the socket
open for the client to close; a client that never closes is closed after the
negotiated heartbeat (RabbitMQ's close timeout when it is under 30 s). Where they
differ on purpose: RabbitMQ's sockets close with a RST (linger 0), even after the
client's own close; brokerha's with a clean EOF. Skipped when rabbitmq-server is
not installed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.amqp.test_close_ok import CLEAN_CLOSE, RawClient, close_and_stay, close_behind_publishes

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]


def test_close_behind_publishes_ends_as_on_rabbitmq(rabbitmq_url: str,
                                                     brokerha_url: str) -> None:
    expected = close_behind_publishes(RawClient.connect(rabbitmq_url))
    got = close_behind_publishes(RawClient.connect(brokerha_url))
    # what tests/amqp/test_close_ok.py holds brokerha to, but for the very end: our own
    # close meets RabbitMQ's RST (linger 0 on its sockets), brokerha's clean EOF
    assert replace(expected, end="eof") == CLEAN_CLOSE and expected.end in ("eof", "reset")
    assert replace(got, end=expected.end) == expected
    assert got.end == "eof"


def test_a_client_that_never_closes_is_closed_as_by_rabbitmq(rabbitmq_url: str,
                                                             brokerha_url: str) -> None:
    """After the heartbeat (2 s, under RabbitMQ's ?CLOSING_TIMEOUT of 30 s); RabbitMQ's end
    is a RST (linger 0), brokerha's a clean EOF: the client sees its connection end."""
    how, after = close_and_stay(RawClient.connect(rabbitmq_url), heartbeat_s=2)
    got, got_after = close_and_stay(RawClient.connect(brokerha_url), heartbeat_s=2)
    assert how in ("eof", "reset") and 1.5 <= after <= 3.5, (how, after)
    assert got == "eof" and abs(got_after - after) < 1.0, (got, got_after, after)
