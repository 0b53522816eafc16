"""RPC across the nodes of a partitioned cluster (issue 35, docs/ha.md "Exclusive queues on a
partitioned cluster"): three nodes, P = 9 (``partitioned_cluster``). The caller, on node
A, declares an exclusive server-named reply queue (pika's RPC tutorial, kombu's and
aio-pika's RPC patterns); the server, on another node B, takes the requests from a
partition queue and publishes each reply to ``reply_to`` on the default exchange. The
reply queue lives on A alone (in no partition): B's stand-in of it forwards the reply to
A, which confirms it to B once it took it; nothing is returned. Once the owner's
connection closed and its entry left the directory, a mandatory publish to that name
from B is returned 312 NO_ROUTE. A transaction on B publishing to it is refused 540. The
same through an exchange the queue is bound to (publish/subscribe)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pika
import pytest
from kombu import Connection, Consumer, Producer, Queue

from tests.clients.test_partition_groups_clients import Cluster, partitioned_cluster
from tests.failover.groups import passive, until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def partitioned() -> Iterator[Cluster]:
    with partitioned_cluster() as cluster:
        yield cluster


def nodes(partitioned: Cluster) -> tuple[str, str]:
    """The caller's node A (the module's client node) and the server's node B."""
    a = partitioned.node
    b = next(n for n in partitioned.cluster.names if n != a)
    return a, b


def connect(partitioned: Cluster, node: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(partitioned.cluster.url(node)))


def get(ch: pika.adapters.blocking_connection.BlockingChannel, queue: str,
        timeout: float = 10.0) -> tuple[pika.spec.BasicProperties, bytes]:
    def one() -> tuple[pika.spec.BasicProperties, bytes] | None:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        return None if method is None else (props, body)
    found: tuple[pika.spec.BasicProperties, bytes] = until(f"a message on {queue}", one,
                                                           timeout=timeout)
    return found


def test_pika_rpc_reply_reaches_an_exclusive_queue_on_another_node(partitioned: Cluster) -> None:
    a, b = nodes(partitioned)
    requests = f"rpc-requests-{uuid.uuid4().hex[:8]}"
    caller = connect(partitioned, a)
    server = connect(partitioned, b)
    try:
        cch = caller.channel()
        reply_to = cch.queue_declare("", exclusive=True).method.queue
        assert reply_to.startswith("amq.gen-")
        cch.queue_declare(requests)
        sch = server.channel()
        # the server declares the queue it serves, as pika's RPC tutorial does: a basic.get
        # on B just after A's declare-ok may still find B without it (404, once in a suite)
        sch.queue_declare(requests)
        sch.confirm_delivery()  # an UnroutableError (returned) or NackError would raise
        ids = [uuid.uuid4().hex for _ in range(20)]
        started = time.monotonic()
        for n, cid in enumerate(ids):
            cch.basic_publish("", requests, str(n).encode(), pika.BasicProperties(
                reply_to=reply_to, correlation_id=cid))
            props, body = get(sch, requests)
            assert props.reply_to == reply_to
            sch.basic_publish("", props.reply_to, b"reply-" + body, pika.BasicProperties(
                correlation_id=props.correlation_id), mandatory=True)  # confirmed
        replies = [get(cch, reply_to) for _ in ids]
        elapsed = time.monotonic() - started
        # every reply, its correlation id the request's, in the server's publishing order
        assert [(p.correlation_id, body) for p, body in replies] == [
            (cid, f"reply-{n}".encode()) for n, cid in enumerate(ids)]
        assert elapsed < 30
        status = partitioned.cluster.status(a) or {}
        owned = status.get("node", {}).get("forwarding", {}).get("owned", {})
        assert owned.get("applied", 0) >= 20
        cch.queue_delete(requests)
    finally:
        caller.close()
        if server.is_open:
            server.close()


