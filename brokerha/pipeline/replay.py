"""``brokerha pipeline replay-plan``: what each minority must do after a split.

For every master outside the majority (see logs.majority) with fork position
``p`` against the majority log:

* **replay** -- the majority's transactions at positions >= p that the
  minority's log does not hold: after restoring to the last common state the
  minority must execute them (in the majority's order);
* **renegotiate** -- the minority's own transactions at positions >= p that
  the majority's log does not hold: they re-enter the TxLog as new
  transactions (their new row carries ``replay_of`` = the old id);
* **conflicts** -- messages dequeued after the fork on both sides (by a
  transaction not already ``failed``): the message was consumed twice, and the
  renegotiated minority transaction must fail deterministic validation.

It then compares the plan with what the brokers recorded (``events`` and
``replay_of``) and reports every disagreement. Exports taken *after* a
recovery no longer show the minority's old log; for those, the recorded
recoveries are still checked for internal consistency (see docs/pipeline.md).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any

from brokerha.pipeline.frames import few, json_field, materialise, read_back
from brokerha.pipeline.inputs import Inputs
from brokerha.pipeline.logs import LogAnalysis, analyse, fork_position
from brokerha.pipeline.reader import MasterExport, read_table
from brokerha.pipeline.report import Section, finding_section, rows_table, write_html, write_json
from brokerha.pipeline.session import sql_conf

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession


#: The plan's aggregations group by transaction or message id, which the map
#: side cannot reduce (each id comes once or twice): skip the partial
#: aggregation before their shuffle (the block digests keep it: set after them).
#: Split the files finer than the default 128 MiB: the rows after the fork are
#: the logs' last row groups, which would otherwise fall into one or two splits
#: and be read by one task while the other cores wait. The post-fork rows are
#: cached once and read three times: uncompressed, which builds the cache in
#: half the time. A shuffled side whose every partition is under 32 MiB (the
#: dequeues after the fork, at 10 M transactions ~20 MiB) is joined by hashing
#: it, not by sorting both sides (adaptive execution decides from the shuffle's
#: sizes, so larger inputs keep the sort-merge join, which can spill).
SETTINGS = {
    "spark.sql.execution.bypassPartialAggregation": "true",
    "spark.sql.files.maxPartitionBytes": str(32 << 20),
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
    "spark.sql.adaptive.advisoryPartitionSizeInBytes": str(32 << 20),
    "spark.sql.adaptive.maxShuffledHashJoinLocalMapThreshold": str(32 << 20),
}


def main(spark: SparkSession, args: argparse.Namespace) -> dict[str, Any]:
    """CLI entry: ``--input DIR --out OUT``."""
    return run(Inputs.load(spark, args.input), args.out)


def run(inputs: Inputs, out: Path) -> dict[str, Any]:
    analysis = analyse(inputs.sync, inputs.names)
    maj = analysis.majority
    rejoins = _last_rejoins(inputs)
    plans = []
    copies = None
    if maj is not None:
        copies = _copies(inputs, maj.master)
        with sql_conf(inputs.spark, SETTINGS):
            for x in maj.minority:
                plans.append(plan_for(inputs, analysis, x, out, rejoins.get(x), copies))
    recorded = check_recorded(inputs, analysis, out, rejoins, copies)
    disagreements = [d for p in plans for d in p["disagreements"]] + [
        d for r in recorded for d in r["disagreements"]
    ]
    report = {
        "command": "replay-plan",
        "ok": not disagreements,
        "summary": f"{len(plans)} minority master(s), {len(disagreements)} disagreement(s) with what the brokers did",
        "input": str(inputs.root),
        "masters": inputs.names,
        "majority": maj.as_dict() if maj else None,
        "plans": plans,
        "recorded_recoveries": recorded,
        "disagreements": disagreements,
    }
    write_json(out, report)
    write_html(out, "TxLog replay plan", sections(report))
    return report


#: Up to this many renegotiated copies are collected and joined as a local, broadcast
#: table: one small job instead of a scan of the log for every join that uses them.
LOCAL_COPIES = 10_000


@dataclass(frozen=True)
class Copies:
    """The majority master's renegotiated copies: (tx_id = the old id, new_tx_id, new_outcome)."""

    frame: DataFrame
    none: bool  # known to be empty


