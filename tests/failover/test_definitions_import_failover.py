"""RabbitMQ 3.10.8's own definitions export imported into a three-node brokerha cluster through
a backup's management API; the primary SIGKILLed; the users log in to the new primary with
their RabbitMQ passwords, its policy and permissions act there, and the new primary exports
what RabbitMQ exported (issue 34, "shows it works"). Skipped without rabbitmq-server."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pika
import pytest

from brokerha.testing import LocalCluster, free_port
from tests.differential.test_definitions_export import make_definitions, mine
from tests.failover.test_failover import FAST, wait_all_ready
from tests.management_http import call

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rabbitmq_ref import RabbitMQRef, available  # noqa: E402

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def rabbitmq_export() -> tuple[str, dict[str, Any]]:
    """Definitions made on a private RabbitMQ node, and its ``GET /api/definitions``; the
    node is stopped once it exported them (the export is all the test reads: an idle Erlang
    VM beside the three nodes and their failover would only take CPU from them)."""
    if not available():
        pytest.skip("rabbitmq-server is not installed (scripts/ensure-rabbitmq installs it)")
    port = free_port()
    with RabbitMQRef(plugins=("rabbitmq_management",),
                     extra_config=f"management.tcp.port = {port}\n"
                                  "management.tcp.ip = 127.0.0.1\n"):
        base = f"http://127.0.0.1:{port}/api"
        s = uuid.uuid4().hex[:8]
        make_definitions(base, s)
        status, export = call(base, "GET", "/definitions")
        assert status == 200
    return s, export


def login_soon(cluster: LocalCluster, name: str, vhost: str, user: str,
               password: str) -> pika.BlockingConnection | None:
    """A connection once the new primary serves (None if it never does within 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        conn = login(cluster, name, vhost, user, password)
        if conn is not None:
            return conn
        time.sleep(0.2)
    return None


def login(cluster: LocalCluster, name: str, vhost: str, user: str,
          password: str) -> pika.BlockingConnection | None:
    url = pika.URLParameters(cluster.url(name))
    try:
        return pika.BlockingConnection(pika.ConnectionParameters(
            url.host, url.port, vhost, pika.PlainCredentials(user, password),
            connection_attempts=1, socket_timeout=5))
    except pika.exceptions.AMQPConnectionError:
        return None


def test_a_rabbitmq_export_imported_through_a_backup_survives_the_primarys_sigkill(
        rabbitmq_export: tuple[str, dict[str, Any]]) -> None:
    s, export = rabbitmq_export
    vhost, user = f"app-{s}", f"svc-{s}"
    with LocalCluster(3, options=FAST) as cluster:
        primary = wait_all_ready(cluster)
        backup = next(n for n in cluster.names if n != primary)
        assert call(cluster.admin_url(backup) + "/api", "POST", "/definitions",
                    body=export) == (204, None)
        for name in cluster.names:
            if name != primary:
                cluster.wait_ready(name, 30)
        cluster.kill(primary)
        new = cluster.wait_primary(30, other_than=primary)
        conn = login_soon(cluster, new, vhost, user, "svc-pw")
        assert conn, "the imported user does not log in to the new primary"
        with conn:
            ch = conn.channel()
            ch.queue_declare(f"pol.{s}")  # the imported policy: max-length 2
            for i in range(4):
                ch.basic_publish("", f"pol.{s}", str(i).encode())
            assert ch.queue_declare(f"pol.{s}", passive=True).method.message_count == 2
            ch.queue_delete(f"pol.{s}")
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                ch.queue_declare(f"other.{s}")  # the imported configure permission
            assert refused.value.reply_code == 403
        assert login(cluster, new, vhost, user, "wrong") is None
        status, ours = call(cluster.admin_url(new) + "/api", "GET", "/definitions")
        assert status == 200
        for key, entries in mine(export, s).items():
            assert json.dumps(mine(ours, s)[key], sort_keys=True) == json.dumps(
                entries, sort_keys=True), key
