"""Definitions export and import (issue 34): ``brokerha ctl export_definitions`` /
``import_definitions`` and ``GET``/``POST /api/definitions`` on a real node.

The file is RabbitMQ's definitions JSON (tests/differential/test_definitions_export.py
checks it against RabbitMQ's own); here a file of the kind RabbitMQ writes, with a
password hash made as RabbitMQ makes it, is imported with ``ctl``, its user logs in
over AMQP with the password, its policy acts, and the node's export holds it; a bad
file is refused with RabbitMQ's reason and changes nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pika
import pytest

from brokerha.broker.auth import hash_password
from brokerha.testing import NodeProcess
from tests.ops.test_management_api import api

pytestmark = pytest.mark.timeout(120)


def ctl(node: NodeProcess, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           f"http://127.0.0.1:{node.port + 10000}", *argv],
                          capture_output=True, text=True, timeout=60, input=stdin)


def rabbitmq_file(s: str) -> dict[str, Any]:
    """What ``rabbitmqctl export_definitions`` writes (3.10.8's keys), for one app."""
    return {
        "rabbit_version": "3.10.8", "rabbitmq_version": "3.10.8", "product_name": "RabbitMQ",
        "product_version": "3.10.8",
        "users": [{"name": f"svc-{s}", "password_hash": hash_password("from-rabbit"),
                   "hashing_algorithm": "rabbit_password_hashing_sha256",
                   "tags": ["management"], "limits": {}},
                  {"name": f"old-{s}", "password_hash": hash_password("md5-pw", algorithm=
                                                                      "rabbit_password_hashing_md5"),
                   "hashing_algorithm": "rabbit_password_hashing_md5", "tags": "", "limits": {}}],
        "vhosts": [{"name": f"app-{s}"}],
        "permissions": [{"user": f"svc-{s}", "vhost": f"app-{s}", "configure": ".*",
                         "write": ".*", "read": ".*"},
                        {"user": f"old-{s}", "vhost": f"app-{s}", "configure": "",
                         "write": "", "read": ".*"}],
        "topic_permissions": [{"user": f"svc-{s}", "vhost": f"app-{s}", "exchange": "amq.topic",
                               "write": "^a\\.", "read": ".*"}],
        "parameters": [{"value": {"pattern": ".*", "definition": {"max-length": 100},
                                  "priority": 0, "apply-to": "queues"},
                        "vhost": f"app-{s}", "component": "operator_policy", "name": "cap"}],
        "global_parameters": [{"name": "internal_cluster_id", "value": "rabbitmq-cluster-id-x"}],
        "policies": [{"vhost": f"app-{s}", "name": "short", "pattern": "^pol\\.",
                      "apply-to": "queues", "definition": {"max-length": 1}, "priority": 0}],
        "queues": [{"name": "pol.inbox", "vhost": f"app-{s}", "durable": True,
                    "auto_delete": False, "arguments": {}}],
        "exchanges": [{"name": "events", "vhost": f"app-{s}", "type": "topic", "durable": True,
                       "auto_delete": False, "internal": False, "arguments": {}}],
        "bindings": [{"source": "events", "vhost": f"app-{s}", "destination": "pol.inbox",
                      "destination_type": "queue", "routing_key": "#", "arguments": {}}],
    }


def entries(export: dict[str, Any], key: str, s: str) -> list[Any]:
    return sorted((e for e in export[key] if s in json.dumps(e)),
                  key=lambda e: json.dumps(e, sort_keys=True))


def test_ctl_imports_a_rabbitmq_file_whose_users_log_in_and_exports_it_again(
        managed_node: NodeProcess, tmp_path: Path) -> None:
    s = "imp1"
    file = rabbitmq_file(s)
    (tmp_path / "in.json").write_text(json.dumps(file))
    done = ctl(managed_node, "import_definitions", str(tmp_path / "in.json"))
    assert done.returncode == 0, done.stderr
    assert "Importing definitions in JSON from a file at" in done.stdout

    params = pika.ConnectionParameters("127.0.0.1", managed_node.port, f"app-{s}",
                                       pika.PlainCredentials(f"svc-{s}", "from-rabbit"))
    with pika.BlockingConnection(params) as conn:
        ch = conn.channel()
        for i in range(3):  # through the imported binding; the policy keeps one
            ch.basic_publish("events", "a.b", str(i).encode())
        assert ch.queue_declare("pol.inbox", passive=True).method.message_count == 1
    old = pika.ConnectionParameters("127.0.0.1", managed_node.port, f"app-{s}",
                                    pika.PlainCredentials(f"old-{s}", "md5-pw"))
    pika.BlockingConnection(old).close()  # an md5 hash from an old RabbitMQ logs in too

    done = ctl(managed_node, "export_definitions", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stderr
    assert f'Exporting definitions in JSON to a file at "{tmp_path / "out.json"}"' in done.stdout
    exported = json.loads((tmp_path / "out.json").read_text())
    assert exported["product_name"] == "brokerha" and exported["rabbit_version"] == "3.10.8"
    assert exported["global_parameters"] == []
    for key in ("users", "vhosts", "permissions", "topic_permissions", "parameters",
                "policies", "queues", "exchanges", "bindings"):
        want = [dict(e, tags=[]) if key == "users" and e["tags"] == "" else e
                for e in file[key]]
        assert entries(exported, key, s) == entries({key: want}, key, s), key
    # "-" is standard output, as rabbitmqctl's
    stdout = ctl(managed_node, "export_definitions", "-")
    assert json.loads(stdout.stdout) == json.loads((tmp_path / "out.json").read_text())


def test_a_bad_file_is_refused_with_rabbitmqs_reason_and_changes_nothing(
        managed_node: NodeProcess) -> None:
    s = "bad1"
    file = rabbitmq_file(s)
    file["permissions"].append({"user": f"nobody-{s}", "vhost": f"app-{s}", "configure": ".*",
                                "write": ".*", "read": ".*"})
    before = api(managed_node, "GET", "definitions")[1]
    done = ctl(managed_node, "import_definitions", "-", stdin=json.dumps(file))
    assert done.returncode == 1
    assert f'bad_request: ["no_such_user", "nobody-{s}"]' in done.stderr
    assert api(managed_node, "GET", "definitions")[1] == before

    for broken, reason in (
            ({"users": [{"name": f"u-{s}", "password_hash": "abc", "tags": ""}]},
             ["not_base64", "abc"]),
            ({"vhosts": [{"name": f"v-{s}"}], "policies": [
                {"vhost": f"v-{s}", "name": "p", "pattern": ".*", "definition": {"nope": 1}}]},
             # the API's reason for the policy (policies_api.py), then which, as RabbitMQ's
             api(managed_node, "PUT", "policies/%2F/p", body={
                 "pattern": ".*", "definition": {"nope": 1}})[1]["reason"] + f" (v-{s}/p)"),
            ({"queues": [{"name": "q", "vhost": f"nonesuch-{s}", "durable": True}]},
             ["no_such_vhost", f"nonesuch-{s}"])):
        assert api(managed_node, "POST", "definitions", body=broken) == (
            400, {"error": "bad_request", "reason": reason})
        assert api(managed_node, "GET", "definitions")[1] == before


def test_a_vhosts_file_has_no_users_and_no_vhost_in_its_entries(
        managed_node: NodeProcess) -> None:
    s = "vh1"
    assert api(managed_node, "POST", "definitions", body=rabbitmq_file(s))[0] == 204
    status, export = api(managed_node, "GET", f"definitions/app-{s}")
    assert status == 200
    assert set(export) == {"rabbit_version", "parameters", "policies", "queues", "exchanges",
                           "bindings"}
    assert export["queues"] == [{"name": "pol.inbox", "durable": True, "auto_delete": False,
                                 "arguments": {}}]
    assert [p["name"] for p in export["policies"]] == ["short"]
    assert api(managed_node, "GET", "definitions/nonesuch") == (
        400, {"error": "bad_request", "reason": "vhost_not_found"})
    assert api(managed_node, "GET", "definitions", "watcher", "w-secret") == (
        401, {"error": "not_authorised", "reason": "Not administrator user"})
