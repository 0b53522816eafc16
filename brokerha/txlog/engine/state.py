"""What a master must keep across a crash, and the only way it changes.

The safety note lists it: synchronised queue, own not-yet-synchronised
transactions with bodies, the counter's high-water mark, generation and member
set, "I voted in generation g with queue Q"; plus the broker model the
workers executed and its backup.  The engine changes this state only through
:meth:`DurableState.apply` with the same :class:`Persist` it hands the caller,
so a driver that writes those actions to disk (and to the DC's backups) can
rebuild exactly this object after a failover.  Foreign incoming entries are
volatile on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from brokerha.txlog.engine.config import Peer, SplitRecovery
from brokerha.txlog.engine.messages import Ballot, Persist
from brokerha.txlog.engine.queues import SyncEntry, SynchronisedQueue
from brokerha.txlog.engine.records import TxBody, TxRecord
from brokerha.txlog.engine.validation import GlobalQueues


@dataclass
class DurableState:
    members: frozenset[str]
    strategy: SplitRecovery
    generation: int = 0
    sync: SynchronisedQueue = field(default_factory=SynchronisedQueue)
    own: dict[str, TxRecord] = field(default_factory=dict)
    bodies: dict[str, TxBody] = field(default_factory=dict)
    counter_reserved: int = 0
    id_last: int = 0
    split_at: int | None = None
    ballot: Ballot | None = None
    decided: tuple[Ballot, ...] = ()
    model: GlobalQueues = field(default_factory=GlobalQueues)
    stable: GlobalQueues = field(default_factory=GlobalQueues)
    backup: GlobalQueues | None = None
    # the sync peers an operator set at runtime (None: the configuration's), in the same
    # record as the view change they cause, so a crash never keeps one without the other
    peers: tuple[Peer, ...] | None = None

    @property
    def split(self) -> bool:
        return self.split_at is not None

    def apply(self, change: Persist) -> None:
        getattr(self, "_" + change.key.replace(".", "_"))(change.value)

    # one method per Persist key ------------------------------------------------

    def _sync_append(self, value: tuple[list[SyncEntry], list[TxBody]]) -> None:
        entries, bodies = value
        for body in bodies:
            self.bodies[body.tx_id] = body
        self.sync.append(entries)
        for entry in entries:
            self.own.pop(entry.record.tx_id, None)

    def _bodies(self, bodies: list[TxBody]) -> None:
        for body in bodies:
            self.bodies[body.tx_id] = body

    def _sync_truncate(self, length: int) -> None:
        self.sync.truncate(length)

    def _sync_prune(self, value: tuple[int, int, int]) -> None:
        floor, max_size, min_created = value
        before = self.sync.ids()
        for tx_id in before[: self.sync.prune(floor, max_size, min_created)]:
            self.bodies.pop(tx_id, None)

    def _own_add(self, value: tuple[TxRecord, TxBody]) -> None:
        record, body = value
        self.own[record.tx_id] = record
        self.bodies[body.tx_id] = body

    def _own_remove(self, tx_id: str) -> None:
        self.own.pop(tx_id, None)

    def _counter(self, reserved: int) -> None:
        self.counter_reserved = reserved

    def _ids(self, last: int) -> None:
        self.id_last = last

    def _view(self, value: tuple[int, frozenset[str], int | None]) -> None:
        self.generation, self.members, self.split_at = value

    def _peers(self, value: tuple[Peer, ...]) -> None:
        self.peers = tuple(value)

    def _strategy(self, value: SplitRecovery) -> None:
        self.strategy = value

    def _vote(self, ballot: Ballot | None) -> None:
        self.ballot = ballot

    def _decided(self, ballots: tuple[Ballot, ...]) -> None:
        self.decided = ballots
        self.ballot = None

    def _exec_apply(self, position: int) -> None:
        entry = self.sync.entries[position - self.sync.offset.length]
        entry.outcome = self.model.apply(self.bodies[entry.record.tx_id])

    def _exec_stable(self, position: int) -> None:
        while self.stable.applied < position:
            entry = self.sync.entries[self.stable.applied - self.sync.offset.length]
            self.stable.apply(self.bodies[entry.record.tx_id])

    def _exec_backup(self, _: None) -> None:
        self.backup = self.stable.snapshot()

    def _exec_restore(self, _: None) -> None:
        assert self.backup is not None
        self.model = self.backup.snapshot()

    def _exec_discard(self, _: None) -> None:
        self.backup = None

    def _exec_rewind(self, position: int) -> None:
        """Strategy None: keep the workers' state, re-point it at the new log."""
        self.model.applied = min(self.model.applied, position)
