"""Inputs are named by URL and listed by Spark, never by the driver's own filesystem.

``viewfs://`` (Hadoop's mount-table filesystem) stands in for ``hdfs://`` or
``s3a://`` here: its paths exist nowhere on the local disk, so a job that
lists or opens them with Python's ``os``/``pathlib`` fails, while anything
going through Spark's Hadoop FileSystem layer reads them.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from brokerha.pipeline import audit, history, replay
from brokerha.pipeline.inputs import Inputs
from brokerha.pipeline.reader import ExportError, discover, location, read_history
from brokerha.pipeline.schema import write_master_export

from . import crafted

pytestmark = pytest.mark.spark


def _mount(spark: Any, target: Path) -> str:
    """A viewfs:// URL whose path does not exist locally, mounted on ``target``."""
    cluster, name = f"c{uuid.uuid4().hex[:8]}", f"/nowhere-{uuid.uuid4().hex[:8]}"
    assert not Path(name).exists()
    spark.conf.set(f"fs.viewfs.mounttable.{cluster}.link.{name}", target.resolve().as_uri())
    return f"viewfs://{cluster}{name}"


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert {k: v for k, v in a.items() if k != "input"} == {
        k: v for k, v in b.items() if k != "input"
    }


def test_location_keeps_urls_and_absolutises_paths(tmp_path: Path) -> None:
    assert location("hdfs://nn:8020/exports/") == "hdfs://nn:8020/exports"
    assert location("s3a://bucket/x") == "s3a://bucket/x"
    assert location("file:///tmp/x") == "file:///tmp/x"
    assert location(tmp_path / "a") == str(tmp_path / "a")
    assert location("rel/dir") == os.path.join(os.getcwd(), "rel/dir")


def test_audit_and_replay_plan_by_url(spark: Any, tmp_path: Path) -> None:
    root = crafted.write_split(tmp_path / "in", recovered_events=True, wrong_replay=True)
    plain_audit = audit.run(Inputs.load(spark, root), tmp_path / "a0")
    plain_plan = replay.run(Inputs.load(spark, root), tmp_path / "p0")
    for i, url in enumerate((root.as_uri(), _mount(spark, root))):
        inputs = Inputs.load(spark, url)
        assert inputs.root == url and all(m.folder.startswith(url) for m in inputs.masters)
        _same(audit.run(inputs, tmp_path / f"a{i + 1}"), plain_audit)
        _same(replay.run(inputs, tmp_path / f"p{i + 1}"), plain_plan)
    # one master's folder given directly, by URL: its name comes from meta.json
    (one,) = discover(spark, _mount(spark, root / "dc3"))
    assert one.name == "dc3" and one.tables == {"synchronised", "incoming", "operations", "events"}


def test_check_history_by_url(spark: Any, tmp_path: Path) -> None:
    exports = crafted.write_split(tmp_path / "in")
    hdir = tmp_path / "hist"
    crafted.write_history_file(hdir / "a.jsonl", crafted.history_ok()[:6])
    crafted.write_history_file(hdir / "b.parquet", crafted.history_ok()[6:])
    plain = history.run(spark, hdir, tmp_path / "o0", exports)
    by_url = history.run(spark, _mount(spark, hdir), tmp_path / "o1", _mount(spark, exports))
    assert plain["ok"] and plain["totals"]["confirmed_messages"] == 5
    assert {k: v for k, v in by_url.items() if k not in ("history", "input")} == {
        k: v for k, v in plain.items() if k not in ("history", "input")
    }
    # a single file with an unknown suffix is sniffed (Parquet magic) on Spark's side
    odd = hdir / "b.parquet"
    odd.rename(tmp_path / "history.bin")
    assert read_history(spark, _mount(spark, tmp_path / "history.bin")).count() == 10


def test_bad_inputs_are_export_errors(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no such file or directory"):
        discover(spark, tmp_path / "missing")
    with pytest.raises(ExportError, match="cannot be listed: .*Empty Mount table"):
        discover(spark, f"viewfs://nothere{uuid.uuid4().hex[:6]}/x")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ExportError, match="not a directory"):
        discover(spark, tmp_path / "file.txt")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "notes.txt").write_text("x")
    with pytest.raises(ExportError, match="no TxLog export"):
        discover(spark, _mount(spark, tmp_path / "empty"))
    folder = write_master_export(tmp_path / "v2", "dc1", meta={"schema_version": 99})
    with pytest.raises(ExportError, match="schema_version 99 is not supported"):
        discover(spark, _mount(spark, folder.parent))
    (folder / "meta.json").write_text("{not json")
    with pytest.raises(ExportError, match="not valid JSON"):
        discover(spark, folder.parent)
    write_master_export(tmp_path / "twice", "a", meta={"master": "dc1"})
    write_master_export(tmp_path / "twice", "b", meta={"master": "dc1"})
    with pytest.raises(ExportError, match="the same master id appears twice"):
        discover(spark, tmp_path / "twice")
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "notes.txt").write_text("x")
    with pytest.raises(ExportError, match="no .jsonl or .parquet history files"):
        read_history(spark, tmp_path / "h")
