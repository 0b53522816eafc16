"""One SparkSession (local[2]) for the whole pipeline suite: the JVM and the
first query's warm-up cost 10-20 s, far more than any of our crafted jobs.

When the tests chosen use it, the session starts in a background thread as
soon as collection ends, and runs each job once on a small crafted export
(the first run of a job costs 10-20 s of JIT and code generation, later ones
a few), so this happens while the tests before tests/pipeline run instead of
in front of the first Spark test. That thread and the JVM it launches run
at nice 10 (back to 0 once warm, or as soon as a test waits for it, where
allowed): the warm-up takes only CPU the running tests leave idle (many of
them time elections and leases). The ``spark`` fixture waits for it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def java_available() -> bool:
    if shutil.which("java") is None:
        return False
    return subprocess.run(["java", "-version"], capture_output=True).returncode == 0


APP = "brokerha-pipeline-tests"


class WarmStart(threading.Thread):
    """Starts the session (and warms the jobs up) off the main thread."""

    def __init__(self) -> None:
        super().__init__(name="spark-warm-start", daemon=True)
        self.session: Any = None
        self.error: BaseException | None = None
        self.hurried = False

    def run(self) -> None:
        # Linux: the niceness is this thread's, and the JVM forked from it inherits it
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            from brokerha.pipeline.session import get_session

            self.session = get_session("local[2]", app=APP)
        except BaseException as exc:  # the fixture raises it in the test that asks
            self.error = exc
            return
        try:
            if not self.hurried:
                warm_up(self.session)
        except Exception as exc:  # the tests run these jobs themselves and say what fails
            warnings.warn(f"the pipeline jobs' warm-up failed: {exc!r}", stacklevel=1)
        finally:
            # the tests' own jobs at the usual priority (root may lower a niceness)
            renice_jvm(0)

    def hurry(self) -> None:
        """A test waits for the session: the rest at the usual priority, and no warm-up
        that has not begun yet (the tests pay it, as they would have without this)."""
        self.hurried = True
        if self.native_id is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self.native_id, 0)
        renice_jvm(0)


def renice_jvm(nice: int) -> None:
    """The session's JVM (once launched) and its Python workers to ``nice``."""
    from pyspark import SparkContext

    proc = getattr(SparkContext._gateway, "proc", None)
    if proc is not None:
        renice_tree(proc.pid, nice)


def renice_tree(pid: int, nice: int) -> None:
    """Every thread of ``pid`` and of its descendants (the JVM's Python workers) to ``nice``."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tasks:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:  # not allowed (not root), or gone
            continue
        for child in children:
            renice_tree(int(child), nice)


def warm_up(spark: Any) -> None:
    """Each job once on crafted inputs (results thrown away): the JIT and code generation
    of its plans, which the first test running that job would otherwise pay."""
    from brokerha.pipeline import audit, history, replay, stats
    from brokerha.pipeline.inputs import Inputs

    from . import crafted

    tmp = Path(tempfile.mkdtemp(prefix="brokerha-spark-warm-"))
    try:
        root = crafted.write_split(tmp / "in", recovered_events=True, wrong_replay=True)
        hist = crafted.write_history_file(tmp / "hist" / "h.jsonl", crafted.history_ok())
        audit.run(Inputs.load(spark, root), tmp / "audit")
        replay.run(Inputs.load(spark, root), tmp / "replay")
        history.run(spark, hist, tmp / "history", root)
        stats.run(Inputs.load(spark, root), tmp / "stats")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_warm: WarmStart | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    global _warm
    here = Path(__file__).parent
    wanted = any(
        "spark" in getattr(item, "fixturenames", ()) and here in item.path.parents
        for item in session.items
    )
    if not wanted or session.config.option.collectonly or not java_available():
        return
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return
    _warm = WarmStart()
    _warm.start()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if not java_available():
        pytest.skip("no Java runtime: run scripts/ensure-java to install a headless JRE")
    pytest.importorskip("pyspark", reason="pyspark not installed (pip install .[pipeline])")
    from pyspark.sql import SparkSession

    from brokerha.pipeline.session import get_session

    if _warm is None:
        session = get_session("local[2]", app=APP)
    else:
        if _warm.is_alive():
            _warm.hurry()
        _warm.join()
        if _warm.error is not None:
            raise _warm.error
        session = _warm.session
        # the active session is per thread: make it this one's too, as if created here
        # (a CLI run in-process stops a session it finds no active one of)
        session.createDataFrame([], "x int")
        assert SparkSession.getActiveSession() is session
    yield session
    session.stop()
