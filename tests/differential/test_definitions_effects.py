"""Differential (issue 34): what a definitions change does to AMQP clients (pika), on
RabbitMQ 3.10 and on brokerha, each changed through its management API.

A deleted user's open connection is closed (320, ``user 'u' is deleted``), a deleted
vhost's too (``vhost 'v' is deleted``) with its queues gone, a changed password
refuses the old one at the next login, a revoked permission refuses the next
operation that needs it (403), topic permissions refuse a routing key. Every
scenario's observations are compared, step by step.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pika
import pytest
from pika.exceptions import (
    ChannelClosedByBroker,
    ConnectionClosedByBroker,
    ProbableAccessDeniedError,
    ProbableAuthenticationError,
)

from tests.management_http import call

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(300)]

ALL = {"configure": ".*", "write": ".*", "read": ".*"}


class Side:
    """One broker: its management API and AMQP port."""

    def __init__(self, api: str, amqp_port: int) -> None:
        self.api, self.amqp_port = api, amqp_port
        self.opened: list[pika.BlockingConnection] = []

    def http(self, method: str, path: str, body: Any = None) -> int:
        return int(call(self.api, method, path, body=body)[0])

    def connect(self, vhost: str, user: str, password: str) -> pika.BlockingConnection:
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", self.amqp_port, vhost, pika.PlainCredentials(user, password),
            connection_attempts=1, socket_timeout=5, heartbeat=0))
        self.opened.append(conn)
        return conn

    def close(self) -> None:
        """Close the scenario's connections still open (a connection left open holds a
        stopping brokerha node for its 2 s shutdown grace)."""
        for conn in self.opened:
            if conn.is_open:
                try:
                    conn.close()
                except pika.exceptions.AMQPError:
                    pass

    def setup(self, s: str) -> None:
        assert self.http("PUT", f"/vhosts/v-{s}") == 201
        assert self.http("PUT", f"/users/u-{s}", {"password": "pw", "tags": ""}) == 201
        assert self.http("PUT", f"/permissions/v-{s}/u-{s}", ALL) == 201


def closed_by_broker(conn: pika.BlockingConnection, wait: float = 5.0) -> str:
    """How the broker ended ``conn`` within ``wait``: "code text", or "open"."""
    deadline = time.monotonic() + wait
    try:
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
    except ConnectionClosedByBroker as exc:
        return f"{exc.reply_code} {exc.reply_text}"
    conn.close()
    return "open"


def attempt(action: Callable[[], Any]) -> str:
    """"ok", or the refusal: "channel 403 ...", "login refused", "vhost refused"."""
    try:
        action()
    except ChannelClosedByBroker as exc:
        return f"channel {exc.reply_code} {exc.reply_text}"
    except ConnectionClosedByBroker as exc:
        return f"connection {exc.reply_code} {exc.reply_text}"
    except ProbableAuthenticationError:
        return "login refused"
    except ProbableAccessDeniedError:
        return "vhost refused"
    return "ok"


def deleted_user(side: Side, s: str) -> list[str]:
    side.setup(s)
    conn = side.connect(f"v-{s}", f"u-{s}", "pw")
    conn.channel()
    return [str(side.http("DELETE", f"/users/u-{s}")), closed_by_broker(conn),
            attempt(lambda: side.connect(f"v-{s}", f"u-{s}", "pw"))]


def deleted_vhost(side: Side, s: str) -> list[str]:
    side.setup(s)
    conn = side.connect(f"v-{s}", f"u-{s}", "pw")
    conn.channel().queue_declare(f"q-{s}", durable=True)
    out = [str(side.http("DELETE", f"/vhosts/v-{s}")), closed_by_broker(conn),
           attempt(lambda: side.connect(f"v-{s}", f"u-{s}", "pw"))]
    side.setup_again = True  # type: ignore[attr-defined]
    assert side.http("PUT", f"/vhosts/v-{s}") == 201
    assert side.http("PUT", f"/permissions/v-{s}/u-{s}", ALL) == 201
    again = side.connect(f"v-{s}", f"u-{s}", "pw")
    out.append(attempt(lambda: again.channel().queue_declare(f"q-{s}", passive=True)))
    return out


def changed_password(side: Side, s: str) -> list[str]:
    side.setup(s)
    open_before = side.connect(f"v-{s}", f"u-{s}", "pw")
    out = [str(side.http("PUT", f"/users/u-{s}", {"password": "new", "tags": ""})),
           attempt(lambda: side.connect(f"v-{s}", f"u-{s}", "pw").close()),
           attempt(lambda: side.connect(f"v-{s}", f"u-{s}", "new").close()),
           closed_by_broker(open_before, wait=0.5)]  # an open connection stays open
    return out


def revoked_permission(side: Side, s: str) -> list[str]:
    side.setup(s)
    conn = side.connect(f"v-{s}", f"u-{s}", "pw")
    ch = conn.channel()
    ch.queue_declare(f"a-{s}")
    out = [str(side.http("PUT", f"/permissions/v-{s}/u-{s}",
                         {"configure": "^a-", "write": ".*", "read": ".*"}))]
    out.append(attempt(lambda: ch.queue_declare(f"b-{s}")))  # not allowed any more
    ch2 = conn.channel()
    out.append(attempt(lambda: ch2.queue_declare(f"a-{s}")))  # still allowed
    out.append(str(side.http("DELETE", f"/permissions/v-{s}/u-{s}")))
    ch3 = conn.channel()
    out.append(attempt(lambda: ch3.queue_declare(f"c-{s}")))
    out.append(attempt(lambda: side.connect(f"v-{s}", f"u-{s}", "pw")))
    return out


def revoked_write(side: Side, s: str) -> list[str]:
    """A channel that published to an exchange before its write permission was revoked."""
    side.setup(s)
    conn = side.connect(f"v-{s}", f"u-{s}", "pw")
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("amq.direct", "k", b"before")
    out = [str(side.http("PUT", f"/permissions/v-{s}/u-{s}",
                         {"configure": ".*", "write": "^nothing$", "read": ".*"}))]
    out.append(attempt(lambda: ch.basic_publish("amq.direct", "k", b"after")))
    fresh = conn.channel()
    fresh.confirm_delivery()
    out.append(attempt(lambda: fresh.basic_publish("amq.direct", "k", b"after")))
    return out


def topic_permission(side: Side, s: str) -> list[str]:
    side.setup(s)
    out = [str(side.http("PUT", f"/topic-permissions/v-{s}/u-{s}",
                         {"exchange": "amq.topic", "write": "^allowed\\.", "read": "^r\\."}))]
    conn = side.connect(f"v-{s}", f"u-{s}", "pw")
    ch = conn.channel()
    ch.confirm_delivery()
    q = ch.queue_declare("", exclusive=True).method.queue
    out.append(attempt(lambda: ch.basic_publish("amq.topic", "allowed.x", b"m")))
    out.append(attempt(lambda: ch.queue_bind(q, "amq.topic", "r.x")))
    ch = conn.channel()
    out.append(attempt(lambda: ch.queue_bind(q, "amq.topic", "other")))
    ch = conn.channel()
    ch.confirm_delivery()
    out.append(attempt(lambda: ch.basic_publish("amq.topic", "denied.x", b"m")))
    ch = conn.channel()
    ch.confirm_delivery()
    out.append(attempt(lambda: ch.basic_publish("amq.direct", "denied.x", b"m")))  # not topic
    return out


SCENARIOS = {"a deleted user's connection is closed": deleted_user,
             "a deleted vhost's connection is closed, its queues gone": deleted_vhost,
             "a changed password refuses the old one at the next login": changed_password,
             "a revoked permission refuses the next operation": revoked_permission,
             "a revoked write permission and a channel that published": revoked_write,
             "topic permissions refuse a routing key": topic_permission}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_effect_on_clients_is_rabbitmqs(name: str, rabbit_node: Any, rabbit_api: str,
                                            brokerha_node: Any, brokerha_api: str) -> None:
    scenario = SCENARIOS[name]
    suffix = uuid.uuid4().hex[:8]
    # a connection of a deleted vhost: RabbitMQ closes it with whichever of its two
    # notices comes first ("vhost 'v' is deleted", or "is down" as its supervisor stops)
    rabbit, brokerha = Side(rabbit_api, rabbit_node.ref.port), Side(brokerha_api,
                                                                     brokerha_node.port)
    try:
        theirs = [t.replace(f"vhost 'v-{suffix}' is down", f"vhost 'v-{suffix}' is deleted")
                  for t in scenario(rabbit, suffix)]
        ours = scenario(brokerha, suffix)
    finally:
        rabbit.close()
        brokerha.close()
    assert "open" not in theirs[1:2] or name.startswith("a changed"), theirs  # it does act
    assert ours == theirs
