"""Definitions export and import on three real nodes running partition groups (issue 35,
docs/ha.md "Definitions on a partitioned cluster"): P = 9, every node leading some
partitions. The export (``GET /api/definitions``, ``brokerha ctl export_definitions``)
from any node lists every partition's queues and bindings in RabbitMQ's format; the
import (``POST /api/definitions``, ``rabbitmqadmin import``, ``brokerha ctl
import_definitions``) on any node declares each queue through its partition's leader and
answers once every item is durable where it belongs; its errors are the unpartitioned
import's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import pika
import pytest

from brokerha.admin.definitions_file import QUEUE_FIELDS
from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster, NodeProcess, free_base_port, get_json
from tests.failover.groups import (
    FOUR_OPTIONS,
    P4,
    cells_of,
    connect,
    leaders,
    queue_in,
    settled_leaders,
    until,
)
from tests.failover.test_failover import FAST
from tests.failover.test_partition_declarations import every_node_leads
from tests.management_http import call

pytestmark = pytest.mark.timeout(120)

P = 9
OPTIONS: dict[str, float | str | bool] = {**FAST, "partitions": P, "partition_groups": True}
RABBITMQADMIN = shutil.which("rabbitmqadmin")


def api(cluster: LocalCluster, node: str, method: str, path: str,
        body: Any = None) -> tuple[int, Any]:
    return call(cluster.admin_url(node) + "/api/", method, path, body=body)


def queue_names(prefix: str, per_partition: int = 2) -> list[str]:
    """``per_partition`` names hashing into each of the P partitions (vhost /)."""
    out: list[str] = []
    for p in range(P):
        out += [n for n in (f"{prefix}-{i}" for i in range(2000))
                if hash_partition("/", n, P) == p][:per_partition]
    return out


def ready(cluster: LocalCluster) -> dict[str, str]:
    """Group -> its leader, once every node leads a partition and is ready in every group."""
    leaders = every_node_leads(cluster, P)

    def all_ready() -> bool:
        for name in cluster.names:
            groups = (cluster.status(name) or {}).get("node", {}).get("groups") or {}
            if len(groups) != P + 1 or not all(g["ready"] for g in groups.values()):
                return False
        return True

    until("every node ready in every group", all_ready, timeout=40)
    return leaders


def make(cluster: LocalCluster, node: str, names: list[str]) -> None:
    """Exchanges, the queues (one placed by ``x-partition``, one with more arguments), each
    bound to the topic exchange, and an exchange-to-exchange binding, declared on ``node``."""
    conn = connect(cluster, node)
    try:
        ch = conn.channel()
        ch.exchange_declare("defs-x", "topic", durable=True)
        ch.exchange_declare("defs-fan", "fanout", durable=True)
        ch.exchange_bind("defs-fan", "defs-x", routing_key="all.#")
        for i, name in enumerate(names):
            arguments: dict[str, Any] = {"x-max-length": 1000} if i == 1 else {}
            if i == 0:
                arguments = {"x-partition": 4}
            ch.queue_declare(name, durable=True, arguments=arguments)
            ch.queue_bind(name, "defs-x", routing_key=f"k.{name}")
        ch.queue_bind(names[-1], "defs-fan")
    finally:
        conn.close()


def mine(export: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The export's queues, exchanges and bindings of this test (``prefix``), sorted."""
    def sort(entries: list[dict[str, Any]]) -> list[str]:
        return sorted(json.dumps(e, sort_keys=True) for e in entries)

    return {
        "queues": sort([q for q in export["queues"] if q["name"].startswith(prefix)]),
        "exchanges": sort([e for e in export["exchanges"] if e["name"].startswith("defs-")]),
        "bindings": sort([b for b in export["bindings"] if b["source"].startswith("defs-")]),
    }


def delete_all(cluster: LocalCluster, node: str, names: list[str]) -> None:
    conn = connect(cluster, node)
    try:
        ch = conn.channel()
        for name in names:
            ch.queue_delete(name)
        ch.exchange_delete("defs-fan")
        ch.exchange_delete("defs-x")
    finally:
        conn.close()


def held_by(cluster: LocalCluster, node: str) -> set[str]:
    """The queues ``node``'s own broker holds (``/api/brokerha/queues``: no forwarding)."""
    answer = get_json(cluster.admin_url(node) + "/api/brokerha/queues")
    return {q["name"] for q in answer["queues"]}


