"""Exclusive queues on a partitioned cluster, real processes (issue 35 task I, docs/ha.md
"Exclusive queues on a partitioned cluster"): three nodes, P = 9. A connection on one node
declares an exclusive queue; a client on another node gets RabbitMQ's 405
RESOURCE_LOCKED for it (the queue directory names its owner), but its publishes reach
the queue on the owner's node; the queue goes everywhere when the owner's connection
closes, and when its node is killed (the metadata primary
drops a node's exclusive queues once its link has been down ``OWNER_GRACE``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pika
import pytest

from brokerha.partition.directory import OWNER_GRACE
from brokerha.testing import LocalCluster
from tests.failover.groups import passive, until
from tests.failover.test_failover import FAST

pytestmark = pytest.mark.timeout(120)

P = 9
GROUPS = sorted(str(g) for g in range(P + 1))
LOCKED = ("405 RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{q}' in "
          "vhost '/'. It could be originally declared on another connection or the "
          "exclusive property value does not match that of the original declaration.")


def ready(cluster: LocalCluster) -> bool:
    for name in cluster.names:
        groups = (cluster.status(name) or {}).get("node", {}).get("groups") or {}
        if sorted(groups) != GROUPS or not all(g["ready"] for g in groups.values()):
            return False
    return True


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options={**FAST, "partitions": P, "partition_groups": True}) as c:
        until("every node ready in every group", lambda: ready(c), timeout=60)
        yield c


def metadata_leader(cluster: LocalCluster) -> str:
    def one() -> str | None:
        return next((n for n in cluster.names if (((cluster.status(n) or {}).get("node", {})
                     .get("groups") or {}).get("0") or {}).get("serving")), None)
    found: str = until("a metadata leader", one)
    return found


def hold(cluster: LocalCluster, node: str, queue: str) -> pika.BlockingConnection:
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(node)))
    conn.channel().queue_declare(queue, exclusive=True)
    return conn


def test_another_node_answers_405_until_the_owners_connection_closes(
        cluster: LocalCluster) -> None:
    a, b, c = cluster.names
    queue = f"exq-{uuid.uuid4().hex[:8]}"
    holder = hold(cluster, a, queue)
    try:
        # at once after the declare-ok, on every other node
        assert passive(cluster, b, queue) == LOCKED.format(q=queue)
        assert passive(cluster, c, queue) == LOCKED.format(q=queue)
        other = pika.BlockingConnection(pika.URLParameters(cluster.url(b)))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as exc:
            other.channel().queue_declare(queue, exclusive=True)
        assert exc.value.reply_code == 405
        # a mandatory publish to it from another node reaches it on its owner's node (as
        # RabbitMQ delivers it: exclusivity does not cover publishing), confirmed, not
        # returned; nothing stays on the stand-in
        ch = other.channel()
        ch.confirm_delivery()
        ch.basic_publish("", queue, b"x", mandatory=True)
        method, _, body = holder.channel().basic_get(queue, auto_ack=True)
        assert method is not None and body == b"x"
        other.close()
    finally:
        holder.close()
    until("the queue gone on b and c", lambda: all(
        passive(cluster, n, queue).startswith("404 NOT_FOUND") for n in (b, c)), timeout=10)


def test_the_queues_of_a_killed_node_go_everywhere(cluster: LocalCluster) -> None:
    meta = metadata_leader(cluster)
    victim = next(n for n in cluster.names if n != meta)
    asker = next(n for n in cluster.names if n not in (meta, victim))
    queue = f"exk-{uuid.uuid4().hex[:8]}"
    holder = hold(cluster, victim, queue)
    assert passive(cluster, asker, queue) == LOCKED.format(q=queue)
    publisher = pika.BlockingConnection(pika.URLParameters(cluster.url(asker)))
    ch = publisher.channel()
    ch.confirm_delivery()
    killed = time.monotonic()
    cluster.kill(victim)
    try:
        holder.close()
    except pika.exceptions.AMQPError:
        pass
    # its owner gone: a publish to it is never confirmed -- nacked while the stand-in is
    # still there (the link to the owner down), returned once it went
    with pytest.raises((pika.exceptions.NackError, pika.exceptions.UnroutableError)) as exc:
        ch.basic_publish("", queue, b"to a dead node", mandatory=True)
    if time.monotonic() - killed < OWNER_GRACE - 1:  # (the stand-in not dropped yet)
        assert isinstance(exc.value, pika.exceptions.NackError), exc.value
    publisher.close()
    until("the killed node's exclusive queue gone on the others", lambda: all(
        passive(cluster, n, queue).startswith("404 NOT_FOUND") for n in (meta, asker)),
        timeout=OWNER_GRACE + 20)
    assert time.monotonic() - killed >= OWNER_GRACE - 1  # not before its grace
