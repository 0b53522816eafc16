"""``/api/vhosts``, ``/api/users``, ``/api/permissions``, ``/api/topic-permissions``:
the definitions changed at runtime, as RabbitMQ 3.10's management plugin does.

Paths, bodies, status codes and reasons are RabbitMQ's (checked against its
plugin in tests/differential/test_definitions_api.py):

- ``PUT /api/vhosts/{v}`` (``description``, ``tags`` as "a,b" or a list,
  ``default_queue_type``): 201 new (its creator gets full permissions in it,
  as RabbitMQ's ``rabbit_vhost:put_vhost``), 204 updated; ``DELETE``: 204, the
  vhost's queues, exchanges, permissions and policies with it, its
  connections closed (320 ``vhost 'v' is deleted``); 404 if there is none;
- ``PUT /api/users/{u}`` (``password`` or ``password_hash`` with
  ``hashing_algorithm``, ``tags`` required): 201/204; neither password nor
  hash: a new user gets the hash of an empty password (no password login), an
  existing one loses its password (``clear_password``); ``DELETE``: 204 (its
  permissions with it, its connections closed: ``user 'u' is deleted``), 404;
  ``POST /api/users/bulk-delete``; ``GET /api/users/without-permissions``;
- ``PUT|DELETE|GET /api/permissions/{v}/{u}`` (``configure``, ``write``,
  ``read``, all required), ``/api/topic-permissions/{v}/{u}`` (``exchange``,
  ``write``, ``read``): 400 ``vhost_or_user_not_found``, 400 with the missing
  keys or the invalid regular expression; the lists by user and by vhost.

Every change path is ``administrator`` only (401 ``Not administrator user``),
goes into the node's ``Definitions`` (``broker/definitions.py``: stored,
replicated to the backups, acted on), is answered once it is durable where a
confirm would be (``Broker.after_durable``), and is logged at INFO with the
user who made it. On a cluster member that is not the primary the request is
forwarded to the primary (``management.py``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
from collections.abc import Callable
from typing import Any

from brokerha.admin.management import (
    Call,
    ManagementAPI,
    ManagementError,
    bad_request,
    decoded_body,
    not_found,
    require_admin,
)
from brokerha.broker import definitions as D
from brokerha.broker.auth import HASHES, hash_password
from brokerha.broker.broker import Broker
from brokerha.broker.definitions import DefinitionChange, Definitions
from brokerha.broker.policies import pcre_error
from brokerha.httpapi.server import Response

log = logging.getLogger("brokerha.management")

DURABLE_WAIT = 10.0  # seconds a change waits to be durable before its answer says so


async def apply_durably(broker: Broker, changes: list[DefinitionChange]) -> None:
    """Apply ``changes`` and return once they are durable as a confirm would be: in the
    store and, on an HA primary, on every ready backup. 503 if that does not come."""
    broker.definitions.apply_all(changes)
    done = asyncio.get_running_loop().create_future()
    broker.after_durable(lambda: done.done() or done.set_result(None))
    try:
        await asyncio.wait_for(done, DURABLE_WAIT)
    except TimeoutError:
        raise ManagementError(503, "service_unavailable",
                              "the change was made but is not yet durable on the cluster "
                              "(this node may no longer be its primary)") from None


def tag_list(value: Any) -> list[str]:
    """RabbitMQ's ``tag_list_from``: "a, b" or ["a", "b"]; anything else is a 400."""
    if isinstance(value, str):
        return [t.strip() for t in value.split(",") if t.strip()]
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return [t.strip() for t in value if t.strip()]
    raise bad_request(f"tags must be a comma-separated string or a list of strings, "
                      f"not {value!r}")


def required(body: dict[str, Any], *keys: str) -> list[Any]:
    """The values of ``keys``; RabbitMQ's 400 naming the missing ones."""
    missing = [k for k in keys if k not in body]
    if missing:
        raise bad_request("[" + ",".join(f"{{key_missing,{k}}}" for k in missing) + "]")
    values = [body[k] for k in keys]
    for key, value in zip(keys, values, strict=True):
        if not isinstance(value, str):
            raise bad_request(f"{key} must be a string, not {value!r}")
    return values