def leaders_of(names: list[str], leaders: dict[str, str], export: dict[str, Any]) -> set[str]:
    partitions = {q["name"]: q.get("arguments", {}).get("x-partition") for q in
                  export["queues"] if q["name"] in names}
    return {leaders[str(1 + (partitions[n] if partitions[n] is not None
                             else hash_partition("/", n, P)))] for n in names}


def routed_everywhere(cluster: LocalCluster, node: str, names: list[str]) -> None:
    """One mandatory publish with confirms through each queue's binding: all routed."""
    conn = connect(cluster, node)
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for name in names:
            ch.basic_publish("defs-x", f"k.{name}", b"x", mandatory=True)
    finally:
        conn.close()


def test_export_on_one_node_delete_import_on_another_gives_the_same_definitions() -> None:
    """18 queues over the 9 partitions, led by all three nodes: the export from B (the
    management API) and from C (``ctl export_definitions``) list every queue and binding
    in RabbitMQ's fields (no partition field; ``x-partition`` as given); everything
    deleted, the file imported on C (``ctl import_definitions``): once it answered, every
    queue is on its leader's broker, the export from A is the first one, and a publish
    through each binding is routed (mandatory, confirmed)."""
    names = queue_names("defs")
    with LocalCluster(3, options=OPTIONS) as cluster:
        leaders = ready(cluster)
        a = leaders["0"]
        b, c = sorted(n for n in cluster.names if n != a)
        make(cluster, b, names)
        status, export = api(cluster, b, "GET", "definitions")
        assert status == 200
        ctl_export = json.loads(ctl(cluster, c, "export_definitions", "-"))
        assert mine(ctl_export, "defs-") == mine(export, "defs-")
        queues = {q["name"]: q for q in export["queues"]}
        assert set(names) <= set(queues)
        assert all(tuple(sorted(q)) == tuple(sorted(QUEUE_FIELDS)) for q in queues.values())
        assert queues[names[0]]["arguments"] == {"x-partition": 4}
        assert queues[names[1]]["arguments"] == {"x-max-length": 1000}
        assert len(mine(export, "defs-")["bindings"]) == len(names) + 2
        assert leaders_of(names, leaders, export) == set(cluster.names)

        delete_all(cluster, a, names)
        _, empty = api(cluster, a, "GET", "definitions")
        assert mine(empty, "defs-") == {"queues": [], "exchanges": [], "bindings": []}

        path = os.path.join(cluster.data_dir, "defs.json")
        with open(path, "w") as f:
            json.dump(export, f)
        ctl(cluster, c, "import_definitions", path)
        # answered: each queue on its leader (x-partition's placement included)
        by_leader: dict[str, set[str]] = {}
        for name in names:
            p = 4 if name == names[0] else hash_partition("/", name, P)
            by_leader.setdefault(leaders[str(p + 1)], set()).add(name)
        for node, expected in by_leader.items():
            assert expected <= held_by(cluster, node), node
        _, again = api(cluster, a, "GET", "definitions")
        assert mine(again, "defs-") == mine(export, "defs-")
        routed_everywhere(cluster, a, names)


