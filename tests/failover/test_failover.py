"""Three real nodes, real clients, the primary SIGKILLed / SIGSTOPped: nothing confirmed is lost."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from brokerha.testing import LocalCluster
from tests.failover.clients import ConfirmedPublisher, connect_any, drain, wait_rejoined

# short timeouts keep the tests quick; the defaults are in docs/ha.md
FAST = {"heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
        "backup_timeout": 3.0}
QUEUE = "ha-orders"


def declare(ch: object) -> None:
    ch.queue_declare(QUEUE, durable=True)  # type: ignore[attr-defined]


@pytest.fixture()
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options=FAST) as c:
        yield c


def wait_all_ready(cluster: LocalCluster, timeout: float = 30.0) -> str:
    primary = cluster.wait_primary(timeout)
    for name in cluster.names:
        node = cluster.nodes.get(name)
        if name != primary and node is not None and node.proc and node.proc.poll() is None:
            cluster.wait_ready(name, timeout)
    return primary


@pytest.fixture(scope="class")
def untouched_cluster() -> Iterator[LocalCluster]:
    """``TestAnUntouchedCluster``'s cluster, stopped after its tests."""
    with LocalCluster(3, options=FAST) as c:
        yield c


class TestAnUntouchedCluster:
    """The tests that only look at a cluster (no kill, pause, promotion or message left
    behind) share one: one cluster start instead of one each."""

    def test_cluster_elects_one_primary_and_ctl_shows_it(
            self, untouched_cluster: LocalCluster) -> None:
        cluster = untouched_cluster
        primary = wait_all_ready(cluster)
        done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                               cluster.url(cluster.names[0]), "status", "--json"],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        roles = {n["name"]: n["role"] for n in status["nodes"]}
        assert roles[primary] == "primary"
        assert sorted(r for n, r in roles.items() if n != primary) == ["backup", "backup"]
        epochs = {n["epoch"] for n in status["nodes"]}
        assert len(epochs) == 1 and epochs.pop() >= 1
        assert all(n["ready"] and n["pid"] and n["amqp_url"] for n in status["nodes"])
        backups = status["replication"]["backups"]
        assert set(backups) == set(cluster.names) - {primary}

    def test_backups_relay_amqp_clients_to_the_primary(
            self, untouched_cluster: LocalCluster) -> None:
        cluster = untouched_cluster
        primary = wait_all_ready(cluster)
        backup = next(n for n in cluster.names if n != primary)
        conn = connect_any([cluster.url(backup)], time.monotonic() + 5)
        try:
            status = cluster.status(backup)
            assert status is not None and status["node"]["relayed_connections"] == 1
            assert status["node"]["role"] == "backup" and not status["node"]["serving"]
            served = cluster.status(primary)
            assert served is not None and served["node"]["connections"] >= 1
        finally:
            conn.close()
        connect_any([cluster.url(primary)], time.monotonic() + 5).close()


def kill_primary_repeatedly(cluster: LocalCluster, kills: int) -> tuple[ConfirmedPublisher, list[float]]:
    primary = wait_all_ready(cluster)
    pub = ConfirmedPublisher(cluster.urls, QUEUE, declare=declare, pause=0.002)
    pub.start()
    gaps: list[float] = []
    for _ in range(kills):
        before = len(pub.confirmed)
        deadline = time.monotonic() + 20
        while len(pub.confirmed) < before + 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pub.error is None, pub.error
        killed_at = time.monotonic()
        cluster.kill(primary)
        confirmed_at_kill = len(pub.confirmed)
        new_primary = cluster.wait_primary(30, other_than=primary)
        while len(pub.confirmed) <= confirmed_at_kill and time.monotonic() < killed_at + 30:
            time.sleep(0.01)
        gaps.append(time.monotonic() - killed_at)
        cluster.restart(primary)  # comes back as a backup
        cluster.wait_ready(primary, 30)
        primary = new_primary
    pub.stop_event.set()
    pub.join(30)
    assert pub.error is None, pub.error
    return pub, gaps


