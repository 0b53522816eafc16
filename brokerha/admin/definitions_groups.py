"""A definitions import's exchanges, queues and bindings on a node running partition groups
(issue 35, docs/ha.md "Definitions on a partitioned cluster").

Without partition groups, ``definitions_file._declare`` declares the file's
exchanges, queues and bindings on the primary's broker, which holds them all.
With partition groups a queue, its life and its bindings are its partition's
(that group's log), the exchanges the metadata group's: each item is asked
of the leader of the group it belongs to, as a client's declaration on any
node is (``partition/declarations.py``'s ``NodeDeclarations.request``, the
same ``MetaRequest`` and the leader's ``BrokerOps``, so the same checks and
errors as the broker's own paths). A group this node serves is asked the
same way (the request goes to its own host): every answer comes once what
the leader did is durable through that group's gate and barriers, and once
this node's copy of the group holds it. So the import is answered only once
every item is durable where it belongs.

Order: the exchanges (all asked at once, at most ``WINDOW`` in flight), then
the queues, then the bindings -- a binding is asked once the exchanges and
queues were answered, and names this node's metadata position, so its leader
finds the exchange. An error is the one the unpartitioned import gives for
the first refused item in the file's order (``_amqp_error`` of the leader's
code and text; a binding to a missing queue or exchange: ``binding to unknown
queue 'q'``); the items of that kind asked with it may have been applied, as
the unpartitioned import keeps what it declared before an error.

A leader lost mid-import: the declarations are idempotent (``IDEMPOTENT``),
so ``DeclarationRequests`` asks the group's next leader; an item with no
answer within its timeout fails the import with 503 naming the item and
saying the file may be imported again -- never a success with items missing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from brokerha.admin.management import ManagementError, _amqp_error, _bool, bad_request
from brokerha.broker.errors import BrokerError
from brokerha.broker.placement import METADATA_GROUP

log = logging.getLogger("brokerha.management")

WINDOW = 2048  # requests in flight: more share the groups' syncs (256: 2.8x slower)

Entry = dict[str, Any]
Ask = Callable[[], Awaitable[list[Any]]]


class Item:
    """One declaration of the file: what to ask (``group``, ``op``, ``args``), what the
    unpartitioned import would call it, and how its leader's refusal reads there."""

    def __init__(self, what: str, group: int, op: str, args: list[Any],
                 unknown: str | None = None) -> None:
        self.what = what
        self.group = group
        self.op = op
        self.args = args
        # a binding: the leader's 404 text for its missing destination, which the
        # unpartitioned import answers 400 "binding to unknown ..."
        self.unknown = unknown


def plan(groups: Any, queue_arguments: Callable[[str, str], dict[str, Any]],
         exchanges: list[Entry], queues: list[Entry], bindings: list[Entry],
         text: Callable[..., str], arguments: Callable[[dict[str, Any]], dict[str, Any]],
         vhost_of: Callable[[Entry], str]) -> tuple[list[Item], list[Item], list[Item]]:
    """The file's items and the group each belongs to, found before anything is changed
    (a node holding no partition table yet refuses the whole file: NotLeader, 404).
    ``queue_arguments(vhost, name)``: a queue's arguments (the file's, else this node's
    copy's) for its partition (``x-partition``)."""
    ex_items = []
    for e in exchanges:
        vhost, name = vhost_of(e), text(e, "name")
        ex_items.append(Item(f"exchange '{name}' in vhost '{vhost}'", METADATA_GROUP,
                             "exchange.declare",
                             [vhost, name, text(e, "type", "direct"), False,
                              _bool(e.get("durable"), True), _bool(e.get("auto_delete"), False),
                              _bool(e.get("internal"), False),
                              dict(e.get("arguments") or {})]))
    q_items = []
    for q in queues:
        vhost, name = vhost_of(q), text(q, "name")
        args = arguments(q.get("arguments") or {})
        group = groups.group_of_queue(vhost, name, args, False)
        q_items.append(Item(f"queue '{name}' in vhost '{vhost}'", group, "queue.declare",
                            [vhost, name, False, _bool(q.get("durable"), True),
                             _bool(q.get("auto_delete"), False), args]))
    b_items = []
    for b in bindings:
        vhost, source, dest = vhost_of(b), text(b, "source"), text(b, "destination")
        key, args = text(b, "routing_key", ""), dict(b.get("arguments") or {})
        what = (f"binding of {b.get('destination_type', 'queue')} '{dest}' to exchange "
                f"'{source}' in vhost '{vhost}'")
        if b.get("destination_type", "queue") == "queue":
            group = groups.group_of_queue(vhost, dest, queue_arguments(vhost, dest), False)
            b_items.append(Item(what, group, "queue.bind", [vhost, dest, source, key, args],
                                f"no queue '{dest}' in vhost '{vhost}'"))
        else:
            b_items.append(Item(what, METADATA_GROUP, "exchange.bind",
                                [vhost, dest, source, key, args],
                                f"no exchange '{dest}' in vhost '{vhost}'"))
    return ex_items, q_items, b_items


async def declare(declarations: Any, kinds: tuple[list[Item], ...]) -> None:
    """Each kind's items asked of their groups' leaders, kind after kind; raises the
    unpartitioned import's error for the first refused item of a kind (file order)."""
    for items in kinds:
        outcomes = await _ask_all(declarations, items)
        for item, outcome in zip(items, outcomes, strict=True):
            if outcome is not None:
                raise _refusal(item, outcome)


async def _ask_all(declarations: Any, items: list[Item]) -> list[BaseException | None]:
    window = asyncio.Semaphore(WINDOW)

    async def one(item: Item) -> BaseException | None:
        async with window:
            try:
                await declarations.request(item.group, item.op, item.args)
            except BrokerError as exc:
                return exc
        return None

    return list(await asyncio.gather(*(one(item) for item in items)))


def _refusal(item: Item, exc: BaseException) -> ManagementError:
    from brokerha.partition.declarations import CONNECTION_FORCED

    code = getattr(exc, "code", 0)
    log.warning("definitions import stopped at %s (partition group %d's leader): %s %s",
                item.what, item.group, code, exc)
    if code == CONNECTION_FORCED:  # no answer: its outcome is unknown, the import is not done
        return ManagementError(503, "service_unavailable",
                               f"definitions import not complete: {item.what} was asked of "
                               f"partition group {item.group}'s leader and got no answer "
                               f"({exc}); what the file declares is idempotent: import it "
                               "again")
    if item.unknown is not None and code == 404 and str(exc) == item.unknown:
        kind = "queue" if item.op == "queue.bind" else "exchange"
        return bad_request(f"binding to unknown {kind} '{item.args[1]}'")
    assert isinstance(exc, BrokerError)
    return _amqp_error(exc)