def rabbitmqadmin(cluster: LocalCluster, node: str, *args: str) -> str:
    assert RABBITMQADMIN is not None
    port = cluster.port(node) + 10000
    done = subprocess.run([RABBITMQADMIN, "-H", "127.0.0.1", "-P", str(port), "-u", "guest",
                           "-p", "guest", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def refusals(base: str, queue: str) -> list[tuple[int, Any]]:
    """The answers of ``POST base/definitions`` to files each refused by a declaration,
    with ``queue`` durable and the exchange ``defs-x`` there: an inequivalent queue, a
    binding to a missing queue, one from a missing exchange, a reserved name; then a file
    refused whole (a bad hash) naming a new queue."""
    files: list[dict[str, Any]] = [
        {"queues": [{"name": queue, "vhost": "/", "durable": False, "auto_delete": False,
                     "arguments": {}}]},
        {"bindings": [{"source": "defs-x", "vhost": "/", "destination": "defs-none",
                       "destination_type": "queue", "routing_key": "k", "arguments": {}}]},
        {"bindings": [{"source": "defs-nox", "vhost": "/", "destination": queue,
                       "destination_type": "queue", "routing_key": "k", "arguments": {}}]},
        {"queues": [{"name": "amq.defs", "vhost": "/", "durable": True, "auto_delete": False,
                     "arguments": {}}]},
        {"users": [{"name": "defs-u", "password_hash": "not base64!", "tags": ""}],
         "queues": [{"name": "defs-new", "vhost": "/", "durable": True, "auto_delete": False,
                     "arguments": {}}]},
    ]
    return [call(base, "POST", "definitions", body=f) for f in files]


def test_an_import_refused_by_a_leader_answers_as_the_unpartitioned_import() -> None:
    """The same refused files imported on a node that leads neither the queue's partition
    nor the metadata group, and on one unpartitioned node: the same status and reason
    each (406's text, ``binding to unknown queue``, 404, 403, ``not_base64`` with nothing
    changed); then ``rabbitmqadmin import`` of a good file on that node declares queues of
    every partition, in / and in a vhost the file makes, and ``rabbitmqadmin export``
    lists them."""
    names = queue_names("adm", per_partition=1)
    with LocalCluster(3, options=OPTIONS) as cluster, \
            NodeProcess("single", port=free_base_port(1)) as single:
        leaders = ready(cluster)
        a = leaders["0"]
        queue = next(n for n in names if leaders[str(hash_partition("/", n, P) + 1)] != a)
        asked = next(n for n in cluster.names
                     if n not in (a, leaders[str(hash_partition("/", queue, P) + 1)]))
        for url in (cluster.url(asked), single.url):
            conn = pika.BlockingConnection(pika.URLParameters(url))
            ch = conn.channel()
            ch.exchange_declare("defs-x", "topic", durable=True)
            ch.queue_declare(queue, durable=True)
            conn.close()
        partitioned = refusals(cluster.admin_url(asked) + "/api/", queue)
        unpartitioned = refusals(f"http://127.0.0.1:{single.port + 10000}/api/", queue)
        assert partitioned == unpartitioned
        assert [status for status, _ in partitioned] == [400, 400, 404, 401, 400], partitioned
        assert "inequivalent arg 'durable'" in partitioned[0][1]["reason"]
        _, export = api(cluster, a, "GET", "definitions")
        assert "defs-new" not in {q["name"] for q in export["queues"]}

        if RABBITMQADMIN is None:
            pytest.skip("rabbitmqadmin is not installed (scripts/ensure-rabbitmq installs it)")
        path = os.path.join(cluster.data_dir, "adm.json")
        with open(path, "w") as f:  # and a vhost of the file, its queues in it
            json.dump({"vhosts": [{"name": "defs-v"}],
                       "permissions": [{"user": "guest", "vhost": "defs-v", "configure": ".*",
                                        "write": ".*", "read": ".*"}],
                       "queues": [{"name": n, "vhost": v, "durable": True,
                                   "auto_delete": False, "arguments": {}}
                                  for n in names for v in ("/", "defs-v")],
                       "bindings": [{"source": "defs-x", "vhost": "/", "destination": n,
                                     "destination_type": "queue", "routing_key": f"k.{n}",
                                     "arguments": {}} for n in names]}, f)
        rabbitmqadmin(cluster, asked, "import", path)
        listed = json.loads(rabbitmqadmin(cluster, a, "-f", "raw_json", "list", "queues"))
        assert {(v, n) for n in names for v in ("/", "defs-v")} <= {
            (q["vhost"], q["name"]) for q in listed}
        exported = os.path.join(cluster.data_dir, "adm-export.json")
        rabbitmqadmin(cluster, a, "export", exported)
        with open(exported) as f:
            bound = {b["destination"] for b in json.load(f)["bindings"]
                     if b["source"] == "defs-x"}
        assert set(names) <= bound
        routed_everywhere(cluster, a, names)


def test_a_leader_lost_mid_import_completes_the_import_or_fails_it() -> None:
    """600 queues over the 9 partitions, each bound, imported on the metadata primary A
    while C, leading some of the partitions, is stopped (SIGSTOP: the import waits for
    its partitions' answers), then SIGKILLed: the import is answered 204 and
    then every queue and binding is there (export from A, and on the partitions' new
    leaders), or 503 naming the item -- and imported again it is 204 with every queue."""
    names = queue_names("lost", per_partition=600 // P)
    with LocalCluster(3, options=OPTIONS) as cluster:
        leaders = ready(cluster)
        a = leaders["0"]
        c = next(n for n in sorted(cluster.names) if n != a)
        base = cluster.admin_url(a) + "/api/"
        exchange = {"exchanges": [{"name": "defs-x", "vhost": "/", "type": "topic",
                                   "durable": True, "auto_delete": False, "internal": False,
                                   "arguments": {}}]}
        assert call(base, "POST", "definitions", body=exchange)[0] == 204
        body = {"queues": [{"name": n, "vhost": "/", "durable": True, "auto_delete": False,
                            "arguments": {}} for n in names],
                "bindings": [{"source": "defs-x", "vhost": "/", "destination": n,
                              "destination_type": "queue", "routing_key": f"k.{n}",
                              "arguments": {}} for n in names]}
        answers: list[tuple[int, Any]] = []
        importing = threading.Thread(target=lambda: answers.append(
            call(base, "POST", "definitions", body=body, timeout=45)))
        cluster.pause(c)  # its partitions' requests go unanswered: the import waits on them
        started = time.monotonic()
        importing.start()
        time.sleep(0.5)
        under_way = importing.is_alive()
        cluster.kill(c)
        importing.join(60)
        status, answer = answers[0]
        took = time.monotonic() - started
        print(f"import answered {status} in {took:.2f} s: {answer}")
        assert under_way, f"the import was answered before the kill ({took:.1f} s): {answers}"
        if status != 204:
            assert status == 503 and "import it again" in answer["reason"], answers
            # (the import's own time: its requests wait for a new leader)
            status, answer = call(base, "POST", "definitions", body=body, timeout=45)
        assert status == 204, answer
        _, export = api(cluster, a, "GET", "definitions")
        assert set(names) <= {q["name"] for q in export["queues"]}
        assert set(names) <= {b["destination"] for b in export["bindings"]
                              if b["source"] == "defs-x"}
        now = until("one serving leader per partition, none on C", lambda: _leaders(
            cluster, [n for n in cluster.names if n != c]))
        for node in set(now.values()):
            expected = {n for n in names if now[str(hash_partition("/", n, P) + 1)] == node}
            assert expected <= held_by(cluster, node), node


def _leaders(cluster: LocalCluster, names: list[str]) -> dict[str, str] | None:
    serving: dict[str, list[str]] = {}
    for name in names:
        for group, g in ((cluster.status(name) or {}).get("node", {}).get("groups")
                         or {}).items():
            if g["serving"]:
                serving.setdefault(group, []).append(name)
    if len(serving) == P + 1 and all(len(v) == 1 for v in serving.values()):
        return {g: v[0] for g, v in serving.items()}
    return None


def test_the_management_lists_show_each_queue_as_its_leader_sees_it() -> None:
    """A queue of a partition B leads, consumed on B (10 delivered, unacknowledged): its
    entry in /api/queues and /api/queues/%2F/q asked on each node (answered by A, the
    metadata primary, whose copy counts no consumer) is B's: 1 consumer, 10
    unacknowledged, node brokerha@B; /api/bindings lists its binding on each node; an
    exclusive queue of a connection on B (in no partition, on B alone) is listed from
    every node, and not exported."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        leaders = ready(cluster)
        a = leaders["0"]
        queue = next(n for n in queue_names("list") if leaders[
            str(hash_partition("/", n, P) + 1)] != a)
        b = leaders[str(hash_partition("/", queue, P) + 1)]
        conn = connect(cluster, b)
        try:
            ch = conn.channel()
            ch.exchange_declare("defs-x", "topic", durable=True)
            ch.queue_declare(queue, durable=True)
            ch.queue_bind(queue, "defs-x", routing_key="list.k")
            ch.confirm_delivery()
            for _ in range(10):
                ch.basic_publish("", queue, b"x")
            ch.basic_qos(prefetch_count=10)
            ch.basic_consume(queue, lambda *_: None)
            own = ch.queue_declare("", exclusive=True).method.queue  # B's alone
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                conn.process_data_events(0.1)
                _, entry = api(cluster, a, "GET", f"queues/%2F/{queue}")
                if entry.get("messages_unacknowledged") == 10:
                    break
            for node in cluster.names:
                status, listed = api(cluster, node, "GET", "queues")
                assert status == 200
                entry = next(q for q in listed if q["name"] == queue)
                one = api(cluster, node, "GET", f"queues/%2F/{queue}")[1]
                for e in (entry, one):
                    assert (e["consumers"], e["messages_unacknowledged"], e["messages_ready"],
                            e["node"], e["leader"]) == (1, 10, 0, f"brokerha@{b}", b), (node, e)
                _, bindings = api(cluster, node, "GET", "bindings")
                assert any(x["source"] == "defs-x" and x["destination"] == queue
                           and x["routing_key"] == "list.k" for x in bindings), node
                exclusive = [q for q in listed if q["name"] == own]
                assert [(q["exclusive"], q["node"]) for q in exclusive] == [
                    (True, f"brokerha@{b}")], (node, exclusive)
            _, export = api(cluster, a, "GET", "definitions")
            assert own not in {q["name"] for q in export["queues"]}
            # what B answers the members: the partitions it leads, one queue when asked
            led = get_json(cluster.admin_url(b) + f"/api/brokerha/partition-objects?"
                           f"vhost=%2F&name={queue}")
            assert hash_partition("/", queue, P) in led["served"]
            assert [q["name"] for q in led["queues"]] == [queue] and led["bindings"] == []
            led = get_json(cluster.admin_url(b) + "/api/brokerha/partition-objects")
            assert any(x["destination"] == queue for x in led["bindings"])
        finally:
            conn.close()


def test_four_nodes_export_and_import_every_partition_from_a_node_outside_some() -> None:
    """P = 4, NR = 2 on four nodes: each node holds cells of three partitions. Queues of
    every partition (with arguments) and their bindings, exported on each node (the
    metadata primary answers, outside one partition): all of them, the same file; deleted,
    the vhost's file (``/api/definitions/%2F``) exported, imported on a node outside a
    partition the metadata primary is in; the export is the first one and each queue is
    on its leader."""
    with LocalCluster(4, options=FOUR_OPTIONS) as cluster:
        names = cluster.names
        lead = settled_leaders(cluster)
        a = lead["0"][0]
        cells = cells_of(cluster, a)
        queues = [queue_in(p, f"four{p}") for p in range(P4)]
        conn = connect(cluster, a)
        try:
            ch = conn.channel()
            ch.exchange_declare("defs-x", "topic", durable=True)
            for q in queues:
                ch.queue_declare(q, durable=True, arguments={"x-max-length": 7})
                ch.queue_bind(q, "defs-x", routing_key=f"k.{q}")
        finally:
            conn.close()
        exports = [api(cluster, n, "GET", "definitions") for n in names]
        assert all(status == 200 for status, _ in exports)
        first = mine(exports[0][1], "four")
        assert all(mine(e, "four") == first for _, e in exports)
        listed = {q["name"]: q["arguments"] for q in exports[0][1]["queues"]}
        assert {q: listed.get(q) for q in queues} == {q: {"x-max-length": 7} for q in queues}
        assert len(first["bindings"]) == P4
        # the vhost's file (RabbitMQ's: no vhost in its entries)
        status, per_vhost = api(cluster, names[-1], "GET", "definitions/%2F")
        assert status == 200
        assert {q["name"]: q["arguments"] for q in per_vhost["queues"]
                if q["name"] in queues} == {q: {"x-max-length": 7} for q in queues}
        assert all("vhost" not in q for q in per_vhost["queues"])

        conn = connect(cluster, a)
        try:
            ch = conn.channel()
            for q in queues:
                ch.queue_delete(q)
            ch.exchange_delete("defs-x")
        finally:
            conn.close()
        # a node outside some partition whose cells include the metadata primary: the
        # vhost's file imported into that vhost
        outside = next(n for p in range(P4) for n in names
                       if n not in cells[p] and a in cells[p])
        assert call(cluster.admin_url(outside) + "/api/", "POST", "definitions/%2F",
                    body=per_vhost)[0] == 204
        assert mine(api(cluster, a, "GET", "definitions")[1], "four") == first
        now = leaders(cluster, names)
        assert now is not None
        for p, q in enumerate(queues):
            assert q in held_by(cluster, now[str(p + 1)][0]), (q, now)


def ctl(cluster: LocalCluster, node: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           cluster.url(node), *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout
