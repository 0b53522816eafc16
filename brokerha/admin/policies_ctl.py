"""``brokerha ctl`` policy verbs, with rabbitmqctl's arguments and words.

- ``set_policy [-p VHOST] [--priority N] [--apply-to queues|exchanges|all] NAME PATTERN
  DEFINITION`` (DEFINITION is JSON), ``clear_policy [-p VHOST] NAME``,
  ``list_policies [-p VHOST]``;
- ``set_operator_policy``, ``clear_operator_policy``, ``list_operator_policies``: the same
  for operator policies.

Each is one request to the management API (``/api/policies``,
``/api/operator-policies``, policies_api.py) of the serving primary; a refusal
prints RabbitMQ's reason after ``Error:``, as rabbitmqctl does (``Parameter does
not exist`` for a policy that is not there), and exits 1 as every refused ``brokerha
ctl`` command (rabbitmqctl: 69), 2 when the node cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from brokerha.httpapi.client import CtlError, request

# verb suffix -> (API path, rabbitmqctl's noun when setting, when clearing, when listing)
KINDS = {
    "policy": ("policies", "policy", "policy", "policies"),
    "operator_policy": ("operator-policies", "operator policy override", "operator policy",
                        "operator policy overrides"),
}
COLUMNS = ("vhost", "name", "pattern", "apply-to", "definition", "priority")

REFUSED = 1  # brokerha ctl's exit code for a refusal (rabbitmqctl's is 69)

Serving = Callable[[str], tuple[str, str]]


def _path(kind: str, vhost: str, name: str | None = None) -> str:
    path = f"/api/{KINDS[kind][0]}/{quote(vhost, safe='')}"
    return path if name is None else f"{path}/{quote(name, safe='')}"


def _refused(exc: CtlError, missing: str = "") -> CtlError:
    """rabbitmqctl's ``Error:`` and exit code for a refusal of the API (else as it is)."""
    if exc.status is None:
        return exc
    reason = missing if exc.status == 404 and missing else exc.reason or str(exc)
    return CtlError(f"Error:\n{reason}", REFUSED)


def cmd_set(args: argparse.Namespace, base: str) -> int:
    noun = KINDS[args.kind][1]
    print(f'Setting {noun} "{args.name}" for pattern "{args.pattern}" to "{args.definition}" '
          f'with priority "{args.priority}" for vhost "{args.vhost}" ...')
    try:
        definition = json.loads(args.definition)
    except ValueError:
        raise CtlError("Error:\nJSON decoding error. Reason: badarg", REFUSED) from None
    body = {"pattern": args.pattern, "definition": definition, "priority": args.priority,
            "apply-to": args.apply_to}
    try:
        request(base, _path(args.kind, args.vhost, args.name), body=body, method="PUT")
    except CtlError as exc:
        raise _refused(exc) from None
    return 0


def cmd_clear(args: argparse.Namespace, base: str) -> int:
    print(f'Clearing {KINDS[args.kind][2]} "{args.name}" on vhost "{args.vhost}" ...')
    try:
        request(base, _path(args.kind, args.vhost, args.name), method="DELETE")
    except CtlError as exc:
        raise _refused(exc, "Parameter does not exist") from None
    return 0


def cmd_list(args: argparse.Namespace, base: str) -> int:
    print(f'Listing {KINDS[args.kind][3]} for vhost "{args.vhost}" ...')
    try:
        policies: list[dict[str, Any]] = request(base, _path(args.kind, args.vhost))
    except CtlError as exc:
        raise _refused(exc) from None
    if policies:
        print("\t".join(COLUMNS))
    for p in policies:
        row = {**p, "definition": json.dumps(p["definition"], separators=(",", ":"),
                                             sort_keys=True)}
        print("\t".join(str(row[c]) for c in COLUMNS))
    sys.stdout.flush()
    return 0


def register(sub: Any, serving: Serving) -> None:
    """The six verbs on ``brokerha ctl``'s subparsers; ``serving(node)`` -> (admin URL, name)
    of the serving primary."""
    for kind, (_, noun, _, listed) in KINDS.items():
        who = "administrator" if kind == "operator_policy" else "administrator or policymaker"
        p = sub.add_parser(f"set_{kind}", help=f"set a {noun} ({who})")
        _vhost(p)
        p.add_argument("--priority", type=int, default=0)
        p.add_argument("--apply-to", dest="apply_to", default="all",
                       choices=("queues", "exchanges", "all"))
        p.add_argument("name", metavar="NAME")
        p.add_argument("pattern", metavar="PATTERN", help="a regular expression of names")
        p.add_argument("definition", metavar="DEFINITION", help="its keys, a JSON object")
        _handle(p, kind, cmd_set, serving)
        p = sub.add_parser(f"clear_{kind}", help=f"clear a {noun} ({who})")
        _vhost(p)
        p.add_argument("name", metavar="NAME")
        _handle(p, kind, cmd_clear, serving)
        p = sub.add_parser(f"list_{'policies' if kind == 'policy' else 'operator_policies'}",
                           help=f"the vhost's {listed}, by priority")
        _vhost(p)
        _handle(p, kind, cmd_list, serving)


def _vhost(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--vhost", default="/", metavar="VHOST")


def _handle(p: argparse.ArgumentParser, kind: str,
            handler: Callable[[argparse.Namespace, str], int], serving: Serving) -> None:
    p.set_defaults(kind=kind, ctl_handler=lambda args: handler(args, serving(args.node)[0]))
