"""A changed ``ha-replicate`` policy applies to an existing queue at once (issue 34), on three
real nodes: under ``none`` its confirmed messages live on the primary alone; once the change to
``all`` is reported applied (``replicate_changes`` in the primary's status) a SIGKILL of the
primary loses none of them. And back: ``all`` -> ``configuration`` empties the backups' copies,
never the primary's queue."""

from __future__ import annotations

import time
from typing import Any

import pika
import pytest

from brokerha.testing import LocalCluster
from tests.failover.test_failover import FAST, wait_all_ready
from tests.failover.test_policy_failover import _try_channel, api, until

pytestmark = pytest.mark.timeout(120)

QUEUE = "rr.orders"
MESSAGES = 2000
BODY = b"x" * 512


def set_replicate(cluster: LocalCluster, node: str, mode: str) -> int:
    status, _ = api(cluster, node, "PUT", "/policies/%2F/replicate", {
        "pattern": "^rr\\.", "apply-to": "queues", "definition": {"ha-replicate": mode}})
    return status


def changes(cluster: LocalCluster, node: str) -> dict[str, Any]:
    status = cluster.status(node) or {}
    return dict((status.get("node", {}).get("replication") or {}).get("replicate_changes") or {})


def queue_entry(cluster: LocalCluster, node: str) -> dict[str, Any] | None:
    _, answer = api(cluster, node, "GET", "/brokerha/queues")
    return next((q for q in answer["queues"] if q["name"] == QUEUE), None)


def publish(ch: Any, first: int, count: int) -> list[int]:
    """Persistent, each confirmed (pika raises on a nack)."""
    for i in range(first, first + count):
        ch.basic_publish("", QUEUE, b"%d:" % i + BODY, pika.BasicProperties(delivery_mode=2))
    return list(range(first, first + count))


def drain(ch: Any) -> set[int]:
    ids = set()
    while True:
        method, _, body = ch.basic_get(QUEUE, auto_ack=True)
        if method is None:
            return ids
        ids.add(int(body.split(b":", 1)[0]))


def wait_applied(cluster: LocalCluster, primary: str, timeout: float = 30.0) -> float:
    started = time.monotonic()
    assert until(lambda: changes(cluster, primary).get("pending") is False
                 and changes(cluster, primary).get("applied_queues", 0) > 0, timeout), \
        changes(cluster, primary)
    return time.monotonic() - started


def test_none_to_all_then_sigkill_loses_no_confirmed_message() -> None:
    with LocalCluster(3, options=FAST) as cluster:
        primary = wait_all_ready(cluster)
        assert set_replicate(cluster, primary, "none") == 201
        conn = pika.BlockingConnection(pika.URLParameters(cluster.url(primary)))
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(QUEUE, durable=True)
        confirmed = publish(ch, 0, MESSAGES)
        held = [ch.basic_get(QUEUE, auto_ack=False)[0] for _ in range(3)]  # unacknowledged
        assert all(held)
        backups = [n for n in cluster.names if n != primary]
        for name in backups:  # not on the backups
            assert queue_entry(cluster, name) is None
        assert queue_entry(cluster, primary)["replicate"] == "none"
        assert set_replicate(cluster, primary, "all") == 204
        confirmed += publish(ch, MESSAGES, 50)  # confirmed by the majority rule at once
        wait_applied(cluster, primary)
        entry = queue_entry(cluster, primary)
        assert entry["replicate"] == "all" and "replicate_change" not in entry
        assert all(entry["backups_caught_up"].get(b) for b in backups), entry
        for name in backups:  # every backup holds it, unacknowledged deliveries included
            copy = queue_entry(cluster, name)
            assert copy is not None and copy["messages_ready"] == MESSAGES + 50, copy
        last = changes(cluster, primary)["last_applied"]
        print(f"\nnone -> all: {MESSAGES + 50} x {len(BODY)} B on both backups "
              f"{last['seconds']:.3f}s after the change ({last})")
        cluster.kill(primary)
        new = cluster.wait_primary(30, other_than=primary)
        ch2 = until(lambda: _try_channel(cluster, new), 30)
        assert ch2, "no AMQP on the new primary"
        found = drain(ch2)
        assert set(confirmed) <= found, sorted(set(confirmed) - found)[:10]


def test_all_to_configuration_empties_the_backups_not_the_primary() -> None:
    with LocalCluster(3, options=FAST) as cluster:
        primary = wait_all_ready(cluster)
        assert set_replicate(cluster, primary, "all") == 201
        ch = pika.BlockingConnection(pika.URLParameters(cluster.url(primary))).channel()
        ch.confirm_delivery()
        ch.queue_declare(QUEUE, durable=True)
        publish(ch, 0, 200)
        backups = [n for n in cluster.names if n != primary]
        assert until(lambda: all((queue_entry(cluster, b) or {}).get("messages_ready") == 200
                                 for b in backups), 10)
        assert set_replicate(cluster, primary, "configuration") == 204
        wait_applied(cluster, primary)
        for name in backups:  # declared there, empty; the primary's queue untouched
            assert until(lambda name=name: (queue_entry(cluster, name) or {})
                         .get("messages_ready") == 0, 10)
        assert ch.queue_declare(QUEUE, passive=True, durable=True).method.message_count == 200
        assert queue_entry(cluster, primary)["replicate"] == "configuration"
        assert set_replicate(cluster, primary, "none") == 204
        wait_applied(cluster, primary)
        for name in backups:
            assert until(lambda name=name: queue_entry(cluster, name) is None, 10)
        assert ch.queue_declare(QUEUE, passive=True, durable=True).method.message_count == 200
