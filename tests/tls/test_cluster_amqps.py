"""amqps against a 3-node HA cluster through a failover: pika, aio-pika, kombu and Celery.

``LocalCluster(tls=True)`` is what ``./scripts/run-local --tls`` starts: the
certificates of ``brokerha tls make-certs`` in DIR/tls, an amqps listener per
node (client certificates checked) and TLS on the node-to-node links.
"""

from __future__ import annotations

import json
import signal
import socket
import ssl
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlencode

import kombu
import pika
import pika.exceptions
import pytest

from brokerha.certs import issue, load_ca
from brokerha.testing import LocalCluster, get_json
from tests.failover.clients import (
    AioPikaConsumer,
    ConfirmedPublisher,
    celery_add,
    connect_any,
    drain,
    wait_count,
)

pytestmark = pytest.mark.timeout(120)

FAST = {"heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
        "backup_timeout": 3.0}
QUEUE = "tls-orders"


@pytest.fixture()
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options=FAST, tls=True) as c:
        yield c


def amqps_port(cluster: LocalCluster, name: str) -> int:
    return cluster.port(name) + len(cluster.names)


def aio_pika_url(cluster: LocalCluster, name: str) -> str:
    tls = cluster.data_dir / "tls"
    query = urlencode({"cafile": tls / "ca.pem", "certfile": tls / "client-guest.pem",
                       "keyfile": tls / "client-guest.key", "auth": "external"})
    return f"amqps://localhost:{amqps_port(cluster, name)}/?{query}"


def kombu_ssl(cluster: LocalCluster) -> dict[str, object]:
    tls = cluster.data_dir / "tls"
    return {"ca_certs": str(tls / "ca.pem"), "cert_reqs": ssl.CERT_REQUIRED,
            "certfile": str(tls / "client-guest.pem"), "keyfile": str(tls / "client-guest.key"),
            "server_hostname": "localhost"}


def external_params(cluster: LocalCluster, name: str, client: str) -> pika.ConnectionParameters:
    tls = cluster.data_dir / "tls"
    ctx = ssl.create_default_context(cafile=str(tls / "ca.pem"))
    ctx.load_cert_chain(str(tls / f"{client}.pem"), str(tls / f"{client}.key"))
    return pika.ConnectionParameters(port=amqps_port(cluster, name), connection_attempts=1,
                                     ssl_options=pika.SSLOptions(ctx, "localhost"),
                                     credentials=pika.credentials.ExternalCredentials())


def external_through_a_backup(cluster: LocalCluster, primary: str, backup: str) -> None:
    """SASL EXTERNAL on a backup's amqps listener: the backup checks the certificate, the
    relay preamble names its user, the primary logs the client in (or refuses it) as
    if the client had connected to it."""
    tls = cluster.data_dir / "tls"
    ca = load_ca(tls)
    assert ca is not None
    issue(ca, tls, "nobody", stem="client-nobody", client_only=True)
    with pika.BlockingConnection(external_params(cluster, backup, "client-guest")) as conn:
        conn.channel().queue_declare("", exclusive=True)
    wait_logged(cluster, primary, "(guest) opened vhost '/'")
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as info:
        pika.BlockingConnection(external_params(cluster, backup, "client-nobody"))
    assert "ACCESS_REFUSED - Login was refused using authentication mechanism EXTERNAL" \
        in str(info.value)
    wait_logged(cluster, primary, "EXTERNAL login refused: user 'nobody' - invalid credentials")


def wait_logged(cluster: LocalCluster, name: str, text: str, timeout: float = 5.0) -> None:
    """Until ``text`` is in the node's log (read by another thread)."""
    deadline = time.monotonic() + timeout
    while not any(text in line for line in list(cluster.nodes[name].log)):
        assert time.monotonic() < deadline, f"{name} did not log {text!r}"
        time.sleep(0.05)


