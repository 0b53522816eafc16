"""Differential (issue 34): RabbitMQ 3.10.8's own definitions export imported into brokerha.

Definitions are made on a private RabbitMQ node through its management API
(vhosts, users with passwords and tags, permissions, topic permissions, a
policy, an operator policy, an exchange, a queue, a binding); its
``GET /api/definitions`` is posted to brokerha's ``POST /api/definitions``; the
users then log in to brokerha with their RabbitMQ passwords (the hashes moved,
not the passwords), the policy acts, and brokerha's own export holds the same
definitions in the same shape as RabbitMQ's (exported again and compared, and
imported into RabbitMQ). Bad files are refused with RabbitMQ's answer and
change nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pika
import pytest

from tests.management_http import call

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(300)]

# rabbit_node, rabbit_api, brokerha_node and brokerha_api: conftest.py

# the lists of an export, and what identifies an entry in each
KEYS = {"users": ("name",), "vhosts": ("name",), "permissions": ("user", "vhost"),
        "topic_permissions": ("user", "vhost", "exchange"), "policies": ("vhost", "name"),
        "parameters": ("component", "vhost", "name"), "queues": ("vhost", "name"),
        "exchanges": ("vhost", "name"),
        "bindings": ("vhost", "source", "destination", "routing_key")}


def make_definitions(base: str, s: str) -> None:
    """What an operator has on a RabbitMQ node: everything named with ``s``."""
    steps: list[tuple[str, str, Any]] = [
        ("PUT", f"/vhosts/app-{s}", {"description": "the app", "tags": "prod"}),
        ("PUT", f"/users/svc-{s}", {"password": "svc-pw", "tags": "management"}),
        ("PUT", f"/users/ops-{s}", {"password": "ops-pw", "tags": "administrator,monitoring"}),
        ("PUT", f"/users/nopw-{s}", {"tags": ""}),
        ("PUT", f"/permissions/app-{s}/svc-{s}", {"configure": "^(svc|pol)\\.", "write": ".*",
                                                   "read": ".*"}),
        ("PUT", f"/permissions/app-{s}/ops-{s}", {"configure": ".*", "write": ".*",
                                                   "read": ".*"}),
        ("PUT", f"/topic-permissions/app-{s}/svc-{s}", {"exchange": "amq.topic",
                                                         "write": "^orders\\.", "read": ".*"}),
        ("PUT", f"/policies/app-{s}/limits", {"pattern": "^pol\\.", "apply-to": "queues",
                                              "priority": 2, "definition": {
                                                  "max-length": 2, "message-ttl": 60000}}),
        ("PUT", f"/operator-policies/app-{s}/cap", {"pattern": ".*", "apply-to": "queues",
                                                    "definition": {"max-length": 1000}}),
        ("PUT", f"/exchanges/app-{s}/events", {"type": "topic", "durable": True}),
        ("PUT", f"/queues/app-{s}/svc.inbox", {"durable": True,
                                               "arguments": {"x-max-priority": 5}}),
        ("POST", f"/bindings/app-{s}/e/events/q/svc.inbox", {"routing_key": "orders.#"}),
    ]
    for method, path, body in steps:
        status, answer = call(base, method, path, body=body)
        assert status in (201, 204), (base, path, status, answer)


def canonical(entries: list[Any]) -> list[str]:
    return sorted(json.dumps(e, sort_keys=True) for e in entries)


def mine(export: dict[str, Any], s: str) -> dict[str, list[Any]]:
    """The export's lists, only the entries this test made, in a fixed order."""
    out = {}
    for key, ident in KEYS.items():
        entries = [e for e in export.get(key) or []
                   if s in json.dumps([e.get(k) for k in ident])]
        out[key] = sorted(entries, key=lambda e, i=ident: json.dumps([e.get(k) for k in i]))
    return out


def login(node: Any, vhost: str, user: str, password: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", node.port, vhost, pika.PlainCredentials(user, password),
        connection_attempts=1, socket_timeout=5))


@pytest.fixture(scope="module")
def exported(rabbit_api: str) -> tuple[str, dict[str, Any]]:
    s = uuid.uuid4().hex[:8]
    make_definitions(rabbit_api, s)
    status, export = call(rabbit_api, "GET", "/definitions")
    assert status == 200
    return s, export


def test_rabbitmqs_export_imported_users_log_in_with_their_rabbitmq_passwords(
        exported: tuple[str, dict[str, Any]], brokerha_api: str, brokerha_node: Any) -> None:
    s, export = exported
    status, answer = call(brokerha_api, "POST", "/definitions", body=export)
    assert (status, answer) == (204, None)  # RabbitMQ answers an import with 204 too
    assert call(brokerha_api, "GET", "/whoami", user=f"svc-{s}", password="svc-pw")[1] == {
        "name": f"svc-{s}", "tags": ["management"]}
    assert call(brokerha_api, "GET", "/whoami", user=f"svc-{s}", password="wrong")[0] == 401
    assert call(brokerha_api, "GET", "/whoami", user=f"nopw-{s}", password="")[0] == 401
    with login(brokerha_node, f"app-{s}", f"svc-{s}", "svc-pw") as conn:
        ch = conn.channel()
        ch.queue_declare(f"pol.{s}")  # the imported policy: max-length 2
        for i in range(3):
            ch.basic_publish("", f"pol.{s}", str(i).encode())
        deadline = time.monotonic() + 5
        while ch.queue_declare(f"pol.{s}", passive=True).method.message_count != 2:
            assert time.monotonic() < deadline, "the imported policy does not act"
            time.sleep(0.05)
        # the imported binding routes, the imported topic permission refuses
        ch.basic_publish("events", "orders.new", b"o")
        deadline = time.monotonic() + 5
        while ch.queue_declare("svc.inbox", passive=True).method.message_count != 1:
            assert time.monotonic() < deadline, "the imported binding does not route"
            time.sleep(0.05)
        ch.queue_delete(f"pol.{s}")  # not one of the file's: the exports compare those
    with login(brokerha_node, f"app-{s}", f"svc-{s}", "svc-pw") as conn:
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.queue_declare(f"other.{s}")  # configure is ^(svc|pol)\.
        assert refused.value.reply_code == 403


