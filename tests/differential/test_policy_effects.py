"""Differential (issue 34): what a policy does to queues and exchanges, seen by pika, on
RabbitMQ 3.10 and on brokerha, each policy set through its management API.

A queue declared without arguments obeys ``message-ttl`` and ``max-length``; a changed
policy, then an operator policy, trim an existing queue; a queue's own arguments against
the policy's keys; a policy's dead-letter exchange and alternate exchange; what
``/api/queues`` shows. RabbitMQ applies a policy to its queue processes asynchronously, so
each depth is read once it has stopped changing (``steady``); every observation of a
scenario is compared.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pika
import pytest

from tests.management_http import call

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(300)]

ALL = {"configure": ".*", "write": ".*", "read": ".*"}


class Side:
    """One broker: its management API and AMQP port; a vhost ``v-{s}`` of its own."""

    def __init__(self, api: str, amqp_port: int, s: str) -> None:
        self.api, self.amqp_port, self.vhost = api, amqp_port, f"v-{s}"
        assert self.http("PUT", f"/vhosts/{self.vhost}")[0] == 201
        assert self.http("PUT", f"/permissions/{self.vhost}/guest", ALL)[0] in (201, 204)
        self.conn = pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", amqp_port, self.vhost, pika.PlainCredentials("guest", "guest"),
            connection_attempts=1, socket_timeout=5))
        self.ch = self.conn.channel()
        self.ch.confirm_delivery()

    def close(self) -> None:
        """Close the connection (left open, it holds a stopping brokerha node for its 2 s
        shutdown grace)."""
        if self.conn.is_open:
            try:
                self.conn.close()
            except pika.exceptions.AMQPError:
                pass

    def http(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return call(self.api, method, path, body=body)

    def policy(self, name: str, body: dict[str, Any], kind: str = "policies") -> int:
        return int(self.http("PUT", f"/{kind}/{self.vhost}/{name}", body)[0])

    def publish(self, queue: str, *bodies: str, exchange: str = "") -> list[str]:
        out = []
        for body in bodies:
            try:
                self.ch.basic_publish(exchange, queue, body.encode())
                out.append("ack")
            except pika.exceptions.NackError:
                out.append("nack")
        return out

    def depth(self, queue: str) -> int:
        return int(self.ch.queue_declare(queue, passive=True).method.message_count)

    def head(self, queue: str) -> str | None:
        body = self.ch.basic_get(queue, auto_ack=True)[2]
        return None if body is None else body.decode()


def steady(read: Callable[[], Any], settle: float = 0.3, limit: float = 10.0) -> Any:
    """``read()`` once it gave the same answer for ``settle`` seconds."""
    value, since, deadline = read(), time.monotonic(), time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= settle:
            break
    return value


def declared_without_arguments(side: Side) -> list[Any]:
    out: list[Any] = [side.policy("p", {"pattern": "^pol\\.", "apply-to": "queues",
                                         "definition": {"message-ttl": 400, "max-length": 2}})]
    side.ch.queue_declare("pol.a")
    side.ch.queue_declare("other.a")
    out += side.publish("pol.a", "1", "2", "3") + side.publish("other.a", "1", "2", "3")
    out += [side.depth("pol.a"), side.depth("other.a"), side.head("pol.a")]
    time.sleep(0.6)
    out += [side.depth("pol.a"), side.depth("other.a")]
    return out


def changed_on_an_existing_queue(side: Side) -> list[Any]:
    side.ch.queue_declare("pol.b")
    out: list[Any] = side.publish("pol.b", *[str(i) for i in range(10)])
    out.append(side.policy("p", {"pattern": "^pol\\.", "definition": {"max-length": 6}}))
    out.append(steady(lambda: side.depth("pol.b")))
    out.append(side.policy("p", {"pattern": "^pol\\.", "definition": {"max-length": 3}}))
    out += [steady(lambda: side.depth("pol.b")), side.head("pol.b")]
    out.append(side.policy("cap", {"pattern": ".", "definition": {"max-length": 1},
                                   "priority": 1}, kind="operator-policies"))
    out += [steady(lambda: side.depth("pol.b")), side.head("pol.b")]
    out.append(side.http("DELETE", f"/operator-policies/{side.vhost}/cap")[0])
    out.append(side.http("DELETE", f"/policies/{side.vhost}/p")[0])
    out += side.publish("pol.b", "a", "b", "c")
    out.append(steady(lambda: side.depth("pol.b")))
    return out


def arguments_against_the_policy(side: Side) -> list[Any]:
    out: list[Any] = [side.policy("p", {"pattern": "^pol\\.", "definition": {
        "max-length": 3, "overflow": "drop-head", "message-ttl": 60000}})]
    side.ch.queue_declare("pol.c", arguments={"x-max-length": 10,
                                              "x-overflow": "reject-publish"})
    side.ch.queue_declare("pol.d", arguments={"x-max-length": 2})
    time.sleep(0.2)
    out += side.publish("pol.c", *[str(i) for i in range(5)])  # min(3, 10), reject-publish
    out += side.publish("pol.d", *[str(i) for i in range(5)])  # min(3, 2), drop-head
    out += [side.depth("pol.c"), side.head("pol.c"), side.depth("pol.d"), side.head("pol.d")]
    return out


def dead_letters_and_alternates(side: Side) -> list[Any]:
    side.ch.queue_declare("dead")
    side.ch.queue_bind("dead", "amq.fanout")
    out: list[Any] = [
        side.policy("dl", {"pattern": "^pol\\.", "apply-to": "queues", "definition": {
            "max-length": 1, "dead-letter-exchange": "amq.fanout"}}),
        side.policy("ae", {"pattern": "^pol\\.x$", "apply-to": "exchanges",
                           "definition": {"alternate-exchange": "amq.fanout"}})]
    side.ch.queue_declare("pol.e")
    side.ch.exchange_declare("pol.x", "direct")
    time.sleep(0.2)
    out += side.publish("pol.e", "1", "2", "3")
    out += side.publish("nowhere", "lost", exchange="pol.x")
    out += [steady(lambda: side.depth("dead")), side.depth("pol.e")]
    out += [side.head("dead") for _ in range(3)]
    return out


def what_the_api_shows(side: Side) -> list[Any]:
    side.policy("p", {"pattern": "^pol\\.", "apply-to": "queues",
                      "definition": {"max-length": 5, "message-ttl": 60000}})
    side.policy("o", {"pattern": "^pol\\.", "definition": {"max-length": 2}},
                kind="operator-policies")
    side.ch.queue_declare("pol.f")
    side.ch.queue_declare("plain")
    fields = ("policy", "operator_policy", "effective_policy_definition")

    def shown(queue: str) -> list[Any]:
        entry = side.http("GET", f"/queues/{side.vhost}/{queue}")[1]
        return [entry.get(f) for f in fields]

    # RabbitMQ's listing has them once the queue's statistics came (every 5 s)
    return [until(lambda: shown("pol.f"), lambda v: v[0] is not None),
            until(lambda: shown("plain"), lambda v: v[2] is not None)]


def until(read: Callable[[], Any], done: Callable[[Any], bool], limit: float = 15.0) -> Any:
    deadline = time.monotonic() + limit
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.2)
        value = read()
    return value


Check = Callable[[list[Any]], bool]
# each scenario, and what shows on RabbitMQ that its policies acted (so equal is not vacuous)
SCENARIOS: dict[str, tuple[Callable[[Side], list[Any]], Check]] = {
    "a queue declared without arguments obeys message-ttl and max-length":
        (declared_without_arguments, lambda seen: seen[7:11] == [2, 3, "2", 0]),
    "a changed policy and an operator policy trim an existing queue":
        (changed_on_an_existing_queue, lambda seen: seen[11] == 6 and seen[16] == 1),
    "a queue's arguments against the policy's keys":
        (arguments_against_the_policy, lambda seen: seen.count("nack") == 2),
    "a policy's dead-letter exchange and alternate exchange":
        (dead_letters_and_alternates, lambda seen: seen[-4:] == [1, "1", "2", "lost"]),
    "/api/queues shows policy, operator_policy, effective_policy_definition":
        (what_the_api_shows, lambda seen: seen[0][:2] == ["p", "o"]),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_policies_act_as_rabbitmqs(name: str, rabbit_node: Any, rabbit_api: str,
                                   brokerha_node: Any, brokerha_api: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    scenario, acted = SCENARIOS[name]
    rabbit = Side(rabbit_api, rabbit_node.ref.port, suffix)
    try:
        theirs = scenario(rabbit)
    finally:
        rabbit.close()
    assert acted(theirs), theirs
    brokerha = Side(brokerha_api, brokerha_node.port, suffix)
    try:
        ours = scenario(brokerha)
    finally:
        brokerha.close()
    assert ours == theirs
