"""``brokerha pipeline stats``: how fast did transactions commit and agree?

Per DC (= per master's synchronised log):

* **committed tx/s over time**: rows with outcome ``committed`` bucketed by
  ``ordered_ms`` (bucket width chosen so a run gives at most ~``MAX_BUCKETS``
  points);
* **commit latency**: ``ordered_ms - created_ms`` for the transactions that
  *originated* at this DC -- both clocks are the origin's, and a transaction
  with dequeues is confirmed to its client once ordered (enqueue-only ones
  may be confirmed earlier, at acquisition, so this is an upper bound);
* **agreement latency**: ``ordered_ms - created_ms`` for every transaction in
  this DC's log -- how long until this DC held it in the agreed order. For
  foreign transactions this mixes two DCs' clocks (skew included).

Percentiles are ``percentile_approx`` aggregates: one pass, a few numbers per
DC back to the driver.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from brokerha.pipeline.inputs import Inputs
from brokerha.pipeline.report import Section, Table, pyplot, save_figure, write_html, write_json

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PERCENTILES = (0.5, 0.9, 0.99, 0.999)
MAX_BUCKETS = 600
_NICE_MS = (
    1_000,
    2_000,
    5_000,
    10_000,
    30_000,
    60_000,
    300_000,
    600_000,
    1_800_000,
    3_600_000,
    21_600_000,
    86_400_000,
)


def main(spark: SparkSession, args: argparse.Namespace) -> dict[str, Any]:
    """CLI entry: ``--input DIR --out OUT``."""
    return run(Inputs.load(spark, args.input), args.out)


def bucket_width(span_ms: int) -> int:
    """Smallest 'nice' width (>= 1 s) giving at most MAX_BUCKETS buckets."""
    for width in _NICE_MS:
        if span_ms / width <= MAX_BUCKETS:
            return width
    return -(-span_ms // MAX_BUCKETS)


def run(inputs: Inputs, out: Path) -> dict[str, Any]:
    from pyspark.sql import functions as F

    sync = inputs.sync.filter(F.col("outcome").isNotNull())
    latency = (F.col("ordered_ms") - F.col("created_ms")).cast("double")
    local = F.col("origin") == F.col("master")
    pct = list(PERCENTILES)
    per_dc = {
        r["master"]: r.asDict()
        for r in sync.groupBy("master")
        .agg(
            F.count(F.lit(1)).alias("applied"),
            F.count(F.when(F.col("outcome") == "committed", 1)).alias("committed"),
            F.count(F.when(F.col("outcome") == "failed", 1)).alias("failed"),
            F.count(F.when(local, 1)).alias("originated"),
            F.min("ordered_ms").alias("first_ms"),
            F.max("ordered_ms").alias("last_ms"),
            F.percentile_approx(F.when(local, latency), pct, 10_000).alias("commit_pct"),
            F.max(F.when(local, latency)).alias("commit_max"),
            F.percentile_approx(latency, pct, 10_000).alias("agree_pct"),
            F.max(latency).alias("agree_max"),
        )
        .collect()
    }
    incoming = {
        r["master"]: r["n"]
        for r in inputs.table("incoming")
        .groupBy("master")
        .agg(F.count(F.lit(1)).alias("n"))
        .collect()
    }
    dcs = []
    for name in inputs.names:
        r = per_dc.get(name, {})
        dcs.append(
            {
                "master": name,
                "applied": r.get("applied", 0),
                "committed": r.get("committed", 0),
                "failed": r.get("failed", 0),
                "originated": r.get("originated", 0),
                "incoming_backlog": incoming.get(name, 0),
                "commit_latency_ms": _pcts(r.get("commit_pct"), r.get("commit_max")),
                "agreement_latency_ms": _pcts(r.get("agree_pct"), r.get("agree_max")),
            }
        )

    starts = [r["first_ms"] for r in per_dc.values() if r["first_ms"] is not None]
    ends = [r["last_ms"] for r in per_dc.values() if r["last_ms"] is not None]
    series: dict[str, list[tuple[int, float]]] = {}
    width = 1000
    if starts:
        t0, width = min(starts), bucket_width(max(ends) - min(starts) + 1)
        rows = (
            sync.filter(F.col("outcome") == "committed")
            .groupBy(
                "master", F.floor((F.col("ordered_ms") - F.lit(t0)) / F.lit(width)).alias("bucket")
            )
            .agg(F.count(F.lit(1)).alias("n"))
            .collect()
        )
        for r in sorted(rows, key=lambda r: (r["master"], r["bucket"])):
            series.setdefault(r["master"], []).append(
                (t0 + int(r["bucket"]) * width, r["n"] * 1000.0 / width)
            )
    total_committed = sum(d["committed"] for d in dcs)
    report = {
        "command": "stats",
        "ok": True,
        "summary": f"{len(dcs)} DCs, {total_committed} committed rows in all logs",
        "input": str(inputs.root),
        "masters": inputs.names,
        "percentiles": pct,
        "dcs": dcs,
        "throughput": {
            "bucket_ms": width,
            "series": {
                m: [{"t_ms": t, "tx_per_s": v} for t, v in pts] for m, pts in series.items()
            },
        },
    }
    write_json(out, report)
    images = [_plot_throughput(out, series, width), _plot_latency(out, dcs)]
    write_html(out, "TxLog stats", _sections(report, [i for i in images if i]))
    return report


def _pcts(values: list[float] | None, peak: float | None) -> dict[str, float | None]:
    keys = [f"p{str(p * 100).rstrip('0').rstrip('.')}" for p in PERCENTILES]
    return {**dict(zip(keys, values or [None] * len(keys), strict=True)), "max": peak}


def _plot_throughput(
    out: Path, series: dict[str, list[tuple[int, float]]], width: int
) -> str | None:
    if not series:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    t0 = min(pts[0][0] for pts in series.values())
    for master, pts in sorted(series.items()):
        ax.plot([(t - t0) / 1000 for t, _ in pts], [v for _, v in pts], label=master, linewidth=1)
    ax.set_xlabel(f"seconds since first ordered transaction ({width / 1000:g} s buckets)")
    ax.set_ylabel("committed tx/s")
    ax.legend()
    return save_figure(fig, out, "throughput.png")


def _plot_latency(out: Path, dcs: list[dict[str, Any]]) -> str | None:
    if not any(d["applied"] for d in dcs):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, key, title in (
        (axes[0], "commit_latency_ms", "commit (own transactions)"),
        (axes[1], "agreement_latency_ms", "agreement (all transactions)"),
    ):
        labels = [k for k in dcs[0][key] if k != "max"]
        step = 0.8 / max(1, len(dcs))
        for i, d in enumerate(dcs):
            vals = [d[key][k] or 0 for k in labels]
            ax.bar([j + i * step for j in range(len(labels))], vals, width=step, label=d["master"])
        ax.set_xticks([j + 0.4 - step / 2 for j in range(len(labels))], labels)
        ax.set_title(title)
        ax.set_ylabel("ms")
    axes[1].legend()
    return save_figure(fig, out, "latency.png")


def _sections(report: dict[str, Any], images: list[str]) -> list[Section]:
    rows = []
    for d in report["dcs"]:
        c, a = d["commit_latency_ms"], d["agreement_latency_ms"]
        rows.append(
            [
                d["master"],
                d["committed"],
                d["failed"],
                d["originated"],
                d["incoming_backlog"],
                *c.values(),
                *a.values(),
            ]
        )
    keys = list(report["dcs"][0]["commit_latency_ms"]) if report["dcs"] else []
    headers = (
        ["DC", "committed", "failed", "originated", "incoming"]
        + [f"commit {k}" for k in keys]
        + [f"agree {k}" for k in keys]
    )
    return [
        Section(
            "Summary",
            [
                report["summary"] + ".",
                "Latencies in ms; commit = own transactions, agreement = all.",
            ],
            [Table(headers, rows)],
        ),
        Section("Plots", images=images),
    ]
