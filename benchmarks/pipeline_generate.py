"""Generate synthetic TxLog exports (and a client history) for the pipeline benchmarks.

    python benchmarks/pipeline_generate.py --out /tmp/exp --masters 3 --txs 10000000 --diverge-at 9000000

Every master holds the same log up to ``--diverge-at``; after it the last
``--minority`` masters hold their own transactions (a split). Files follow
docs/txlog-export.md exactly: sorted by position (operations too), row groups of 65,536 rows,
26-character ids. Written chunk by chunk with pyarrow so 10 M rows per master
need little memory. Post-fork dequeues of the same messages on both sides
give replay-plan real conflicts to find.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from brokerha.pipeline.schema import (
    EVENTS,
    HISTORY,
    INCOMING,
    OPERATIONS,
    ROW_GROUP_ROWS,
    SYNCHRONISED,
    write_master_export,
)
from brokerha.txlog.master.export_schema import sort_operations

CHUNK = 1 << 20
QUEUE = "/bench"


def _ids(prefix: str, pos: np.ndarray, origin: pa.Array) -> pa.Array:
    """26-character ids: prefix + 19-digit position + '-' + origin ('dcN', padded to 5)."""
    digits = pc.utf8_lpad(pc.cast(pa.array(pos), pa.string()), width=19, padding="0")
    return pc.binary_join_element_wise(
        prefix, digits, "-", pc.utf8_rpad(origin, width=5, padding="_"), ""
    )


def _side_chunk(
    master: str,
    names: list[str],
    side: list[int],
    pos: np.ndarray,
    fork: int,
    rng: np.random.Generator,
) -> tuple[pa.Table, pa.Table]:
    """Synchronised rows and operations for positions ``pos`` of one master's log.

    ``side`` = indices of the masters on this master's side after the fork;
    before the fork every log is identical (ids do not depend on ``side``).
    """
    common = pos < fork
    # a tx's origin must be the same in every log holding it: derive it from the position
    pick = np.where(common, pos % len(names), np.asarray(side)[pos % len(side)])
    origin = pa.array(np.asarray(names, dtype=object)[pick], pa.string())
    minority = side[0] != 0
    prefix = pa.array(np.where(common, "T", "M" if minority else "T"), pa.string())
    tx = _ids(prefix, pos, origin)
    created = 1_700_000_000_000 + pos  # one tx per ms
    local = np.asarray(names, dtype=object)[pick] == master
    latency = (
        np.where(
            local, rng.lognormal(1.0, 0.5, pos.size), rng.lognormal(3.5, 0.6, pos.size)
        ).astype(np.int64)
        + 1
    )
    failed = rng.random(pos.size) < 0.001
    sync = pa.table(
        {
            "master": pa.array([master] * pos.size, pa.string()),
            "position": pa.array(pos, pa.int64()),
            "tx_id": tx,
            "timestamp": pa.array(pos + 1, pa.int64()),
            "origin": origin,
            "generation": pa.array(np.where(common, 1, 2).astype(np.int32)),
            "created_ms": pa.array(created, pa.int64()),
            "ordered_ms": pa.array(created + latency, pa.int64()),
            "outcome": pa.array(np.where(failed, "failed", "committed"), pa.string()),
            "replay_of": pa.nulls(pos.size, pa.string()),
        },
        schema=SYNCHRONISED,
    )
    msg = pc.binary_join_element_wise("m-", tx, "")
    enq = pa.table(
        {
            "tx_id": tx,
            "seq": pa.array(np.zeros(pos.size, np.int32)),
            "kind": pa.array(["enqueue"] * pos.size),
            "queue": pa.array([QUEUE] * pos.size),
            "message_id": msg,
            "position": pa.array(pos, pa.int64()),
        },
        schema=OPERATIONS,
    )
    # every 5th tx (every 3rd on the minority after the fork) consumes the message of tx pos//2
    every = np.where(common | (not minority), 5, 3)
    deq = (pos % every == 0) & (pos > 0)
    target = pos[deq] // 2
    t_origin = pa.array(np.asarray(names, dtype=object)[target % len(names)], pa.string())
    deq_tab = pa.table(
        {
            "tx_id": pc.filter(tx, pa.array(deq)),
            "seq": pa.array(np.ones(int(deq.sum()), np.int32)),
            "kind": pa.array(["dequeue"] * int(deq.sum())),
            "queue": pa.array([QUEUE] * int(deq.sum())),
            "message_id": pc.binary_join_element_wise(
                "m-", _ids(pa.array(["T"] * target.size), target, t_origin), ""
            ),
            "position": pa.array(pos[deq], pa.int64()),
        },
        schema=OPERATIONS,
    )
    return sync, sort_operations(pa.concat_tables([enq, deq_tab]))


def generate(
    out: Path,
    masters: int,
    txs: int,
    diverge_at: int | None,
    minority: int,
    seed: int,
    minority_txs: int | None,
) -> None:
    names = [f"dc{i + 1}" for i in range(masters)]
    fork = txs if diverge_at is None else diverge_at
    maj_side = list(range(masters - minority)) if diverge_at is not None else list(range(masters))
    min_side = list(range(masters - minority, masters)) if diverge_at is not None else []
    for i, name in enumerate(names):
        rng = np.random.default_rng(seed + i)
        on_minority = i in min_side
        length = (
            (fork + (minority_txs if minority_txs is not None else txs - fork))
            if on_minority
            else txs
        )
        folder = out / name
        write_master_export(
            out,
            name,
            meta={
                "members": names,
                "generation": 2 if diverge_at is not None else 1,
                "split_recovery": "simple",
                "split": diverge_at is not None,
                "exported_ms": 1_700_000_000_000 + txs,
            },
            events=[
                {
                    "master": name,
                    "at_ms": 1_700_000_000_000 + fork,
                    "kind": "split-detected",
                    "generation": 2,
                    "peer": names[0] if on_minority else names[-1],
                    "detail": "{}",
                }
            ]
            if diverge_at is not None
            else None,
        )
        side = min_side if on_minority else maj_side
        with (
            pq.ParquetWriter(folder / "synchronised.parquet", SYNCHRONISED) as sw,
            pq.ParquetWriter(folder / "operations.parquet", OPERATIONS) as ow,
        ):
            for start in range(0, length, CHUNK):
                pos = np.arange(start, min(length, start + CHUNK), dtype=np.int64)
                sync, ops = _side_chunk(name, names, side, pos, fork, rng)
                sw.write_table(sync, row_group_size=ROW_GROUP_ROWS)
                ow.write_table(ops, row_group_size=ROW_GROUP_ROWS)
        pq.write_table(INCOMING.empty_table(), folder / "incoming.parquet")
    _ = EVENTS  # schema used via write_master_export


def generate_history(path: Path, messages: int, anomalies: int, seed: int) -> None:
    """publish-confirmed / delivered / acked per message; ``anomalies`` lost, duplicated and half-visible cases."""
    rng = np.random.default_rng(seed)
    ids = pc.binary_join_element_wise("h-", pc.cast(pa.array(np.arange(messages)), pa.string()), "")
    t = np.arange(messages, dtype=np.int64) * 2
    in_tx = (np.arange(messages) // 4) % 2 == 1  # half the messages in 4-message transactions
    tx = pa.array(
        np.where(in_tx, np.char.add("T", (np.arange(messages) // 4).astype(str)), None), pa.string()
    )
    lost = np.zeros(messages, bool)
    lost[rng.choice(messages, anomalies, replace=False)] = True

    def rows(op: str, mask: np.ndarray, at: np.ndarray, **extra: pa.Array) -> pa.Table:
        n = int(mask.sum())
        cols = {
            "client": pa.array(["c1"] * n),
            "at_ms": pa.array(at[mask]),
            "op": pa.array([op] * n),
            "queue": pa.array([QUEUE] * n),
            "message_id": pc.filter(ids, pa.array(mask)),
            "tx_id": extra.get("tx_id", pa.nulls(n, pa.string())),
            "tx_size": pa.nulls(n, pa.int64()),
            "redelivered": extra.get("redelivered", pa.nulls(n, pa.bool_())),
        }
        return pa.table(cols, schema=HISTORY)

    every = np.ones(messages, bool)
    commits = in_tx & (np.arange(messages) % 4 == 3)
    commit_rows = pa.table(
        {
            "client": pa.array(["c1"] * int(commits.sum())),
            "at_ms": pa.array(t[commits]),
            "op": pa.array(["tx-committed"] * int(commits.sum())),
            "queue": pa.array([QUEUE] * int(commits.sum())),
            "message_id": pa.nulls(int(commits.sum()), pa.string()),
            "tx_id": pc.filter(tx, pa.array(commits)),
            "tx_size": pa.array(np.full(int(commits.sum()), 4)),
            "redelivered": pa.nulls(int(commits.sum()), pa.bool_()),
        },
        schema=HISTORY,
    )
    dup = np.zeros(messages, bool)
    dup[rng.choice(messages, anomalies, replace=False)] = True
    dup &= ~lost
    table = pa.concat_tables(
        [
            rows("publish-confirmed", every, t, tx_id=tx),
            commit_rows,
            rows(
                "delivered", ~lost, t + 10, redelivered=pa.array(np.zeros(int((~lost).sum()), bool))
            ),
            rows("acked", ~lost, t + 11),
            rows("delivered", dup, t + 20, redelivered=pa.array(np.zeros(int(dup.sum()), bool))),
        ]
    )
    pq.write_table(table, path, row_group_size=ROW_GROUP_ROWS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--masters", type=int, default=3)
    ap.add_argument("--txs", type=int, default=1_000_000, help="log length of the majority masters")
    ap.add_argument(
        "--diverge-at", type=int, default=None, help="fork position (default: no split)"
    )
    ap.add_argument(
        "--minority", type=int, default=1, help="masters on the minority side of the split"
    )
    ap.add_argument(
        "--minority-txs",
        type=int,
        default=None,
        help="post-fork length of the minority (default: same as majority)",
    )
    ap.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="MESSAGES",
        help="also write OUT/history.parquet with this many messages",
    )
    ap.add_argument(
        "--anomalies",
        type=int,
        default=10,
        help="lost / duplicated messages injected into the history",
    )
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    generate(
        args.out / "exports",
        args.masters,
        args.txs,
        args.diverge_at,
        args.minority,
        args.seed,
        args.minority_txs,
    )
    if args.history:
        generate_history(args.out / "history.parquet", args.history, args.anomalies, args.seed)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({size / 2**20:,.0f} MiB) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
