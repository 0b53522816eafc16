"""``brokerha ctl partitions drain NODE`` on four real nodes (issue 35 stage 5: P = 4,
NR = 2, ``[cluster] partition_groups``): every partition has three cells, so each
partition D holds has one node to move to.

D (not the metadata primary, the leader of a partition if one is) is drained while a
client on another cell of that partition publishes with confirms, through forwarding,
to a queue of a partition D leads or holds (a node with no cell of the partition does
not know the queue: its publishes would be unroutable there). Each partition D holds gets a learner on the node without
a cell of it, caught up by the streamed catch-up; the coordinator marks it up to date;
the group makes it a voter and removes D, one voter at a time (D, leading, hands over
first). Then: the drain exits 0 and says D holds no cell and its loss stops no
partition; ``ctl partitions`` shows D in no cell; no group's leader counts D, D runs the
metadata group alone; the client's connection stayed open, nothing nacked, every
confirmed message is in the queue; SIGKILL of D elects in no group.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    FOUR_OPTIONS,
    P4,
    StreamPublisher,
    cells_of,
    connect,
    drain_ids,
    groups_of,
    leaders,
    queue_in,
    settled_leaders,
    table,
    until,
)

pytestmark = pytest.mark.timeout(150)

def test_drain_moves_every_cell_off_a_node_online() -> None:
    started = time.monotonic()
    with LocalCluster(4, options=FOUR_OPTIONS) as cluster:
        names = cluster.names
        lead = settled_leaders(cluster, timeout=40)
        coordinator = lead["0"][0]
        cells = cells_of(cluster, coordinator)
        # D: not the coordinator; one leading a partition if any does
        others = [n for n in names if n != coordinator]
        leading = [n for n in others if any(lead[str(p + 1)][0] == n for p in range(P4))]
        d = (leading or others)[0]
        held = sorted(p for p, row in cells.items() if d in row)
        assert held
        led_by_d = [p for p in held if lead[str(p + 1)][0] == d]
        p = (led_by_d or held)[0]
        group = str(p + 1)
        queue = queue_in(p, "drain")
        leader = lead[group][0]
        conn = connect(cluster, leader)
        try:
            conn.channel().queue_declare(queue, durable=True)
        finally:
            conn.close()
        # the client: on a cell of the partition that neither leads it nor is D -- a node
        # holding no cell of it does not know the queue (no directory stand-in yet): its
        # publishes there are unroutable, confirmed and dropped as RabbitMQ does
        client_node = next(n for n in cells[p] if n not in (d, leader))
        client = StreamPublisher(cluster.url(client_node), lambda _i: queue)
        client.start()
        until("a few confirmed", lambda: len(client.acked) >= 200, timeout=30)

        asked = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                               cluster.url(client_node), "partitions", "drain", d, "--json",
                               "--timeout", "20"], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - asked
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout)
        assert report["finished"] and report["cells"] == [] and report["stopped_by"] == [], \
            report
        assert report["by"] == coordinator
        assert len(report["lines"]) == len(held), report
        at_drain = len(client.acked)
        until("confirms after the drain", lambda: len(client.acked) >= at_drain + 200,
              timeout=30)
        client.finish()

        after = table(cluster, coordinator)
        assert all(d not in [c[0] for c in r["cells"]] for r in after["rows"]), after["rows"]
        assert all(c[1] == "U" for r in after["rows"] for c in r["cells"]), after["rows"]
        until("D runs the metadata group alone", lambda: sorted(groups_of(cluster, d)) == ["0"])
        for name in names:
            for g, status in groups_of(cluster, name).items():
                if g != "0":
                    assert d not in status["voters"] + status["learners"], (name, g, status)
        try:
            until("every group settled", lambda: leaders(cluster, names) is not None)
        except AssertionError:
            raise AssertionError({n: {g: (s["role"], s["serving"], s["epoch"], s["voters"])
                                      for g, s in groups_of(cluster, n).items()}
                                  for n in names}) from None
        before = leaders(cluster, names)
        assert before is not None

        assert client.done.is_set() and client.closed is None, repr(client.closed)
        assert not client.nacked and not client.outstanding
        leader_now = before[group][0]
        got = drain_ids(cluster, leader_now, queue)
        twice = [m for m, n in Counter(got).items() if n > 1]
        lost = set(client.acked) - {int(m) for m in got}
        if lost:
            for name in names:  # what the nodes said of the moves and roles
                print("\n".join(line for line in cluster.nodes[name].log
                                if "WARNING" in line and "stall" not in line))
        assert not lost, (f"confirmed and lost: {len(lost)} of {len(client.acked)}, "
                          f"{sorted(lost)[:10]}; {len(got)} in {queue} on {leader_now}, "
                          f"D {d}, leaders {before}, client on {client_node}")
        assert not twice, f"enqueued twice: {twice[:10]}"

        cluster.kill(d)
        survivors = [n for n in names if n != d]
        time.sleep(3.0)  # several election timeouts of FAST
        now = leaders(cluster, survivors)
        assert now is not None
        for g, (name, epoch) in now.items():
            if g != "0" or before[g][0] != d:
                assert (name, epoch) == before[g], (g, before[g], (name, epoch))
        print(f"drained {d} (partitions {held}, {len(led_by_d)} led) in {took:.2f}s "
              f"({report['seconds']:.2f}s on {coordinator}): {report['lines']}; client on "
              f"{client_node}: {len(client.acked)} confirmed, {len(got)} in the queue; "
              f"whole test {time.monotonic() - started:.1f}s")
