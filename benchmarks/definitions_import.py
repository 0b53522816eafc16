"""A definitions import and the management lists on a partitioned cluster vs an
unpartitioned one (issue 35, docs/ha.md "Definitions on a partitioned cluster").

Two clusters of three real nodes (``LocalCluster``), one after the other in the same
run: the reference, an HA cluster without partition groups (the primary declares
every item, its backups replicate), and one with ``partition_groups`` and P = 9 (each
item asked of its group's leader, answered once durable there and in the answering
node's copy). On each: ``--rounds`` times, ``POST /api/definitions`` of one file (an
exchange, ``--queues`` durable queues each bound to it) on a node that is not the
(metadata) primary -- so forwarded to it, as an operator's import usually is -- timed
to its 204, then ``GET /api/queues`` and ``GET /api/definitions`` timed, then the
queues deleted. Printed: the medians per cluster and the ratios partitioned /
reference, with the machine's load before and after. The client shares the 2 cores
with the nodes: the figures are relative.

    .venv/bin/python benchmarks/definitions_import.py --queues 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import time
import urllib.error
import urllib.request
from typing import Any

import pika

from brokerha.testing import LocalCluster

FAST: dict[str, float | str | bool] = {
    "heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
    "backup_timeout": 3.0}
PARTITIONED: dict[str, float | str | bool] = {**FAST, "partitions": 9,
                                              "partition_groups": True}


def http(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()[:300]


def definitions(queues: int) -> dict[str, Any]:
    names = [f"bench-def-{i}" for i in range(queues)]
    return {
        "exchanges": [{"name": "bench-def-x", "vhost": "/", "type": "topic", "durable": True,
                       "auto_delete": False, "internal": False, "arguments": {}}],
        "queues": [{"name": n, "vhost": "/", "durable": True, "auto_delete": False,
                    "arguments": {}} for n in names],
        "bindings": [{"source": "bench-def-x", "vhost": "/", "destination": n,
                      "destination_type": "queue", "routing_key": f"k.{n}", "arguments": {}}
                     for n in names]}


def ready(cluster: LocalCluster, partitioned: bool) -> str:
    """The (metadata) primary, once every node is ready in every group it runs."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        statuses = [cluster.status(n) or {} for n in cluster.names]
        if partitioned:
            groups = [s.get("node", {}).get("groups") or {} for s in statuses]
            if all(len(g) == 10 and all(v["ready"] for v in g.values()) for g in groups):
                serving = [n for n, g in zip(cluster.names, groups, strict=True)
                           if g["0"]["serving"]]
                if len(serving) == 1:
                    return serving[0]
        else:
            primary = cluster.primary()
            if primary is not None and all(s.get("node", {}).get("ready")
                                           for s in statuses):
                return primary
        time.sleep(0.2)
    raise SystemExit("the cluster did not become ready")


def run(partitioned: bool, queues: int, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"import": [], "list": [], "export": []}
    body = definitions(queues)
    with LocalCluster(3, options=PARTITIONED if partitioned else FAST) as cluster:
        primary = ready(cluster, partitioned)
        other = next(n for n in cluster.names if n != primary)
        base = cluster.admin_url(other) + "/api/"
        for _ in range(rounds):
            started = time.monotonic()
            status, answer = http(base, "POST", "definitions", body)
            if status != 204:
                raise SystemExit(f"import: {status} {answer!r}")
            times["import"].append(time.monotonic() - started)
            started = time.monotonic()
            status, listed = http(base, "GET", "queues")
            times["list"].append(time.monotonic() - started)
            assert status == 200 and len(listed) >= queues, (status, len(listed))
            started = time.monotonic()
            status, export = http(base, "GET", "definitions")
            times["export"].append(time.monotonic() - started)
            assert status == 200 and len(export["queues"]) >= queues
            conn = pika.BlockingConnection(pika.URLParameters(cluster.url(primary)))
            ch = conn.channel()
            for q in body["queues"]:
                ch.queue_delete(q["name"])
            conn.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}")
    results = {}
    for label, partitioned in (("reference (HA, no partition groups)", False),
                               ("partitioned (P = 9)", True)):
        results[label] = run(partitioned, args.queues, args.rounds)
        print(f"{label}: " + ", ".join(
            f"{k} median {statistics.median(v):.3f} s ({', '.join(f'{x:.3f}' for x in v)})"
            for k, v in results[label].items()))
    ref, part = results.values()
    print("ratios partitioned / reference: " + ", ".join(
        f"{k} {statistics.median(part[k]) / statistics.median(ref[k]):.2f}x" for k in ref))
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
