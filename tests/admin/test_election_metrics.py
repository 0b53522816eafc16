"""Elections by reason, step-downs, late heartbeats and the event loop's lag, as operators see
them: ``/metrics`` (admin/metrics.py), the management UI's node entries (management.py and
static/app.js), the status page (status_page.py) and ``ctl status`` (ctl.py).

The node is a stand-in carrying a real ``Broker``, a real ``LoopMonitor`` and the status an
HA member reports (``HANode.election_status`` over a real ``Election`` driven through a
failover on the election tests' in-memory network).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from brokerha.admin.ctl import last_election
from brokerha.broker.broker import Broker
from brokerha.cluster.election import CAMPAIGN_REASONS, STEPDOWN_REASONS, Election
from brokerha.node.ha import HANode
from brokerha.node.loop_monitor import LoopMonitor
from tests.admin.views import assert_overview_renders, samples, scrape, status_body, ui_entry
from tests.cluster.test_election import Mesh


def failed_over() -> tuple[Election, Election]:
    """A primary whose links closed (killed), then came back deposed: (successor, old)."""
    mesh = Mesh.of(3)
    old = mesh.elect()
    mesh.cut = {old}
    mesh.close_links_to(old)
    new = mesh.elect_other_than(old)
    mesh.cut = set()
    mesh.run(mesh.now + 2.0)  # the old one hears the newer epoch: stepped down
    return mesh.nodes[new], mesh.nodes[old]


class StandIn:
    """What the admin endpoints read of a node (admin/node_view.py), for an HA member."""

    def __init__(self, election: Election, role: str) -> None:
        self.broker = Broker("t")
        self.config = SimpleNamespace(name=election.me)
        self.connections: list[Any] = []
        self.admission = SimpleNamespace(refused=0)
        loop = asyncio.new_event_loop()
        self.loop_monitor = LoopMonitor(loop)  # never started: the lags are given below
        loop.close()
        for lag in [0.001] * 980 + [0.03] * 19 + [0.25]:
            self.loop_monitor.observe(lag)
        self.loop_monitor.stalls = 1
        self.ha = SimpleNamespace(primary=None)
        self.tls = None
        self.txlog = None
        # HANode.election_status reads its election and its clock (the election's, here 0)
        shell = SimpleNamespace(election=election, _now=lambda: election._now)  # noqa: SLF001
        self.election = HANode.election_status(shell)  # type: ignore[arg-type]
        self.role = role

    def status(self) -> dict[str, Any]:
        me = {"name": self.config.name, "role": self.role, "epoch": 3, "ready": True,
              "serving": self.role == "primary", "alarms": {},
              "disk": {"free": {}, "disk_free_limit": 0}, "election": self.election,
              "loop": self.loop_monitor.status()}
        return {"node": me, "cluster": "dc1", "members": None, "failovers": []}


def test_metrics_count_elections_and_step_downs_by_reason() -> None:
    new, old = failed_over()
    got = scrape(StandIn(new, "primary"))
    for reason in CAMPAIGN_REASONS:  # every reason a series, from 0 (Prometheus practice)
        assert ("brokerha_elections_total", (("reason", reason),)) in got
    assert got[("brokerha_elections_total", (("reason", "link_down"),))] == 1
    assert got[("brokerha_election_rounds_total", (("phase", "vote"),))] >= 1
    last = got[("brokerha_last_election_timestamp_seconds", ())]
    assert abs(last - time.time()) < 60  # Unix time, converted from the election's clock
    for reason in STEPDOWN_REASONS:
        assert ("brokerha_primary_stepdowns_total", (("reason", reason),)) in got
    assert got[("brokerha_heartbeats_late_total", ())] == 0
    assert ("brokerha_heartbeat_gap_max_seconds", ()) in got
    assert ("brokerha_lease_lapses_total", ()) in got
    assert ("brokerha_lease_lapses_renewed_total", ()) in got
    assert got[("brokerha_event_loop_stalls_total", ())] == 1
    assert got[("brokerha_event_loop_lag_max_seconds", ())] == 0.25

    deposed = scrape(StandIn(old, "backup"))
    assert deposed[("brokerha_primary_stepdowns_total", (("reason", "newer_epoch"),))] == 1
    assert deposed[("brokerha_elections_total", (("reason", "no_primary"),))] >= 1


def test_the_ui_and_the_status_page_show_elections_by_reason_and_the_loop_lag() -> None:
    new, old = failed_over()
    node = StandIn(new, "primary")
    ha = ui_entry(node)
    assert ha["election"]["elections"]["link_down"] == 1
    assert ha["election"]["last_election"]["reason"] == "link_down"
    assert ha["loop"]["lag_p99"] == 0.03 and ha["loop"]["lag_max"] == 0.25
    assert_overview_renders(".election)", ".loop)", "lag_p99", "lag_max", "last_election",
                            "stepdowns", "Elections (why)", "Loop lag p99 / max")

    html = status_body([{**node.status()["node"], "position": [3, 0]},
                        {**StandIn(old, "backup").status()["node"], "name": old.me}])
    assert "<th>elections</th><th>loop lag p99 / max</th>" in html
    assert "stood: link_down 1" in html and "last: link_down" in html
    assert "stepped down: newer_epoch 1" in html
    assert "30.0 / 250.0 ms" in html and "(1 stalls)" in html


def test_ctl_status_names_the_last_election_of_the_cluster() -> None:
    new, old = failed_over()
    nodes = [{"name": e.me, **StandIn(e, "x").status()["node"]} for e in (new, old)]
    last = last_election(nodes)
    assert last is not None and last["node"] == new.me and last["reason"] == "link_down"
    assert last["epoch"] == new.epoch
    assert last_election([{"name": "solo", "role": "standalone"}]) is None


def test_a_killed_primary_is_seen_as_a_link_down_election_on_a_real_cluster() -> None:
    """End to end: SIGKILL the primary of three real nodes; its successor's ``/metrics`` and
    ``ctl status --json`` say that it stood because its link to the primary closed."""
    import json
    import subprocess
    import sys
    import urllib.request

    from brokerha.testing import LocalCluster

    with LocalCluster(3) as cluster:
        old = cluster.wait_primary(30)
        for name in cluster.names:
            if name != old:
                cluster.wait_ready(name, 30)
        cluster.kill(old)
        new = cluster.wait_primary(30, other_than=old)
        with urllib.request.urlopen(cluster.admin_url(new) + "/metrics", timeout=5) as resp:
            got = samples(resp.read().decode())
        assert got[("brokerha_elections_total", (("reason", "link_down"),))] >= 1
        assert got[("brokerha_last_election_timestamp_seconds", ())] > time.time() - 60
        done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                               cluster.url(new), "status", "--json"],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        last = status["last_election"]
        assert last["reason"] == "link_down" and last["at"] > time.time() - 60, last
        entry = next(n for n in status["nodes"] if n["name"] == new)
        assert entry["election"]["elections"]["link_down"] >= 1
        assert set(entry["loop"]) >= {"lag_p99", "lag_max", "stalls"}
