"""``brokerha ctl status`` as text: publisher flow holds and long GC pauses (issue 33)."""

from __future__ import annotations

from typing import Any

import pytest

from brokerha.admin.ctl import _print_status


def status(**replication: Any) -> dict[str, Any]:
    node = {"name": "n1", "role": "primary", "epoch": 3, "ready": True, "pid": 42,
            "amqp_url": "amqp://127.0.0.1:5672",
            "gc": {"pause_seconds_max": 0.25, "collections": [900, 40, 2], "frozen": 123456}}
    quiet = {"name": "n2", "role": "backup", "epoch": 3, "ready": True, "pid": 43,
             "gc": {"pause_seconds_max": 0.02, "collections": [5, 1, 0], "frozen": 9}}
    return {"cluster": "dc1", "primary": "n1", "nodes": [node, quiet],
            "replication": {"seq": 10, "backups": {}, **replication}, "last_election": None}


def test_a_held_publisher_and_a_long_gc_pause_are_printed(
        capsys: pytest.CaptureFixture[str]) -> None:
    _print_status(status(publishers_held=True, publishers_held_by="n2", publisher_holds=3,
                         publishers_held_seconds=1.25))
    out = capsys.readouterr().out
    assert "publishers held now (flow: backup n2 lags); held 3 times, 1.2 s in all" in out
    assert "n1           GC: longest pause 0.250 s, collections 900/40/2, 123456 objects" in out
    assert "n2           GC" not in out  # its pauses stayed under 0.1 s


def test_nothing_about_flow_when_publishers_were_never_held(
        capsys: pytest.CaptureFixture[str]) -> None:
    _print_status(status(publishers_held=False, publisher_holds=0))
    assert "publishers" not in capsys.readouterr().out


def test_an_ha_replicate_change_not_applied_yet_is_printed(
        capsys: pytest.CaptureFixture[str]) -> None:
    _print_status(status(backups={"n2": {"ready": False, "rejoining": True, "acked": 9,
                                         "lag": 1}},
                         replicate_changes={"pending": True, "queues_pending": 1,
                                            "queues": ["'orders' in vhost '/': none -> all "
                                                       "(policy 'keep')"],
                                            "backups_to_join_again": ["n2"]}))
    out = capsys.readouterr().out
    assert "n2           joining again" in out
    assert ("ha-replicate changes not applied yet (1 queues: 'orders' in vhost '/': none -> "
            "all (policy 'keep')); backups to join again: n2") in out


def group(role: str, epoch: int, leader: str | None) -> dict[str, Any]:
    return {"role": role, "phase": role if role != "none" else "joining", "serving":
            role == "primary", "ready": True, "epoch": epoch, "leader": leader,
            "members": ["n1", "n2"], "position": [epoch, 0]}


def test_each_group_s_leader_is_the_node_that_says_it_leads_it_in_the_newest_epoch(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Nodes running partition groups (issue 35 stage 2): ``groups_view`` per group."""
    from brokerha.admin.ctl import groups_view

    nodes = [{"name": "n1", "groups": {"0": group("primary", 1, "n1"),
                                       "1": group("primary", 2, "n1")}},
             {"name": "n2", "groups": {"0": group("backup", 1, "n1"),
                                       "1": group("primary", 3, "n2")}},
             {"name": "n3", "role": "down"}]
    view = groups_view(nodes)
    assert view is not None and list(view) == ["0", "1"]
    assert (view["0"]["leader"], view["0"]["epoch"]) == ("n1", 1)
    assert (view["1"]["leader"], view["1"]["epoch"]) == ("n2", 3)  # n1's epoch 2 is older
    assert view["1"]["nodes"]["n1"] == {"role": "primary", "phase": "primary", "epoch": 2,
                                        "serving": True}
    assert groups_view([{"name": "n1"}]) is None  # no node runs groups
    _print_status({**status(), "groups": view})
    assert "    1  leader n2           epoch 3    n1:primary n2:primary" in \
        capsys.readouterr().out
