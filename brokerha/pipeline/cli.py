"""``brokerha pipeline audit | replay-plan | check-history | stats``.

``brokerha.cli`` imports this module only when the ``pipeline`` area is
asked for, and this module in turn imports pyspark only inside a handler, so
neither ``brokerha --help`` nor ``brokerha pipeline --help`` starts a JVM.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: sub-command -> (module with run(inputs-or-args…), help)
COMMANDS: dict[str, tuple[str, str]] = {
    "audit": ("brokerha.pipeline.audit", "prefix consistency, divergence per pair, majority log"),
    "replay-plan": (
        "brokerha.pipeline.replay",
        "what each minority must replay/renegotiate; conflicts; vs. what brokers did",
    ),
    "check-history": (
        "brokerha.pipeline.history",
        "lost, duplicated and half-visible transactions in client histories",
    ),
    "stats": (
        "brokerha.pipeline.stats",
        "committed tx/s over time, commit/agreement latency per DC",
    ),
}


def _conf(value: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key, val


def register(parser: argparse.ArgumentParser) -> None:
    """Add the pipeline sub-commands to ``brokerha pipeline``'s parser."""
    sub = parser.add_subparsers(dest="pipeline_command", metavar="JOB", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        needs_input = name != "check-history"
        p.add_argument(
            "--input",
            type=str,
            required=needs_input,
            metavar="DIR",
            help="TxLog export: one <master>/ folder or a directory of them "
            "(a path or any URL Spark reads: file://, hdfs://, s3a://...)"
            + ("" if needs_input else " (optional: classifies lost messages against the logs)"),
        )
        if name == "check-history":
            p.add_argument(
                "--history",
                type=str,
                required=True,
                metavar="PATH",
                help="client history: .jsonl/.parquet file or a directory of them (path or URL)",
            )
        p.add_argument(
            "--out", type=Path, required=True, metavar="OUT", help="report directory (created)"
        )
        where = p.add_mutually_exclusive_group()
        where.add_argument(
            "--master",
            default=None,
            metavar="SPARK_URL",
            help="Spark master: local[N], spark://host:port, yarn... "
            "(default local[*]; under spark-submit, the launcher's)",
        )
        where.add_argument(
            "--remote",
            default=None,
            metavar="sc://HOST:PORT",
            help="run on a Spark Connect server instead of starting a local JVM",
        )
        p.add_argument(
            "--conf",
            type=_conf,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="extra Spark setting (repeatable)",
        )
        p.add_argument(
            "--fail-on-findings",
            action="store_true",
            help="exit 1 when the report finds a problem (for CI)",
        )
        p.set_defaults(handler=_make_handler(name, module))


def _make_handler(name: str, module: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        return run(name, module, args)

    return handler


def run(name: str, module: str, args: argparse.Namespace) -> int:
    """Start one session, run the job, print where the report is; exit code 0/1/2."""
    from pyspark.sql import SparkSession

    from brokerha.pipeline.reader import ExportError
    from brokerha.pipeline.session import get_session

    job = importlib.import_module(module)
    owned = SparkSession.getActiveSession() is None
    spark = get_session(
        args.master, app=f"brokerha-pipeline-{name}", conf=dict(args.conf), remote=args.remote
    )
    try:
        report: dict[str, Any] = job.main(spark, args)
    except ExportError as exc:
        print(f"brokerha pipeline {name}: {exc}", file=sys.stderr)
        return 2
    finally:
        if owned:
            spark.stop()
    ok = bool(report.get("ok", True))
    print(f"{name}: {'ok' if ok else 'FINDINGS'} - {report.get('summary', '')}")
    print(f"report: {args.out / 'report.json'}  {args.out / 'report.html'}")
    return 1 if (args.fail_on_findings and not ok) else 0