def test_no_confirmed_message_lost_when_the_primary_is_killed(cluster: LocalCluster) -> None:
    pub, gaps = kill_primary_repeatedly(cluster, kills=2)
    got = drain(cluster.urls, QUEUE)
    missing = set(pub.confirmed) - set(got)
    assert not missing, f"confirmed but lost: {sorted(missing)[:20]} (of {len(missing)})"
    assert pub.reconnects >= 2
    assert max(gaps) < 10, gaps


def test_a_killed_primary_is_replaced_without_waiting_for_the_election_timeout() -> None:
    """The backups' links to a SIGKILLed primary close: they elect at once (Election.link_down).

    The timeouts here are long (3 s) so that only that path can elect a successor
    within half of one; a hang would still wait them out.
    """
    slow = {"heartbeat_interval": 0.2, "lease_timeout": 2.0, "election_timeout": 3.0,
            "backup_timeout": 5.0}
    with LocalCluster(3, options=slow) as c:
        primary = wait_all_ready(c, 60)
        killed_at = time.monotonic()
        c.kill(primary)
        new_primary = c.wait_primary(30, other_than=primary)
        elapsed = time.monotonic() - killed_at
        assert elapsed < 1.5, f"successor serving after {elapsed:.2f} s"
        conn = connect_any([c.url(n) for n in c.names if n != primary], time.monotonic() + 30)
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            declare(ch)
            ch.basic_publish("", QUEUE, b"after the kill")
        finally:
            conn.close()
        events = (c.status(new_primary) or {}).get("failovers", [])
        assert [e["epoch"] for e in events if e["event"] == "elected"][-1] >= 2


def test_paused_primary_is_deposed_and_rejoins_as_backup(cluster: LocalCluster) -> None:
    primary = wait_all_ready(cluster)
    cluster.pause(primary)
    try:
        new_primary = cluster.wait_primary(30, other_than=primary)
    finally:
        cluster.resume(primary)
    wait_rejoined(cluster, primary)
    assert cluster.primary() == new_primary


@pytest.mark.slow
def test_soak_many_primary_kills() -> None:
    with LocalCluster(3, options=FAST) as c:
        pub, gaps = kill_primary_repeatedly(c, kills=10)
        got = drain(c.urls, QUEUE)
        assert not set(pub.confirmed) - set(got)
        print(f"{len(pub.confirmed)} confirmed, {len(got)} drained "
              f"({len(got) - len(set(got))} duplicates), {pub.reconnects} reconnects")
        print(f"failover gaps: p50 {sorted(gaps)[len(gaps) // 2]:.2f} s, max {max(gaps):.2f} s")


def test_pika_publisher_and_aio_pika_consumer_through_kills(cluster: LocalCluster) -> None:
    """Every confirmed message is consumed (or still queued) after two primary kills."""
    from tests.failover.clients import AioPikaConsumer

    consumer = AioPikaConsumer(cluster.urls, QUEUE)
    wait_all_ready(cluster)
    consumer.start()
    pub, _ = kill_primary_repeatedly(cluster, kills=2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not set(pub.confirmed) <= set(consumer.consumed):
        time.sleep(0.1)
    consumer.stop_event.set()
    consumer.join(10)
    left = drain(cluster.urls, QUEUE)
    missing = set(pub.confirmed) - set(consumer.consumed) - set(left)
    assert not missing, f"confirmed but never consumed: {sorted(missing)[:20]}"
    assert consumer.consumed, "the aio-pika consumer consumed nothing"


def test_ctl_promote_hands_over_to_a_ready_backup(cluster: LocalCluster) -> None:
    primary = wait_all_ready(cluster)
    target = next(n for n in cluster.names if n != primary)

    def ctl(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                               cluster.url(primary), *argv], capture_output=True, text=True,
                              timeout=30)

    refused = ctl("--password", "wrong", "promote", target)
    assert refused.returncode == 1 and "401" in refused.stderr
    unknown = ctl("promote", "n9")
    assert unknown.returncode == 1 and "n9" in unknown.stderr
    done = ctl("promote", target)
    assert done.returncode == 0, done.stderr
    assert cluster.wait_primary(15, other_than=primary) == target
    cluster.wait_ready(primary, 30)
    st = cluster.status(primary)
    assert st is not None and st["node"]["role"] == "backup"  # type: ignore[index]
