"""The status page in a real headless browser (Debian's Chromium): it renders, refreshes on
its own and shows a failover. Skipped when no Chromium is installed
(`apt-get install chromium`). A screenshot goes to the test's temporary directory."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerha.testing import LocalCluster

FAST = {"heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
        "backup_timeout": 3.0}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")


def browse(url: str, *extra: str) -> str:
    assert CHROMIUM is not None
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--window-size=1100,900", "--virtual-time-budget=3000", *extra, url],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture()
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options=FAST) as c:
        yield c


def test_status_page_renders_and_shows_a_failover(cluster: LocalCluster, tmp_path: Path) -> None:
    primary = cluster.wait_primary(30)
    for name in cluster.names:
        if name != primary:
            cluster.wait_ready(name, 30)
    watcher = next(n for n in cluster.names if n != primary)
    # Basic credentials in the URL: every page but /metrics needs them (the browser keeps
    # them for the page's own refreshes)
    url = cluster.admin_url(watcher).replace("http://", "http://guest:guest@") + "/status"
    dom = browse(url, "--dump-dom")
    for name in cluster.names:
        assert f'data-node="{name}"' in dom
    cluster.kill(primary)
    new = cluster.wait_primary(30, other_than=primary)
    dom = browse(url, "--dump-dom")
    assert ">down<" in dom and f"primary: <b>{new}</b>" in dom and "elected" in dom
    shot = tmp_path / "status-page.png"
    browse(url, f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000
