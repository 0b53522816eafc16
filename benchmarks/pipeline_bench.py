"""Time each pipeline job on one SparkSession (default local[2]) and print a table.

    python benchmarks/pipeline_generate.py --out /tmp/bench --txs 1000000 --diverge-at 900000 --history 1000000
    python benchmarks/pipeline_bench.py --data /tmp/bench

The session is started once (its cost is reported separately, as a command
pays it once); each job runs ``--repeat`` times so cold (first) and warm
figures can be told apart.
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
from brokerha.pipeline.session import get_session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data", type=Path, required=True, help="output directory of pipeline_generate.py"
    )
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--driver-memory", default="2g")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    spark = get_session(
        args.master, app="brokerha-pipeline-bench", conf={"spark.driver.memory": args.driver_memory}
    )
    session_s = time.perf_counter() - t0
    exports, hist = args.data / "exports", args.data / "history.parquet"
    jobs: dict[str, Callable[[Path], dict[str, Any]]] = {
        "audit": lambda out: audit.run(Inputs.load(spark, exports), out),
        "replay-plan": lambda out: replay.run(Inputs.load(spark, exports), out),
        "stats": lambda out: stats.run(Inputs.load(spark, exports), out),
    }
    if hist.exists():
        jobs["check-history"] = lambda out: history.run(spark, hist, out)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, job in jobs.items():
            times = []
            for i in range(args.repeat):
                t = time.perf_counter()
                report = job(Path(tmp) / f"{name}-{i}")
                times.append(time.perf_counter() - t)
            results.append({"job": name, "seconds": times, "summary": report.get("summary", "")})
    spark.stop()
    rows = sum(1 for _ in exports.iterdir())
    size = sum(p.stat().st_size for p in args.data.rglob("*") if p.is_file()) / 2**20
    print(
        f"\n{rows} masters, {size:,.0f} MiB on disk, master {args.master}; session start {session_s:.1f} s\n"
    )
    print(f"| job | {' | '.join(f'run {i + 1} (s)' for i in range(args.repeat))} | result |")
    print(f"|---|{'---|' * args.repeat}---|")
    for r in results:
        print(f"| {r['job']} | {' | '.join(f'{s:.1f}' for s in r['seconds'])} | {r['summary']} |")
    if args.json:
        args.json.write_text(json.dumps({"session_s": session_s, "results": results}, indent=2))


if __name__ == "__main__":
    main()
