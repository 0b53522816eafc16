"""``brokerha ctl check-replicas [--partition N]``: do a group's replicas agree? (issue 35)

Asks each group's leader (``POST /api/check-replicas``, node/check_replicas.py;
an ordinary cluster's one primary; with partition groups each partition's
leader, or partition N's alone) to check its group's replicas (``ha/check.py``):
every member's copy of every queue, as at one seq of the group's log, compared
with the primary's. Prints per queue and replica whether they agree and how
they differ (positions missing or extra, the content's digest, a queue missing,
extra or of another incarnation); ``--json`` prints the answers whole.

Exit code: 0 when every replica of every group checked agrees and all were
compared; 1 when some replica differs; 3 when none differs but something could
not be compared (a backup down, catching up, or silent past ``--timeout``; a
group without a leader); 2 when the node cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from brokerha.httpapi.client import CtlError, request

DIFFERS = 1
INCOMPLETE = 3

Status = Callable[[str], dict[str, Any]]


def targets(status: dict[str, Any], partition: int | None) -> list[tuple[int | None, str, Any]]:
    """(group, label, leader's node entry or None) of each group to check."""
    nodes = {n["name"]: n for n in status["nodes"]}
    groups = status.get("groups")
    if not groups:  # one replication group: the whole cluster
        if partition is not None:
            raise CtlError("--partition: the nodes run one replication group (no [cluster] "
                           "partition_groups); check it without --partition")
        primary = status.get("primary")
        if primary is None and any(n.get("role") == "standalone" for n in nodes.values()):
            raise CtlError("a standalone node: it has no replicas to check")
        return [(None, "the cluster's group", nodes.get(primary) if primary else None)]
    if partition is not None:
        group = groups.get(str(partition + 1))
        if group is None:
            raise CtlError(f"no group of partition {partition} (partitions 0..{len(groups) - 2})")
        chosen = {str(partition + 1): group}
    else:  # every partition's group; the metadata group holds no queue
        chosen = {g: v for g, v in groups.items() if g != "0"}
    return [(int(g), f"group {g} (partition {int(g) - 1})",
             nodes.get(v["leader"]) if v.get("leader") else None)
            for g, v in sorted(chosen.items(), key=lambda item: int(item[0]))]


def _runs(diff: dict[str, Any]) -> str:
    shown = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in diff["runs"])
    more = f" and {diff['more_runs']} more runs" if diff.get("more_runs") else ""
    return f"{shown}{more} ({diff['count']} messages)"


def describe(diff: dict[str, Any]) -> str:
    what = diff["what"]
    if what in ("missing positions", "extra positions"):
        return f"{what} {_runs(diff)}"
    if what == "extra queue":
        return f"extra queue ({diff['count']} messages, x-ha-id {diff['ha_id']})"
    if what == "another incarnation":
        return f"another incarnation of the queue (x-ha-id {diff['ha_id']})"
    if what == "count differs":
        return f"{diff['count']} messages"
    return str(what)


def print_result(label: str, result: dict[str, Any]) -> None:
    replicas = result["replicas"]
    print(f"{label}: primary {result['primary']}, epoch {result['epoch']}, checked at seq "
          f"{result['seq']}; {len(result['queues'])} queues, {len(replicas) - 1} backups; "
          f"{result['seconds']:.2f} s")
    for name, r in sorted(replicas.items()):
        state = (f"reported in {r['seconds']:.2f} s" if r["reported"] and r["seconds"] is not None
                 else "reported" if r["reported"] else "NOT CHECKED")
        why = f" ({r['why']})" if r.get("why") else ""
        print(f"  {name:<12} {r['role']:<8} {state}{why}")
    for q in result["queues"]:
        count = "absent" if q["count"] is None else f"{q['count']} messages"
        vhost = "" if q["vhost"] == "/" else f" in vhost '{q['vhost']}'"
        parts = []
        for node, v in sorted(q["replicas"].items()):
            if v["differences"]:
                parts.append(f"{node} DIFFERS: " + "; ".join(describe(d) for d in v["differences"]))
            elif v["agree"]:
                parts.append(f"{node} agrees")
            else:
                parts.append(f"{node} not compared ({'; '.join(v['notes'])})")
        mode = f", {q['mode']}" if q["mode"] and q["mode"] != "all" else ""
        print(f"  queue '{q['name']}'{vhost} ({count}{mode}): {', '.join(parts) or 'no backup'}")


def cmd_check_replicas(args: argparse.Namespace, cluster_status: Status) -> int:
    status = cluster_status(args.node)
    answers: list[dict[str, Any]] = []
    differs = incomplete = False
    for group, label, leader in targets(status, args.partition):
        if leader is None:
            answers.append({"group": group, "label": label, "error": "no leader serving"})
            incomplete = True
            continue
        body: dict[str, Any] = {"timeout": args.timeout}
        if group is not None:
            body["group"] = group
        result = request(leader["admin_url"], "/api/check-replicas", body=body,
                         user=args.user, password=args.password, timeout=args.timeout + 10)
        result["label"] = label
        answers.append(result)
        differs = differs or not result["agree"]
        incomplete = incomplete or not result["complete"]
    if args.json:
        json.dump({"groups": answers, "agree": not differs, "complete": not incomplete},
                  sys.stdout, indent=1, sort_keys=True)
        print()
    else:
        for answer in answers:
            if "error" in answer:
                print(f"{answer['label']}: NOT CHECKED ({answer['error']})")
            else:
                print_result(answer["label"], answer)
        if differs:
            count = sum(a.get("differences", 0) for a in answers)
            print(f"DIFFERENCES: {count} copies of queues differ from their primary's")
        elif incomplete:
            print("no difference found, but not every replica was compared")
        else:
            print("every replica agrees")
    return DIFFERS if differs else INCOMPLETE if incomplete else 0


def register(sub: Any, cluster_status: Status) -> None:
    p = sub.add_parser("check-replicas", help="compare every replica of a group's queues "
                       "with its primary's (positions, content digest); exit 1 on a difference")
    p.add_argument("--partition", type=int, metavar="N",
                   help="partition N's group only (nodes running partition groups); default: "
                        "every partition's, or the cluster's one group")
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for the backups' reports (default 30)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=lambda args: cmd_check_replicas(args, cluster_status))
