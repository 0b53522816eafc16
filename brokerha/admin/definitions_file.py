"""Definitions export and import in RabbitMQ 3.10's JSON (``GET``/``POST /api/definitions``).

The same file as ``rabbitmqctl export_definitions`` and the management
plugin's ``/api/definitions`` write, so a RabbitMQ node's definitions import
into brokerha (its users log in with their RabbitMQ passwords: the salted
hashes move as they are) and brokerha's import into RabbitMQ:

- ``rabbit_version``/``rabbitmq_version`` (the API version brokerha answers
  as), ``product_name``/``product_version`` (brokerha's);
- ``users`` (``password_hash``, ``hashing_algorithm``, ``tags``, ``limits``),
  ``vhosts`` (the name, as RabbitMQ 3.10 exports them), ``permissions``,
  ``topic_permissions``, ``policies``; operator policies are ``parameters`` of
  component ``operator_policy``, as RabbitMQ keeps them; ``global_parameters``
  empty (RabbitMQ's ``internal_cluster_id`` names its own cluster);
- ``queues`` (not exclusive ones; without brokerha's internal ``x-ha-id``),
  ``exchanges`` (not the standard ones), ``bindings`` (not the default
  exchange's).

``/api/definitions/{vhost}`` exports one vhost's policies, parameters, queues,
exchanges and bindings without the vhost in each entry (RabbitMQ's shape), and
imports only those kinds, into that vhost.

An import applies the definitions through the broker's ``Definitions`` (one
``DefinitionChange`` each: stored, replicated to the backups, acted on, as a
change made through the API), so the file's users, vhosts, permissions and
policies are checked whole first — RabbitMQ's 400 reasons: ``["not_base64",
hash]``, ``["no_such_user", name]``, ``["no_such_vhost", name]``, a policy's
``Validation failed`` text — and a bad file changes nothing (RabbitMQ keeps
what it applied before the error). Exchanges, queues and bindings are then
declared in that order by the broker's own paths, as the AMQP methods do.

On a node running partition groups (issue 35) the import declares each
exchange, queue and binding through its group's leader
(``definitions_groups.py``) and the export adds the queues and bindings this
node holds no copy of, as the members leading them list them
(``partition_views.py``), or refuses (503) when some partition's cannot be
listed.
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Callable
from typing import Any

from brokerha.admin import definitions_groups, partition_views
from brokerha.admin.definitions_api import (
    DefinitionsAPI,
    apply_durably,
    checked_regex,
    permission_entry,
    tag_list,
    topic_permission_entry,
    user_entry,
)
from brokerha.admin.management import (
    PRODUCT,
    RABBITMQ_VERSION,
    Call,
    ManagementAPI,
    ManagementError,
    _bool,
    _exchange_entry,
    _version,
    bad_request,
    require_admin,
)
from brokerha.broker import definitions as D
from brokerha.broker.definitions import DefinitionChange, Definitions
from brokerha.broker.placement import NotLeader
from brokerha.broker.policies import OPERATOR_POLICY, POLICY, PolicyInvalid, parse
from brokerha.cluster.replication import HA_ID
from brokerha.httpapi.server import json_safe

log = logging.getLogger("brokerha.management")

QUEUE_FIELDS = ("name", "vhost", "durable", "auto_delete", "arguments")
EXCHANGE_FIELDS = ("name", "vhost", "type", "durable", "auto_delete", "internal", "arguments")
PER_VHOST = ("parameters", "policies", "queues", "exchanges", "bindings")


# -- export --------------------------------------------------------------------------------

async def export(api: ManagementAPI, call: Call) -> dict[str, Any]:
    require_admin(call)
    only = call.params.get("vhost")
    if only is not None and only not in api.node.broker.vhosts:
        raise bad_request("vhost_not_found")
    defs = api.node.broker.definitions
    vhosts = [only] if only is not None else sorted(api.node.broker.vhosts)
    objects = _objects(api, vhosts)
    if api.node.broker.groups is not None:
        await _led_elsewhere(api, objects, vhosts)
    if only is not None:  # RabbitMQ's per-vhost file: no vhost in the entries it implies
        for kind in ("queues", "exchanges", "bindings"):
            objects[kind] = [{k: v for k, v in e.items() if k != "vhost"}
                             for e in objects[kind]]
        return {"rabbit_version": RABBITMQ_VERSION,
                "parameters": _parameters(defs, only), "policies": _policies(defs, only),
                **objects}
    return {"rabbit_version": RABBITMQ_VERSION, "rabbitmq_version": RABBITMQ_VERSION,
            "product_name": PRODUCT, "product_version": _version(),
            "users": [user_entry(name, v) for (name,), v in defs.items(D.USER)],
            "vhosts": [{"name": name} for name in vhosts],
            "permissions": [permission_entry(k, v) for k, v in defs.permissions()],
            "topic_permissions": [topic_permission_entry(k, v)
                                  for k, v in defs.topic_permissions()],
            "parameters": _parameters(defs, None), "global_parameters": [],
            "policies": _policies(defs, None), **objects}


def _policies(defs: Definitions, vhost: str | None) -> list[dict[str, Any]]:
    return [{"vhost": vh, "name": name, **value} for (vh, name), value in defs.items(POLICY)
            if vhost is None or vh == vhost]


def _parameters(defs: Definitions, vhost: str | None) -> list[dict[str, Any]]:
    return [{"value": value, "vhost": vh, "component": OPERATOR_POLICY, "name": name}
            for (vh, name), value in defs.items(OPERATOR_POLICY)
            if vhost is None or vh == vhost]


def _objects(api: ManagementAPI, vhosts: list[str]) -> dict[str, list[dict[str, Any]]]:
    queues, exchanges, bindings = [], [], []
    for name in vhosts:
        vh = api.node.broker.vhosts[name]
        queues += [{"name": q.name, "vhost": vh.name, "durable": q.durable,
                    "auto_delete": q.auto_delete, "arguments": _arguments(q.arguments)}
                   for q in sorted(vh.queues.values(), key=lambda q: q.name)
                   if q.exclusive_owner is None]
        exchanges += [{k: v for k, v in _exchange_entry(ex).items() if k in EXCHANGE_FIELDS}
                      for ex in sorted(vh.exchanges.values(), key=lambda e: e.name)
                      if ex.name and not ex.name.startswith("amq.")]
        bindings += [{k: v for k, v in b.items() if k != "properties_key"}
                     for b in api._binding_entries(vh) if b["source"]]
    return {"queues": queues, "exchanges": exchanges, "bindings": bindings}


async def _led_elsewhere(api: ManagementAPI, objects: dict[str, list[dict[str, Any]]],
                         vhosts: list[str]) -> None:
    """A partitioned node's export: the queues (and their bindings) of partitions it holds
    no copy of, as their leaders list them (partition_views.py); 503 naming the
    partitions whose queues it cannot list -- the file would silently lack them."""
    unknown_partitions = getattr(api.node.broker.groups, "unknown_partitions", None)
    try:
        if unknown_partitions is not None and not unknown_partitions():
            return  # every partition's queues are here (copies, or the directory's)
    except NotLeader:
        pass  # no table yet: gather says so
    views = await partition_views.gather(api)
    if views is None:
        return
    missing = views.missing()
    if missing is None or missing:
        raise ManagementError(503, "service_unavailable", (
            "this node holds no partition table yet" if missing is None else
            f"partitions {', '.join(map(str, missing))} are held by no cell of this node "
            "and no answering member leads them now") +
            ": their queues cannot be exported; retry (or export from a node holding them)")
    have = {(q["vhost"], q["name"]) for q in objects["queues"]}
    added = [q for key, q in sorted(views.queues.items())
             if key not in have and key[0] in vhosts and not q.get("exclusive")]
    objects["queues"] = sorted(objects["queues"] + [
        {"name": q["name"], "vhost": q["vhost"], "durable": q["durable"],
         "auto_delete": q["auto_delete"], "arguments": _arguments(q.get("arguments") or {})}
        for q in added], key=lambda q: (q["vhost"], q["name"]))
    exclusive = {key for key, q in views.queues.items() if q.get("exclusive")}
    bindings = [{k: v for k, v in b.items() if k != "properties_key"}
                for vhost in vhosts
                for b in views.binding_entries([], vhost) if b["source"]
                and (b["vhost"], b["destination"]) not in exclusive]
    seen = {json.dumps(b, sort_keys=True) for b in objects["bindings"]}
    objects["bindings"] += [b for b in bindings if json.dumps(b, sort_keys=True) not in seen]


# -- import --------------------------------------------------------------------------------

async def import_(api: ManagementAPI, checks: DefinitionsAPI, call: Call) -> None:
    require_admin(call)
    body = call.body()
    only = call.params.get("vhost")
    broker = api.node.broker
    if only is not None and only not in broker.vhosts:
        raise ManagementError(404, "not_found", "vhost_not_found")
    if only is not None:  # RabbitMQ's per-vhost import: these kinds, into that vhost
        body = {kind: [{**e, "vhost": only} if isinstance(e, dict) else e
                       for e in _entries(body, kind)] for kind in PER_VHOST}
    changes = changes_of(body, checks)
    known = set(broker.vhosts) | {c.key[0] for c in changes if c.kind == D.VHOST}
    for kind in ("queues", "exchanges", "bindings"):
        for entry in _entries(body, kind):
            if _vhost_of(entry) not in known:
                raise refused(["no_such_vhost", _vhost_of(entry)])
    declarations = getattr(broker.groups, "declarations", None)  # GroupClients'
    if declarations is None:
        _guard(api, *(_entries(body, kind) for kind in ("exchanges", "queues", "bindings")))
        items = None
    else:  # partition groups: each item through its group's leader (definitions_groups.py)
        items = _plan(api, body)
    await apply_durably(broker, changes)  # answered once durable, as the API's changes
    if items is None:
        declared = _declare(api, body)
        await apply_durably(broker, [])  # the declarations durable too, as a declare-ok
    else:
        await definitions_groups.declare(declarations, items)
        declared = (len(items[0]), len(items[1]), len(items[2]))
    log.info("management API: %s imported definitions%s: %d changes of users, vhosts, "
             "permissions and policies; %d exchanges, %d queues, %d bindings", call.user.name,
             f" into vhost '{only}'" if only else "", len(changes), *declared)


def changes_of(body: dict[str, Any], checks: DefinitionsAPI) -> list[DefinitionChange]:
    """The file's users, vhosts, permissions, topic permissions, policies and operator
    policies as changes to the broker's definitions, checked whole by the API's own checks
    (a 400 ManagementError for the first bad entry); what the definitions already hold as
    the file says is left out."""
    defs = checks.definitions
    changes = [*map(_vhost, _entries(body, "vhosts"))]
    changes += [DefinitionChange(D.USER, (name,), checks.user_value(name, entry))
                for entry in _entries(body, "users") for name in [_text(entry, "name")]]
    users = set(defs.users) | {c.key[0] for c in changes if c.kind == D.USER}
    vhosts = set(defs.vhosts) | {c.key[0] for c in changes if c.kind == D.VHOST}

    def known(user: str | None, vhost: str) -> None:
        if user is not None and user not in users:
            raise refused(["no_such_user", user])
        if vhost not in vhosts:
            raise refused(["no_such_vhost", vhost])

    for entry in _entries(body, "permissions"):
        user, vhost = _text(entry, "user"), _text(entry, "vhost")
        known(user, vhost)
        changes.append(D.permission_set(user, vhost, *(_regex(entry, k, True) for k in
                                                      ("configure", "write", "read"))))
    for entry in _entries(body, "topic_permissions"):
        user, vhost = _text(entry, "user"), _text(entry, "vhost")
        known(user, vhost)
        changes.append(D.topic_permission_set(user, vhost, _text(entry, "exchange"),
                                              _regex(entry, "write", False),
                                              _regex(entry, "read", False)))
    for entry in _entries(body, "policies"):
        changes.append(_policy(POLICY, entry, known))
    for entry in _entries(body, "parameters"):
        component = entry.get("component")
        where = f"{entry.get('vhost')}/{component}/{entry.get('name')}"
        if component != OPERATOR_POLICY:  # brokerha has no federation, shovels, ...
            raise bad_request(f"Validation failed\n\ncomponent {component} not found\n "
                              f"({where})")
        changes.append(_policy(OPERATOR_POLICY, {**_object(entry.get("value")),
                                                 "vhost": entry.get("vhost"),
                                                 "name": entry.get("name")}, known, where))
    return [c for c in changes if defs.get(c.kind, *c.key) != c.value]


def _entries(body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    found = body.get(kind) or []
    if not isinstance(found, list) or not all(isinstance(e, dict) for e in found):
        raise bad_request(f"'{kind}' must be a list of JSON objects")
    return found


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("an operator policy parameter's value must be a JSON object")
    return value


def _text(entry: dict[str, Any], key: str, default: str | None = None) -> str:
    value = entry.get(key, default)
    if not isinstance(value, str):
        raise bad_request(f"[{{key_missing,{key}}}]" if value is None else
                          f"'{key}' must be a string, not {value!r}")
    return value


def _regex(entry: dict[str, Any], key: str, as_chars: bool) -> str:
    pattern = _text(entry, key)
    checked_regex(pattern, as_chars)  # RabbitMQ's invalid_regexp, as the API answers it
    return pattern


def _vhost(entry: dict[str, Any]) -> DefinitionChange:
    metadata: dict[str, Any] = entry["metadata"] if isinstance(entry.get("metadata"), dict) \
        else entry
    description = metadata.get("description", "")
    if not isinstance(description, str):
        raise bad_request("a vhost's description must be a string")
    return D.vhost_set(_text(entry, "name"), description=description,
                       tags=tag_list(metadata.get("tags") or []))


def _policy(kind: str, entry: dict[str, Any], known: Callable[[str | None, str], None],
            where: str | None = None) -> DefinitionChange:
    """A policy (an operator policy) of the file; RabbitMQ's import reason for a bad one: the
    validation text, HTML-escaped as its definitions import does for both kinds, and which
    (``vhost/name``, ``vhost/operator_policy/name``)."""
    vhost, name = _text(entry, "vhost"), _text(entry, "name")
    known(None, vhost)
    try:
        policy = parse(kind, vhost, name, entry)
    except PolicyInvalid as exc:
        text = html.escape(exc.reason, quote=False) if exc.reason else f"bad {kind}"
        raise bad_request(f"{text} ({where or f'{vhost}/{name}'})") from None
    return DefinitionChange(kind, (vhost, name), policy.value())


def _arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """A queue's arguments without brokerha's ``x-ha-id``: the identity a cluster gave its
    replicated queue (cluster/replication.py) is not the file's to carry elsewhere."""
    safe: dict[str, Any] = json_safe({k: v for k, v in arguments.items() if k != HA_ID})
    return safe


