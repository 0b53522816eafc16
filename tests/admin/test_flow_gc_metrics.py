"""Publisher flow control and the cyclic GC, as operators see them (issue 33): ``/metrics``
(admin/metrics.py), the logs of a hold (broker/flow.py), the primary's replication status,
the management UI's node entries (management.py, static/app.js) and the status page.

The holds come from a real ``Primary`` on the HA harness (virtual clock) whose backup n2
stops acknowledging (tests/ha/test_flow.py); the GC figures from a real ``GCGovernor``
installed in this process. The node is the election metrics' stand-in carrying them.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from brokerha.broker import flow as flow_module
from brokerha.broker.broker import Broker
from brokerha.node.gc_governor import GCGovernor
from tests.admin.test_election_metrics import StandIn, failed_over
from tests.admin.views import assert_overview_renders, scrape, status_body, ui_entry
from tests.ha.harness import Cluster
from tests.ha.test_flow import lagging_cluster, later, n2_lags

HELD = ("brokerha_publishers_held", ())
HOLDS = ("brokerha_publisher_flow_holds_total", ())
SECONDS = ("brokerha_publisher_flow_held_seconds_total", ())
N2_HOLDS = ("brokerha_backup_flow_holds_total", (("backup", "n2"),))


def node_with(broker: Broker | None = None, governor: GCGovernor | None = None) -> StandIn:
    node = StandIn(failed_over()[0], "primary")
    if broker is not None:
        node.broker = broker
    node.gc = governor  # type: ignore[attr-defined]
    return node


def held_cluster() -> tuple[Cluster, StandIn]:
    """n2 stopped acknowledging: publishers held at 0.15 s (flow_lag 0.1 s)."""
    c, _ = lagging_cluster()
    c.primary.backup_timeout = 60.0  # n2 stays guarded: the hold lasts
    n2_lags(c)
    later(c, 0.15)
    assert c.broker.flow.held
    return c, node_with(c.broker)


def test_metrics_show_a_hold_its_seconds_and_the_backup_whose_lag_started_it() -> None:
    before = scrape(node_with())
    assert before[HELD] == 0 and before[HOLDS] == 0 and before[SECONDS] == 0
    c, node = held_cluster()
    later(c, 1.0)
    got = scrape(node)
    assert got[HELD] == 1 and got[HOLDS] == 1 and got[N2_HOLDS] == 1
    assert got[SECONDS] == pytest.approx(1.0)  # the hold in force counts as it goes
    backup = c.nodes["n2"].backup
    assert backup is not None
    c.primary.backup_acked("n2", backup.applied_seq)  # n2 caught up: released
    later(c, 3.0)
    got = scrape(node)
    assert got[HELD] == 0 and got[HOLDS] == 1
    assert got[SECONDS] == pytest.approx(1.0)  # nothing added once released


def test_the_primary_status_says_who_holds_publishers_and_for_how_long() -> None:
    c, _ = held_cluster()
    later(c, 0.5)
    status = c.primary.status()
    assert set(flow_module.STATUS_KEYS) <= set(status)
    assert status["publishers_held"] is True and status["publishers_held_by"] == "n2"
    assert status["publisher_holds"] == 1 and status["publisher_holds_by"] == {"n2": 1}
    assert status["publishers_held_seconds"] == pytest.approx(0.5)


def flow_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == flow_module.log.name and r.levelno == level]


def test_a_long_hold_is_a_warning_naming_the_backup_and_its_release_says_how_long(
        caplog: pytest.LogCaptureFixture) -> None:
    c, _ = held_cluster()  # held at 0.15 s
    bound = flow_module.HELD_WARNING
    with caplog.at_level(logging.INFO, logger=flow_module.log.name):
        later(c, 0.9 * bound)
        assert not flow_lines(caplog, logging.WARNING)
        later(c, 0.2 * bound)
        later(c, bound)  # once per hold, not at every check
        warnings = flow_lines(caplog, logging.WARNING)
        assert warnings == [f"publishers held (flow) for {1.1 * bound:.1f}s: backup n2 has not "
                            f"acknowledged for {1.1 * bound + 0.15:.2f}s (flow_lag 0.1s)"]
        backup = c.nodes["n2"].backup
        assert backup is not None
        c.primary.backup_acked("n2", backup.applied_seq)
    released = [line for line in flow_lines(caplog, logging.INFO) if "released" in line]
    assert released == [f"publishers released (flow) after {2.1 * bound:.2f}s (held: backup n2 "
                        "has not acknowledged for 0.15s (flow_lag 0.1s))"], released


@pytest.fixture
def governor() -> Iterator[GCGovernor]:
    g = GCGovernor()
    g.install()
    yield g
    g.uninstall()
    gc.unfreeze()


def test_metrics_show_gc_collections_pauses_and_frozen_objects(governor: GCGovernor) -> None:
    gc.unfreeze()
    kept = [[i] for i in range(20_000)]
    node = node_with(governor=governor)
    gc.collect()  # a full collection: its survivors (``kept`` among them) are frozen
    governor.count_frozen()  # as the thaw check does (stats never walks them)
    gc.disable()  # no collection while the figures are compared
    try:
        got = scrape(node)
    finally:
        gc.enable()
    full = (("generation", "2"),)
    assert got[("brokerha_gc_collections_total", full)] == governor.collections[2] >= 1
    assert got[("brokerha_gc_pause_seconds_count", full)] == governor.collections[2]
    assert got[("brokerha_gc_pause_seconds_sum", full)] > 0
    assert got[("brokerha_gc_pause_seconds_bucket", (*full, ("le", "+Inf")))] >= 1
    for generation in "01":
        assert ("brokerha_gc_collections_total", (("generation", generation),)) in got
    assert got[("brokerha_gc_pause_max_seconds", ())] == governor.pause_max > 0
    assert got[("brokerha_gc_frozen_objects", ())] >= len(kept)
    assert got[("brokerha_gc_thaws_total", ())] == 0
    assert ("brokerha_gc_thaws_skipped_total", ()) in got
    assert got[("brokerha_gc_bulk_freezes_total", ())] == (governor.bulk_freezes
                                                          + governor.bulk_walks_frozen)


def test_the_ui_and_the_status_page_show_flow_holds_and_the_gc_pause_max() -> None:
    c, node = held_cluster()
    rep = c.primary.status()
    gc_stats: dict[str, Any] = {"collections": [120, 60, 1], "pause_seconds_max": 0.0425,
                                "frozen": 345_678, "thaws": 0, "thaws_skipped": 0}
    me = {**node.status()["node"], "replication": rep, "gc": gc_stats}
    ha = ui_entry(node, me)
    assert ha["flow"]["publishers_held"] is True and ha["flow"]["publishers_held_by"] == "n2"
    assert ha["flow"]["publisher_holds"] == 1 and ha["gc"]["pause_seconds_max"] == 0.0425
    assert_overview_renders(".flow)", ".gc)", "publishers_held", "publishers_held_by",
                            "publisher_holds", "publishers_held_seconds", "pause_seconds_max",
                            "Publishers held (flow)", "GC pause max")

    html = status_body([{**me, "position": [3, 0]}], rep)
    assert "<th>loop lag p99 / max</th><th>GC pause max</th>" in html
    assert "42.5 ms <span class=muted>(collections 120/60/1, 345678 frozen)" in html
    assert ("publishers held (flow): <span id=flow><span class=down>held</span> (n2)</span> "
            "<span class=muted>(1 holds, 0.0 s)") in html