def _copies(inputs: Inputs, master: str) -> Copies:
    """``master``'s renegotiated copies (row groups whose ``replay_of`` is all null are skipped)."""
    from pyspark.sql import functions as F

    df = (
        read_table(inputs.spark, [inputs.meta(master)], "synchronised")
        .filter((F.col("master") == master) & F.col("replay_of").isNotNull())
        .select(
            F.col("replay_of").alias("tx_id"),
            F.col("tx_id").alias("new_tx_id"),
            F.col("outcome").alias("new_outcome"),
        )
    )
    rows = df.limit(LOCAL_COPIES + 1).collect()
    if len(rows) > LOCAL_COPIES:
        return Copies(few(df), none=False)
    if not rows:  # empty to the optimizer: the joins with it are planned away, no job runs
        return Copies(df.limit(0), none=True)
    return Copies(F.broadcast(inputs.spark.createDataFrame(rows, df.schema)), none=False)


def _post_fork(sync: DataFrame, winner: str, minority: str, fork: int) -> DataFrame:
    """Every transaction at a position >= ``fork`` in either log, once, with where each holds it.

    One read of both logs (row groups before the fork are skipped by their
    ``position`` statistics) and one aggregation by id: ``maj``/``min`` is
    that side's ``2 * position + consumes`` (see _held), null when its log
    lacks the transaction after the fork; ``h`` is the id's xxhash64.

    Only numbers are aggregated, so Spark hashes the rows into groups instead
    of sorting them by id (ids share long prefixes: a sort compares them
    byte by byte). The origin is a grouping key rather than an aggregate: an
    id is assigned at its origin (docs/txlog-export.md), so grouping by
    (id, origin) is grouping by id. The rows are shuffled by (``h``, id),
    the key the dequeues are joined on later, so that join shuffles only
    the dequeues and sorts by a hash first.
    """
    from pyspark.sql import functions as F

    return (
        sync.filter(F.col("master").isin(winner, minority) & (F.col("position") >= fork))
        .select(
            F.xxhash64("tx_id").alias("h"),
            "tx_id",
            "origin",
            _held(winner).alias("maj"),
            _held(minority).alias("min"),
        )
        .repartition("h", "tx_id")
        .groupBy("h", "tx_id", "origin")
        .agg(F.max("maj").alias("maj"), F.max("min").alias("min"))
    )


def _held(master: str) -> Column:
    """``2 * position + consumes`` of a row of ``master`` (else null), 0 <= consumes <= 1.

    ``consumes``: its dequeues consumed their messages, unless validation
    rejected the transaction (a null outcome is not applied yet: it will
    consume). Of several rows of one side (a malformed log) the aggregation
    keeps the latest position.
    """
    from pyspark.sql import functions as F

    outcome = F.col("outcome")
    consumes = F.when(outcome.isNull() | (outcome != "failed"), 1).otherwise(0)
    return F.when(F.col("master") == master, F.col("position") * 2 + consumes)


def _only(post: DataFrame, side: str, other: str) -> DataFrame:
    """(position, tx_id, origin) of the transactions after the fork that only ``side`` holds."""
    from pyspark.sql import functions as F

    return post.filter(F.col(side).isNotNull() & F.col(other).isNull()).select(
        F.shiftright(F.col(side), 1).alias("position"), "tx_id", "origin"
    )


def _consumes(side: str) -> Column:
    """The side holds the transaction after the fork and its dequeues consumed their messages."""
    from pyspark.sql import functions as F

    return F.col(side).isNotNull() & (F.col(side).bitwiseAND(1) == 1)


def _dequeues_after(
    inputs: Inputs, analysis: LogAnalysis, sides: tuple[str, str], fork: int
) -> DataFrame:
    """(tx_id, queue, message_id) of every master's dequeues that may belong to a
    transaction after the fork of ``sides``.

    Bodies come from any master's operations (each holds the bodies it knows,
    so a row may come several times). Each operation carries its
    transaction's position in its master's own log; below both the fork and
    that log's first difference with either side, that position holds a
    transaction of the common prefix, so those row groups are skipped by their
    ``position`` statistics. Bodies of transactions outside the master's log
    (null position, as for every row of a version-1 export) are always read.
    """
    from pyspark.sql import functions as F

    by_start: dict[int, list[MasterExport]] = {}
    for m in inputs.masters:
        forks = (fork_position(analysis.pairs, m.name, s) for s in sides if s != m.name)
        start = min([fork, *(p for p in forks if p is not None)])
        by_start.setdefault(start, []).append(m)
    frames = []
    position = F.col("position")
    for start, masters in by_start.items():  # one read of the masters that skip the same rows
        frames.append(
            read_table(inputs.spark, masters, "operations")
            .filter((F.col("kind") == "dequeue") & (position.isNull() | (position >= start)))
            .select("tx_id", "queue", "message_id")
        )
    return reduce(lambda a, b: a.unionByName(b), frames)


