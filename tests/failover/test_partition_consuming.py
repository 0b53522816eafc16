"""Consumers on any node of three real nodes running partition groups (issue 35 stage 3's
remote consumers, ``partition/consuming.py``).

P = 3 over 3 nodes, each partition led by its preferred node (one a node). A pika
consumer on A (the metadata primary) consumes a queue of the partition B leads: A's
proxy attaches it to B's host, B delivers over the link, A gives its own delivery
tags and carries the acks back. ``basic.get`` from A likewise; a channel closed with
unacked deliveries gives them back to the queue (redelivered). SIGKILL of B while the
consumer on A consumes: the consumer re-attaches to the partition's new leader, every
confirmed message is delivered at least once, and a message confirmed before the kill
that comes again (held unacked at the kill, or acked without the leader's durable
answer) is flagged redelivered.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pika
import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    OPTIONS,
    StreamPublisher,
    connect,
    depth,
    leader,
    name_in,
    one_partition_each,
    props,
    until,
)

pytestmark = pytest.mark.timeout(60)

N = 300


def setup(cluster: LocalCluster) -> tuple[str, str, str, str, str]:
    """A (the metadata primary), B and C (the two other partitions' leaders), B's
    partition's group, and a durable queue of it declared on B."""
    _leaders, a, b, c, by_node = one_partition_each(cluster)
    partition = by_node[b][0]
    queue = name_in(partition, f"rc-{b}")
    conn = connect(cluster, b)
    try:
        conn.channel().queue_declare(queue, durable=True)
    finally:
        conn.close()
    return a, b, c, str(partition + 1), queue


def publish(cluster: LocalCluster, node: str, queue: str, ids: range) -> None:
    conn = connect(cluster, node)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in ids:
            ch.basic_publish("", queue, b"x", props(i))
    finally:
        conn.close()




def test_a_consumer_on_another_node_gets_every_message_once_and_acks_it() -> None:
    with LocalCluster(3, options=OPTIONS) as cluster:
        a, b, c, _group, queue = setup(cluster)
        conn = connect(cluster, a)
        ch = conn.channel()
        ch.basic_qos(prefetch_count=10)
        publisher = StreamPublisher(cluster.url(c), lambda _i: queue)
        publisher.start()
        got: list[str] = []
        flagged = 0
        started = time.monotonic()
        for method, properties, _body in ch.consume(queue, inactivity_timeout=10):
            assert method is not None, f"nothing for 10 s after {len(got)}"
            got.append(str(properties.message_id))
            flagged += method.redelivered
            ch.basic_ack(method.delivery_tag)
            if len(got) == N:
                publisher.finish()
            if publisher.done.is_set() and len(got) >= publisher.next_id:
                break
        ch.cancel()
        elapsed = time.monotonic() - started
        assert publisher.closed is None and not publisher.nacked
        assert sorted(int(m) for m in got) == sorted(publisher.acked), "not exactly once"
        assert not [m for m, n in Counter(got).items() if n > 1]
        assert flagged == 0
        until("the queue empty on its leader", lambda: depth(cluster, b, queue) == 0, 10)
        print(f"{len(got)} consumed on {a} from {b}'s queue in {elapsed:.2f} s")

        # basic.get from A: a message, acked; then get-empty
        publish(cluster, b, queue, range(1000, 1002))
        method, properties, _ = ch.basic_get(queue)
        assert method is not None and properties.message_id == "1000"
        ch.basic_ack(method.delivery_tag)
        method, properties, _ = ch.basic_get(queue, auto_ack=True)
        assert method is not None and properties.message_id == "1001"
        assert ch.basic_get(queue)[0] is None
        until("the gets settled on the leader", lambda: depth(cluster, b, queue) == 0, 10)

        # a channel closed with unacked deliveries: the next consumer has them, flagged
        publish(cluster, c, queue, range(2000, 2010))
        held: list[str] = []
        for method, properties, _body in ch.consume(queue, inactivity_timeout=10):
            assert method is not None
            held.append(str(properties.message_id))
            if len(held) == 5:
                break
        ch.close()
        ch2 = conn.channel()
        again: dict[str, bool] = {}
        for method, properties, _body in ch2.consume(queue, inactivity_timeout=10):
            assert method is not None, f"only {sorted(again)}"
            again[str(properties.message_id)] = bool(method.redelivered)
            ch2.basic_ack(method.delivery_tag)
            if len(again) == 10:
                break
        assert sorted(again) == [str(i) for i in range(2000, 2010)]
        assert all(again[m] for m in held), again
        conn.close()
        until("the queue empty on its leader", lambda: depth(cluster, b, queue) == 0, 10)


class Consumer(threading.Thread):
    """A pika consumer (prefetch 10, manual ack, every 4th delivery acked with
    ``multiple``) recording each delivery's message id and redelivered flag."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.queue = queue
        self.lock = threading.Lock()
        self.deliveries: list[tuple[str, bool]] = []
        self.acked: set[str] = set()
        self.unacked: list[str] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.url))
            ch = conn.channel()
            ch.basic_qos(prefetch_count=10)
            for method, properties, _body in ch.consume(self.queue, inactivity_timeout=0.2):
                if self.stopping.is_set():
                    break
                if method is None:
                    with self.lock:
                        if self.unacked:
                            ch.basic_ack(0, multiple=True)
                            self.acked.update(self.unacked)
                            self.unacked.clear()
                    continue
                with self.lock:
                    m = str(properties.message_id)
                    self.deliveries.append((m, bool(method.redelivered)))
                    self.unacked.append(m)
                    if len(self.unacked) >= 4:
                        ch.basic_ack(method.delivery_tag, multiple=True)
                        self.acked.update(self.unacked)
                        self.unacked.clear()
            conn.close()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            self.error = exc

    def seen(self) -> set[str]:
        with self.lock:
            return {m for m, _ in self.deliveries}


@pytest.mark.parametrize("consumer_on", ["metadata-primary", "third-node"])
def test_the_queue_s_leader_killed_mid_consume(consumer_on: str) -> None:
    """The consumer on A (the metadata primary, the publisher on C) or on C (the
    publisher on A): with the new leader the other survivor, the re-attach goes over a
    link; with the consumer's own node, to its host in process."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        a, b, c, group, queue = setup(cluster)
        if consumer_on == "third-node":
            a, c = c, a
        consumer = Consumer(cluster.url(a), queue)
        consumer.start()
        publisher = StreamPublisher(cluster.url(c), lambda _i: queue)
        publisher.start()
        until("a few consumed", lambda: len(consumer.seen()) >= 300)
        with consumer.lock:  # what the consumer holds unacked at the kill
            held = list(consumer.unacked)
            confirmed_before = {str(i) for i in list(publisher.acked)}
            cluster.kill(b)
        survivors = [a, c]
        new = until("the partition elects among the survivors",
                    lambda: leader(cluster, survivors, group))
        at_failover = len(publisher.acked)
        until("confirms again after the failover",
              lambda: len(publisher.acked) >= at_failover + 300, 30)
        publisher.finish()
        assert publisher.closed is None and not publisher.nacked
        confirmed = {str(i) for i in publisher.acked}
        until("every confirmed message consumed", lambda: confirmed <= consumer.seen(), 20)
        consumer.stopping.set()
        consumer.join(5)
        assert consumer.error is None, repr(consumer.error)
        with consumer.lock:
            deliveries = list(consumer.deliveries)
        counts = Counter(m for m, _ in deliveries)
        later: dict[str, list[bool]] = {}
        for m, flag in deliveries:
            later.setdefault(m, []).append(flag)
        for m in held:
            assert len(later[m]) >= 2 and all(later[m][1:]), (m, later[m])
        again = [m for m, n in counts.items() if n > 1]
        flagged = sum(1 for m in again if all(later[m][1:]))
        # a message confirmed before the kill and delivered again (held unacked at the kill,
        # or acked and not answered Settled by the killed leader) is named by the re-attach:
        # flagged. One not confirmed yet may have been delivered by B before its enqueue
        # was replicated: the publisher's node forwards it again to the new leader, which
        # enqueues it anew (another position), a first delivery there, unflagged
        unflagged = {m: later[m] for m in again if not all(later[m][1:])}
        assert not set(unflagged) & confirmed_before, unflagged
        print(f"killed {b} after {len(deliveries)} deliveries; new leader {new} (the "
              f"consumer's node {a}); "
              f"{len(confirmed)} confirmed, {len(counts)} distinct delivered, "
              f"{len(again)} delivered again ({flagged} flagged; unflagged, not confirmed "
              f"at the kill: {len(unflagged)}), held at the kill {len(held)}")
