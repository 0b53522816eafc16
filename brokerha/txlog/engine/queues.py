"""The incoming queue and the synchronised queue with its merge base.

The merge base names a *history*, not an id (safety rule F4): it is the
length of the synchronised queue and a running hash of its ids.  After two
queues diverge, "the id of the last transaction" no longer identifies a
prefix; (length, hash) does, so posts are matched, laggers caught up and
splits detected on the history itself.  Retention drops old entries from the
front but keeps (length, hash) of what it dropped, so the merge base of every
master stays valid.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from brokerha.txlog.engine.records import TxRecord

EMPTY_DIGEST = "0" * 16


def chain(digest: str, tx_id: str) -> str:
    """The running hash after appending ``tx_id`` to a history hashed ``digest``."""
    return hashlib.blake2b(f"{digest}|{tx_id}".encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class MergeBase:
    """(length, running hash) of a synchronised queue; ``last_id`` for the seed's literal rule."""

    length: int
    digest: str
    last_id: str | None = None

    def same(self, other: MergeBase, by_hash: bool = True) -> bool:
        if by_hash:
            return self.length == other.length and self.digest == other.digest
        return self.last_id == other.last_id


GENESIS = MergeBase(0, EMPTY_DIGEST, None)


@dataclass(slots=True)
class SyncEntry:
    """One synchronised transaction, with when and in which generation it was added here."""

    record: TxRecord
    generation: int
    ordered_ms: int
    outcome: str | None = None


class SynchronisedQueue:
    """The agreed log: append-only within a generation, truncated only by recovery."""

    def __init__(self) -> None:
        self.offset: MergeBase = GENESIS  # what retention dropped from the front
        self.entries: list[SyncEntry] = []
        self._digests: list[str] = []  # digest after each entry
        self._index: dict[str, int] = {}  # tx_id -> absolute position

    def __len__(self) -> int:
        return self.offset.length + len(self.entries)

    def merge_base(self) -> MergeBase:
        if not self.entries:
            return self.offset
        return MergeBase(len(self), self._digests[-1], self.entries[-1].record.tx_id)

    def digest_at(self, length: int) -> str | None:
        """Hash of the first ``length`` entries, or None if pruned or beyond the end."""
        if length == self.offset.length:
            return self.offset.digest
        i = length - self.offset.length - 1
        if 0 <= i < len(self._digests):
            return self._digests[i]
        return None

    def base_at(self, length: int) -> MergeBase | None:
        digest = self.digest_at(length)
        if digest is None:
            return None
        last = self.entries[length - self.offset.length - 1].record.tx_id if length > self.offset.length else self.offset.last_id
        return MergeBase(length, digest, last)

    def holds_prefix(self, base: MergeBase, by_hash: bool = True) -> bool:
        """True if the history ``base`` names is a prefix of this queue."""
        if by_hash:
            return self.digest_at(base.length) == base.digest
        return base.last_id is None or base.last_id in self._index

    def position_after(self, base: MergeBase, by_hash: bool = True) -> int:
        """Absolute position where a tail cut at ``base`` starts (literal rule: after last_id)."""
        if by_hash or base.last_id is None:
            return base.length
        return self._index[base.last_id] + 1

    def contains(self, tx_id: str) -> bool:
        return tx_id in self._index

    def position(self, tx_id: str) -> int | None:
        """Absolute position of ``tx_id``, or None if not (or no longer) held."""
        return self._index.get(tx_id)

    def entry(self, tx_id: str) -> SyncEntry | None:
        position = self._index.get(tx_id)
        return None if position is None else self.entries[position - self.offset.length]

    def record(self, tx_id: str) -> TxRecord | None:
        position = self._index.get(tx_id)
        if position is None:
            return None
        return self.entries[position - self.offset.length].record

    def records(self, start: int = 0) -> list[TxRecord]:
        i = max(start - self.offset.length, 0)
        return [e.record for e in self.entries[i:]]

    def id_set(self) -> set[str]:
        return set(self._index)

    def ids(self) -> list[str]:
        return [e.record.tx_id for e in self.entries]

    def append(self, entries: Iterable[SyncEntry]) -> None:
        for entry in entries:
            prev = self._digests[-1] if self._digests else self.offset.digest
            self._index[entry.record.tx_id] = len(self)
            self.entries.append(entry)
            self._digests.append(chain(prev, entry.record.tx_id))

    def truncate(self, length: int) -> list[SyncEntry]:
        """Cut back to ``length`` (split recovery only); returns the removed entries."""
        cut = max(length - self.offset.length, 0)
        removed = self.entries[cut:]
        del self.entries[cut:]
        del self._digests[cut:]
        for entry in removed:
            self._index.pop(entry.record.tx_id, None)
        return removed

    def prune(self, floor: int, max_size: int, min_created_ms: int) -> int:
        """Retention: drop entries beyond ``max_size`` or created before ``min_created_ms``.

        Never drops at or past ``floor``, the shortest length every configured
        master is known to hold: a lagger's merge base and a recovery vote's
        fork point must stay inside the kept part.  Returns how many were dropped.
        """
        keep_from = self.offset.length
        total = len(self)
        while keep_from < floor and (
            total - keep_from > max_size
            or self.entries[keep_from - self.offset.length].record.created_ms < min_created_ms
        ):
            keep_from += 1
        drop = keep_from - self.offset.length
        if drop:
            new_offset = self.base_at(keep_from)
            assert new_offset is not None
            for entry in self.entries[:drop]:
                self._index.pop(entry.record.tx_id, None)
            del self.entries[:drop]
            del self._digests[:drop]
            self.offset = new_offset
        return drop


class IncomingQueue:
    """Transactions not yet synchronised, sorted by (timestamp, id)."""

    def __init__(self, records: Iterable[TxRecord] = ()) -> None:
        self._keys: list[tuple[int, str]] = []
        self._by_id: dict[str, TxRecord] = {}
        for record in records:
            self.add(record)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, tx_id: object) -> bool:
        return tx_id in self._by_id

    def add(self, record: TxRecord) -> bool:
        if record.tx_id in self._by_id:
            return False
        bisect.insort(self._keys, record.key)
        self._by_id[record.tx_id] = record
        return True

    def remove(self, tx_ids: Iterable[str]) -> None:
        for tx_id in tx_ids:
            record = self._by_id.pop(tx_id, None)
            if record is not None:
                i = bisect.bisect_left(self._keys, record.key)
                del self._keys[i]

    def get(self, tx_id: str) -> TxRecord | None:
        return self._by_id.get(tx_id)

    def records(self) -> list[TxRecord]:
        return [self._by_id[tx_id] for _, tx_id in self._keys]


def agreed_prefix(
    queues: Sequence[Sequence[TxRecord]], limit: int, eligible: set[str] | None
) -> list[TxRecord]:
    """ADD: the longest common prefix of all queues, timestamps up to ``limit``.

    ``eligible`` (rule F5) restricts the comparison to transactions whose origin
    is a current member; None compares every transaction (the seed's rule).
    """
    if eligible is not None:
        queues = [[r for r in q if r.origin in eligible] for q in queues]
    prefix: list[TxRecord] = []
    for column in zip(*queues, strict=False):
        first = column[0]
        if first.timestamp > limit or any(r.tx_id != first.tx_id for r in column[1:]):
            break
        prefix.append(first)
    return prefix
