"""``brokerha ctl``: ask nodes what they are doing, tell them what to do.

``--node`` takes a node's admin URL (``http://host:port``, or
``https://host:port`` for its HTTPS listener, checked against ``--ca``) or its
AMQP URL (``amqp://host:P``, whose admin port is ``P + 10000`` unless
configured otherwise). ``status`` asks that node for the datacenter's member list, then
asks every member itself, so the answer does not depend on one node's
possibly stale view; a member that does not answer is shown as ``down``.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from brokerha.admin import check_ctl, definitions_ctl, policies_ctl, users_ctl
from brokerha.cluster.partition_table import PartitionTable
from brokerha.cluster.ports import ADMIN_OFFSET
from brokerha.httpapi.client import CREDENTIALS, CtlError, request
from brokerha.partition import balance


def admin_url(node: str) -> str:
    """The admin base URL for an admin or AMQP URL."""
    url = urlsplit(node if "://" in node else f"http://{node}")
    if url.scheme in ("http", "https"):
        return f"{url.scheme}://{url.hostname}:{url.port or 80}"
    if url.scheme in ("amqp", "amqps"):
        port = (url.port or 5672) + ADMIN_OFFSET
        return f"http://{url.hostname or '127.0.0.1'}:{port}"
    raise CtlError(f"--node: expected http://HOST:PORT or amqp://HOST:PORT, got {node!r}")


def cluster_status(node: str) -> dict[str, Any]:
    """One object with a ``nodes`` list: each member's own answer, or role ``down``."""
    base = admin_url(node)
    first = request(base, "/api/status")
    members = first.get("members") or [{"name": first["node"]["name"], "admin_url": base,
                                         "amqp_url": first["node"].get("amqp_url")}]
    nodes = []
    for member in members:
        # asked over HTTPS (--ca/--cert apply) those that have it, when we came that way
        url = (member.get("https_url") if base.startswith("https:") else None) \
            or member["admin_url"]
        if base in (url, member["admin_url"], member.get("https_url")):
            status = first
        else:
            try:
                status = request(url, "/api/status", timeout=1.5)
            except CtlError as exc:
                nodes.append({"name": member["name"], "role": "down", "epoch": None,
                              "ready": False, "pid": None, "amqp_url": member.get("amqp_url"),
                              "admin_url": member["admin_url"], "error": str(exc)})
                continue
        entry = dict(status["node"])
        entry["admin_url"] = member["admin_url"]
        nodes.append(entry)
    primaries = [n for n in nodes if n.get("role") == "primary"]
    return {"cluster": first.get("cluster"), "nodes": nodes,
            "primary": primaries[0]["name"] if len(primaries) == 1 else None,
            "replication": next((n.get("replication") for n in primaries), None),
            "last_election": last_election(nodes),
            "partitions": partitions_view(nodes),
            "groups": groups_view(nodes)}


