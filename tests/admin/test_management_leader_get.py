"""The management API's get, publish and aliveness test on a partitioned cluster (issue 35,
admin/leader_requests.py): four real nodes (P = 4, each partition on three of them), a
queue in a partition the metadata primary leads, one it backs up and one it holds no
cell of; every request through each node (the queue's leader, a backup of it, the node
outside its partition). A get is answered by the queue's leader, every ackmode with its
meaning (requeue: the messages stay, marked redelivered; take: they are gone)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import FOUR_OPTIONS, cells_of, queue_in, settled_leaders, until
from tests.management_http import USERS, call

pytestmark = pytest.mark.timeout(150)


def messages(base: str, name: str) -> int | None:
    status, entry = call(base, "GET", f"/queues/%2F/{name}")
    return int(entry["messages"]) if status == 200 else None


def get(base: str, name: str, ackmode: str, count: int) -> list[dict[str, Any]]:
    status, answer = call(base, "POST", f"/queues/%2F/{name}/get",
                          body={"count": count, "ackmode": ackmode, "encoding": "auto"})
    assert status == 200, (status, answer)
    return list(answer)


def every_ackmode(base: str, name: str) -> None:
    """Three messages published (routed), looked at twice (requeued, in their order,
    redelivered), then taken one by one (acked, rejected): none left."""
    for i in range(3):
        assert call(base, "POST", "/exchanges/%2F/amq.default/publish",
                    body={"routing_key": name, "payload": f"m{i}", "payload_encoding": "string",
                          "properties": {"message_id": f"id{i}"}}) == (200, {"routed": True})
    until(f"3 messages in {name}", lambda: messages(base, name) == 3)
    for ackmode in ("ack_requeue_true", "reject_requeue_true"):
        got = get(base, name, ackmode, 2)
        assert [m["payload"] for m in got] == ["m0", "m1"], got
        assert [m["properties"]["message_id"] for m in got] == ["id0", "id1"]
        assert all(m["routing_key"] == name and m["message_count"] == 1 for m in got), got
        assert until(f"3 messages in {name} after a look",
                     lambda: messages(base, name) == 3)
    assert get(base, name, "ack_requeue_true", 1)[0]["redelivered"] is True
    assert [m["payload"] for m in get(base, name, "ack_requeue_false", 1)] == ["m0"]
    assert [m["payload"] for m in get(base, name, "reject_requeue_false", 1)] == ["m1"]
    last = get(base, name, "ack_requeue_false", 5)
    assert [(m["payload"], m["message_count"]) for m in last] == [("m2", 0)], last
    assert get(base, name, "ack_requeue_true", 1) == []
    until(f"{name} empty", lambda: messages(base, name) == 0)


def four_nodes() -> LocalCluster:
    cluster = LocalCluster(4, options=FOUR_OPTIONS)
    cluster.config.write_text(cluster.config.read_text() + USERS)
    return cluster


def test_get_publish_and_aliveness_through_every_node_answered_by_the_leader() -> None:
    started = time.monotonic()
    with four_nodes() as cluster:
        names = cluster.names
        lead = settled_leaders(cluster)
        primary = lead["0"][0]
        cells = cells_of(cluster, primary)
        role: dict[str, int] = {}  # the metadata primary's role in a partition -> it
        for p, holders in cells.items():
            leader = lead[str(p + 1)][0]
            kind = "leader" if leader == primary else \
                "backup" if primary in holders else "outside"
            role.setdefault(kind, p)
        assert {"backup", "outside"} <= set(role), (cells, lead)
        tried = 0
        for kind, p in sorted(role.items()):
            leader = lead[str(p + 1)][0]
            backup = next(n for n in cells[p] if n != leader)
            outside = next((n for n in names if n not in cells[p]), None)
            for via in [leader, backup, outside]:
                if via is None:
                    continue
                base = cluster.admin_url(via) + "/api"
                name = queue_in(p, f"get-{kind}-{uuid.uuid4().hex[:6]}")
                assert call(base, "PUT", f"/queues/%2F/{name}",
                            body={"durable": True})[0] == 201
                every_ackmode(base, name)
                assert call(base, "GET", "/aliveness-test/%2F") == (200, {"status": "ok"})
                # the user's permissions, checked on the leader as before: a management
                # user without permissions in "/" does not see its queues
                assert call(base, "POST", f"/queues/%2F/{name}/get", user="alice",
                            password="a-secret", body={"count": 1})[0] == 404
                assert call(base, "DELETE", f"/queues/%2F/{name}")[0] == 204
                tried += 1
        # a get of a queue that exists nowhere: RabbitMQ's 404
        assert call(cluster.admin_url(names[0]) + "/api", "POST",
                    "/queues/%2F/nonesuch/get", body={"count": 1})[0] == 404
    print(f"\n4 nodes, P = 4: metadata primary {primary} ({', '.join(sorted(role))}), "
          f"{tried} queues x every ackmode through leader/backup/outside in "
          f"{time.monotonic() - started:.1f} s")


@pytest.mark.slow
def test_a_leader_that_does_not_answer_is_a_503_then_its_successor_answers() -> None:
    """The leader of the queue's partition stopped (SIGSTOP) just before a get: 503
    ``service_unavailable`` after ``LEADER_TIMEOUT`` (6 s), not a hang nor the forwarded
    request's 10 s; once a new leader is elected the get is its answer, the message
    kept."""
    with four_nodes() as cluster:
        lead = settled_leaders(cluster)
        primary = lead["0"][0]
        p = next(p for p in range(4) if lead[str(p + 1)][0] != primary)
        stopped = lead[str(p + 1)][0]
        via = next(n for n in cluster.names if n not in (primary, stopped))
        base = cluster.admin_url(via) + "/api"
        name = queue_in(p, f"get-stopped-{uuid.uuid4().hex[:6]}")
        assert call(base, "PUT", f"/queues/%2F/{name}", body={"durable": True})[0] == 201
        assert call(base, "POST", "/exchanges/%2F/amq.default/publish",
                    body={"routing_key": name, "payload": "kept", "payload_encoding": "string",
                          "properties": {"delivery_mode": 2}}) == (200, {"routed": True})
        until(f"1 message in {name}", lambda: messages(base, name) == 1)
        cluster.pause(stopped)
        try:
            asked = time.monotonic()
            status, answer = call(base, "POST", f"/queues/%2F/{name}/get",
                                  body={"count": 1, "ackmode": "ack_requeue_true"})
            took = time.monotonic() - asked
            assert (status, answer["error"]) == (503, "service_unavailable"), answer
            assert stopped in answer["reason"] and 5.0 < took < 9.5, (took, answer)

            def got() -> list[dict[str, Any]] | None:
                status, answer = call(base, "POST", f"/queues/%2F/{name}/get",
                                      body={"count": 1, "ackmode": "ack_requeue_true"})
                return answer if status == 200 and answer else None

            after = until("the new leader's answer", got, timeout=40)
            assert [m["payload"] for m in after] == ["kept"], after
        finally:
            cluster.resume(stopped)
    print(f"\n{stopped} stopped: 503 in {took:.1f} s, then the new leader's get")
