"""One SparkSession (local[2]) for the whole pipeline suite: the JVM and the
first query's warm-up cost 10-20 s, far more than any of our crafted jobs."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


def java_available() -> bool:
    if shutil.which("java") is None:
        return False
    return subprocess.run(["java", "-version"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if not java_available():
        pytest.skip("no Java runtime: run scripts/ensure-java to install a headless JRE")
    pytest.importorskip("pyspark", reason="pyspark not installed (pip install .[pipeline])")
    from brokerha.pipeline.session import get_session

    session = get_session("local[2]", app="brokerha-pipeline-tests")
    yield session
    session.stop()
