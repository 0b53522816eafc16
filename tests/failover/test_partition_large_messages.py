"""A large message through another node on three real nodes running partition groups
(issue 35: clients on any node).

A body over ``PART_BYTES`` (1 MiB) travels between nodes in parts, as replication's
``bp`` events do: a publish on a node that does not lead the queue's partition goes
to the leader as ``ForwardPart``s then its ``Forward`` (``partition/forward.py``), and
a delivery to a consumer on another node as ``DeliverPart``s then its ``Deliver`` or
``GetReply`` (``partition/remote_consumer.py``), so no link packet comes near its
64 MiB limit and a client on any node publishes up to the broker's
``max_message_size`` (128 MiB), as on a single node.
"""

from __future__ import annotations

import hashlib
import os
import time

import pika
import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    OPTIONS,
    connect,
    name_in,
    one_leader_each,
    props,
    ready_everywhere,
    until,
)

pytestmark = pytest.mark.timeout(180)

MIB = 1024 * 1024
# a 60 MiB body is copied a few times on each node (the client's frames, the parts, the
# store, two backups): on the shared 2 cores at load 20 a loop turn of those took up to
# 0.7 s, so the leases are those of a slower network than FAST's (0.6 s)
SLOW = {**OPTIONS, "heartbeat_interval": 0.2, "lease_timeout": 2.0, "election_timeout": 3.0,
        "backup_timeout": 6.0}


@pytest.mark.parametrize("mib", [3, pytest.param(60, marks=pytest.mark.slow)])
def test_a_large_message_published_on_a_non_leader_is_consumed_whole_anywhere(
        mib: int) -> None:
    """Two messages of ``mib`` MiB (and a byte) published with confirms on A, the queue's
    partition led by B: both confirmed; the first taken whole on B (the leader), the
    second consumed whole by a consumer on C (a remote consumer: delivered in parts over
    the link B -> C). 3 MiB in the default run (4 parts each), 60 MiB under ``-m slow``
    (39-52 s)."""
    size = mib * MIB
    parts = mib + 1  # of 1 MiB
    with LocalCluster(3, options=SLOW) as cluster:
        names = cluster.names
        leaders = until("one serving primary per group",
                        lambda: one_leader_each(cluster, names), timeout=60)
        until("every node ready in every group", lambda: ready_everywhere(cluster, names),
              timeout=60)
        b = leaders["1"]  # partition 0's leader; A and C the two others, each leading a
        a, c = sorted(n for n in names if n != b)  # group (a node leading none relays
        if not {a, c} <= set(leaders.values()):  # its clients to the metadata primary)
            pytest.skip(f"a node other than partition 0's leader leads nothing: {leaders}")
        queue = name_in(0, f"big-{b}")
        conn = connect(cluster, b)
        try:
            conn.channel().queue_declare(queue, durable=True)
        finally:
            conn.close()
        bodies = [os.urandom(1024) * (size // 1024) + bytes([i]) for i in range(2)]
        digests = [hashlib.sha256(body).hexdigest() for body in bodies]
        conn = connect(cluster, a)
        try:
            ch = conn.channel()
            ch.confirm_delivery()  # each publish waits for its ack (raises on a nack)
            started = time.monotonic()
            for i, body in enumerate(bodies):
                ch.basic_publish("", queue, body, props(i), mandatory=True)
            published = time.monotonic() - started
        finally:
            conn.close()
        forwarding = (cluster.status(a) or {})["node"]["forwarding"]
        assert forwarding["sender"]["acks"] == 2 and forwarding["sender"]["nacks"] == 0
        # (more, if a failover had them sent again)
        assert forwarding["sender"]["parts"] >= 2 * parts, forwarding

        conn = connect(cluster, b)  # the leader: its own queue
        try:
            method, properties, body = conn.channel().basic_get(queue, auto_ack=True)
        finally:
            conn.close()
        assert method is not None and properties.message_id == "0"
        assert hashlib.sha256(body).hexdigest() == digests[0] and len(body) == size + 1

        conn = connect(cluster, c)  # a third node: a remote consumer, B delivering in parts
        got: list[tuple[str, bytes, bool]] = []
        try:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=1)

            def on_message(channel: pika.adapters.blocking_connection.BlockingChannel,
                           method: pika.spec.Basic.Deliver, properties: pika.BasicProperties,
                           body: bytes) -> None:
                got.append((str(properties.message_id), body, bool(method.redelivered)))
                channel.basic_ack(method.delivery_tag)

            ch.basic_consume(queue, on_message)
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                conn.process_data_events(time_limit=0.2)
            consumed = time.monotonic() - started - published
        finally:
            conn.close()
        assert len(got) == 1, f"the {mib} MiB message not delivered to the consumer on C"
        message_id, body, redelivered = got[0]
        assert message_id == "1" and not redelivered
        assert hashlib.sha256(body).hexdigest() == digests[1] and len(body) == size + 1
        consuming = (cluster.status(c) or {})["node"]["consuming"]
        assert consuming["proxy"]["parts"] >= parts, consuming
        conn = connect(cluster, b)
        try:
            depth = conn.channel().queue_declare(queue, passive=True).method.message_count
        finally:
            conn.close()
        assert depth == 0
        print(f"2 x {mib} MiB published on {a} to {b}'s queue, confirmed in {published:.2f}s; "
              f"one taken on {b}, one consumed on {c} ({consumed:.2f}s after); "
              f"parts sent {forwarding['sender']['parts']} (retries "
              f"{forwarding['sender']['retries']}); load {os.getloadavg()[0]:.1f}")