def test_after_the_owner_closed_a_mandatory_publish_from_another_node_is_returned_312(
        partitioned: Cluster) -> None:
    a, b = nodes(partitioned)
    caller = connect(partitioned, a)
    reply_to = caller.channel().queue_declare("", exclusive=True).method.queue
    until("the stand-in on B", lambda: passive(partitioned.cluster, b, reply_to).startswith("405"))
    caller.close()
    until("the owner entry gone on B", lambda: passive(partitioned.cluster, b, reply_to).startswith(
        "404 NOT_FOUND"), timeout=15)
    server = connect(partitioned, b)
    try:
        sch = server.channel()
        sch.confirm_delivery()
        with pytest.raises(pika.exceptions.UnroutableError) as exc:
            sch.basic_publish("", reply_to, b"late", mandatory=True)
        (returned,) = exc.value.messages
        assert (returned.method.reply_code, returned.method.reply_text) == (312, "NO_ROUTE")
    finally:
        server.close()


def test_a_transaction_publishing_to_another_nodes_exclusive_queue_is_refused_540(
        partitioned: Cluster) -> None:
    a, b = nodes(partitioned)
    caller = connect(partitioned, a)
    server = connect(partitioned, b)
    try:
        reply_to = caller.channel().queue_declare("", exclusive=True).method.queue
        until("the stand-in on B", lambda: passive(partitioned.cluster, b, reply_to).startswith("405"))
        sch = server.channel()
        sch.tx_select()
        sch.basic_publish("", reply_to, b"in a tx")
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as exc:
            sch.tx_commit()
        assert exc.value.reply_code == 540
        assert f"exclusive queue '{reply_to}'" in exc.value.reply_text
        assert f"on node {a}" in exc.value.reply_text
        cch = caller.channel()
        assert cch.queue_declare(reply_to, passive=True).method.message_count == 0
    finally:
        caller.close()
        if server.is_open:
            server.close()


def test_kombu_reply_to_an_exclusive_queue_on_another_node(partitioned: Cluster) -> None:
    a, b = nodes(partitioned)
    with Connection(partitioned.cluster.url(a), connect_timeout=5) as caller, \
            Connection(partitioned.cluster.url(b), connect_timeout=5,
                       transport_options={"confirm_publish": True}) as server:
        cch = caller.channel()
        reply = Queue("", exclusive=True, auto_delete=True)
        bound = reply(cch)
        bound.declare()
        name = bound.name
        assert name.startswith("amq.gen-")
        until("the stand-in on B", lambda: passive(partitioned.cluster, b, name).startswith("405"))
        producer = Producer(server.channel(), serializer="json")  # the default exchange
        for n in range(5):  # confirmed by the owner (py-amqp waits for each confirm)
            producer.publish({"n": n}, routing_key=name, correlation_id=str(n),
                             mandatory=True, retry=False)
        received: list[tuple[str, object]] = []

        def on_message(body: object, message: object) -> None:
            received.append((getattr(message, "properties", {}).get("correlation_id"), body))

        with Consumer(cch, queues=[bound], callbacks=[on_message], accept=["json"],
                      no_ack=True, auto_declare=False):  # (declared: server-named)
            deadline = time.monotonic() + 10
            while len(received) < 5 and time.monotonic() < deadline:
                caller.drain_events(timeout=5)
    assert received == [(str(n), {"n": n}) for n in range(5)]


def test_pika_publish_subscribe_to_an_exclusive_queue_bound_on_another_node(
        partitioned: Cluster) -> None:
    """pika's tutorial 3 across nodes: the subscriber on A binds its exclusive server-named
    queue to a fanout exchange; a publish on B through the exchange reaches it (B's
    stand-in bound as the queue directory says once A's bind-ok came)."""
    a, b = nodes(partitioned)
    exchange = f"logs-{uuid.uuid4().hex[:8]}"
    subscriber = connect(partitioned, a)
    publisher = connect(partitioned, b)
    try:
        sub = subscriber.channel()
        sub.exchange_declare(exchange, "fanout")
        queue = sub.queue_declare("", exclusive=True).method.queue
        sub.queue_bind(queue, exchange)
        pch = publisher.channel()
        pch.confirm_delivery()
        for n in range(5):
            pch.basic_publish(exchange, "", f"log-{n}".encode(), mandatory=True)
        assert [get(sub, queue)[1] for _ in range(5)] == [f"log-{n}".encode()
                                                          for n in range(5)]
        sub.queue_unbind(queue, exchange)
        with pytest.raises(pika.exceptions.UnroutableError):
            pch.basic_publish(exchange, "", b"after the unbind", mandatory=True)
        sub.exchange_delete(exchange)
    finally:
        subscriber.close()
        if publisher.is_open:
            publisher.close()