def checked_regex(pattern: str, as_chars: bool) -> None:
    """RabbitMQ's ``{invalid_regexp, Pattern, {Text, Position}}`` for a bad one (a
    permission's pattern comes out as a list of character codes, a topic one's as text)."""
    try:
        re.compile(pattern)
    except re.error as exc:
        text, at = pcre_error(exc, pattern)
        shown: Any = [ord(c) for c in pattern] if as_chars else pattern
        raise ManagementError(400, "bad_request", ["invalid_regexp", shown,  # type: ignore[arg-type]
                                                   [[ord(c) for c in text], at]]) from None


def user_entry(name: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "password_hash": value["password_hash"],
            "hashing_algorithm": value.get("hashing_algorithm", D.SHA256),
            "tags": list(value.get("tags", [])), "limits": {}}


def permission_entry(key: tuple[str, ...], value: dict[str, Any]) -> dict[str, Any]:
    return {"user": key[0], "vhost": key[1], **value}


def topic_permission_entry(key: tuple[str, ...], value: dict[str, Any]) -> dict[str, Any]:
    return {"user": key[0], "vhost": key[1], "exchange": key[2], **value}


class DefinitionsAPI:
    """The handlers, registered on the management API's router (``install``)."""

    def __init__(self, api: ManagementAPI) -> None:
        self.api = api
        r = api._route
        r("GET", "vhosts/{vhost}/permissions", self.vhost_permissions)
        r("GET", "vhosts/{vhost}/topic-permissions", self.vhost_topic_permissions)
        r("PUT", "vhosts/{vhost}", self.put_vhost)
        r("DELETE", "vhosts/{vhost}", self.delete_vhost)
        r("GET", "users", self.users)
        r("GET", "users/without-permissions", self.users_without_permissions)
        r("POST", "users/bulk-delete", self.bulk_delete_users)
        r("GET", "users/{user}", self.user)
        r("PUT", "users/{user}", self.put_user)
        r("DELETE", "users/{user}", self.delete_user)
        r("GET", "users/{user}/permissions", self.user_permissions)
        r("GET", "users/{user}/topic-permissions", self.user_topic_permissions)
        r("GET", "permissions", self.permissions)
        r("GET", "permissions/{vhost}/{user}", self.permission)
        r("PUT", "permissions/{vhost}/{user}", self.put_permission)
        r("DELETE", "permissions/{vhost}/{user}", self.delete_permission)
        r("GET", "topic-permissions", self.topic_permissions)
        r("GET", "topic-permissions/{vhost}/{user}", self.topic_permission)
        r("PUT", "topic-permissions/{vhost}/{user}", self.put_topic_permission)
        r("DELETE", "topic-permissions/{vhost}/{user}", self.delete_topic_permission)

    @property
    def definitions(self) -> Definitions:
        return self.api.node.broker.definitions

    async def _change(self, call: Call, changes: list[DefinitionChange], what: str) -> None:
        log.info("management API: %s %s", call.user.name, what)
        await apply_durably(self.api.node.broker, changes)

    # -- vhosts ----------------------------------------------------------------------------

    async def put_vhost(self, call: Call) -> Response:
        require_admin(call)
        name = call.params["vhost"]
        body = decoded_body(call)
        description = body.get("description", "")
        if not isinstance(description, str):
            raise bad_request(f"description must be a string, not {description!r}")
        queue_type = body.get("default_queue_type", body.get("defaultqueuetype"))
        if queue_type is not None and not isinstance(queue_type, str):
            raise bad_request(f"default_queue_type must be a string, not {queue_type!r}")
        value = D.vhost_value(description, tag_list(body.get("tags", "")), queue_type)
        existed = self.definitions.get(D.VHOST, name) is not None
        changes = [DefinitionChange(D.VHOST, (name,), value)]
        if not existed:  # its creator may use it (rabbit_vhost:put_vhost)
            changes.append(D.permission_set(call.user.name, name))
        await self._change(call, changes, f"{'updated' if existed else 'created'} vhost "
                                          f"'{name}' ({value})")
        return Response(204 if existed else 201, b"")

    async def delete_vhost(self, call: Call) -> None:
        require_admin(call)
        name = call.params["vhost"]
        changes = self.definitions.deleting(D.VHOST, name)
        if not changes:
            raise not_found()
        await self._change(call, changes, f"deleted vhost '{name}' with its queues, exchanges, "
                                          f"permissions and policies")

    def vhost_permissions(self, call: Call) -> list[dict[str, Any]]:
        return self._grants_of(call, "vhost", self.definitions.permissions, permission_entry)

    def vhost_topic_permissions(self, call: Call) -> list[dict[str, Any]]:
        return self._grants_of(call, "vhost", self.definitions.topic_permissions,
                               topic_permission_entry)

    # -- users -----------------------------------------------------------------------------

    def users(self, call: Call) -> list[dict[str, Any]]:
        require_admin(call)
        return [user_entry(name, value) for name, value in sorted(self.definitions.users.items())]

    def user(self, call: Call) -> dict[str, Any]:
        require_admin(call)
        value = self.definitions.users.get(call.params["user"])
        if value is None:
            raise not_found()
        return user_entry(call.params["user"], value)

    def users_without_permissions(self, call: Call) -> list[dict[str, Any]]:
        require_admin(call)
        with_permissions = {k[0] for k, _ in self.definitions.permissions()}
        return [user_entry(name, value) for name, value in sorted(self.definitions.users.items())
                if name not in with_permissions]

    async def put_user(self, call: Call) -> Response:
        require_admin(call)
        name = call.params["user"]
        value = self.user_value(name, decoded_body(call))
        existed = name in self.definitions.users
        await self._change(call, [DefinitionChange(D.USER, (name,), value)],
                           f"{'updated' if existed else 'created'} user '{name}' "
                           f"(tags {value['tags']})")
        return Response(204 if existed else 201, b"")

    def user_value(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """RabbitMQ's ``put_user``: the user's new definition, or its 400."""
        if "tags" not in body:
            raise bad_request("tags_not_present")
        tags = tag_list(body["tags"])
        if "password" in body and "password_hash" in body:
            raise bad_request("both_password_and_password_hash_are_provided")
        algorithm = body.get("hashing_algorithm", D.SHA256)
        if algorithm not in HASHES:
            raise bad_request(f"unknown hashing_algorithm {algorithm!r}")
        if "password_hash" in body:
            password_hash = body["password_hash"]
            if not isinstance(password_hash, str):
                raise bad_request(f"password_hash must be a string, not {password_hash!r}")
            try:
                base64.b64decode(password_hash, validate=True)
            except (binascii.Error, ValueError):
                raise ManagementError(400, "bad_request",
                                      ["not_base64", password_hash]) from None  # type: ignore[arg-type]
            return D.user_value(password_hash, tags, algorithm)
        password = body.get("password")
        if password is None:
            if name in self.definitions.users:
                return D.user_value("", tags)  # its password cleared (RabbitMQ's clear_password)
            password = ""  # a new user without a password: no password login
        if not isinstance(password, str):
            raise bad_request(f"password must be a string, not {password!r}")
        return D.user_value(hash_password(password), tags)

    async def delete_user(self, call: Call) -> None:
        require_admin(call)
        name = call.params["user"]
        changes = self.definitions.deleting(D.USER, name)
        if not changes:
            raise not_found()
        await self._change(call, changes, f"deleted user '{name}' with its permissions")

    async def bulk_delete_users(self, call: Call) -> None:
        require_admin(call)
        names = decoded_body(call).get("users")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad_request("users must be a list of user names")
        changes = [c for n in names for c in self.definitions.deleting(D.USER, n)]
        await self._change(call, changes, f"deleted users {names}")

    def user_permissions(self, call: Call) -> list[dict[str, Any]]:
        return self._grants_of(call, "user", self.definitions.permissions, permission_entry)

    def user_topic_permissions(self, call: Call) -> list[dict[str, Any]]:
        return self._grants_of(call, "user", self.definitions.topic_permissions,
                               topic_permission_entry)

    # -- permissions -----------------------------------------------------------------------

    def _grants_of(self, call: Call, owner: str, listing: Callable[..., list[Any]],
                   entry: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
        """The permissions or topic permissions (``listing``) of the path's ``owner``, a
        "vhost" or a "user"; 404 if it does not exist."""
        require_admin(call)
        name = call.params[owner]
        known = self.definitions.vhosts if owner == "vhost" else self.definitions.users
        if name not in known:
            raise not_found()
        return [entry(k, v) for k, v in listing(**{owner: name})]

    def permissions(self, call: Call) -> list[dict[str, Any]]:
        require_admin(call)
        return [permission_entry(k, v) for k, v in self.definitions.permissions()]

    def permission(self, call: Call) -> dict[str, Any]:
        require_admin(call)
        key = (call.params["user"], call.params["vhost"])
        value = self.definitions.get(D.PERMISSION, *key)
        if value is None:
            raise not_found()
        return permission_entry(key, value)

    def _vhost_and_user(self, call: Call) -> tuple[str, str]:
        vhost, user = call.params["vhost"], call.params["user"]
        if vhost not in self.definitions.vhosts or user not in self.definitions.users:
            raise bad_request("vhost_or_user_not_found")
        return vhost, user

    async def put_permission(self, call: Call) -> Response:
        require_admin(call)
        vhost, user = self._vhost_and_user(call)
        configure, write, read = required(decoded_body(call), "configure", "write", "read")
        for pattern in (configure, write, read):
            checked_regex(pattern, as_chars=True)
        existed = self.definitions.get(D.PERMISSION, user, vhost) is not None
        await self._change(call, [D.permission_set(user, vhost, configure, write, read)],
                           f"set permissions of user '{user}' in vhost '{vhost}': configure "
                           f"{configure!r}, write {write!r}, read {read!r}")
        return Response(204 if existed else 201, b"")

    async def delete_permission(self, call: Call) -> None:
        require_admin(call)
        user, vhost = call.params["user"], call.params["vhost"]
        if self.definitions.get(D.PERMISSION, user, vhost) is None:
            raise not_found()
        await self._change(call, [DefinitionChange(D.PERMISSION, (user, vhost), None)],
                           f"cleared permissions of user '{user}' in vhost '{vhost}'")

    # -- topic permissions -----------------------------------------------------------------

    def topic_permissions(self, call: Call) -> list[dict[str, Any]]:
        require_admin(call)
        return [topic_permission_entry(k, v) for k, v in self.definitions.topic_permissions()]

    def topic_permission(self, call: Call) -> list[dict[str, Any]]:
        require_admin(call)
        found = self.definitions.topic_permissions(user=call.params["user"],
                                                   vhost=call.params["vhost"])
        if not found:
            raise not_found()
        return [topic_permission_entry(k, v) for k, v in found]

    async def put_topic_permission(self, call: Call) -> Response:
        require_admin(call)
        vhost, user = self._vhost_and_user(call)
        exchange, write, read = required(decoded_body(call), "exchange", "write", "read")
        for pattern in (write, read):
            checked_regex(pattern, as_chars=False)
        existed = self.definitions.get(D.TOPIC_PERMISSION, user, vhost, exchange) is not None
        await self._change(call, [D.topic_permission_set(user, vhost, exchange, write, read)],
                           f"set topic permissions of user '{user}' in vhost '{vhost}' on "
                           f"exchange '{exchange}': write {write!r}, read {read!r}")
        return Response(204 if existed else 201, b"")

    async def delete_topic_permission(self, call: Call) -> None:
        require_admin(call)
        user, vhost = call.params["user"], call.params["vhost"]
        found = self.definitions.topic_permissions(user=user, vhost=vhost)
        if not found:
            raise not_found()
        await self._change(call, [DefinitionChange(D.TOPIC_PERMISSION, k, None)
                                  for k, _ in found],
                           f"cleared topic permissions of user '{user}' in vhost '{vhost}'")


def install(api: ManagementAPI) -> DefinitionsAPI:
    return DefinitionsAPI(api)
