"""``brokerha pipeline audit``: do all masters hold the same synchronised log?

Answers, for every master's export: is every pair of synchronised logs equal
or one a prefix of the other (the TxLog safety invariant); if not, at which
position each diverging pair forks and with which transactions; and which log
the majority holds. The report's ``consistent`` / ``masters`` /
``divergences`` keys are an interface other tools rely on (issue 8).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from brokerha.pipeline.inputs import Inputs
from brokerha.pipeline.logs import BLOCK, LogAnalysis, analyse
from brokerha.pipeline.report import (
    Section,
    Table,
    pyplot,
    rows_table,
    save_figure,
    write_html,
    write_json,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def main(spark: SparkSession, args: argparse.Namespace) -> dict[str, Any]:
    """CLI entry: ``--input DIR --out OUT``."""
    return run(Inputs.load(spark, args.input), args.out)


def run(inputs: Inputs, out: Path) -> dict[str, Any]:
    """Run the audit and write ``OUT/report.json``, ``report.html`` and ``logs.png``."""
    analysis = analyse(inputs.sync, inputs.names)
    report = build_report(inputs, analysis)
    write_json(out, report)
    image = plot_logs(out, analysis)
    write_html(out, "TxLog audit", sections(report, image))
    return report


def build_report(inputs: Inputs, analysis: LogAnalysis) -> dict[str, Any]:
    logs = []
    for m in inputs.masters:
        s = analysis.summaries[m.name]
        logs.append(
            {
                "master": m.name,
                "length": s.length,
                "rows": s.rows,
                "generation": m.meta.get("generation"),
                "split": m.meta.get("split"),
                "split_recovery": m.split_recovery,
            }
        )
    divergences = [p.as_dict() for p in analysis.divergences]
    maj = analysis.majority
    return {
        "command": "audit",
        "ok": not divergences and not analysis.problems,
        "summary": (
            f"{len(inputs.names)} masters, "
            + ("consistent" if not divergences else f"{len(divergences)} diverging pair(s)")
            + (f", majority log {maj.master} ({maj.length} positions)" if maj else "")
        ),
        "input": str(inputs.root),
        "masters": inputs.names,
        "consistent": not divergences,
        "divergences": divergences,
        "majority": analysis.majority.as_dict() if analysis.majority else None,
        "logs": logs,
        "pairs": [p.as_dict() for p in analysis.pairs],
        "problems": analysis.problems,
        "block_size": BLOCK,
    }


def plot_logs(out: Path, analysis: LogAnalysis) -> str | None:
    """Bar per master (log length), coloured majority/minority, forks marked."""
    if not analysis.summaries:
        return None
    plt = pyplot()
    names = sorted(analysis.summaries)
    minority = set(analysis.majority.minority) if analysis.majority else set()
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(names)))
    ax.barh(
        names,
        [analysis.summaries[n].length for n in names],
        color=["#d1495b" if n in minority else "#2e86ab" for n in names],
    )
    for pos in sorted({p.position for p in analysis.divergences if p.position is not None}):
        ax.axvline(pos, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"fork @ {pos:,}", (pos, len(names) - 0.5), fontsize=8, ha="left")
    ax.set_xlabel("synchronised log length (positions); red = outside the majority")
    ax.invert_yaxis()
    return save_figure(fig, out, "logs.png")


def sections(report: dict[str, Any], image: str | None) -> list[Section]:
    maj = report["majority"]
    summary = Section(
        "Consistent" if report["consistent"] else "NOT consistent",
        [
            f"{len(report['masters'])} masters: {', '.join(report['masters'])}.",
            "Every pair of synchronised logs is equal or one is a prefix of the other."
            if report["consistent"]
            else f"{len(report['divergences'])} pair(s) of logs diverge.",
        ],
        status="ok" if report["consistent"] else "bad",
    )
    if maj:
        summary.paragraphs.append(
            f"Majority log: {maj['master']} ({maj['length']:,} positions), supported by "
            f"{', '.join(maj['supporters'])}{'' if maj['strict'] else ' (NOT a strict majority)'}; "
            f"minority: {', '.join(maj['minority']) or 'none'}."
        )
    out = [summary]
    if report["divergences"]:
        out.append(
            Section(
                "Divergences",
                ["Position = first position where the two logs hold different transactions."],
                [
                    rows_table(
                        report["divergences"],
                        columns=["a", "b", "position", "a_tx", "b_tx", "a_length", "b_length"],
                    )
                ],
                status="bad",
            )
        )
    out.append(
        Section("Logs", tables=[rows_table(report["logs"])], images=[image] if image else [])
    )
    out.append(
        Section(
            "All pairs",
            tables=[
                Table(
                    ["a", "b", "relation", "position"],
                    [[p["a"], p["b"], p["relation"], p["position"]] for p in report["pairs"]],
                )
            ],
        )
    )
    if report["problems"]:
        out.append(Section("Malformed exports", report["problems"], status="bad"))
    return out
