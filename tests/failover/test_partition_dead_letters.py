"""Dead letters to another partition's queue on three real nodes running partition groups
(issue 35: clients on any node).

A message dead-lettered on a partition's leader (rejected without requeue, expired by
``x-message-ttl``, dropped from the head by ``x-max-length``) whose dead-letter exchange
routes it to a queue of a partition another node leads reaches that queue: the leader
forwards it (``NodeForwarding.dead_letter``, the publishes' forward path, without a
confirm: at most once, as RabbitMQ's default dead-lettering). Before, it was dropped with
a warning.
"""

from __future__ import annotations

import time

import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    OPTIONS,
    connect,
    depth,
    drained,
    name_in,
    one_leader_each,
    props,
    ready_everywhere,
    until,
)

pytestmark = pytest.mark.timeout(120)




def test_dead_letters_of_one_partition_reach_a_queue_another_node_leads() -> None:
    with LocalCluster(3, options=OPTIONS) as cluster:
        names = cluster.names
        leaders = until("one serving primary per group",
                        lambda: one_leader_each(cluster, names), timeout=60)
        until("every node ready in every group", lambda: ready_everywhere(cluster, names),
              timeout=60)
        b = leaders["1"]  # partition 0's leader: the sources
        other = next((p for p in (1, 2) if leaders[str(p + 1)] != b), None)
        if other is None:
            pytest.skip(f"one node leads every partition: {leaders}")
        t = leaders[str(other + 1)]
        target = name_in(other, "dl-target")
        conn = connect(cluster, t)
        try:
            ch = conn.channel()
            ch.exchange_declare("dlx", "fanout", durable=True)
            ch.queue_declare(target, durable=True)
            ch.queue_bind(target, "dlx")
        finally:
            conn.close()
        dlx = {"x-dead-letter-exchange": "dlx"}
        rejected, expired, bounded = (name_in(0, f"dl-{kind}") for kind in
                                      ("reject", "ttl", "max"))
        conn = connect(cluster, b)
        try:
            ch = conn.channel()
            ch.queue_declare(rejected, durable=True, arguments=dlx)
            ch.queue_declare(expired, durable=True, arguments={**dlx, "x-message-ttl": 200})
            ch.queue_declare(bounded, durable=True, arguments={**dlx, "x-max-length": 1})
            ch.confirm_delivery()
            ch.basic_publish("", rejected, b"r", props(1))
            ch.basic_publish("", expired, b"e", props(2))
            for i in (3, 4, 5):  # 3 and 4 dropped from the head
                ch.basic_publish("", bounded, b"m", props(i))
            method, _properties, _body = ch.basic_get(rejected)
            assert method is not None
            ch.basic_reject(method.delivery_tag, requeue=False)
        finally:
            conn.close()
        started = time.monotonic()
        until("the dead letters on the target's leader",
              lambda: depth(cluster, t, target) >= 4, 20)
        took = time.monotonic() - started
        got = {str(p.message_id): p.headers["x-death"][0] for p, _ in drained(cluster, t,
                                                                             target)}
        assert sorted(got) == ["1", "2", "3", "4"], got
        assert {m: (d["reason"], d["queue"]) for m, d in got.items()} == {
            "1": ("rejected", rejected), "2": ("expired", expired),
            "3": ("maxlen", bounded), "4": ("maxlen", bounded)}
        assert depth(cluster, b, bounded) == 1
        forwarding = (cluster.status(b) or {})["node"]["forwarding"]
        assert forwarding["node"]["dead_letters"] == 4, forwarding
        print(f"4 dead letters of {b}'s partition on {t}'s queue within {took:.2f}s")