def groups_view(nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A node running partition groups (issue 35 stage 2) reports each group's role as it
    sees it (``groups`` in its status); per group: its leader (the node that says it is
    its primary, in the highest epoch), that epoch, the members, and each answering
    member's role, phase and epoch. None when no node runs groups."""
    seen = [(n["name"], n["groups"]) for n in nodes if n.get("groups")]
    if not seen:
        return None
    out: dict[str, Any] = {}
    for name, groups in seen:
        for group, g in groups.items():
            entry = out.setdefault(group, {"leader": None, "epoch": None,
                                           "members": g["members"], "nodes": {}})
            entry["nodes"][name] = {"role": g["role"], "phase": g["phase"],
                                    "epoch": g["epoch"], "serving": g["serving"]}
            if g["role"] == "primary" and (entry["epoch"] is None or g["epoch"] > entry["epoch"]):
                entry["leader"], entry["epoch"] = name, g["epoch"]
    for entry in out.values():
        if entry["epoch"] is None:  # no primary answered: the newest epoch any member holds
            entry["epoch"] = max(n["epoch"] for n in entry["nodes"].values())
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


def partitions_view(nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The partition table (issue 35) as the cluster holds it: the coordinator's copy (the
    primary's; else the highest ptid any node answered with), each partition's cells and
    preferred leader, which are operational with the nodes that answered, which partitions
    each node's loss would stop, and whether every answering node holds the same table.
    None for a standalone node (no table)."""
    copies = {n["name"]: n["partitions"] for n in nodes if n.get("partitions")}
    if not copies:
        return None
    primary = next((n["name"] for n in nodes if n.get("role") == "primary"
                    and n["name"] in copies), None)
    source = primary or max(copies, key=lambda name: copies[name]["ptid"])
    held = copies[source]
    table = PartitionTable.from_wire(held["ptid"], held["num_replicas"], held["rows"])
    alive = [n["name"] for n in nodes if n.get("role") not in (None, "down")]
    out = table.status(alive)
    out["from"] = source
    out["routing"] = False  # nothing routes by it yet (docs/ha.md Partitions, stage 3)
    out["ptids"] = {name: c["ptid"] for name, c in sorted(copies.items())}
    out["same_on_every_node"] = all(  # of those that answered
        (c["ptid"], c["num_replicas"], c["rows"]) == (held["ptid"], held["num_replicas"],
                                                      held["rows"])
        for c in copies.values()) and sorted(copies) == sorted(alive)
    return out


def _print_partitions(view: dict[str, Any] | None) -> None:
    if view is None:
        print("no partition table (a standalone node; an HA cluster's metadata primary "
              "makes one at its first start)")
        return
    if not view["rows"]:
        print(f"no partition table yet (ptid {view['ptid']}): the metadata primary makes "
              "it once elected")
        return
    differs = "" if view["same_on_every_node"] else (
        " (not the same on every node: ptid " + ", ".join(
            f"{name} {ptid}" for name, ptid in view["ptids"].items()) + ")")
    print(f"partition table: ptid {view['ptid']}, {view['partitions']} partitions, "
          f"{view['num_replicas']} replicas (NR), as held by {view['from']}{differs}")
    led = any("leader" in row for row in view["rows"])  # the nodes run partition groups
    routing = ("each partition's queues served by its leader (partition groups, stage 2; "
               "forwarding between nodes is stage 3)" if led else "not yet (issue 35 stage 3)")
    print(f"routing by it: {routing}; cells: U up to date, O out of date (learner), "
          "F feeding (leaving), C corrupted")
    operational = set(view.get("operational", []))

    def leader(row: dict[str, Any]) -> list[Any]:
        if not led:
            return []
        return [f"{row['leader'] or '-'} (epoch {row['leader_epoch']})"]

    _table([[row["partition"], view["ptid"], row["preferred_leader"], *leader(row),
             " ".join(f"{node}:{state}" for node, state in row["cells"]),
             "yes" if row["partition"] in operational else "NO"] for row in view["rows"]],
           ["partition", "ptid", "preferred leader", *(["leader"] if led else []), "cells",
            "operational"])
    stops = {n: ps for n, ps in (view.get("stopped_by") or {}).items() if ps}
    for node, parts in sorted(stops.items()):
        print(f"losing {node} would stop partitions {', '.join(map(str, parts))}")
    if not stops:
        print("losing any one node stops no partition")


def cmd_partitions(args: argparse.Namespace) -> int:
    if args.action == "balance":
        return cmd_partitions_balance(args)
    if args.action in ("drain", "undrain"):
        return cmd_partitions_drain(args)
    status = cluster_status(args.node)
    view = status["partitions"]
    groups = status["groups"]
    if view is not None and groups is not None:  # the leader elected per partition
        for row in view["rows"]:
            group = groups.get(str(row["partition"] + 1))
            row["leader"] = None if group is None else group["leader"]
            row["leader_epoch"] = None if group is None else group["epoch"]
    if args.json:
        _dump(view)
    else:
        _print_partitions(view)
    return 0


def cmd_partitions_drain(args: argparse.Namespace) -> int:
    """Asks the partition table's coordinator to move every cell off NODE (``drain``) or
    cells back onto it (``undrain``), one partition at a time: a learner on another node,
    caught up, then the group's voters changed one at a time (``node/partition_balance.py``
    ``DrainEndpoint``, ``partition/moves.py``). Prints a line per partition. Exit 0:
    done (drained: the node holds no cell, its loss stops no partition); 1: stopped or
    timed out (why said); 2: the node did not answer."""
    if not args.target:
        raise CtlError(f"ctl partitions {args.action} NODE: which node")
    status = cluster_status(args.node)
    if status["partitions"] is None or status["groups"] is None:
        raise CtlError("no partition groups: the nodes run without [cluster] partition_groups")
    coordinator = next((n for n in status["nodes"] if n.get("role") == "primary"), None)
    if coordinator is None:
        raise CtlError("no metadata primary (the partition table's coordinator) is serving")
    answer = request(coordinator["admin_url"], "/api/partitions/drain",
                     body={"node": args.target, "undrain": args.action == "undrain",
                           "timeout": args.timeout}, user=args.user, password=args.password,
                     timeout=status["partitions"]["partitions"] * (args.timeout + 5.0) + 30.0)
    if args.json:
        _dump(answer)
    else:
        for line in answer.get("lines") or []:
            print(line)
        cells = answer.get("cells") or []
        print(f"{args.target} holds cells of partitions {', '.join(map(str, cells))}" if cells
              else f"{args.target} holds no cell")
        stops = answer.get("stopped_by") or []
        print(f"losing {args.target} would stop partitions {', '.join(map(str, stops))}"
              if stops else f"losing {args.target} stops no partition")
        print(f"(by {answer.get('by')}, the table's coordinator, in "
              f"{answer.get('seconds', 0):.2f} s)")
    return 0 if answer.get("finished") else 1


def cmd_partitions_balance(args: argparse.Namespace) -> int:
    """Asks the metadata primary (the partition table's coordinator) to hand each partition
    whose leader is not its preferred cell over to it, one at a time, each waited for up
    to ``--timeout`` (``node/partition_balance.py``, ``partition/balance.py``), and
    prints its answer. Exit 0: every partition led by its preferred cell; 1: some left
    unbalanced (skipped, why said), or no coordinator serving; 2: the node did not
    answer."""
    status = cluster_status(args.node)
    view = status["partitions"]
    if view is None or status["groups"] is None:
        raise CtlError("no partition groups: the nodes run without [cluster] "
                       "partition_groups (one group: nothing to balance)")
    coordinator = next((n for n in status["nodes"] if n.get("role") == "primary"), None)
    if coordinator is None:
        raise CtlError("no metadata primary (the partition table's coordinator) is serving; "
                       "an election is under way or no majority is up")
    answer = request(coordinator["admin_url"], "/api/partitions/balance",
                     body={"timeout": args.timeout}, user=args.user, password=args.password,
                     timeout=view["partitions"] * (args.timeout + 5.0) + 30.0)
    unbalanced = answer.get("unbalanced") or []
    if args.json:
        _dump(answer)
    else:
        for line in answer.get("partitions") or []:
            print(balance.Line(**{k: v for k, v in line.items()}).text())
        print(f"unbalanced: {', '.join(map(str, unbalanced))}" if unbalanced
              else "every partition led by its preferred cell")
        print(f"(by {answer.get('by')}, the table's coordinator, in "
              f"{answer.get('seconds', 0):.2f} s)")
    return 1 if unbalanced else 0


def last_election(nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest campaign any answering member started: node, reason, epoch asked for,
    Unix time (each node counts its own, ``election.last_election``)."""
    started = [{"node": n["name"], **n["election"]["last_election"]} for n in nodes
               if (n.get("election") or {}).get("last_election")]
    return max(started, key=lambda e: float(e.get("at", 0.0)), default=None)


def _print_status(status: dict[str, Any]) -> None:
    print(f"cluster {status.get('cluster') or '(standalone)'}: primary "
          f"{status.get('primary') or '(none)'}")
    print(f"{'node':<12} {'role':<9} {'epoch':>5} {'ready':<5} {'pid':>7}  amqp")
    for n in status["nodes"]:
        print(f"{n['name']:<12} {n['role']:<9} {n['epoch'] if n['epoch'] is not None else '-':>5} "
              f"{'yes' if n.get('ready') else 'no':<5} {n.get('pid') or '-':>7}  "
              f"{n.get('amqp_url') or ''}")
    last = status.get("last_election")
    if last:
        ago = max(0.0, time.time() - float(last.get("at", 0.0)))
        print(f"last election: {last['node']} stood ({last.get('reason')}) for epoch "
              f"{last.get('epoch')}, {ago:.0f} s ago")
    for n in status["nodes"]:
        election, loop = n.get("election") or {}, n.get("loop") or {}
        stood = ", ".join(f"{k} {v}" for k, v in sorted((election.get("elections") or {}).items())
                          if v)
        stepped = ", ".join(f"{k} {v}" for k, v in
                            sorted((election.get("stepdowns") or {}).items()) if v)
        if stood or stepped or loop.get("stalls"):
            print(f"  {n['name']:<12} elections: {stood or 'none'}; stepped down: "
                  f"{stepped or 'never'}; loop lag p99/max {loop.get('lag_p99', 0) * 1000:.0f}/"
                  f"{loop.get('lag_max', 0) * 1000:.0f} ms, {loop.get('stalls', 0)} stalls")
        collector = n.get("gc") or {}
        if collector.get("pause_seconds_max", 0) >= 0.1:
            print(f"  {n['name']:<12} GC: longest pause {collector['pause_seconds_max']:.3f} s, "
                  f"collections {'/'.join(str(c) for c in collector.get('collections', []))}, "
                  f"{collector.get('frozen', 0)} objects frozen")
    replication = status.get("replication") or {}
    backups = replication.get("backups") or {}
    if replication.get("publishers_held") or replication.get("publisher_holds"):
        now = (f"held now (flow: backup {replication.get('publishers_held_by')} lags)"
               if replication.get("publishers_held") else "not held")
        print(f"publishers {now}; held {replication.get('publisher_holds', 0)} times, "
              f"{replication.get('publishers_held_seconds', 0):.1f} s in all")
    if backups:
        print(f"\nreplication (seq {replication.get('seq')}):")
        for name, b in sorted(backups.items()):
            state = "ready" if b.get("ready") else (
                "joining again" if b.get("rejoining")
                else "timed out" if b.get("timed_out") else "catching up")
            print(f"  {name:<12} {state:<12} acked {b.get('acked')}  lag {b.get('lag')}")
    groups = status.get("groups")
    if groups:  # nodes running partition groups (issue 35 stage 2)
        print("\ngroups (0: metadata, p + 1: partition p):")
        for group, g in groups.items():
            roles = " ".join(f"{name}:{n['role']}" for name, n in sorted(g["nodes"].items()))
            print(f"  {group:>3}  leader {g['leader'] or '(none)':<12} epoch {g['epoch']:<4} "
                  f"{roles}")
    changes = replication.get("replicate_changes") or {}
    if changes.get("pending"):  # an ha-replicate change of existing queues (docs/ha.md)
        again = ", ".join(changes.get("backups_to_join_again") or []) or "none"
        print(f"ha-replicate changes not applied yet ({changes.get('queues_pending')} queues: "
              f"{'; '.join(changes.get('queues') or [])}); backups to join again: {again}")


def cmd_status(args: argparse.Namespace) -> int:
    status = cluster_status(args.node)
    if args.json:
        json.dump(status, sys.stdout, indent=1, sort_keys=True)
        print()
    else:
        _print_status(status)
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    status = cluster_status(args.node)
    body: dict[str, Any] = {"node": args.target}
    if args.partition is None:
        primary = next((n for n in status["nodes"] if n.get("role") == "primary"), None)
    else:  # one partition's group, on nodes running partition groups: ask its leader
        group = (status.get("groups") or {}).get(str(args.partition + 1))
        if group is None:
            raise CtlError(f"no group of partition {args.partition}: the nodes run no "
                           "partition groups ([cluster] partition_groups), or P is smaller")
        primary = next((n for n in status["nodes"] if n["name"] == group["leader"]), None)
        body["group"] = args.partition + 1
    if primary is None:
        raise CtlError("no primary is serving; an election is under way or no majority is up")
    answer = request(primary["admin_url"], "/api/promote", body=body,
                     user=args.user, password=args.password)
    if args.json:
        json.dump(answer, sys.stdout, indent=1, sort_keys=True)
        print()
    else:
        print(answer.get("message", answer))
    return 0


def _dump(value: Any) -> None:
    json.dump(value, sys.stdout, indent=1, sort_keys=True)
    print()


def _serving_node(node: str) -> tuple[str, str]:
    """(admin URL, name) of the serving primary, or of ``node`` itself when none serves."""
    try:
        status = cluster_status(node)
    except CtlError:
        return admin_url(node), "?"
    primary = next((n for n in status["nodes"] if n.get("role") in ("primary", "standalone")),
                   None)
    if primary is not None:
        return primary["admin_url"], primary["name"]
    return admin_url(node), status["nodes"][0]["name"] if status["nodes"] else "?"


def _table(rows: list[list[Any]], header: list[str]) -> None:
    cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def cmd_queues(args: argparse.Namespace) -> int:
    base, name = (admin_url(args.node), None) if args.here else _serving_node(args.node)
    answer = request(base, "/api/brokerha/queues")
    if args.json:
        _dump(answer)
        return 0
    queues = answer.get("queues") or []
    print(f"queues on {answer.get('node', name)} ({len(queues)}):")
    _table([[q["vhost"], q["name"], q["messages_ready"], q["messages_unacked"], q["consumers"],
             q["published"], q["delivered"],
             ", ".join(f"{b}{'' if ok else ' (catching up)'}"
                       for b, ok in sorted((q.get("backups_caught_up") or {}).items())) or None]
            for q in queues],
           ["vhost", "queue", "ready", "unacked", "consumers", "in", "out", "backups"])
    return 0


def cmd_connections(args: argparse.Namespace) -> int:
    base, name = (admin_url(args.node), None) if args.here else _serving_node(args.node)
    answer = request(base, "/api/brokerha/connections", user=args.user, password=args.password)
    if args.json:
        _dump(answer)
        return 0
    conns = answer.get("connections") or []
    print(f"connections on {answer.get('node', name)} ({len(conns)}):")
    _table([[c["peer"], c["user"], c["vhost"], c["channels"],
             (c.get("client") or {}).get("product"), f"{c['connected_seconds']:.0f}s"]
            for c in conns], ["peer", "user", "vhost", "channels", "client", "connected"])
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    answer = request(admin_url(args.node), "/api/brokerha/users", user=args.user, password=args.password)
    if args.json:
        _dump(answer)
        return 0
    _table([[u["name"], ",".join(u["tags"]) or None, "yes" if u["loopback_only"] else "no",
             ",".join(u["vhosts"]) or None] for u in answer.get("users") or []],
           ["user", "tags", "loopback only", "vhosts"])
    return 0


def cmd_permissions(args: argparse.Namespace) -> int:
    answer = request(admin_url(args.node), "/api/brokerha/permissions", user=args.user,
                     password=args.password)
    if args.json:
        _dump(answer)
        return 0
    _table([[p["user"], p["vhost"], p["configure"], p["write"], p["read"]]
            for p in answer.get("permissions") or []],
           ["user", "vhost", "configure", "write", "read"])
    return 0


def cmd_txlog_status(args: argparse.Namespace) -> int:
    answer = request(admin_url(args.node), "/api/txlog")
    if args.json:
        _dump(answer)
        return 0
    if not answer.get("running"):
        print(f"TxLog: not running on {answer.get('node')}: {answer.get('reason', '')}")
        return 0
    sync = answer.get("synchronised") or {}
    latency = answer.get("latency_ms") or {}
    print(f"TxLog master {answer.get('master')} running on {answer.get('node')} "
          f"(group {answer.get('group')})")
    print(f"generation {answer.get('generation')}, members "
          f"{', '.join(answer.get('members') or [])}, split {answer.get('split')}, "
          f"voting {answer.get('voting')}, split-recovery {answer.get('split_recovery')}")
    print(f"synchronised {sync.get('length')}, incoming {answer.get('incoming')}, applied "
          f"{answer.get('applied')}, agreement p50 {latency.get('p50')} ms / p99 "
          f"{latency.get('p99')} ms")
    _table([[p["id"], p["url"], "up" if p.get("connected") else "down",
             "yes" if p.get("member") else "no", p.get("silent_ms")]
            for p in answer.get("peers") or []], ["peer", "url", "link", "member", "silent ms"])
    queues = answer.get("global_queues") or {}
    if queues:
        _table([[k, n] for k, n in queues.items()], ["global queue", "messages"])
    _print_split_recovery(answer)
    return 0


def _print_split_recovery(answer: dict[str, Any]) -> None:
    """The broker state's backup at the last split and its restore + replay at the rejoin."""
    recovery = answer.get("recovery") or {}
    counters = answer.get("bridge") or {}
    backup, restore = recovery.get("last_backup"), recovery.get("last_restore")
    if backup:
        print(f"split recovery: backup at position {backup['position']} "
              f"({backup['messages']} message(s), {backup['missing']} not recoverable)")
    if restore:
        print(f"split recovery: restored to position {restore['position']} "
              f"({restore['removed']} removed, {restore['rebuilt']} rebuilt, "
              f"{restore['kept_held']} held kept); replayed {counters.get('replayed', 0)} "
              f"transaction(s)")
    elif counters.get("replayed"):
        print(f"split recovery: replayed {counters['replayed']} transaction(s) on the "
              "current state")
    undo = recovery.get("undo") or {}
    if undo.get("shed"):
        print(f"split recovery: undo records {undo['records']} ({undo['bytes'] >> 20} of "
              f"{undo['max_bytes'] >> 20} MiB), {undo['shed']} dropped over the bound (read "
              "from the TxLog's log if a backup needs them)")


def cmd_txlog_export(args: argparse.Namespace) -> int:
    answer = request(admin_url(args.node), "/api/txlog/export", body={"out": args.out},
                     user=args.user, password=args.password, timeout=60.0)
    if args.json:
        _dump(answer)
        return 0
    print(f"exported to {answer.get('folder')}: {', '.join(answer.get('files') or [])}")
    return 0


def _txlog_change(args: argparse.Namespace, path: str, body: dict[str, Any]) -> int:
    """POST one TxLog change to ``--node`` (it must run the master: no redirection).

    The node that runs the master is the one the operator means to change;
    sending it on to another node could change a master the operator did not
    name (a DC's primary can move between the status lookup and the POST).
    """
    answer = request(admin_url(args.node), path, body=body, user=args.user,
                     password=args.password, timeout=15.0)
    if args.json:
        _dump(answer)
        return 0
    print(answer.get("message", ""))
    print(f"peers: {', '.join(p['id'] for p in answer.get('peers') or []) or 'none'}; "
          f"split-recovery {answer.get('split_recovery')}")
    return 0


def cmd_txlog_add_peer(args: argparse.Namespace) -> int:
    return _txlog_change(args, "/api/txlog/peers", {"id": args.peer_id, "url": args.url})


def cmd_txlog_remove_peer(args: argparse.Namespace) -> int:
    return _txlog_change(args, "/api/txlog/peers/remove", {"id": args.peer_id})


def cmd_txlog_split_recovery(args: argparse.Namespace) -> int:
    if args.value is not None:
        return _txlog_change(args, "/api/txlog/split-recovery", {"value": args.value})
    answer = request(admin_url(args.node), "/api/txlog")
    if args.json:
        _dump({k: answer.get(k) for k in ("node", "master", "running", "reason", "split",
                                          "split_recovery")})
        return 0 if answer.get("running") else 1
    if not answer.get("running"):
        raise CtlError(f"TxLog: not running on {answer.get('node')}: {answer.get('reason', '')}")
    print(f"{answer.get('master')} on {answer.get('node')}: split-recovery "
          f"{answer.get('split_recovery')}{' (split now)' if answer.get('split') else ''}")
    return 0


def cmd_tls(args: argparse.Namespace) -> int:
    """The ``--node``'s certificate (``status``), or read its TLS files again (``reload``)."""
    base = admin_url(args.node)
    if args.tls_command == "reload":
        answer = request(base, "/api/tls/reload", body={}, user=args.user,
                         password=args.password, timeout=15.0)
    else:
        answer = request(base, "/api/tls")
    if args.json:
        _dump(answer)
        return 0
    cert = answer.get("certificate") or {}
    if not answer.get("configured"):
        print("no [tls] certificate configured (amqps and HTTPS are off)")
    else:
        print(f"{cert.get('subject')} (issuer {cert.get('issuer')}, serial {cert.get('serial')}), "
              f"expires {cert.get('not_after')} (in {cert.get('expires_in_days')} days)")
    print(f"reloaded {answer.get('reloads')} time(s); links: "
          f"{', '.join(answer.get('links') or []) or 'none with TLS'}")
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", required=True, metavar="URL",
                        help="a node's admin URL (http://HOST:PORT) or AMQP URL")
    parser.add_argument("--ca", metavar="FILE",
                        help="CA certificate(s) an https:// node's certificate is checked "
                             "against (default: the system's)")
    parser.add_argument("--cert", metavar="FILE", help="client certificate (PEM) for an HTTPS "
                        "listener that requires one ([tls] fail_if_no_peer_cert)")
    parser.add_argument("--key", metavar="FILE", help="its key (default: in --cert's file)")
    parser.add_argument("--user", default="guest",
                        help="a user with a management tag (reads); an administrator (actions)")
    parser.add_argument("--password", default="guest")
    sub = parser.add_subparsers(dest="ctl_command", metavar="COMMAND", required=True)
    p = sub.add_parser("status", help="roles, epoch, readiness and lag of every node")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_status)
    p = sub.add_parser("partitions", help="the partition table: cells, states, preferred "
                       "leaders, which partitions a node's loss would stop; 'balance': "
                       "leaders back to their preferred cells (administrator)")
    p.add_argument("action", nargs="?", choices=["balance", "drain", "undrain"],
                   help="balance: hand each partition whose leader is not its preferred "
                        "cell over to it, one at a time (exit 0 balanced, 1 some left "
                        "unbalanced, 2 unreachable); drain NODE: move every cell off NODE, "
                        "one partition at a time (exit 0 done); undrain NODE: cells back")
    p.add_argument("target", nargs="?", metavar="NODE", help="drain, undrain: the node")
    p.add_argument("--timeout", type=float, default=15.0, metavar="S",
                   help="balance: the longest a move may take; drain: a step (default 15 s)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_partitions)
    p = sub.add_parser("promote", help="hand the primary role to a ready backup")
    p.add_argument("target", metavar="NODE")
    p.add_argument("--partition", type=int, metavar="P",
                   help="hand partition P's leadership over (nodes running partition "
                        "groups); default: the metadata group's primary role")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_promote)
    check_ctl.register(sub, cluster_status)
    for name, handler, text in (
            ("queues", cmd_queues, "queues on the primary: depth, unacked, consumers, in/out"),
            ("connections", cmd_connections, "client connections on the primary (administrator)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--here", action="store_true",
                       help="ask the --node itself instead of the serving primary")
        p.add_argument("--json", action="store_true")
        p.set_defaults(ctl_handler=handler)
    p = sub.add_parser("users", help="users and their tags (administrator)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_users)
    p = sub.add_parser("permissions", help="permissions per user and vhost (administrator)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_permissions)
    definitions_ctl.register(sub, _serving_node)
    policies_ctl.register(sub, _serving_node)
    users_ctl.register(sub, _serving_node)
    p = sub.add_parser("tls", help="the node's TLS certificate; reload the files (SIGHUP's "
                       "equivalent, administrator)")
    tls_sub = p.add_subparsers(dest="tls_command", metavar="COMMAND", required=True)
    for name, text in (("status", "subject, issuer, serial, expiry of the node certificate"),
                       ("reload", "read every certificate, key and CA file again")):
        tp = tls_sub.add_parser(name, help=text)
        tp.add_argument("--json", action="store_true")
        tp.set_defaults(ctl_handler=cmd_tls)
    p = sub.add_parser("txlog", help="the cross-datacenter TxLog")
    txsub = p.add_subparsers(dest="txlog_command", metavar="COMMAND", required=True)
    p = txsub.add_parser("status", help="whether the TxLog runs on the node, and its state")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_txlog_status)
    p = txsub.add_parser("export", help="write the node's TxLog logs to Parquet "
                         "(docs/txlog-export.md; DIR is on the node's host)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_txlog_export)
    p = txsub.add_parser("add-peer", help="add a sync peer at runtime (administrator; the "
                         "node running the master)")
    p.add_argument("peer_id", metavar="ID")
    p.add_argument("url", metavar="URL", help="txlog://host:port (an HA datacenter: every "
                   "node's, comma-separated, quoted)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_txlog_add_peer)
    p = txsub.add_parser("remove-peer", help="remove a sync peer at runtime (administrator)")
    p.add_argument("peer_id", metavar="ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_txlog_remove_peer)
    p = txsub.add_parser("split-recovery", help="show, or set None|Simple|Smart (administrator; "
                         "refused during a split)")
    p.add_argument("value", nargs="?", metavar="STRATEGY",
                   help="None, Simple or Smart (case-insensitive); omitted: show the current one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(ctl_handler=cmd_txlog_split_recovery)
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    CREDENTIALS.update(user=args.user, password=args.password)
    try:
        if args.ca or args.cert:  # every request of this command (also to other members)
            try:
                context = ssl.create_default_context(cafile=args.ca)
                if args.cert:
                    context.load_cert_chain(args.cert, args.key)
            except (OSError, ssl.SSLError) as exc:
                raise CtlError(f"--ca/--cert: {exc}") from exc
            urllib.request.install_opener(urllib.request.build_opener(
                urllib.request.HTTPSHandler(context=context)))
        return int(args.ctl_handler(args))
    except CtlError as exc:
        print(f"brokerha ctl: {exc}", file=sys.stderr)
        return exc.code
