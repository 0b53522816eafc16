"""RabbitMQ's management HTTP API, for the tools that speak it (rabbitmqadmin, Flower, scripts).

Same paths, JSON field names and meanings as RabbitMQ 3.10's ``rabbitmq_management``
for what brokerha has (docs/operations.md, "RabbitMQ's management API", lists
what is there and what is not). Every path needs HTTP Basic credentials of a
user with a management tag, as in RabbitMQ:

- ``administrator``: everything;
- ``monitoring``: reads everything (every vhost, every connection), changes
  what its vhost permissions allow;
- ``management`` (and ``policymaker``): its own connections and channels, the
  vhosts it has permissions in, changes what those permissions allow.

Other users get 401 ``Not management user``; a monitoring user asking for
``/api/users`` gets 401 ``Not administrator user``. Changes take the broker's own
code paths (the vhost's declare/delete/bind/purge and routing, as the AMQP
methods do), so they are permission-checked with the AMQP rules (configure,
write, read on the object's name), replicated to the backups, and logged. On
a cluster member that is not the serving primary, every request is forwarded
to the primary (its answer is the cluster's), so a tool pointed at any node
sees the broker.

Rates (``*_details.rate``) come from counters sampled every
``SAMPLE_INTERVAL`` seconds (RabbitMQ's ``collect_statistics_interval``), over
the last ``RATE_WINDOW``; ``/api/overview?lengths_age=S&msg_rates_age=S`` adds
RabbitMQ's ``*_details.samples`` (the last S seconds, up to ``HISTORY``), which
the management UI (ui.py) charts.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from pamqp import commands

from brokerha.admin import leader_requests
from brokerha.admin.errors import ManagementError
from brokerha.admin.node_view import NodeView
from brokerha.broker.auth import AuthenticationFailed, User
from brokerha.broker.content import build_header, decode_header
from brokerha.broker.errors import BrokerError
from brokerha.broker.flow import STATUS_KEYS as FLOW_STATUS_KEYS
from brokerha.broker.message import Message
from brokerha.broker.placement import NotLeader
from brokerha.httpapi.server import (
    MAX_REQUEST,
    READ_TAGS,
    HTTPError,
    Request,
    Response,
    basic_credentials,
    body_limit,
    exchange,
    json_safe,
)

log = logging.getLogger("brokerha.management")

Node = NodeView  # what these endpoints read of the node (admin/node_view.py)

SAMPLE_INTERVAL = 5.0
RATE_WINDOW = 60.0  # rates are over this much of the history
HISTORY = 600.0     # samples kept (the UI's charts; ``lengths_age``/``msg_rates_age``)
PRODUCT = "brokerha"
RABBITMQ_VERSION = "3.10.8"  # the API version the tools see (what the differential tests use)
FORWARD_TIMEOUT = 10.0
# a definitions import forwarded to the primary: its requests may wait for a partition's
# new leader (admin/definitions_groups.py), up to their own 15 s, kind after kind
IMPORT_FORWARD_TIMEOUT = 60.0
MAX_GET = 1000
ALIVENESS = "aliveness-test"  # RabbitMQ's aliveness test's queue


def not_authorised(reason: str) -> ManagementError:
    """RabbitMQ's 401 (spelt ``not_authorised``; a failed login says ``not_authorized``)."""
    return ManagementError(401, "not_authorised", reason)


ACCESS_REFUSED = "Access refused."  # RabbitMQ's reason for a vhost permission refused


def not_found() -> ManagementError:
    return ManagementError(404, "Object Not Found", "Not Found")


def bad_request(reason: str) -> ManagementError:
    return ManagementError(400, "bad_request", reason)


@dataclass
class Call:
    request: Request
    user: User
    params: dict[str, str]
    # sent by a member to this node as the queue's leader (leader_requests.py): answered
    # here, never sent on
    leader_asked: bool = False

    @property
    def admin(self) -> bool:
        return "administrator" in self.user.tags

    @property
    def monitor(self) -> bool:
        return self.admin or "monitoring" in self.user.tags

    def body(self) -> dict[str, Any]:
        try:
            value = self.request.json()
        except HTTPError as exc:
            raise bad_request(str(exc)) from None
        if not isinstance(value, dict):
            raise bad_request("the body must be a JSON object")
        return value


Handler = Callable[[Call], Any]


def require_admin(call: Call) -> None:
    """RabbitMQ's 401 for a path only an ``administrator`` may use."""
    if not call.admin:
        raise not_authorised("Not administrator user")


def decoded_body(call: Call) -> dict[str, Any]:
    """The JSON object, as RabbitMQ's ``with_decode`` reads it (``null``, ``undefined``,
    empty: no keys)."""
    if call.request.body.strip() in (b"", b"undefined"):
        return {}
    try:
        value = json.loads(call.request.body)
    except ValueError:
        raise bad_request("not_json") from None
    if value is None:
        return {}
    if isinstance(value, str):
        raise bad_request("invalid payload: the request body JSON-decoded to a string. "
                          "Is the input doubly-JSON-encoded?")
    if not isinstance(value, dict):
        raise bad_request("not_json")
    return value


# -- counters and rates ----------------------------------------------------------------

class Sampler:
    """Counters sampled over time; ``rate(key)`` is per second over the window."""

    def __init__(self, read: Callable[[], dict[tuple[str, ...], int]]) -> None:
        self.read = read
        self.samples: deque[tuple[float, dict[tuple[str, ...], int]]] = deque()

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.samples.append((now, self.read()))
        while self.samples and now - self.samples[0][0] > HISTORY:
            self.samples.popleft()

    def fresh(self) -> None:
        if not self.samples or time.monotonic() - self.samples[-1][0] >= 1.0:
            self.sample()

    def rate(self, key: tuple[str, ...]) -> float:
        if len(self.samples) < 2:
            return 0.0
        t1, last = self.samples[-1]
        t0, first = next((t, v) for t, v in self.samples if t1 - t <= RATE_WINDOW)
        if t1 <= t0:
            return 0.0
        return round(max(0, last.get(key, 0) - first.get(key, 0)) / (t1 - t0), 1)

    def history(self, key: tuple[str, ...], age: float) -> list[dict[str, int]]:
        """RabbitMQ's ``samples``: ``{"sample", "timestamp" (ms)}``, newest first."""
        if not self.samples:
            return []
        wall = time.time() - time.monotonic()
        newest = self.samples[-1][0]
        return [{"sample": v.get(key, 0), "timestamp": int((t + wall) * 1000)}
                for t, v in reversed(self.samples) if newest - t <= age]


