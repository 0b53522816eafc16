"""A management request of a queue whose partition another node leads, answered by that
leader (issue 35, docs/ha.md "Definitions on a partitioned cluster").

The management API is answered by the metadata group's primary (management.py,
``_forward``). A get (``POST /api/queues/{vhost}/{name}/get``) and the aliveness test
take messages off a queue, which only its partition's leader may do: the metadata
primary sends the request on, as it came (the user's credentials, the body), to the
leader's admin listener with ``X-Brokerha-Answer-Here`` and its member signature
(``X-Brokerha-Member``, http's ``member_token`` of the method and path). The leader
honours the marker only with a valid signature: it answers the request itself instead
of forwarding it back to the metadata primary, checking the user and permissions as
for any request. Its status and JSON are the answer; a leader that does not answer
within ``LEADER_TIMEOUT``: 503, as the other forwarded requests. A leader that no longer
leads the queue when it comes does not send it on again (no loop): 503, retry.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

from brokerha.httpapi.server import (
    MEMBER_HEADER,
    Request,
    Response,
    exchange,
    member_token,
    member_token_valid,
)

ANSWER_HERE = "x-brokerha-answer-here"
LEADER_TIMEOUT = 6.0  # under the first hop's FORWARD_TIMEOUT (10 s): its 503 comes back


def unavailable(reason: str) -> Response:
    return Response.json({"error": "service_unavailable", "reason": reason}, 503)


def answer_here(node: Any, request: Request) -> bool:
    """Whether ``request`` came from a member asking this node, as the queue's leader, to
    answer it itself (the marker and a valid member signature of its method and path)."""
    token = request.headers.get(MEMBER_HEADER)
    secret = node.admin.member_secret
    return (request.headers.get(ANSWER_HERE) == "1" and token is not None
            and secret is not None
            and member_token_valid(secret, token, request.method, request.path))


@dataclass
class _Named:
    """A queue by its name only (not declared yet): what ``queue_home`` reads of one."""

    vhost: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    exclusive_owner: Any = None


async def leader_of(api: Any, vhost: str, name: str, declare: bool) -> str | None:
    """The node to answer a request taking messages off the queue ``name``: None if this
    node does (no partition groups, it serves the queue's partition, an exclusive queue
    of its own, or -- unless ``declare`` -- no node holds such a queue: 404 here); else
    the leader's name. A queue this node holds no copy of is looked for on the other
    members (``partition_views.gather``: where it is served); one found nowhere, to be
    declared (the aliveness test), is placed by its name. Raises ``ManagementError``
    (503) while its partition has no leader this node knows of."""
    from brokerha.admin import partition_views
    from brokerha.admin.errors import ManagementError

    groups = api.node.broker.groups
    if groups is None:
        return None
    me = api.node.config.name
    host = api.node.broker.vhosts.get(vhost)
    q = None if host is None else host.queues.get(name)
    if q is not None:
        if q.exclusive_owner is not None or groups.serves_queue(vhost, name, q.arguments,
                                                                False):
            return None
    else:
        views = await partition_views.gather(api, (vhost, name))
        entry = None if views is None else views.queues.get((vhost, name))
        if entry is not None and entry.get("leader"):
            return None if entry["leader"] == me else str(entry["leader"])
        if not declare or groups.serves_queue(vhost, name, {}, False):
            return None  # nowhere (a get: 404 here), or to be declared here
        q = _Named(vhost, name)
    partition, leader = groups.queue_home(cast(Any, q))
    if leader is None or leader == me:
        raise ManagementError(503, "service_unavailable",
                              f"queue '{name}' in vhost '{vhost}' is in partition {partition}, "
                              "which has no serving leader now (an election); retry")
    return str(leader)


async def ask_leader(api: Any, leader: str, request: Request) -> Response:
    """``request`` as it came, answered by the member ``leader`` (its status and JSON)."""
    node = api.node
    ha = node.ha
    member = None if ha is None else next((m for m in ha.cluster.members
                                           if m.name == leader), None)
    base = None if member is None else (member.https_url or member.admin_url)
    secret = node.admin.member_secret
    if base is None or secret is None:
        return unavailable(f"the queue's leader {leader} has no admin listener this node "
                           "can ask")
    from urllib.parse import urlencode

    target = request.path + (f"?{urlencode(request.query, doseq=True)}" if request.query
                             else "")
    headers = {name: request.headers[name] for name in ("authorization", "content-type")
               if name in request.headers}
    headers[ANSWER_HERE] = "1"
    headers[MEMBER_HEADER] = member_token(secret, node.config.name, request.method,
                                          request.path)
    try:
        return await asyncio.wait_for(
            exchange(base, request.method, target, headers, request.body,
                     node.tls.member_client), LEADER_TIMEOUT)
    except (OSError, TimeoutError, ValueError, IndexError) as exc:
        return unavailable(f"the queue's leader {leader} at {base} did not answer: "
                           f"{exc or type(exc).__name__}")
