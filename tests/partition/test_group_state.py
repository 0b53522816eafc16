"""Each group's epoch and vote in the node's state file (brokerha/partition/state.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from brokerha.cluster.state import StateFile
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
    assert states.unpartitioned  # the node's shell refuses it (node/ha_groups.py)
    states.save(0, epoch=5, voted_for=None)
    assert not GroupStateFile(tmp_path).unpartitioned


def test_a_partitioned_nodes_file_stops_a_node_without_groups(tmp_path: Path) -> None:
    """Read as one group's, it would have no epoch and no vote: the node could vote twice
    in an epoch. ``StateFile`` (cluster/state.py) refuses it."""
    GroupStateFile(tmp_path).save(0, epoch=6, voted_for="n2")
    with pytest.raises(RuntimeError, match="partition groups.*forgotten epoch or vote"):
        StateFile(tmp_path)


@pytest.mark.parametrize("text", ["{", json.dumps({"groups": {"1": {"epoch": "x"}}})])
def test_a_file_that_cannot_be_read_stops_the_node(tmp_path: Path, text: str) -> None:
    (tmp_path / "cluster-state.json").write_text(text)
    with pytest.raises(RuntimeError, match="forgotten epoch or vote"):
        GroupStateFile(tmp_path)
