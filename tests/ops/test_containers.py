"""The image built from docker/, three nodes in containers (testcontainers), SIGKILL.

Runs in the default suite when a Docker engine answers or docker/engine.sh can
start one (root); skipped with the reason otherwise. Fresh machine cost: the
engine (apt-get install docker.io if missing, then a few seconds), the base
image (debootstrap, about a minute), the node image (about 1.5 minutes on the
vfs driver; skipped when an image of the same source is there), then the test
itself (under a minute). See docs/operations.md.
"""

from __future__ import annotations

import time

import pika
import pytest

from brokerha.testing_containers import BrokerhaClusterContainers
from tests.failover.clients import ConfirmedPublisher, drain

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]

FAST = {"heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
        "backup_timeout": 3.0}
QUEUE = "containers-orders"


def declare(ch: object) -> None:
    ch.queue_declare(QUEUE, durable=True)  # type: ignore[attr-defined]


def test_sigkill_of_the_primary_container_loses_no_confirmed_message(
        brokerha_image: str) -> None:
    with BrokerhaClusterContainers(3, image=brokerha_image, options=FAST) as cluster:
        primary = cluster.wait_primary(60)
        for name in cluster.names:
            if name != primary:
                cluster.wait_ready(name, 60)
        # the image's HEALTHCHECK command says ready on the primary and on a caught-up backup
        for name in cluster.names:
            code, out = cluster.containers[name].get_wrapped_container().exec_run(
                ["/opt/brokerha/bin/python", "/usr/local/bin/brokerha-healthcheck"])
            assert code == 0, out
        # the node runs as the image's non-root user, its data on the volume
        code, out = cluster.containers[primary].get_wrapped_container().exec_run(["id", "-u"])
        assert out.decode().strip() == "10001"

        publisher = ConfirmedPublisher(cluster.urls, QUEUE, declare=declare, limit=100_000)
        publisher.start()
        deadline = time.monotonic() + 60
        while len(publisher.confirmed) < 300 and time.monotonic() < deadline:
            assert publisher.error is None, publisher.error
            time.sleep(0.05)
        assert len(publisher.confirmed) >= 300, "publishing through pika did not start"
        cluster.kill(primary)  # docker kill: SIGKILL
        assert not cluster.containers[primary].running()
        new = cluster.wait_primary(60, other_than=primary)
        before = len(publisher.confirmed)
        deadline = time.monotonic() + 60
        while len(publisher.confirmed) < before + 200 and time.monotonic() < deadline:
            assert publisher.error is None, publisher.error
            time.sleep(0.05)
        publisher.stop_event.set()
        publisher.join(30)
        assert publisher.error is None, publisher.error
        assert len(publisher.confirmed) >= before + 200, "no confirms from the new primary"
        assert publisher.reconnects >= 1

        got = drain([cluster.url(new)], QUEUE)
        missing = sorted(set(publisher.confirmed) - set(got))
        assert not missing, f"{len(missing)} confirmed messages lost, e.g. {missing[:10]}"
        st = cluster.status(new)
        assert st is not None and st["node"]["epoch"] >= 2


def test_a_standalone_container_serves_pika(brokerha_image: str) -> None:
    from brokerha.testing_containers import BrokerhaContainer

    with BrokerhaContainer(brokerha_image, name="solo") as node:
        conn = pika.BlockingConnection(pika.URLParameters(node.amqp_url))
        try:
            ch = conn.channel()
            ch.queue_declare("solo-q")
            ch.basic_publish("", "solo-q", b"hello")
            method, _, body = ch.basic_get("solo-q", auto_ack=True)
            assert body == b"hello"
        finally:
            conn.close()
        status = node.node_status()
        assert status is not None and status["node"]["role"] == "standalone"
