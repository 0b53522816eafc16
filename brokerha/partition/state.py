"""What a partitioned node remembers of each group's election across a crash.

``cluster/state.py``'s rule per group: an election's ``Persist`` (its epoch
and vote) is durable before anything sent after it. One JSON object keyed by
group in the node's one state file (``cluster-state.json``), replaced
atomically (``files.replace_durably``) at every ``Persist`` of any group: the
groups' votes never mix two versions of the file. The positions are in the
store (``ha/core.py`` ``position_key``: ``ha_position/<group>``), as with one
group.

A state file of an unpartitioned node (``{"epoch": ..., "voted_for": ...}``)
is read as the metadata group's: the node-level election it held is what the
metadata group's is.
"""

from __future__ import annotations

import json
from pathlib import Path

from brokerha.broker.placement import METADATA_GROUP
from brokerha.cluster.state import FILE_NAME, NodeState
from brokerha.files import replace_durably


class GroupStateFile:
    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir) / FILE_NAME
        self.unpartitioned = False  # the file is an unpartitioned node's (one group's)
        self.states = self._read()

    def _read(self) -> dict[int, NodeState]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"cannot read {self.path}: {exc}; refusing to start with a "
                               "forgotten epoch or vote") from exc
        try:
            if "groups" not in raw:  # one group's file: the metadata group's
                self.unpartitioned = True
                return {METADATA_GROUP: NodeState(epoch=int(raw["epoch"]),
                                                  voted_for=raw["voted_for"])}
            return {int(group): NodeState(epoch=int(vote["epoch"]), voted_for=vote["voted_for"])
                    for group, vote in raw["groups"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise RuntimeError(f"cannot read {self.path}: {exc!r}; refusing to start with a "
                               "forgotten epoch or vote") from exc

    def state(self, group: int) -> NodeState:
        """Group ``group``'s epoch and vote (none yet: epoch 0, no vote)."""
        return self.states.setdefault(group, NodeState())

    def save(self, group: int, *, epoch: int, voted_for: str | None) -> None:
        """Record one group's ``Persist`` durably (the whole file, replaced) before returning."""
        state = self.state(group)
        state.epoch, state.voted_for = epoch, voted_for
        groups = {str(g): {"epoch": s.epoch, "voted_for": s.voted_for}
                  for g, s in sorted(self.states.items())}
        replace_durably(self.path, json.dumps({"groups": groups}).encode())
