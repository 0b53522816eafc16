"""Writing reports: ``report.json``, a self-contained ``report.html``, PNG plots.

All four commands produce the same shape of output so that a person (HTML)
and a program (JSON) read every report the same way. Nothing here touches
Spark: jobs hand over the small aggregates they collected.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: At most this many example rows of a finding go into report.json / HTML;
#: the full list is written as Parquet beside it by the job (via Spark).
SAMPLE_ROWS = 100


@dataclass
class Table:
    """A small table for the HTML report (already collected to the driver)."""

    headers: Sequence[str]
    rows: Sequence[Sequence[Any]]
    caption: str = ""


@dataclass
class Section:
    """One heading of the HTML report: paragraphs, tables and images, in that order."""

    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    images: list[str] = field(default_factory=list)  # file names relative to OUT
    status: str | None = None  # "ok" | "bad" | None, colours the heading


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "asDict"):  # a pyspark Row
        return _jsonable(value.asDict(recursive=True))
    return value


def write_json(out: Path, report: dict[str, Any], name: str = "report.json") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(_jsonable(report), indent=2, sort_keys=False) + "\n")
    return path


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:75em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;font-size:.9em}
th{background:#f2f2f2} caption{text-align:left;font-style:italic;padding:.2em 0}
h2.ok{color:#1a7f37} h2.bad{color:#b42318} img{max-width:100%;border:1px solid #eee}
code{background:#f5f5f5;padding:0 .2em}
"""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, (list, tuple)):
        return html.escape(", ".join(map(str, value)))
    return html.escape("" if value is None else str(value))


def write_html(
    out: Path, title: str, sections: Iterable[Section], name: str = "report.html"
) -> Path:
    """Write a single HTML page (CSS inline, images beside it)."""
    out.mkdir(parents=True, exist_ok=True)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for sec in sections:
        cls = f" class='{sec.status}'" if sec.status else ""
        parts.append(f"<h2{cls}>{html.escape(sec.title)}</h2>")
        parts.extend(f"<p>{html.escape(p)}</p>" for p in sec.paragraphs)
        for tab in sec.tables:
            parts.append("<table>")
            if tab.caption:
                parts.append(f"<caption>{html.escape(tab.caption)}</caption>")
            parts.append(
                "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in tab.headers) + "</tr>"
            )
            for row in tab.rows:
                parts.append("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>")
            parts.append("</table>")
        parts.extend(
            f"<p><img src='{html.escape(img)}' alt='{html.escape(img)}'></p>" for img in sec.images
        )
    parts.append("</body></html>")
    path = out / name
    path.write_text("\n".join(parts))
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display on servers or in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, out: Path, name: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    pyplot().close(fig)
    return name


def rows_table(
    rows: Sequence[dict[str, Any]], caption: str = "", columns: Sequence[str] | None = None
) -> Table:
    """A Table from a list of dicts (the shape the JSON report uses)."""
    columns = list(columns or (rows[0].keys() if rows else []))
    return Table(columns, [[r.get(c) for c in columns] for r in rows], caption)


def finding_section(title: str, count: int, sample: list[dict[str, Any]], explain: str) -> Section:
    """A section for one kind of finding: its count, its definition, sample rows."""
    paras = [explain, f"Found: {count}."]
    if count > len(sample):
        paras.append(f"Showing the first {len(sample)}; all rows are in the Parquet output.")
    tables = [rows_table(sample)] if sample else []
    return Section(title, paras, tables, status="bad" if count else "ok")
