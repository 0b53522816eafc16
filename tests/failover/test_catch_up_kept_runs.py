"""A catch-up's runs kept in the backup's operation log (issue 33), on three real nodes.

A backup stopped while 12,000 x 1 KiB are confirmed catches up on its restart:
its store keeps the catch-up's runs in its log files, SQL holding references
(``store/runs.py``). That backup is then made primary (``ctl promote``),
restarted (its store loaded from those files) and made primary again: every
confirmed message not consumed before is delivered from it, each once, and
the ones consumed before the catch-up stay gone.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerha.store.runs import REF_BYTES
from brokerha.testing import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from ha_heavy_work import drain_ids, fill, message_id  # noqa: E402

from tests.failover.clients import connect_any  # noqa: E402

pytestmark = pytest.mark.timeout(300)

QUEUE = "kept-runs"
COUNT = 12_000
CONSUMED = 500  # taken before the catch-up: must not come back
# timing tolerant of a loaded machine: what is tested is the store, not the election
OPTIONS: dict[str, float | str | bool] = {"heartbeat_interval": 0.2, "lease_timeout": 2.0,
                                          "election_timeout": 3.0, "backup_timeout": 5.0}


@pytest.fixture()
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options=OPTIONS) as c:
        yield c


def promote(cluster: LocalCluster, via: str, target: str) -> None:
    """Hand the primary role to ``target``, asked again while the primary does not count
    it ready yet (409: it says ready before the primary has its acknowledgement)."""
    deadline = time.monotonic() + 60
    while True:
        done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                               cluster.url(via), "promote", target], capture_output=True,
                              text=True, timeout=30)
        if done.returncode == 0 or "409" not in done.stderr or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done.returncode == 0, done.stderr
    assert cluster.wait_primary(30, other_than=via) == target


def take(url: str, count: int) -> list[int]:
    """``count`` messages got and acknowledged (the head of the queue)."""
    conn = connect_any([url], time.monotonic() + 30)
    ch = conn.channel()
    got: list[int] = []
    while len(got) < count:
        method, _props, body = ch.basic_get(QUEUE, auto_ack=False)
        assert method is not None, f"the queue ran dry after {len(got)}"
        got.append(message_id(body))
        ch.basic_ack(method.delivery_tag)
    conn.close()
    return got


def kept_runs(db: Path) -> tuple[int, int]:
    """(runs whose contents stay in the log, runs SQL holds a copy of) in ``db``."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        refs, copies = conn.execute(
            f'SELECT sum(length("contents") = {REF_BYTES}), sum(length("contents") > '
            f'{REF_BYTES}) FROM "message_runs" WHERE "queue" = ?', (QUEUE,)).fetchone()
        return int(refs or 0), int(copies or 0)
    finally:
        conn.close()


def test_a_caught_up_backup_promoted_and_restarted_delivers_every_message_once(
        cluster: LocalCluster) -> None:
    primary = cluster.wait_primary(30)
    for name in cluster.names:
        cluster.wait_ready(name, 60)
    backup = next(n for n in cluster.names if n != primary)
    cluster.nodes[backup].stop()
    filled = fill([cluster.url(primary)], QUEUE, COUNT, 1024)
    assert len(filled.confirmed_ids) == COUNT, filled.errors
    consumed = take(cluster.url(primary), CONSUMED)

    cluster.start_node(backup)
    cluster.wait_ready(backup, 120)
    db = cluster.nodes[backup].data_dir / "brokerha.db"
    deadline = time.monotonic() + 20  # SQL applies the log's last file when the log is idle
    while (refs := kept_runs(db)[0]) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert refs > 0, f"the catch-up's runs were not kept in the log: {kept_runs(db)}"

    promote(cluster, primary, backup)
    cluster.nodes[backup].stop()  # its store is loaded from the kept files on restart
    other = cluster.wait_primary(60, other_than=backup)
    cluster.start_node(backup)
    cluster.wait_ready(backup, 120)
    promote(cluster, other, backup)
    time.sleep(0.5)

    drained = drain_ids([cluster.url(backup)], QUEUE, COUNT - CONSUMED)
    assert len(drained) == len(set(drained)), "a message delivered twice"
    assert set(drained) == filled.confirmed_ids - set(consumed)