def details(sampler: Sampler, key: tuple[str, ...], age: float = 0.0) -> dict[str, Any]:
    out: dict[str, Any] = {"rate": sampler.rate(key)}
    if age > 0:
        out["samples"] = sampler.history(key, age)
    return out


# -- the API ---------------------------------------------------------------------------

class ManagementAPI:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.routes: list[tuple[str, tuple[str, ...], Handler]] = []
        self.sampler = Sampler(self._counters)
        self.policies: Any = None  # /api/policies (policies_api.py): set by ``install``
        self._task: asyncio.Task[None] | None = None
        r = self._route
        r("GET", "overview", self.overview)
        r("GET", "nodes", self.nodes)
        r("GET", "nodes/{node}", self.one_node)
        r("GET", "connections", self.connections)
        r("GET", "channels", self.channels)
        r("GET", "vhosts", self.vhosts)
        r("GET", "vhosts/{vhost}", self.one_vhost)
        r("GET", "whoami", self.whoami)
        r("GET", "exchanges", self.exchanges)
        r("GET", "exchanges/{vhost}", self.exchanges)
        r("GET", "exchanges/{vhost}/{name}", self.one_exchange)
        r("PUT", "exchanges/{vhost}/{name}", self.declare_exchange)
        r("DELETE", "exchanges/{vhost}/{name}", self.delete_exchange)
        r("POST", "exchanges/{vhost}/{name}/publish", self.publish)
        r("GET", "queues", self.queues)
        r("GET", "queues/{vhost}", self.queues)
        r("GET", "queues/{vhost}/{name}", self.one_queue)
        r("PUT", "queues/{vhost}/{name}", self.declare_queue)
        r("DELETE", "queues/{vhost}/{name}", self.delete_queue)
        r("DELETE", "queues/{vhost}/{name}/contents", self.purge)
        r("POST", "queues/{vhost}/{name}/get", self.get)
        r("GET", "queues/{vhost}/{name}/bindings", self.queue_bindings)
        r("GET", "bindings", self.bindings)
        r("GET", "bindings/{vhost}", self.bindings)
        for kind in ("q", "e"):
            r("GET", f"bindings/{{vhost}}/e/{{source}}/{kind}/{{dest}}", self.bindings_between)
            r("POST", f"bindings/{{vhost}}/e/{{source}}/{kind}/{{dest}}", self.bind)
            r("GET", f"bindings/{{vhost}}/e/{{source}}/{kind}/{{dest}}/{{props}}",
              self.one_binding)
            r("DELETE", f"bindings/{{vhost}}/e/{{source}}/{kind}/{{dest}}/{{props}}",
              self.unbind)
        r("GET", "aliveness-test/{vhost}", self.aliveness)
        r("GET", "health/checks/alarms", self.alarms_check)
        r("GET", "health/checks/local-alarms", self.local_alarms_check)

    def _route(self, method: str, pattern: str, handler: Handler) -> None:
        self.routes.append((method, tuple(pattern.split("/")), handler))

    # -- dispatch ----------------------------------------------------------------------

    def match(self, method: str, parts: list[str]) -> tuple[Handler, dict[str, str]] | None:
        """The handler for ``method`` and the path's segments; raises 405 for another method."""
        allowed = False
        for m, pattern, handler in self.routes:
            if len(pattern) != len(parts):
                continue
            params: dict[str, str] = {}
            for want, got in zip(pattern, parts, strict=True):
                if want.startswith("{"):
                    params[want[1:-1]] = got
                elif want != got:
                    break
            else:
                if m == method:
                    return handler, params
                allowed = True
        if allowed:
            raise ManagementError(405, "", "")
        return None

    async def handle(self, request: Request) -> Response | None:
        """Answer ``/api/...`` if it is a management path; None for another router."""
        raw = request.path[len("/api/"):].rstrip("/")
        parts = [unquote(p) for p in raw.split("/")] if raw else []
        try:
            found = self.match(request.method, parts)
            if found is None:
                return None
            handler, params = found
            asked = self.node.broker.groups is not None and \
                leader_requests.answer_here(self.node, request)
            forwarded = None if asked else await self._forward(request)
            if forwarded is not None:
                return forwarded
            user = self._authenticate(request)
            self.start()
            self.sampler.fresh()
            result = handler(Call(request, user, params, asked))
            if asyncio.iscoroutine(result):
                result = await result
        except ManagementError as exc:
            return exc.response()
        except BrokerError as exc:
            return _amqp_error(exc).response()
        if isinstance(result, Response):
            return result
        if result is None:
            return Response(204, b"")
        return Response.json(_select(result, request))

    def _authenticate(self, request: Request) -> User:
        try:
            credentials = basic_credentials(request)
        except ValueError:
            credentials = None
        if credentials is None:
            raise ManagementError(401, "", "")  # RabbitMQ: 401 without a body
        name, password = credentials
        try:
            user = self.node.broker.users.authenticate(name, password, request.peer_host)
        except AuthenticationFailed as exc:
            log.warning("management API: refused %s from %s: %s", name, request.peer_host, exc)
            raise ManagementError(401, "not_authorized", "Login failed") from None
        if not READ_TAGS.intersection(user.tags):
            raise not_authorised("Not management user")
        return user

    async def _forward(self, request: Request) -> Response | None:
        """On a cluster member that is not the serving primary: the primary answers."""
        ha = self.node.ha
        if ha is None or ha.phase == "primary":
            return None
        primary = ha.election.primary
        member = next((m for m in ha.cluster.members if m.name == primary), None)
        if member is None or primary == self.node.config.name:
            raise ManagementError(503, "service_unavailable",
                                  "no serving primary in this cluster now (an election); retry")
        base = member.https_url or member.admin_url
        return await forward(base, request, self.node.tls.member_client)

    # -- a node running partition groups (issue 35 stage 2, Broker.groups) --------------

    def _guard_queue(self, vhost: str, name: str, arguments: Any,
                     exclusive: bool = False) -> None:
        """404 (``NotLeader``) unless this node leads the queue's partition now: the
        request came to the metadata primary, which serves no other partition's queue."""
        groups = self.node.broker.groups
        if groups is not None:
            groups.check_queue(None, vhost, name, arguments, exclusive)

    def _via_leader(self, vhost: str, name: str, arguments: Any, op: str,
                    args: list[Any], then: Callable[[list[Any]], Any]) -> Any:
        """A queue method of a partition led elsewhere: asked of its leader
        (partition/declarations.py), ``then(result)`` its answer (a coroutine); None:
        decided here (``_guard_queue``)."""
        groups = self.node.broker.groups
        pending = None if groups is None else groups.queue_request(vhost, name, arguments,
                                                                   op, args)
        if pending is None:
            return None

        async def answered() -> Any:
            from brokerha.partition.declarations import CONNECTION_FORCED, LeaderRefused

            try:
                result = await pending
            except LeaderRefused as exc:
                if exc.code == CONNECTION_FORCED:  # no answer: its outcome is unknown
                    raise ManagementError(503, "service_unavailable", exc.text) from None
                raise
            return then(result)

        return answered()

    def _guard_configuration(self, what: str) -> None:
        groups = self.node.broker.groups
        if groups is not None:
            groups.check_configuration(None, what)

    def _guard_destination(self, vhost: str, dest: Any, kind: str) -> None:
        if kind == "queue":
            self._guard_queue(vhost, dest.name, dest.arguments, dest.exclusive_owner is not None)
        else:
            self._guard_configuration(f"bind to exchange '{dest.name}'")

    # -- sampling ----------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sample_forever())

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.sampler.sample()
            except Exception:  # a sampling bug must not end the sampling
                log.exception("management statistics sampling failed")
            await asyncio.sleep(SAMPLE_INTERVAL)

    def _counters(self) -> dict[tuple[str, ...], int]:
        out: dict[tuple[str, ...], int] = {}
        totals = {"publish": 0, "deliver_get": 0, "ack": 0, "messages": 0, "ready": 0,
                  "unacked": 0}
        for vhost in list(self.node.broker.vhosts.values()):
            for q in list(vhost.queues.values()):
                key = (q.vhost, q.name)
                stats = {"publish": q.published, "deliver_get": q.delivered,
                         "ack": q.acked, "messages": q.message_count + q.unacked,
                         "ready": q.message_count, "unacked": q.unacked}
                for name, value in stats.items():
                    out[("queue", *key, name)] = value
                    totals[name] += value
        for name, value in totals.items():
            out[("total", name)] = value
        out[("total", "confirm")] = self.node.broker.stats.confirms
        return out

    # -- visibility --------------------------------------------------------------------

    def _visible_vhosts(self, call: Call) -> list[str]:
        names = sorted(self.node.broker.vhosts)
        if call.monitor:
            return names
        return [v for v in names if v in call.user.permissions]

    def _vhost(self, call: Call, name: str) -> Any:
        vhost = self.node.broker.vhosts.get(name)
        if vhost is None or name not in self._visible_vhosts(call):
            raise not_found()
        return vhost

    def _check(self, call: Call, kind: str, vhost: str, resource: str, name: str) -> None:
        try:
            call.user.check(kind, vhost, resource, name)
        except BrokerError as exc:
            log.info("management API: %s", exc)
            raise not_authorised(ACCESS_REFUSED) from None

    def _connections(self, call: Call) -> list[Any]:
        out = []
        for proto in list(self.node.connections):
            conn = proto.conn
            if conn is None or conn.user is None:
                continue
            if call.monitor or conn.user.name == call.user.name:
                out.append(conn)
        return out

    # -- overview, nodes, health -------------------------------------------------------

    def overview(self, call: Call) -> dict[str, Any]:
        s = self.sampler
        q = call.request.query
        try:
            lengths = min(HISTORY, float((q.get("lengths_age") or ["0"])[0]))
            rates = min(HISTORY, float((q.get("msg_rates_age") or ["0"])[0]))
        except ValueError:
            raise bad_request("lengths_age and msg_rates_age: seconds") from None
        vhosts = [self.node.broker.vhosts[v] for v in self._visible_vhosts(call)]
        queues = [q for vh in vhosts for q in vh.queues.values()]
        ready = sum(q.message_count for q in queues)
        unacked = sum(q.unacked for q in queues)
        conns = self._connections(call)
        cfg = self.node.config
        listeners = [{"node": self._node_name(), "protocol": "amqp", "ip_address": cfg.listen_host,
                      "port": cfg.listen_port}] if cfg.amqp_plain else []
        if cfg.amqps_listen is not None:
            listeners.append({"node": self._node_name(), "protocol": "amqp/ssl",
                              "ip_address": cfg.amqps_listen[0], "port": cfg.amqps_listen[1]})
        return {
            "management_version": RABBITMQ_VERSION, "rabbitmq_version": RABBITMQ_VERSION,
            "product_name": PRODUCT, "product_version": _version(),
            "cluster_name": self._cluster_name(), "node": self._node_name(),
            "erlang_version": "n/a", "statistics_db_event_queue": 0,
            "message_stats": {
                "publish": sum(q.published for q in queues),
                "publish_details": details(s, ("total", "publish"), rates),
                "deliver_get": sum(q.delivered for q in queues),
                "deliver_get_details": details(s, ("total", "deliver_get"), rates),
                "ack": sum(q.acked for q in queues),
                "ack_details": details(s, ("total", "ack"), rates),
                "confirm": self.node.broker.stats.confirms,
                "confirm_details": details(s, ("total", "confirm"), rates),
            },
            "queue_totals": {
                "messages": ready + unacked, "messages_details": details(s, ("total", "messages"), lengths),
                "messages_ready": ready,
                "messages_ready_details": details(s, ("total", "ready"), lengths),
                "messages_unacknowledged": unacked,
                "messages_unacknowledged_details": details(s, ("total", "unacked"), lengths),
            },
            "object_totals": {
                "connections": len(conns), "channels": sum(len(c.channels) for c in conns),
                "exchanges": sum(len(vh.exchanges) for vh in vhosts), "queues": len(queues),
                "consumers": sum(q.consumer_count for q in queues),
            },
            "listeners": listeners,
            "contexts": [{"node": self._node_name(), "description": "brokerha management",
                          "path": "/", "port": str((cfg.admin_listen or ("", 0))[1])}],
        }

    def _node_name(self, name: str | None = None) -> str:
        return f"{PRODUCT}@{name or self.node.config.name}"

    def _cluster_name(self) -> str:
        ha = self.node.ha
        return ha.cluster.name if ha is not None else self.node.config.name

    async def nodes(self, call: Call) -> list[dict[str, Any]]:
        ha = self.node.ha
        if ha is None:
            status = self.node.status()
            status["node"].setdefault("loop", self.node.loop_monitor.status())
            return [self._node_entry(status)]
        from brokerha.admin.api import cluster_view  # one way to ask every member

        view = await cluster_view(self.node)
        out = []
        for entry in view["nodes"]:
            out.append(self._node_entry({"node": entry}))
        return out

    def _node_entry(self, status: dict[str, Any]) -> dict[str, Any]:
        me = status["node"]
        role = me.get("role")
        alarms = me.get("alarms") or {}
        entry = {
            "name": self._node_name(me.get("name")), "type": "disc",
            "running": role != "down", "os_pid": str(me.get("pid") or ""),
            "mem_alarm": "memory" in alarms,
            "disk_free_alarm": any(a.startswith("disk") for a in alarms),
            "partitions": [], "uptime": 0, "mem_used": me.get("memory_used", 0),
            "mem_limit": me.get("memory_limit", 0), "fd_used": 0, "sockets_used":
            me.get("connections", 0), "disk_free": min(
                [v for v in ((me.get("disk") or {}).get("free") or {}).values() if v] or [0]),
            # brokerha's own: its HA role, epoch, readiness, each backup's lag, elections
            # and step-downs by reason, the event loop's lag (p99 and max of the last minute),
            # the cyclic GC's collections and pauses (node/gc_governor.py)
            "brokerha": {k: me.get(k) for k in ("role", "epoch", "ready", "serving", "primary",
                                                "position", "phase", "election", "loop",
                                                "gc")},
        }
        replication = me.get("replication") or {}
        if replication.get("backups"):
            entry["brokerha"]["backups"] = replication["backups"]
        if "publishers_held" in replication:  # a primary's publisher flow control (flow.py)
            entry["brokerha"]["flow"] = {k: replication.get(k) for k in FLOW_STATUS_KEYS}
        if "replicate_changes" in replication:  # a primary's ha-replicate changes (docs/ha.md)
            entry["brokerha"]["replicate_changes"] = replication["replicate_changes"]
        return entry

    async def one_node(self, call: Call) -> dict[str, Any]:
        for entry in await self.nodes(call):
            if entry["name"] in (call.params["node"], self._node_name(call.params["node"])):
                return entry
        raise not_found()

    async def aliveness(self, call: Call) -> Any:
        """RabbitMQ's: declare ``aliveness-test``, publish to it, get it back. On a
        partitioned cluster all three on the queue's partition's leader (the request sent
        there: ``_leader_answers``)."""
        vhost = self._vhost(call, call.params["vhost"])
        self._check(call, "configure", vhost.name, "queue", ALIVENESS)
        remote = await self._leader_answers(call, vhost.name, ALIVENESS, declare=True)
        if remote is not None:
            return remote
        q = vhost.queues.get(ALIVENESS)
        if q is None:
            declared = self._via_leader(vhost.name, ALIVENESS, {}, "queue.declare",
                                        [vhost.name, ALIVENESS, False, False, False, {}],
                                        lambda _result: None)
            if declared is not None:  # this leader's own declaration host (a directory)
                await declared
            else:
                self._guard_queue(vhost.name, ALIVENESS, {})
                vhost.declare_queue(ALIVENESS, owner=None, durable=False)
            q = vhost.queues.get(ALIVENESS)
            if q is None:
                return {"status": "failed", "reason": "the test queue was not declared"}
        self._guard_queue(vhost.name, ALIVENESS, q.arguments)
        message = Message("", ALIVENESS, build_header(len(b"test")), b"test")
        groups = self.node.broker.groups
        if groups is not None:  # this node leads its partition (checked): enqueued here
            groups.publish(None, vhost.name, [q], message, None)
        else:
            q.enqueue(message)
        entry = q.get()
        if entry is None or entry.message.body != b"test":
            if entry is not None:
                q.requeue(entry)
            return {"status": "failed", "reason": "the test message did not come back"}
        q.settle(entry)
        return {"status": "ok"}

    def alarms_check(self, call: Call) -> Response:
        return self._alarms(dict(self.node.broker.alarms))

    def local_alarms_check(self, call: Call) -> Response:
        return self._alarms({k: v for k, v in self.node.broker.alarms.items()
                             if ":" not in k or k == "disk:store"})

    def _alarms(self, alarms: dict[str, str]) -> Response:
        if not alarms:
            return Response.json({"status": "ok"})
        listed = [{"node": self._node_name(), "resource": name.split(":", 1)[0],
                   "reason": reason} for name, reason in sorted(alarms.items())]
        return Response.json({"status": "failed", "reason": "resource alarm(s) in effect",
                              "alarms": listed}, 503)

    # -- connections, channels, vhosts, users ------------------------------------------

    def connections(self, call: Call) -> list[dict[str, Any]]:
        now = self.node.loop.time()
        out = []
        for conn in self._connections(call):
            props = conn.client_properties or {}
            peer = conn.peer or ("", 0)
            out.append({
                "name": f"{peer[0]}:{peer[1]} -> {self._node_name()}", "node": self._node_name(),
                "user": conn.user.name, "vhost": conn.vhost.name if conn.vhost else None,
                "peer_host": peer[0], "peer_port": peer[1], "protocol": "AMQP 0-9-1",
                "channels": len(conn.channels), "state": "blocked" if conn.blocked_notified
                else "running", "ssl": conn.tls is not None,
                "connected_at": int((time.time() - (now - conn.created)) * 1000),
                "client_properties": json_safe(props),
            })
        return sorted(out, key=lambda c: c["name"])

    def channels(self, call: Call) -> list[dict[str, Any]]:
        out = []
        for conn in self._connections(call):
            peer = conn.peer or ("", 0)
            for number, ch in sorted(conn.channels.items()):
                out.append({
                    "name": f"{peer[0]}:{peer[1]} -> {self._node_name()} ({number})",
                    "number": number, "node": self._node_name(), "user": conn.user.name,
                    "vhost": conn.vhost.name if conn.vhost else None,
                    "consumer_count": len(ch.consumers),
                    "messages_unacknowledged": len(ch.unacked),
                    "prefetch_count": ch.prefetch_count,
                    "confirm": ch.confirm is not None,
                    "transactional": bool(ch.tx_mode),
                    "connection_details": {"name": f"{peer[0]}:{peer[1]} -> {self._node_name()}",
                                           "peer_host": peer[0], "peer_port": peer[1]},
                })
        return out

    def vhosts(self, call: Call) -> list[dict[str, Any]]:
        return [self._vhost_entry(v) for v in self._visible_vhosts(call)]

    def one_vhost(self, call: Call) -> dict[str, Any]:
        return self._vhost_entry(self._vhost(call, call.params["vhost"]).name)

    def _vhost_entry(self, name: str) -> dict[str, Any]:
        vh = self.node.broker.vhosts[name]
        ready = sum(q.message_count for q in vh.queues.values())
        unacked = sum(q.unacked for q in vh.queues.values())
        defined = self.node.broker.definitions.vhosts.get(name, {})
        return {"name": name, **vhost_fields(defined), "tracing": False,
                "cluster_state": {self._node_name(): "running"},
                "messages": ready + unacked, "messages_ready": ready,
                "messages_unacknowledged": unacked}

    def whoami(self, call: Call) -> dict[str, Any]:
        return {"name": call.user.name, "tags": sorted(call.user.tags)}

    # -- exchanges ---------------------------------------------------------------------

    def exchanges(self, call: Call) -> list[dict[str, Any]]:
        names = [call.params["vhost"]] if "vhost" in call.params else self._visible_vhosts(call)
        out = []
        for name in names:
            vh = self._vhost(call, name)
            out += [{**_exchange_entry(ex), **self.policies.fields(ex, "exchange")}
                    for ex in vh.exchanges.values()]
        return sorted(out, key=lambda e: (e["vhost"], e["name"]))

    def one_exchange(self, call: Call) -> dict[str, Any]:
        vh = self._vhost(call, call.params["vhost"])
        name = _exchange_name(call.params["name"])
        ex = vh.exchanges.get(name)
        if ex is None:
            raise not_found()
        return {**_exchange_entry(ex), **self.policies.fields(ex, "exchange")}

    def declare_exchange(self, call: Call) -> Response:
        vh = self._vhost(call, call.params["vhost"])
        name = _exchange_name(call.params["name"])
        existed = name in vh.exchanges
        body = call.body()
        self._check(call, "configure", vh.name, "exchange", name)
        kind = body.get("type")
        if not isinstance(kind, str) or not kind:
            raise bad_request("type: the exchange type (direct, fanout, topic, headers)")
        if not existed:
            self._guard_configuration(f"declare exchange '{name}'")
        vh.declare_exchange(name, kind, durable=_bool(body.get("durable"), True),
                            auto_delete=_bool(body.get("auto_delete"), False),
                            internal=_bool(body.get("internal"), False),
                            arguments=_arguments(body))
        log.info("management API: %s declared exchange '%s' in vhost '%s'", call.user.name,
                 name, vh.name)
        return Response(204 if existed else 201, b"")

    def delete_exchange(self, call: Call) -> None:
        vh = self._vhost(call, call.params["vhost"])
        name = _exchange_name(call.params["name"])
        self._check(call, "configure", vh.name, "exchange", name)
        if name not in vh.exchanges:
            raise not_found()
        self._guard_configuration(f"delete exchange '{name}'")
        vh.delete_exchange(name, if_unused=_flag(call.request, "if-unused"))
        log.info("management API: %s deleted exchange '%s' in vhost '%s'", call.user.name,
                 name, vh.name)

    def publish(self, call: Call) -> dict[str, Any]:
        vh = self._vhost(call, call.params["vhost"])
        name = _exchange_name(call.params["name"])
        body = call.body()
        self._check(call, "write", vh.name, "exchange", name)
        exchange = vh.exchanges.get(name)
        if exchange is None:  # as RabbitMQ: its internal channel's error, as a 400
            raise bad_request(f"404 NOT_FOUND - no exchange '{name}' in vhost '{vh.name}'")
        if exchange.internal:
            raise bad_request(f"cannot publish to internal exchange '{name}'")
        payload = body.get("payload", "")
        encoding = body.get("payload_encoding", "string")
        if not isinstance(payload, str):
            raise bad_request("payload: a string")
        if encoding == "base64":
            try:
                data = base64.b64decode(payload, validate=True)
            except (ValueError, binascii.Error):
                raise bad_request("payload is not base64") from None
        elif encoding == "string":
            data = payload.encode()
        else:
            raise bad_request("payload_encoding: string or base64")
        routing_key = body.get("routing_key", "")
        if not isinstance(routing_key, str):
            raise bad_request("routing_key: a string")
        props = _properties(body.get("properties") or {})
        message = Message(name, routing_key, build_header(len(data), props), data)
        if message.user_id is not None and message.user_id != call.user.name:
            raise bad_request(f"user_id property set to '{message.user_id}' but authenticated "
                              f"user was '{call.user.name}'")
        queues = vh.route(exchange, message)
        groups = self.node.broker.groups
        if groups is not None:  # a partitioned node: a copy's messages go to its leader
            groups.publish(None, vh.name, queues, message, None)
            return {"routed": bool(queues)}
        if any(q.ordered for q in queues):  # ordered by another layer: a transaction
            tx = self.node.broker.new_transaction()
            tx.publish(queues, message)
            self.node.broker.spawn(tx.commit(), lambda exc: exc and log.warning(
                "management API publish to a global queue not accepted: %s", exc))
        else:
            for q in queues:
                q.enqueue(message)
        return {"routed": bool(queues)}

    # -- queues ------------------------------------------------------------------------

    def queues(self, call: Call) -> Any:
        names = [call.params["vhost"]] if "vhost" in call.params else self._visible_vhosts(call)
        out = []
        for name in names:
            vh = self._vhost(call, name)
            out += [self._queue_entry(q) for q in vh.queues.values()]
        if self.node.broker.groups is not None:  # each queue as its leader sees it
            return self._partitioned(call, out, names, "queue_entries")
        out.sort(key=lambda q: (q["vhost"], q["name"]))
        return _page(out, call.request)

    async def _partitioned(self, call: Call, local: list[dict[str, Any]], vhosts: list[str],
                           merge: str) -> Any:
        """``local`` merged with what the other members lead (partition_views.py)."""
        from brokerha.admin import partition_views

        views = await partition_views.gather(self)
        out = local
        if views is not None:
            out = [e for vhost in vhosts
                   for e in getattr(views, merge)([x for x in local if x["vhost"] == vhost],
                                                  vhost)]
        if merge == "binding_entries":
            return out
        out.sort(key=lambda q: (q["vhost"], q["name"]))
        return _page(out, call.request)

    def one_queue(self, call: Call) -> Any:
        if self.node.broker.groups is not None:  # as its leader sees it
            return self._one_partitioned(call)
        return self._queue_entry(self._queue(call))

    async def _one_partitioned(self, call: Call) -> dict[str, Any]:
        from brokerha.admin import partition_views

        vh = self._vhost(call, call.params["vhost"])
        key = (vh.name, call.params["name"])
        views = await partition_views.gather(self, key)
        led = None if views is None else views.queues.get(key)
        return led if led is not None else self._queue_entry(self._queue(call))

    def _queue(self, call: Call) -> Any:
        vh = self._vhost(call, call.params["vhost"])
        q = vh.queues.get(call.params["name"])
        if q is None:
            raise not_found()
        return q

    def _queue_entry(self, q: Any) -> dict[str, Any]:
        s = self.sampler
        key = ("queue", q.vhost, q.name)
        ready, unacked = q.message_count, q.unacked
        home = self._queue_home(q)
        return {
            "name": q.name, "vhost": q.vhost, "type": "classic",
            "node": self._node_name(home["leader"]),  # where it is served: its leader
            "durable": q.durable, "auto_delete": q.auto_delete,
            "exclusive": q.exclusive_owner is not None,
            "arguments": json_safe(dict(q.arguments)), "state": "running",
            **self.policies.fields(q, "queue"),
            "messages": ready + unacked, "messages_details": details(s, (*key, "messages")),
            "messages_ready": ready, "messages_ready_details": details(s, (*key, "ready")),
            "messages_unacknowledged": unacked,
            "messages_unacknowledged_details": details(s, (*key, "unacked")),
            "message_bytes_ready": q.ready_bytes, "consumers": q.consumer_count,
            **home,
            "message_stats": {
                "publish": q.published, "publish_details": details(s, (*key, "publish")),
                "deliver_get": q.delivered,
                "deliver_get_details": details(s, (*key, "deliver_get")),
                "ack": q.acked, "ack_details": details(s, (*key, "ack")),
            },
        }

    def _queue_home(self, q: Any) -> dict[str, Any]:
        """``partition`` (None without partition groups) and ``leader``: the node serving the
        queue (its partition group's leader as this node knows it; this node without
        groups, where the management API is answered by the primary)."""
        groups = self.node.broker.groups
        if groups is None:
            return {"partition": None, "leader": self.node.config.name}
        partition, leader = groups.queue_home(q)
        return {"partition": partition, "leader": leader}

    def declare_queue(self, call: Call) -> Any:
        vh = self._vhost(call, call.params["vhost"])
        name = call.params["name"]
        existed = name in vh.queues
        body = call.body()
        self._check(call, "configure", vh.name, "queue", name)
        if _bool(body.get("exclusive"), False):
            raise bad_request("exclusive queues belong to an AMQP connection; declare them there")
        remote = self._via_leader(
            vh.name, name, _arguments(body), "queue.declare",
            [vh.name, name, False, _bool(body.get("durable"), True),
             _bool(body.get("auto_delete"), False), _arguments(body)],
            lambda _result: Response(204 if existed else 201, b""))
        if remote is not None:
            return remote
        self._guard_queue(vh.name, name, _arguments(body))
        vh.declare_queue(name, owner=None, durable=_bool(body.get("durable"), True),
                         auto_delete=_bool(body.get("auto_delete"), False),
                         arguments=_arguments(body))
        log.info("management API: %s declared queue '%s' in vhost '%s'", call.user.name, name,
                 vh.name)
        return Response(204 if existed else 201, b"")

    def delete_queue(self, call: Call) -> Any:
        q = self._queue(call)
        self._check(call, "configure", q.vhost, "queue", q.name)
        remote = self._via_leader(
            q.vhost, q.name, q.arguments, "queue.delete",
            [q.vhost, q.name, _flag(call.request, "if-unused"), _flag(call.request, "if-empty")],
            lambda _result: None)
        if remote is not None:
            return remote
        self._guard_queue(q.vhost, q.name, q.arguments, q.exclusive_owner is not None)
        self.node.broker.vhosts[q.vhost].delete_queue(
            q.name, owner=None, if_unused=_flag(call.request, "if-unused"),
            if_empty=_flag(call.request, "if-empty"))
        log.info("management API: %s deleted queue '%s' in vhost '%s'", call.user.name, q.name,
                 q.vhost)

    def purge(self, call: Call) -> Any:
        q = self._queue(call)
        self._check(call, "read", q.vhost, "queue", q.name)
        remote = self._via_leader(q.vhost, q.name, q.arguments, "queue.purge",
                                  [q.vhost, q.name], lambda _result: None)
        if remote is not None:
            return remote
        self._guard_queue(q.vhost, q.name, q.arguments, q.exclusive_owner is not None)
        count = self.node.broker.vhosts[q.vhost].purge_queue(q.name, None)
        log.info("management API: %s purged %d messages of queue '%s' in vhost '%s'",
                 call.user.name, count, q.name, q.vhost)

    async def get(self, call: Call) -> Any:
        """``{"count", "ackmode", "encoding", "truncate"}``; ackmode as RabbitMQ's:
        ``ack_requeue_true`` / ``reject_requeue_true`` (look: back in place, marked
        redelivered), ``ack_requeue_false`` / ``reject_requeue_false`` (take them). On a
        partitioned cluster, by the queue's partition's leader (``_leader_answers``)."""
        if self.node.broker.groups is not None:
            vh = self._vhost(call, call.params["vhost"])
            remote = await self._leader_answers(call, vh.name, call.params["name"],
                                                declare=False)
            if remote is not None:
                return remote
        q = self._queue(call)
        self._check(call, "read", q.vhost, "queue", q.name)
        count, ackmode, encoding, truncate = _get_options(call.body())
        if q.ordering is not None:
            raise bad_request(q.ordering.refuse_get(q))
        self._guard_queue(q.vhost, q.name, q.arguments, q.exclusive_owner is not None)
        taken = []
        for _ in range(max(0, min(count, MAX_GET))):
            entry = q.get()
            if entry is None:
                break
            taken.append(entry)
        out = []
        left = q.message_count
        for entry in taken:
            m = entry.message
            data = m.body if truncate is None else m.body[:int(truncate)]
            try:
                text, kind = (data.decode(), "string") if encoding == "auto" else ("", "")
            except UnicodeDecodeError:
                text, kind = "", ""
            if not kind:
                text, kind = base64.b64encode(data).decode(), "base64"
            out.append({
                "payload_bytes": len(m.body), "redelivered": entry.redelivered,
                "exchange": m.exchange, "routing_key": m.routing_key,
                "message_count": left, "properties": _props_json(m.header),
                "payload": text, "payload_encoding": kind,
            })
        for entry in reversed(taken):  # back in their places (requeue keeps the order)
            if ackmode.endswith("requeue_true"):
                q.requeue(entry)
            else:
                q.settle(entry)
        return out

    async def _leader_answers(self, call: Call, vhost: str, name: str,
                              declare: bool) -> Response | None:
        """The answer of the queue's partition's leader when another node leads it
        (leader_requests.py); None: this node answers. A request a member sent here as
        the leader is never sent on (503: the leadership moved; retry)."""
        leader = await leader_requests.leader_of(self, vhost, name, declare)
        if leader is None:
            return None
        if call.leader_asked:
            raise ManagementError(503, "service_unavailable",
                                  f"queue '{name}' in vhost '{vhost}': this node no longer "
                                  f"leads its partition ({leader} does); retry")
        if not declare:  # refused here as the leader would (it checks them again)
            self._check(call, "read", vhost, "queue", name)
            _get_options(call.body())
        return await leader_requests.ask_leader(self, leader, call.request)

    # -- bindings ----------------------------------------------------------------------

    def _binding_entries(self, vh: Any) -> list[dict[str, Any]]:
        out = []
        for q in vh.queues.values():  # the default exchange's implicit bindings
            out.append(_binding_entry(vh.name, "", "queue", q.name, q.name, {}))
        for ex in vh.exchanges.values():
            for b in ex.bindings.values():
                kind = "queue" if b.destination.name in vh.queues and \
                    vh.queues[b.destination.name] is b.destination else "exchange"
                out.append(_binding_entry(vh.name, ex.name, kind, b.destination.name,
                                          b.routing_key, b.arguments))
        return out

    def bindings(self, call: Call) -> Any:
        names = [call.params["vhost"]] if "vhost" in call.params else self._visible_vhosts(call)
        out: list[dict[str, Any]] = []
        for name in names:
            out += self._binding_entries(self._vhost(call, name))
        if self.node.broker.groups is not None:  # the queues this node holds no copy of
            return self._partitioned(call, out, names, "binding_entries")
        return out

    def queue_bindings(self, call: Call) -> list[dict[str, Any]]:
        q = self._queue(call)
        return [b for b in self._binding_entries(self.node.broker.vhosts[q.vhost])
                if b["destination_type"] == "queue" and b["destination"] == q.name]

    def _endpoints(self, call: Call) -> tuple[Any, Any, Any, str]:
        vh = self._vhost(call, call.params["vhost"])
        source = vh.exchanges.get(_exchange_name(call.params["source"]))
        kind = "queue" if call.request.path.split("/")[-2 if "props" not in call.params
                                                           else -3] == "q" else "exchange"
        table = vh.queues if kind == "queue" else vh.exchanges
        dest = table.get(call.params["dest"])
        if source is None or dest is None:
            raise not_found()
        return vh, source, dest, kind

    def bindings_between(self, call: Call) -> list[dict[str, Any]]:
        vh, source, dest, kind = self._endpoints(call)
        return [_binding_entry(vh.name, source.name, kind, dest.name, b.routing_key, b.arguments)
                for b in source.bindings.values() if b.destination is dest]

    def bind(self, call: Call) -> Any:
        vh, source, dest, kind = self._endpoints(call)
        body = call.body()
        key = body.get("routing_key", "")
        if not isinstance(key, str):
            raise bad_request("routing_key: a string")
        self._check(call, "write", vh.name, kind, dest.name)
        self._check(call, "read", vh.name, "exchange", source.name)
        if kind == "queue":
            remote = self._via_leader(vh.name, dest.name, dest.arguments, "queue.bind",
                                      [vh.name, dest.name, source.name, key, _arguments(body)],
                                      lambda _result: Response(201, b""))
            if remote is not None:
                return remote
        self._guard_destination(vh.name, dest, kind)
        vh.bind(source.name, dest, key, _arguments(body))
        return Response(201, b"")

    def _binding(self, call: Call) -> tuple[Any, Any, Any, str, Any]:
        vh, source, dest, kind = self._endpoints(call)
        for b in source.bindings.values():
            if b.destination is dest and _props_key(b.routing_key, b.arguments) == \
                    call.params["props"]:
                return vh, source, dest, kind, b
        raise not_found()

    def one_binding(self, call: Call) -> dict[str, Any]:
        vh, source, dest, kind, b = self._binding(call)
        return _binding_entry(vh.name, source.name, kind, dest.name, b.routing_key, b.arguments)

    def unbind(self, call: Call) -> Any:
        vh, source, dest, kind, b = self._binding(call)
        self._check(call, "write", vh.name, kind, dest.name)
        self._check(call, "read", vh.name, "exchange", source.name)
        if kind == "queue":
            remote = self._via_leader(
                vh.name, dest.name, dest.arguments, "queue.unbind",
                [vh.name, dest.name, source.name, b.routing_key, dict(b.arguments or {})],
                lambda _result: None)
            if remote is not None:
                return remote
        self._guard_destination(vh.name, dest, kind)
        vh.unbind(source.name, dest, b.routing_key, b.arguments)

