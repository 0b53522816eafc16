"""Policies that act, on a node, through RabbitMQ's management API and an AMQP client (pika).

The issue's step: ``PUT /api/policies/v/p`` with ``message-ttl`` and ``max-length`` on
``^pol\\.``, then a queue declared without arguments obeys it; a changed policy acts on the
existing queue at once; ``/api/queues`` shows ``policy``, ``operator_policy`` and
``effective_policy_definition`` as RabbitMQ does.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from brokerha.testing import NodeProcess
from tests.management_http import call

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def node(managed_node: NodeProcess) -> Iterator[NodeProcess]:
    yield managed_node
    for kind in ("policies", "operator-policies"):
        for p in api(managed_node, "GET", f"/{kind}")[1] or []:
            api(managed_node, "DELETE", f"/{kind}/{quote(p['vhost'])}/{p['name']}")


def quote(vhost: str) -> str:
    return "%2F" if vhost == "/" else vhost


def api(node: NodeProcess, method: str, path: str, body: Any = None,
        user: str = "guest", password: str = "guest") -> tuple[int, Any]:
    return call(f"http://127.0.0.1:{node.port + 10000}/api", method, path, user, password, body)


def channel(node: NodeProcess) -> pika.adapters.blocking_connection.BlockingChannel:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", node.port))
    return conn.channel()


def publish(ch: Any, queue: str, *bodies: bytes) -> None:
    for body in bodies:
        ch.basic_publish("", queue, body)


def depth(ch: Any, queue: str) -> int:
    return ch.queue_declare(queue, passive=True).method.message_count


def test_a_queue_declared_without_arguments_obeys_the_policy(node: NodeProcess) -> None:
    status, _ = api(node, "PUT", "/policies/%2F/p", {
        "pattern": "^pol\\.", "definition": {"message-ttl": 300, "max-length": 2},
        "apply-to": "queues"})
    assert status == 201
    ch = channel(node)
    ch.queue_declare("pol.a")
    ch.queue_declare("other.a")
    for queue in ("pol.a", "other.a"):
        publish(ch, queue, b"1", b"2", b"3")
    assert depth(ch, "pol.a") == 2 and depth(ch, "other.a") == 3
    first = ch.basic_get("pol.a", auto_ack=True)[2]
    assert first == b"2"  # max-length dropped the oldest
    time.sleep(0.6)
    assert depth(ch, "pol.a") == 0 and depth(ch, "other.a") == 3  # the TTL expired the rest
    status, entry = api(node, "GET", "/queues/%2F/pol.a")
    assert (entry["policy"], entry["operator_policy"], entry["effective_policy_definition"]) \
        == ("p", None, {"max-length": 2, "message-ttl": 300})
    status, entry = api(node, "GET", "/queues/%2F/other.a")
    assert (entry["policy"], entry["effective_policy_definition"]) == (None, {})


def test_a_changed_policy_acts_on_the_existing_queue_at_once(node: NodeProcess) -> None:
    ch = channel(node)
    ch.queue_declare("pol.b")
    publish(ch, "pol.b", *[str(i).encode() for i in range(10)])
    assert api(node, "PUT", "/policies/%2F/p", {
        "pattern": "^pol\\.", "definition": {"max-length": 6}})[0] == 201
    assert depth(ch, "pol.b") == 6
    assert api(node, "PUT", "/policies/%2F/p", {
        "pattern": "^pol\\.", "definition": {"max-length": 3}})[0] == 204
    assert depth(ch, "pol.b") == 3
    assert ch.basic_get("pol.b", auto_ack=True)[2] == b"7"
    assert api(node, "PUT", "/operator-policies/%2F/cap", {
        "pattern": ".", "definition": {"max-length": 1}, "priority": 1})[0] == 201
    assert depth(ch, "pol.b") == 1
    entry = api(node, "GET", "/queues/%2F/pol.b")[1]
    assert (entry["policy"], entry["operator_policy"], entry["effective_policy_definition"]) \
        == ("p", "cap", {"max-length": 1})
    assert api(node, "DELETE", "/operator-policies/%2F/cap")[0] == 204
    assert api(node, "DELETE", "/policies/%2F/p")[0] == 204
    publish(ch, "pol.b", b"a", b"b", b"c")
    assert depth(ch, "pol.b") == 4  # no limit any more


def test_the_alternate_exchange_of_a_policy_catches_unroutable_messages(
        node: NodeProcess) -> None:
    ch = channel(node)
    ch.exchange_declare("pol.x", "direct")
    ch.queue_declare("caught")
    ch.queue_bind("caught", "amq.fanout")
    assert api(node, "PUT", "/policies/%2F/ae", {
        "pattern": "^pol\\.x$", "apply-to": "exchanges",
        "definition": {"alternate-exchange": "amq.fanout"}})[0] == 201
    ch.basic_publish("pol.x", "nowhere", b"lost?")
    assert ch.basic_get("caught", auto_ack=True)[2] == b"lost?"
    assert api(node, "GET", "/exchanges/%2F/pol.x")[1]["policy"] == "ae"
    assert "policy" not in api(node, "GET", "/exchanges/%2F/amq.topic")[1]


def test_who_may_read_and_change_policies(node: NodeProcess) -> None:
    policy = {"pattern": "^x", "definition": {"max-length": 1}}
    assert api(node, "PUT", "/policies/%2F/p", policy) == (201, None)
    # a management user without permissions in / sees no policy of it, may change none
    assert api(node, "GET", "/policies", user="alice", password="a-secret") == (200, [])
    assert api(node, "GET", "/policies/%2F", user="alice", password="a-secret") == (
        401, {"error": "not_authorised", "reason": "User not authorised to access virtual host"})
    assert api(node, "PUT", "/policies/%2F/q", policy, user="alice", password="a-secret") == (
        401, {"error": "not_authorised", "reason": "User not authorised to access object"})
    # monitoring reads the list of its vhosts, not one policy
    assert api(node, "GET", "/policies", user="watcher", password="w-secret")[1][0]["name"] == "p"
    assert api(node, "GET", "/policies/%2F/p", user="watcher", password="w-secret")[0] == 401
    assert api(node, "PUT", "/operator-policies/%2F/o", policy, user="watcher",
               password="w-secret") == (
        401, {"error": "not_authorised", "reason": "Not administrator user"})
    assert api(node, "GET", "/policies/%2F/p")[1] == {
        "vhost": "/", "name": "p", "pattern": "^x", "apply-to": "all",
        "definition": {"max-length": 1}, "priority": 0}


def test_bad_policies_get_rabbitmqs_400_and_change_nothing(node: NodeProcess) -> None:
    assert api(node, "PUT", "/policies/%2F/p", {"pattern": "^x",
                                                 "definition": {"max-length": -1}}) == (
        400, {"error": "bad_request",
              "reason": "Validation failed\n\n-1 is not a valid maximum length\n"})
    assert api(node, "GET", "/policies/%2F/p")[0] == 404
    # RabbitMQ escapes HTML in a policy's reasons, not in an operator policy's
    assert api(node, "PUT", "/policies/%2F/p", {"pattern": "^x",
                                                 "definition": {"overflow": "x"}})[1]["reason"] \
        == "Validation failed\n\n&lt;&lt;\"x\"&gt;&gt; is not a valid overflow value\n"
    assert api(node, "PUT", "/operator-policies/%2F/o", {
        "pattern": "^x", "definition": {"max-length": "x"}})[1]["reason"] \
        == "Validation failed\n\n<<\"x\">> is not a valid maximum length\n"
    assert api(node, "PUT", "/policies/nonesuch/p", {"pattern": "^x",
                                                      "definition": {"max-length": 1}}) == (
        404, {"error": "not_found", "reason": "vhost_not_found"})
    assert api(node, "DELETE", "/policies/%2F/p")[0] == 404


def ctl(node: NodeProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           f"http://127.0.0.1:{node.port + 10000}", *argv],
                          capture_output=True, text=True, timeout=60)


def test_ctl_sets_lists_and_clears_policies_as_rabbitmqctl(node: NodeProcess) -> None:
    done = ctl(node, "set_policy", "--priority", "3", "--apply-to", "queues", "c1", "^c\\.",
               '{"max-length":4}')
    assert done.returncode == 0, done.stderr
    assert done.stdout == ('Setting policy "c1" for pattern "^c\\." to "{"max-length":4}" '
                           'with priority "3" for vhost "/" ...\n')
    assert ctl(node, "set_operator_policy", "-p", "/", "o1", ".", '{"message-ttl":100}'
               ).returncode == 0
    listed = ctl(node, "list_policies")
    assert listed.stdout == ('Listing policies for vhost "/" ...\n'
                             "vhost\tname\tpattern\tapply-to\tdefinition\tpriority\n"
                             '/\tc1\t^c\\.\tqueues\t{"max-length":4}\t3\n')
    assert "o1\t.\tall\t{\"message-ttl\":100}\t0" in ctl(node, "list_operator_policies").stdout
    assert api(node, "GET", "/policies/%2F/c1")[1]["definition"] == {"max-length": 4}
    refused = ctl(node, "set_policy", "bad", "^c", '{"max-length":-1}')
    assert refused.returncode == 1
    assert "Error:\nValidation failed\n\n-1 is not a valid maximum length" in refused.stderr
    assert ctl(node, "set_policy", "bad", "^c", "nojson").returncode == 1
    assert api(node, "GET", "/policies/%2F/bad")[0] == 404
    cleared = ctl(node, "clear_policy", "c1")
    assert (cleared.returncode, cleared.stdout) == (0, 'Clearing policy "c1" on vhost "/" ...\n')
    again = ctl(node, "clear_policy", "c1")
    assert again.returncode == 1 and "Parameter does not exist" in again.stderr
    assert ctl(node, "clear_operator_policy", "o1").returncode == 0
    assert ctl(node, "list_policies").stdout == 'Listing policies for vhost "/" ...\n'