def _vhost_of(entry: dict[str, Any]) -> str:
    vhost = entry.get("vhost", "/")
    return vhost if isinstance(vhost, str) else "/"


def _declare(api: ManagementAPI, body: dict[str, Any]) -> tuple[int, int, int]:
    """Exchanges, queues, then bindings, by the broker's own paths (checked as AMQP's)."""
    brokers = api.node.broker.vhosts
    exchanges, queues, bindings = (_entries(body, k) for k in ("exchanges", "queues",
                                                               "bindings"))
    for item in exchanges:
        brokers[_vhost_of(item)].declare_exchange(
            _text(item, "name"), _text(item, "type", "direct"),
            durable=_bool(item.get("durable"), True),
            auto_delete=_bool(item.get("auto_delete"), False),
            internal=_bool(item.get("internal"), False),
            arguments=dict(item.get("arguments") or {}))
    for item in queues:
        brokers[_vhost_of(item)].declare_queue(
            _text(item, "name"), owner=None, durable=_bool(item.get("durable"), True),
            auto_delete=_bool(item.get("auto_delete"), False),
            arguments=_arguments(item.get("arguments") or {}))
    for item in bindings:
        vh = brokers[_vhost_of(item)]
        kind = item.get("destination_type", "queue")
        name = _text(item, "destination")
        dest = (vh.queues if kind == "queue" else vh.exchanges).get(name)
        if dest is None:
            raise bad_request(f"binding to unknown {kind} '{name}'")
        vh.bind(_text(item, "source"), dest, _text(item, "routing_key", ""),
                dict(item.get("arguments") or {}))
    return len(exchanges), len(queues), len(bindings)


