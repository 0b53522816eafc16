"""Parquet export of a master's TxLog, exactly as docs/txlog-export.md (schema version 1) says.

The schema is a contract with the pipeline team: columns and types below are
fixed; a later version may only add nullable columns.  The export reads a
:class:`ExportSource`, which a live engine and a simulated master both produce.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from brokerha.txlog.engine.queues import SyncEntry
from brokerha.txlog.engine.records import MasterEvent, TxBody, TxRecord
from brokerha.txlog.master.export_schema import (
    EVENTS,
    INCOMING,
    OPERATIONS,
    ROW_GROUP_ROWS,
    SCHEMA_VERSION,
    SYNCHRONISED,
    place_operations,
)

if TYPE_CHECKING:
    from brokerha.txlog.engine.rounds import RoundEngine
    from brokerha.txlog.engine.state import DurableState

ROW_GROUP = ROW_GROUP_ROWS

EVENT_KINDS = frozenset(
    {"peer-dropped", "split-detected", "vote", "rejoin", "restore", "replay", "renegotiate", "crash", "restart"}
)


@dataclass
class ExportSource:
    """Everything one master's export needs, independent of how the master runs."""

    master: str
    generation: int
    members: frozenset[str]
    split_recovery: str
    split: bool
    sync_offset: int
    synchronised: list[SyncEntry]
    incoming: list[tuple[TxRecord, int]]  # record, acquired_ms
    bodies: dict[str, TxBody]
    events: list[MasterEvent]


def _table(schema: pa.Schema, rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def synchronised_rows(src: ExportSource) -> list[dict[str, Any]]:
    return [
        {
            "master": src.master,
            "position": src.sync_offset + i,
            "tx_id": e.record.tx_id,
            "timestamp": e.record.timestamp,
            "origin": e.record.origin,
            "generation": e.generation,
            "created_ms": e.record.created_ms,
            "ordered_ms": e.ordered_ms,
            "outcome": e.outcome,
            "replay_of": e.record.replay_of,
        }
        for i, e in enumerate(src.synchronised)
    ]


def incoming_rows(src: ExportSource) -> list[dict[str, Any]]:
    return [
        {
            "master": src.master,
            "tx_id": r.tx_id,
            "timestamp": r.timestamp,
            "origin": r.origin,
            "created_ms": r.created_ms,
            "acquired_ms": acquired,
        }
        for r, acquired in src.incoming
    ]


def operation_rows(bodies: Iterable[TxBody]) -> list[dict[str, Any]]:
    """One row per operation; ``position`` and the order are place_operations' work."""
    return [
        {"tx_id": b.tx_id, "seq": seq, "kind": op.kind, "queue": op.queue, "message_id": op.message_id}
        for b in bodies
        for seq, op in enumerate(b.operations)
    ]


def event_rows(src: ExportSource) -> list[dict[str, Any]]:
    return [
        {
            "master": src.master,
            "at_ms": e.at_ms,
            "kind": e.kind,
            "generation": e.generation,
            "peer": e.peer,
            "detail": json.dumps(e.detail, sort_keys=True),
        }
        for e in src.events
        if e.kind in EVENT_KINDS
    ]


def export(src: ExportSource, out_dir: Path | str, exported_ms: int) -> Path:
    """Write ``out_dir/<master>/`` with meta.json and the four Parquet files; returns the folder."""
    folder = Path(out_dir) / src.master
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "schema_version": SCHEMA_VERSION,
        "master": src.master,
        "exported_ms": exported_ms,
        "generation": src.generation,
        "members": sorted(src.members),
        "split_recovery": src.split_recovery,
        "split": src.split,
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    synchronised = _table(SYNCHRONISED, synchronised_rows(src))
    tables = {
        "synchronised.parquet": synchronised,
        "incoming.parquet": _table(INCOMING, incoming_rows(src)),
        "operations.parquet": place_operations(
            _table(OPERATIONS, operation_rows(src.bodies.values())), synchronised
        ),
        "events.parquet": _table(EVENTS, event_rows(src)),
    }
    for name, table in tables.items():
        pq.write_table(table, folder / name, row_group_size=ROW_GROUP)
    return folder


def source_for(
    durable: DurableState, engine: RoundEngine | None, events: Iterable[MasterEvent], master: str
) -> ExportSource:
    """Build the export of a master from its durable state and, if it is up, its engine.

    A master that is down exports only what survives a crash: its own
    unsynchronised transactions stand in for the incoming queue.
    """
    if engine is not None:
        incoming = [(r, engine.acquired_ms.get(r.tx_id, r.created_ms)) for r in engine.incoming.records()]
        bodies = {**engine.foreign_bodies, **durable.bodies}
    else:
        incoming = [(r, r.created_ms) for r in sorted(durable.own.values(), key=lambda r: r.key)]
        bodies = dict(durable.bodies)
    return ExportSource(
        master=master,
        generation=durable.generation,
        members=durable.members,
        split_recovery=durable.strategy.value,
        split=durable.split,
        sync_offset=durable.sync.offset.length,
        synchronised=list(durable.sync.entries),
        incoming=incoming,
        bodies=bodies,
        events=list(events),
    )
