"""Comparing synchronised logs: block digests, pairwise divergence, the majority.

Shared by ``audit`` and ``replay-plan``. The approach follows the measured
advice in performance-notes.md: never join or shuffle whole logs. Each
master's log is reduced to one digest per block of ``BLOCK`` positions (a few
hundred rows per master even at 10 M transactions); only the first block in
which two logs differ is read back, and Parquet row-group statistics on the
sorted ``position`` column make that read touch one or two row groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import reduce
from itertools import combinations
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

#: Positions per block; equal to the contract's row-group cap so a block is
#: about one row group.
BLOCK = 65_536


@dataclass(frozen=True)
class Block:
    """Order-sensitive digest of one block: two XORs of a 64-bit hash of (position, tx_id).

    ``h1`` XORs the rows' hashes, ``h2`` a rehash of each (xxhash64 of the
    hash: not linear in XOR, so a difference that cancels in one XOR does not
    cancel in the other). Each row's id is hashed once: decoding and hashing
    the 26-byte ids is most of the pass. Hashing the position with the id makes
    the digest order-sensitive even though XOR is commutative; the row count
    catches a duplicated row that XOR would cancel out.
    """

    rows: int
    h1: int
    h2: int


@dataclass
class LogSummary:
    """What the driver knows about one master's log after the block pass."""

    master: str
    rows: int = 0
    min_position: int | None = None
    max_position: int | None = None
    blocks: dict[int, Block] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Length of the log = next position (the contract promises no gaps)."""
        return 0 if self.max_position is None else self.max_position + 1

    @property
    def problems(self) -> list[str]:
        out = []
        if self.rows and self.min_position != 0:
            out.append(f"{self.master}: log starts at position {self.min_position}, not 0")
        if self.rows != self.length:
            out.append(
                f"{self.master}: {self.rows} rows for positions 0..{self.length - 1} (gaps or duplicates)"
            )
        return out


@dataclass
class PairResult:
    """How two logs relate: ``equal``, ``prefix`` (one extends the other) or ``diverged``."""

    a: str
    b: str
    a_length: int
    b_length: int
    position: int | None = None  # first differing position, if diverged
    a_tx: str | None = None
    b_tx: str | None = None

    @property
    def relation(self) -> str:
        if self.position is not None:
            return "diverged"
        return "equal" if self.a_length == self.b_length else "prefix"

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "masters": [self.a, self.b],
            "relation": self.relation,
            "position": self.position,
            "a_tx": self.a_tx,
            "b_tx": self.b_tx,
            "a_length": self.a_length,
            "b_length": self.b_length,
        }


@dataclass
class Majority:
    """The log most masters agree with, and who is outside it."""

    master: str  # whose log is the majority log
    length: int
    supporters: list[str]
    minority: list[str]
    strict: bool  # more than half of all masters support it

    def as_dict(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "length": self.length,
            "supporters": self.supporters,
            "minority": self.minority,
            "strict": self.strict,
        }


def summarise(sync: DataFrame, masters: Iterable[str]) -> dict[str, LogSummary]:
    """One aggregation over all logs: per (master, block) row count and digests."""
    from pyspark.sql import functions as F

    blocks = (
        sync.select("master", "position", F.xxhash64("position", "tx_id").alias("h"))
        .groupBy("master", F.floor(F.col("position") / F.lit(BLOCK)).alias("block"))
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.min("position").alias("lo"),
            F.max("position").alias("hi"),
            F.bit_xor("h").alias("h1"),
            F.bit_xor(F.xxhash64("h")).alias("h2"),
        )
        .collect()
    )
    out = {m: LogSummary(m) for m in masters}
    for r in blocks:
        s = out.setdefault(r["master"], LogSummary(r["master"]))
        s.blocks[int(r["block"])] = Block(int(r["rows"]), int(r["h1"]), int(r["h2"]))
        s.rows += int(r["rows"])
        s.min_position = r["lo"] if s.min_position is None else min(s.min_position, r["lo"])
        s.max_position = r["hi"] if s.max_position is None else max(s.max_position, r["hi"])
    return out


def _candidate_blocks(a: LogSummary, b: LogSummary) -> list[int]:
    """Blocks that may hold the first difference of two logs within their common length.

    Full blocks are compared by digest; the last, partial block of the shorter
    log can differ in digest even for a prefix, so it is always a candidate.
    """
    common = min(a.length, b.length)
    full = common // BLOCK
    out = [k for k in range(full) if a.blocks.get(k) != b.blocks.get(k)]
    if common % BLOCK:
        out.append(full)
    return out


def compare_pairs(sync: DataFrame, summaries: dict[str, LogSummary]) -> list[PairResult]:
    """Relate every pair of logs, reading exact rows only in candidate blocks.

    Pairs are processed in rounds: every pending pair proposes its next
    candidate block and one small Spark job settles them all, reading only
    the proposed blocks. In a split every pair usually proposes the fork's
    block (and equal or prefix pairs the last, partial one), so the whole
    comparison costs one extra job.
    """
    names = sorted(summaries)
    results = {
        (a, b): PairResult(a, b, summaries[a].length, summaries[b].length)
        for a, b in combinations(names, 2)
    }
    pending = {pair: _candidate_blocks(summaries[pair[0]], summaries[pair[1]]) for pair in results}
    pending = {p: c for p, c in pending.items() if c}
    while pending:
        proposed = {pair: cands[0] for pair, cands in pending.items()}
        found = _exact_blocks(sync, proposed, summaries)
        for pair in proposed:
            hit = found.get(pair)
            if hit is not None:
                res = results[pair]
                res.position, res.a_tx, res.b_tx = hit
                del pending[pair]
            else:
                pending[pair].pop(0)
                if not pending[pair]:
                    del pending[pair]
    return list(results.values())


def _exact_blocks(
    sync: DataFrame, proposed: dict[tuple[str, str], int], summaries: dict[str, LogSummary]
) -> dict[tuple[str, str], tuple[int, str | None, str | None]]:
    """First differing position of each pair inside its proposed block (one Spark job).

    Rows of the proposed blocks are laid side by side per position (one
    column per master, by conditional aggregation -- at most BLOCK rows per
    block), then each pair takes the minimum position where its two columns
    differ null-safely, inside its block and below the pair's common length.
    """
    from pyspark.sql import functions as F

    pairs = list(proposed)
    involved = sorted({m for p in pairs for m in p})
    col = {m: f"m{i}" for i, m in enumerate(involved)}
    position = F.col("position")
    blocks = sorted(set(proposed.values()))
    in_blocks = reduce(
        lambda a, b: a | b,
        [(position >= k * BLOCK) & (position < (k + 1) * BLOCK) for k in blocks],
    )
    wide = (
        sync.filter(F.col("master").isin(involved) & in_blocks)
        .groupBy("position")
        .agg(
            *[F.max(F.when(F.col("master") == m, F.col("tx_id"))).alias(c) for m, c in col.items()]
        )
    )
    aggs = []
    for i, (a, b) in enumerate(pairs):
        lo = proposed[a, b] * BLOCK
        hi = min(lo + BLOCK, summaries[a].length, summaries[b].length)
        differs = (position >= lo) & (position < hi) & ~F.col(col[a]).eqNullSafe(F.col(col[b]))
        first = F.struct(position, F.col(col[a]).alias("a"), F.col(col[b]).alias("b"))
        aggs.append(F.min(F.when(differs, first)).alias(f"p{i}"))
    row = wide.agg(*aggs).collect()[0]
    out = {}
    for i, pair in enumerate(pairs):
        hit = row[f"p{i}"]
        if hit is not None:
            out[pair] = (int(hit["position"]), hit["a"], hit["b"])
    return out


def majority(summaries: dict[str, LogSummary], pairs: list[PairResult]) -> Majority | None:
    """Pick the log the most masters are prefix-consistent with.

    A master supports a log when its own log equals it, is a prefix of it
    (a lagger) or extends it. Ties go to the longer log, then the smaller
    master id, so the choice is deterministic. ``strict`` says whether the
    supporters are more than half of all masters -- the seeds' majority vote.
    """
    if not summaries:
        return None
    diverged = {frozenset((p.a, p.b)) for p in pairs if p.relation == "diverged"}
    names = sorted(summaries)

    def supporters(m: str) -> list[str]:
        return [k for k in names if frozenset((m, k)) not in diverged]

    best = min(names, key=lambda m: (-len(supporters(m)), -summaries[m].length, m))
    sup = supporters(best)
    return Majority(
        master=best,
        length=summaries[best].length,
        supporters=sup,
        minority=[m for m in names if m not in sup],
        strict=2 * len(sup) > len(names),
    )


def fork_position(pairs: list[PairResult], a: str, b: str) -> int | None:
    """Where the logs of ``a`` and ``b`` diverge (None if they do not)."""
    for p in pairs:
        if {p.a, p.b} == {a, b}:
            return p.position
    return None


@dataclass
class LogAnalysis:
    """Everything audit and replay-plan learn from the block pass."""

    summaries: dict[str, LogSummary]
    pairs: list[PairResult]
    majority: Majority | None

    @property
    def divergences(self) -> list[PairResult]:
        return [p for p in self.pairs if p.relation == "diverged"]

    @property
    def problems(self) -> list[str]:
        return [msg for s in self.summaries.values() for msg in s.problems]


def analyse(sync: DataFrame, masters: Iterable[str]) -> LogAnalysis:
    """Summarise every log, relate every pair, choose the majority."""
    summaries = summarise(sync, masters)
    pairs = compare_pairs(sync, summaries)
    return LogAnalysis(summaries, pairs, majority(summaries, pairs))
