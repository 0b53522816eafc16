"""Every pipeline command on real Spark deployments gives the local report.

* a standalone cluster: a master and two workers (1 core, 1 GiB each), each a
  JVM of its own, started from the installed pyspark; the driver runs in a
  separate process and its executors in JVMs the workers launch;
* a Spark Connect server, reached by the real CLI with ``--remote``: the CLI
  process starts no JVM at all.

The data (3 masters x 200 k transactions forking at 150 k, several Parquet
row groups and digest blocks per log, and a 20 k-message history with
injected anomalies) lives under a path every worker reads, as the operator
set-up in docs/pipeline.md requires. Each report must equal the one the
in-process local[2] session writes for the same inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import run_jobs
from .sparkcluster import ConnectServer, Standalone

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """A Spark Connect server launched before the workload is made: its JVM starts while
    the data are generated and the local reports written (the test waits for it)."""
    server = ConnectServer(tmp_path_factory.mktemp("connect"))
    server.launch()
    try:
        yield server
    finally:
        server.jvms.stop()  # by PID, started or not


@pytest.fixture(scope="module")
def workload(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Generated exports + history, and the reports of the local[2] session."""
    data = tmp_path_factory.mktemp("cluster-data")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "pipeline_generate.py"),
            "--out",
            str(data),
            "--txs",
            "200000",
            "--diverge-at",
            "150000",
            "--history",
            "20000",
            "--anomalies",
            "7",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    inputs, hist = str(data / "exports"), str(data / "history.parquet")
    local = run_jobs.run_all(inputs, hist, data / "local")
    # the reference is itself right: the generator's split and anomalies are found
    assert [(d["a"], d["b"], d["position"]) for d in local["audit"]["divergences"]] == [
        ("dc1", "dc3", 150_000),
        ("dc2", "dc3", 150_000),
    ]
    assert local["replay-plan"]["plans"][0]["replay"]["count"] == 50_000
    assert local["check-history"]["lost"]["count"] == 7
    return {"inputs": inputs, "history": hist, "local": local, "dir": data}


# -m slow: two worker JVMs besides the master cost the default suite ~140 s on CI's two
# cores; the Spark Connect run below stays in it (the CLI against a remote Spark)
@pytest.mark.slow
def test_standalone_cluster_reports_equal_local(workload: dict[str, Any], tmp_path: Path) -> None:
    with Standalone(tmp_path / "cluster", workers=2, cores=1, memory="1g") as cluster:
        out = tmp_path / "out"
        proc = subprocess.run(
            [
                sys.executable,
                str(Path(run_jobs.__file__)),
                "--master",
                cluster.url,
                "--input",
                workload["inputs"],
                "--history",
                workload["history"],
                "--out",
                str(out),
                "--conf",
                "spark.executor.memory=512m",
                "--conf",
                "spark.driver.host=127.0.0.1",
                "--conf",
                "spark.sql.shuffle.partitions=4",
                "--conf",
                f"spark.pyspark.python={sys.executable}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        # the work really ran in executor JVMs on both workers
        executors = sorted((tmp_path / "cluster").glob("work*/app-*/*/stderr"))
        assert {p.parts[-4] for p in executors} == {"work1", "work2"}, executors
    for command, expected in workload["local"].items():
        got = json.loads((out / command / "report.json").read_text())
        assert got == expected, command


def test_spark_connect_reports_equal_local(
    connect_server: ConnectServer, workload: dict[str, Any], tmp_path: Path
) -> None:
    connect_server.wait_ready()
    # the commands at once, each its own CLI process and Connect session (one after the
    # other, each process's start -- Python, pyspark's imports -- was much of their time)
    procs = {}
    for command in workload["local"]:
        args = ["--input", workload["inputs"], "--out", str(tmp_path / command),
                "--remote", connect_server.url]
        if command == "check-history":
            args += ["--history", workload["history"]]
        with open(tmp_path / f"{command}.stderr", "w") as stderr:  # a file: no pipe to fill
            procs[command] = subprocess.Popen(
                [sys.executable, "-m", "brokerha.cli", "pipeline", command, *args],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
            )
    deadline = time.monotonic() + 300
    try:
        for proc in procs.values():
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():  # by PID: any still running after a timeout
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for command, expected in workload["local"].items():
        stderr = (tmp_path / f"{command}.stderr").read_text()
        assert procs[command].returncode == 0, (command, stderr[-3000:])
        got = json.loads((tmp_path / command / "report.json").read_text())
        assert got == expected, command
