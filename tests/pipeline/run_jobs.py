"""Run every pipeline command through the CLI on one session; used by test_cluster.py.

    python tests/pipeline/run_jobs.py --master spark://127.0.0.1:7077 --input DIR \
        --history PATH --out OUT [--conf K=V]...

Starting a session on a cluster (driver JVM, executors) costs far more than
our small test jobs, so the session is created first and the four commands
then run through ``brokerha.cli.main`` on it, as the tests' in-process
local[2] session does; ``OUT/<command>/report.json`` are the reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from brokerha.cli import main as cli_main

COMMANDS = ("audit", "replay-plan", "check-history", "stats")


def run_all(inputs: str, history: str, out: Path) -> dict[str, dict[str, Any]]:
    """Each command's report (the session is the active one)."""
    reports = {}
    for command in COMMANDS:
        args = ["pipeline", command, "--input", inputs, "--out", str(out / command)]
        if command == "check-history":
            args += ["--history", history]
        if cli_main(args) != 0:
            raise RuntimeError(f"brokerha pipeline {command} failed")
        reports[command] = json.loads((out / command / "report.json").read_text())
    return reports


def main() -> int:
    from brokerha.pipeline.session import get_session

    ap = argparse.ArgumentParser()
    ap.add_argument("--master")
    ap.add_argument("--input", required=True)
    ap.add_argument("--history", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conf", action="append", default=[])
    args = ap.parse_args()
    conf = dict(kv.split("=", 1) for kv in args.conf)
    spark = get_session(args.master, app="brokerha-pipeline-cluster-test", conf=conf)
    try:
        run_all(args.input, args.history, args.out)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
