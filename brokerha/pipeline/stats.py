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
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from brokerha.pipeline.inputs import Inputs
from brokerha.pipeline.report import Section, Table, pyplot, save_figure, write_html, write_json

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

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
    pct = list(PERCENTILES)
    per_dc = _per_dc(sync)
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


def _per_dc(sync: DataFrame) -> dict[str, dict[str, Any]]:
    """Counts, first/last ordered_ms and latency percentiles per master, in one aggregation.

    Latencies are whole milliseconds, so the aggregation keeps a histogram
    (master, own-origin?, latency) -> rows: thousands of rows however long
    the logs, from one hash aggregation (percentile_approx instead keeps a
    quantile sketch per group and was most of this job's time). The driver
    reads exact percentiles off the histogram.
    """
    from pyspark.sql import functions as F

    local = F.coalesce(F.col("origin") == F.col("master"), F.lit(False))
    hist = (
        sync.groupBy(
            "master",
            local.alias("local"),
            (F.col("ordered_ms") - F.col("created_ms")).alias("latency"),
        )
        .agg(
            F.count(F.lit(1)).alias("n"),
            F.count(F.when(F.col("outcome") == "committed", 1)).alias("committed"),
            F.count(F.when(F.col("outcome") == "failed", 1)).alias("failed"),
            F.min("ordered_ms").alias("first_ms"),
            F.max("ordered_ms").alias("last_ms"),
        )
        .collect()
    )
    groups: dict[str, list[Any]] = {}
    for r in hist:
        groups.setdefault(r["master"], []).append(r)
    out = {}
    for master, rows in groups.items():
        own = {r["latency"]: r["n"] for r in rows if r["local"] and r["latency"] is not None}
        every: dict[int, int] = {}
        for r in rows:
            if r["latency"] is not None:
                every[r["latency"]] = every.get(r["latency"], 0) + r["n"]
        firsts = [r["first_ms"] for r in rows if r["first_ms"] is not None]
        lasts = [r["last_ms"] for r in rows if r["last_ms"] is not None]
        out[master] = {
            "applied": sum(r["n"] for r in rows),
            "committed": sum(r["committed"] for r in rows),
            "failed": sum(r["failed"] for r in rows),
            "originated": sum(r["n"] for r in rows if r["local"]),
            "first_ms": min(firsts) if firsts else None,
            "last_ms": max(lasts) if lasts else None,
            "commit_pct": percentiles(own, PERCENTILES),
            "commit_max": float(max(own)) if own else None,
            "agree_pct": percentiles(every, PERCENTILES),
            "agree_max": float(max(every)) if every else None,
        }
    return out


def percentiles(histogram: dict[int, int], qs: Sequence[float]) -> list[float] | None:
    """Nearest-rank percentiles of a value -> count histogram: the value at rank ceil(q * n).

    The same definition as Spark's ``percentile_approx`` when its sketch is
    exact (the smallest value with at least q of all values at or below it).
    """
    n = sum(histogram.values())
    if not n:
        return None
    values = sorted(histogram)
    out = []
    for q in qs:
        rank, seen = max(1, math.ceil(q * n)), 0
        for v in values:
            seen += histogram[v]
            if seen >= rank:
                out.append(float(v))
                break
    return out


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
