"""The TxLog export schema (docs/txlog-export.md), shared by the exporter and the pipeline.

One definition of the contract: ``brokerha.txlog.master.export`` writes these
tables and ``brokerha.pipeline`` reads them.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

#: 2: operations carry ``position`` and are sorted by it (version 1 had neither).
SCHEMA_VERSION = 2
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
        ("position", pa.int64()),
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


def sort_operations(operations: pa.Table) -> pa.Table:
    """Operations in the contract's order: by ``position`` (null last), ``tx_id``, ``seq``.

    A reader then skips, by row-group statistics on ``position``, the bodies
    of transactions before a position (as on the synchronised queue).
    """
    return operations.sort_by(
        [("position", "ascending"), ("tx_id", "ascending"), ("seq", "ascending")]
    )


def place_operations(operations: pa.Table, synchronised: pa.Table) -> pa.Table:
    """``operations`` with each row's ``position`` = its transaction's position in
    ``synchronised`` (null when the transaction is not in it), sorted (sort_operations)."""
    where = pc.index_in(operations["tx_id"], value_set=synchronised["tx_id"])
    positions = pc.take(synchronised["position"], where)
    column = operations.schema.get_field_index("position")
    return sort_operations(operations.set_column(column, OPERATIONS.field("position"), positions))
