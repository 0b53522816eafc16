"""Users, vhosts and permissions made through a backup's management API survive the
primary's SIGKILL (three real nodes, pika): the user logs in to the new primary, a user
deleted there has its connections closed, and a node that was away catches up."""

from __future__ import annotations

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, ProbableAuthenticationError

from brokerha.testing import LocalCluster
from tests.failover.test_failover import FAST, wait_all_ready
from tests.failover.test_policy_failover import api, until

pytestmark = pytest.mark.timeout(240)

ALL = {"configure": ".*", "write": ".*", "read": ".*"}


def login(cluster: LocalCluster, name: str, vhost: str, user: str,
          password: str) -> pika.BlockingConnection:
    port = int(cluster.url(name).rsplit(":", 1)[1].split("/")[0])
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", port, vhost, pika.PlainCredentials(user, password),
        connection_attempts=1, socket_timeout=5))


def try_login(cluster: LocalCluster, name: str, vhost: str, user: str,
              password: str) -> pika.BlockingConnection | None:
    try:
        return login(cluster, name, vhost, user, password)
    except (pika.exceptions.AMQPConnectionError, OSError):
        return None


def test_a_user_made_through_a_backup_logs_in_after_the_primary_is_killed() -> None:
    with LocalCluster(3, options=FAST) as cluster:
        primary = wait_all_ready(cluster)
        backup = next(n for n in cluster.names if n != primary)
        assert api(cluster, backup, "PUT", "/vhosts/team")[0] == 201
        assert api(cluster, backup, "PUT", "/users/svc",
                   {"password": "s3cret", "tags": "management"})[0] == 201
        assert api(cluster, backup, "PUT", "/permissions/team/svc",
                   {"configure": "^svc\\.", "write": ".*", "read": ".*"})[0] == 201
        login(cluster, primary, "team", "svc", "s3cret").channel().queue_declare(
            "svc.work", durable=True)

        cluster.kill(primary)
        new = cluster.wait_primary(30, other_than=primary)
        conn = until(lambda: try_login(cluster, new, "team", "svc", "s3cret"), 30)
        assert conn, "the user made before the failover does not log in"
        ch = conn.channel()
        assert ch.queue_declare("svc.work", passive=True).method.queue == "svc.work"
        with pytest.raises(ChannelClosedByBroker, match="403"):
            ch.queue_declare("other.work")  # the permission came along too
        status, users = api(cluster, new, "GET", "/users/svc")
        assert status == 200 and users["tags"] == ["management"]

        # changed on the new primary: at once, and for the node that comes back
        assert api(cluster, new, "PUT", "/users/svc", {"password": "n3w", "tags": ""})[0] == 204
        with pytest.raises(ProbableAuthenticationError):
            login(cluster, new, "team", "svc", "s3cret")
        assert api(cluster, new, "DELETE", "/users/svc")[0] == 204
        until(lambda: not conn.is_open or _closed(conn), 10)
        assert not conn.is_open, "the deleted user's connection stays open"
        cluster.start_node(primary)  # it was away: the catch-up brings the deletion
        cluster.wait_ready(primary, 60)
        status, _ = api(cluster, primary, "GET", "/users/svc")  # forwarded to the primary
        assert status == 404
        # its own copy (not forwarded): the user it had before it was killed is gone
        status, local = api(cluster, primary, "GET", "/brokerha/users")
        assert status == 200 and "svc" not in {u["name"] for u in local["users"]}
        assert "team" in {v for u in local["users"] for v in u["vhosts"]}


def _closed(conn: pika.BlockingConnection) -> bool:
    try:
        conn.process_data_events(time_limit=0.1)
    except pika.exceptions.ConnectionClosedByBroker:
        return True
    return not conn.is_open
