"""A changed ``ha-replicate`` on existing queues (issue 34), as operators see it besides
``ctl status``: ``/metrics`` (admin/metrics.py), the management UI's node entries
(management.py, static/app.js) and the status page (status_page.py).

The change comes from a real ``Primary`` on the HA harness (tests/ha/test_replicate_change.py):
``q`` goes from ``none`` to ``all`` while n3 hears nothing, so n2 joins again and the
change waits for n3; then n3 hears again and the change is applied. The node is the
election metrics' stand-in, as an HA primary whose status carries that primary's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.admin.test_election_metrics import StandIn, failed_over
from tests.admin.views import assert_overview_renders, scrape, status_body, ui_entry
from tests.ha.harness import Cluster, publish
from tests.ha.test_replicate_change import cluster, policy

PENDING = ("brokerha_replicate_changes_pending", ())
APPLIED = ("brokerha_replicate_changes_applied_total", ())
REJOINS = ("brokerha_backup_rejoins_asked_total", ())


class PrimaryStandIn(StandIn):
    """The stand-in as the harness's HA primary: its broker, its replication status."""

    def __init__(self, c: Cluster) -> None:
        super().__init__(failed_over()[0], "primary")
        self.cluster = c
        self.broker = c.broker
        self.ha = SimpleNamespace(primary=c.primary)

    def status(self) -> dict[str, Any]:
        out = super().status()
        out["node"]["replication"] = self.cluster.primary.status()
        return out


def waiting_for_n3() -> tuple[Cluster, PrimaryStandIn]:
    """``q`` (5 messages) changed from none to all; n2 joined again, n3 hears nothing."""
    c = cluster(mode="none")
    for i in range(5):
        publish(c.broker, b"%d" % i, rk="q")
    c.pump()
    c.silent.add("n3")
    c.broker.definitions.apply(policy("all"))
    c.pump()
    changes = c.primary.status()["replicate_changes"]
    assert changes["pending"] and changes["joining_again"] == "n3"
    return c, PrimaryStandIn(c)


def test_metrics_show_the_queues_not_applied_the_changes_applied_and_the_joins_asked() -> None:
    before = scrape(PrimaryStandIn(cluster(mode="none")))
    assert before[PENDING] == 0 and before[APPLIED] == 0 and before[REJOINS] == 0
    c, node = waiting_for_n3()
    got = scrape(node)
    assert got[PENDING] == 1 and got[APPLIED] == 0
    assert got[REJOINS] == 2  # n2, then n3 (which has not answered)
    c.silent.clear()
    c.pump()
    got = scrape(node)
    assert got[PENDING] == 0 and got[APPLIED] == 1 and got[REJOINS] == 2


def test_a_node_that_is_not_the_primary_has_none_of_them() -> None:
    got = scrape(StandIn(failed_over()[1], "backup"))
    assert PENDING not in got and APPLIED not in got and REJOINS not in got


def test_the_ui_and_the_status_page_show_a_change_not_applied_and_whom_it_waits_for() -> None:
    c, node = waiting_for_n3()
    rep = c.primary.status()
    changes = ui_entry(node)["replicate_changes"]
    assert changes["pending"] is True and changes["queues_pending"] == 1
    assert changes["joining_again"] == "n3" and changes["backups_to_join_again"] == ["n3"]
    assert changes["applied_queues"] == 0 and changes["joins_asked"] == 2
    assert_overview_renders(".replicate_changes)", "queues_pending", "joining_again",
                            "backups_to_join_again", "applied_queues", "joins_asked",
                            "ha-replicate changes")

    nodes = [{**node.status()["node"], "position": [3, 0]}]
    html = status_body(nodes, rep)
    assert ("; ha-replicate changes: <span id=replicate-changes><span class=joining title="
            "'&#x27;q&#x27; in vhost &#x27;/&#x27;: none -&gt; all (policy &#x27;ha&#x27;)'>"
            "1 queues not applied</span> (joining again: n3; to join again: n3)</span> "
            "<span class=muted>(0 applied, 2 joins again asked)</span>") in html

    c.silent.clear()
    c.pump()
    html = status_body(nodes, c.primary.status())
    assert ("ha-replicate changes: <span id=replicate-changes>none pending</span> "
            "<span class=muted>(1 applied, 2 joins again asked)</span>") in html
