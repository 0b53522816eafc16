"""``brokerha txlog ctl --node URL …``: operator actions on a running TxLog master.

Talks to the master's loopback API (:mod:`brokerha.txlog.master.node`); ``URL`` is
``http://host:port`` or ``host:port``. Exit 0 on success, 1 with the master's
error message otherwise, 2 if the master cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from brokerha.httpapi.client import CtlError, request


def call(node: str, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
    """One request to the master's API (``brokerha.httpapi.client.request``: GET, or POST a body)."""
    if (method == "POST") != (body is not None):
        raise ValueError(f"{method} {path}: POST carries a body, GET none")
    base = node if "://" in node else f"http://{node}"
    return request(base.rstrip("/"), path, body=body, timeout=timeout)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ctl = sub.add_parser("ctl", help="status and peer changes on a running TxLog master")
    ctl.add_argument("--node", required=True, metavar="URL",
                     help="the master's API, http://host:port (its log's 'ready' line)")
    actions = ctl.add_subparsers(dest="ctl_command", metavar="ACTION", required=True)
    add = actions.add_parser("add-peer", help="add a sync peer at runtime")
    add.add_argument("peer_id")
    add.add_argument("url", help="txlog://host:port")
    remove = actions.add_parser("remove-peer", help="remove a sync peer at runtime")
    remove.add_argument("peer_id")
    status = actions.add_parser("status", help="the master's view of the TxLog")
    status.add_argument("--json", action="store_true", help="the full status as JSON")
    export = actions.add_parser("export", help="write synchronised + incoming logs to Parquet")
    export.add_argument("--out", type=Path, required=True, metavar="DIR")
    strategy = actions.add_parser("split-recovery", help="set None|Simple|Smart (not while split)")
    strategy.add_argument("value")
    ctl.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.ctl_command == "add-peer":
            status = call(args.node, "POST", "/api/peers", {"id": args.peer_id, "url": args.url})
            print(f"{status['node_id']}: peer {args.peer_id} added "
                  f"(peers: {', '.join(p['id'] for p in status['peers'])})")
        elif args.ctl_command == "remove-peer":
            status = call(args.node, "POST", "/api/peers/remove", {"id": args.peer_id})
            print(f"{status['node_id']}: peer {args.peer_id} removed "
                  f"(peers: {', '.join(p['id'] for p in status['peers']) or 'none'})")
        elif args.ctl_command == "split-recovery":
            status = call(args.node, "POST", "/api/split-recovery", {"value": args.value})
            print(f"{status['node_id']}: split-recovery {status['split_recovery']}")
        elif args.ctl_command == "export":
            result = call(args.node, "POST", "/api/export", {"out": str(args.out.resolve())},
                          timeout=300)
            print(f"exported to {result['folder']}: {', '.join(result['files'])}")
        else:
            status = call(args.node, "GET", "/api/status")
            print(json.dumps(status, indent=2, sort_keys=True) if args.json else summary(status))
    except CtlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    return 0


def summary(s: dict[str, Any]) -> str:
    sync, lat = s["synchronised"], s["latency_ms"]
    state = "voting" if s["voting"] else ("SPLIT" if s["split"] else "ok")
    lines = [
        f"master {s['node_id']} (group {s['group']}): {state}, generation {s['generation']}, "
        f"members {', '.join(s['members'])}, split-recovery {s['split_recovery']}",
        f"  synchronised {sync['length']} (digest {sync['digest']}), incoming {s['incoming']}, "
        f"own unsynchronised {s['own_unsynchronised']}, applied {s['applied']}",
        f"  agreement latency (own tx -> synchronised here): p50 {lat['p50']} ms, "
        f"p99 {lat['p99']} ms over {lat['samples']}",
    ]
    for p in s["peers"]:
        link = "up" if p["connected"] else "down"
        member = "member" if p["member"] else "not a member"
        lines.append(f"  peer {p['id']} {p['url']}: link {link}, {member}, silent {p['silent_ms']} ms")
    for e in s["events"][-5:]:
        lines.append(f"  event {e['at_ms']} {e['kind']} {e['peer'] or ''} {json.dumps(e['detail'])}")
    return "\n".join(lines)
