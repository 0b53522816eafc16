"""What a cluster node must remember across a crash: epoch and vote here, position in the store.

The election's ``Persist`` action is written here before anything that
depends on it leaves the node: a vote is sent only after its epoch and
candidate are on disk (otherwise a restarted voter could vote twice in an
epoch). One small JSON file in the data directory, replaced atomically
(write a temporary file, fsync it, rename over the old one, fsync the
directory).

The position and vote floor (``NodeState.pos_*``, ``floor_*``) are kept in
memory here but made durable only in the broker's store, in the same commit
as the events they describe (``ha/core.py`` ``POSITION_KEY``): a backup
acknowledges events only after that commit, so a restarted node never claims
to hold less than it confirmed. The file keeps no copy of them; one written
by an older version is read only while the store has no position yet.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from brokerha.files import replace_durably

FILE_NAME = "cluster-state.json"


@dataclass
class NodeState:
    epoch: int = 0
    voted_for: str | None = None
    # the position (epoch, seq) of the replicated state this node holds;
    # (-1, -1) while it is catching up (its state is not a consistent copy)
    pos_epoch: int = 0
    pos_seq: int = 0
    # the highest valid position ever held (election.py's vote floor): it must
    # survive a crash during a catch-up, when the position itself is (-1, -1)
    floor_epoch: int = 0
    floor_seq: int = 0

    def move_to(self, epoch: int, seq: int) -> None:
        """A new position; the floor rises with it and never falls."""
        self.pos_epoch, self.pos_seq = epoch, seq
        if (epoch, seq) > (self.floor_epoch, self.floor_seq):
            self.floor_epoch, self.floor_seq = epoch, seq


class StateFile:
    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / FILE_NAME
        self.state = self._read()

    def _read(self) -> NodeState:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return NodeState()
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"cannot read {self.path}: {exc}; refusing to start with a "
                               "forgotten epoch or vote") from exc
        if isinstance(raw, dict) and "groups" in raw:  # partition/state.py's, one per group
            raise RuntimeError(f"{self.path} holds the votes of a node running partition "
                               "groups ([cluster] partition_groups = true): refusing to start "
                               "without them, with a forgotten epoch or vote")
        return NodeState(**{k: raw[k] for k in asdict(NodeState()) if k in raw})

    def save(self, *, epoch: int, voted_for: str | None) -> None:
        """Record the election's epoch and vote durably before returning (a ``Persist``)."""
        self.state.epoch, self.state.voted_for = epoch, voted_for
        replace_durably(self.path, json.dumps({"epoch": epoch, "voted_for": voted_for}).encode())
