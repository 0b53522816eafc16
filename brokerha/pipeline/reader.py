"""Find TxLog exports on disk and read them as Spark DataFrames.

Every job reads through here so that the contract's quirks are handled once:
``DIR`` may be one master's folder or a directory of ``<master>/`` folders, a
table may be a single Parquet file or a directory of part files, and columns
are cast to the contract's types (a later schema version may add columns,
which are ignored here). Discovery only touches the local/driver filesystem;
the data itself is read by Spark executors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from brokerha.pipeline import schema as S

if TYPE_CHECKING:  # pyspark is imported only inside functions that run jobs
    from pyspark.sql import DataFrame, SparkSession


class ExportError(Exception):
    """The input does not look like a TxLog export this pipeline understands."""


@dataclass(frozen=True)
class MasterExport:
    """One ``<master>/`` folder: its id, location and meta.json."""

    name: str
    folder: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def split_recovery(self) -> str:
        return str(self.meta.get("split_recovery", "unknown")).lower()


def _is_export(folder: Path) -> bool:
    return (folder / "meta.json").is_file() or (folder / "synchronised.parquet").exists()


def discover(root: Path | str) -> list[MasterExport]:
    """List the master exports under ``root`` (itself one, or its sub-folders)."""
    root = Path(root)
    if not root.is_dir():
        raise ExportError(f"{root}: not a directory")
    folders = (
        [root]
        if _is_export(root)
        else sorted(p for p in root.iterdir() if p.is_dir() and _is_export(p))
    )
    if not folders:
        raise ExportError(
            f"{root}: no TxLog export (no <master>/meta.json or synchronised.parquet)"
        )
    masters: list[MasterExport] = []
    for folder in folders:
        meta: dict[str, Any] = {}
        if (folder / "meta.json").is_file():
            meta = json.loads((folder / "meta.json").read_text())
            version = meta.get("schema_version", S.SCHEMA_VERSION)
            if version != S.SCHEMA_VERSION:
                raise ExportError(
                    f"{folder}: schema_version {version} is not supported (this pipeline reads {S.SCHEMA_VERSION})"
                )
        masters.append(MasterExport(str(meta.get("master", folder.name)), folder, meta))
    names = [m.name for m in masters]
    if len(set(names)) != len(names):
        raise ExportError(f"{root}: the same master id appears twice: {sorted(names)}")
    return masters


_SPARK_TYPES = {
    pa.string(): "string",
    pa.int64(): "bigint",
    pa.int32(): "int",
    pa.bool_(): "boolean",
}


def spark_schema(arrow_schema: pa.Schema) -> Any:
    """The Spark StructType matching one of the contract's pyarrow schemas."""
    from pyspark.sql.types import _parse_datatype_string

    ddl = ", ".join(f"`{f.name}` {_SPARK_TYPES[f.type]}" for f in arrow_schema)
    return _parse_datatype_string(ddl)


def conform(df: DataFrame, arrow_schema: pa.Schema) -> DataFrame:
    """Select exactly the contract's columns with the contract's types.

    Casting here (rather than trusting each writer) makes int32/int64 or a
    missing nullable column in some writer's output a non-event.
    """
    from pyspark.sql import functions as F

    present = set(df.columns)
    cols = []
    for f in arrow_schema:
        typ = _SPARK_TYPES[f.type]
        col = F.col(f"`{f.name}`") if f.name in present else F.lit(None)
        cols.append(col.cast(typ).alias(f.name))
    return df.select(*cols)


def read_table(spark: SparkSession, masters: list[MasterExport], stem: str) -> DataFrame:
    """Read ``<master>/<stem>.parquet`` (file or part directory) of every master as one DataFrame.

    A master whose file is missing simply contributes no rows; callers that
    need a table (synchronised) check that themselves.
    """
    arrow_schema = S.TABLES[stem]
    paths = [
        str(m.folder / f"{stem}.parquet")
        for m in masters
        if (m.folder / f"{stem}.parquet").exists()
    ]
    if not paths:
        return spark.createDataFrame([], spark_schema(arrow_schema))
    return conform(spark.read.parquet(*paths), arrow_schema)


def read_history(spark: SparkSession, path: Path | str) -> DataFrame:
    """Read client histories: a .jsonl/.json/.parquet file or a directory of them."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such history file or directory")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    parquet = [str(p) for p in files if p.suffix == ".parquet"]
    jsonl = [str(p) for p in files if p.suffix in (".jsonl", ".json")]
    if path.is_file() and not parquet and not jsonl:  # unknown suffix: sniff the magic
        with path.open("rb") as fh:
            (parquet if fh.read(4) == b"PAR1" else jsonl).append(str(path))
    frames = []
    if parquet:
        frames.append(conform(spark.read.parquet(*parquet), S.HISTORY))
    if jsonl:
        frames.append(conform(spark.read.schema(spark_schema(S.HISTORY)).json(jsonl), S.HISTORY))
    if not frames:
        raise ExportError(f"{path}: no .jsonl or .parquet history files")
    df = frames[0]
    for other in frames[1:]:
        df = df.unionByName(other)
    return df
