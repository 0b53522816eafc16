"""Transaction records: what the rounds order, and the bodies kept apart.

Rounds only carry :class:`TxRecord` (id, Lamport timestamp, origin): the
operations of a transaction (its :class:`TxBody`) travel once, pushed with the
origin's first post or fetched from a master that listed the transaction, so
bulky bodies never slow the agreement itself (seed 000, "Transaction exchange").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

OpKind = Literal["enqueue", "dequeue"]


@dataclass(frozen=True, slots=True)
class Operation:
    """One enqueue or dequeue of a global queue (`vhost/queue`) by message id.

    ``data`` is what a DC needs to apply it besides the id: for a broker's
    enqueue, the message itself (``brokerha.txlog.bridge.broker_bridge`` packs it);
    empty for dequeues and for the simulation's transactions. It travels with
    the body, never in rounds, and is not part of validation.
    """

    kind: OpKind
    queue: str
    message_id: str
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class TxRecord:
    """The part of a transaction the rounds negotiate.

    ``key`` is the incoming-queue order: Lamport timestamp first, then the
    globally unique id, so every master sorts the same set the same way.
    """

    tx_id: str
    timestamp: int
    origin: str
    created_ms: int
    replay_of: str | None = None

    @property
    def key(self) -> tuple[int, str]:
        return (self.timestamp, self.tx_id)


@dataclass(frozen=True, slots=True)
class TxBody:
    """The operations of one transaction, in the order the client issued them."""

    tx_id: str
    operations: tuple[Operation, ...]

    @property
    def has_dequeue(self) -> bool:
        """A transaction with a dequeue can fail validation; enqueue-only ones cannot."""
        return any(op.kind == "dequeue" for op in self.operations)


class TxIdGenerator:
    """NEO-style ids: time based, strictly increasing, unique with the node id.

    The value is milliseconds << 16 plus a sequence, so a burst inside one
    millisecond (or a clock that stepped back) still gets increasing ids.
    ``last`` is part of the durable state: a restarted master must not reissue
    an id it already handed out.
    """

    def __init__(self, node_id: str, last: int = 0) -> None:
        self.node_id = node_id
        self.last = last

    def next(self, now_ms: int) -> str:
        self.last = max(self.last + 1, now_ms << 16)
        return f"{self.last:016x}.{self.node_id}"


@dataclass
class MasterEvent:
    """One row of a master's event log (crash, split, rejoin, ...): what the export writes
    to events.parquet, from a running master (``master/driver.py``) or a simulated one."""

    at_ms: int
    kind: str
    generation: int
    peer: str | None
    detail: dict[str, Any]