def test_brokerhas_export_holds_what_rabbitmqs_held(exported: tuple[str, dict[str, Any]],
                                                    brokerha_api: str, rabbit_api: str) -> None:
    s, theirs = exported
    assert call(brokerha_api, "POST", "/definitions", body=theirs)[0] == 204
    status, ours = call(brokerha_api, "GET", "/definitions")
    assert status == 200
    assert {"rabbit_version", "rabbitmq_version", "product_name", "product_version",
            "users", "vhosts", "permissions", "topic_permissions", "parameters",
            "global_parameters", "policies", "queues", "exchanges", "bindings"} <= set(ours)
    assert ours["product_name"] == "brokerha" and ours["rabbit_version"] == "3.10.8"
    assert mine(ours, s) == mine(theirs, s)  # password hashes included: moved as they were
    # and brokerha's export goes back into RabbitMQ as it is
    back = json.loads(json.dumps(ours).replace(s, s[::-1]))
    assert call(rabbit_api, "POST", "/definitions", body=back)[0] == 204
    _, again = call(rabbit_api, "GET", "/definitions")
    assert mine(again, s[::-1]) == json.loads(json.dumps(mine(ours, s)).replace(s, s[::-1]))


def test_a_vhosts_export_and_import(exported: tuple[str, dict[str, Any]], brokerha_api: str,
                                    rabbit_api: str) -> None:
    """``/api/definitions/{vhost}``: that vhost's policies, parameters, queues, exchanges and
    bindings, no users or vhosts, as RabbitMQ's; imported into another vhost."""
    s, _ = exported
    assert call(brokerha_api, "POST", "/definitions", body=exported[1])[0] == 204
    theirs = call(rabbit_api, "GET", f"/definitions/app-{s}")[1]
    ours = call(brokerha_api, "GET", f"/definitions/app-{s}")[1]
    assert set(ours) == set(theirs)
    for key in ("policies", "parameters", "queues", "exchanges", "bindings"):
        assert canonical(ours[key]) == canonical(theirs[key]), key
    for base in (rabbit_api, brokerha_api):
        assert call(base, "PUT", f"/vhosts/copy-{s}", body={})[0] == 201
        assert call(base, "POST", f"/definitions/copy-{s}", body=theirs)[0] == 204
    copies = [call(base, "GET", f"/definitions/copy-{s}")[1] for base in (rabbit_api,
                                                                           brokerha_api)]
    for key in ("policies", "queues", "exchanges", "bindings"):
        assert canonical(copies[1][key]) == canonical(copies[0][key]), key


BAD_FILES: dict[str, Any] = {
    "a user with a bad password hash": {"users": [{"name": "bad-{s}", "password_hash": "abc",
                                                   "tags": ""}]},
    "a permission with a bad regex": {
        "vhosts": [{"name": "v-{s}"}],
        "users": [{"name": "u-{s}", "password_hash": "", "tags": ""}],
        "permissions": [{"user": "u-{s}", "vhost": "v-{s}", "configure": "(", "write": "",
                         "read": ""}]},
    "a policy with an unknown key": {
        "vhosts": [{"name": "v-{s}"}],
        "policies": [{"vhost": "v-{s}", "name": "p", "pattern": ".*", "apply-to": "all",
                      "priority": 0, "definition": {"nonesuch": 1}}]},
    "an operator policy with a key only policies have": {
        "vhosts": [{"name": "v-{s}"}],
        "parameters": [{"vhost": "v-{s}", "component": "operator_policy", "name": "op",
                        "value": {"pattern": ".*", "apply-to": "queues", "priority": 0,
                                  "definition": {"dead-letter-exchange": "x"}}}]},
    "a parameter of a plugin brokerha does not have": {
        "vhosts": [{"name": "v-{s}"}],
        "parameters": [{"vhost": "v-{s}", "component": "federation-upstream", "name": "up",
                        "value": {"uri": "amqp://elsewhere"}}]},
    "a permission for a user neither there nor in the file": {
        "vhosts": [{"name": "v-{s}"}],
        "permissions": [{"user": "nobody-{s}", "vhost": "v-{s}", "configure": ".*",
                         "write": ".*", "read": ".*"}]},
    "a queue in a vhost neither there nor in the file": {
        "queues": [{"name": "q", "vhost": "nonesuch-{s}", "durable": True,
                    "auto_delete": False, "arguments": {}}]},
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_refused_and_changes_nothing_on_brokerha(
        case: str, rabbit_api: str, brokerha_api: str) -> None:
    s = uuid.uuid4().hex[:8]
    body = json.loads(json.dumps(BAD_FILES[case]).replace("{s}", s))
    theirs = call(rabbit_api, "POST", "/definitions", body=body)
    ours = call(brokerha_api, "POST", "/definitions", body=body)
    assert ours == theirs  # RabbitMQ's 400 and reason
    # RabbitMQ applies a file in order and keeps what came before the error; brokerha
    # checks the whole file first and changes nothing
    export = call(brokerha_api, "GET", "/definitions")[1]
    assert all(not v for v in mine(export, s).values()), mine(export, s)
