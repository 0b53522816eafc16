"""The four pipeline jobs on crafted exports with known answers (real PySpark, local[2])."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from brokerha.pipeline import audit, history, logs, replay, stats
from brokerha.pipeline.inputs import Inputs
from brokerha.pipeline.schema import write_master_export

from . import crafted

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[2]


def _audit(spark: Any, root: Path, out: Path) -> dict[str, Any]:
    return audit.run(Inputs.load(spark, root), out)


# --- audit -------------------------------------------------------------------


def test_audit_clean_with_a_lagger(spark: Any, tmp_path: Path) -> None:
    rep = _audit(spark, crafted.write_consistent(tmp_path / "in"), tmp_path / "out")
    assert rep["consistent"] is True and rep["ok"] is True
    assert rep["masters"] == ["dc1", "dc2", "dc3"] and rep["divergences"] == []
    assert (
        rep["majority"]["supporters"] == ["dc1", "dc2", "dc3"] and rep["majority"]["length"] == 15
    )
    relations = {(p["a"], p["b"]): p["relation"] for p in rep["pairs"]}
    assert relations == {
        ("dc1", "dc2"): "equal",
        ("dc1", "dc3"): "prefix",
        ("dc2", "dc3"): "prefix",
    }
    assert (tmp_path / "out" / "report.html").exists() and (tmp_path / "out" / "logs.png").exists()


def test_audit_finds_crafted_divergence(spark: Any, tmp_path: Path) -> None:
    rep = _audit(spark, crafted.write_split(tmp_path / "in"), tmp_path / "out")
    assert rep["consistent"] is False
    got = {(d["a"], d["b"]): (d["position"], d["a_tx"], d["b_tx"]) for d in rep["divergences"]}
    assert got == {
        ("dc1", "dc3"): (10, "dc1-100", "dc3-200"),
        ("dc2", "dc3"): (10, "dc1-100", "dc3-200"),
    }
    assert rep["majority"] == {
        "master": "dc1",
        "length": 15,
        "supporters": ["dc1", "dc2"],
        "minority": ["dc3"],
        "strict": True,
    }
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["divergences"][0]["position"] == 10


def test_audit_exact_position_across_blocks(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny blocks so the digest pass, the exact pass and partial last blocks all matter."""
    monkeypatch.setattr(logs, "BLOCK", 4)
    base = [f"dc1-{i}" for i in range(30)]
    forked = base[:17] + [f"dc2-{i}" for i in range(17, 26)]  # differs from 17 on (block 4)
    late = base[:29] + ["dc3-x"]  # differs only in the last, partial block of the shorter pair
    short = base[:13]  # a lagger: prefix ending inside a block
    for name, log in (("a", base), ("b", forked), ("c", late), ("d", short)):
        # write each table as a directory of part files, as Spark would
        write_master_export(tmp_path / "in", name, synchronised=crafted.sync_rows(name, log))
    rep = _audit(spark, tmp_path / "in", tmp_path / "out")
    got = {(d["a"], d["b"]): d["position"] for d in rep["divergences"]}
    assert got == {("a", "b"): 17, ("a", "c"): 29, ("b", "c"): 17}
    relations = {(p["a"], p["b"]): p["relation"] for p in rep["pairs"]}
    assert relations[("a", "d")] == relations[("b", "d")] == relations[("c", "d")] == "prefix"


def test_audit_reads_part_file_directories(spark: Any, tmp_path: Path) -> None:
    """A table may be a directory of part files; DIR may be one master's folder."""
    import pyarrow.parquet as pq

    src = crafted.write_split(tmp_path / "src")
    table = pq.read_table(src / "dc3" / "synchronised.parquet")
    (src / "dc3" / "synchronised.parquet").unlink()
    parts = src / "dc3" / "synchronised.parquet"
    parts.mkdir()
    pq.write_table(table.slice(0, 6), parts / "part-00000.parquet")
    pq.write_table(table.slice(6), parts / "part-00001.parquet")
    rep = _audit(spark, src, tmp_path / "out")
    assert [d["position"] for d in rep["divergences"]] == [10, 10]
    single = _audit(spark, src / "dc3", tmp_path / "out1")
    assert single["masters"] == ["dc3"] and single["consistent"] is True


# --- replay-plan --------------------------------------------------------------