def _conflicts(deq: DataFrame) -> DataFrame:
    """(message_id, queue, majority_tx, minority_tx) per message dequeued on both sides.

    ``deq`` holds (tx_id, queue, message_id, maj, min): one aggregation by
    message lists each side's transactions (without repeats: a body may come
    from several masters), then only the messages with both are paired.
    """
    from pyspark.sql import functions as F

    def listed(side: str, what: Column) -> Column:
        return F.array_distinct(F.collect_list(F.when(F.col(side), what)))

    majority = F.struct(F.col("tx_id").alias("majority_tx"), "queue")
    return (
        deq.groupBy("message_id")
        .agg(listed("maj", majority).alias("majs"), listed("min", F.col("tx_id")).alias("mins"))
        .filter((F.size("majs") > 0) & (F.size("mins") > 0))
        .select("message_id", F.explode("majs").alias("m"), "mins")
        .select("message_id", "m.queue", "m.majority_tx", F.explode("mins").alias("minority_tx"))
    )


def plan_for(
    inputs: Inputs,
    analysis: LogAnalysis,
    minority: str,
    out: Path,
    rejoin: dict[str, Any] | None,
    copies: Copies,
) -> dict[str, Any]:
    """The plan for one minority master, and how its recorded recovery compares
    (``rejoin``: its latest recorded rejoin, see _last_rejoins; ``copies``: the
    majority's renegotiated copies, see _copies)."""
    from pyspark.sql import functions as F

    assert analysis.majority is not None
    winner = analysis.majority.master
    fork = fork_position(analysis.pairs, winner, minority)
    assert fork is not None, "a minority master always diverges from the majority log"
    sync = inputs.sync
    spark = sync.sparkSession
    # only the two logs' files: the other masters' would be split into tasks that skip every row
    pair = read_table(spark, [inputs.meta(winner), inputs.meta(minority)], "synchronised")
    post = _post_fork(pair, winner, minority, fork).cache()
    base = out / "plans" / minority

    only_maj = _only(post, "maj", "min")
    n_replay, replay_sample = materialise(only_maj, base / "replay.parquet", ["position"])
    # the winner's renegotiated copies: usually few (then a local table, broadcast, not
    # shuffled with the rows joined to them)
    renegotiated = copies.frame
    renegotiate = _only(post, "min", "maj").join(renegotiated, "tx_id", "left")
    n_reneg, reneg_sample = materialise(renegotiate, base / "renegotiate.parquet", ["position"])

    consuming = post.select(
        "h", "tx_id", _consumes("maj").alias("maj"), _consumes("min").alias("min")
    ).filter(F.col("maj") | F.col("min"))
    # used once (the conflicts are written, then read back): not cached
    deq = (
        _dequeues_after(inputs, analysis, (winner, minority), fork)
        .withColumn("h", F.xxhash64("tx_id"))
        .join(consuming, ["h", "tx_id"])
        .drop("h")
    )
    conflicts = _conflicts(deq).join(
        renegotiated.withColumnRenamed("tx_id", "minority_tx"), "minority_tx", "left"
    )
    n_conf, conf_sample = materialise(
        conflicts, base / "conflicts.parquet", ["message_id", "minority_tx"]
    )
    post.unpersist()  # a session outlives the job (a Connect server, the bench)
    if copies.none:
        # no copies: no renegotiated row and no conflict has a new transaction
        bad_conflicts: list[dict[str, Any]] = []
        n_renegotiated = 0
    else:
        # a conflicting minority tx, once renegotiated, must fail validation everywhere
        committed_conflicts = (
            read_back(conflicts, base / "conflicts.parquet")
            .filter(F.col("new_outcome") == "committed")
            .select("minority_tx", "new_tx_id")
            .distinct()
        )
        bad_conflicts = [r.asDict() for r in committed_conflicts.limit(20).collect()]
        n_renegotiated = (
            read_back(renegotiate, base / "renegotiate.parquet")
            .filter(F.col("new_tx_id").isNotNull())
            .count()
        )

    strategy = inputs.meta(minority).split_recovery
    replay = read_back(only_maj, base / "replay.parquet")
    compare = compare_recorded(inputs, minority, winner, fork, replay, strategy, analysis, rejoin)
    disagreements = compare.pop("disagreements")
    disagreements += [
        {"master": minority, "what": "conflicting transaction renegotiated but committed", **row}
        for row in bad_conflicts
    ]
    return {
        "master": minority,
        "majority_master": winner,
        "fork_position": fork,
        "restore_to_position": fork,
        "split_recovery": strategy,
        "expected": _expected(strategy),
        "replay": {"count": n_replay, "sample": replay_sample},
        "renegotiate": {
            "count": n_reneg,
            "already_renegotiated": n_renegotiated,
            "sample": reneg_sample,
        },
        "conflicts": {"count": n_conf, "sample": conf_sample},
        "recorded": compare,
        "disagreements": disagreements,
    }


