"""Helpers for turning a (possibly large) result DataFrame into report material.

A finding such as "transactions to replay" can be millions of rows after a
long split, so it is never collected: it is written as Parquet by the
executors, and the driver reads back only its row count (from Parquet
metadata) and the first ``SAMPLE_ROWS`` rows for the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from brokerha.pipeline.report import SAMPLE_ROWS

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def materialise(
    df: DataFrame, path: Path, order_by: list[str], sample: int = SAMPLE_ROWS
) -> tuple[int, list[dict[str, Any]]]:
    """Write ``df`` to ``path`` (Parquet dir); return (row count, first rows by ``order_by``).

    Findings are usually fewer than a sample: then the sample is all of them
    and no separate count runs.
    """
    df.write.mode("overwrite").parquet(str(path))
    back = read_back(df, path)
    rows = [r.asDict(recursive=True) for r in back.orderBy(*order_by).limit(sample).collect()]
    return (len(rows) if len(rows) < sample else back.count()), rows


def read_back(df: DataFrame, path: Path) -> DataFrame:
    """The rows ``materialise`` wrote from ``df`` to ``path``, read with ``df``'s schema
    (so no job runs to read the schema from a file footer)."""
    return df.sparkSession.read.schema(df.schema).parquet(str(path))


#: A key set up to this many rows is broadcast to the join that re-reads its
#: rows (no shuffle of the big side); larger sets are joined by shuffling.
BROADCAST_ROWS = 1_000_000


def few(keys: DataFrame) -> DataFrame:
    """``keys`` with a broadcast hint when it is small (counted: keep it cheap to compute).

    Findings are usually few (lost messages, conflicts...) but need not be:
    a run that did not drain its queues loses millions, and a forced
    broadcast of millions of ids would exhaust the driver.
    """
    from pyspark.sql import functions as F

    return F.broadcast(keys) if keys.count() <= BROADCAST_ROWS else keys


def json_field(column: str, field: str, spark_type: str) -> Any:
    """Column expression: one field of a JSON string column (events.detail)."""
    from pyspark.sql import functions as F

    return F.from_json(F.col(column), f"struct<{field}: {spark_type}>")[field]