def test_replay_plan_for_crafted_split(spark: Any, tmp_path: Path) -> None:
    rep = replay.run(Inputs.load(spark, crafted.write_split(tmp_path / "in")), tmp_path / "out")
    assert rep["ok"] is True and rep["disagreements"] == []
    (plan,) = rep["plans"]
    assert (
        plan["master"] == "dc3"
        and plan["fork_position"] == crafted.FORK
        and plan["majority_master"] == "dc1"
    )
    assert [r["tx_id"] for r in plan["replay"]["sample"]] == crafted.MAJORITY_TAIL
    assert [r["tx_id"] for r in plan["renegotiate"]["sample"]] == crafted.MINORITY_TAIL
    # the crafted double consumption: m-dc1-3 dequeued by dc2-101 (majority) and dc3-200 (minority)
    assert [
        (c["message_id"], c["majority_tx"], c["minority_tx"]) for c in plan["conflicts"]["sample"]
    ] == [("m-dc1-3", "dc2-101", "dc3-200")]
    assert plan["recorded"]["status"].startswith("pending")
    assert (tmp_path / "out" / "plans" / "dc3" / "replay.parquet").is_dir()
    # nothing stays cached: a session (a Connect server's, the bench's) outlives the job
    assert spark._jsparkSession.sharedState().cacheManager().isEmpty()


def test_replay_plan_reads_version_1_exports(spark: Any, tmp_path: Path) -> None:
    """Operations without ``position`` (schema version 1) are all read: the same plan."""
    now = replay.run(Inputs.load(spark, crafted.write_split(tmp_path / "v2")), tmp_path / "o2")
    old_root = crafted.as_version_1(crafted.write_split(tmp_path / "v1"))
    old = replay.run(Inputs.load(spark, old_root), tmp_path / "o1")
    assert old["plans"][0]["conflicts"]["count"] == 1
    assert {**old, "input": None} == {**now, "input": None}


def test_replay_plan_reports_what_brokers_did_wrong(spark: Any, tmp_path: Path) -> None:
    good = replay.run(
        Inputs.load(spark, crafted.write_split(tmp_path / "ok", recovered_events=True)),
        tmp_path / "o1",
    )
    assert good["ok"] is True and good["plans"][0]["recorded"]["missing_replays"] == 0
    root = crafted.write_split(tmp_path / "bad", recovered_events=True, wrong_replay=True)
    rep = replay.run(Inputs.load(spark, root), tmp_path / "o2")
    assert rep["ok"] is False
    whats = {d["what"]: d for d in rep["disagreements"]}
    assert (
        whats["rejoin common_prefix differs from the fork position"]["recorded"] == crafted.FORK + 1
    )
    assert whats["planned replay not replayed"]["sample"] == [crafted.MAJORITY_TAIL[-1]]


def test_replay_plan_clean_input(spark: Any, tmp_path: Path) -> None:
    rep = replay.run(
        Inputs.load(spark, crafted.write_consistent(tmp_path / "in")), tmp_path / "out"
    )
    assert rep["ok"] is True and rep["plans"] == [] and rep["majority"]["minority"] == []


# --- check-history ------------------------------------------------------------


def test_check_history_clean(spark: Any, tmp_path: Path) -> None:
    path = crafted.write_history_file(tmp_path / "h.jsonl", crafted.history_ok())
    rep = history.run(spark, path, tmp_path / "out")
    assert rep["ok"] is True
    assert all(rep[k]["count"] == 0 for k in history.FINDINGS)
    assert rep["totals"]["confirmed_messages"] == 5 and rep["totals"]["committed_transactions"] == 1


