"""A client on a node holding no cell of a queue's partition (issue 35's queue directory,
not built: docs/ha.md "Declarations"), on four real nodes (P = 4, NR = 2: every
partition on three of the four, each node outside one partition).

Such a node does not know the partition's queues nor their bindings (they live in the
partition's own log), so it fails closed: a publish it cannot route completely -- to the
default exchange naming a queue it does not hold, or to any exchange but the default
one -- closes the connection with 540 NOT_IMPLEMENTED naming the limitation, before
anything is enqueued or confirmed (it used to be confirmed and dropped: 650-995 confirmed,
0 on the leader, in the drain helper's run). The queue's declaration and binding from
that node go to the partition's leader (partition/declarations.py). A client on a cell of
the partition publishes to the same queue (through forwarding): every confirmed message
is on the leader.
"""

from __future__ import annotations

import time

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, ConnectionClosedByBroker

from brokerha.testing import LocalCluster
from tests.failover.groups import connect, drain_ids, props, until
from tests.failover.test_partition_drain import (
    DRAIN_OPTIONS,
    P,
    leaders,
    queue_in,
    settled,
    table,
)

pytestmark = pytest.mark.timeout(150)

N = 20
EXCHANGE = "directory-x"


def refused(ch: pika.adapters.blocking_connection.BlockingChannel, exchange: str,
            key: str) -> tuple[int, ConnectionClosedByBroker]:
    """Publish up to N with confirms until the broker closes the connection (540 is a
    connection error in AMQP 0-9-1, as RabbitMQ): (how many were confirmed before, the
    close)."""
    confirmed = 0
    try:
        for i in range(N):
            ch.basic_publish(exchange, key, b"m%d" % i, props(i))
            confirmed += 1
    except ConnectionClosedByBroker as exc:
        return confirmed, exc
    raise AssertionError(f"{confirmed} publishes to {exchange!r}/{key} confirmed, none refused")


def test_a_node_outside_a_partition_refuses_what_it_cannot_route() -> None:
    started = time.monotonic()
    with LocalCluster(4, options=DRAIN_OPTIONS) as cluster:
        names = cluster.names
        until("one serving leader per group, every node ready",
              lambda: settled(cluster, names), timeout=60)
        lead = leaders(cluster, names)
        assert lead is not None
        rows = table(cluster, lead["0"][0])["rows"]
        cells = {r["partition"]: [c[0] for c in r["cells"]] for r in rows}
        assert all(len(c) == 3 for c in cells.values()), cells
        # X: a node outside partition p's cells
        x, p = next((n, q) for q in range(P) for n in names if n not in cells[q])
        queue = queue_in(p, "directory")
        leader = lead[str(p + 1)][0]

        conn = connect(cluster, x)
        try:
            ch = conn.channel()  # declared and bound from X: carried to p's leader
            ch.queue_declare(queue, durable=True)
            ch.exchange_declare(EXCHANGE, "direct", durable=True)
            ch.queue_bind(queue, EXCHANGE, routing_key="k")
            ch.confirm_delivery()
            confirmed, closed = refused(ch, "", queue)  # the default exchange
            assert confirmed == 0
            assert closed.reply_code == 540, closed
            assert f"holds no cell of partition {p}" in closed.reply_text, closed
            assert "default exchange" in closed.reply_text, closed
        finally:
            if conn.is_open:
                conn.close()
        conn = connect(cluster, x)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            confirmed, closed = refused(ch, EXCHANGE, "k")  # a direct exchange's binding
            assert confirmed == 0
            assert closed.reply_code == 540, closed
            assert f"exchange '{EXCHANGE}'" in closed.reply_text, closed
        finally:
            if conn.is_open:
                conn.close()

        conn = connect(cluster, x)  # known, left: no copy here to consume through
        try:
            with pytest.raises(ChannelClosedByBroker) as gone:
                conn.channel().basic_get(queue)
            assert gone.value.reply_code == 404, gone.value
        finally:
            if conn.is_open:
                conn.close()

        # a client on a cell of p (not its leader): its publishes forwarded to the leader
        y = next(n for n in cells[p] if n != leader)
        conn = connect(cluster, y)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            for i in range(N):
                ch.basic_publish("", queue, b"m%d" % i, props(i))  # raises if nacked
            y_holds_all = all(y in cells[q] for q in range(P))
            if y_holds_all:  # it knows every binding: the exchange publish is routed
                for i in range(N, 2 * N):
                    ch.basic_publish(EXCHANGE, "k", b"m%d" % i, props(i))
            else:
                confirmed, closed = refused(ch, EXCHANGE, "k")
                assert confirmed == 0 and closed.reply_code == 540, closed
        finally:
            if conn.is_open:
                conn.close()
        expected = [str(i) for i in range(2 * N if y_holds_all else N)]
        got = drain_ids(cluster, leader, queue)
        assert got == expected, (len(got), got[:5])
    print(f"\n4 nodes, P = {P}: X={x} outside partition {p} refused (540), {y} forwarded "
          f"{len(expected)} to {leader}; {time.monotonic() - started:.1f} s")