# -- helpers ---------------------------------------------------------------------------

def _get_options(body: dict[str, Any]) -> tuple[int, str, str, Any]:
    """A get's ``(count, ackmode, encoding, truncate)``, or 400."""
    try:
        count = int(body.get("count", 1))
    except (TypeError, ValueError):
        raise bad_request("count: a number") from None
    ackmode = body.get("ackmode", "ack_requeue_true")
    if ackmode not in ("ack_requeue_true", "ack_requeue_false", "reject_requeue_true",
                       "reject_requeue_false"):
        raise bad_request("ackmode: ack_requeue_true, ack_requeue_false, "
                          "reject_requeue_true or reject_requeue_false")
    encoding = body.get("encoding", "auto")
    if encoding not in ("auto", "base64"):
        raise bad_request("encoding: auto or base64")
    return count, ackmode, encoding, body.get("truncate")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("brokerha")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "dev"


def vhost_fields(value: dict[str, Any]) -> dict[str, Any]:
    """A vhost's definition as RabbitMQ 3.10 shows it (``rabbit_vhost:info``)."""
    description, tags = value.get("description", ""), list(value.get("tags", []))
    return {"description": description, "tags": tags,
            "default_queue_type": value.get("default_queue_type") or "undefined",
            "metadata": {"description": description, "tags": tags}}


