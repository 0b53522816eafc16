"""``brokerha txlog simulate``: the summary line, the exit code and the export."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from brokerha.cli import main


def test_summary_line_and_zero_exit_without_violations(capsys) -> None:
    assert main(["txlog", "simulate", "--seeds", "12", "--start-seed", "3", "--jobs", "2"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("seeds: 12, violations: 0, ") and line.endswith(
        " seeds/s over 2 processes)")


def test_violations_exit_non_zero_with_the_first_failing_seed(capsys) -> None:
    assert main(["txlog", "simulate", "--seeds", "40", "--unsafe", "full", "--masters", "3"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("seeds: 40, violations: ") and not lines[0].endswith(": 0")
    assert lines[1].startswith("first failing seed: ") and "S1 prefix" in lines[1]
    seed = int(lines[1].split()[3])
    assert main(["txlog", "simulate", "--seeds", "1", "--start-seed", str(seed), "--masters", "3"]) == 0


def test_strategy_is_case_insensitive_and_validated(capsys) -> None:
    assert main(["txlog", "simulate", "--seeds", "2", "--strategy", "NONE"]) == 0
    capsys.readouterr()
    try:
        main(["txlog", "simulate", "--seeds", "2", "--strategy", "fast"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "split-recovery" in capsys.readouterr().err


def test_export_writes_every_master_of_the_last_seed_with_a_split_and_a_rejoin(tmp_path: Path) -> None:
    out = tmp_path / "exports"
    proc = subprocess.run(
        [sys.executable, "-m", "brokerha.cli", "txlog", "simulate", "--seeds", "2", "--masters", "3", "--export", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1
    assert proc.stdout.startswith("seeds: 2, violations: 0, ")
    assert sorted(p.name for p in out.iterdir()) == ["dc1", "dc2", "dc3"]
    kinds = set()
    for master in out.iterdir():
        meta = json.loads((master / "meta.json").read_text())
        assert meta["master"] == master.name and meta["schema_version"] == 2
        kinds |= set(pq.read_table(master / "events.parquet").column("kind").to_pylist())
    assert {"split-detected", "vote", "rejoin"} <= kinds
