"""The inputs of one command: the session, the discovered masters, their tables.

A small holder so that a job reads each table once per command (Spark plans
are lazy, so "reading" is cheap until an action) and every job gets the same
view of the export directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from brokerha.pipeline.reader import MasterExport, discover, read_table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


@dataclass
class Inputs:
    spark: SparkSession
    root: str  # as the user named it (path or URL)
    masters: list[MasterExport]
    _tables: dict[str, DataFrame] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, spark: SparkSession, root: str | os.PathLike[str]) -> Inputs:
        return cls(spark, os.fspath(root), discover(spark, root))

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.masters]

    def meta(self, name: str) -> MasterExport:
        return next(m for m in self.masters if m.name == name)

    def table(self, stem: str) -> DataFrame:
        if stem not in self._tables:
            self._tables[stem] = read_table(self.spark, self.masters, stem)
        return self._tables[stem]

    @property
    def sync(self) -> DataFrame:
        return self.table("synchronised")
