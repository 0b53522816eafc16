"""The pipeline's CLI must be importable (and its parser usable) without pyspark/JVM."""

from __future__ import annotations

import argparse
import subprocess
import sys

from brokerha.pipeline.cli import register


def test_import_does_not_load_pyspark() -> None:
    code = (
        "import sys, brokerha.cli as c; c.build_parser(['pipeline']);"
        "import brokerha.pipeline.cli, brokerha.pipeline.schema;"
        "assert 'pyspark' not in sys.modules, 'pyspark imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_parser_accepts_every_job() -> None:
    parser = argparse.ArgumentParser()
    register(parser)
    for job in ("audit", "replay-plan", "stats"):
        args = parser.parse_args(
            [job, "--input", "D", "--out", "O", "--master", "local[2]", "--conf", "a.b=c"]
        )
        assert args.input == "D" and args.master == "local[2]" and args.conf == [("a.b", "c")]
        assert callable(args.handler)
    args = parser.parse_args(["check-history", "--history", "h.jsonl", "--out", "O"])
    assert args.input is None and args.history == "h.jsonl" and args.master is None
