"""What masters send each other (inputs) and what the engine asks its caller to do (outputs).

The engine never touches a socket, a timer or a disk: it returns actions in
the order the caller must carry them out.  A :class:`Persist` must be durable
before any :class:`Send` that follows it leaves the node (a post is a promise
that the persisted counter backs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from brokerha.txlog.engine.queues import MergeBase
from brokerha.txlog.engine.records import TxBody, TxRecord

# ---- messages between masters -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Post:
    """One round's status: view, merge base, counter, acquired incoming ids (+ first-time bodies)."""

    sender: str
    generation: int
    members: frozenset[str]
    merge_base: MergeBase
    counter: int
    incoming: tuple[TxRecord, ...]
    bodies: tuple[TxBody, ...] = ()


@dataclass(frozen=True, slots=True)
class CatchUp:
    """A forerunner's synchronised tail for a lagger, cut after ``base``."""

    sender: str
    generation: int
    members: frozenset[str]
    base: MergeBase
    tail: tuple[TxRecord, ...]
    bodies: tuple[TxBody, ...]


@dataclass(frozen=True, slots=True)
class FetchBodies:
    """Transaction exchange: ask the master that listed these ids for their bodies."""

    sender: str
    tx_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Bodies:
    sender: str
    records: tuple[TxRecord, ...]
    bodies: tuple[TxBody, ...]


@dataclass(frozen=True, slots=True)
class Ballot:
    """A master's frozen synchronised queue, cast in the vote for ``generation``."""

    master: str
    generation: int
    offset: MergeBase
    records: tuple[TxRecord, ...]


@dataclass(frozen=True, slots=True)
class Vote:
    """Every ballot the sender knows for ``generation`` (gossiped so a lost link cannot stall it)."""

    sender: str
    generation: int
    ballots: tuple[Ballot, ...]


Message = Post | CatchUp | FetchBodies | Bodies | Vote

# ---- actions for the caller ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    peer: str
    message: Message


@dataclass(frozen=True, slots=True)
class Persist:
    """Make this change durable (and replicate it to the DC's backups) before later sends."""

    key: str
    value: Any


@dataclass(frozen=True, slots=True)
class DeliverOrdered:
    """Apply this synchronised transaction to the broker; ``outcome`` is its validation result."""

    tx_id: str
    position: int
    outcome: str
    replay: bool = False


@dataclass(frozen=True, slots=True)
class Confirm:
    """Tell the client: one-phase on acquire for enqueue-only, else once ordered and validated."""

    tx_id: str
    outcome: str


@dataclass(frozen=True, slots=True)
class Backup:
    """Snapshot the broker state as of synchronised position ``position`` (split detected)."""

    position: int


@dataclass(frozen=True, slots=True)
class Restore:
    """Restore the broker from the backup taken at ``position`` (rejoin, minority)."""

    position: int


@dataclass(frozen=True, slots=True)
class Event:
    """An operator-visible event (the export's ``events.parquet``)."""

    kind: str
    peer: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Refused:
    """A message from an unconfigured peer, dropped unprocessed."""

    sender: str
    reason: str


Action = Send | Persist | DeliverOrdered | Confirm | Backup | Restore | Event | Refused
