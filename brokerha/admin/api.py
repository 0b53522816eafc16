"""Read-only admin endpoints of a node.

``endpoints.install(node)`` (called once when the node is built) registers, on
the admin listener, these and the status page and metrics:

| path | credentials | what |
|---|---|---|
| ``GET /`` | none | the status page (``status_page.py``) |
| ``GET /metrics`` | none | Prometheus text format (``metrics.py``) |
| ``GET /api/cluster`` | none | every member's own ``/api/status``, gathered by this node |
| ``GET /api/brokerha/queues`` | none | queues: depth, unacked, consumers, counters, arguments, backups caught up, what is replicated |
| ``GET /api/brokerha/connections`` | administrator | client connections: peer, user, vhost, channels |
| ``GET /api/brokerha/users`` | administrator | users and their tags (never the password hashes) |
| ``GET /api/brokerha/permissions`` | administrator | user × vhost permission patterns |
| ``GET /api/txlog`` | none | the TxLog master's state on this node (``running: false`` and a reason when it runs none) |
| ``POST /api/txlog/export`` | administrator | ``{"out": DIR}``: Parquet export of this node's TxLog (docs/txlog-export.md) |
| ``POST /api/txlog/peers`` | administrator | ``{"id": DC, "url": "txlog://host:port[, ...]"}``: add a sync peer at runtime |
| ``POST /api/txlog/peers/remove`` | administrator | ``{"id": DC}``: remove a sync peer at runtime |
| ``POST /api/txlog/split-recovery`` | administrator | ``{"value": "None"|"Simple"|"Smart"}`` (refused during a split) |

The three TxLog changes are accepted only by the node running the DC's master
(a standalone node with ``[txlog]``, or the serving primary); another node
answers 409 naming the primary it knows. Input the master could never accept
(no id, a bad URL, an unknown strategy) is a 400; a change it refuses now
(a peer already configured, an unknown peer, during a split or a vote) a 409.
On an HA primary the answer waits (up to 5 s) for the change to reach the DC's
quorum and says in ``replicated`` whether it did.

Reading status, queues and metrics needs no credentials, as ``/api/status``
(what a monitoring probe needs); who connects and who may do what is for
administrators only. RabbitMQ's paths (``/api/queues``, ``/api/overview``, ...)
are the management API (management.py), which needs credentials.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from brokerha.admin.node_view import NodeView
from brokerha.admin.peers import _signer, fetch_json
from brokerha.httpapi.server import (
    HTTPError,
    Request,
    Response,
    json_safe,
)

Node = NodeView  # what these endpoints read of the node (admin/node_view.py)

PEER_TIMEOUT = 1.5
TXLOG_NOT_CONFIGURED = ("no [txlog] section in this node's configuration: it orders nothing "
                        "across datacenters")


def install(node: Node) -> None:
    api = AdminAPI(node)
    node.admin.route("GET", "/api/cluster", api.cluster)
    node.admin.route("GET", "/api/brokerha/queues", api.queues)
    node.admin.route("GET", "/api/brokerha/connections", api.connections, admin=True)
    node.admin.route("GET", "/api/brokerha/users", api.users, admin=True)
    node.admin.route("GET", "/api/brokerha/permissions", api.permissions, admin=True)
    node.admin.route("GET", "/api/txlog", api.txlog)
    node.admin.route("POST", "/api/txlog/export", api.txlog_export, admin=True)
    node.admin.route("POST", "/api/txlog/peers", api.txlog_add_peer, admin=True)
    node.admin.route("POST", "/api/txlog/peers/remove", api.txlog_remove_peer, admin=True)
    node.admin.route("POST", "/api/txlog/split-recovery", api.txlog_split_recovery, admin=True)


def txlog_status(node: Node) -> dict[str, Any]:
    bridge = getattr(node, "txlog", None)
    if bridge is None:
        return {"running": False, "node": node.config.name, "reason": TXLOG_NOT_CONFIGURED}
    return {**bridge.status(), "node": node.config.name, "master": bridge.node_id}


class AdminAPI:
    def __init__(self, node: Node) -> None:
        self.node = node

    # -- the whole datacenter, as seen from here -----------------------------------------

    async def cluster(self, request: Request) -> Response:
        return Response.json(await cluster_view(self.node))

    # -- listings ------------------------------------------------------------------------

    def queues(self, request: Request) -> Any:
        local = queue_list(self.node)
        if self.node.broker.groups is None:
            return Response.json({"node": self.node.config.name, "queues": local})
        from brokerha.admin import partition_views

        if request.query.get("led"):  # a member's ask: the queues this node leads
            return Response.json({"node": self.node.config.name,
                                  "queues": partition_views.led_only(self.node, local)})
        return self._led_queues(local)

    async def _led_queues(self, local: list[dict[str, Any]]) -> Response:
        """On a partitioned node: each queue as its leader lists it (partition_views.py)."""
        from brokerha.admin import partition_views

        return Response.json({"node": self.node.config.name,
                              "queues": await partition_views.led_queue_list(self.node, local)})

    def connections(self, request: Request) -> Response:
        now = self.node.loop.time()
        out = []
        for proto in list(self.node.connections):
            conn = proto.conn
            if conn is None:
                continue
            props = conn.client_properties or {}
            out.append({
                "peer": f"{conn.peer[0]}:{conn.peer[1]}" if conn.peer else None,
                "user": conn.user.name if conn.user else None,
                "vhost": conn.vhost.name if conn.vhost is not None else None,
                "channels": len(conn.channels),
                "state": str(conn.state),
                "client": {k: json_safe(props.get(k)) for k in ("product", "version", "platform",
                                                               "connection_name")
                           if props.get(k) is not None},
                "connected_seconds": round(now - conn.created, 3),
                "blocked": bool(conn.blocked_notified),
            })
        out.sort(key=lambda c: c["peer"] or "")
        return Response.json({"node": self.node.config.name, "connections": out})

    def users(self, request: Request) -> Response:
        db = self.node.broker.users
        out = [{"name": u.name, "tags": list(u.tags),
                "loopback_only": u.name in db.loopback_users,
                "vhosts": sorted(u.permissions)} for u in db.users.values()]
        out.sort(key=lambda u: u["name"])
        return Response.json({"node": self.node.config.name, "users": out})

    def permissions(self, request: Request) -> Response:
        out = [{"user": u.name, "vhost": vhost, "configure": p.configure, "write": p.write,
                "read": p.read}
               for u in self.node.broker.users.users.values()
               for vhost, p in u.permissions.items()]
        out.sort(key=lambda p: (p["user"], p["vhost"]))
        return Response.json({"node": self.node.config.name, "permissions": out})

    def txlog(self, request: Request) -> Response:
        return Response.json(txlog_status(self.node))

    async def txlog_export(self, request: Request) -> Response:
        bridge = getattr(self.node, "txlog", None)
        driver = bridge.driver if bridge is not None else None
        if driver is None:
            raise HTTPError(409, txlog_status(self.node)["reason"])
        out = request.json().get("out")
        if not isinstance(out, str) or not out:
            raise HTTPError(400, "out: a directory on the node's host")
        folder = await driver.export(out)
        return Response.json({"folder": str(folder),
                              "files": sorted(p.name for p in folder.iterdir())})


    # -- TxLog changes at runtime (the node running the DC's master only) ---------------

    async def txlog_add_peer(self, request: Request) -> Response:
        body = _object(request)
        node_id, url = body.get("id"), body.get("url")
        if not isinstance(node_id, str) or not node_id.strip():
            raise HTTPError(400, 'id: the peer\'s TxLog node id, e.g. {"id": "dc2", "url": ...}')
        if not isinstance(url, str):
            raise HTTPError(400, "url: txlog://host:port (an HA datacenter: every node's, "
                                 "comma-separated)")
        node_id, url = node_id.strip(), url.strip()
        _bad_input(self.node, lambda bridge: bridge.check_peer_url(node_id, url))
        bridge = _txlog_master(self.node)
        replicated = await _change(bridge.add_peer(node_id, url))
        return _changed(self.node, replicated, f"peer {node_id} added ({url})")

    async def txlog_remove_peer(self, request: Request) -> Response:
        node_id = _object(request).get("id")
        if not isinstance(node_id, str) or not node_id.strip():
            raise HTTPError(400, 'id: the peer\'s TxLog node id, e.g. {"id": "dc2"}')
        bridge = _txlog_master(self.node)
        replicated = await _change(bridge.remove_peer(node_id.strip()))
        return _changed(self.node, replicated, f"peer {node_id.strip()} removed")

    async def txlog_split_recovery(self, request: Request) -> Response:
        value = _object(request).get("value")
        if not isinstance(value, str):
            raise HTTPError(400, "value: None, Simple or Smart")
        strategy = _bad_input(self.node, lambda bridge: bridge.parse_split_recovery(value))
        bridge = _txlog_master(self.node)
        replicated = await _change(bridge.set_split_recovery(strategy))
        return _changed(self.node, replicated, f"split-recovery {strategy}")


def _object(request: Request) -> dict[str, Any]:
    body = request.json()
    if not isinstance(body, dict):
        raise HTTPError(400, "body: a JSON object")
    return body


def _bad_input(node: Node, check: Any) -> Any:
    """``check(bridge)``'s result; its ValueError (the TxLog's ConfigError) is a 400.

    The bridge validates (the admin package sits below the TxLog and does not
    import it); without ``[txlog]`` there is nothing to check against, and
    ``_txlog_master`` answers the 409.
    """
    bridge = getattr(node, "txlog", None)
    if bridge is None:
        return None
    try:
        return check(bridge)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None


def _txlog_master(node: Node) -> Any:
    """The bridge of the master running here, or a 409 saying where it runs.

    Only this node's master may change its peers or strategy: a backup's copy
    is replaced by whatever its primary replicates next.
    """
    bridge = getattr(node, "txlog", None)
    if bridge is not None and bridge.driver is not None:
        return bridge
    me = node.config.name
    if bridge is None:
        raise HTTPError(409, f"node {me}: {TXLOG_NOT_CONFIGURED}")
    where = ""
    ha = getattr(node, "ha", None)
    if ha is not None:
        primary = ha.election.primary
        if primary is None:
            where = "; no primary is serving (an election is under way, or no majority is up)"
        elif primary == me:
            where = "; this node is becoming the primary: retry in a moment"
        else:
            url = next((m.admin_url for m in ha.cluster.members if m.name == primary), None)
            where = (f"; the DC's serving primary is {primary}"
                     f"{f' ({url})' if url else ''}: send the change there")
    raise HTTPError(409, f"node {me} does not run the TxLog master {bridge.node_id} "
                         f"({bridge.reason}){where}")


async def _change(work: Any) -> bool:
    """Run a bridge change; the engine's refusal (``ConfigError``, a ValueError) is a 409."""
    try:
        return bool(await work)
    except ValueError as exc:
        raise HTTPError(409, str(exc)) from None
    except ConnectionError as exc:  # the master stopped meanwhile (demotion, shutdown)
        raise HTTPError(409, f"{exc}: nothing changed; ask the serving primary") from None
    except TimeoutError as exc:  # a peer change waits for its journal record's fsync (driver.py)
        raise HTTPError(503, str(exc)) from None


