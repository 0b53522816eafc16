"""Real Spark deployments for the pipeline tests, started from the installed pyspark.

* :class:`Standalone` -- a standalone master and N workers, each its own JVM
  (``spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker``),
  bound to 127.0.0.1; applications get executors in further JVMs that the
  workers launch.
* :class:`ConnectServer` -- a Spark Connect server
  (``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``;
  the connect jar ships in pyspark's ``jars/``); ``launch`` and ``wait_ready``
  apart let its JVM start while the caller does other work.

Each is a context manager that starts its JVMs, waits until they answer and
stops exactly the processes it started, by PID (workers stop their executors).
These are the set-ups docs/pipeline.md tells an operator to copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO

from brokerha.testing import free_base_port


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _env(log_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(spark_home()),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(log_dir),
        PYSPARK_PYTHON=sys.executable,
        SPARK_NO_DAEMONIZE="1",
    )
    env.pop("PYSPARK_GATEWAY_PORT", None)
    return env


class _Jvms:
    """The JVM processes one deployment started, stopped in reverse order by PID."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        # spark-class execs java, so the PID is the JVM's own
        proc = subprocess.Popen(
            cmd, env=_env(self.workdir), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
        )
        self.procs.append((name, proc, log))
        return proc

    def check_alive(self) -> None:
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        for _name, proc, log in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            log.close()
        self.procs.clear()


def _wait(what: str, ready: object, jvms: _Jvms, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        jvms.check_alive()
        try:
            if ready():  # type: ignore[operator]
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.3)


class _Deployment:
    """JVMs started together: stopped (by PID) on exit, or as soon as starting them fails."""

    jvms: _Jvms

    @contextlib.contextmanager
    def _starting(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.jvms.stop()
            raise

    def __exit__(
        self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
    ) -> None:
        self.jvms.stop()


class Standalone(_Deployment):
    """A standalone master and ``workers`` workers of ``cores`` cores / ``memory`` each."""

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.jvms = _Jvms(workdir)
        self.workers, self.cores, self.memory = workers, cores, memory
        self.base = free_base_port(2 + 2 * workers, offsets=(0,))
        self.url = f"spark://127.0.0.1:{self.base}"
        self.ui = f"http://127.0.0.1:{self.base + 1}"

    def alive_workers(self) -> list[dict[str, object]]:
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=2) as resp:
            state = json.load(resp)
        return [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]

    def __enter__(self) -> Standalone:
        spark_class = str(spark_home() / "bin" / "spark-class")
        self.jvms.start(
            "master",
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.base),
                "--webui-port",
                str(self.base + 1),
            ],
        )
        with self._starting():
            for i in range(self.workers):
                port = self.base + 2 + 2 * i
                self.jvms.start(
                    f"worker{i + 1}",
                    [
                        spark_class,
                        "org.apache.spark.deploy.worker.Worker",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--webui-port",
                        str(port + 1),
                        "--cores",
                        str(self.cores),
                        "--memory",
                        self.memory,
                        "--work-dir",
                        str(self.jvms.workdir / f"work{i + 1}"),
                        self.url,
                    ],
                )
            _wait(
                "standalone cluster",
                lambda: len(self.alive_workers()) == self.workers,
                self.jvms,
                120,
            )
        return self


class ConnectServer(_Deployment):
    """A Spark Connect server on 127.0.0.1 running its jobs on ``master``."""

    def __init__(self, workdir: Path, master: str = "local[2]") -> None:
        self.jvms = _Jvms(workdir)
        self.master = master
        self.port = free_base_port(1, offsets=(0,))
        self.url = f"sc://127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True

    def __enter__(self) -> ConnectServer:
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the server's JVM without waiting for it (``wait_ready`` does)."""
        self.jvms.start(
            "connect",
            [
                str(spark_home() / "bin" / "spark-submit"),
                "--class",
                "org.apache.spark.sql.connect.service.SparkConnectServer",
                "--master",
                self.master,
                "--conf",
                "spark.connect.grpc.binding.address=127.0.0.1",
                "--conf",
                f"spark.connect.grpc.binding.port={self.port}",
                "--conf",
                "spark.ui.enabled=false",
                "--conf",
                "spark.sql.shuffle.partitions=4",
                "--conf",
                "spark.sql.session.timeZone=UTC",
                "spark-internal",
            ],
        )

    def wait_ready(self) -> None:
        """Until the launched server answers (120 s); stopped if it exits or never does."""
        with self._starting():
            _wait("Spark Connect server", self._answers, self.jvms, 120)
