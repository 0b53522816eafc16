"""RabbitMQ's management HTTP API on a node, driven by the unmodified tools that speak it.

``rabbitmqadmin`` (Debian's rabbitmq-server package ships it; ``scripts/test``
installs the package where it can) and Flower's broker module run against a
brokerha node; plain HTTP checks the credentials rules (RabbitMQ's: every path
needs a user with a management tag, some an administrator).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pika
import pytest

from brokerha.testing import LocalCluster, NodeProcess, get, get_json
from tests.management_http import call

pytestmark = pytest.mark.timeout(120)

RABBITMQADMIN = shutil.which("rabbitmqadmin")


@pytest.fixture()
def node(managed_node: NodeProcess) -> NodeProcess:
    return managed_node


def api(node: NodeProcess, method: str, path: str, user: str | None = "guest",
        password: str = "guest", body: Any = None) -> tuple[int, Any]:
    return call(f"http://127.0.0.1:{node.port + 10000}/api/", method, path, user, password, body)


def rabbitmqadmin(node: NodeProcess, *args: str, user: str = "guest",
                  password: str = "guest") -> str:
    if RABBITMQADMIN is None:
        pytest.skip("rabbitmqadmin is not installed (scripts/ensure-rabbitmq installs it)")
    done = subprocess.run([RABBITMQADMIN, "-H", "127.0.0.1", "-P", str(node.port + 10000),
                           "-u", user, "-p", password, "-f", "raw_json", *args],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def test_rabbitmqadmin_declares_publishes_gets_lists_and_deletes(node: NodeProcess,
                                                                 tmp_path: Path) -> None:
    rabbitmqadmin(node, "declare", "queue", "name=adm-q", "durable=true")
    rabbitmqadmin(node, "declare", "exchange", "name=adm-x", "type=topic")
    rabbitmqadmin(node, "declare", "binding", "source=adm-x", "destination=adm-q",
                  "routing_key=orders.#")
    for i in range(3):
        rabbitmqadmin(node, "publish", "exchange=adm-x", "routing_key=orders.new",
                      f"payload=order {i}", 'properties={"content_type": "text/plain"}')
    queues = {q["name"]: q for q in json.loads(rabbitmqadmin(node, "list", "queues"))}
    assert queues["adm-q"]["messages"] == 3
    # an AMQP client sees what the API published, and the API what AMQP did
    with pika.BlockingConnection(pika.URLParameters(node.url)) as conn:
        method, props, body = conn.channel().basic_get("adm-q", auto_ack=True)
        assert body == b"order 0" and props.content_type == "text/plain"
        assert method.routing_key == "orders.new" and method.exchange == "adm-x"
    peek = json.loads(rabbitmqadmin(node, "get", "queue=adm-q", "count=2"))
    assert [m["payload"] for m in peek] == ["order 1", "order 2"]
    assert json.loads(rabbitmqadmin(node, "list", "queues"))[0]["messages"] == 2  # requeued
    taken = json.loads(rabbitmqadmin(node, "get", "queue=adm-q", "ackmode=ack_requeue_false"))
    assert taken[0]["payload"] == "order 1" and taken[0]["redelivered"] is True
    bindings = json.loads(rabbitmqadmin(node, "list", "bindings"))
    assert {"source": "adm-x", "destination": "adm-q", "routing_key": "orders.#"} in [
        {k: b[k] for k in ("source", "destination", "routing_key")} for b in bindings]

    exported = tmp_path / "defs.json"
    rabbitmqadmin(node, "export", str(exported))
    defs = json.loads(exported.read_text())
    assert {q["name"] for q in defs["queues"]} >= {"adm-q"}
    rabbitmqadmin(node, "delete", "queue", "name=adm-q")
    rabbitmqadmin(node, "delete", "exchange", "name=adm-x")
    assert "adm-q" not in {q["name"] for q in json.loads(rabbitmqadmin(node, "list", "queues"))}
    rabbitmqadmin(node, "import", str(exported))
    assert "adm-q" in {q["name"] for q in json.loads(rabbitmqadmin(node, "list", "queues"))}
    assert any(b["source"] == "adm-x" for b in json.loads(rabbitmqadmin(node, "list",
                                                                         "bindings")))


def test_rabbitmqadmin_lists_connections_channels_nodes_and_the_overview(
        node: NodeProcess) -> None:
    with pika.BlockingConnection(pika.URLParameters(node.url)) as conn:
        conn.channel()
        connections = json.loads(rabbitmqadmin(node, "list", "connections"))
        assert len(connections) == 1 and connections[0]["user"] == "guest"
        assert connections[0]["channels"] == 1
        assert len(json.loads(rabbitmqadmin(node, "list", "channels"))) == 1
    overview = json.loads(rabbitmqadmin(node, "show", "overview"))[0]
    assert overview["rabbitmq_version"] and "queue_totals" in json.dumps(overview)
    nodes = json.loads(rabbitmqadmin(node, "list", "nodes"))
    assert nodes[0]["name"] == "brokerha@mgmt" and nodes[0]["brokerha"]["role"] == "standalone"


def test_brokerhas_own_routes_need_credentials_too_but_metrics(node: NodeProcess) -> None:
    """As RabbitMQ: nothing but the Prometheus endpoint (and the UI's page, no data) is open."""
    admin = f"http://127.0.0.1:{node.port + 10000}"
    for path in ("/api/status", "/api/cluster", "/api/brokerha/queues", "/api/txlog",
                 "/api/tls", "/status"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(admin + path, timeout=5)
        assert info.value.code == 401, path
        # a user without a management tag is refused as well
        with pytest.raises(urllib.error.HTTPError) as info:
            get_json(admin + path, 5, user="app", password="p-secret")
        assert info.value.code == 403, path
        assert get(admin + path, 5, user="watcher", password="w-secret")
    # a browser is asked for a login on the status page
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(admin + "/status", timeout=5)
    assert info.value.headers["WWW-Authenticate"] == 'Basic realm="brokerha"'
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as r:
        assert b"rabbitmq_identity_info" in r.read()
    with urllib.request.urlopen(admin + "/", timeout=5) as r:
        assert b"<title>brokerha</title>" in r.read()


def test_credentials_are_required_and_tags_decide_as_in_rabbitmq(node: NodeProcess) -> None:
    assert api(node, "GET", "overview", user=None) == (401, None)  # RabbitMQ: no body
    assert api(node, "GET", "queues", password="wrong")[0] == 401
    assert api(node, "GET", "queues", user="app", password="p-secret") == (
        401, {"error": "not_authorised", "reason": "Not management user"})
    status, users = api(node, "GET", "users", user="watcher", password="w-secret")
    assert (status, users) == (401, {"error": "not_authorised",
                                     "reason": "Not administrator user"})
    assert api(node, "GET", "queues", user="watcher", password="w-secret")[0] == 200
    assert api(node, "GET", "whoami", user="watcher", password="w-secret") == (
        200, {"name": "watcher", "tags": ["monitoring"]})
    # a management user sees the vhosts it has permissions in, and changes what they allow
    status, vhosts = api(node, "GET", "vhosts", user="alice", password="a-secret")
    assert status == 200 and [v["name"] for v in vhosts] == ["orders"]
    assert api(node, "GET", "queues/%2F", user="alice", password="a-secret")[0] == 404
    assert api(node, "PUT", "queues/orders/alice-q", user="alice", password="a-secret",
               body={"durable": True})[0] == 201
    assert api(node, "PUT", "queues/orders/alice-q", user="alice", password="a-secret",
               body={"durable": False}) == (
        400, {"error": "bad_request", "reason": "inequivalent arg 'durable' for queue "
              "'alice-q' in vhost 'orders': received 'false' but current is 'true'"})
    assert api(node, "GET", "metrics".replace("metrics", "health/checks/alarms"))[1] == {
        "status": "ok"}
    assert api(node, "GET", "aliveness-test/%2F") == (200, {"status": "ok"})
    assert api(node, "GET", "queues/%2F/nonesuch") == (
        404, {"error": "Object Not Found", "reason": "Not Found"})


def test_flowers_broker_module_reads_queue_lengths(node: NodeProcess) -> None:
    from flower.utils.broker import RabbitMQ

    api(node, "PUT", "queues/%2F/celery", body={"durable": True})
    with pika.BlockingConnection(pika.URLParameters(node.url)) as conn:
        ch = conn.channel()
        for _ in range(4):
            ch.basic_publish("", "celery", b"task")
    # the broker URL as Celery users write it (vhost "/": the path "//")
    broker = RabbitMQ(f"amqp://guest:guest@127.0.0.1:{node.port}//",
                      f"http://guest:guest@127.0.0.1:{node.port + 10000}/api/")

    async def ask() -> list[dict[str, Any]]:
        return await broker.queues(["celery"])

    found = asyncio.run(ask())
    assert [(q["name"], q["messages"]) for q in found] == [("celery", 4)]


def test_a_backup_answers_for_the_cluster_and_changes_reach_every_node() -> None:
    with LocalCluster(3, options={"backup_timeout": 3.0}) as cluster:
        primary = cluster.wait_primary(30)
        backup = next(n for n in cluster.names if n != primary)
        for name in cluster.names:
            if name != primary:
                cluster.wait_ready(name, 30)
        other = NodeProcess.__new__(NodeProcess)  # only its port: the helpers take a node
        other.port = cluster.port(backup)
        assert api(other, "PUT", "queues/%2F/via-backup", body={"durable": True})[0] == 201
        status, queues = api(other, "GET", "queues")
        assert status == 200 and "via-backup" in {q["name"] for q in queues}
        status, nodes = api(other, "GET", "nodes")
        roles = sorted(n["brokerha"]["role"] for n in nodes)
        assert status == 200 and roles == ["backup", "backup", "primary"]
        # replicated: the backup holds the queue itself (its own brokerha listing)
        held = get_json(cluster.admin_url(backup) + "/api/brokerha/queues", 5)["queues"]
        assert "via-backup" in {q["name"] for q in held}


def test_metrics_carry_rabbitmq_prometheus_names_beside_brokerhas(node: NodeProcess) -> None:
    with pika.BlockingConnection(pika.URLParameters(node.url)) as conn:
        ch = conn.channel()
        ch.queue_declare("prom-q")
        ch.confirm_delivery()
        for _ in range(3):
            ch.basic_publish("", "prom-q", b"m")
        with urllib.request.urlopen(f"http://127.0.0.1:{node.port + 10000}/metrics",
                                    timeout=5) as r:
            text = r.read().decode()
    values = {line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("rabbitmq_")}
    assert 'rabbitmq_identity_info{rabbitmq_cluster="mgmt"' in text.replace(
        'rabbitmq_node="brokerha@mgmt",', "")
    assert values["rabbitmq_connections"] >= 1 and values["rabbitmq_channels"] >= 1
    assert values["rabbitmq_queue_messages_ready"] >= 3
    assert values["rabbitmq_global_messages_received_total"] >= 3
    assert values["rabbitmq_global_messages_confirmed_total"] >= 3
    assert "brokerha_role" in text  # brokerha's own series stay


def test_bad_input_gets_rabbitmqs_error_shape_and_changes_nothing(node: NodeProcess) -> None:
    api(node, "PUT", "queues/%2F/bad-in", body={"durable": True})
    assert api(node, "POST", "queues/%2F/bad-in/get", body={"count": 1, "ackmode": "nope"}) == (
        400, {"error": "bad_request", "reason": "ackmode: ack_requeue_true, ack_requeue_false, "
                                                  "reject_requeue_true or reject_requeue_false"})
    assert api(node, "POST", "exchanges/%2F/amq.default/publish",
               body={"routing_key": "bad-in", "payload": "x", "payload_encoding": "rot13"}) == (
        400, {"error": "bad_request", "reason": "payload_encoding: string or base64"})
    assert api(node, "POST", "exchanges/%2F/amq.default/publish",
               body={"routing_key": "bad-in", "payload": "%%%", "payload_encoding": "base64"}) == (
        400, {"error": "bad_request", "reason": "payload is not base64"})
    assert api(node, "PUT", "queues/%2F/bad-in", body=["not", "an", "object"]) == (
        400, {"error": "bad_request", "reason": "the body must be a JSON object"})
    assert api(node, "PUT", "exchanges/%2F/bad-x", body={"type": "direct", "durable": "maybe"}) == (
        400, {"error": "bad_request", "reason": "expected true or false, got 'maybe'"})
    assert api(node, "GET", "exchanges/%2F/bad-x")[0] == 404  # nothing declared
    assert api(node, "GET", "queues/%2F/bad-in")[1]["messages"] == 0  # nothing published
