"""Differential: RabbitMQ 3.10's management API (its plugin on a private node) and brokerha's.

The same HTTP calls, the status and the JSON answer compared (for lists and
objects, the fields both have and their values where they are not counters
or names of the node). Skipped when rabbitmq-server is not installed.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.management_http import call

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]

# rabbit_api and brokerha_api: conftest.py


CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "no credentials": ("GET", "/overview", {"user": None}),
    "a wrong password": ("GET", "/overview", {"password": "wrong"}),
    "a user without a management tag": ("GET", "/queues", {"user": "app",
                                                           "password": "p-secret"}),
    "a monitoring user asks for the users": ("GET", "/users", {"user": "watcher",
                                                               "password": "w-secret"}),
    "whoami of a monitoring user": ("GET", "/whoami", {"user": "watcher",
                                                      "password": "w-secret"}),
    "a missing queue": ("GET", "/queues/%2F/nonesuch-{s}", {}),
    "a missing exchange": ("GET", "/exchanges/%2F/nonesuch-{s}", {}),
    "a missing vhost": ("GET", "/queues/nonesuch-{s}", {}),
    "aliveness test": ("GET", "/aliveness-test/%2F", {}),
    "health check: alarms": ("GET", "/health/checks/alarms", {}),
    "health check: local alarms": ("GET", "/health/checks/local-alarms", {}),
    "declare a queue": ("PUT", "/queues/%2F/dq-{s}", {"body": {"durable": True}}),
    "publish to a missing exchange": ("POST", "/exchanges/%2F/nonesuch-{s}/publish",
                                      {"body": {"routing_key": "k", "payload": "x",
                                                "payload_encoding": "string",
                                                "properties": {}}}),
    "publish to the default exchange, unroutable": (
        "POST", "/exchanges/%2F/amq.default/publish",
        {"body": {"routing_key": "nowhere-{s}", "payload": "x", "payload_encoding": "string",
                  "properties": {}}}),
    "get from an empty queue": ("POST", "/queues/%2F/aliveness-test/get",
                                {"body": {"count": 1, "ackmode": "ack_requeue_true",
                                          "encoding": "auto"}}),
    "delete a missing queue": ("DELETE", "/queues/%2F/nonesuch-{s}", {}),
    "declare an amq.* exchange": ("PUT", "/exchanges/%2F/amq.x-{s}", {"body": {"type": "direct"}}),
    "delete amq.direct": ("DELETE", "/exchanges/%2F/amq.direct", {}),
    "an exchange of an unknown type": ("PUT", "/exchanges/%2F/ux-{s}",
                                       {"body": {"type": "nonesuch"}}),
    "an empty page": ("GET", "/queues?page=1&page_size=10&name=nonesuch-{s}", {}),
    "an unknown path": ("GET", "/nonesuch", {}),
    "a method the path does not take": ("DELETE", "/overview", {}),
}


def outcome(base: str, case: str, suffix: str) -> tuple[int, Any]:
    method, path, kw = CASES[case]
    kw = json.loads(json.dumps(kw).replace("{s}", suffix))
    return call(base, method, path.replace("{s}", suffix), **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_answer_as_rabbitmqs_management_api(case: str, rabbit_api: str,
                                                 brokerha_api: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    expected = outcome(rabbit_api, case, suffix)
    got = outcome(brokerha_api, case, suffix)
    assert got == expected


def test_the_same_fields_on_a_queue_and_the_overview(rabbit_api: str,
                                                     brokerha_api: str) -> None:
    """Every field a tool reads is there (RabbitMQ has more, brokerha's own are extra)."""
    name = f"fields-{uuid.uuid4().hex[:8]}"
    keys = {}
    for base in (rabbit_api, brokerha_api):
        assert call(base, "PUT", f"/queues/%2F/{name}", body={"durable": True})[0] == 201
        queue = call(base, "GET", f"/queues/%2F/{name}")[1]
        overview = call(base, "GET", "/overview")[1]
        keys[base] = (set(queue), set(overview), set(overview["queue_totals"]),
                      set(overview["object_totals"]))
    # RabbitMQ adds the counters once its statistics collector has seen the queue;
    # brokerha has them at once
    wanted_queue = {"name", "vhost", "durable", "auto_delete", "exclusive", "arguments", "node",
                    "type"}
    assert wanted_queue | {"state", "messages", "messages_ready", "messages_unacknowledged",
                           "consumers"} <= keys[brokerha_api][0]
    for base in (rabbit_api, brokerha_api):
        queue, overview, totals, objects = keys[base]
        assert wanted_queue <= queue, (base, wanted_queue - queue)
        assert {"rabbitmq_version", "cluster_name", "node", "queue_totals", "object_totals",
                "listeners", "message_stats"} <= overview | {"message_stats"}, base
        assert {"connections", "channels", "exchanges", "queues", "consumers"} <= objects
    # RabbitMQ's queue_totals stay empty until its first statistics round
    assert {"messages", "messages_ready", "messages_unacknowledged"} <= keys[brokerha_api][2]
