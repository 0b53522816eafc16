"""``POST /api/check-replicas``: the asyncio side of a replica check (``ha/check.py``).

``ctl check-replicas`` posts ``{"group": g, "timeout": s}`` to the group's
leader (``group`` absent or 0 on an ordinary cluster: its one group). The
member emits the ``ck`` and makes its own report in slices; this waits until
every backup that followed at the ``ck`` reported, or ``timeout`` seconds
passed, and answers the comparison (``ReplicaCheck.result``): a backup that
did not report in time is named, never waited for longer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from brokerha.ha.check import CheckRefused
from brokerha.ha.member import HAMember
from brokerha.httpapi.server import HTTPError, Request, Response

DEFAULT_TIMEOUT = 30.0
MAX_TIMEOUT = 600.0


async def answer(request: Request, member_of: Callable[[int | None], HAMember | None],
                 me: str) -> Response:
    body = request.json()
    if not isinstance(body, dict):
        raise HTTPError(400, "body: a JSON object")
    try:
        group = None if body.get("group") is None else int(body["group"])
        timeout = min(MAX_TIMEOUT, max(0.0, float(body.get("timeout", DEFAULT_TIMEOUT))))
    except (TypeError, ValueError):
        raise HTTPError(400, "group: a group number; timeout: seconds") from None
    member = member_of(group)
    if member is None:
        raise HTTPError(404, f"{me} is not a member of group {group}")
    try:
        run = member.check_replicas()
    except CheckRefused as exc:
        raise HTTPError(409, str(exc)) from exc
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    run.on_done.append(finished)
    if not run.done:
        try:
            await asyncio.wait_for(done, timeout)
        except TimeoutError:
            pass
    return Response.json(run.result(member.clock()))
