"""What ``ctl check-replicas`` costs on a deep queue (issue 35, "Replicas checked").

Three real nodes; a queue filled with N persistent messages of SIZE bytes
(confirmed, the load generator of ``ha_heavy_work.py``); then the check
(``POST /api/check-replicas`` on the primary) while a probe publishes with
confirms on another queue. Prints the check's time, the primary's own work
(slices, longest slice), each node's event-loop lag over the check (from
``/metrics``) and the longest gap between two of the probe's confirms.

    .venv/bin/python benchmarks/check_replicas.py --messages 200000 --size 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))      # ha_heavy_work, deep_queue_ops
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.*

from deep_queue_ops import lag_between  # noqa: E402
from ha_heavy_work import Probe, fill, scrape_lag, stall_lines  # noqa: E402

from brokerha.httpapi.client import request  # noqa: E402
from brokerha.testing import LocalCluster  # noqa: E402
from tests.failover.test_failover import wait_all_ready  # noqa: E402

QUEUE = "deep"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--queue-max-memory", metavar="SIZE",
                        help="[limits] queue_max_memory (e.g. 16MiB): bodies past it are paged "
                             "out to the store, and the check reads them back")
    args = parser.parse_args()
    cluster = LocalCluster(3)
    if args.queue_max_memory:
        with cluster.config.open("a") as config:
            config.write(f'\n[limits]\nqueue_max_memory = "{args.queue_max_memory}"\n')
    with cluster:
        primary = wait_all_ready(cluster)
        began = time.monotonic()
        published = fill(cluster.urls, QUEUE, args.messages, args.size, connections=2)
        print(f"filled {len(published.confirmed_ids)} x {args.size} B in "
              f"{time.monotonic() - began:.1f} s")
        primary = wait_all_ready(cluster, 120)
        time.sleep(1.0)
        with Probe(cluster.urls, ()) as probe:
            quiet, quiet_wall = time.monotonic(), time.time()
            calm = {n: scrape_lag(cluster, n) for n in cluster.names}
            time.sleep(2.0)  # the probe alone: its gaps and the loops' lag without a check
            base = [t for t in probe.pub.confirmed_at if t >= quiet]
            before = {n: scrape_lag(cluster, n) for n in cluster.names}
            calm_stalls = stall_lines(cluster, quiet_wall, time.time())
            confirmed = len(probe.pub.confirmed)
            began, wall = time.monotonic(), time.time()
            answer = request(cluster.admin_url(primary), "/api/check-replicas",
                             body={"timeout": 300}, user="guest", password="guest",
                             timeout=320)
            took = time.monotonic() - began
            stalls = stall_lines(cluster, wall - 0.1, time.time() + 0.1)
            after = {n: scrape_lag(cluster, n) for n in cluster.names}
            stamps = [t for t in probe.pub.confirmed_at if t >= began]
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        print(f"check: agree {answer['agree']}, complete {answer['complete']}, "
              f"{took:.2f} s (the primary's answer), {answer['seconds']:.2f} s on the primary")
        print(f"primary's own report: {answer['primary_work']}")
        for name, r in sorted(answer["replicas"].items()):
            print(f"  {name}: {r['role']}, reported in {r['seconds']} s")
        for name in cluster.names:
            b, a, c = before[name], after[name], calm[name]
            p99, top = lag_between(b, a) if b is not None and a is not None else ("-", "-")
            p99_calm, top_calm = lag_between(c, b) if c is not None and b is not None \
                else ("-", "-")
            print(f"  {name}{' (primary)' if name == primary else ''}: loop lag p99 {p99} s, "
                  f"max {top} s over the check (2 s before it: p99 {p99_calm}, max {top_calm})")
        for line in calm_stalls:
            print(f"  before the check: {line}")
        for line in stalls:  # stalls, elections and GC pauses the nodes logged meanwhile
            print(f"  {line}")
        base_gaps = [b - a for a, b in zip(base, base[1:], strict=False)]
        print(f"probe: {len(probe.pub.confirmed) - confirmed} confirms during the check, "
              f"longest gap {max(gaps, default=0.0) * 1000:.0f} ms (alone for 2 s before: "
              f"{len(base)} confirms, longest gap {max(base_gaps, default=0.0) * 1000:.0f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