def _exchange_name(name: str) -> str:
    return "" if name == "amq.default" else name


def _exchange_entry(ex: Any) -> dict[str, Any]:
    return {"name": ex.name, "vhost": ex.vhost, "type": ex.type, "durable": ex.durable,
            "auto_delete": ex.auto_delete, "internal": ex.internal,
            "arguments": json_safe(dict(ex.arguments)), "user_who_performed_action": ""}


def _props_key(routing_key: str, arguments: dict[str, Any]) -> str:
    """RabbitMQ's binding ``properties_key``: the routing key, or it and a hash of the
    arguments (``~``), URL-quoted."""
    if not arguments:
        return quote(routing_key, safe="") or "~"
    digest = base64.urlsafe_b64encode(
        repr(sorted(arguments.items())).encode()[:64]).decode().rstrip("=")
    return f"{quote(routing_key, safe='')}~{digest}"


def _binding_entry(vhost: str, source: str, kind: str, dest: str, key: str,
                   arguments: dict[str, Any]) -> dict[str, Any]:
    return {"source": source, "vhost": vhost, "destination": dest, "destination_type": kind,
            "routing_key": key, "arguments": json_safe(dict(arguments)),
            "properties_key": _props_key(key, arguments)}


def _bool(value: Any, default: bool) -> bool:
    """A JSON boolean, or rabbitmqadmin's "true"/"false" strings."""
    if value is None:
        return default
    if isinstance(value, str):
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad_request(f"expected true or false, got {value!r}")
    return bool(value)


