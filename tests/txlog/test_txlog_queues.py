from brokerha.txlog.engine.queues import (
    GENESIS,
    IncomingQueue,
    SyncEntry,
    SynchronisedQueue,
    agreed_prefix,
)
from brokerha.txlog.engine.records import TxRecord


def rec(tx_id: str, ts: int, origin: str = "dc1") -> TxRecord:
    return TxRecord(tx_id, ts, origin, ts)


def queue(*ids: str) -> SynchronisedQueue:
    q = SynchronisedQueue()
    q.append(SyncEntry(rec(i, n), 0, 0) for n, i in enumerate(ids))
    return q


def test_incoming_queue_is_sorted_by_timestamp_then_id_and_ignores_duplicates() -> None:
    q = IncomingQueue()
    for r in (rec("b", 2), rec("a", 2), rec("c", 1), rec("a", 2)):
        q.add(r)
    assert [r.tx_id for r in q.records()] == ["c", "a", "b"]
    q.remove(["a"])
    assert [r.tx_id for r in q.records()] == ["c", "b"] and "a" not in q


def test_merge_base_names_a_history_not_a_last_id() -> None:
    left, right = queue("a", "x"), queue("b", "x")
    assert left.merge_base().last_id == right.merge_base().last_id
    assert left.merge_base().same(right.merge_base(), by_hash=False)
    assert not left.merge_base().same(right.merge_base())


def test_holds_prefix_checks_the_exact_history() -> None:
    long = queue("a", "b", "c")
    assert long.holds_prefix(queue("a", "b").merge_base())
    assert long.holds_prefix(GENESIS)
    assert not long.holds_prefix(queue("b", "a").merge_base())


def test_truncate_restores_the_earlier_merge_base() -> None:
    q = queue("a", "b", "c")
    removed = q.truncate(1)
    assert [e.record.tx_id for e in removed] == ["b", "c"]
    assert q.merge_base() == queue("a").merge_base() and not q.contains("b")


def test_retention_keeps_the_merge_base_valid_and_stops_at_the_floor() -> None:
    q = queue(*"abcdef")
    base = q.merge_base()
    dropped = q.prune(floor=4, max_size=1, min_created_ms=0)
    assert dropped == 4 and len(q) == 6 and q.merge_base() == base
    assert q.holds_prefix(queue(*"abcd").merge_base())
    assert q.records() == [e.record for e in q.entries]
    q.append([SyncEntry(rec("g", 9), 0, 0)])
    assert q.merge_base() == queue(*"abcdefg").merge_base()


def test_retention_by_age_drops_only_old_entries() -> None:
    q = queue(*"abcd")  # created_ms 0..3
    assert q.prune(floor=4, max_size=100, min_created_ms=2) == 2
    assert q.ids() == ["c", "d"]


def test_agreed_prefix_is_common_and_bounded_by_the_least_counter() -> None:
    mine = [rec("a", 1), rec("b", 2), rec("c", 3)]
    theirs = [rec("a", 1), rec("b", 2), rec("d", 3)]
    assert [r.tx_id for r in agreed_prefix([mine, theirs], limit=10, eligible=None)] == ["a", "b"]
    assert [r.tx_id for r in agreed_prefix([mine, theirs], limit=1, eligible=None)] == ["a"]


def test_agreed_prefix_skips_transactions_of_non_members() -> None:
    mine = [rec("a", 1), rec("z", 2, origin="dc3"), rec("b", 3)]
    theirs = [rec("a", 1), rec("b", 3)]
    assert [r.tx_id for r in agreed_prefix([mine, theirs], 10, eligible={"dc1"})] == ["a", "b"]
    assert [r.tx_id for r in agreed_prefix([mine, theirs], 10, eligible=None)] == ["a"]
