"""The partition table on three real nodes (issue 35, stage 1): the metadata primary makes
it at the cluster's start, every node holds the same (``ctl status --json``), it survives
the primary's SIGKILL unchanged (same ptid, same rows on the new primary: not made or
tweaked again), and ``ctl partitions`` prints it."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import ctl
from tests.failover.test_failover import FAST, wait_all_ready

pytestmark = pytest.mark.timeout(180)


def status(cluster: LocalCluster, name: str) -> dict[str, Any]:
    return dict(json.loads(ctl(cluster, name, "status", "--json")))


def tables(view: dict[str, Any]) -> dict[str, Any]:
    """Each answering node's own copy of the table."""
    return {n["name"]: n["partitions"] for n in view["nodes"] if n.get("partitions")}


def until_same(cluster: LocalCluster, name: str, nodes: int,
               timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        view = status(cluster, name)
        copies = tables(view)
        if (len(copies) == nodes and view["partitions"] is not None
                and view["partitions"]["same_on_every_node"]):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"the nodes' tables differ: {json.dumps(copies)[:600]}")
        time.sleep(0.2)


def test_the_table_is_the_same_everywhere_and_survives_the_primary_s_sigkill() -> None:
    with LocalCluster(3, options=FAST) as cluster:
        primary = wait_all_ready(cluster)
        view = until_same(cluster, primary, 3)
        table = view["partitions"]
        assert table["ptid"] == 1 and table["partitions"] == 9 and table["num_replicas"] == 2
        assert table["from"] == primary and table["routing"] is False
        assert [row["preferred_leader"] for row in table["rows"]] == \
            sorted(cluster.names) * 3
        assert all(sorted(c[0] for c in row["cells"]) == sorted(cluster.names)
                   and {c[1] for c in row["cells"]} == {"U"} for row in table["rows"])
        assert table["operational"] == list(range(9))
        assert table["stopped_by"] == {n: [] for n in sorted(cluster.names)}
        coordinator = {n["name"]: n["partitions"]["coordinator"] for n in view["nodes"]}
        assert coordinator == {n: n == primary for n in cluster.names}
        before = tables(view)[primary]

        cluster.kill(primary)
        new = cluster.wait_primary(30, other_than=primary)
        survivors = [n for n in cluster.names if n != primary]
        view = until_same(cluster, new, 2)
        after = tables(view)
        assert after[new]["coordinator"]
        for name in survivors:  # same ptid, same rows: not made or tweaked again
            assert (after[name]["ptid"], after[name]["rows"]) == (before["ptid"], before["rows"])
        # with one node down a majority of every partition's cells is still up, but
        # losing either survivor now would stop every partition
        assert view["partitions"]["operational"] == list(range(9))
        assert view["partitions"]["stopped_by"] == {
            **{n: list(range(9)) for n in survivors}, primary: []}

        text = ctl(cluster, new, "partitions")
        assert "partition table: ptid 1, 9 partitions, 2 replicas (NR)" in text
        lines = [line.split() for line in text.splitlines()]
        header = next(i for i, words in enumerate(lines) if words[:2] == ["partition", "ptid"])
        rows = lines[header + 1:header + 10]
        assert [r[0] for r in rows] == [str(p) for p in range(9)]
        assert all(r[1] == "1" for r in rows)
        assert rows[0][2] == sorted(cluster.names)[0]
        assert rows[0][3:6] == [f"{n}:U" for n in sorted(cluster.names)]
        assert f"losing {survivors[0]} would stop partitions 0, 1, 2" in text

        cluster.start_node(primary)  # back: its copy (from its own store) is the same
        cluster.wait_ready(primary, 60)
        view = until_same(cluster, new, 3)
        assert tables(view)[primary]["rows"] == before["rows"]
        assert view["partitions"]["ptid"] == 1
