"""A policy set through a backup's management API acts on the primary, and still acts on the
new primary after the old one is SIGKILLed (three real nodes, pika)."""

from __future__ import annotations

import time
from typing import Any

import pika
import pytest

from brokerha.testing import LocalCluster
from tests.failover.test_failover import FAST, wait_all_ready
from tests.management_http import call

pytestmark = pytest.mark.timeout(180)


def api(cluster: LocalCluster, name: str, method: str, path: str,
        body: Any = None) -> tuple[int, Any]:
    return call(cluster.admin_url(name) + "/api", method, path, body=body)


def depth(ch: Any, queue: str) -> int:
    return ch.queue_declare(queue, passive=True, durable=True).method.message_count


def channel(cluster: LocalCluster, name: str) -> Any:
    ch = pika.BlockingConnection(pika.URLParameters(cluster.url(name))).channel()
    ch.confirm_delivery()
    return ch


def until(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_a_policy_set_through_a_backup_holds_after_the_primary_is_killed() -> None:
    with LocalCluster(3, options=FAST) as cluster:
        primary = wait_all_ready(cluster)
        backup = next(n for n in cluster.names if n != primary)
        assert api(cluster, backup, "PUT", "/policies/%2F/limits", {
            "pattern": "^pol\\.", "apply-to": "queues",
            "definition": {"max-length": 3, "message-ttl": 600000}})[0] == 201
        ch = channel(cluster, primary)
        ch.queue_declare("pol.orders", durable=True)
        for i in range(10):
            ch.basic_publish("", "pol.orders", str(i).encode(),
                             pika.BasicProperties(delivery_mode=2))
        assert depth(ch, "pol.orders") == 3
        # every backup holds the policy itself (replicated with the definitions)
        for name in cluster.names:
            if name != primary:
                cluster.wait_ready(name, 30)
        cluster.kill(primary)
        new = cluster.wait_primary(30, other_than=primary)
        ch = until(lambda: _try_channel(cluster, new), 30)
        assert ch, "no AMQP on the new primary"
        assert depth(ch, "pol.orders") == 3
        assert ch.basic_get("pol.orders", auto_ack=False)[2] == b"7"
        ch.basic_recover(requeue=True)
        for i in range(5):  # the limit acts on the new primary
            ch.basic_publish("", "pol.orders", f"new {i}".encode(),
                             pika.BasicProperties(delivery_mode=2))
        assert depth(ch, "pol.orders") == 3
        status, entry = api(cluster, new, "GET", "/queues/%2F/pol.orders")
        assert status == 200 and entry["policy"] == "limits"
        assert entry["effective_policy_definition"] == {"max-length": 3,
                                                        "message-ttl": 600000}
        # and it changes there at once
        assert api(cluster, new, "PUT", "/policies/%2F/limits", {
            "pattern": "^pol\\.", "definition": {"max-length": 1}})[0] == 204
        assert depth(ch, "pol.orders") == 1
        assert ch.basic_get("pol.orders", auto_ack=True)[2] == b"new 4"


def _try_channel(cluster: LocalCluster, name: str) -> Any:
    try:
        return channel(cluster, name)
    except pika.exceptions.AMQPError:
        return None
