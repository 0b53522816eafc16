"""The Parquet export against the contract in docs/txlog-export.md (schema version 1)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from brokerha.txlog.cli import force_split
from brokerha.txlog.engine.queues import SyncEntry
from brokerha.txlog.engine.records import MasterEvent, Operation, TxBody, TxRecord
from brokerha.txlog.master.export import ExportSource, export, source_for
from brokerha.txlog.simulation.faults import run_seed
from brokerha.txlog.simulation.simulation import SimParams

CONTRACT = {
    "synchronised.parquet": [
        ("master", pa.string()),
        ("position", pa.int64()),
        ("tx_id", pa.string()),
        ("timestamp", pa.int64()),
        ("origin", pa.string()),
        ("generation", pa.int32()),
        ("created_ms", pa.int64()),
        ("ordered_ms", pa.int64()),
        ("outcome", pa.string()),
        ("replay_of", pa.string()),
    ],
    "incoming.parquet": [
        ("master", pa.string()),
        ("tx_id", pa.string()),
        ("timestamp", pa.int64()),
        ("origin", pa.string()),
        ("created_ms", pa.int64()),
        ("acquired_ms", pa.int64()),
    ],
    "operations.parquet": [
        ("tx_id", pa.string()),
        ("seq", pa.int32()),
        ("kind", pa.string()),
        ("queue", pa.string()),
        ("message_id", pa.string()),
        ("position", pa.int64()),
    ],
    "events.parquet": [
        ("master", pa.string()),
        ("at_ms", pa.int64()),
        ("kind", pa.string()),
        ("generation", pa.int32()),
        ("peer", pa.string()),
        ("detail", pa.string()),
    ],
}
META_KEYS = {"schema_version", "master", "exported_ms", "generation", "members", "split_recovery", "split"}
EVENT_KINDS = {"peer-dropped", "split-detected", "vote", "rejoin", "restore", "replay", "renegotiate", "crash", "restart"}


def simulated_export(tmp_path: Path) -> Path:
    result = run_seed(5, SimParams(masters=3), profile="crash", setup=force_split)
    assert result.violation is None
    for name, master in result.masters.items():
        export(source_for(master.durable, master.engine, master.events, name), tmp_path, result.ended_ms)
    return tmp_path


def test_every_file_has_exactly_the_contract_schema(tmp_path: Path) -> None:
    out = simulated_export(tmp_path)
    for master in sorted(out.iterdir()):
        meta = json.loads((master / "meta.json").read_text())
        assert set(meta) == META_KEYS and meta["schema_version"] == 2
        assert meta["split_recovery"] in {"none", "simple", "smart"} and isinstance(meta["split"], bool)
        for name, columns in CONTRACT.items():
            schema = pq.read_schema(master / name)
            assert [(f.name, f.type) for f in schema] == columns, name


def test_exports_round_trip_the_masters_logs(tmp_path: Path) -> None:
    out = simulated_export(tmp_path)
    tables = {m.name: pq.read_table(m / "synchronised.parquet").to_pylist() for m in out.iterdir()}
    logs = {tuple(r["tx_id"] for r in rows) for rows in tables.values()}
    assert len(logs) == 1  # converged: every DC exports the same synchronised queue
    for name, rows in tables.items():
        assert [r["position"] for r in rows] == list(range(len(rows)))
        assert all(r["master"] == name and r["outcome"] in {"committed", "failed"} for r in rows)
        assert all(r["ordered_ms"] is not None and r["created_ms"] is not None for r in rows)
    events = pq.read_table(out / "dc3" / "events.parquet").to_pylist()
    assert {e["kind"] for e in events} <= EVENT_KINDS
    rejoin = next(e for e in events if e["kind"] == "rejoin")
    assert set(json.loads(rejoin["detail"])) == {"winner", "common_prefix"}
    replay = next(e for e in events if e["kind"] == "replay")
    assert isinstance(json.loads(replay["detail"])["tx_ids"], list)
    replays = [r for r in tables["dc1"] if r["replay_of"]]
    renegotiated = {json.loads(e["detail"])["replay_of"] for e in events if e["kind"] == "renegotiate"}
    assert {r["replay_of"] for r in replays} == renegotiated
    ops = pq.read_table(out / "dc1" / "operations.parquet").to_pylist()
    assert {o["tx_id"] for o in ops} >= {r["tx_id"] for r in tables["dc1"]}
    # each operation carries its transaction's position in this log, and they are sorted by it
    at = {r["tx_id"]: r["position"] for r in tables["dc1"]}
    assert [o["position"] for o in ops] == [at.get(o["tx_id"]) for o in ops]
    placed = [o["position"] for o in ops if o["position"] is not None]
    assert placed == sorted(placed) and ops[: len(placed)] == [o for o in ops if o["position"] is not None]


def test_row_groups_hold_at_most_65536_rows(tmp_path: Path) -> None:
    n = 70_000
    entries = [SyncEntry(TxRecord(f"t{i:06d}", i, "dc1", i), 0, i, "committed") for i in range(n)]
    body = TxBody("t000000", (Operation("enqueue", "/q", "m"), Operation("dequeue", "/q", "m")))
    source = ExportSource(
        master="dc1",
        generation=0,
        members=frozenset({"dc1"}),
        split_recovery="smart",
        split=False,
        sync_offset=0,
        synchronised=entries,
        incoming=[],
        bodies={body.tx_id: body},
        events=[MasterEvent(1, "crash", 0, None, {}), MasterEvent(2, "diverged", 0, "dc2", {})],
    )
    folder = export(source, tmp_path, exported_ms=5)
    meta = pq.ParquetFile(folder / "synchronised.parquet").metadata
    assert meta.num_rows == n and all(meta.row_group(i).num_rows <= 65_536 for i in range(meta.num_row_groups))
    assert pq.read_table(folder / "operations.parquet").column("seq").to_pylist() == [0, 1]
    assert pq.read_table(folder / "events.parquet").column("kind").to_pylist() == ["crash"]  # not a contract kind