def _expected(strategy: str) -> str:
    if strategy == "none":
        return "none: no restore and no replay; the minority keeps its diverged state (DCs stay inconsistent)"
    if strategy in ("simple", "smart"):
        return (
            f"{strategy}: restore to the state at the fork position, replay the majority's transactions after it, "
            "renegotiate the minority's own post-fork transactions as new transactions"
        )
    return f"unknown strategy {strategy!r}"


def _events(inputs: Inputs, master: str, kind: str) -> DataFrame:
    from pyspark.sql import functions as F

    ev = inputs.table("events")
    return ev.filter((F.col("master") == master) & (F.col("kind") == kind))


def _last_rejoins(inputs: Inputs) -> dict[str, dict[str, Any]]:
    """Every master's latest ``rejoin`` event (rejoins are few: one collect for all)."""
    from pyspark.sql import functions as F

    rows = inputs.table("events").filter(F.col("kind") == "rejoin").collect()
    out: dict[str, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: r["at_ms"]):
        detail = json.loads(row["detail"] or "{}")
        out[row["master"]] = {
            "at_ms": row["at_ms"],
            "winner": detail.get("winner"),
            "common_prefix": detail.get("common_prefix"),
        }
    return out


def _replayed(inputs: Inputs, master: str, since_ms: int) -> DataFrame:
    """tx ids listed by ``master``'s replay events since its last rejoin."""
    from pyspark.sql import functions as F

    return (
        _events(inputs, master, "replay")
        .filter(F.col("at_ms") >= since_ms)
        .select(F.explode(json_field("detail", "tx_ids", "array<string>")).alias("tx_id"))
        .distinct()
    )


def compare_recorded(
    inputs: Inputs,
    minority: str,
    winner: str,
    fork: int,
    replay: DataFrame,
    strategy: str,
    analysis: LogAnalysis,
    rejoin: dict[str, Any] | None,
) -> dict[str, Any]:
    """Compare the plan with the minority's recorded ``rejoin`` and replay events."""
    issues: list[dict[str, Any]] = []

    def issue(what: str, **kw: Any) -> None:
        issues.append({"master": minority, "what": what, **kw})

    if rejoin is None:
        if strategy == "none" and _events(inputs, minority, "replay").limit(1).count():
            issue("strategy is none but the master replayed transactions")
        return {
            "status": "pending (no rejoin recorded yet)",
            "rejoin": None,
            "disagreements": issues,
        }
    assert analysis.majority is not None
    if rejoin["winner"] not in analysis.majority.supporters:
        issue(
            "rejoin chose a winner outside the majority", recorded=rejoin["winner"], expected=winner
        )
    if rejoin["common_prefix"] != fork:
        issue(
            "rejoin common_prefix differs from the fork position",
            recorded=rejoin["common_prefix"],
            expected=fork,
        )
    replayed = _replayed(inputs, minority, rejoin["at_ms"])
    planned = replay.select("tx_id")
    if strategy == "none":
        extra = replayed.count()
        if extra:
            issue("strategy is none but the master replayed transactions", count=extra)
        missing = 0
    else:
        missing_df = planned.join(replayed, "tx_id", "left_anti")
        extra_df = replayed.join(planned, "tx_id", "left_anti")
        missing, extra = missing_df.count(), extra_df.count()
        if missing:
            issue(
                "planned replay not replayed",
                count=missing,
                sample=[r["tx_id"] for r in missing_df.limit(10).collect()],
            )
        if extra:
            issue(
                "replayed but not in the plan",
                count=extra,
                sample=[r["tx_id"] for r in extra_df.limit(10).collect()],
            )
    return {
        "status": "rejoined (its log still diverges: export taken mid-recovery?)",
        "rejoin": rejoin,
        "missing_replays": missing,
        "extra_replays": extra,
        "disagreements": issues,
    }