def _plan(api: ManagementAPI, body: dict[str, Any]) -> tuple[list[definitions_groups.Item],
                                                             ...]:
    """The file's exchanges, queues and bindings as requests to their groups' leaders,
    planned whole before anything changes (no table yet: 404, as ``_guard``)."""
    exchanges, queues, bindings = (_entries(body, k) for k in ("exchanges", "queues",
                                                               "bindings"))
    in_file = {(_vhost_of(q), _text(q, "name")): _arguments(q.get("arguments") or {})
               for q in queues}
    vhosts = api.node.broker.vhosts

    def queue_arguments(vhost: str, name: str) -> dict[str, Any]:
        if (vhost, name) in in_file:
            return in_file[vhost, name]
        vh = vhosts.get(vhost)
        queue = None if vh is None else vh.queues.get(name)
        return {} if queue is None else dict(queue.arguments)

    return definitions_groups.plan(api.node.broker.groups, queue_arguments, exchanges, queues,
                                   bindings, _text, _arguments, _vhost_of)


def _guard(api: ManagementAPI, exchanges: list[dict[str, Any]], queues: list[dict[str, Any]],
           bindings: list[dict[str, Any]]) -> None:
    """A node running partition groups (issue 35 stage 2, ``Broker.groups``): nothing of
    the file is applied unless this node serves everything it names now -- the metadata
    group for a new exchange, each queue's partition -- else 404 before any change."""
    groups = api.node.broker.groups
    if groups is None:
        return
    vhosts = api.node.broker.vhosts
    for item in exchanges:
        vh = vhosts.get(_vhost_of(item))
        if vh is None or _text(item, "name") not in vh.exchanges:
            groups.check_configuration(None, f"declare exchange '{_text(item, 'name')}'")
    for item in queues:
        groups.check_queue(None, _vhost_of(item), _text(item, "name"),
                           item.get("arguments") or {}, False)
    for item in bindings:
        if item.get("destination_type", "queue") == "queue":
            vh = vhosts.get(_vhost_of(item))
            queue = None if vh is None else vh.queues.get(_text(item, "destination"))
            arguments = {} if queue is None else queue.arguments
            groups.check_queue(None, _vhost_of(item), _text(item, "destination"), arguments,
                               queue is not None and queue.exclusive_owner is not None)
        else:
            groups.check_configuration(None, "bind exchanges")


def refused(reason: Any) -> ManagementError:
    """RabbitMQ's 400, whose reason is an Erlang term shown as JSON (``["no_such_user", u]``)."""
    return ManagementError(400, "bad_request", reason)


def install(api: ManagementAPI, checks: DefinitionsAPI) -> None:
    """The routes on ``api``; ``checks`` (definitions_api.py) checks a file's users."""
    for path in ("definitions", "definitions/{vhost}"):
        api._route("GET", path, lambda call: export(api, call))  # a coroutine, awaited
        api._route("POST", path, lambda call: import_(api, checks, call))
