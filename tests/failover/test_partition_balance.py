"""``brokerha ctl partitions balance`` on three real nodes (issue 35, P = 3, NR = 2,
``[cluster] partition_groups``).

Each partition starts led by its preferred cell (one a node). SIGKILL of B, the leader
of a partition off the metadata primary: its group elects among the two others. While
B is down, ``balance`` skips B's partition (its preferred cell is down) and exits 1.
B restarted from its data directory rejoins every group as a backup, nothing moves it
back; a client on the survivor that did not take B's partition publishes with
confirms to its queue (forwarded to its leader, ``partition/forwarding.py``); ``balance`` hands that
partition back to B (the group's ``TransferPrimary``, waited for), leaves the others,
exits 0: every partition led by its preferred cell again, only the moved group's epoch
changed; the publisher's connection stays open, nothing nacked, every confirmed
message on B's queue exactly once. A second ``balance`` moves nothing; an unreachable
node is exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    OPTIONS,
    StreamPublisher,
    connect,
    ctl_status,
    drain_ids,
    name_in,
    one_leader_each,
    promote,
    ready_everywhere,
    until,
)

pytestmark = pytest.mark.timeout(90)


class TimedPublisher(StreamPublisher):
    """``StreamPublisher`` noting when each confirm arrived."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(url, lambda _i: queue)
        self.confirmed_at: list[float] = []

    def _confirm(self, frame: Any) -> None:
        self.confirmed_at.append(time.monotonic())
        super()._confirm(frame)


def balance(cluster: LocalCluster, node: str, *args: str) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           cluster.url(node), "partitions", "balance", "--json", *args],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, json.loads(done.stdout) if done.stdout else {}, done.stderr


def epochs(status: dict[str, Any]) -> dict[str, tuple[str, int]]:
    return {g: (v["leader"], v["epoch"]) for g, v in status["groups"].items()}


@pytest.mark.parametrize("held_by", ["coordinator", "third-node"])
def test_balance_hands_a_returned_node_s_partition_back_to_it_online(held_by: str) -> None:
    """``held_by``: B's partition is led, when ``balance`` runs, by A (the coordinator
    hands it over itself) or by C (asked over C's admin listener); whichever survivor
    the failover elected, a ``ctl promote --partition`` puts it there first."""
    started = time.monotonic()
    with LocalCluster(3, options=OPTIONS) as cluster:
        names = cluster.names
        leaders = until("one serving primary per group", lambda: one_leader_each(cluster, names))
        until("every node ready in every group", lambda: ready_everywhere(cluster, names))
        status = ctl_status(cluster, names[0])
        preferred = [row["preferred_leader"] for row in status["partitions"]["rows"]]
        if [leaders[str(p + 1)] for p in range(3)] != preferred:
            pytest.skip(f"the partitions did not elect their preferred cells at the start: "
                        f"{leaders}, preferred {preferred}")
        code, report, _ = balance(cluster, names[0])
        assert code == 0 and report["moved"] == 0, report
        assert [line["status"] for line in report["partitions"]] == ["balanced"] * 3

        a = leaders["0"]
        b = next(n for n in names if n != a)
        moved = preferred.index(b)
        group = str(moved + 1)
        queue = name_in(moved, "bal")
        conn = connect(cluster, b)
        try:
            conn.channel().queue_declare(queue, durable=True)
        finally:
            conn.close()

        cluster.kill(b)
        survivors = [n for n in names if n != b]
        after_kill = until("B's partition elects among the others",
                           lambda: one_leader_each(cluster, survivors))
        assert after_kill[group] in survivors
        # B down: its partition skipped (its preferred cell did not answer), exit 1
        code, report, _ = balance(cluster, a, "--timeout", "3")
        assert code == 1 and report["unbalanced"] == [moved], report
        line = report["partitions"][moved]
        assert line["status"] == "skipped" and f"{b} is down" in line["reason"], line

        cluster.restart(b)
        until("B rejoins every group", lambda: ready_everywhere(cluster, names), timeout=30)
        rejoined = ctl_status(cluster, a)
        assert rejoined["groups"][group]["leader"] == after_kill[group]  # nothing moved it
        c = next(n for n in survivors if n != a)
        holder = a if held_by == "coordinator" else c
        if after_kill[group] != holder:
            until("the hand-over to the holder taken",
                  lambda: promote(cluster, a, holder, moved))
            until("the holder serves B's partition",
                  lambda: (one_leader_each(cluster, names) or {}).get(group) == holder)
            until("every node ready in every group", lambda: ready_everywhere(cluster, names))
            rejoined = ctl_status(cluster, a)

        # the client on the survivor that does not lead B's partition: it forwards to the
        # partition's leader, then to B (a client on the leader itself is that group's
        # client, closed 320 when its role ends, node/ha_groups.py)
        client_node = next(n for n in survivors if n != holder)
        client = TimedPublisher(cluster.url(client_node), queue)
        client.start()
        until("a few confirmed", lambda: len(client.acked) >= 300)
        asked = time.monotonic()
        code, report, stderr = balance(cluster, a)
        took = time.monotonic() - asked
        assert code == 0, (report, stderr)
        assert report["moved"] == 1 and report["unbalanced"] == [], report
        assert report["by"] == a  # the coordinator ran it
        line = report["partitions"][moved]
        assert line["status"] == "moved" and line["leader"] == holder, line
        at_balance = len(client.acked)
        until("confirms after the move", lambda: len(client.acked) >= at_balance + 300)
        client.finish()

        balanced = ctl_status(cluster, a)
        for g, (leader, epoch) in epochs(balanced).items():
            was_leader, was_epoch = epochs(rejoined)[g]
            if g == group:
                assert leader == b and epoch > was_epoch, (g, leader, epoch)
            else:  # no other group elected
                assert (leader, epoch) == (was_leader, was_epoch), (g, leader, epoch)
        assert [balanced["groups"][str(p + 1)]["leader"] for p in range(3)] == preferred

        assert client.done.is_set() and client.closed is None, repr(client.closed)
        assert not client.nacked and not client.outstanding
        got = drain_ids(cluster, b, queue)
        twice = [m for m, n in Counter(got).items() if n > 1]
        assert not twice, f"enqueued twice: {twice[:10]}"
        lost = set(client.acked) - {int(m) for m in got}
        assert not lost, f"confirmed and lost: {sorted(lost)[:10]}"
        window = [t for t in client.confirmed_at if asked <= t <= asked + took]
        gaps = [later - earlier for earlier, later in zip(window, window[1:], strict=False)]

        done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                               cluster.url(c), "partitions", "balance"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("already balanced") == 3, done.stdout
        assert "every partition led by its preferred cell" in done.stdout
        sender = (cluster.status(client_node) or {})["node"]["forwarding"]["sender"]
        assert sender["forwards"] > 0  # it went through forwarding
        print(f"client on {client_node}, forwarding {sender}")
        print(f"partition {moved} moved {line['leader']} -> {b} in {line['seconds']:.2f}s "
              f"(ctl {took:.2f}s); longest confirm gap during the balance "
              f"{max(gaps, default=0.0) * 1000:.0f} ms; {len(client.acked)} confirmed, "
              f"{len(got)} in the queue")
    done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                           "http://127.0.0.1:9", "partitions", "balance"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    print(f"whole test {time.monotonic() - started:.1f}s")
