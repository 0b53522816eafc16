"""The TxLog export schema (docs/txlog-export.md), shared by the exporter and the pipeline.

One definition of the contract: ``brokerha.txlog.master.export`` writes these
tables and ``brokerha.pipeline`` reads them.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
#: The contract caps row groups at 65,536 rows so that min/max statistics on
#: `position` let a reader skip everything outside one block.
ROW_GROUP_ROWS = 65_536

SYNCHRONISED = pa.schema(
    [
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
    ]
)

INCOMING = pa.schema(
    [
        ("master", pa.string()),
        ("tx_id", pa.string()),
        ("timestamp", pa.int64()),
        ("origin", pa.string()),
        ("created_ms", pa.int64()),
        ("acquired_ms", pa.int64()),
    ]
)

OPERATIONS = pa.schema(
    [
        ("tx_id", pa.string()),
        ("seq", pa.int32()),
        ("kind", pa.string()),
        ("queue", pa.string()),
        ("message_id", pa.string()),
    ]
)

EVENTS = pa.schema(
    [
        ("master", pa.string()),
        ("at_ms", pa.int64()),
        ("kind", pa.string()),
        ("generation", pa.int32()),
        ("peer", pa.string()),
        ("detail", pa.string()),
    ]
)
