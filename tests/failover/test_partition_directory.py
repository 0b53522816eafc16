"""A client on a node holding no cell of a queue's partition (issue 35's queue directory:
docs/ha.md "Routing on a node outside a partition: the queue directory"), on four real
nodes (P = 4, NR = 2: every partition on three of the four, each node outside one).

Such a node holds neither the partition's queues nor the bindings to them (they live in
the partition's own log); it routes to them by the directory the metadata group keeps
(partition/directory.py): a stand-in per queue, bound as on the leader, forwarded to by
``x-ha-id``. (1) A client there declares q and binds it to a direct exchange (carried to
q's leader, answered once the directory and this node's copy of it hold them), publishes
with confirms and ``mandatory`` to the default exchange and through the binding: all
confirmed, none returned, all on the leader, then consumed (basic.consume, then
basic.get) from that node, in order.
(2) The coordinator (the metadata group's leader, which appends the directory's changes)
SIGKILLed while clients on two other nodes declare queues in a stream: every queue
answered ok is routable afterwards from every node left (a publish with confirms and
``mandatory`` to each, on each node, confirmed and not returned).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    FOUR_OPTIONS,
    P4,
    DeclaringStreams,
    cells_of,
    connect,
    depth,
    drain_ids,
    outside_a_partition,
    props,
    queue_in,
    settled_leaders,
    until,
)

pytestmark = pytest.mark.timeout(150)

N = 20
EXCHANGE = "directory-x"


def test_a_node_outside_a_partition_routes_by_the_directory() -> None:
    started = time.monotonic()
    with LocalCluster(4, options=FOUR_OPTIONS) as cluster:
        # X: a node outside partition p's cells that leads some group
        lead, cells, x, p, leader = outside_a_partition(cluster)
        assert all(len(c) == 3 for c in cells.values()), cells
        queue = queue_in(p, "directory")

        conn = connect(cluster, x)
        try:
            ch = conn.channel()  # declared and bound from X: carried to p's leader
            ch.queue_declare(queue, durable=True)
            ch.exchange_declare(EXCHANGE, "direct", durable=True)
            ch.queue_bind(queue, EXCHANGE, routing_key="k")
            ch.confirm_delivery()
            for i in range(N):  # the default exchange; raises if nacked or returned
                ch.basic_publish("", queue, b"m%d" % i, props(i), mandatory=True)
            for i in range(N, 2 * N):  # the direct exchange's binding
                ch.basic_publish(EXCHANGE, "k", b"m%d" % i, props(i), mandatory=True)
        finally:
            if conn.is_open:
                conn.close()
        assert depth(cluster, leader, queue) == 2 * N  # every one on the leader
        conn = connect(cluster, x)  # consumed from X (basic.consume): attached to the leader
        try:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=5)
            consumed: list[str] = []
            for method, properties, _body in ch.consume(queue, inactivity_timeout=10):
                assert method is not None, f"nothing delivered after {consumed}"
                consumed.append(str(properties.message_id))
                ch.basic_ack(method.delivery_tag)
                if len(consumed) == N:
                    break
            ch.cancel()
        finally:
            if conn.is_open:
                conn.close()
        got = consumed + drain_ids(cluster, x, queue)  # and the rest got from X
        assert got == [str(i) for i in range(2 * N)], (len(got), got[:5])
        status = (cluster.status(x) or {}).get("node", {}).get("directory") or {}
        assert status.get("synced") == list(range(P4)), status
        assert status.get("stand_ins", 0) >= 1, status
    print(f"\n4 nodes, P = {P4}: X={x} outside partition {p}: {2 * N} confirmed through the "
          f"directory, on {leader}, consumed from {x}; {time.monotonic() - started:.1f} s")


def test_coordinator_killed_while_declaring_every_queue_answered_ok_routes_everywhere(
        ) -> None:
    started = time.monotonic()
    with LocalCluster(4, options=FOUR_OPTIONS) as cluster:
        names = cluster.names
        lead = settled_leaders(cluster)
        a = lead["0"][0]  # the coordinator
        streams = [n for n in names if n != a][:2]
        acked: list[str] = []

        def declare(ch: Any, node: str, i: int) -> None:
            name = f"kd-{node}-{i}"
            ch.queue_declare(name, durable=True)
            acked.append(name)

        declaring = DeclaringStreams(cluster, streams, declare)
        until("declarations under way", lambda: len(acked) >= 20, timeout=30)
        before = len(acked)
        cluster.kill(a)
        until("declarations answered after the kill", lambda: len(acked) >= before + 30,
              timeout=60)
        declaring.stop()
        alive = [n for n in names if n != a]
        until("a serving leader of every group again", lambda: all(
            any(((cluster.status(n) or {}).get("node", {}).get("groups") or {})
                .get(str(g), {}).get("serving") for n in alive) for g in range(P4 + 1)),
              timeout=40)
        # every queue answered ok routes from every node left: confirmed, not returned
        for node in alive:
            conn = connect(cluster, node)
            try:
                ch = conn.channel()
                ch.confirm_delivery()
                for i, name in enumerate(acked):
                    ch.basic_publish("", name, b"r", props(i), mandatory=True)
            finally:
                if conn.is_open:
                    conn.close()
        outside = {n: [p for p, c in cells_of(cluster, alive[0]).items() if n not in c]
                   for n in alive}
    print(f"\n4 nodes, P = {P4}: coordinator {a} killed; {len(acked)} declared ok "
          f"({before} before), {len(declaring.closed)} connections closed "
          f"{declaring.closed[:2]}; each routed "
          f"from {alive} (outside partitions {outside}); {time.monotonic() - started:.1f} s")
