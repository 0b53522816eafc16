"""Small hand-made TxLog exports and client histories with known answers.

Transaction ids are ``<origin>-<n>`` so a reader of a failing test sees at a
glance where each transaction came from; every transaction enqueues the
message ``m-<tx_id>`` and may dequeue earlier messages.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from brokerha.pipeline.schema import write_history, write_master_export

QUEUE = "/orders"


def sync_rows(
    master: str,
    tx_ids: Sequence[str],
    *,
    failed: Sequence[str] = (),
    replay_of: dict[str, str] | None = None,
    generation: int = 1,
) -> list[dict[str, Any]]:
    """Synchronised rows for ``tx_ids`` in order; created every 10 ms, ordered
    3 ms later at the origin and 20 ms later elsewhere."""
    rows = []
    for pos, tx in enumerate(tx_ids):
        origin = tx.split("-")[0]
        created = 1_000 + 10 * pos
        rows.append(
            {
                "master": master,
                "position": pos,
                "tx_id": tx,
                "timestamp": pos + 1,
                "origin": origin,
                "generation": generation,
                "created_ms": created,
                "ordered_ms": created + (3 if origin == master else 20),
                "outcome": "failed" if tx in failed else "committed",
                "replay_of": (replay_of or {}).get(tx),
            }
        )
    return rows


def ops_rows(tx_ids: Sequence[str], dequeues: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Each tx enqueues ``m-<tx>``; ``dequeues`` maps tx -> message it consumes."""
    rows = []
    for tx in tx_ids:
        rows.append(
            {"tx_id": tx, "seq": 0, "kind": "enqueue", "queue": QUEUE, "message_id": f"m-{tx}"}
        )
        if dequeues and tx in dequeues:
            rows.append(
                {
                    "tx_id": tx,
                    "seq": 1,
                    "kind": "dequeue",
                    "queue": QUEUE,
                    "message_id": dequeues[tx],
                }
            )
    return rows


def event(
    master: str,
    kind: str,
    at_ms: int,
    detail: dict[str, Any] | None = None,
    peer: str | None = None,
) -> dict[str, Any]:
    return {
        "master": master,
        "at_ms": at_ms,
        "kind": kind,
        "generation": 2,
        "peer": peer,
        "detail": json.dumps(detail or {}),
    }


COMMON = [f"dc{1 + i % 3}-{i}" for i in range(10)]
MAJORITY_TAIL = ["dc1-100", "dc2-101", "dc1-102", "dc2-103", "dc1-104"]
MINORITY_TAIL = ["dc3-200", "dc3-201", "dc3-202"]
#: after the fork both sides consume messages of the common prefix; m-dc1-3 on both
MAJ_DEQ = {"dc2-101": "m-dc1-3", "dc1-102": "m-dc3-5"}
MIN_DEQ = {"dc3-200": "m-dc1-3", "dc3-201": "m-dc2-4"}
FORK = len(COMMON)


def write_consistent(root: Path, lag: int = 3) -> Path:
    """Three masters, no split: dc3 lags ``lag`` transactions behind (a prefix)."""
    log = COMMON + MAJORITY_TAIL
    ops = ops_rows(log, MAJ_DEQ)
    for master, n in (("dc1", len(log)), ("dc2", len(log)), ("dc3", len(log) - lag)):
        write_master_export(
            root,
            master,
            synchronised=sync_rows(master, log[:n]),
            operations=ops,
            meta={"members": ["dc1", "dc2", "dc3"]},
        )
    return root


def write_split(root: Path, *, recovered_events: bool = False, wrong_replay: bool = False) -> Path:
    """dc1+dc2 (majority) and dc3 (minority) forked at position FORK.

    With ``recovered_events`` dc3's export also records a rejoin and a replay
    (as if the export was taken during recovery); ``wrong_replay`` makes that
    replay miss one transaction and the rejoin name the wrong common prefix.
    """
    maj_log = COMMON + MAJORITY_TAIL
    min_log = COMMON + MINORITY_TAIL
    ops = ops_rows(COMMON + MAJORITY_TAIL + MINORITY_TAIL, {**MAJ_DEQ, **MIN_DEQ})
    members = {"members": ["dc1", "dc2", "dc3"], "split_recovery": "simple", "split": True}
    for master in ("dc1", "dc2"):
        write_master_export(
            root, master, synchronised=sync_rows(master, maj_log), operations=ops, meta=members
        )
    events = [event("dc3", "split-detected", 1_100, peer="dc1")]
    if recovered_events:
        replayed = MAJORITY_TAIL[:-1] if wrong_replay else MAJORITY_TAIL
        events += [
            event(
                "dc3",
                "rejoin",
                2_000,
                {"winner": "dc1", "common_prefix": FORK + 1 if wrong_replay else FORK},
            ),
            event("dc3", "replay", 2_001, {"tx_ids": replayed}),
        ]
    write_master_export(
        root,
        "dc3",
        synchronised=sync_rows("dc3", min_log),
        operations=ops,
        events=events,
        meta=members,
    )
    return root


def as_version_1(root: Path) -> Path:
    """Rewrite every export under ``root`` as schema version 1 wrote it: operations
    without ``position``, sorted by transaction id."""
    for folder in root.iterdir():
        ops = pq.read_table(folder / "operations.parquet").drop_columns(["position"])
        pq.write_table(
            ops.sort_by([("tx_id", "ascending"), ("seq", "ascending")]),
            folder / "operations.parquet",
        )
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, "schema_version": 1}))
    return root


def history_ok() -> list[dict[str, Any]]:
    """Clean history: 3 plain publishes and a 2-message transaction, all delivered and acked once."""
    rows: list[dict[str, Any]] = []
    for i in range(3):
        rows.append(
            {
                "client": "p1",
                "at_ms": 10 + i,
                "op": "publish-confirmed",
                "queue": QUEUE,
                "message_id": f"p{i}",
            }
        )
    for i in range(2):
        rows.append(
            {
                "client": "p2",
                "at_ms": 20,
                "op": "publish-confirmed",
                "queue": QUEUE,
                "message_id": f"t{i}",
                "tx_id": "T1",
            }
        )
    rows.append(
        {
            "client": "p2",
            "at_ms": 21,
            "op": "tx-committed",
            "queue": QUEUE,
            "tx_id": "T1",
            "tx_size": 2,
        }
    )
    for i, mid in enumerate(["p0", "p1", "p2", "t0", "t1"]):
        rows.append(
            {
                "client": "c1",
                "at_ms": 100 + 2 * i,
                "op": "delivered",
                "queue": QUEUE,
                "message_id": mid,
                "redelivered": False,
            }
        )
        rows.append(
            {"client": "c1", "at_ms": 101 + 2 * i, "op": "acked", "queue": QUEUE, "message_id": mid}
        )
    return rows


def write_history_file(path: Path, rows: list[dict[str, Any]]) -> Path:
    return write_history(path, rows)