def _changed(node: Node, replicated: bool, what: str) -> Response:
    status = txlog_status(node)
    message = f"{status['master']} on {status['node']}: {what}"
    if not replicated:
        message += ("; NOT yet on the datacenter's quorum (a failover now could undo it; "
                    "check the backups with 'ctl status')")
    return Response.json({**status, "replicated": replicated, "message": message})


def queue_list(node: Node) -> list[dict[str, Any]]:
    """Every queue of the node; on a primary, which backups acknowledged its catch-up and
    what of it is replicated (``replicate``: all, configuration or none; with
    ``replicate_change`` while a change of its ``ha-replicate`` is not applied yet)."""
    caught: dict[tuple[str, str], dict[str, bool]] = {}
    primary = getattr(node.ha, "primary", None)
    for backup, session in sorted((getattr(primary, "sessions", None) or {}).items()):
        progress = getattr(session, "progress", None)
        for guard in getattr(session, "guards", []):
            if progress is not None:
                caught.setdefault((guard.vhost, guard.queue), {})[backup] = guard.passed(progress)
    from brokerha.admin.partition_views import stand_in

    out = []
    queues = []
    for vhost in list(node.broker.vhosts.values()):
        for q in list(vhost.queues.values()):
            if stand_in(node, q):  # another node's queue (the directory's): not listed here
                continue
            queues.append(q)
            out.append({
                "vhost": q.vhost, "name": q.name, "durable": q.durable,
                "exclusive": q.exclusive_owner is not None, "auto_delete": q.auto_delete,
                "messages_ready": q.message_count, "messages_unacked": q.unacked,
                "ready_bytes": q.ready_bytes, "consumers": q.consumer_count,
                "published": getattr(q, "published", 0),
                "delivered": getattr(q, "delivered", 0),
                "deduplicated": q.dedup_dropped,
                "arguments": {k: json_safe(v) for k, v in sorted(q.arguments.items())},
            })
    if primary is not None:  # what of each queue the primary replicates (issue 34)
        for entry, q in zip(out, queues, strict=True):
            entry["replicate"] = primary.replicate_mode(q)
            change = primary.replicate_change(q)
            if change is not None:  # an ha-replicate change not yet applied on every backup
                entry["replicate_change"] = f"{change.old} -> {change.new} ({change.why})"
                for backup in primary.lacking(q):  # to join again: its catch-up brings it
                    caught.setdefault((q.vhost, q.name), {})[backup] = False
    for entry in out:
        backups = caught.get((entry["vhost"], entry["name"]))
        if backups is not None:
            entry["backups_caught_up"] = backups
    out.sort(key=lambda q: (q["vhost"], q["name"]))
    return out


