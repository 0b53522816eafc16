"""The cluster state file (``cluster/state.py``): the election's epoch and vote, nothing else."""

from __future__ import annotations

import json
from pathlib import Path

from brokerha.cluster.state import FILE_NAME, StateFile


def test_the_file_holds_the_epoch_and_vote_only(tmp_path: Path) -> None:
    state = StateFile(tmp_path)
    state.state.move_to(3, 17)  # a position: in memory, durable only in the store
    state.save(epoch=4, voted_for="n2")
    assert json.loads((tmp_path / FILE_NAME).read_text()) == {"epoch": 4, "voted_for": "n2"}
    again = StateFile(tmp_path).state
    assert (again.epoch, again.voted_for) == (4, "n2")
    assert (again.pos_epoch, again.pos_seq, again.floor_epoch, again.floor_seq) == (0, 0, 0, 0)


def test_an_older_versions_file_still_gives_its_position(tmp_path: Path) -> None:
    """Read while the store has no position yet (``ha.core.load_position`` prefers the store's)."""
    (tmp_path / FILE_NAME).write_text(json.dumps(
        {"epoch": 2, "voted_for": "n1", "pos_epoch": 2, "pos_seq": 40, "floor_epoch": 2,
         "floor_seq": 41}))
    st = StateFile(tmp_path).state
    assert (st.epoch, st.pos_epoch, st.pos_seq, st.floor_epoch, st.floor_seq) == (2, 2, 40, 2, 41)


def test_the_stores_position_wins_over_an_older_file(tmp_path: Path) -> None:
    from brokerha.ha.core import POSITION_KEY
    from brokerha.ha.simulation.disk import DiskStore
    from tests.node.test_ha_backup_acks import backup_node

    (tmp_path / FILE_NAME).write_text(json.dumps(
        {"epoch": 2, "voted_for": None, "pos_epoch": 2, "pos_seq": 40, "floor_epoch": 2,
         "floor_seq": 40}))
    store = DiskStore()
    store.put_meta(POSITION_KEY, json.dumps([3, 7, 3, 9]))
    store.sync()
    _, _, ha, _ = backup_node(tmp_path, store)
    st = ha.state.state
    assert (st.pos_epoch, st.pos_seq, st.floor_epoch, st.floor_seq) == (3, 7, 3, 9)
    assert ha.election.epoch == 2  # the epoch still comes from the file
