"""TxLog masters as real processes on loopback: ordering, crash/restart, split/heal, ctl.

Each test starts its own `brokerha txlog node` processes (free ports, fresh
data directories) and talks to them through their local API, exactly as an
operator or a later broker integration would.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from brokerha.cli import main
from tests.txlog.masters import Master, make_masters, running_group, wait_for

pytestmark = pytest.mark.timeout(60)

DCS = ["dc1", "dc2", "dc3"]


def submit_concurrently(group, per_dc: int, wait: str = "confirm") -> list[str]:
    """``per_dc`` transactions in every DC at once; returns the confirmed ids."""
    ids: list[str] = []
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            for i in range(per_dc):
                ids.append(group[name].tx(f"{name}-m{i}", wait=wait)["tx_id"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in group.masters]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        group.assert_prefix_consistent()  # the safety invariant, sampled while rounds run
        time.sleep(0.05)
    assert not errors, errors
    return ids


def test_three_masters_agree_on_one_order_and_validate_the_same_way(tmp_path: Path) -> None:
    with running_group(tmp_path, DCS) as group:
        ids = submit_concurrently(group, per_dc=6)
        log = group.wait_converged(set(ids))
        assert sorted(log) == sorted(ids)

        # a dequeue races in two DCs: exactly one wins, and every DC says which
        group["dc1"].tx("shared-msg", queue="/jobs", wait="synchronised")
        outcomes: dict[str, str] = {}

        def take(name: str) -> None:
            outcomes[name] = group[name].tx("shared-msg", queue="/jobs", kind="dequeue")["outcome"]

        threads = [threading.Thread(target=take, args=(n,)) for n in ("dc2", "dc3")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes.values()) == ["committed", "failed"]
        group.wait_converged()
        group.wait_applied()
        per_dc = {n: [(e["tx_id"], e["outcome"]) for e in group[n].entries()] for n in DCS}
        assert per_dc["dc1"] == per_dc["dc2"] == per_dc["dc3"]

        status = group["dc1"].status()
        assert status["members"] == DCS and not status["split"]
        assert all(p["connected"] for p in status["peers"])
        assert status["latency_ms"]["samples"] >= 6


def test_unknown_master_and_wrong_group_are_refused(tmp_path: Path) -> None:
    with running_group(tmp_path, ["dc1", "dc2"]) as group:
        # "dc0" sorts first, so it dials dc1 (one link per pair); dc1 does not know it
        intruder, stranger = make_masters(tmp_path, ["dc0", "dc05"]).values()
        intruder.write_config([group["dc1"]])
        stranger.write_config([group["dc1"]], group="another-group")
        try:
            intruder.start()
            stranger.start()
            wait_for(lambda: "is not a configured peer" in group["dc1"].log_text(), 10,
                     "dc1 refuses dc0")
            wait_for(lambda: "is not of cluster" in group["dc1"].log_text(), 10,
                     "dc1 refuses another group")
            status = group["dc1"].status()
            assert [p["id"] for p in status["peers"]] == ["dc2"]
            assert not intruder.status()["peers"][0]["connected"]
            tx = group["dc1"].tx("after-intruder", wait="synchronised")
            assert group.wait_converged({tx["tx_id"]})
        finally:
            intruder.stop()
            stranger.stop()


def test_sigkilled_master_restarts_on_its_data_dir_and_loses_nothing(tmp_path: Path) -> None:
    with running_group(tmp_path, DCS) as group:
        before = submit_concurrently(group, per_dc=3)
        group.wait_converged(set(before))
        # acquired (confirmed: enqueue-only is confirmed once acquired), then killed at once
        acquired = [group["dc2"].tx(f"last-words-{i}")["tx_id"] for i in range(3)]
        group["dc2"].kill()
        during = [group["dc1"].tx("while-down")["tx_id"], group["dc3"].tx("while-down")["tx_id"]]
        time.sleep(0.5)
        group["dc2"].start()
        log = group.wait_converged(set(before) | set(acquired) | set(during), timeout=20)
        assert log[: len(before)] == sorted(before, key=log.index)
        events = [e["kind"] for e in group["dc2"].status()["events"]]
        assert "restart" in events
        after = group["dc2"].tx("after-restart", wait="synchronised")
        group.wait_converged({after["tx_id"]})


@pytest.mark.parametrize("strategy", ["simple", "smart"])
def test_split_both_sides_continue_and_converge_on_heal(tmp_path: Path, strategy: str) -> None:
    with running_group(tmp_path, DCS, wan=True, **{"split-recovery": strategy,
                                                   "max-peer-lag": 1200}) as group:
        base = group["dc1"].tx("before-split", wait="synchronised")["tx_id"]
        group.wait_converged({base})
        group.wan.isolate("dc3")
        # each side orders its own transactions once it has dropped the other (MaxPeerLag)
        majority = group["dc1"].tx("majority-side", wait="synchronised", timeout=15)
        minority = group["dc3"].tx("minority-side", wait="synchronised", timeout=15)
        assert all(group[n].status()["split"] for n in DCS)
        group.assert_prefix_consistent(["dc1", "dc2"])
        assert minority["tx_id"] not in group["dc1"].ids()

        group.wan.heal()
        # the loser's post-split transaction comes back renegotiated: a new id, replay_of the old
        replayed = wait_for(lambda: [e for e in group["dc1"].entries()
                                     if e["replay_of"] == minority["tx_id"]], 20,
                            "the minority's transaction renegotiated")
        assert replayed[0]["origin"] == "dc3"
        log = group.wait_converged({base, majority["tx_id"], replayed[0]["tx_id"]}, timeout=20)
        assert minority["tx_id"] not in log

        group.wait_applied()
        statuses = {n: group[n].status() for n in DCS}
        assert all(not s["split"] and s["members"] == DCS for s in statuses.values())
        kinds = {n: [e["kind"] for e in s["events"]] for n, s in statuses.items()}
        assert all("split-detected" in k and "rejoin" in k for k in kinds.values())
        restored = {n for n, k in kinds.items() if "restore" in k}
        # Simple: every master restores its backup and replays; Smart: only the loser
        assert restored == (set(DCS) if strategy == "simple" else {"dc3"})
        winner = next(e for e in statuses["dc3"]["events"] if e["kind"] == "rejoin")
        assert winner["detail"]["winner"] in ("dc1", "dc2")
        assert all(s["applied"] == len(log) for s in statuses.values())


def ctl(capsys: pytest.CaptureFixture[str], master: Master, *args: str) -> str:
    capsys.readouterr()
    code = main(["txlog", "ctl", "--node", master.api, *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_ctl_adds_and_removes_a_peer_and_exports(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    peers = {"dc1": ["dc2"], "dc2": ["dc1"], "dc3": ["dc1", "dc2"]}
    with running_group(tmp_path, DCS, peers=peers) as group:
        early = group["dc1"].tx("two-dc-era", wait="synchronised")["tx_id"]
        assert early not in group["dc3"].ids()

        out = ctl(capsys, group["dc1"], "add-peer", "dc3", group["dc3"].url)
        assert "peer dc3 added" in out
        ctl(capsys, group["dc2"], "add-peer", "dc3", group["dc3"].url)
        late = group["dc3"].tx("three-dc-era", wait="synchronised", timeout=20)["tx_id"]
        log = group.wait_converged({early, late}, timeout=20)

        status = json.loads(ctl(capsys, group["dc1"], "status", "--json"))
        assert status["members"] == DCS and {p["id"] for p in status["peers"]} == {"dc2", "dc3"}
        assert "master dc1" in ctl(capsys, group["dc1"], "status")

        out_dir = tmp_path / "export"
        assert "synchronised.parquet" in ctl(capsys, group["dc1"], "export", "--out", str(out_dir))
        table = pq.read_table(out_dir / "dc1" / "synchronised.parquet").to_pylist()
        assert [r["tx_id"] for r in sorted(table, key=lambda r: r["position"])] == log
        assert pq.read_table(out_dir / "dc1" / "incoming.parquet").num_rows == 0
        assert json.loads((out_dir / "dc1" / "meta.json").read_text())["master"] == "dc1"

        ctl(capsys, group["dc1"], "remove-peer", "dc3")
        ctl(capsys, group["dc2"], "remove-peer", "dc3")
        without = group["dc1"].tx("after-removal", wait="synchronised", timeout=10)["tx_id"]
        group.wait_converged({without}, names=["dc1", "dc2"])
        assert {p["id"] for p in group["dc1"].status()["peers"]} == {"dc2"}
        capsys.readouterr()
        assert main(["txlog", "ctl", "--node", group["dc1"].api, "remove-peer", "dc3"]) == 1
        assert "not a configured peer" in capsys.readouterr().err
