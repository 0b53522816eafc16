"""Which thread runs the cyclic GC's collections, and what that costs the event loop (issue 33).

In process, a node's store in small: ``SQLStore`` with its operation log (its
appender and SQL writer threads) on an asyncio loop, the node's GC settings
(``tune_gc``'s collect, freeze and ``GC_THRESHOLDS``) and its ``GCGovernor``
installed on the loop. The loop enqueues ``--count`` persistent 1 KiB messages,
2,000 a step, a sync every 20,000, then takes and settles them, 4,096 a step;
beside it a task sleeps 1 ms at a time and records how late it wakes (the
loop's lag). Each run is a fresh process; ``on`` (the governor's
``COLLECT_ON_LOOP``: automatic collection off, the loop collects) and ``off``
(CPython's automatic collection, on whichever thread allocates) alternate.

Per run: the collections by the thread they ran on (``gc.callbacks``), the
longest one on a store thread, the loop's lateness p99 / max and wake-ups over
10 ms late, the seconds the work took; ``uptime``'s load before and after.

    .venv/bin/python benchmarks/gc_store_threads.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brokerha.node import gc_governor  # noqa: E402
from brokerha.node.gc_governor import GCGovernor  # noqa: E402
from brokerha.node.server import GC_THRESHOLDS  # noqa: E402
from tests.store.harness import StoreNode, message  # noqa: E402

BODY = b"x" * 1024


def one(on_loop: bool, count: int) -> dict[str, object]:
    gc_governor.COLLECT_ON_LOOP = on_loop
    ran_on: dict[str, int] = {}
    store_pause = 0.0
    started: dict[int, float] = {}

    def record(phase: str, _info: dict[str, int]) -> None:
        nonlocal store_pause
        ident = threading.get_ident()
        if phase == "start":
            started[ident] = time.perf_counter()
            name = threading.current_thread().name
            ran_on[name] = ran_on.get(name, 0) + 1
        elif threading.current_thread().name.startswith("brokerha-store"):
            store_pause = max(store_pause, time.perf_counter() - started.get(ident, 0.0))

    with tempfile.TemporaryDirectory(prefix="gc-store-") as tmp:
        node = StoreNode(f"sqlite:///{tmp}/b.db", oplog=True)
        q = node.queue()
        node.sync()
        lateness: list[float] = []
        done = False

        async def probe() -> None:
            while not done:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                lateness.append(time.perf_counter() - t - 0.001)

        async def work() -> float:
            nonlocal done
            gc.collect()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            governor = GCGovernor()
            governor.install(asyncio.get_running_loop())
            gc.callbacks.append(record)
            task = asyncio.get_running_loop().create_task(probe())
            t0 = time.perf_counter()
            for i in range(0, count, 2_000):
                for _ in range(2_000):
                    q.enqueue(message(BODY, rk="q"))
                await asyncio.sleep(0)
                if (i + 2_000) % 20_000 == 0:
                    await node.barrier()
            await node.barrier()
            while q.message_count:
                for _ in range(min(4_096, q.message_count)):
                    entry = q.get()
                    if entry is None:
                        break
                    q.settle(entry)
                await asyncio.sleep(0)
            await node.barrier()
            seconds = time.perf_counter() - t0
            done = True
            await task
            gc.callbacks.remove(record)
            governor.uninstall()
            return seconds

        seconds = node.loop.run_until_complete(work())
        node.close()
    ordered = sorted(lateness)
    return {"on_loop": on_loop, "collections": ran_on,
            "store_pause_max": round(store_pause, 4),
            "lag_p99": round(ordered[int(0.99 * len(ordered))], 4) if ordered else 0.0,
            "lag_max": round(ordered[-1], 4) if ordered else 0.0,
            "late_10ms": sum(1 for x in ordered if x > 0.01), "seconds": round(seconds, 2)}


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--count", type=int, default=200_000)
    p.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one == "on", args.count)), flush=True)
        return 0
    print(f"# gc_store_threads: {args.count} x 1 KiB enqueued then settled, {args.rounds} rounds\n"
          "| collections on the loop | collections by thread | longest on a store thread | "
          "loop lateness p99 / max | wake-ups > 10 ms late | work (s) | load before -> after |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            before = load()
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--count",
                                  str(args.count)], capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                print(f"| {mode} | failed: {out.stderr.strip()[-300:]} |", flush=True)
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            by = ", ".join(f"{k} {v}" for k, v in sorted(res["collections"].items()))
            print(f"| {mode} | {by} | {1000 * res['store_pause_max']:.1f} ms | "
                  f"{1000 * res['lag_p99']:.1f} / {1000 * res['lag_max']:.1f} ms | "
                  f"{res['late_10ms']} | {res['seconds']} | {before} -> {load()} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
