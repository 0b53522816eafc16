"""``/api/policies`` and ``/api/operator-policies``, as RabbitMQ 3.10's management plugin.

Paths, bodies, status codes and reasons are RabbitMQ's (checked against its
management plugin in tests/differential/test_definitions_api.py):

- ``GET /api/policies[/{vhost}]``: a list by priority, ascending; an
  administrator sees every vhost's, another management user those of the
  vhosts it may use (401 ``User not authorised to access virtual host`` for
  another one's, 404 for an unknown vhost);
- ``GET|PUT|DELETE /api/policies/{vhost}/{name}``: an ``administrator``, or a
  ``policymaker`` with permissions in the vhost (else 401 ``User not
  authorised to access object``); ``PUT`` answers 201 (new) or 204, a bad body
  400 with RabbitMQ's reason (``broker/policies.py``), an unknown vhost 404
  ``vhost_not_found``; ``DELETE`` 204, or 404 when there is none;
- ``/api/operator-policies/...``: the same, for administrators only
  (``Not administrator user``) but the lists.

A change goes into the node's definitions (replicated to the backups, on
disk), whose listener applies it to the broker's queues and exchanges
(``broker/policy_effects.py``); it is logged with the user who made it. On a
cluster member that is not the primary the request is forwarded to it
(``management.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from brokerha.admin.management import (
    Call,
    ManagementAPI,
    ManagementError,
    bad_request,
    decoded_body,
    not_authorised,
    not_found,
    require_admin,
)
from brokerha.broker.definitions import DefinitionChange
from brokerha.broker.exchange import Exchange
from brokerha.broker.policies import (
    OPERATOR_POLICY,
    POLICY,
    PolicyBook,
    PolicyInvalid,
    parse,
)
from brokerha.broker.policy_effects import PolicyEffects
from brokerha.broker.queue import Queue
from brokerha.httpapi.server import Response

log = logging.getLogger("brokerha.management")

PATHS = {"policies": POLICY, "operator-policies": OPERATOR_POLICY}
NOUN = {POLICY: "policy", OPERATOR_POLICY: "operator policy"}


class PoliciesAPI:
    """The handlers, registered on the management API's router."""

    def __init__(self, api: ManagementAPI, effects: PolicyEffects) -> None:
        self.api = api
        self.effects = effects
        for path, kind in PATHS.items():
            api._route("GET", path, self._lister(kind))
            api._route("GET", f"{path}/{{vhost}}", self._lister(kind))
            api._route("GET", f"{path}/{{vhost}}/{{name}}", self._one(kind, self.get))
            api._route("PUT", f"{path}/{{vhost}}/{{name}}", self._one(kind, self.put))
            api._route("DELETE", f"{path}/{{vhost}}/{{name}}", self._one(kind, self.delete))

    @property
    def book(self) -> PolicyBook:
        return self.effects.book

    def fields(self, obj: Queue | Exchange, kind: str) -> dict[str, Any]:
        """What ``/api/queues`` (``kind`` queue) and ``/api/exchanges`` show of the policies:
        a queue always has the three fields; an exchange ``policy`` only when one applies."""
        applied = self.effects.applied(obj)
        if kind == "exchange":
            return {"policy": applied.policy_name} if applied.policy is not None else {}
        return {"policy": applied.policy_name or None,
                "operator_policy": applied.operator_policy_name or None,
                "effective_policy_definition": applied.definition}

    def _write(self, kind: str, vhost: str, name: str, value: dict[str, Any] | None) -> None:
        """Into the broker's definitions: stored, replicated, applied (policy_effects.py)."""
        self.api.node.broker.definitions.apply(DefinitionChange(kind, (vhost, name), value))

    # -- who may ---------------------------------------------------------------------------

    def _vhosts(self, call: Call) -> list[str]:
        """RabbitMQ's filter_vhost: an administrator sees every vhost, others their own."""
        names = sorted(self.api.node.broker.vhosts)
        if call.admin:
            return names
        return [v for v in names if v in call.user.permissions]

    def _may_change(self, call: Call, kind: str, vhost: str) -> None:
        if kind == OPERATOR_POLICY:
            require_admin(call)
            return
        if call.admin:
            return
        known = vhost in self.api.node.broker.vhosts
        if "policymaker" not in call.user.tags or (known and vhost not in call.user.permissions):
            raise not_authorised("User not authorised to access object")

    # -- handlers ----------------------------------------------------------------------------

    def _lister(self, kind: str) -> Callable[[Call], Any]:
        def handler(call: Call) -> Any:
            vhost = call.params.get("vhost")
            if vhost is not None:
                if vhost not in self.api.node.broker.vhosts:
                    raise not_found()
                if vhost not in self._vhosts(call):
                    raise not_authorised("User not authorised to access virtual host")
            visible = set(self._vhosts(call))
            return [p.as_json() for p in self.book.list(kind, vhost) if p.vhost in visible]
        return handler

    def _one(self, kind: str, method: Callable[[Call, str], Any]) -> Callable[[Call], Any]:
        def handler(call: Call) -> Any:
            self._may_change(call, kind, call.params["vhost"])
            return method(call, kind)
        return handler

    def get(self, call: Call, kind: str) -> Any:
        policy = self.book.get(kind, call.params["vhost"], call.params["name"])
        if policy is None:
            raise not_found()
        return policy.as_json()

    def put(self, call: Call, kind: str) -> Response:
        vhost, name = call.params["vhost"], call.params["name"]
        if vhost not in self.api.node.broker.vhosts:
            raise ManagementError(404, "not_found", "vhost_not_found")
        body = decoded_body(call)
        try:
            policy = parse(kind, vhost, name, body)
        except PolicyInvalid as exc:
            if exc.status == 500:
                raise ManagementError(500, "", "") from None
            # the policy handler escapes HTML in its reasons, the operator policy one does not
            raise bad_request(_escape_html(exc.reason) if kind == POLICY else exc.reason) \
                from None
        existed = self.book.get(kind, vhost, name) is not None
        if self.book.get(kind, vhost, name) != policy:
            self._write(kind, vhost, name, policy.value())
            log.info("management API: %s set %s '%s' in vhost '%s': pattern %r, apply-to %s, "
                     "priority %s, definition %s", call.user.name, NOUN[kind], name, vhost,
                     policy.pattern, policy.apply_to, policy.priority,
                     json.dumps(policy.definition, sort_keys=True))
        return Response(204 if existed else 201, b"")

    def delete(self, call: Call, kind: str) -> None:
        vhost, name = call.params["vhost"], call.params["name"]
        if self.book.get(kind, vhost, name) is None:
            raise not_found()
        self._write(kind, vhost, name, None)
        log.info("management API: %s cleared %s '%s' in vhost '%s'", call.user.name, NOUN[kind],
                 name, vhost)


def install(api: ManagementAPI) -> PoliciesAPI:
    """The routes on ``api``; the broker gets its ``PolicyEffects`` if it had none."""
    broker = api.node.broker
    effects = PolicyEffects.of(broker) or PolicyEffects(broker)
    return PoliciesAPI(api, effects)


def _escape_html(text: str) -> str:
    """RabbitMQ's ``rabbit_mgmt_format:escape_html_tags``: <, > and & only."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
