"""Each group's epoch and vote in the node's state file (brokerha/partition/state.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from brokerha.partition.state import GroupStateFile


def test_each_groups_vote_survives_a_restart_in_one_file(tmp_path: Path) -> None:
    states = GroupStateFile(tmp_path)
    assert states.states == {}
    states.save(0, epoch=3, voted_for="n2")
    states.save(2, epoch=7, voted_for=None)
    states.save(2, epoch=8, voted_for="n1")
    again = GroupStateFile(tmp_path)
    assert {g: (s.epoch, s.voted_for) for g, s in again.states.items()} == {
        0: (3, "n2"), 2: (8, "n1")}
    assert json.loads((tmp_path / "cluster-state.json").read_text()) == {
        "groups": {"0": {"epoch": 3, "voted_for": "n2"}, "2": {"epoch": 8, "voted_for": "n1"}}}
    assert again.state(5).epoch == 0  # a group never voted in


def test_an_unpartitioned_nodes_file_is_the_metadata_groups(tmp_path: Path) -> None:
    (tmp_path / "cluster-state.json").write_text(json.dumps({"epoch": 4, "voted_for": "n3"}))
    states = GroupStateFile(tmp_path)
    assert (states.state(0).epoch, states.state(0).voted_for) == (4, "n3")


@pytest.mark.parametrize("text", ["{", json.dumps({"groups": {"1": {"epoch": "x"}}})])
def test_a_file_that_cannot_be_read_stops_the_node(tmp_path: Path, text: str) -> None:
    (tmp_path / "cluster-state.json").write_text(text)
    with pytest.raises(RuntimeError, match="forgotten epoch or vote"):
        GroupStateFile(tmp_path)
