"""``brokerha ctl export_definitions FILE`` / ``import_definitions FILE``, as rabbitmqctl's.

Both go through the management API (``GET``/``POST /api/definitions``,
definitions_file.py) of the serving primary, as an administrator: the file is
RabbitMQ's definitions JSON, so a file exported from RabbitMQ (``rabbitmqctl
export_definitions`` or the management UI's "Export definitions") imports here
and brokerha's imports into RabbitMQ. ``-`` is standard output / input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from brokerha.httpapi.client import CtlError, request

IMPORT_TIMEOUT = 60.0  # a big file is one request, checked whole before anything changes


def cmd_export(args: argparse.Namespace, base: str) -> int:
    answer = request(base, "/api/definitions")
    text = json.dumps(answer, indent=1, sort_keys=True) + "\n"
    if args.file == "-":
        sys.stdout.write(text)
        return 0
    print(f'Exporting definitions in JSON to a file at "{args.file}" ...')
    try:
        with open(args.file, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        raise CtlError(f"cannot write {args.file}: {exc}") from exc
    return 0


def cmd_import(args: argparse.Namespace, base: str) -> int:
    if args.file != "-":
        print(f'Importing definitions in JSON from a file at "{args.file}" ...')
    body = _read(args.file)
    request(base, "/api/definitions", body=body, timeout=IMPORT_TIMEOUT)
    return 0


def _read(name: str) -> Any:
    try:
        if name == "-":
            text = sys.stdin.read()
        else:
            with open(name, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        raise CtlError(f"cannot read {name}: {exc}") from exc
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise CtlError(f"{name} is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise CtlError(f"{name}: a definitions file is a JSON object")
    return body


def register(sub: Any, serving: Any) -> None:
    """The two verbs on ``brokerha ctl``'s subparsers; ``serving(node)`` -> (admin URL, name)
    of the serving primary."""
    for name, handler, text in (
            ("export_definitions", cmd_export,
             "write every definition (RabbitMQ's JSON) to FILE, - for stdout (administrator)"),
            ("import_definitions", cmd_import,
             "apply a definitions file (RabbitMQ's or brokerha's JSON), - for stdin; "
             "checked whole first (administrator)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("file", metavar="FILE")
        p.set_defaults(ctl_handler=lambda args, h=handler: h(args, serving(args.node)[0]))
