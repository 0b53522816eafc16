"""The management API's lists on a node running partition groups (issue 35, docs/ha.md
"Definitions on a partitioned cluster"): every partition's queues and bindings, each
queue as its leader sees it.

The management API is answered by the metadata primary. Its broker holds a copy of
the queues of every partition it holds a cell of, but a copy is not the queue: a
backup's copy counts no consumer and no unacknowledged message (they are the
leader's), and a node holding no cell of a partition (more nodes than
``partition_replicas`` + 1) holds none of its queues nor their bindings. So
``GET /api/queues``, ``/api/bindings`` and ``/api/definitions`` ask every other
member for what it serves (``GET /api/brokerha/partition-objects``, read with the
cluster's member signature): the queues of the partitions it leads now and its
exclusive queues (on no other node), in ``/api/queues``' fields, and their bindings
(the export leaves exclusive queues out, as before). A queue led elsewhere is listed as
its leader answered; one of a partition no answering member leads is listed from
this node's copy (if it holds one). The export refuses (503 naming them) when
some partition's queues are neither here nor on an answering leader: a file
silently missing queues would lose them at its import. Asking the leaders reads
no directory; when the metadata group's queue directory exists this can read it
for the names (the counts stay the leader's).
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlencode

from brokerha.admin.peers import _signer, fetch_json
from brokerha.broker.placement import NotLeader
from brokerha.httpapi.server import Request, Response
from brokerha.partition.directory import Owner

PATH = "/api/brokerha/partition-objects"
PEER_TIMEOUT = 1.5


def served_objects(api: Any, only: tuple[str, str] | None = None) -> dict[str, Any]:
    """What this node serves now: its partitions (``served``), their queues and its
    exclusive queues (in no partition, on this node only) in ``/api/queues``' fields, and
    the bindings to them (``/api/bindings``' fields); ``only`` (vhost, name): that queue
    alone, no bindings."""
    broker = api.node.broker
    groups = broker.groups
    served: set[int] = set()
    queues: list[dict[str, Any]] = []
    bindings: list[dict[str, Any]] = []
    if groups is None:
        return {"node": api.node.config.name, "served": [], "queues": [], "bindings": []}
    for vh in list(broker.vhosts.values()):
        if only is not None and vh.name != only[0]:
            continue
        mine: set[str] = set()
        for q in list(vh.queues.values()):
            if only is not None and q.name != only[1]:
                continue
            if isinstance(q.exclusive_owner, Owner):
                continue  # a stand-in of another node's exclusive queue: that node lists it
            if q.exclusive_owner is not None:  # in no partition: this node's own
                mine.add(q.name)
                queues.append(api._queue_entry(q))
                continue
            partition, leader = groups.queue_home(q)
            if partition is None or leader != api.node.config.name or \
                    not groups.serves_queue(q.vhost, q.name, q.arguments, False):
                continue
            served.add(partition)
            mine.add(q.name)
            queues.append(api._queue_entry(q))
        if only is None:
            bindings += [b for b in api._binding_entries(vh)
                         if b["destination_type"] == "queue" and b["destination"] in mine]
    for p in _serving_partitions(groups):
        served.add(p)
    return {"node": api.node.config.name, "served": sorted(served), "queues": queues,
            "bindings": bindings}


def stand_in(node: Any, queue: Any) -> bool:
    """Whether ``queue`` is a stand-in of the queue directory on this node (a queue of a
    partition it holds no cell of, or another node's exclusive queue): not this node's
    queue, so never in its own lists (its leader lists it)."""
    groups = node.broker.groups
    owners = None if groups is None else getattr(groups, "owners", None)
    return owners is not None and owners.stand_ins.is_stand_in(queue)


def led_only(node: Any, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of ``entries`` (``api.queue_list``'s), those of the queues this node leads now and
    its own exclusive queues: its answer to another member's ``led_queue_list``."""
    groups = node.broker.groups
    me = node.config.name
    led: set[tuple[str, str]] = set()
    for vh in list(node.broker.vhosts.values()):
        for q in list(vh.queues.values()):
            if isinstance(q.exclusive_owner, Owner):
                continue
            if q.exclusive_owner is not None:
                led.add((q.vhost, q.name))
                continue
            _, leader = groups.queue_home(q)
            if leader == me and groups.serves_queue(q.vhost, q.name, q.arguments, False):
                led.add((q.vhost, q.name))
    return [e for e in entries if (e["vhost"], e["name"]) in led]


async def led_queue_list(node: Any, local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``local`` (this node's ``api.queue_list``, stand-ins left out) with each queue
    another member leads as that member lists it (``GET /api/brokerha/queues?led=1``,
    asked in parallel; one not answering within ``PEER_TIMEOUT`` is left out: its queues
    as this node's copy has them, or not at all), and the queues this node holds nothing
    of (a partition it holds no cell of, another node's exclusive queue): each queue
    once, with its leader's figures, never a stand-in's zeros."""
    ha = node.ha
    me = node.config.name
    members = [] if ha is None else [m for m in ha.cluster.members if m.name != me]
    sign = _signer(node)

    async def one(member: Any) -> list[dict[str, Any]]:
        base = member.https_url or member.admin_url
        if not base:
            return []
        try:
            answer = await fetch_json(base + "/api/brokerha/queues?led=1", PEER_TIMEOUT,
                                      node.tls.member_client, sign)
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError):
            return []
        return list(answer.get("queues") or []) if isinstance(answer, dict) else []

    led = {(q["vhost"], q["name"]): q
           for a in await asyncio.gather(*(one(m) for m in members)) for q in a}
    out = [led.pop((q["vhost"], q["name"]), q) for q in local]
    out += led.values()
    out.sort(key=lambda q: (q["vhost"], q["name"]))
    return out


def _serving_partitions(groups: Any) -> list[int]:
    """The partitions whose groups this node serves now (with no queue, too)."""
    return [g - 1 for g in groups.serving_groups() if g > 0]


class Views:
    """The other members' ``served_objects``, gathered once for a request."""

    def __init__(self, me: str, answers: list[dict[str, Any]],
                 unknown: list[int] | None) -> None:
        self.me = me
        self.answers = answers
        self.served: set[int] = {p for a in answers for p in a.get("served") or []}
        # (vhost, name) -> the leader's entry
        self.queues: dict[tuple[str, str], dict[str, Any]] = {
            (q["vhost"], q["name"]): q for a in answers for q in a.get("queues") or []}
        self.bindings = [b for a in answers for b in a.get("bindings") or []]
        # partitions whose queues this node holds no copy of (None: no table here yet)
        self.unknown = unknown

    def missing(self) -> list[int] | None:
        """Partitions neither held here nor led by an answering member (None: not known:
        this node holds no partition table yet)."""
        if self.unknown is None:
            return None
        return [p for p in self.unknown if p not in self.served]

    def queue_entries(self, local: list[dict[str, Any]], vhost: str | None) -> \
            list[dict[str, Any]]:
        """``local`` (this node's entries) with each queue a member leads as that member
        answered, and the queues it leads that this node holds no copy of."""
        out = [self.queues.get((q["vhost"], q["name"]), q) for q in local]
        have = {(q["vhost"], q["name"]) for q in local}
        out += [q for key, q in self.queues.items()
                if key not in have and (vhost is None or key[0] == vhost)]
        return out

    def binding_entries(self, local: list[dict[str, Any]], vhost: str | None) -> \
            list[dict[str, Any]]:
        """``local`` and the bindings of the queues this node holds no copy of."""
        seen = {_binding_key(b) for b in local}
        out = list(local)
        for b in self.bindings:
            if (vhost is None or b["vhost"] == vhost) and _binding_key(b) not in seen:
                seen.add(_binding_key(b))
                out.append(b)
        return out


def _binding_key(b: dict[str, Any]) -> tuple[Any, ...]:
    return (b["vhost"], b["source"], b["destination_type"], b["destination"],
            b["properties_key"])


async def gather(api: Any, only: tuple[str, str] | None = None) -> Views | None:
    """The other members' views, asked in parallel (None: no partition groups here), of
    every queue or ``only`` (vhost, name). A member that does not answer within
    ``PEER_TIMEOUT`` is left out."""
    node = api.node
    groups = node.broker.groups
    ha = node.ha
    if groups is None or ha is None:
        return None
    try:
        unknown: list[int] | None = list(groups.unknown_partitions())
    except NotLeader:  # no table yet: which partitions it lacks is not known
        unknown = None
    me = node.config.name
    members = [m for m in ha.cluster.members if m.name != me]
    sign = _signer(node)
    query = "" if only is None else "?" + urlencode({"vhost": only[0], "name": only[1]})

    async def one(member: Any) -> dict[str, Any] | None:
        base = member.https_url or member.admin_url
        if not base:
            return None
        try:
            answer = await fetch_json(base + PATH + query, PEER_TIMEOUT,
                                      node.tls.member_client, sign)
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError):
            return None
        return answer if isinstance(answer, dict) else None

    answers = [a for a in await asyncio.gather(*(one(m) for m in members)) if a is not None]
    return Views(me, answers, unknown)


def install(api: Any) -> None:
    """``GET /api/brokerha/partition-objects`` on the node's admin listener (a management
    tag, or a member's signature)."""
    def handler(request: Request) -> Response:
        api.start()  # its sampler: the rates in the entries
        vhost, name = request.query.get("vhost"), request.query.get("name")
        only = (vhost[0], name[0]) if vhost and name else None
        return Response.json(served_objects(api, only))

    api.node.admin.route("GET", PATH, handler)
