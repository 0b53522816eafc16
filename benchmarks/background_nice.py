"""The store threads' nice value (``[node] background_nice``) against the loop lag and confirms.

Issue 33: beside two CPU burners on two cores, the primary's event-loop
thread spent most of its stalls runnable and waiting for a core. Linux shares
a core fairly between threads of equal nice value, and each node's store
threads (the operation log's appender and fsync, the SQL writer) are among
the loop's competitors. This runs the same sustained confirmed publishing --
``--count`` persistent messages of ``--size`` bytes over 2 connections x 2000
unconfirmed (``ha_heavy_work.fill``), beside the probe (a pika publisher, one
confirm at a time, a message every 20 ms) -- on a fresh 3-node
``LocalCluster`` for each ``--nice`` value, alternating their order each
round, beside ``--burners`` ``yes > /dev/null``.

Per run: the fill's confirmed msgs/s; the probe's confirm latency p50 / p99
(the time between two confirms less its 20 ms pause: one publish in flight);
the primary's loop lag p99 / max over the fill (``/metrics``); elections; and
the "event loop stalled" lines of every node, with the share of their time the
loop's thread spent running, waiting for a core and blocked (the stall
line's own split, node/loop_monitor.py). ``uptime``'s load before and after.

    .venv/bin/python benchmarks/background_nice.py --burners 2 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ha_heavy_work import (  # noqa: E402
    PROBE_PAUSE,
    QUEUE,
    Outcome,
    Probe,
    burners,
    fill,
    measured,
)

from brokerha.testing import LocalCluster  # noqa: E402

SPLIT = re.compile(r"loop thread CPU ([\d.]+)s of ([\d.]+)s, waiting for a core ([\d.]+)s, "
                   r"blocked \(the GIL, or a blocking call\) ([\d.]+)s")


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def split(stalls: Sequence[str]) -> str:
    """The stall lines' time: running / waiting for a core / blocked, in % of what they cover."""
    cpu = wait = blocked = span = 0.0
    n = 0
    for line in stalls:
        m = SPLIT.search(line)
        if m:
            n += 1
            c, s, w, b = (float(x) for x in m.groups())
            cpu, span, wait, blocked = cpu + c, span + s, wait + w, blocked + b
    if not span:
        return f"{len(stalls)} stalls"
    return (f"{len(stalls)} stalls ({n} split: running {100 * cpu / span:.0f} %, waiting for a "
            f"core {100 * wait / span:.0f} %, blocked {100 * blocked / span:.0f} %)")


def one(nice: int, count: int, size: int) -> str:
    with LocalCluster(3, extra_args=["--background-nice", str(nice)]) as cluster:
        out = Outcome("brokerha", f"fill {count}")
        before = load()
        with Probe(cluster.urls) as probe, measured(cluster, probe, out) as primary:
            t0 = time.monotonic()
            filled = fill([cluster.url(primary)], QUEUE, count, size, connections=2, window=2000)
            times = [t for t in list(probe.pub.confirmed_at) if t > t0]
        latency = sorted(b - a - PROBE_PAUSE for a, b in zip(times, times[1:], strict=False))
        p50 = statistics.median(latency) if latency else 0.0
        p99 = latency[min(len(latency) - 1, int(0.99 * len(latency)))] if latency else 0.0
        rate = len(filled.confirmed_ids) / filled.seconds if filled.seconds else 0.0
        return (f"| {nice} | {rate:,.0f} | {1000 * p50:.1f} / {1000 * p99:.1f} ms | "
                f"{out.lag_p99} / {out.lag_max} s | {out.elections} | "
                f"{split([s for s in out.stalls if 'stalled' in s])} | {before} -> {load()} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nice", type=int, action="append", help="values to compare (default 0, 10)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--burners", type=int, default=2)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, _f: (_ for _ in ()).throw(SystemExit(128 + signum)))
    values = args.nice or [0, 10]
    print(f"# background_nice: {args.count} x {args.size} B confirmed, {args.burners} burners, "
          f"{args.rounds} rounds, load {load()}", flush=True)
    print("| nice | fill msgs/s | probe confirm p50 / p99 | primary lag p99 / max | elections "
          "| stalls over 100 ms, every node | load (1, 5, 15 min) before -> after |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    with burners(args.burners):
        for r in range(args.rounds):
            for nice in (values if r % 2 == 0 else list(reversed(values))):
                print(one(nice, args.count, args.size), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
