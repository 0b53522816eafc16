"""The lists of a node outside a partition (issue 35 task I item 2; docs/ha.md "Routing on
a node outside a partition: the queue directory"): four real nodes, P = 4, NR = 2 (the
layout of test_partition_directory.py). Such a node holds a stand-in per queue of the
partition it has no cell of (no messages, no consumer); ``/api/queues``,
``/api/bindings``, ``ctl queues``, ``ctl status`` and ``/metrics`` asked there must show
each queue once, with its leader's figures, never the stand-in's zeros."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pika
import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    FOUR_OPTIONS,
    connect,
    ctl,
    outside_a_partition,
    props,
    queue_in,
)
from tests.management_http import call

pytestmark = pytest.mark.timeout(150)

N = 7
EXCHANGE = "lists-x"


def ctl_json(cluster: LocalCluster, node: str, *args: str) -> Any:
    return json.loads(ctl(cluster, node, *args, "--json"))


def metrics(cluster: LocalCluster, node: str) -> str:
    with urllib.request.urlopen(cluster.admin_url(node) + "/metrics", timeout=30) as r:
        return str(r.read().decode())


def test_a_node_outside_a_partition_lists_its_queues_as_their_leader() -> None:
    started = time.monotonic()
    with LocalCluster(4, options=FOUR_OPTIONS) as cluster:
        names = cluster.names
        lead, cells, x, p, leader = outside_a_partition(cluster)
        queue = queue_in(p, "lists")
        conn = connect(cluster, x)
        try:
            ch = conn.channel()
            ch.queue_declare(queue, durable=True)
            ch.exchange_declare(EXCHANGE, "direct", durable=True)
            ch.queue_bind(queue, EXCHANGE, routing_key="k")
            ch.confirm_delivery()
            for i in range(N):
                ch.basic_publish("", queue, b"m%d" % i, props(i), mandatory=True)
        finally:
            if conn.is_open:
                conn.close()
        # an exclusive queue of a connection on another node: a stand-in on X too (405)
        owner = next(n for n in names if n != x)
        holder = connect(cluster, owner)
        exclusive = f"lists-ex-{p}"
        holder.channel().queue_declare(exclusive, exclusive=True)
        status = (cluster.status(x) or {}).get("node", {}).get("directory") or {}
        assert status.get("stand_ins", 0) >= 2, status
        seen: dict[str, Any] = {}

        # the management API (RabbitMQ's format)
        code, listed = call(cluster.admin_url(x) + "/api/", "GET", "queues/%2F")
        assert code == 200
        mine = [q for q in listed if q["name"] == queue]
        seen["/api/queues"] = mine
        code, bindings = call(cluster.admin_url(x) + "/api/", "GET", "bindings/%2F")
        assert code == 200
        seen["/api/bindings"] = [b for b in bindings if b["destination"] == queue]
        # ctl queues asked of X itself, and as ctl asks (the serving node)
        here = ctl_json(cluster, x, "queues", "--here")
        seen["ctl queues --here"] = [q for q in here["queues"] if q["name"] == queue]
        served = ctl_json(cluster, x, "queues")
        seen["ctl queues"] = [q for q in served["queues"] if q["name"] == queue]
        st = ctl_json(cluster, x, "status")  # (lists no queue: the directory's counts)
        seen["ctl status"] = [k for k in json.dumps(st).split('"') if k == queue]
        code, view = call(cluster.admin_url(x) + "/api/", "GET", "cluster")  # queues listed
        seen["/api/cluster"] = [q for q in view.get("queues") or [] if q["name"] == queue]
        text = metrics(cluster, x)
        seen["/metrics"] = [line for line in text.splitlines()
                            if f'queue="{queue}"' in line
                            and line.startswith("brokerha_queue_messages_ready")]
        code, listed_ex = call(cluster.admin_url(x) + "/api/", "GET", "queues/%2F")
        ex_entries = [q for q in listed_ex if q["name"] == exclusive]
        ex_here = [q for q in ctl_json(cluster, x, "queues", "--here")["queues"]
                   if q["name"] == exclusive]
        ex_metrics = [line for line in metrics(cluster, x).splitlines()
                      if f'queue="{exclusive}"' in line]
        asker = connect(cluster, x)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as locked:
            asker.channel().queue_declare(exclusive, passive=True)
        asker.close()
        holder.close()
        assert locked.value.reply_code == 405, locked.value
        assert len(ex_entries) == 1 and ex_entries[0]["exclusive"], ex_entries
        assert ex_entries[0]["node"] == f"brokerha@{owner}", ex_entries
        assert len(ex_here) == 1 and ex_here[0]["exclusive"], ex_here  # the owner's
        assert ex_metrics == [], ex_metrics
        print(f"\nX={x} outside partition {p}, leader {leader}:")
        for k, v in seen.items():
            print(f"  {k}: {json.dumps(v)[:400]}")
        assert len(mine) == 1 and mine[0]["messages"] == N, mine
        assert len(seen["/api/bindings"]) == 2, seen["/api/bindings"]  # default + lists-x
        assert len(seen["ctl queues"]) == 1 and seen["ctl queues"][0]["messages_ready"] == N
        assert seen["ctl status"] == []
        assert len(seen["/api/cluster"]) == 1 and seen["/api/cluster"][0]["messages_ready"] == N
        here = seen["ctl queues --here"]  # X's own list: as its leader lists it
        assert len(here) == 1 and here[0]["messages_ready"] == N, here
        assert seen["/metrics"] == []  # X's metrics: its own queues (the leader reports it)
        # every node's /metrics: the leader's and its copies' figures (no stand-in's 0)
        every = [line for n in names for line in metrics(cluster, n).splitlines()
                 if line.startswith(f'brokerha_queue_messages_ready{{queue="{queue}"')]
        assert every and all(line.endswith(f" {float(N)}") for line in every), every
    print(f"{time.monotonic() - started:.1f} s")
