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
from typing import Any

import pytest

from brokerha.admin.definitions_file import QUEUE_FIELDS
from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster, get_json
from tests.failover.groups import connect, until
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


def ctl(cluster: LocalCluster, node: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           cluster.url(node), *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout
