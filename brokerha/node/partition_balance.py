"""The table coordinator's side of ``brokerha ctl partitions balance`` (issue 35).

``POST /api/partitions/balance {"timeout": S}`` on the metadata primary (the partition
table's coordinator, ``partition/coordinator.py``): a ``partition.balance.Balancer``
over the partition table's preferred cells, stepped every ``STEP`` with what the nodes
answer (``admin/api.py`` ``member_statuses``: every member's own status, its
groups' roles, epochs, readiness; not ``cluster_view``, whose queue list would cost
the coordinator's loop every step), until it is done. Each ``Promote`` goes to the group's
leader: this node's member when it leads the group (``PartitionedMember.promote``),
else ``POST /api/promote {"node", "group"}`` on the leader's admin listener with the
operator's credentials (a member's signature is good for reads only). One move at a
time, each waited for; one run at a time per node (409 meanwhile). The answer: one
line per partition (moved, balanced, skipped and why), the partitions left
unbalanced, the run's seconds.

Driven by the request, not by the node's tick: nothing moves a leader unless an
operator asks (no ``auto_balance`` yet).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from brokerha.admin.api import member_statuses, member_url
from brokerha.broker.placement import METADATA_GROUP
from brokerha.cluster.partition_table import PartitionTableError
from brokerha.httpapi.server import HTTPError, Request, Response, exchange
from brokerha.partition import balance, moves

if TYPE_CHECKING:
    from brokerha.node.ha_groups import GroupsNode

log = logging.getLogger("brokerha.ha")

STEP = 0.05  # between two observations
ASK_TIMEOUT = 5.0  # a leader's answer to a hand-over request
MAX_TIMEOUT = 300.0


class BalanceEndpoint:
    """``POST /api/partitions/balance`` of a node running partition groups (and, made with
    it, ``POST /api/partitions/drain``: ``DrainEndpoint``)."""

    def __init__(self, shell: GroupsNode) -> None:
        self.shell = shell
        self.running = False
        shell.node.admin.route("POST", "/api/partitions/balance", self.request, admin=True)
        self.drain = DrainEndpoint(shell)

    async def request(self, request: Request) -> Response:
        shell = self.shell
        metadata = shell.ha.groups[METADATA_GROUP]
        if metadata.role_term() is None:
            raise HTTPError(409, f"{shell.me} is not the metadata primary (the partition "
                                 "table's coordinator): ask "
                                 f"{metadata.election.primary or 'it (none known now)'}")
        table = shell.partitions.table
        if not table.exists:
            raise HTTPError(409, "no partition table yet")
        try:
            timeout = float(request.json().get("timeout", 15.0))
        except (TypeError, ValueError):
            raise HTTPError(400, "timeout: seconds a move may take") from None
        if not 0 < timeout <= MAX_TIMEOUT:
            raise HTTPError(400, f"timeout: more than 0, at most {MAX_TIMEOUT:g} seconds")
        if self.running:
            raise HTTPError(409, f"a balance is under way on {shell.me}")
        self.running = True
        try:
            return Response.json(await self.run(request, [
                table.preferred_leader(p) or "" for p in range(table.partitions)], timeout))
        finally:
            self.running = False

    async def run(self, request: Request, preferred: list[str],
                  timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        balancer = balance.Balancer(preferred, timeout)
        while True:
            _own, members, answers = await member_statuses(self.shell.node)
            nodes = [{**(answer.get("node") or {}), **{k: member.get(k) for k in (
                "name", "admin_url", "https_url")}} for member, answer in zip(
                members or [{"name": self.shell.me}], answers, strict=True)]
            action = balancer.step(time.monotonic(), balance.observe(nodes))
            if isinstance(action, balance.Done):
                break
            if isinstance(action, balance.Promote):
                reason = await self.ask(action, request, nodes)
                if reason is not None:
                    balancer.refused(time.monotonic(), action.partition, reason)
            await asyncio.sleep(STEP)
        report = action.report
        for line in report:
            if line.status != balance.BALANCED:
                log.warning("partitions balance: %s", line.text())
        return {"partitions": [line.as_json() for line in report],
                "moved": sum(line.status == balance.MOVED for line in report),
                "unbalanced": balancer.unbalanced(), "by": self.shell.me,
                "seconds": round(time.monotonic() - started, 3)}

    async def ask(self, action: balance.Promote, request: Request,
                  nodes: list[dict[str, Any]]) -> str | None:
        """Ask the group's leader to hand over: None, or why it did not."""
        shell = self.shell
        log.warning("partitions balance: partition %d (group %d) asked of %s, to %s",
                    action.partition, action.group, action.leader, action.target)
        if action.leader == shell.me:
            try:
                shell.ha.promote(action.group, action.target)
            except ValueError as exc:
                return str(exc)
            shell._record_failover("promote requested", node=action.target, by=shell.me,
                                   group=action.group)
            return None
        member = next((n for n in nodes if n.get("name") == action.leader), None)
        if member is None or not (member.get("admin_url") or member.get("https_url")):
            return f"{action.leader}: no admin URL known"
        headers = {"content-type": "application/json"}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        body = json.dumps({"node": action.target, "group": action.group}).encode()
        try:
            answer = await asyncio.wait_for(
                exchange(member_url(member), "POST", "/api/promote", headers, body,
                         shell.node.tls.member_client), ASK_TIMEOUT)
        except (OSError, TimeoutError, ValueError, IndexError) as exc:
            return f"{action.leader} did not answer: {exc}"
        if answer.status != 200:
            try:
                parsed = json.loads(answer.body)
                said = parsed.get("error") or parsed.get("reason")
            except (ValueError, AttributeError):
                said = answer.body[:200]
            return f"{action.leader}: {answer.status} {said}"
        return None


def _coordinator(shell: GroupsNode) -> None:
    metadata = shell.ha.groups[METADATA_GROUP]
    if metadata.role_term() is None:
        raise HTTPError(409, f"{shell.me} is not the metadata primary (the partition "
                             "table's coordinator): ask "
                             f"{metadata.election.primary or 'it (none known now)'}")
    if not shell.partitions.table.exists:
        raise HTTPError(409, "no partition table yet")


class DrainEndpoint:
    """``POST /api/partitions/drain {"node", "undrain", "timeout"}`` on the metadata primary
    (``ctl partitions drain NODE``, ``ctl partitions undrain NODE``; stage 5 of docs/ha.md
    "Partitions"): a ``moves.Mover`` stepped every ``STEP`` with what the nodes answer
    (each group's leader: the membership it runs, the learners it reports caught up),
    each of its table changes made here (``TableCoordinator.change``, a ``pt``); the groups
    carry them out by themselves (``moves.MembershipChanger`` on each leader). One
    partition at a time; the answer: a line per partition, whether it finished, and the
    partitions the node's loss would stop now. ``timeout``: the longest one step (a
    learner's catch-up, a group's change) may take."""

    def __init__(self, shell: GroupsNode) -> None:
        self.shell = shell
        self.running = False
        shell.node.admin.route("POST", "/api/partitions/drain", self.request, admin=True)

    async def request(self, request: Request) -> Response:
        shell = self.shell
        _coordinator(shell)
        body = request.json()
        node = str(body.get("node", ""))
        names = [m.name for m in shell.cluster.members]
        if node not in names:
            raise HTTPError(400, f"node: one of {', '.join(names)}")
        try:
            timeout = float(body.get("timeout", 30.0))
        except (TypeError, ValueError):
            raise HTTPError(400, "timeout: seconds a step may take") from None
        if not 0 < timeout <= MAX_TIMEOUT:
            raise HTTPError(400, f"timeout: more than 0, at most {MAX_TIMEOUT:g} seconds")
        if self.running:
            raise HTTPError(409, f"a drain is under way on {shell.me}")
        self.running = True
        try:
            return Response.json(await self.run(node, names, bool(body.get("undrain")),
                                                timeout))
        finally:
            self.running = False

    async def run(self, node: str, names: list[str], undrain: bool,
                  timeout: float) -> dict[str, Any]:
        shell = self.shell
        started = time.monotonic()
        mover = moves.Mover(node, names, undrain=undrain, every_group=True)
        what = "undrain" if undrain else "drain"
        waiting: tuple[str, float] | None = None  # (why, since)
        finished, lines = False, []
        while True:
            if shell.ha.groups[METADATA_GROUP].role_term() is None:
                lines = ["stopped: this node is no longer the partition table's coordinator"]
                break
            _own, members, answers = await member_statuses(shell.node)
            nodes = [{**(answer.get("node") or {}), "name": member.get("name")}
                     for member, answer in zip(members or [{"name": shell.me}], answers,
                                               strict=True)]
            memberships, done = moves.observe(nodes)
            table = shell.partitions.table
            step = mover.step(table, memberships, done)
            if isinstance(step, moves.Finished):
                finished, lines = True, list(step.lines)
                break
            if isinstance(step, moves.Change):
                try:
                    shell.partitions.change(step.change)
                except PartitionTableError as exc:
                    lines = [f"stopped: {step.why}: {exc}"]
                    break
                log.warning("partitions %s %s: %s (ptid %d)", what, node, step.why,
                            step.change.ptid)
                waiting = None
            elif isinstance(step, moves.Waiting):
                now = time.monotonic()
                if waiting is None or waiting[0] != step.why:
                    waiting = (step.why, now)
                elif now - waiting[1] > timeout:
                    lines = [*mover.lines.values(), f"timed out: {step.why}"]
                    break
            await asyncio.sleep(STEP)
        table = shell.partitions.table
        for line in lines:
            log.warning("partitions %s %s: %s", what, node, line)
        return {"node": node, "undrain": undrain, "finished": finished, "lines": lines,
                "cells": table.cells_of(node), "stopped_by": table.stopped_by(node),
                "ptid": table.ptid, "by": shell.me,
                "seconds": round(time.monotonic() - started, 3)}
