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

On a partitioned node (docs/ha.md "Partitions") one ``TxOutcomes`` holds the
records of every replication group the node is in; a record's group is in
its name (``group_of``: ``g<group>/...``, given by the group's primary, the
same on every node of the group; an unpartitioned node's names have none:
group 0), so a group's catch-up sends, and its backup replaces, only its
own group's records. A record that no commit or rollback event carries (a
cross-partition transaction's tombstone, ``brokerha/partition/xtx.py``) goes
to the group's backups as a ``to`` event of its own: ``replicate`` hands it
to the ``listeners`` (the HA primary of its group).
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

MAX_RECORDS = 100_000
MAX_AGE = 7 * 86400.0

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


def of_group(txid: str, group: int | None) -> bool:
    """Whether ``txid`` is group ``group``'s (None: the whole broker's, every record)."""
    return group is None or group_of(txid) == group


class TxOutcomes:
    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time,
                 max_records: int = MAX_RECORDS, max_age: float = MAX_AGE) -> None:
        self.store = store
        self.clock = clock
        self.max_records = max_records
        self.max_age = max_age
        self._records: OrderedDict[str, Record] = OrderedDict()
        self._by_client: dict[str, str] = {}
        self._in_flight: dict[str, list[Callable[[str], None]]] = {}
        # the HA primaries that send a ``replicate``d record to their backups
        self.listeners: list[Callable[[Record], None]] = []

    def __len__(self) -> int:
        return len(self._records)

    # -- queries -----------------------------------------------------------------------

    def outcome(self, client_id: str) -> str:
        txid = self._by_client.get(client_id)
        return UNKNOWN if txid is None else self._records[txid][2]

    def committed(self, txid: str) -> bool:
        record = self._records.get(txid)
        return record is not None and record[2] == COMMITTED

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
        return txid in self._records

    def get(self, txid: str) -> Record | None:
        return self._records.get(txid)

    def snapshot(self, group: int | None = None) -> list[Record]:
        """Every record, oldest first, or group ``group``'s only."""
        if group is None:
            return list(self._records.values())
        return [r for r in self._records.values() if group_of(r[0]) == group]

    # -- changes (each goes to the store in the caller's loop callback) -------------------

    def record(self, txid: str, client_id: str | None, outcome: str,
               at: float | None = None) -> None:
        at = self.clock() if at is None else at
        self._put((txid, client_id, outcome, at))
        self.store.tx_outcome(txid, client_id, outcome, at)
        self.prune()
        if client_id is not None:
            for callback in self._in_flight.pop(client_id, []):
                callback(outcome)

    def replicate(self, txid: str) -> None:
        """Send ``txid``'s record to the backups of its group as it is (a ``to`` event):
        for a record no ``tc`` or ``tr`` carries, such as a tombstone."""
        record = self._records.get(txid)
        if record is not None:
            for listener in list(self.listeners):
                listener(record)

    def _put(self, record: Record) -> None:
        txid, client_id = record[0], record[1]
        self._drop(txid)
        self._records[txid] = record
        if client_id is not None:
            self._by_client[client_id] = txid

    def _drop(self, txid: str) -> bool:
        old = self._records.pop(txid, None)
        if old is None:
            return False
        if old[1] is not None and self._by_client.get(old[1]) == txid:
            del self._by_client[old[1]]
        return True

    def forget(self, txid: str) -> None:
        if self._drop(txid):
            self.store.tx_outcome_deleted(txid)

    def keep_only(self, txids: set[str], group: int | None = None) -> None:
        """After a catch-up: what the primary does not know is not an outcome here either
        (of its group's records: ``group``; None, every record)."""
        for txid in [t for t in self._records if t not in txids and of_group(t, group)]:
            self.forget(txid)

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
        """Records the store kept (oldest first); nothing is written back."""
        for txid, client_id, outcome, at in sorted(rows, key=lambda r: r[3]):
            self._put((txid, client_id, outcome, float(at)))
