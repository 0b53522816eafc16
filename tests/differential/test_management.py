"""Differential: RabbitMQ 3.10's management API (its plugin on a private node) and brokerha's.

The same HTTP calls, the status and the JSON answer compared (for lists and
objects, the fields both have and their values where they are not counters
or names of the node). Skipped when rabbitmq-server is not installed.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from brokerha.testing import NodeProcess, free_base_port, free_port
from tests.management_http import USERS, call

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rabbitmq_ref import RabbitMQRef, available  # noqa: E402

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]



@pytest.fixture(scope="module")
def rabbit_api() -> Iterator[str]:
    if not available():
        pytest.skip("rabbitmq-server is not installed (scripts/ensure-rabbitmq installs it)")
    port = free_port()
    ref = RabbitMQRef(plugins=("rabbitmq_management",),
                      extra_config=f"management.tcp.port = {port}\n"
                                   "management.tcp.ip = 127.0.0.1\n")
    with ref:
        for args in (("add_user", "watcher", "w-secret"),
                     ("set_user_tags", "watcher", "monitoring"),
                     ("set_permissions", "watcher", ".*", ".*", ".*"),
                     ("add_user", "app", "p-secret")):
            done = ref.ctl(*args)
            assert done.returncode == 0, done.stderr
        yield f"http://127.0.0.1:{port}/api"


@pytest.fixture(scope="module")
def brokerha_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("diff-mgmt") / "node.toml"
    config.write_text(USERS)
    with NodeProcess("diff-mgmt", port=free_base_port(1),
                     extra_args=["--config", str(config)]) as node:
        yield f"http://127.0.0.1:{node.port + 10000}/api"


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
