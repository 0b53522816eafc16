"""Find TxLog exports and read them as Spark DataFrames.

Every job reads through here so that the contract's quirks are handled once:
``DIR`` may be one master's folder or a directory of ``<master>/`` folders, a
table may be a single Parquet file or a directory of part files, and columns
are cast to the contract's types (a later schema version may add columns,
which are ignored here).

Inputs are named by anything Spark's Hadoop filesystem layer reads: a plain
path, ``file://``, ``hdfs://``, ``s3a://`` (when the cluster has the
connector)... Nothing here touches the driver's own filesystem: the listing
is Spark's (``binaryFile`` source, ``inputFiles()``: no file is opened) and
the few ``meta.json`` files are read by Spark too, so the same code works in
a local session, against a standalone cluster and over Spark Connect, where
the client has no JVM at all.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from brokerha.pipeline import schema as S

if TYPE_CHECKING:  # pyspark is imported only inside functions that run jobs
    from pyspark.sql import DataFrame, SparkSession


class ExportError(Exception):
    """The input does not look like a TxLog export this pipeline understands."""


@dataclass(frozen=True)
class MasterExport:
    """One ``<master>/`` folder: its id, location (path or URL), meta.json and tables."""

    name: str
    folder: str
    meta: dict[str, Any] = field(default_factory=dict)
    tables: frozenset[str] = frozenset()

    @property
    def split_recovery(self) -> str:
        return str(self.meta.get("split_recovery", "unknown")).lower()

    def table_path(self, stem: str) -> str:
        return f"{self.folder}/{stem}.parquet"


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def location(path: str | os.PathLike[str]) -> str:
    """``path`` as Spark should be given it: URLs unchanged, plain paths absolute.

    A plain relative path means the caller's current directory (not the
    Spark driver's or a Connect server's).
    """
    text = os.fspath(path)
    if _SCHEME.match(text):
        return text.rstrip("/") or text
    return os.path.abspath(text)


def _path_part(url: str) -> str:
    """The path of a URL without scheme and authority: ``hdfs://nn:8020/a/b`` -> ``/a/b``.

    Spark names listed files in its own qualified form (``file:/a``,
    ``file:///a``); comparing path parts relates them to the root as given.
    """
    rest = _SCHEME.sub("", url, count=1) if _SCHEME.match(url) else url
    if rest.startswith("//"):
        slash = rest.find("/", 2)
        rest = rest[slash:] if slash >= 0 else "/"
    return "/" + rest.strip("/")


def list_files(spark: SparkSession, root: str) -> list[str]:
    """Every file under ``root`` (or ``root`` itself, if a file), as Spark's qualified URLs.

    Spark (the driver JVM, or the Connect server) lists through the Hadoop
    FileSystem of the URL's scheme; hidden files (``.x``, ``_x``) are skipped
    as for any Spark read. Raises ExportError when ``root`` does not exist.
    """
    try:
        df = spark.read.format("binaryFile").option("recursiveFileLookup", "true").load(root)
        return sorted(df.inputFiles())
    except Exception as exc:  # whatever the filesystem raised, in a JVM or over Connect
        reason = _reason(exc)
        if "PATH_NOT_FOUND" in reason or "FileNotFoundException" in reason:
            raise ExportError(f"{root}: no such file or directory") from None
        raise ExportError(f"{root}: cannot be listed: {reason}") from None


def _reason(exc: Exception) -> str:
    """One line saying why Spark failed (a Py4J error's Java exception, else the message's first line)."""
    java = getattr(exc, "java_exception", None)
    text = str(java.toString()) if java is not None else str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def _relative(files: list[str], root: str) -> list[tuple[str, ...]]:
    """Path components of each listed file below ``root`` (() for root itself)."""
    base = _path_part(root)
    base = "" if base == "/" else base
    out = []
    for f in files:
        p = _path_part(f)
        if p == base:
            out.append(())
        elif p.startswith(base + "/"):
            out.append(tuple(p[len(base) + 1 :].split("/")))
    return out


def _stems_at(rel: list[tuple[str, ...]], prefix: tuple[str, ...]) -> set[str]:
    """Table stems present directly in folder ``prefix`` (a file or a part directory)."""
    n = len(prefix)
    return {
        parts[n][: -len(".parquet")]
        for parts in rel
        if len(parts) > n
        and parts[:n] == prefix
        and parts[n].endswith(".parquet")
        and parts[n][: -len(".parquet")] in S.TABLES
    }


def _read_metas(spark: SparkSession, paths: list[str]) -> dict[str, dict[str, Any]]:
    """path part of each meta.json's folder -> its parsed content (read by Spark)."""
    if not paths:
        return {}
    rows = spark.read.format("binaryFile").load(paths).select("path", "content").collect()
    out = {}
    for r in rows:
        folder = _path_part(r["path"]).rsplit("/", 1)[0]
        try:
            out[folder] = json.loads(bytes(r["content"]).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ExportError(f"{r['path']}: not valid JSON ({exc})") from None
    return out


def discover(spark: SparkSession, root: str | os.PathLike[str]) -> list[MasterExport]:
    """List the master exports under ``root`` (itself one, or its sub-folders)."""
    url = location(root)
    rel = _relative(list_files(spark, url), url)
    if rel == [()]:
        raise ExportError(f"{root}: not a directory")

    def is_export(prefix: tuple[str, ...]) -> bool:
        return prefix + ("meta.json",) in rel_set or "synchronised" in _stems_at(rel, prefix)

    rel_set = set(rel)
    if is_export(()):
        folders: list[tuple[str, ...]] = [()]
    else:
        folders = sorted({(p[0],) for p in rel if len(p) > 1 and is_export((p[0],))})
    if not folders:
        raise ExportError(
            f"{root}: no TxLog export (no <master>/meta.json or synchronised.parquet)"
        )
    join = {f: "/".join((url, *f)) if f else url for f in folders}
    metas = _read_metas(
        spark, [f"{join[f]}/meta.json" for f in folders if f + ("meta.json",) in rel_set]
    )
    masters: list[MasterExport] = []
    for f in folders:
        meta = metas.get(_path_part(join[f]), {})
        version = meta.get("schema_version", S.SCHEMA_VERSION)
        if version not in S.READABLE_VERSIONS:
            readable = ", ".join(map(str, S.READABLE_VERSIONS))
            raise ExportError(
                f"{join[f]}: schema_version {version} is not supported (this pipeline reads {readable})"
            )
        name = str(meta.get("master", f[0] if f else url.rstrip("/").rsplit("/", 1)[-1]))
        masters.append(MasterExport(name, join[f], meta, frozenset(_stems_at(rel, f))))
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
    from pyspark.sql import types as T

    spark_type = {
        "string": T.StringType,
        "bigint": T.LongType,
        "int": T.IntegerType,
        "boolean": T.BooleanType,
    }
    return T.StructType(
        [T.StructField(f.name, spark_type[_SPARK_TYPES[f.type]](), True) for f in arrow_schema]
    )


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
    paths = [m.table_path(stem) for m in masters if stem in m.tables]
    if not paths:
        return spark.createDataFrame([], spark_schema(arrow_schema))
    return conform(spark.read.parquet(*paths), arrow_schema)


def read_history(spark: SparkSession, path: str | os.PathLike[str]) -> DataFrame:
    """Read client histories: a .jsonl/.json/.parquet file or a directory of them."""
    from pyspark.sql import functions as F

    url = location(path)
    files = list_files(spark, url)
    single = _relative(files, url) == [()]
    parquet = [f for f in files if f.endswith(".parquet")]
    jsonl = [f for f in files if f.endswith((".jsonl", ".json"))]
    if single and not parquet and not jsonl:  # unknown suffix: sniff the magic (on Spark's side)
        magic = (
            spark.read.format("binaryFile")
            .load(url)
            .select(F.substring("content", 1, 4).alias("m"))
            .collect()[0]["m"]
        )
        (parquet if bytes(magic) == b"PAR1" else jsonl).append(url)
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