async def member_statuses(node: Node) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                list[dict[str, Any]]]:
    """(this node's status, the members, each member's own status answer -- role ``down``
    when it does not answer), asked in parallel."""
    own = node.status()
    own["node"].setdefault("loop", node.loop_monitor.status())  # a standalone node's too
    members = own.get("members") or []
    me = node.config.name

    async def ask(member: dict[str, Any]) -> dict[str, Any]:
        if member["name"] == me:
            return own
        try:
            return await fetch_json(member_url(member) + "/api/status", PEER_TIMEOUT,
                                    node.tls.member_client, _signer(node))
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError) as exc:
            return {"node": {"name": member["name"], "role": "down", "epoch": None,
                             "ready": False, "amqp_url": member.get("amqp_url"),
                             "error": str(exc) or type(exc).__name__}}

    answers = await asyncio.gather(*(ask(m) for m in members)) if members else [own]
    return own, members, list(answers)


async def cluster_view(node: Node) -> dict[str, Any]:
    """Every member's own status (role ``down`` when it does not answer), asked in parallel."""
    own, members, answers = await member_statuses(node)
    me = node.config.name
    nodes = []
    for member, answer in zip(members or [{"name": me, "admin_url": None}], answers,
                              strict=True):
        entry = dict(answer.get("node") or {})
        entry["admin_url"] = member.get("admin_url")
        entry["https_url"] = member.get("https_url")
        entry["failovers"] = answer.get("failovers") or []
        nodes.append(entry)
    primaries = [n for n in nodes if n.get("role") == "primary"]
    primary = primaries[0] if len(primaries) == 1 else None
    failovers = sorted(({**f, "seen_by": n["name"]} for n in nodes for f in n.pop("failovers")),
                       key=lambda f: f.get("at", 0.0), reverse=True)
    queues: list[dict[str, Any]] | None = None
    if primary is None or primary["name"] == me:
        queues = queue_list(node)
        if node.broker.groups is not None:  # each queue as its leader lists it
            from brokerha.admin import partition_views

            queues = await partition_views.led_queue_list(node, queues)
    elif primary.get("admin_url") or primary.get("https_url"):
        try:
            answer = await fetch_json(member_url(primary) + "/api/brokerha/queues", PEER_TIMEOUT,
                                      node.tls.member_client, _signer(node))
            queues = list(answer.get("queues") or [])
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError):
            queues = None
    return {"cluster": own.get("cluster"), "asked": me, "at": time.time(), "nodes": nodes,
            "primary": primary["name"] if primary else None,
            "replication": primary.get("replication") if primary else None,
            "queues": queues, "queues_from": (primary or {"name": me})["name"],
            "failovers": failovers[:20], "txlog": txlog_status(node)}


def member_url(member: dict[str, Any]) -> str:
    """Where to read another member: its HTTPS listener if it has one, else plain HTTP."""
    return str(member.get("https_url") or member["admin_url"])


