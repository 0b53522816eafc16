"""``brokerha ctl check-replicas`` (admin/check_ctl.py): which groups it asks, what it prints
and its exit code, over canned answers of the nodes."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from brokerha.admin import check_ctl
from brokerha.httpapi.client import CtlError

NODES = [{"name": n, "admin_url": f"http://{n}"} for n in ("n1", "n2", "n3")]


def single() -> dict[str, Any]:
    return {"nodes": NODES, "primary": "n1", "groups": None}


def grouped(leaders: dict[str, str | None]) -> dict[str, Any]:
    return {"nodes": NODES, "primary": "n1",
            "groups": {g: {"leader": leader} for g, leader in leaders.items()}}


def answer(group: int | None, primary: str, *, differs: bool = False,
           complete: bool = True) -> dict[str, Any]:
    diff = [{"what": "digest differs", "digest": 7}] if differs else []
    return {"group": group, "primary": primary, "epoch": 2, "seq": 40, "seconds": 0.05,
            "replicas": {primary: {"role": "primary", "reported": True, "seconds": 0.01,
                                   "caught_up": True, "why": None},
                         "n9": {"role": "backup", "reported": complete, "seconds": 0.02,
                                "caught_up": True,
                                "why": None if complete else "no report after 20.0 s"}},
            "queues": [{"vhost": "/", "name": "q", "mode": "all", "count": 3, "ha_id": "1.0.q",
                        "digest": 1, "replicas": {"n9": {"agree": not differs,
                                                         "differences": diff, "notes": []}}}],
            "differences": int(differs), "agree": not differs, "complete": complete,
            "primary_work": {}}


def run(status: dict[str, Any], answers: dict[str, dict[str, Any]], partition: int | None,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        as_json: bool = False) -> tuple[int, str, list[tuple[str, Any]]]:
    asked: list[tuple[str, Any]] = []

    def request(base: str, path: str, **kw: Any) -> dict[str, Any]:
        assert path == "/api/check-replicas"
        asked.append((base, kw["body"]))
        return dict(answers[base])

    monkeypatch.setattr(check_ctl, "request", request)
    args = argparse.Namespace(node="http://n1", partition=partition, timeout=20.0,
                              json=as_json, user="guest", password="guest")
    code = check_ctl.cmd_check_replicas(args, lambda node: status)
    return code, capsys.readouterr().out, asked


def test_one_group_is_asked_of_the_primary_and_agreement_exits_0(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, asked = run(single(), {"http://n1": answer(None, "n1")}, None, monkeypatch,
                           capsys)
    assert code == 0 and asked == [("http://n1", {"timeout": 20.0})]
    assert "queue 'q' (3 messages): n9 agrees" in out and out.endswith("every replica agrees\n")


def test_a_difference_exits_1_and_names_queue_and_node(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(single(), {"http://n1": answer(None, "n1", differs=True)}, None,
                       monkeypatch, capsys)
    assert code == check_ctl.DIFFERS == 1
    assert "queue 'q' (3 messages): n9 DIFFERS: digest differs" in out


def test_a_replica_not_compared_exits_3(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(single(), {"http://n1": answer(None, "n1", complete=False)}, None,
                       monkeypatch, capsys)
    assert code == check_ctl.INCOMPLETE == 3 and "NOT CHECKED (no report" in out


def test_partition_groups_each_asked_of_its_leader(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    status = grouped({"0": "n1", "1": "n2", "2": "n3", "3": "n1"})
    answers = {"http://n2": answer(1, "n2"), "http://n3": answer(2, "n3", differs=True),
               "http://n1": answer(3, "n1")}
    code, _, asked = run(status, answers, None, monkeypatch, capsys)
    assert code == 1  # the metadata group (0) holds no queue: not asked
    assert asked == [("http://n2", {"timeout": 20.0, "group": 1}),
                     ("http://n3", {"timeout": 20.0, "group": 2}),
                     ("http://n1", {"timeout": 20.0, "group": 3})]
    code, _, asked = run(status, answers, 1, monkeypatch, capsys)
    assert code == 1 and asked == [("http://n3", {"timeout": 20.0, "group": 2})]


def test_a_group_without_leader_is_not_checked(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, out, asked = run(grouped({"0": "n1", "1": None}), {}, None, monkeypatch, capsys)
    assert code == 3 and asked == [] and "group 1 (partition 0): NOT CHECKED" in out


def test_partition_asked_of_one_group_or_out_of_range_is_refused() -> None:
    with pytest.raises(CtlError, match="one replication group"):
        check_ctl.targets(single(), 0)
    with pytest.raises(CtlError, match="no group of partition 5"):
        check_ctl.targets(grouped({"0": "n1", "1": "n2"}), 5)
    standalone = {"nodes": [{"name": "n1", "role": "standalone"}], "primary": None}
    with pytest.raises(CtlError, match="standalone"):
        check_ctl.targets(standalone, None)