def check_recorded(
    inputs: Inputs,
    analysis: LogAnalysis,
    out: Path,
    rejoins: dict[str, dict[str, Any]],
    copies: Copies | None = None,
) -> list[dict[str, Any]]:
    """Check recoveries the brokers recorded for masters no longer diverging.

    Their pre-recovery log is gone, so the plan cannot be recomputed; what can
    be checked: the winner was a majority log, every replayed id sits in the
    winner's log at or after the recorded common prefix, and no renegotiated
    transaction is also in the majority log under its old id (that would
    execute it twice).
    """
    from pyspark.sql import functions as F

    maj = analysis.majority
    if maj is None:
        return []
    sync = inputs.sync
    results: list[dict[str, Any]] = []
    for name in maj.supporters:
        rejoin = rejoins.get(name)
        if rejoin is None:
            continue
        issues: list[dict[str, Any]] = []
        if rejoin["winner"] not in maj.supporters:
            issues.append(
                {
                    "master": name,
                    "what": "rejoin chose a winner outside the majority",
                    "recorded": rejoin["winner"],
                }
            )
        prefix = int(rejoin["common_prefix"] or 0)
        winner_tail = sync.filter(
            (F.col("master") == (rejoin["winner"] or maj.master)) & (F.col("position") >= prefix)
        )
        stray = _replayed(inputs, name, rejoin["at_ms"]).join(
            winner_tail.select("tx_id"), "tx_id", "left_anti"
        )
        n_stray = stray.count()
        if n_stray:
            issues.append(
                {
                    "master": name,
                    "what": "replayed transactions not in the winner's log after the common prefix",
                    "count": n_stray,
                    "sample": [r["tx_id"] for r in stray.limit(10).collect()],
                }
            )
        results.append({"master": name, "rejoin": rejoin, "disagreements": issues})
    if copies is None:
        copies = _copies(inputs, maj.master)
    # few copies, a long log: broadcast the copies, stream the log (no shuffle of it)
    both = (
        sync.filter(F.col("master") == maj.master)
        .select("tx_id")
        .join(F.broadcast(copies.frame.select("tx_id", "new_tx_id")), "tx_id")
        .dropDuplicates(["tx_id", "new_tx_id"])
    )
    n_both, sample = materialise(both, out / "executed_twice.parquet", ["tx_id"])
    if n_both:
        results.append(
            {
                "master": maj.master,
                "rejoin": None,
                "disagreements": [
                    {
                        "master": maj.master,
                        "what": "renegotiated transaction also in the log under its old id",
                        "count": n_both,
                        "sample": sample[:10],
                    }
                ],
            }
        )
    return results


def sections(report: dict[str, Any]) -> list[Section]:
    maj = report["majority"]
    out = [
        Section(
            "Summary",
            [report["summary"] + "."]
            + (
                [
                    f"Majority log: {maj['master']} ({maj['length']:,} positions), minority: {', '.join(maj['minority']) or 'none'}."
                ]
                if maj
                else []
            ),
            status="ok" if report["ok"] else "bad",
        )
    ]
    for plan in report["plans"]:
        sec = Section(
            f"Minority {plan['master']} (fork at {plan['fork_position']:,})",
            [
                f"Strategy {plan['expected']}.",
                f"Replay {plan['replay']['count']:,} transaction(s); renegotiate {plan['renegotiate']['count']:,} "
                f"({plan['renegotiate']['already_renegotiated']:,} already renegotiated); "
                f"{plan['conflicts']['count']:,} message(s) consumed on both sides.",
                f"Recorded recovery: {plan['recorded']['status']}.",
            ],
        )
        for key, caption in (
            ("replay", "to replay"),
            ("renegotiate", "to renegotiate"),
            ("conflicts", "consumed on both sides"),
        ):
            if plan[key]["sample"]:
                sec.tables.append(
                    rows_table(
                        plan[key]["sample"], caption=f"{caption} (first {len(plan[key]['sample'])})"
                    )
                )
        out.append(sec)
    out.append(
        finding_section(
            "Disagreements with what the brokers did",
            len(report["disagreements"]),
            [{k: v for k, v in d.items() if k != "sample"} for d in report["disagreements"]],
            "Differences between this plan and the brokers' rejoin/replay events and replay_of rows.",
        )
    )
    return out