def test_amqps_clients_through_a_primary_failover(cluster: LocalCluster) -> None:
    primary = cluster.wait_primary(30)
    for name in cluster.names:
        if name != primary:
            cluster.wait_ready(name, 30)
    pika_urls = [cluster.amqps_url(n) for n in cluster.names]
    # a backup terminates amqps and relays the connection to the primary
    backup = next(n for n in cluster.names if n != primary)
    relayed = connect_any([cluster.amqps_url(backup)], time.monotonic() + 5)
    status = cluster.status(backup)
    assert status is not None and status["node"]["relayed_connections"] == 1
    relayed.close()
    external_through_a_backup(cluster, primary, backup)

    consumer = AioPikaConsumer([aio_pika_url(cluster, n) for n in cluster.names], QUEUE)
    consumer.start()
    pub = ConfirmedPublisher(pika_urls, QUEUE, pause=0.002,
                             declare=lambda ch: ch.queue_declare(QUEUE, durable=True))  # type: ignore[attr-defined]
    pub.start()
    deadline = time.monotonic() + 20
    while len(pub.confirmed) < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pub.error is None and len(pub.confirmed) >= 100, pub.error
    # kombu connected before the kill, publishing (with confirms) after it: its ensure()
    # reconnects through the amqps URL list (round-robin) to the new primary
    urls = [f"amqps://guest:guest@localhost:{amqps_port(cluster, n)}//" for n in cluster.names]
    kombu_queue = f"kombu-through-{uuid.uuid4().hex[:8]}"
    through = kombu.Connection(";".join(urls), ssl=kombu_ssl(cluster), connect_timeout=3,
                               failover_strategy="round-robin",
                               transport_options={"confirm_publish": True})
    through.ensure_connection(max_retries=6, interval_start=0.1, interval_step=0.2)
    producer = through.Producer()
    publish = through.ensure(producer, producer.publish, max_retries=10, interval_start=0.1,
                             interval_step=0.2, interval_max=1)
    kq = kombu.Queue(kombu_queue, durable=True)
    publish({"n": "before"}, routing_key=kombu_queue, declare=[kq])
    cluster.kill(primary)
    new_primary = cluster.wait_primary(30, other_than=primary)
    publish({"n": "after"}, routing_key=kombu_queue, declare=[kq])
    with through.SimpleQueue(kombu_queue) as sq:
        payloads = [sq.get(timeout=5).payload for _ in range(2)]
    through.release()
    assert payloads == [{"n": "before"}, {"n": "after"}]
    at_kill = len(pub.confirmed)
    wait_count(lambda: len(pub.confirmed), at_kill + 100, 30)
    pub.stop_event.set()
    pub.join(30)
    assert pub.error is None, pub.error
    assert pub.reconnects >= 1 and len(pub.confirmed) >= at_kill + 100
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not set(pub.confirmed) <= set(consumer.consumed):
        time.sleep(0.1)
    consumer.stop_event.set()
    consumer.join(10)
    left = drain(pika_urls, QUEUE)
    missing = set(pub.confirmed) - set(consumer.consumed) - set(left)
    assert not missing, f"confirmed over amqps but never consumed: {sorted(missing)[:20]}"
    # the aio-pika consumer came back on the new primary: it got messages sent after the kill
    assert any(n >= at_kill for n in consumer.consumed)

    # kombu and a Celery worker find the new primary in the amqps URL list
    with kombu.Connection(";".join(urls), ssl=kombu_ssl(cluster), connect_timeout=3,
                          failover_strategy="round-robin") as conn:
        conn.ensure_connection(max_retries=6, interval_start=0.1, interval_step=0.2)
        name = f"kombu-tls-{uuid.uuid4().hex[:8]}"
        q = conn.SimpleQueue(name)
        q.put("after failover")
        msg = q.get(timeout=5)
        assert msg.payload == "after failover"
        msg.ack()
        q.close()


    assert celery_add("celery-tls", urls, broker_use_ssl=kombu_ssl(cluster),
                      broker_connection_max_retries=6,
                      broker_failover_strategy="round-robin") == 42

    # SIGHUP on the new primary reloads its amqps and [cluster.tls] certificates; the
    # links and clients carry on
    node = cluster.nodes[new_primary]
    assert node.proc is not None
    node.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while True:
        tls = get_json(cluster.admin_url(new_primary) + "/api/tls", 2)
        if tls["reloads"] == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert tls["reloads"] == 1 and tls["links"] == ["[cluster.tls]"]
    members = get_json(cluster.admin_url(new_primary) + "/api/status", 2)["members"]
    assert [m["amqps_url"] for m in members] == [
        f"amqps://127.0.0.1:{amqps_port(cluster, n)}" for n in cluster.names]
    connect_any([cluster.amqps_url(new_primary)], time.monotonic() + 5).close()
    assert cluster.primary() == new_primary


def test_with_plain_amqp_off_on_every_member_a_backup_relays_amqps_over_tls() -> None:
    """No plain listener anywhere: the relay reaches the primary's amqps listener, over TLS."""
    with LocalCluster(3, options=FAST, tls=True, extra_args=["--listen", "off"]) as cluster:
        primary = cluster.wait_primary(30)
        backup = next(n for n in cluster.names if n != primary)
        cluster.wait_ready(backup, 30)
        for name in cluster.names:
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", cluster.port(name)), timeout=1).close()
        conn = connect_any([cluster.amqps_url(backup)], time.monotonic() + 10)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            ch.queue_declare(QUEUE, durable=True)
            ch.basic_publish("", QUEUE, b"7")
            status = cluster.status(backup)
            assert status is not None and status["node"]["relayed_connections"] == 1
        finally:
            conn.close()
        external_through_a_backup(cluster, primary, backup)
        assert drain([cluster.amqps_url(primary)], QUEUE) == [7]


def test_members_read_each_other_over_https_with_the_plain_admin_listener_off() -> None:
    """``--admin off``: status, the cluster view and ``ctl status`` go over HTTPS."""
    import subprocess
    import sys

    with LocalCluster(3, options=FAST, tls=True, https_only=True) as cluster:
        primary = cluster.wait_primary(30)
        for name in cluster.names:
            if name != primary:
                cluster.wait_ready(name, 30)
        for name in cluster.names:  # no plain admin listener anywhere
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", cluster.port(name) + 10000),
                                         timeout=1).close()
        backup = next(n for n in cluster.names if n != primary)
        ctx = ssl.create_default_context(cafile=str(cluster.data_dir / "tls" / "ca.pem"))
        ctx.check_hostname = False
        view = get_json(cluster.admin_url(backup) + "/api/cluster", 5, ctx)
        roles = {n["name"]: n["role"] for n in view["nodes"]}
        assert roles[primary] == "primary" and sorted(roles.values()) == [
            "backup", "backup", "primary"], view
        assert view["queues"] is not None  # read from the primary, over HTTPS too
        done = subprocess.run(
            [sys.executable, "-m", "brokerha.cli", "ctl", "--node", cluster.admin_url(backup),
             "--ca", str(cluster.data_dir / "tls" / "ca.pem"), "status", "--json"],
            capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert {n["name"]: n["role"] for n in status["nodes"]} == roles
