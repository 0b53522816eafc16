"""Outcomes of finished transactions, for the ``tx-outcome`` question and verification.

AMQP 0-9-1 has no "outcome unknown" answer: a client whose connection dropped
during ``tx.commit`` cannot tell whether its transaction committed. A client
that names its transaction (header ``x-tx-id`` on a message published in it)
can ask the (new) primary afterwards (``tx-outcome`` on ``amq.dtx``,
docs/ha.md "Transactions").

Every committed HA transaction is recorded here by its internal id (so the
verification phase can ask a node "did you commit txid?"), with the client's
id when it gave one; a transaction rolled back after its prepare started is
recorded as ``rolled back``. A record is written to the store in the same loop
callback as the commit's effects, hence in the same group commit: the outcome
is durable exactly when the transaction is. Retention: the newest
``max_records`` records, none older than ``max_age`` seconds.

**Held records** (outcome ``HELD``, an XA transaction across partitions held
for its TM: ``partition/xtx_broker.py``) are kept apart (``held``), out of
``max_records``/``max_age``: the record is what keeps the decider from
rolling such a transaction back (rule (c) of ``partition/xtx.py``), however
long the TM takes and however many transactions commit meanwhile; once
decided it is recorded again ``DECIDED`` (replicated likewise) and ages out
as any record.

On a partitioned node (docs/ha.md "Partitions") one ``TxOutcomes`` holds the
records of every replication group the node is in; a record's group is in
its name (``group_of``: ``g<group>/...``, given by the group's primary, the
same on every node of the group; an unpartitioned node's names have none:
group 0), so a group's catch-up sends, and its backup replaces, only its
own group's records. A record that no commit or rollback event carries (a
cross-partition transaction's tombstone, ``brokerha/partition/xtx.py``) goes
to the group's backups as a ``to`` event of its own: ``replicate`` hands it
to the ``listeners`` (the HA primary of its group).

**Forward marks** (``partition/forward_apply.py``): a record whose client id is a
mark (``fw:<group>:<upto>:<refused>:<origin>``, a forwarded batch's) is kept
apart (``marks``): the newest per (group, origin) only, the one before it
deleted from the store in the same callback, none counted against
``max_records``/``max_age`` (one a forwarded batch would evict the clients'
records). An origin (a node's start) is dropped once not heard for
``mark_max_age`` seconds, and a group keeps at most ``mark_max_origins``
origins (the least recently heard go first): a sender resends only what is
unanswered, every few seconds while its node runs, so an origin silent that
long is a previous start of its node. A mark's group is in its name.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from brokerha.broker.storage import Store

COMMITTED = "committed"
ROLLED_BACK = "rolled back"
UNKNOWN = "unknown"
PREPARING = "preparing"  # not recorded: the commit of a named transaction is under way
# an XA transaction across partitions held for its TM (partition/xtx.py rule (c)): its
# all-prepared record is kept apart from the retention until it is rewritten decided
HELD = "prepared"
DECIDED = "decided"

MAX_RECORDS = 100_000
MAX_AGE = 7 * 86400.0
MARK_PREFIX = "fw"  # a forwarded batch's client id: fw:<group>:<upto>:<refused>:<origin>
MARK_MAX_AGE = 7 * 86400.0  # an origin not heard this long is dropped
MARK_MAX_ORIGINS = 1024     # origins (node starts) a group keeps at most
MARK_SWEEP = 60.0           # seconds between two sweeps of the marks by age

Record = tuple[str, str | None, str, float]  # txid, client id, outcome, wall-clock time

GROUP_MARK = "g"


def in_group(group: int, name: str) -> str:
    """``name`` of a transaction of replication group ``group`` (> 0): ``g<group>/name``."""
    return f"{GROUP_MARK}{group}/{name}"


def group_of(txid: str) -> int:
    """The replication group whose log holds transaction ``txid`` (0: an unpartitioned
    node's, or the metadata group's)."""
    if txid.startswith(GROUP_MARK):
        head, slash, _ = txid.partition("/")
        if slash and head[1:].isdigit():
            return int(head[1:])
    return 0


def mark_key(client_id: str | None) -> tuple[int, str, int] | None:
    """(group, origin, upto) of a forward mark's name, or None for any other client id."""
    if client_id is None or not client_id.startswith(MARK_PREFIX + ":"):
        return None
    parts = client_id.split(":", 4)
    if len(parts) != 5 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[1]), parts[4], int(parts[2])


