"""The partition test: three nodes in network namespaces, iptables DROP, nothing confirmed lost.

docs/ha.md, "Failure history": the first run of this test from outside lost
700-1,100 committed transactions per run; a node that had just lost its
lease still accepted connections and answered ``tx.commit-ok`` on its local
fsync. Here (``tests/netns.py``, ``tests/jepsen.py``) two pika publishers
with all three URLs commit transactions of 10 persistent messages (or
publish with confirms) through five faults in a row -- the primary cut from
both backups but not from the clients, one backup cut from everyone, n1 <->
n3 cut, the primary's links flapping, the primary's packets delayed
150 ms +- 50 ms with 2 % loss -- with the shipped election timing; the
cluster settles after each; the drain holds every committed message, no
transaction partly. The default suite holds each fault 3 s; ``-m slow`` runs
three rounds of longer faults per mode (``benchmarks/partition.py`` for runs
of any length, with a table).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import jepsen
from tests.netns import NamespacedCluster, available

WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture()
def cluster() -> Iterator[NamespacedCluster]:
    with NamespacedCluster() as c:
        yield c


def assert_nothing_lost(report: jepsen.Report, cluster: NamespacedCluster) -> None:
    assert report.ok, jepsen.describe(report, cluster)
    assert report.committed > 100, report.table()  # it did publish through the faults
    assert report.duplicates == 0, report.table()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["tx", "confirm"])
def test_five_faults_lose_no_committed_message(cluster: NamespacedCluster, mode: str) -> None:
    report = jepsen.run(cluster, mode=mode, hold=3.0, seed=1, log=lambda _line: None)
    assert_nothing_lost(report, cluster)
    assert report.epochs >= 2, report.table()  # the faults did depose a primary


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["tx", "confirm"])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_longer_faults_three_rounds_lose_nothing(mode: str, seed: int) -> None:
    with NamespacedCluster(seed=seed) as c:
        report = jepsen.run(c, mode=mode, hold=8.0, seed=seed, rounds=3,
                            log=lambda _line: None)
        assert_nothing_lost(report, c)
