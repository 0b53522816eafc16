"""The TxLog export schema (docs/txlog-export.md, version 2) as pyarrow schemas.

Kept in one place so that the test fixtures, the benchmark generator and any
other writer produce exactly the columns and types the contract names; the
Spark jobs read by column name and never rely on anything not listed here.
This module imports only pyarrow (a core dependency), never pyspark.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from brokerha.txlog.master.export_schema import (  # the export contract, re-exported here
    EVENTS,
    INCOMING,
    OPERATIONS,
    ROW_GROUP_ROWS,
    SCHEMA_VERSION,
    SYNCHRONISED,
    place_operations,
)

#: Export versions the pipeline reads. Version 1's operations have no
#: ``position`` (read as null: replay-plan then reads every body, not only
#: those after the fork) and are not sorted by it.
READABLE_VERSIONS = (1, SCHEMA_VERSION)

HISTORY = pa.schema(
    [
        ("client", pa.string()),
        ("at_ms", pa.int64()),
        ("op", pa.string()),
        ("queue", pa.string()),
        ("message_id", pa.string()),
        ("tx_id", pa.string()),
        ("tx_size", pa.int64()),
        ("redelivered", pa.bool_()),
    ]
)

#: file stem -> schema, for the four per-master tables.
TABLES: dict[str, pa.Schema] = {
    "synchronised": SYNCHRONISED,
    "incoming": INCOMING,
    "operations": OPERATIONS,
    "events": EVENTS,
}

TableData = pa.Table | Sequence[Mapping[str, Any]] | None


def to_table(data: TableData, schema: pa.Schema) -> pa.Table:
    """Turn rows (dicts) or a table into a table of exactly ``schema``.

    Missing nullable keys become nulls, so fixtures only spell out what a test
    is about.
    """
    if data is None:
        return schema.empty_table()
    if isinstance(data, pa.Table):
        return data.select(schema.names).cast(schema)
    columns = {name: [row.get(name) for row in data] for name in schema.names}
    return pa.table(columns, schema=schema)


def write_master_export(
    root: Path | str,
    master: str,
    *,
    synchronised: TableData = None,
    incoming: TableData = None,
    operations: TableData = None,
    events: TableData = None,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write one ``<root>/<master>/`` export folder as the contract lays it out.

    ``synchronised`` is sorted by position before writing and each operation
    gets its transaction's position in it (place_operations), as the exporter
    does: readers rely on both for row-group skipping.
    """
    folder = Path(root) / master
    folder.mkdir(parents=True, exist_ok=True)
    sync = to_table(synchronised, SYNCHRONISED).sort_by("position")
    tables = {
        "synchronised": sync,
        "incoming": to_table(incoming, INCOMING),
        "operations": place_operations(to_table(operations, OPERATIONS), sync),
        "events": to_table(events, EVENTS),
    }
    for stem, table in tables.items():
        pq.write_table(table, folder / f"{stem}.parquet", row_group_size=ROW_GROUP_ROWS)
    full_meta = {
        "schema_version": SCHEMA_VERSION,
        "master": master,
        "exported_ms": 0,
        "generation": 0,
        "members": [master],
        "split_recovery": "simple",
        "split": False,
    }
    full_meta.update(meta or {})
    (folder / "meta.json").write_text(json.dumps(full_meta, indent=2))
    return folder


def write_history(path: Path | str, rows: TableData) -> Path:
    """Write a client history as JSON lines (``.jsonl``) or Parquet (otherwise)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = to_table(rows, HISTORY)
    if path.suffix in (".jsonl", ".json"):
        with path.open("w") as fh:
            for row in table.to_pylist():
                fh.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
    else:
        pq.write_table(table, path)
    return path