def _flag(request: Request, name: str) -> bool:
    return (request.query.get(name) or ["false"])[0].lower() == "true"


def _arguments(body: dict[str, Any]) -> dict[str, Any]:
    args = body.get("arguments") or {}
    if not isinstance(args, dict):
        raise bad_request("arguments: a JSON object")
    return dict(args)


PROPERTY_NAMES = ("content_type", "content_encoding", "headers", "delivery_mode", "priority",
                  "correlation_id", "reply_to", "expiration", "message_id", "timestamp", "type",
                  "user_id", "app_id")


def _properties(props: dict[str, Any]) -> commands.Basic.Properties:
    if not isinstance(props, dict):
        raise bad_request("properties: a JSON object")
    unknown = set(props) - set(PROPERTY_NAMES)
    if unknown:
        raise bad_request(f"unknown properties: {', '.join(sorted(unknown))}")
    values = dict(props)
    if "timestamp" in values:
        import datetime

        values["timestamp"] = datetime.datetime.fromtimestamp(int(values["timestamp"]),
                                                               datetime.UTC)
    try:
        return commands.Basic.Properties(**values)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"properties: {exc}") from None


def _props_json(header: bytes) -> dict[str, Any]:
    props = decode_header(header).properties
    out = {}
    for name in PROPERTY_NAMES:
        value = getattr(props, name, None)
        if value is not None:
            out[name] = int(value.timestamp()) if name == "timestamp" else json_safe(value)
    return out


