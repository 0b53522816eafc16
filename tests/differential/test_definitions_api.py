"""Differential (issue 34): the definitions API of RabbitMQ 3.10's management plugin and brokerha's.

Each case is a short scenario of HTTP calls (vhosts, users, permissions, topic
permissions, policies, operator policies; the right caller and the wrong one;
good input and bad), made against a private RabbitMQ node and against brokerha
with names unique to the run. Every step's status and body are compared:
errors exactly (``error`` and ``reason``, RabbitMQ's texts; a bad regular
expression's reason quotes PCRE's message and offset, which brokerha words as
PCRE does for the common mistakes); answers field by field for the
fields RabbitMQ has (brokerha may add its own), the password hash as present or
not, lists restricted to the scenario's objects.

Then the operator walk of issue 34, with Debian's unmodified ``rabbitmqadmin``
(shipped by the rabbitmq-server package) and pika: 5/5 steps on both.
Skipped when rabbitmq-server is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika
import pytest

from brokerha.broker.auth import check_password, hash_password
from tests.management_http import call

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(300)]

# rabbit_node, rabbit_api, brokerha_node and brokerha_api: conftest.py

ALL = {"configure": ".*", "write": ".*", "read": ".*"}
HASH_OF_PW = hash_password("pw", b"\x01\x02\x03\x04")  # RabbitMQ's salted SHA-256 of "pw"


@dataclass
class Step:
    method: str
    path: str
    body: Any = None
    user: str = "guest"
    password: str = "guest"


def put(path: str, body: Any = None, **kw: Any) -> Step:
    return Step("PUT", path, {} if body is None else body, **kw)


def get(path: str, **kw: Any) -> Step:
    return Step("GET", path, **kw)


def delete(path: str, **kw: Any) -> Step:
    return Step("DELETE", path, **kw)


def post(path: str, body: Any, **kw: Any) -> Step:
    return Step("POST", path, body, **kw)


@dataclass
class Case:
    steps: list[Step] = field(default_factory=list)


def vhost_user_permission(tags: str = "management") -> list[Step]:
    """v-{s}, u-{s} with password pw and ``tags``, full permissions of u-{s} in v-{s}."""
    return [put("/vhosts/v-{s}"), put("/users/u-{s}", {"password": "pw", "tags": tags}),
            put("/permissions/v-{s}/u-{s}", ALL)]


def callers() -> list[Step]:
    """A monitoring, a management and a policymaker user (pm-{s} with permissions in v-{s})."""
    return [put("/vhosts/v-{s}"),
            put("/users/mon-{s}", {"password": "m", "tags": "monitoring"}),
            put("/users/mg-{s}", {"password": "g", "tags": "management"}),
            put("/permissions/v-{s}/mg-{s}", ALL),
            put("/users/pm-{s}", {"password": "p", "tags": "policymaker"}),
            put("/permissions/v-{s}/pm-{s}", ALL)]


def policy_refused(definition: Any, **extra: Any) -> list[Step]:
    return [put("/vhosts/v-{s}"),
            put("/policies/v-{s}/p", {"pattern": "^x", "definition": definition, **extra}),
            get("/policies/v-{s}/p")]


MON = {"user": "mon-{s}", "password": "m"}
MG = {"user": "mg-{s}", "password": "g"}
PM = {"user": "pm-{s}", "password": "p"}
POLICY = {"pattern": "^pol\\.", "definition": {"message-ttl": 1000, "max-length": 2},
          "apply-to": "queues", "priority": 1}
TOPIC = {"exchange": "amq.topic", "write": "^a", "read": "^b"}

CASES: dict[str, list[Step]] = {
    # -- vhosts ----------------------------------------------------------------------------
    "a vhost created, created again, read, deleted, deleted again": [
        put("/vhosts/v-{s}"), put("/vhosts/v-{s}"), get("/vhosts/v-{s}"), get("/vhosts"),
        delete("/vhosts/v-{s}"), get("/vhosts/v-{s}"), delete("/vhosts/v-{s}")],
    "a vhost with a description and tags": [
        put("/vhosts/v-{s}", {"description": "orders of {s}", "tags": "a,b"}),
        get("/vhosts/v-{s}")],
    "the creator of a vhost gets full permissions in it": [
        put("/vhosts/v-{s}"), get("/vhosts/v-{s}/permissions")],
    "a missing vhost": [get("/vhosts/nonesuch-{s}"), delete("/vhosts/nonesuch-{s}")],
    # -- users -----------------------------------------------------------------------------
    "a user created, created again, read, deleted, deleted again": [
        put("/users/u-{s}", {"password": "pw", "tags": "management"}),
        put("/users/u-{s}", {"password": "pw", "tags": "management"}),
        get("/users/u-{s}"), get("/users"), delete("/users/u-{s}"), get("/users/u-{s}"),
        delete("/users/u-{s}")],
    "a user's tags as a list": [
        put("/users/u-{s}", {"password": "pw", "tags": ["administrator", "monitoring"]}),
        get("/users/u-{s}")],
    "a user without the tags key": [put("/users/u-{s}", {"password": "pw"}),
                                    get("/users/u-{s}")],
    "a user without a password (no password login)": [
        put("/users/u-{s}", {"tags": "management"}), get("/users/u-{s}"),
        get("/whoami", user="u-{s}", password="")],
    "a user with an empty password_hash": [
        put("/users/u-{s}", {"password_hash": "", "tags": ""}), get("/users/u-{s}")],
    "a password_hash that is not base64": [
        put("/users/u-{s}", {"password_hash": "abc", "tags": ""}), get("/users/u-{s}")],
    "a user from RabbitMQ's password_hash logs in with the password": [
        put("/users/u-{s}", {"password_hash": HASH_OF_PW,
                             "hashing_algorithm": "rabbit_password_hashing_sha256",
                             "tags": "management"}),
        get("/whoami", user="u-{s}", password="pw"),
        get("/whoami", user="u-{s}", password="other")],
    "a changed password refuses the old one": [
        put("/users/u-{s}", {"password": "old", "tags": "management"}),
        get("/whoami", user="u-{s}", password="old"),
        put("/users/u-{s}", {"password": "new", "tags": "management"}),
        get("/whoami", user="u-{s}", password="old"),
        get("/whoami", user="u-{s}", password="new")],
    "a user's tags changed": [
        put("/users/u-{s}", {"password": "pw", "tags": "management"}),
        put("/users/u-{s}", {"password": "pw", "tags": "monitoring"}),
        get("/users/u-{s}"), get("/whoami", user="u-{s}", password="pw")],
    "a user changed without a password can no longer log in with it": [
        put("/users/u-{s}", {"password": "pw", "tags": "management"}),
        put("/users/u-{s}", {"tags": "monitoring"}), get("/users/u-{s}"),
        get("/whoami", user="u-{s}", password="pw")],
    "a missing user": [get("/users/nonesuch-{s}"), delete("/users/nonesuch-{s}")],
    "users deleted in bulk": [
        put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/users/w-{s}", {"password": "pw", "tags": ""}),
        post("/users/bulk-delete", {"users": ["u-{s}", "w-{s}"]}),
        get("/users/u-{s}"), get("/users/w-{s}")],
    "users without permissions": [
        *vhost_user_permission(), put("/users/w-{s}", {"password": "pw", "tags": ""}),
        get("/users/without-permissions")],
    "a deleted user's permissions go with it": [
        *vhost_user_permission(), delete("/users/u-{s}"), get("/permissions/v-{s}/u-{s}"),
        get("/vhosts/v-{s}/permissions")],
    # -- permissions -----------------------------------------------------------------------
    "permissions set, set again, read, listed, cleared, cleared again": [
        put("/vhosts/v-{s}"), put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/permissions/v-{s}/u-{s}", {"configure": "^c", "write": "^w", "read": "^r"}),
        put("/permissions/v-{s}/u-{s}", ALL), get("/permissions/v-{s}/u-{s}"),
        get("/permissions"), get("/vhosts/v-{s}/permissions"), get("/users/u-{s}/permissions"),
        delete("/permissions/v-{s}/u-{s}"), get("/permissions/v-{s}/u-{s}"),
        delete("/permissions/v-{s}/u-{s}")],
    "a permission with a bad regex": [
        put("/vhosts/v-{s}"), put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/permissions/v-{s}/u-{s}", {"configure": "(", "write": ".*", "read": ".*"},
            ),
        get("/permissions/v-{s}/u-{s}")],
    "a permission without write and read": [
        put("/vhosts/v-{s}"), put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/permissions/v-{s}/u-{s}", {"configure": ".*"}),
        get("/permissions/v-{s}/u-{s}")],
    "a permission in an unknown vhost": [
        put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/permissions/nonesuch-{s}/u-{s}", ALL), get("/users/u-{s}/permissions")],
    "a permission for an unknown user": [
        put("/vhosts/v-{s}"), put("/permissions/v-{s}/nonesuch-{s}", ALL),
        get("/vhosts/v-{s}/permissions")],
    # -- topic permissions -----------------------------------------------------------------
    "topic permissions set, set again, read, listed, cleared, cleared again": [
        put("/vhosts/v-{s}"), put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/topic-permissions/v-{s}/u-{s}", TOPIC),
        put("/topic-permissions/v-{s}/u-{s}", TOPIC),
        get("/topic-permissions/v-{s}/u-{s}"), get("/topic-permissions"),
        delete("/topic-permissions/v-{s}/u-{s}"), get("/topic-permissions/v-{s}/u-{s}"),
        delete("/topic-permissions/v-{s}/u-{s}")],
    "a topic permission with a bad regex": [
        put("/vhosts/v-{s}"), put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/topic-permissions/v-{s}/u-{s}", {**TOPIC, "write": "("}, ),
        get("/topic-permissions/v-{s}/u-{s}")],
    "a topic permission without an exchange": [
        put("/vhosts/v-{s}"), put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/topic-permissions/v-{s}/u-{s}", {"write": "x", "read": "y"})],
    "a topic permission without write and read": [
        put("/vhosts/v-{s}"), put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/topic-permissions/v-{s}/u-{s}", {"exchange": "amq.topic"})],
    "a topic permission in an unknown vhost": [
        put("/users/u-{s}", {"password": "pw", "tags": ""}),
        put("/topic-permissions/nonesuch-{s}/u-{s}", TOPIC)],
    # -- policies --------------------------------------------------------------------------
    "a policy set, set again, read, listed, cleared, cleared again": [
        put("/vhosts/v-{s}"), put("/policies/v-{s}/p", POLICY), put("/policies/v-{s}/p", POLICY),
        get("/policies/v-{s}/p"), get("/policies/v-{s}"), get("/policies"),
        delete("/policies/v-{s}/p"), get("/policies/v-{s}/p"), delete("/policies/v-{s}/p")],
    "a policy's defaults (apply-to all, priority 0)": [
        put("/vhosts/v-{s}"), put("/policies/v-{s}/p", {"pattern": "^x",
                                                         "definition": {"expires": 60000}}),
        get("/policies/v-{s}/p")],
    "a policy of every key brokerha acts on": [
        put("/vhosts/v-{s}"),
        put("/policies/v-{s}/p", {"pattern": "^x", "apply-to": "queues", "definition": {
            "message-ttl": 1000, "expires": 60000, "max-length": 10, "max-length-bytes": 1000,
            "overflow": "reject-publish", "dead-letter-exchange": "dlx",
            "dead-letter-routing-key": "dl", "delivery-limit": 5, "queue-mode": "lazy"}}),
        put("/policies/v-{s}/ae", {"pattern": "^x", "apply-to": "exchanges",
                                   "definition": {"alternate-exchange": "ae"}}),
        get("/policies/v-{s}")],
    "a policy with a bad regex": [
        put("/vhosts/v-{s}"),
        put("/policies/v-{s}/p", {"pattern": "(", "definition": {"message-ttl": 1}},
            ), get("/policies/v-{s}/p")],
    "a policy with an unknown key": policy_refused({"nonesuch": 1000}),
    "a policy with a message-ttl that is a string": policy_refused({"message-ttl": "abc"}),
    "a policy with a negative message-ttl": policy_refused({"message-ttl": -1}),
    "a policy with a max-length that is not an integer": policy_refused({"max-length": 1.5}),
    "a policy with an unknown overflow": policy_refused({"overflow": "bogus"}),
    "a policy with an empty definition": policy_refused({}),
    "a policy with an unknown apply-to": policy_refused({"message-ttl": 1}, **{"apply-to": "x"}),
    "a policy with a priority that is a string": policy_refused({"message-ttl": 1},
                                                               priority="high"),
    "a policy without a definition": [
        put("/vhosts/v-{s}"), put("/policies/v-{s}/p", {"pattern": "^x"})],
    "a policy without a pattern": [
        put("/vhosts/v-{s}"), put("/policies/v-{s}/p", {"definition": {"message-ttl": 1}})],
    "a policy in an unknown vhost": [
        put("/policies/nonesuch-{s}/p", {"pattern": "^x", "definition": {"max-length": 1}})],
    "a missing policy": [put("/vhosts/v-{s}"), get("/policies/v-{s}/nonesuch"),
                         delete("/policies/v-{s}/nonesuch")],
    "a deleted vhost's policies and permissions go with it": [
        *vhost_user_permission(), put("/policies/v-{s}/p", POLICY), delete("/vhosts/v-{s}"),
        get("/permissions/v-{s}/u-{s}"), get("/users/u-{s}/permissions"),
        get("/policies")],
    # -- operator policies -----------------------------------------------------------------
    "an operator policy set, read, listed, cleared, cleared again": [
        put("/vhosts/v-{s}"),
        put("/operator-policies/v-{s}/op", {"pattern": ".*", "apply-to": "queues",
                                            "definition": {"message-ttl": 1000,
                                                           "max-length": 5}}),
        get("/operator-policies/v-{s}/op"), get("/operator-policies/v-{s}"),
        get("/operator-policies"), delete("/operator-policies/v-{s}/op"),
        get("/operator-policies/v-{s}/op"), delete("/operator-policies/v-{s}/op")],
    "an operator policy with a key only user policies have": [
        put("/vhosts/v-{s}"),
        put("/operator-policies/v-{s}/op", {"pattern": ".*", "apply-to": "queues",
                                            "definition": {"dead-letter-exchange": "x"}}),
        get("/operator-policies/v-{s}/op")],
    # -- who may ---------------------------------------------------------------------------
    "a management user adds a vhost": [
        *callers(), put("/vhosts/w-{s}", **MG), get("/vhosts/w-{s}")],
    "a monitoring user deletes a vhost": [
        *callers(), delete("/vhosts/v-{s}", **MON), get("/vhosts/v-{s}")],
    "a monitoring user adds a user": [
        *callers(), put("/users/x-{s}", {"password": "x", "tags": ""}, **MON),
        get("/users/x-{s}")],
    "a monitoring user deletes a user": [
        *callers(), delete("/users/mg-{s}", **MON), get("/users/mg-{s}")],
    "a management user lists the users": [*callers(), get("/users", **MG)],
    "a monitoring user sets and lists permissions": [
        *callers(), put("/permissions/v-{s}/mon-{s}", ALL, **MON), get("/permissions", **MON),
        get("/permissions/v-{s}/mon-{s}")],
    "a monitoring user clears permissions": [
        *callers(), delete("/permissions/v-{s}/mg-{s}", **MON), get("/permissions/v-{s}/mg-{s}")],
    "a policymaker sets topic permissions": [
        *callers(), put("/topic-permissions/v-{s}/pm-{s}", TOPIC, **PM),
        get("/topic-permissions/v-{s}/pm-{s}")],
    "a policymaker sets and clears a policy in its vhost": [
        *callers(), put("/policies/v-{s}/p", POLICY, **PM), get("/policies/v-{s}/p", **PM),
        delete("/policies/v-{s}/p", **PM), get("/policies/v-{s}/p")],
    "a policymaker sets a policy where it has no permissions": [
        *callers(), put("/vhosts/w-{s}"), put("/policies/w-{s}/p", POLICY, **PM),
        get("/policies/w-{s}/p")],
    "a monitoring user sets a policy": [
        *callers(), put("/policies/v-{s}/p", POLICY, **MON), get("/policies/v-{s}/p")],
    "a management user sets a policy": [
        *callers(), put("/policies/v-{s}/p", POLICY, **MG), get("/policies/v-{s}/p")],
    "a policymaker sets an operator policy": [
        *callers(), put("/operator-policies/v-{s}/op", {"pattern": ".*", "definition": {
            "max-length": 1}}, **PM), get("/operator-policies/v-{s}/op")],
    "who reads the policies": [
        *callers(), put("/policies/v-{s}/p", POLICY),
        get("/policies/v-{s}", **MON), get("/policies/v-{s}", **MG), get("/policies", **MG),
        get("/operator-policies", **PM)],
}

# what RabbitMQ answers that tools do not rely on, or that names the node or time
VOLATILE = {"cluster_state"}


def expand(value: Any, suffix: str) -> Any:
    return json.loads(json.dumps(value).replace("{s}", suffix))


def run(base: str, steps: list[Step], suffix: str) -> list[tuple[int, Any]]:
    return [call(base, s.method, expand(s.path, suffix), user=expand(s.user, suffix),
                 password=expand(s.password, suffix), body=expand(s.body, suffix))
            for s in steps]


def mine(item: Any, suffix: str) -> bool:
    """An object of this scenario (its name, user or vhost carries the run's suffix)."""
    return suffix in json.dumps(item)


def order(item: Any) -> str:
    if isinstance(item, dict):
        return json.dumps([item.get(k) for k in ("vhost", "name", "user", "exchange")])
    return json.dumps(item)


def project(theirs: Any, ours: Any, suffix: str) -> tuple[Any, Any]:
    """RabbitMQ's answer and brokerha's, reduced to what is compared."""
    if isinstance(theirs, dict) and "error" in theirs and isinstance(ours, dict):
        return theirs, ours
    if isinstance(theirs, list) and isinstance(ours, list):
        theirs = sorted((t for t in theirs if mine(t, suffix)), key=order)
        ours = sorted((o for o in ours if mine(o, suffix)), key=order)
        if len(theirs) != len(ours):
            return theirs, ours
        pairs = [project(t, o, suffix) for t, o in zip(theirs, ours, strict=True)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    if isinstance(theirs, dict) and isinstance(ours, dict):
        keep = [k for k in theirs if k not in VOLATILE]
        t = {k: normal(k, theirs[k]) for k in keep}
        o = {k: normal(k, ours[k]) if k in ours else "<missing>" for k in keep}
        return t, o
    return theirs, ours


def normal(key: str, value: Any) -> Any:
    if key == "password_hash":  # salted: compared as set or not (its use is checked apart)
        return bool(value)
    return value


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_answers_as_rabbitmqs_definitions_api(case: str, rabbit_api: str,
                                                   brokerha_api: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    steps = CASES[case]
    theirs = run(rabbit_api, steps, suffix)
    ours = run(brokerha_api, steps, suffix)
    for step, t, o in zip(steps, theirs, ours, strict=True):
        expected, got = project(t[1], o[1], suffix)
        where = f"{step.method} {expand(step.path, suffix)} as {expand(step.user, suffix)}"
        assert (o[0], got) == (t[0], expected), where


def test_a_user_keeps_the_password_hash_it_was_given(rabbit_api: str,
                                                      brokerha_api: str) -> None:
    """A hash imported as is (the password never seen), and a set password hashed as
    RabbitMQ does (salted SHA-256: the hash checks the password with RabbitMQ's scheme)."""
    for base in (rabbit_api, brokerha_api):
        suffix = uuid.uuid4().hex[:8]
        assert call(base, "PUT", f"/users/h-{suffix}",
                    body={"password_hash": HASH_OF_PW, "tags": ""})[0] == 201
        assert call(base, "GET", f"/users/h-{suffix}")[1]["password_hash"] == HASH_OF_PW, base
        assert call(base, "PUT", f"/users/p-{suffix}",
                    body={"password": "secret", "tags": ""})[0] == 201
        entry = call(base, "GET", f"/users/p-{suffix}")[1]
        assert entry["hashing_algorithm"] == "rabbit_password_hashing_sha256", base
        assert check_password("secret", entry["password_hash"]), base
        assert not check_password("other", entry["password_hash"]), base


WRONG_TYPES: dict[str, tuple[str, Any]] = {
    "a password that is a number": ("/users/t-{s}", {"password": 5, "tags": ""}),
    "tags that are a number": ("/users/t-{s}", {"password": "x", "tags": 5}),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_wrong_types_where_rabbitmq_crashes_get_a_400(case: str, rabbit_api: str,
                                                      brokerha_api: str) -> None:
    """RabbitMQ's plugin answers these with a 500 (a crash, no body); brokerha refuses them
    with RabbitMQ's 400 shape and creates nothing, as for other bad input."""
    path, body = WRONG_TYPES[case]
    suffix = uuid.uuid4().hex[:8]
    path, body = expand(path, suffix), expand(body, suffix)
    assert call(rabbit_api, "PUT", path, body=body)[0] == 500
    status, answer = call(brokerha_api, "PUT", path, body=body)
    assert status == 400 and answer["error"] == "bad_request" and answer["reason"], answer
    assert call(brokerha_api, "GET", path)[0] == 404


# -- the operator walk of issue 34 with Debian's rabbitmqadmin ---------------------------------

RABBITMQADMIN = shutil.which("rabbitmqadmin")


@dataclass
class Target:
    name: str
    http_port: int
    amqp_port: int


def admin(target: Target, *args: str) -> subprocess.CompletedProcess[str]:
    """Debian's unmodified rabbitmqadmin (its own /usr/bin/python3) against ``target``."""
    assert RABBITMQADMIN is not None
    return subprocess.run([RABBITMQADMIN, "-H", "127.0.0.1", "-P", str(target.http_port),
                           "-u", "guest", "-p", "guest", *args],
                          capture_output=True, text=True, timeout=30)


def amqp(target: Target, vhost: str, user: str, password: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", target.amqp_port, vhost, pika.PlainCredentials(user, password),
        connection_attempts=1, socket_timeout=5, blocked_connection_timeout=10))


def refused(login: Callable[[], pika.BlockingConnection]) -> bool:
    try:
        login().close()
    except (pika.exceptions.ProbableAuthenticationError,
            pika.exceptions.ProbableAccessDeniedError):
        return True
    return False


def walk(target: Target) -> dict[str, str]:
    """The five steps of the issue's table; each "ok" or what went wrong."""
    s = uuid.uuid4().hex[:8]
    vhost, user = f"walk-{s}", f"svc-{s}"
    out: dict[str, str] = {}

    def step(name: str, body: Callable[[], None]) -> None:
        try:
            body()
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the step's failure is the result
            out[name] = f"{type(exc).__name__}: {exc}"

    def ran(*args: str) -> None:
        done = admin(target, *args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)

    def create_and_log_in() -> None:
        ran("declare", "vhost", f"name={vhost}")
        ran("declare", "user", f"name={user}", "password=pw1", "tags=")
        ran("declare", "permission", f"vhost={vhost}", f"user={user}", "configure=.*",
            "write=.*", "read=.*")
        conn = amqp(target, vhost, user, "pw1")
        conn.channel().queue_declare(f"q-{s}")
        conn.close()

    def policy_acts() -> None:
        ran(f"--vhost={vhost}", "declare", "policy", "name=limits", "pattern=^pol\\.",
            'definition={"message-ttl": 1500, "max-length": 2}', "apply-to=queues")
        conn = amqp(target, vhost, user, "pw1")
        ch = conn.channel()
        ch.queue_declare(f"pol.{s}")  # no arguments: the policy's keys act
        for i in range(3):
            ch.basic_publish("", f"pol.{s}", f"m{i}".encode())
        deadline = time.monotonic() + 5
        while ch.queue_declare(f"pol.{s}", passive=True).method.message_count != 2:
            assert time.monotonic() < deadline, "max-length 2 not applied"
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while ch.queue_declare(f"pol.{s}", passive=True).method.message_count != 0:
            assert time.monotonic() < deadline, "message-ttl 1500 ms not applied"
            time.sleep(0.2)
        conn.close()

    def password_change() -> None:
        ran("declare", "user", f"name={user}", "password=pw2", "tags=")
        assert refused(lambda: amqp(target, vhost, user, "pw1")), "the old password logs in"
        amqp(target, vhost, user, "pw2").close()

    def delete_user() -> None:
        ran("delete", "user", f"name={user}")
        assert refused(lambda: amqp(target, vhost, user, "pw2")), "a deleted user logs in"

    def delete_vhost() -> None:
        ran("delete", "vhost", f"name={vhost}")
        listed = admin(target, "-f", "raw_json", "list", "vhosts")
        assert vhost not in {v["name"] for v in json.loads(listed.stdout)}, listed.stdout

    step("declare vhost, user, permission; AMQP login as that user", create_and_log_in)
    step("a policy with message-ttl and max-length on ^pol\\. acts on a queue without "
         "arguments", policy_acts)
    step("a changed password refuses the old one", password_change)
    step("delete user", delete_user)
    step("delete vhost", delete_vhost)
    return out


@pytest.mark.skipif(RABBITMQADMIN is None, reason="no rabbitmqadmin (Debian's rabbitmq-server)")
def test_the_operator_walk_with_rabbitmqadmin_5_of_5_on_both(rabbit_node: Any,
                                                             brokerha_node: Any) -> None:
    theirs = walk(Target("RabbitMQ", rabbit_node.management_port, rabbit_node.ref.port))
    ours = walk(Target("brokerha", brokerha_node.port + 10000, brokerha_node.port))
    assert set(theirs.values()) == {"ok"}, theirs  # the walk itself is right
    assert ours == theirs
