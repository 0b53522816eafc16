"""Declarations from any node of three real nodes running partition groups (issue 35 stage
3's declarations, ``partition/declarations.py``).

P = 3 over 3 nodes, each partition led by its preferred node (one a node): A leads the
metadata group (the coordinator) and one partition, B and C one partition each. A
client on a node that does not serve a queue's partition (or, for an exchange, the
metadata group) declares, binds, purges and deletes all the same: its node asks the
group's leader, which answers once durable; the client's node answers once its own copy
holds it (read-your-writes). Errors carry the leader's code and text, the ones the
leader gives its own clients.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pika
import pika.exceptions
import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    OPTIONS,
    DeclaringStreams,
    connect,
    drain_ids,
    name_in,
    promote,
    props,
    ready_everywhere,
    until,
)

pytestmark = pytest.mark.timeout(120)


def serving_leaders(cluster: LocalCluster, groups: list[str]) -> dict[str, str] | None:
    """Group -> the one node serving it, once each of ``groups`` has exactly one."""
    serving: dict[str, list[str]] = {g: [] for g in groups}
    for name in cluster.names:
        status = cluster.status(name) or {}
        for group, g in (status.get("node", {}).get("groups") or {}).items():
            if g["serving"] and group in serving:
                serving[group].append(name)
    if all(len(nodes) == 1 for nodes in serving.values()):
        return {g: nodes[0] for g, nodes in serving.items()}
    return None


def every_node_leads(cluster: LocalCluster, partitions: int) -> dict[str, str]:
    """The groups' leaders once every node leads a partition: a node that leads none relays
    its clients to the metadata primary (node/relay.py), so a client "on" it would be on
    the coordinator. Under load the preferred leaders do not always win their first
    election: a partition of a node leading several is handed to one leading none."""
    groups = [str(g) for g in range(partitions + 1)]
    for _ in range(6):
        leaders = until("one serving primary per group",
                        lambda: serving_leaders(cluster, groups), timeout=40)
        led = {n: [int(g) - 1 for g, v in leaders.items() if g != "0" and v == n]
               for n in cluster.names}
        idle = [n for n, ps in led.items() if not ps]
        if not idle:
            return leaders
        busiest = max(led, key=lambda n: len(led[n]))
        promote(cluster, busiest, idle[0], led[busiest][-1])
        time.sleep(1.0)
    raise AssertionError(f"a node leads no partition: {leaders}")


class Layout:
    """A the coordinator (the metadata group's leader), C and B the two other nodes, every
    node leading a partition (``every_node_leads``), and ``partition`` one that C does
    not lead (B's)."""

    def __init__(self, cluster: LocalCluster) -> None:
        names = cluster.names
        leaders = every_node_leads(cluster, 3)
        until("every node ready in every group", lambda: ready_everywhere(cluster, names),
              timeout=30)
        self.leaders = leaders
        self.a = leaders["0"]
        others = [n for n in names if n != self.a]
        led = {n: [p for p in range(3) if leaders[str(p + 1)] == n] for n in names}
        # C: a node other than A that does not lead every partition A does not
        self.c, self.b = sorted(others, key=lambda n: len(led[n]))
        self.partition = (led[self.b] or led[self.a])[0]
        self.leader = leaders[str(self.partition + 1)]
        self.led = led


def closed_with(fn: Any) -> tuple[int, str]:
    """The channel error ``fn`` ends in: (code, text)."""
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        fn()
    return caught.value.reply_code, caught.value.reply_text


def test_declare_bind_publish_consume_across_three_nodes() -> None:
    """The queue declared on C (B leads its partition), the exchange on B (A is the
    coordinator), the binding on C, published with confirms on A, consumed on C; then
    the errors on C are the leader's: 406, 404, and 405 of another connection's
    exclusive queue; purge and delete on C, answered with the leader's counts."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout = Layout(cluster)
        a, b, c, leader = layout.a, layout.b, layout.c, layout.leader
        queue = name_in(layout.partition, "decl")
        on_c = connect(cluster, c)
        on_b = connect(cluster, b)
        on_a = connect(cluster, a)
        try:
            ch_c, ch_b, ch_a = on_c.channel(), on_b.channel(), on_a.channel()
            ok = ch_c.queue_declare(queue, durable=True).method
            assert (ok.queue, ok.message_count, ok.consumer_count) == (queue, 0, 0)
            ch_b.exchange_declare("decl-x", "direct", durable=True)
            ch_c.queue_bind(queue, "decl-x", routing_key="k")
            ch_a.confirm_delivery()
            for i in range(50):  # every one routed (mandatory) and confirmed
                ch_a.basic_publish("decl-x", "k", b"x", props(i), mandatory=True)
            # the leader's count, answered on C
            assert until("50 on the queue", lambda: ch_c.queue_declare(
                queue, passive=True).method.message_count == 50)
            got = []
            for _ in range(50):
                method, _props, _body = ch_c.basic_get(queue)
                assert method is not None
                got.append(_props.message_id)
                ch_c.basic_ack(method.delivery_tag)
            assert got == [str(i) for i in range(50)]

            # errors: the leader's code and text, as on the leader itself
            on_c_err = connect(cluster, c)
            code_c = closed_with(lambda: on_c_err.channel().queue_declare(queue,
                                                                          durable=False))
            on_l = connect(cluster, leader)
            code_b = closed_with(lambda: on_l.channel().queue_declare(queue, durable=False))
            assert code_c == code_b and code_c[0] == 406, (code_c, code_b)
            missing = name_in(layout.partition, "missing")
            code_c = closed_with(lambda: on_c_err.channel().queue_declare(missing,
                                                                          passive=True))
            code_b = closed_with(lambda: on_l.channel().queue_declare(missing, passive=True))
            assert code_c == code_b and code_c[0] == 404, (code_c, code_b)
            code_c = closed_with(lambda: on_c_err.channel().queue_bind(queue, "no-such-x"))
            code_b = closed_with(lambda: on_l.channel().queue_bind(queue, "no-such-x"))
            on_l.close()
            assert code_c == code_b and code_c[0] == 404, (code_c, code_b)
            # an exclusive queue lives on the declaring node: 405 for another connection
            ch_c.queue_declare("decl-excl", exclusive=True)
            code_c = closed_with(lambda: on_c_err.channel().queue_declare("decl-excl"))
            assert code_c[0] == 405 and "RESOURCE_LOCKED" in code_c[1], code_c
            on_c_err.close()

            # purge and delete from C: the leader's counts
            for i in range(7):
                ch_a.basic_publish("", queue, b"y", props(i))
            assert ch_c.queue_purge(queue).method.message_count == 7
            ch_a.basic_publish("", queue, b"z", props(99))
            code_c = closed_with(lambda: on_c.channel().queue_delete(queue, if_empty=True))
            assert code_c[0] == 406, code_c
            ch_c = on_c.channel()
            other = name_in(layout.partition, "decl-other")
            ch_c.queue_declare(other, durable=True)
            assert ch_c.queue_delete(queue).method.message_count == 1
            assert not any(exists(cluster, n, "queue", queue) for n in (a, b, c))
            # the management API's queue objects: partition and leader
            objects = {q["name"]: q for q in api_get(cluster, a, "/api/queues")}
            assert objects[other]["partition"] == layout.partition
            assert objects[other]["leader"] == leader
            # the management API (answered by A) declares, binds, purges and deletes a queue
            # of a partition another node leads through that leader, as the AMQP methods
            elsewhere = [p for p in range(3) if layout.leaders[str(p + 1)] != a]
            if elsewhere:
                api_q = name_in(elsewhere[0], "decl-api")
                q_path = f"/api/queues/%2F/{api_q}"
                assert api(cluster, c, "PUT", q_path, {"durable": True}) == (201, "")
                assert api(cluster, b, "PUT", q_path, {"durable": True}) == (204, "")
                status, reason = api(cluster, a, "PUT", q_path, {"durable": False})
                assert status == 400 and "inequivalent arg 'durable'" in reason, reason
                ch_b.exchange_declare("decl-api-x", "fanout", durable=True)
                assert api(cluster, c, "POST", f"/api/bindings/%2F/e/decl-api-x/q/{api_q}",
                           {"routing_key": ""}) == (201, "")
                ch_a.basic_publish("decl-api-x", "", b"via-api", props(1), mandatory=True)
                assert until("the message on the queue", lambda: ch_c.queue_declare(
                    api_q, passive=True).method.message_count == 1)
                assert api(cluster, b, "DELETE", f"{q_path}/contents") == (204, "")
                assert ch_c.queue_declare(api_q, passive=True).method.message_count == 0
                assert api(cluster, c, "DELETE", q_path) == (204, "")
                assert not exists(cluster, c, "queue", api_q)
                ch_b.exchange_delete("decl-api-x")
                print(f"management API: a queue of partition {elsewhere[0]}, led by "
                      f"{layout.leaders[str(elsewhere[0] + 1)]}, asked of A = {a}")
            ch_b.queue_unbind(queue, "decl-x", routing_key="k")  # idempotent, as RabbitMQ's
            ch_c.exchange_delete("decl-x")
            assert not exists(cluster, a, "exchange", "decl-x")
        finally:
            for conn in (on_a, on_b, on_c):
                if conn.is_open:
                    conn.close()


def api_get(cluster: LocalCluster, node: str, path: str) -> Any:
    request = urllib.request.Request(
        f"{cluster.admin_url(node)}{path}", headers={
            "authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())


def api(cluster: LocalCluster, node: str, method: str, path: str,
        body: Any = None) -> tuple[int, str]:
    """A management API request on ``node`` (answered by the metadata primary): (status,
    the reason of an error)."""
    request = urllib.request.Request(
        f"{cluster.admin_url(node)}{path}", method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": "Basic "
                 + base64.b64encode(b"guest:guest").decode()})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, str(json.loads(exc.read() or b"{}").get("reason"))


def exists(cluster: LocalCluster, node: str, kind: str, name: str) -> bool:
    """A passive declare on ``node`` (a queue's: answered by its partition's leader)."""
    conn = connect(cluster, node)
    try:
        ch = conn.channel()
        if kind == "queue":
            ch.queue_declare(name, passive=True)
        else:
            ch.exchange_declare(name, passive=True)
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404, exc
        return False
    finally:
        if conn.is_open:
            conn.close()


def test_read_your_writes_declare_then_publish_on_a_non_leader() -> None:
    """On C, each of 20 queues of A's and B's partitions declared then published to at
    once through the default exchange with confirms, mandatory: every message routed and
    confirmed, then on its queue (drained on its leader); server-named and passive too."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout = Layout(cluster)
        c = layout.c
        elsewhere = [p for p in range(3) if layout.leaders[str(p + 1)] != c]
        conn = connect(cluster, c)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            names = [(name_in(p, f"ryw{i}"), p) for i in range(10) for p in elsewhere]
            for i, (queue, _p) in enumerate(names):
                ch.queue_declare(queue, durable=True)
                ch.basic_publish("", queue, b"m", props(i), mandatory=True)
            for i, (queue, p) in enumerate(names):
                assert drain_ids(cluster, layout.leaders[str(p + 1)], queue) == [str(i)]
        finally:
            conn.close()


def test_coordinator_killed_during_declarations() -> None:
    """Clients on B and C declare queues of every partition and exchanges in a stream
    while A, the coordinator (and one partition's leader), is SIGKILLed: each declare is
    answered ok or its connection is closed, never declare-ok for what is then missing."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout = Layout(cluster)
        a, b, c = layout.a, layout.b, layout.c
        acked: list[tuple[str, str]] = []  # (kind, name) answered ok

        def declare(ch: Any, node: str, i: int) -> None:
            if i % 4 == 0:
                name = f"kx-{node}-{i}"
                ch.exchange_declare(name, "fanout", durable=True)
                acked.append(("exchange", name))
            else:
                name = f"kq-{node}-{i}"
                ch.queue_declare(name, durable=True)
                acked.append(("queue", name))

        declaring = DeclaringStreams(cluster, [b, c], declare)
        until("declarations under way", lambda: len(acked) >= 40, timeout=30)
        before = len(acked)
        cluster.kill(a)
        until("declarations answered after the kill", lambda: len(acked) >= before + 60,
              timeout=40)
        declaring.stop()
        names = {b, c}
        until("a coordinator again", lambda: any(
            ((cluster.status(n) or {}).get("node", {}).get("groups") or {}).get("0", {})
            .get("serving") for n in names))

        # every queue and exchange declared ok is there, asked on B and on C (a queue's
        # existence answered by its partition's leader, an exchange's by the node's copy)
        until("a leader for every partition", lambda: all(
            leader_known(cluster, names, str(p + 1)) for p in range(3)), timeout=30)
        missing = [(node, kind, name) for node in sorted(names) for kind, name in acked
                   if not exists(cluster, node, kind, name)]
        assert not missing, missing[:10]
        counters = {n: ((cluster.status(n) or {}).get("node", {}).get("declarations") or {})
                    .get("requests") for n in sorted(names)}
        per_node = {n: sum(1 for _k, name in acked if f"-{n}-" in name) for n in (b, c)}
        print(f"leaders before the kill {layout.leaders}, answered ok per node {per_node}")
        print(f"{len(acked)} declarations answered ok ({before} before the kill), "
              f"{len(declaring.closed)} connections closed: {declaring.closed[:4]}; "
              f"requests {counters}")


def leader_known(cluster: LocalCluster, names: set[str], group: str) -> bool:
    return any(((cluster.status(n) or {}).get("node", {}).get("groups") or {})
               .get(group, {}).get("serving") for n in names)


def test_management_queue_objects_without_partition_groups() -> None:
    """One node, no partition groups: ``partition`` None, ``leader`` the node; every other
    field as before."""
    from brokerha.testing import NodeProcess, free_base_port

    with NodeProcess("solo", port=free_base_port(1)) as node:
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        try:
            conn.channel().queue_declare("solo-q", durable=True)
        finally:
            conn.close()
        request = urllib.request.Request(
            f"http://127.0.0.1:{node.port + 10000}/api/queues/%2F/solo-q", headers={
                "authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
        with urllib.request.urlopen(request, timeout=10) as answer:
            q = json.loads(answer.read())
        assert (q["partition"], q["leader"]) == (None, "solo")
        assert (q["name"], q["durable"], q["messages"], q["consumers"]) == ("solo-q", True, 0, 0)
