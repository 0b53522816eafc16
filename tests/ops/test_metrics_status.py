"""/metrics, the status page and the read-only admin API on a real three-node cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from brokerha.testing import LocalCluster

FAST = {"heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
        "backup_timeout": 3.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options=FAST) as c:
        primary = c.wait_primary(30)
        for name in c.names:
            if name != primary:
                c.wait_ready(name, 30)
        yield c


def get(url: str) -> tuple[str, bytes]:
    req = urllib.request.Request(url)  # guest's credentials: every route but /metrics needs them
    req.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.headers.get("Content-Type", ""), resp.read()


def scrape(cluster: LocalCluster, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples by (name, sorted labels), parsed with the Prometheus client's own parser."""
    ctype, body = get(cluster.admin_url(name) + "/metrics")
    assert ctype.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def ctl(cluster: LocalCluster, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           cluster.url(cluster.names[0]), *argv],
                          capture_output=True, text=True, timeout=30)


def test_metrics_move_with_traffic(cluster: LocalCluster) -> None:
    primary = cluster.wait_primary()
    queue = (("queue", "metrics-q"), ("vhost", "/"))
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(primary)))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("metrics-q", durable=True)
        before = scrape(cluster, primary)
        assert before[("brokerha_role", (("role", "primary"),))] == 1
        assert before[("brokerha_ready", ())] == 1
        assert before[("brokerha_txlog_running", ())] == 0
        assert before[("brokerha_connections", ())] >= 1
        epoch = before[("brokerha_epoch", ())]
        assert epoch >= 1
        assert before[("brokerha_queue_messages_published_total", queue)] == 0
        for i in range(25):
            ch.basic_publish("", "metrics-q", f"m{i}".encode(),
                             pika.BasicProperties(delivery_mode=2))
        mid = scrape(cluster, primary)
        assert mid[("brokerha_queue_messages_published_total", queue)] == 25
        assert mid[("brokerha_queue_messages_ready", queue)] == 25
        assert (mid[("brokerha_durable_requests_total", ())]
                - before[("brokerha_durable_requests_total", ())]) >= 25
        assert mid[("brokerha_replication_seq", ())] > before[("brokerha_replication_seq", ())]
        assert mid[("brokerha_confirms_total", ())] - before[("brokerha_confirms_total", ())] == 25
        for _ in range(10):
            method, _, _ = ch.basic_get("metrics-q", auto_ack=True)
            assert method is not None
        tx = conn.channel()
        tx.tx_select()
        for _ in range(3):
            tx.basic_publish("", "metrics-q", b"t", pika.BasicProperties(delivery_mode=2))
            tx.tx_commit()
        tx.basic_get("metrics-q")  # keeps the queue at 15 + 3 - 3 after the commits below
        after = scrape(cluster, primary)
        assert after[("brokerha_commits_total", ())] - before[("brokerha_commits_total", ())] == 3
        assert after[("brokerha_commit_latency_seconds_count", ())] == 3
        assert after[("brokerha_commit_latency_seconds_bucket", (("le", "+Inf"),))] == 3
        assert after[("brokerha_commit_latency_seconds_sum", ())] > 0
        assert after[("brokerha_queue_messages_delivered_total", queue)] == 11  # 10 + 1 held
        assert after[("brokerha_queue_messages_ready", queue)] == 17  # 15 + 3 - 1 held
        tx.tx_rollback()
    finally:
        conn.close()
    backups = [n for n in cluster.names if n != primary]
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(cluster, primary)
        lags = [samples.get(("brokerha_backup_lag_events", (("backup", b),))) for b in backups]
        if all(lag == 0 for lag in lags) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lags == [0, 0]
    assert all(samples[("brokerha_backup_ready", (("backup", b),))] == 1 for b in backups)
    # a backup holds the replicated queue and says what it is
    b = scrape(cluster, backups[0])
    assert b[("brokerha_role", (("role", "backup"),))] == 1
    assert b[("brokerha_epoch", ())] == epoch
    assert b[("brokerha_queue_messages_ready", queue)] == 18  # the unacked one is still there
    assert b[("brokerha_failovers_total", (("event", "elected"),))] == 0


def test_status_page_shows_every_node(cluster: LocalCluster) -> None:
    primary = cluster.wait_primary()
    backup = next(n for n in cluster.names if n != primary)
    ctype, body = get(cluster.admin_url(backup) + "/status")
    html = body.decode()
    assert ctype.startswith("text/html")
    assert len(body) < 20_000 and "<script>" in html and "http://" not in html.split("<script>")[1]
    for name in cluster.names:
        assert f"data-node='{name}'" in html
    assert "not running on this node" in html          # TxLog section
    assert f"primary: <b>{primary}</b>" in html
    assert "Recent failovers" in html and "elected" in html
    _, part = get(cluster.admin_url(primary) + "/status?part=body")
    assert part.decode().startswith("<p") and "<html" not in part.decode()
    view = json.loads(get(cluster.admin_url(backup) + "/api/cluster")[1])
    assert view["primary"] == primary
    assert {n["name"]: n["role"] for n in view["nodes"]}[primary] == "primary"


def test_ctl_queues_connections_users_permissions_txlog(cluster: LocalCluster) -> None:
    primary = cluster.wait_primary()
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(primary)))
    try:
        conn.channel().queue_declare("ctl-q", durable=True)
        done = ctl(cluster, "queues", "--json")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["node"] == primary
        assert "ctl-q" in {q["name"] for q in answer["queues"]}
        assert "ctl-q" in ctl(cluster, "queues").stdout
        done = ctl(cluster, "connections", "--json")
        assert done.returncode == 0, done.stderr
        conns = json.loads(done.stdout)["connections"]
        assert len(conns) >= 1 and conns[0]["user"] == "guest"
        assert "guest" in ctl(cluster, "connections").stdout
    finally:
        conn.close()
    users = json.loads(ctl(cluster, "users", "--json").stdout)["users"]
    assert {"name": "guest", "tags": ["administrator"], "loopback_only": True,
            "vhosts": ["/"]} in users
    assert "password" not in json.dumps(users)
    perms = json.loads(ctl(cluster, "permissions", "--json").stdout)["permissions"]
    assert {"user": "guest", "vhost": "/", "configure": ".*", "write": ".*",
            "read": ".*"} in perms
    assert "guest" in ctl(cluster, "permissions").stdout
    txlog = ctl(cluster, "txlog", "status", "--json")
    assert txlog.returncode == 0 and json.loads(txlog.stdout)["running"] is False
    assert "not running" in ctl(cluster, "txlog", "status").stdout
    # users and connections are for administrators only
    denied = ctl(cluster, "--user", "nobody", "--password", "x", "users")
    assert denied.returncode == 1 and "401" in denied.stderr


def test_metrics_count_a_failover(cluster: LocalCluster) -> None:
    """Last in the module: kills the primary."""
    old = cluster.wait_primary()
    cluster.kill(old)
    new = cluster.wait_primary(30, other_than=old)
    samples = scrape(cluster, new)
    assert samples[("brokerha_failovers_total", (("event", "elected"),))] == 1
    assert samples[("brokerha_last_failover_timestamp_seconds", ())] > time.time() - 60
    html = get(cluster.admin_url(new) + "/status")[1].decode()
    assert f"data-node='{old}'" in html and ">down<" in html