def of_group(txid: str, group: int | None) -> bool:
    """Whether ``txid`` is group ``group``'s (None: the whole broker's, every record)."""
    return group is None or group_of(txid) == group


class TxOutcomes:
    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time,
                 max_records: int = MAX_RECORDS, max_age: float = MAX_AGE,
                 mark_max_age: float = MARK_MAX_AGE,
                 mark_max_origins: int = MARK_MAX_ORIGINS) -> None:
        self.store = store
        self.clock = clock
        self.max_records = max_records
        self.max_age = max_age
        self.mark_max_age = mark_max_age
        self.mark_max_origins = mark_max_origins
        self._records: OrderedDict[str, Record] = OrderedDict()
        self.held: dict[str, Record] = {}  # HELD records: out of the retention
        # forward marks: (group, origin) -> its newest record, least recently heard first
        self.marks: OrderedDict[tuple[int, str], Record] = OrderedDict()
        self._mark_txids: dict[str, tuple[int, str]] = {}
        self._stale: list[str] = []  # superseded mark rows a restore found: deleted later
        self._swept = 0.0
        self._by_client: dict[str, str] = {}
        self._in_flight: dict[str, list[Callable[[str], None]]] = {}
        # the HA primaries that send a ``replicate``d record to their backups
        self.listeners: list[Callable[[Record], None]] = []

    def __len__(self) -> int:
        return len(self._records)

    # -- queries -----------------------------------------------------------------------

    def outcome(self, client_id: str) -> str:
        txid = self._by_client.get(client_id)
        record = None if txid is None else self.get(txid)
        return UNKNOWN if record is None else record[2]

    def when_known(self, client_id: str, callback: Callable[[str], None]) -> None:
        """``callback(outcome)`` now, or once a commit under way has its outcome."""
        waiters = self._in_flight.get(client_id)
        if waiters is None:
            callback(self.outcome(client_id))
        else:
            waiters.append(callback)

    def preparing(self, client_id: str) -> None:
        self._in_flight.setdefault(client_id, [])

    def known(self, txid: str) -> bool:
        return txid in self._records or txid in self.held or txid in self._mark_txids

    def get(self, txid: str) -> Record | None:
        record = self._records.get(txid) or self.held.get(txid)
        if record is None:
            key = self._mark_txids.get(txid)
            return None if key is None else self.marks[key]
        return record

    def committed(self, txid: str) -> bool:
        record = self.get(txid)
        return record is not None and record[2] == COMMITTED

    def snapshot(self, group: int | None = None) -> list[Record]:
        """Every record, oldest first, then the marks; or group ``group``'s only."""
        if group is None:
            return [*self._records.values(), *self.held.values(), *self.marks.values()]
        return [*(r for r in self._records.values() if group_of(r[0]) == group),
                *(r for r in self.held.values() if group_of(r[0]) == group),
                *(r for k, r in self.marks.items() if k[0] == group)]

    def marks_of(self, group: int) -> list[Record]:
        """The marks of ``group`` (their records: the client id is the mark's name)."""
        return [r for k, r in self.marks.items() if k[0] == group]

    # -- changes (each goes to the store in the caller's loop callback) -------------------

    def record(self, txid: str, client_id: str | None, outcome: str,
               at: float | None = None) -> None:
        at = self.clock() if at is None else at
        key = mark_key(client_id)
        if key is not None:
            self._record_mark(key, (txid, client_id, outcome, at))
            return
        self._put((txid, client_id, outcome, at))
        self.store.tx_outcome(txid, client_id, outcome, at)
        self.prune()
        if client_id is not None:
            for callback in self._in_flight.pop(client_id, []):
                callback(outcome)

    def _record_mark(self, key: tuple[int, str, int], record: Record) -> None:
        # The mark of a record replaces the one held whatever its upto: records come in
        # the group's log order (a tc's, live, after the catch-up's), and a catch-up's
        # ``to`` is the primary's mark as of the join -- lower than one this node applied
        # beyond the primary's log (uncommitted, from a deposed primary), which it must
        # replace: kept, ``keep_only`` then dropped it as unknown and the origin had no
        # mark at all (forwards above it gaps, resends at or below it duplicates; the
        # remote-consume simulation's seed 511 of five nodes).
        group, origin, _upto = key
        old = self.marks.get((group, origin))
        if old is not None:
            self._drop_mark((group, origin), write=old[0] != record[0])
        self.marks[(group, origin)] = record
        self._mark_txids[record[0]] = (group, origin)
        self.store.tx_outcome(*record)
        for txid in self._stale:
            self.store.tx_outcome_deleted(txid)
        self._stale.clear()
        self.prune_marks(record[3])

    def _drop_mark(self, key: tuple[int, str], *, write: bool = True) -> None:
        old = self.marks.pop(key, None)
        if old is not None:
            self._mark_txids.pop(old[0], None)
            if write:
                self.store.tx_outcome_deleted(old[0])

    def prune_marks(self, now: float | None = None) -> None:
        """Origins over ``mark_max_origins`` in a group, and those not heard for
        ``mark_max_age`` (swept every ``MARK_SWEEP`` seconds), dropped."""
        now = self.clock() if now is None else now
        counts: dict[int, int] = {}
        for group, _ in self.marks:
            counts[group] = counts.get(group, 0) + 1
        for key in list(self.marks):  # least recently heard first
            if counts[key[0]] > self.mark_max_origins:
                counts[key[0]] -= 1
                self._drop_mark(key)
        if now - self._swept < MARK_SWEEP:
            return
        self._swept = now
        limit = now - self.mark_max_age
        for key, record in list(self.marks.items()):
            if record[3] < limit:
                self._drop_mark(key)

    def replicate(self, txid: str) -> None:
        """Send ``txid``'s record to the backups of its group as it is (a ``to`` event):
        for a record no ``tc`` or ``tr`` carries, such as a tombstone."""
        record = self._records.get(txid) or self.held.get(txid)
        if record is not None:
            for listener in list(self.listeners):
                listener(record)

    def _put(self, record: Record) -> None:
        txid, client_id = record[0], record[1]
        self._drop(txid)
        if record[2] == HELD:
            self.held[txid] = record
        else:
            self._records[txid] = record
        if client_id is not None:
            self._by_client[client_id] = txid

    def _drop(self, txid: str) -> bool:
        old = self._records.pop(txid, None) or self.held.pop(txid, None)
        if old is None:
            return False
        if old[1] is not None and self._by_client.get(old[1]) == txid:
            del self._by_client[old[1]]
        return True

    def forget(self, txid: str) -> None:
        key = self._mark_txids.get(txid)
        if key is not None:
            self._drop_mark(key)
        elif self._drop(txid):
            self.store.tx_outcome_deleted(txid)

    def keep_only(self, txids: set[str], group: int | None = None) -> None:
        """After a catch-up: what the primary does not know is not an outcome here either
        (of its group's records: ``group``; None, every record). A mark's group is the
        one its name says: another group's marks stay."""
        for txid in [t for t in [*self._records, *self.held]
                     if t not in txids and of_group(t, group)]:
            self.forget(txid)
        for key in [k for k, r in self.marks.items()
                    if r[0] not in txids and (group is None or k[0] == group)]:
            self._drop_mark(key)

    def prune(self, now: float | None = None) -> None:
        records = self._records
        while len(records) > self.max_records:
            self.forget(next(iter(records)))
        if not records:
            return
        limit = (self.clock() if now is None else now) - self.max_age
        while records:
            first = next(iter(records.values()))
            if first[3] >= limit:
                break
            self.forget(first[0])

    def restore(self, rows: Iterable[Any]) -> None:
        """Records the store kept (oldest first); nothing is written back (mark rows
        superseded by a newer one of their origin are deleted at the next mark's record:
        a store written before the marks were kept apart holds one per batch)."""
        for txid, client_id, outcome, at in sorted(rows, key=lambda r: r[3]):
            record = (txid, client_id, outcome, float(at))
            key = mark_key(client_id)
            if key is None:
                self._put(record)
                continue
            old = self.marks.get(key[:2])
            if old is not None:
                old_key = mark_key(old[1])
                if old_key is not None and old_key[2] > key[2]:
                    self._stale.append(txid)
                    continue
                self._stale.append(old[0])
                self._mark_txids.pop(old[0], None)
                del self.marks[key[:2]]
            self.marks[key[:2]] = record
            self._mark_txids[txid] = key[:2]
