"""A network partition between nodes (a fault-injecting proxy on loopback).

The primary is cut off from both backups while it and its clients stay up:
it must stop serving within its lease, the majority side elects a new primary,
no confirmed message is lost, and after the heal the old primary rejoins as a
backup. The minority never confirms anything on its own.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from brokerha.testing import LocalCluster, free_port
from tests.failover.clients import ConfirmedPublisher, drain, wait_rejoined
from tests.failover.test_failover import FAST, QUEUE, declare, wait_all_ready
from tests.netfaults import Partition


@pytest.fixture()
def proxied() -> Iterator[tuple[LocalCluster, Partition]]:
    cluster = LocalCluster(3, options=FAST)
    text = cluster.config.read_text()
    routes: dict[str, tuple[int, int]] = {}
    for name in cluster.names:
        real = cluster.port(name) + 20000
        proxy = free_port()
        routes[name] = (proxy, real)
        text = text.replace(f'cluster = "127.0.0.1:{real}"\n',
                            f'cluster = "127.0.0.1:{proxy}"\ncluster_bind = "127.0.0.1:{real}"\n')
    cluster.config.write_text(text)
    assert len(re.findall("cluster_bind", text)) == 3
    partition = Partition(routes)
    try:
        cluster.start()
        yield cluster, partition
    finally:
        cluster.close()
        partition.close()


def test_isolated_primary_stops_serving_and_majority_fails_over(
        proxied: tuple[LocalCluster, Partition]) -> None:
    cluster, partition = proxied
    primary = wait_all_ready(cluster)
    pub = ConfirmedPublisher(cluster.urls, QUEUE, declare=declare, pause=0.002)
    pub.start()
    deadline = time.monotonic() + 20
    while len(pub.confirmed) < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    partition.isolate(primary)
    cut_at = time.monotonic()
    confirmed_at_cut = len(pub.confirmed)
    new_primary = cluster.wait_primary(30, other_than=primary)
    # the old primary gave up serving (its lease ran out without a majority)
    st = cluster.status(primary)
    assert st is not None and st["node"]["role"] != "primary", st
    while len(pub.confirmed) < confirmed_at_cut + 100 and time.monotonic() < cut_at + 30:
        time.sleep(0.05)
    assert len(pub.confirmed) >= confirmed_at_cut + 100, "publishing did not resume"
    partition.heal()
    wait_rejoined(cluster, primary)
    pub.stop_event.set()
    pub.join(30)
    assert pub.error is None, pub.error
    assert cluster.primary() == new_primary
    got = drain(cluster.urls, QUEUE)
    missing = set(pub.confirmed) - set(got)
    assert not missing, f"confirmed but lost: {sorted(missing)[:20]}"


def test_minority_primary_confirms_nothing(proxied: tuple[LocalCluster, Partition]) -> None:
    """Cut both backups from each other and from the primary: no majority anywhere."""
    cluster, partition = proxied
    primary = wait_all_ready(cluster)
    for name in cluster.names:
        partition.isolate(name)
    time.sleep(FAST["lease_timeout"] + 0.5)
    assert cluster.primary() is None, "a primary without a majority still serves"
    assert all((cluster.status(n) or {"node": {}})["node"].get("role") != "primary"  # type: ignore[index]
               for n in cluster.names)
    partition.heal()
    cluster.wait_primary(30)
    _ = primary