def test_check_history_finds_each_crafted_anomaly(spark: Any, tmp_path: Path) -> None:
    q = crafted.QUEUE

    def keep(r: dict[str, Any]) -> bool:
        mid, op = r.get("message_id"), r["op"]
        # p2: lost plain publish; t1: half of transaction T1 never delivered; p1/t0 acked later below
        return not (
            (mid in ("p2", "t1") and op in ("delivered", "acked"))
            or (mid in ("p1", "t0") and op == "acked")
        )

    rows = [r for r in crafted.history_ok() if keep(r)]
    rows += [
        # p1 legitimately redelivered (flag set) before its ack: not a duplicate
        {
            "client": "c1",
            "at_ms": 150,
            "op": "delivered",
            "queue": q,
            "message_id": "p1",
            "redelivered": True,
        },
        {"client": "c1", "at_ms": 151, "op": "acked", "queue": q, "message_id": "p1"},
        # p0 delivered again to c2 after c1 acked it, and acked again: duplicate + double consumption
        {
            "client": "c2",
            "at_ms": 500,
            "op": "delivered",
            "queue": q,
            "message_id": "p0",
            "redelivered": True,
        },
        {"client": "c2", "at_ms": 501, "op": "acked", "queue": q, "message_id": "p0"},
        # t0 delivered a second time without the redelivered flag
        {
            "client": "c1",
            "at_ms": 502,
            "op": "delivered",
            "queue": q,
            "message_id": "t0",
            "redelivered": False,
        },
        # u0 from a transaction that never committed shows up at a consumer
        {
            "client": "p3",
            "at_ms": 30,
            "op": "publish-confirmed",
            "queue": q,
            "message_id": "u0",
            "tx_id": "T9",
        },
        {
            "client": "c1",
            "at_ms": 600,
            "op": "delivered",
            "queue": q,
            "message_id": "u0",
            "redelivered": False,
        },
    ]
    path = crafted.write_history_file(tmp_path / "h.parquet", rows)
    rep = history.run(spark, path, tmp_path / "out", crafted.write_split(tmp_path / "exports"))
    assert sorted(r["message_id"] for r in rep["lost"]["sample"]) == ["p2", "t1"]
    assert {r["in_txlog"] for r in rep["lost"]["sample"]} == {"never reached the TxLog"}
    assert sorted((r["message_id"], r["reason"]) for r in rep["duplicates"]["sample"]) == [
        ("p0", "delivered after ack"),
        ("t0", "redelivered flag not set"),
    ]
    assert [(r["message_id"], r["clients"]) for r in rep["double_consumptions"]["sample"]] == [
        ("p0", ["c1", "c2"])
    ]
    (half,) = rep["half_visible"]["sample"]
    assert (half["tx_id"], half["messages"], half["delivered"], half["never_delivered"]) == (
        "T1",
        2,
        1,
        ["t1"],
    )
    assert [r["message_id"] for r in rep["uncommitted_visible"]["sample"]] == ["u0"]
    assert rep["ok"] is False


# --- stats --------------------------------------------------------------------


def test_stats_latency_and_throughput(spark: Any, tmp_path: Path) -> None:
    root = tmp_path / "in"
    log = [
        f"dc1-{i}" if i % 2 else f"dc2-{i}" for i in range(200)
    ]  # created every 10 ms -> 100 tx/s
    for m in ("dc1", "dc2"):
        write_master_export(root, m, synchronised=crafted.sync_rows(m, log, failed=["dc2-0"]))
    rep = stats.run(Inputs.load(spark, root), tmp_path / "out")
    dc1 = next(d for d in rep["dcs"] if d["master"] == "dc1")
    assert (dc1["committed"], dc1["failed"], dc1["originated"]) == (199, 1, 100)
    assert dc1["commit_latency_ms"]["p50"] == 3 and dc1["commit_latency_ms"]["max"] == 3
    assert dc1["agreement_latency_ms"]["max"] == 20 and dc1["agreement_latency_ms"]["p99"] == 20
    series = rep["throughput"]["series"]["dc1"]
    assert rep["throughput"]["bucket_ms"] == 1000 and sum(p["tx_per_s"] for p in series) == 199
    assert max(p["tx_per_s"] for p in series) == 100
    assert (tmp_path / "out" / "throughput.png").exists() and (
        tmp_path / "out" / "latency.png"
    ).exists()


# --- the CLI, end to end ---------------------------------------------------------


def test_cli_audit_end_to_end(tmp_path: Path) -> None:
    from .conftest import java_available

    if not java_available():
        pytest.skip("no Java runtime: run scripts/ensure-java")
    root = crafted.write_split(tmp_path / "in")
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "brokerha.cli",
        "pipeline",
        "audit",
        "--input",
        str(root),
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        [*cmd, "--master", "local[2]", "--fail-on-findings"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["consistent"] is False and rep["masters"] == ["dc1", "dc2", "dc3"]
    assert sorted((d["a"], d["b"], d["position"]) for d in rep["divergences"]) == [
        ("dc1", "dc3", 10),
        ("dc2", "dc3", 10),
    ]
    assert (out / "report.html").exists()


def test_audit_and_replay_plan_read_a_real_simulation_export(spark: Any, tmp_path: Path) -> None:
    """The contract end to end: what `brokerha txlog simulate --export` writes, the jobs read.

    The exported seed went through a split and a majority-vote rejoin, after
    which every master holds the same synchronised log.
    """
    from brokerha.cli import main as cli_main

    exports = tmp_path / "exports"
    assert (
        cli_main(["txlog", "simulate", "--seeds", "2", "--masters", "3", "--export", str(exports)])
        == 0
    )
    report = _audit(spark, exports, tmp_path / "audit")
    assert report["consistent"] is True
    assert sorted(report["masters"]) == ["dc1", "dc2", "dc3"]
    plan = replay.run(Inputs.load(spark, exports), tmp_path / "replay")
    assert plan["ok"] is True, plan.get("summary")
