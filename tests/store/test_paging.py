"""Paging bodies of long durable queues to the store (docs/store.md, "Paging")."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from brokerha.broker.broker import Broker, Limits
from brokerha.broker.paging import PAGED, PENDING
from brokerha.broker.queue import Queue
from brokerha.node import config_from_args, register
from brokerha.node.config import ConfigError, NodeConfig, apply_document
from brokerha.testing import NodeProcess
from tests.store.harness import LIMIT, SIZE, StoreNode, body, message, resident


def check_accounting(q: Queue) -> None:
    assert q.paged_bytes == sum(e.message.size for e in q.ready if e.paged)
    assert resident(q) <= q.ready_bytes - q.paged_bytes + sum(
        len(e.message.body) for e in q.ready if e.paged == PENDING)


@pytest.fixture
def node(store_url: str) -> Iterator[StoreNode]:
    n = StoreNode(store_url, limits=Limits(queue_max_memory=LIMIT))
    yield n
    n.close()


def settle(n: StoreNode) -> None:
    """Sync until no queue waits for a commit to page: entries marked while a
    page-out callback was already registered wait for the next commit."""
    for _ in range(20):
        n.sync()
        if not any(q.page_pending for q in n.vhost.queues.values()):
            return
    raise AssertionError("entries still pending after 20 commits")


def fill(n: StoreNode, q: Queue, count: int, chunk: int = 50, start: int = 0) -> None:
    for first in range(start, start + count, chunk):
        end = min(first + chunk, start + count)
        n.call(lambda f=first, e=end: [q.enqueue(message(body(i))) for i in range(f, e)])
        n.sync()
        assert resident(q) <= LIMIT + chunk * SIZE  # the last chunk may wait for its commit
    settle(n)


def drain(n: StoreNode, q: Queue) -> list[bytes]:
    settle(n)
    out = []
    while True:
        entry = n.call(q.get)
        if entry is None:
            return out
        out.append(entry.message.body)
        assert resident(q) <= LIMIT + 2 * SIZE
        n.call(lambda e=entry: q.settle(e))


def test_long_queue_keeps_resident_bodies_under_the_limit(node: StoreNode) -> None:
    q = node.queue()
    fill(node, q, 500)
    assert resident(q) <= LIMIT + SIZE
    assert node.broker.memory.used == q.ready_bytes - q.paged_bytes
    assert sum(1 for e in q.ready if e.paged == PAGED) > 450
    # the head stays resident
    assert all(e.paged == 0 for e in list(q.ready)[:10])
    check_accounting(q)
    assert drain(node, q) == [body(i) for i in range(500)]
    assert q.ready_bytes == q.paged_bytes == node.broker.memory.used == 0
    pager = node.broker.memory.pager
    assert pager is not None and pager.read_back >= 480
    assert pager.reads < pager.read_back  # read ahead: several bodies per query


def test_entries_consumed_before_their_commit_are_never_paged(node: StoreNode) -> None:
    q = node.queue()
    fill(node, q, 10)  # under the limit

    def burst() -> list[bytes]:
        for i in range(10, 100):  # past the limit: marked for paging, then consumed
            q.enqueue(message(body(i)))
        return [q.get().message.body for _ in range(100)]  # type: ignore[union-attr]

    assert node.call(burst) == [body(i) for i in range(100)]
    node.sync()
    assert node.broker.memory.pager.paged_out == 0  # type: ignore[union-attr]
    assert q.paged_bytes == 0 and q.ready_bytes == 0


def test_a_message_on_several_queues_keeps_its_body_where_it_is_not_paged(
        node: StoreNode) -> None:
    durable, transient = node.queue("d"), node.queue("t", durable=False)
    messages = [message(body(i)) for i in range(100)]
    for first in range(0, 100, 20):
        def route(f: int = first) -> None:
            for m in messages[f:f + 20]:
                durable.enqueue(m)
                transient.enqueue(m)
        node.call(route)
        settle(node)
    assert any(e.paged == PAGED for e in durable.ready)
    assert all(e.message.body is not None for e in transient.ready)
    assert [e.message.body for e in transient.ready] == [body(i) for i in range(100)]
    assert drain(node, durable) == [body(i) for i in range(100)]


def test_dead_lettered_paged_entries_keep_their_bodies(store_url: str) -> None:
    n = StoreNode(store_url, limits=Limits(queue_max_memory=LIMIT))
    try:
        n.vhost.declare_exchange("dlx", "fanout", durable=True)
        dead = n.queue("dead")
        n.vhost.bind("dlx", dead, "")
        q = n.vhost.declare_queue("src", owner=None, durable=True,
                                  arguments={"x-dead-letter-exchange": "dlx"})
        fill(n, q, 100)
        assert n.call(q.purge) == 100  # purge does not dead-letter
        fill(n, q, 100, start=100)
        n.call(lambda: q.expire(float("inf")))  # nothing expires without a TTL
        entries = []
        while (e := n.call(q.get)) is not None:
            entries.append(e)
        n.call(lambda: [q.reject(e) for e in entries])
        n.sync()
        assert drain(n, dead) == [body(i) for i in range(100, 200)]
    finally:
        n.close()


def test_a_restarted_queue_pages_what_it_recovers(store_url: str) -> None:
    n = StoreNode(store_url, limits=Limits(queue_max_memory=LIMIT))
    q = n.queue()
    fill(n, q, 300)
    n.close()
    n = StoreNode(store_url, limits=Limits(queue_max_memory=LIMIT))
    try:
        q = n.vhost.queues["q"]
        assert len(q.ready) == 300
        assert resident(q) <= LIMIT + SIZE
        assert n.broker.memory.used == q.ready_bytes - q.paged_bytes
        assert drain(n, q) == [body(i) for i in range(300)]
    finally:
        n.close()


def test_a_memory_store_never_pages() -> None:
    broker = Broker("t", limits=Limits(queue_max_memory=1024))
    assert broker.memory.pager is None


def test_configuration(tmp_path: Path) -> None:
    cfg = apply_document({"limits": {"queue_max_memory": "64KiB", "node_max_memory": 1 << 30}},
                         NodeConfig())
    assert cfg.limits.queue_max_memory == 64 * 1024
    assert cfg.limits.node_max_memory == 1 << 30
    with pytest.raises(ConfigError):
        apply_document({"limits": {"queue_max_memory": "lots"}},
                       NodeConfig())
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["--queue-max-memory", "64KiB", "--data", str(tmp_path)])
    assert config_from_args(args)[0].limits.queue_max_memory == 64 * 1024
    with pytest.raises(ConfigError):
        config_from_args(parser.parse_args(["--queue-max-memory", "-1"]))


# -- a real node ------------------------------------------------------------------------

COUNT = 2000
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def publish(node: NodeProcess, first: int, count: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.queue_declare("paged", durable=True)
    ch.confirm_delivery()
    for i in range(first, first + count):
        ch.basic_publish("", "paged", body(i), PERSISTENT)
    conn.close()


def test_a_node_with_a_queue_memory_limit_delivers_everything_in_order(tmp_path: Path) -> None:
    args = ["--queue-max-memory", "64KiB"]
    with NodeProcess(data_dir=tmp_path, extra_args=args) as node:
        publish(node, 0, COUNT)
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        ch = conn.channel()
        got = []
        for _ in range(300):  # basic.get
            method, _props, data = ch.basic_get("paged")
            assert method is not None
            got.append(data)
            ch.basic_ack(method.delivery_tag)
        assert got == [body(i) for i in range(300)]
        conn.close()
    with NodeProcess(data_dir=tmp_path, extra_args=args) as node:  # restarted
        publish(node, COUNT, 500)
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        ch = conn.channel()
        ch.basic_qos(prefetch_count=50)
        got = []
        for method, _props, data in ch.consume("paged", inactivity_timeout=10):
            assert method is not None, f"stalled after {len(got)} messages"
            got.append(data)
            ch.basic_ack(method.delivery_tag)
            if len(got) == COUNT + 500 - 300:
                break
        ch.cancel()
        assert got == [body(i) for i in range(300, COUNT + 500)]
        assert ch.queue_declare("paged", durable=True, passive=True).method.message_count == 0
        conn.close()