def _page(items: list[dict[str, Any]], request: Request) -> Any:
    """RabbitMQ's pagination (``page``, ``page_size``, ``name``, ``use_regex``) when asked."""
    q = request.query
    if "page" not in q:
        return items
    try:
        page = max(1, int(q["page"][0]))
        size = max(1, min(500, int((q.get("page_size") or ["100"])[0])))
    except ValueError:
        raise bad_request("page and page_size: numbers") from None
    total = len(items)
    name = (q.get("name") or [""])[0]
    if name:
        if (q.get("use_regex") or ["false"])[0] == "true":
            import re

            try:
                pattern = re.compile(name)
            except re.error as exc:
                raise bad_request(f"name: {exc}") from None
            items = [i for i in items if pattern.search(i["name"])]
        else:
            items = [i for i in items if name in i["name"]]
    filtered = len(items)
    chunk = items[(page - 1) * size: page * size]
    return {"filtered_count": filtered, "item_count": len(chunk), "items": chunk, "page": page,
            "page_count": -(-filtered // size), "page_size": size, "total_count": total}


def _select(result: Any, request: Request) -> Any:
    """``columns=a,b.c`` (rabbitmqadmin's list), ``sort`` and ``sort_reverse``."""
    items = result["items"] if isinstance(result, dict) and "items" in result else result
    if isinstance(items, list):
        sort = (request.query.get("sort") or [""])[0]
        if sort:
            items.sort(key=lambda i: str(_dig(i, sort)),
                       reverse=(request.query.get("sort_reverse") or ["false"])[0] == "true")
        columns = [c for c in ",".join(request.query.get("columns") or []).split(",") if c]
        if columns:
            items[:] = [_columns(i, columns) for i in items]
    return result


def _dig(item: Any, path: str) -> Any:
    for part in path.split("."):
        item = item.get(part) if isinstance(item, dict) else None
    return item


def _columns(item: dict[str, Any], columns: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for column in columns:
        value = _dig(item, column)
        target = out
        parts = column.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return out


def _amqp_error(exc: BrokerError) -> ManagementError:
    code = exc.code
    text = str(exc)
    if isinstance(exc, NotLeader):  # a partitioned node's: which node leads it
        return ManagementError(404, "not_found", text)
    if code == 404:
        return not_found()
    if code == 403:
        log.info("management API: %s", text)
        return not_authorised(ACCESS_REFUSED)
    return bad_request(text)


async def forward(base: str, request: Request, tls: Any) -> Response:
    """Send ``request`` as it came to ``base`` (another member's admin listener)."""
    from urllib.parse import urlencode

    target = request.path + (f"?{urlencode(request.query, doseq=True)}" if request.query else "")
    headers = {name: request.headers[name] for name in ("authorization", "content-type")
               if name in request.headers}
    try:
        return await asyncio.wait_for(
            exchange(base, request.method, target, headers, request.body, tls),
            IMPORT_FORWARD_TIMEOUT if body_limit(request.method, request.path) > MAX_REQUEST
            else FORWARD_TIMEOUT)
    except (OSError, TimeoutError, ValueError, IndexError) as exc:
        raise ManagementError(503, "service_unavailable",
                              f"the primary at {base} did not answer: {exc}") from None


def install(node: Node) -> ManagementAPI:
    """The management API on the node's admin listener. The definitions' and policies'
    routes build on it (``admin/endpoints.py`` installs them: they import this module)."""
    api = ManagementAPI(node)
    node.admin.fallback("/api/", api.handle)
    return api
