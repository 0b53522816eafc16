"""``brokerha ctl`` user, vhost and permission verbs, named and worded as rabbitmqctl's,
on a running node: each change acts (logins, permissions) and is what the API shows."""

from __future__ import annotations

import uuid

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker, ProbableAuthenticationError

from brokerha.testing import NodeProcess
from tests.ops.test_policies import api, ctl

pytestmark = pytest.mark.timeout(180)

ALL = {"configure": ".*", "write": ".*", "read": ".*"}


def ok(node: NodeProcess, *argv: str) -> str:
    done = ctl(node, *argv)
    assert done.returncode == 0, (argv, done.stdout, done.stderr)
    return done.stdout


def refused(node: NodeProcess, *argv: str) -> str:
    done = ctl(node, *argv)
    assert done.returncode == 1, (argv, done.stdout, done.stderr)
    return done.stderr.strip()


def login(node: NodeProcess, vhost: str, user: str, password: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", node.port, vhost, pika.PlainCredentials(user, password),
        connection_attempts=1, socket_timeout=5))


def test_a_service_account_made_and_unmade_with_ctl(managed_node: NodeProcess) -> None:
    node, s = managed_node, uuid.uuid4().hex[:8]
    v, u = f"v-{s}", f"u-{s}"
    assert ok(node, "add_vhost", v, "--description", "team", "--tags", "a,b") == \
        f'Adding vhost "{v}" ...\n'
    assert ok(node, "add_user", u, "pw1") == f'Adding user "{u}" ...\n'
    assert refused(node, "add_user", u, "pw1").endswith(f'Error:\nUser "{u}" already exists')
    assert ok(node, "set_permissions", "-p", v, u, "^q-", ".*", ".*") == \
        f'Setting permissions for user "{u}" in vhost "{v}" ...\n'
    assert ok(node, "set_topic_permissions", "-p", v, u, "amq.topic", "^t\\.", ".*") == \
        f'Setting topic permissions on "amq.topic" for user "{u}" in vhost "{v}" ...\n'
    assert api(node, "GET", f"/vhosts/{v}")[1]["tags"] == ["a", "b"]

    conn = login(node, v, u, "pw1")
    ch = conn.channel()
    ch.queue_declare(f"q-{s}")
    with pytest.raises(ChannelClosedByBroker, match="403"):
        ch.queue_declare(f"other-{s}")  # configure only ^q-
    conn.close()

    lines = ok(node, "list_permissions", "-p", v).splitlines()
    assert lines[0] == f'Listing permissions for vhost "{v}" ...'
    assert lines[1] == "user\tconfigure\twrite\tread"
    assert f"{u}\t^q-\t.*\t.*" in lines
    assert ok(node, "list_user_permissions", u).splitlines()[1:] == [
        "vhost\tconfigure\twrite\tread", f"{v}\t^q-\t.*\t.*"]
    assert f"{u}\tamq.topic\t^t\\.\t.*" in ok(node, "list_topic_permissions", "-p", v)
    assert v in ok(node, "list_vhosts").splitlines()

    assert ok(node, "set_user_tags", u, "monitoring", "management") == \
        f'Setting tags for user "{u}" to [monitoring, management] ...\n'
    assert f"{u}\t[monitoring, management]" in ok(node, "list_users").splitlines()
    login(node, v, u, "pw1").close()  # the tags kept the password
    assert ok(node, "change_password", u, "pw2") == f'Changing password for user "{u}" ...\n'
    with pytest.raises(ProbableAuthenticationError):
        login(node, v, u, "pw1")
    login(node, v, u, "pw2").close()

    assert ok(node, "clear_topic_permissions", "-p", v, u).startswith("Clearing topic")
    assert ok(node, "clear_permissions", "-p", v, u) == \
        f'Clearing permissions for user "{u}" in vhost "{v}" ...\n'
    assert api(node, "GET", f"/permissions/{v}/{u}")[0] == 404
    assert ok(node, "delete_user", u) == f'Deleting user "{u}" ...\n'
    assert refused(node, "delete_user", u).endswith(f'Error:\nUser "{u}" does not exist')
    assert refused(node, "change_password", u, "x").endswith(f'User "{u}" does not exist')
    assert refused(node, "set_permissions", "-p", v, u, ".*", ".*", ".*").endswith(
        f"Error:\nUser {u} does not exist")
    assert ok(node, "delete_vhost", v) == f'Deleting vhost "{v}" ...\n'
    assert refused(node, "delete_vhost", v).endswith(f"Virtual host '{v}' does not exist")
    assert api(node, "GET", f"/vhosts/{v}")[0] == 404


def test_only_an_administrator_changes_definitions(managed_node: NodeProcess) -> None:
    s = uuid.uuid4().hex[:8]
    done = ctl(managed_node, "--user", "watcher", "--password", "w-secret", "add_vhost",
               f"v-{s}")
    assert done.returncode == 1 and "Not administrator user" in done.stderr, done.stderr
    assert api(managed_node, "GET", f"/vhosts/v-{s}")[0] == 404


def test_the_api_answers_with_rabbitmqs_codes_and_logs_who_changed_what(
        managed_node: NodeProcess) -> None:
    """The codes without a RabbitMQ node beside (tests/differential compares them with it)."""
    node, s = managed_node, uuid.uuid4().hex[:8]
    v, u = f"v-{s}", f"u-{s}"
    assert api(node, "PUT", f"/vhosts/{v}", {"description": "d"}) == (201, None)
    assert api(node, "PUT", f"/vhosts/{v}", {"description": "e"}) == (204, None)
    assert api(node, "PUT", f"/users/{u}", {"password": "pw"}) == (
        400, {"error": "bad_request", "reason": "tags_not_present"})
    assert api(node, "PUT", f"/users/{u}", {"password": "pw", "tags": ""}) == (201, None)
    assert api(node, "PUT", f"/permissions/{v}/{u}", {"configure": ".*"}) == (
        400, {"error": "bad_request", "reason": "[{key_missing,write},{key_missing,read}]"})
    assert api(node, "PUT", f"/permissions/{v}/nobody-{s}", ALL) == (
        400, {"error": "bad_request", "reason": "vhost_or_user_not_found"})
    status, answer = api(node, "PUT", f"/permissions/{v}/{u}",
                         {"configure": "(", "write": ".*", "read": ".*"})
    assert status == 400 and answer["reason"][0] == "invalid_regexp"
    assert api(node, "GET", f"/permissions/{v}/{u}")[0] == 404  # nothing changed
    assert api(node, "PUT", f"/permissions/{v}/{u}", ALL) == (201, None)
    assert api(node, "PUT", f"/users/{u}", {"password": "x", "tags": ""}, user="alice",
               password="a-secret") == (401, {"error": "not_authorised",
                                              "reason": "Not administrator user"})
    assert api(node, "DELETE", f"/users/{u}") == (204, None)
    assert api(node, "DELETE", f"/users/{u}")[0] == 404
    assert api(node, "GET", f"/permissions/{v}/{u}")[0] == 404  # went with the user
    assert api(node, "DELETE", f"/vhosts/{v}") == (204, None)
    assert api(node, "DELETE", f"/vhosts/{v}")[0] == 404
    logged = "\n".join(node.log)
    assert f"management API: guest created user '{u}'" in logged
    assert f"management API: guest deleted vhost '{v}'" in logged
