"""One SparkSession per command.

Starting the JVM and a session costs 8-10 s on this class of machine and the
first query warms up for several more (performance-notes.md), so a command
creates exactly one session and runs all its jobs on it; tests share one for
the whole run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def local_defaults(master: str) -> dict[str, str]:
    """Settings that only make sense on one machine.

    The inputs our jobs shuffle are small aggregates, so Spark's default of
    200 shuffle partitions is pure task overhead in local mode; on a cluster
    we leave it to the cluster's configuration (or ``--conf``).
    """
    if not master.startswith("local"):
        return {}
    return {
        "spark.sql.shuffle.partitions": "4",
        "spark.default.parallelism": "4",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
    }


DEFAULT_MASTER = "local[*]"


def get_session(
    master: str | None = None,
    app: str = "brokerha-pipeline",
    conf: Mapping[str, str] | None = None,
    remote: str | None = None,
) -> SparkSession:
    """Create (or, in-process, reuse) the session for one command.

    With ``remote`` (``sc://host:port``) the session is a Spark Connect
    client: no JVM starts here, the server runs the jobs (the pipeline uses
    DataFrame APIs only, never RDDs or the SparkContext, so the same code runs
    both ways); ``conf`` may then set only runtime SQL settings. With
    ``master`` None we use ``local[*]`` -- unless spark-submit launched us (it
    starts the JVM first and exports PYSPARK_GATEWAY_PORT), in which case the
    launcher's ``--master`` must win and we set nothing ourselves.
    """
    from pyspark.sql import SparkSession

    if remote is not None:
        if master is not None:
            raise ValueError("give either a Spark master or a Spark Connect URL, not both")
        builder = SparkSession.builder.remote(remote)
        for key, value in {"spark.sql.session.timeZone": "UTC", **(conf or {})}.items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    builder = SparkSession.builder.appName(app)
    active = SparkSession.getActiveSession()
    if active is None:
        settings: dict[str, str] = {"spark.sql.session.timeZone": "UTC"}
        launched = "PYSPARK_GATEWAY_PORT" in os.environ
        if master is not None or not launched:
            master = master or DEFAULT_MASTER
            builder = builder.master(master)
            settings.update(local_defaults(master))
        settings.update(conf or {})
        for key, value in settings.items():
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


@contextmanager
def sql_conf(spark: SparkSession, settings: Mapping[str, str]) -> Iterator[None]:
    """Runtime SQL settings for the plans built inside the block (restored after).

    A plan takes the settings current when it is planned: a DataFrame cached
    (or an action run) inside the block keeps them. Works over Spark Connect
    too; a key an older Spark does not know is accepted and ignored.
    """
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
