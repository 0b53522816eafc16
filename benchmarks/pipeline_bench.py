"""Time each pipeline job on one SparkSession (default local[2]) and print a table.

    python benchmarks/pipeline_generate.py --out /tmp/bench --txs 1000000 --diverge-at 900000 --history 1000000
    python benchmarks/pipeline_bench.py --data /tmp/bench
    python benchmarks/pipeline_bench.py --data /shared/bench --master spark://host:7077
    python benchmarks/pipeline_bench.py --data /tmp/bench --remote sc://host:15002

The session is started once (its cost is reported separately, as a command
pays it once); each job runs ``--repeat`` times so cold (first) and warm
figures can be told apart. The reference, timed in the same run, is one
plain pass over every column of every input table (``scan``): each job's
figure is also printed as a ratio to it, so runs on a busy or different
machine compare. With ``--remote`` the data path must be one the Connect
server reads (and ``--data`` is listed by Spark, not locally).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from brokerha.pipeline import audit, history, replay, stats
from brokerha.pipeline.inputs import Inputs
from brokerha.pipeline.reader import list_files, read_history
from brokerha.pipeline.session import get_session

JOBS = ("audit", "replay-plan", "stats", "check-history")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data", required=True, help="output directory of pipeline_generate.py (path or URL)"
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--master", help="Spark master (default local[2])")
    where.add_argument("--remote", metavar="sc://HOST:PORT", help="a Spark Connect server")
    ap.add_argument(
        "--jobs", default=",".join(JOBS), help="comma-separated subset of " + ", ".join(JOBS)
    )
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--driver-memory", default="2g", help="local/cluster driver memory (not with --remote)"
    )
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    jobs = [j for j in args.jobs.split(",") if j]
    if unknown := set(jobs) - set(JOBS):
        ap.error(f"unknown job(s): {sorted(unknown)}")

    t0 = time.perf_counter()
    if args.remote:
        spark = get_session(remote=args.remote)
        where_ = args.remote
    else:
        where_ = args.master or "local[2]"
        spark = get_session(
            where_, app="brokerha-pipeline-bench", conf={"spark.driver.memory": args.driver_memory}
        )
    session_s = time.perf_counter() - t0
    data = args.data.rstrip("/")
    exports, hist = f"{data}/exports", f"{data}/history.parquet"
    has_history = any(f.endswith("/history.parquet") for f in list_files(spark, data))
    runs: dict[str, Callable[[Path], dict[str, Any]]] = {
        "scan": lambda out: _scan(spark, exports, hist if has_history else None),
        "audit": lambda out: audit.run(Inputs.load(spark, exports), out),
        "replay-plan": lambda out: replay.run(Inputs.load(spark, exports), out),
        "stats": lambda out: stats.run(Inputs.load(spark, exports), out),
        "check-history": lambda out: history.run(spark, hist, out),
    }
    if not has_history and "check-history" in jobs:
        jobs.remove("check-history")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["scan", *jobs]:
            times = []
            for i in range(args.repeat):
                t = time.perf_counter()
                report = runs[name](Path(tmp) / f"{name}-{i}")
                times.append(time.perf_counter() - t)
            results.append({"job": name, "seconds": times, "summary": report.get("summary", "")})
    spark.stop()
    ref = min(results[0]["seconds"])
    print(f"\n{data}, {where_}; session start {session_s:.1f} s; reference scan {ref:.1f} s\n")
    cols = " | ".join(f"run {i + 1} (s)" for i in range(args.repeat))
    print(f"| job | {cols} | best / scan | result |")
    print(f"|---|{'---|' * args.repeat}---|---|")
    for r in results:
        secs = " | ".join(f"{s:.1f}" for s in r["seconds"])
        print(f"| {r['job']} | {secs} | {min(r['seconds']) / ref:.2f} | {r['summary']} |")
    if args.json:
        args.json.write_text(
            json.dumps({"session_s": session_s, "where": where_, "results": results}, indent=2)
        )


def _scan(spark: Any, exports: str, hist: str | None) -> dict[str, Any]:
    """The reference: one pass over every column of every synchronised table (and the history)."""
    from pyspark.sql import functions as F

    sync = Inputs.load(spark, exports).sync
    rows = sync.agg(F.bit_xor(F.xxhash64(*sync.columns))).collect()[0][0]
    if hist is not None:
        h = read_history(spark, hist)
        rows = h.agg(F.bit_xor(F.xxhash64(*h.columns))).collect()[0][0]
    return {"summary": f"checksum {rows}"}


if __name__ == "__main__":
    main()
