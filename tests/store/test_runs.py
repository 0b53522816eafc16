"""Message runs: a batch of enqueues at consecutive positions is one row (and one log record).

The fold (``batch.py``) turns an ``ENQUEUED_MANY`` into runs; positions taken off a run,
or delivered, are marked apart (``run_marks``) until the run is empty (``runs.py``).
Recovery, paging reads and a replay of the operation log see the same messages as if
each had a row of its own.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgpack
import pytest

from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.store import schema
from brokerha.store.batch import (
    ACQUIRED,
    DEQUEUED,
    ENQUEUED,
    ENQUEUED_MANY,
    ENQUEUED_RUN,
    PURGED,
    QUEUE_DELETED,
    RUN_MIN,
    Batch,
    Unit,
    runs_of,
    unpack_run,
)
from brokerha.store.oplog import decode_ops, encode_ops, with_runs
from brokerha.store.sql import SQLStore, StoreError
from tests.store.harness import StoreNode, body, message
from tests.store.test_oplog import crash, lazy, lazy_writer, open_node, readable  # noqa: F401


def entries(first: int, count: int, persistent: bool = True) -> list[Entry]:
    return [Entry(p, message(body(p), persistent=persistent), None)
            for p in range(first, first + count)]


def stored(url: str) -> list[tuple[int, bytes, bool]]:
    """(position, body, delivered) of every stored message, read back by a new store."""
    node = StoreNode(url)
    try:
        return [(m.position, m.body, m.delivered) for m in node.store.load().messages]
    finally:
        node.close()


def table_rows(db: Path, table: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0])
    finally:
        conn.close()


def add(node: StoreNode, q: Queue, first: int, count: int) -> None:
    """Entries at first.. as one batch (a backup's run of ``Enqueued``, a TX's enqueues)."""
    node.call(lambda: q.add_entries(entries(first, count)))


def take(node: StoreNode, q: Queue, positions: list[int]) -> None:
    def run() -> None:
        for p in positions:
            entry = q.take_position(p)
            assert entry is not None
            q.settle(entry)
    node.call(run)


# -- the fold ---------------------------------------------------------------------------------


def test_consecutive_persistent_entries_are_runs_and_the_rest_rows_of_their_own() -> None:
    batch_entries = entries(1, 40) + entries(41, 3, persistent=False) + entries(44, 20)
    batch_entries += entries(70, RUN_MIN - 1)  # a gap, then too short for a run
    ops = runs_of((ENQUEUED_MANY, "/", "q", batch_entries))
    assert [(op[0], op[3]) + ((op[4],) if op[0] == ENQUEUED_RUN else ()) for op in ops] == (
        [(ENQUEUED_RUN, 1, 40), (ENQUEUED_RUN, 44, 63)]
        + [(ENQUEUED, p) for p in range(70, 70 + RUN_MIN - 1)])
    assert [c.body for c in unpack_run(ops[0][5])] == [body(p) for p in range(1, 41)]


def test_a_run_is_split_past_its_byte_bound() -> None:
    big = [Entry(p, message(b"x" * 300_000), None) for p in range(20)]
    ops = runs_of((ENQUEUED_MANY, "/", "q", big))
    # 4 x 300 kB reach 1 MiB: runs of 4 are under RUN_MIN, so rows of their own
    assert {op[0] for op in ops} == {ENQUEUED}


def test_dequeues_and_deliveries_inside_a_pending_run_are_marked() -> None:
    batch = Batch()
    batch.add(Unit([(ENQUEUED_MANY, "/", "q", entries(1, 20)),
                    (ACQUIRED, "/", "q", 3), (DEQUEUED, "/", "q", 4), (DEQUEUED, "/", "q", 3)],
                   []))
    [(_, _, run)] = batch.run_rows()
    assert (run.first, run.last, run.gone, run.delivered) == (1, 20, {3, 4}, {3})
    assert batch.rows() == ([], [], []) and batch.cancelled == 2


def test_dequeues_find_their_run_among_many_in_one_batch() -> None:
    """A batch of a second's transactions holds many runs of one queue (bisected)."""
    ops: list[tuple[object, ...]] = [(ENQUEUED_MANY, "/", "q", entries(first, 20))
                                     for first in range(1, 2001, 20)]
    ops += [(DEQUEUED, "/", "q", p) for p in range(1, 2001, 7)]
    ops += [(DEQUEUED, "/", "q", p) for p in range(41, 61)]  # the third run, whole
    batch = Batch()
    batch.add(Unit(ops, []))
    runs = {run.first: run for _, _, run in batch.run_rows()}
    assert len(runs) == 99 and 41 not in runs
    assert set().union(*(r.gone for r in runs.values())) == (
        set(range(1, 2001, 7)) - set(range(41, 61)))


def test_a_run_wholly_consumed_in_its_batch_is_never_written() -> None:
    ops = [(ENQUEUED_MANY, "/", "q", entries(1, 20))]
    ops += [(DEQUEUED, "/", "q", p) for p in range(1, 21)]
    batch = Batch()
    batch.add(Unit(ops, []))
    assert batch.empty and batch.cancelled == 20
    replay = Batch(cancel=False)  # a replay: the run may be in SQL already, its row must go
    replay.add(Unit(ops, []))
    assert replay.run_rows() == [] and replay.dropped_runs == [("/", "q", 1, 20)]


def test_a_purge_marks_pending_runs_it_crosses_and_drops_those_inside() -> None:
    batch = Batch()
    batch.add(Unit([(ENQUEUED_MANY, "/", "q", entries(1, 20) + entries(21, 20)),
                    (PURGED, "/", "q", [(15, 40)])], []))
    [(_, _, run)] = batch.run_rows()  # one run of 40 (1..40)
    assert run.gone == set(range(15, 41))
    batch = Batch()
    batch.add(Unit([(ENQUEUED_MANY, "/", "q", entries(1, 20)), (PURGED, "/", "q", [(1, 20)])],
                   []))
    assert batch.run_rows() == [] and batch.purges == [("/", "q", 1, 20)]


def test_a_deleted_queue_drops_its_pending_runs() -> None:
    batch = Batch()
    batch.add(Unit([(ENQUEUED_MANY, "/", "q", entries(1, 20)), (QUEUE_DELETED, "/", "q")], []))
    assert batch.run_rows() == []
    assert [name for name, _ in batch.statements] == ["delete_queue", "purge_queue"]


def test_a_run_is_one_log_record_row_with_its_contents_as_packed() -> None:
    ops = with_runs([(ENQUEUED_MANY, "/", "q", entries(5, 30))])
    decoded = decode_ops(encode_ops(msgpack.Packer(use_bin_type=True), ops))
    assert decoded == [(ENQUEUED_RUN, "/", "q", 5, 34, ops[0][5])]


# -- in SQL, both backends ----------------------------------------------------------------------


def test_runs_are_recovered_with_their_dequeues_and_delivered_flags(store_url: str) -> None:
    node = StoreNode(store_url)
    q = node.queue()
    add(node, q, 1, 50)
    add(node, q, 51, 50)
    node.sync()
    take(node, q, [1, 7, 60])
    node.call(lambda: [q.get(), q.get()])  # 2 and 3 delivered, not acked
    node.sync()
    node.close()
    expected = [(p, body(p), p in (2, 3)) for p in range(1, 101) if p not in (1, 7, 60)]
    assert stored(store_url) == expected


def test_a_run_goes_once_every_position_is_taken(store_url: str, tmp_path: Path) -> None:
    node = StoreNode(store_url)
    q = node.queue()
    add(node, q, 1, 30)
    node.call(lambda: q.enqueue(message(body(31))))  # a row of its own after the run
    node.sync()
    take(node, q, list(range(1, 20)))
    node.sync()
    take(node, q, list(range(20, 31)))
    node.sync()
    assert node.store._writer.runs.queues == {}
    node.close()
    assert stored(store_url) == [(31, body(31), False)]
    if store_url.startswith("sqlite"):
        db = tmp_path / "store.db"
        assert table_rows(db, "message_runs") == table_rows(db, "run_marks") == 0


def test_purge_ranges_across_stored_runs(store_url: str) -> None:
    node = StoreNode(store_url)
    q = node.queue()
    for first in (1, 21, 41):
        add(node, q, first, 20)
    node.sync()
    take(node, q, [5])
    node.sync()
    node.broker.store.purged(q, [(10, 45)])  # what a purge of those entries records
    node.sync()
    node.close()
    assert [p for p, _, _ in stored(store_url)] == [p for p in range(1, 61)
                                                     if p != 5 and not 10 <= p <= 45]


def test_a_deleted_queue_takes_its_runs_and_a_new_one_starts_afresh(store_url: str) -> None:
    node = StoreNode(store_url)
    q = node.queue()
    add(node, q, 1, 40)
    node.sync()
    take(node, q, [3])
    node.sync()
    node.call(lambda: node.vhost.delete_queue("q", owner=None))
    q = node.queue()
    add(node, q, 1, 20)
    node.sync()
    node.close()
    assert stored(store_url) == [(p, body(p), False) for p in range(1, 21)]


def test_paged_bodies_are_read_back_from_runs(store_url: str) -> None:
    node = StoreNode(store_url)
    q = node.queue()
    add(node, q, 1, 40)
    node.call(lambda: q.enqueue(message(body(41))))
    node.sync()
    try:
        found = node.store.read_bodies("/", "q", [2, 39, 41, 40])
        assert {p: b for p, (_, b) in found.items()} == {p: body(p) for p in (2, 39, 40, 41)}
        assert node.store.read_bodies("/", "q", [3])[3][1] == body(3)  # the cached run
    finally:
        node.close()


def test_a_queue_declared_again_reads_its_own_bodies_not_the_last_run_read(
        store_url: str) -> None:
    node = StoreNode(store_url)
    try:
        q = node.queue()
        add(node, q, 1, 40)
        node.sync()
        assert node.store.read_bodies("/", "q", [5])[5][1] == body(5)  # the run is kept
        node.call(lambda: node.vhost.delete_queue("q", owner=None))
        q = node.queue()
        node.call(lambda: q.add_entries([Entry(p, message(b"new %d" % p), None)
                                         for p in range(1, 41)]))
        node.sync()
        assert node.store.read_bodies("/", "q", [5])[5][1] == b"new 5"
    finally:
        node.close()


# -- the operation log ------------------------------------------------------------------------


@pytest.mark.usefixtures("lazy_writer")
def test_runs_in_the_log_are_replayed_after_a_crash(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    add(node, q, 1, 50)
    node.sync()
    take(node, q, [10, 11])
    node.call(lambda: q.get())  # 1 delivered
    add(node, q, 51, 20)
    take(node, q, list(range(51, 71)))  # a run taken whole within the log
    node.sync()  # logged, none of it in SQL
    crash(node)
    assert table_rows(db, "message_runs") == 0
    assert stored(f"sqlite:///{db}") == [(p, body(p), p == 1) for p in range(1, 51)
                                         if p not in (10, 11)]


@pytest.mark.usefixtures("lazy_writer")
def test_a_replay_over_runs_sql_already_holds_ends_as_the_log_says(tmp_path: Path) -> None:
    """The first part of the newest file may be in SQL already: runs written again, their
    marks again, a run emptied in the log deleted."""
    db = tmp_path / "store.db"
    node = open_node(db)
    q = node.queue()
    add(node, q, 1, 30)
    add(node, q, 31, 30)
    take(node, q, [2])
    node.sync()
    readable(node)  # applied, and the file is still the current one
    take(node, q, list(range(31, 61)) + [3])
    node.sync()
    crash(node)
    assert stored(f"sqlite:///{db}") == [(p, body(p), False) for p in range(1, 31)
                                         if p not in (2, 3)]
    assert table_rows(db, "message_runs") == 1


def test_a_version_1_database_is_migrated(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    node = StoreNode(f"sqlite:///{db}")
    q = node.queue()
    node.call(lambda: q.enqueue(message(body(1))))
    node.sync()
    node.close()
    conn = sqlite3.connect(db)
    conn.execute('UPDATE brokerha_meta SET value = \'1\' WHERE key = \'schema_version\'')
    conn.execute('DROP TABLE message_runs')
    conn.execute('DROP TABLE run_marks')
    conn.commit()
    conn.close()
    assert stored(f"sqlite:///{db}") == [(1, body(1), False)]
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT value FROM brokerha_meta WHERE key = 'schema_version'"
                        ).fetchone()[0] == schema.SCHEMA_VERSION
    conn.execute('UPDATE brokerha_meta SET value = \'99\' WHERE key = \'schema_version\'')
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="version 99"):
        SQLStore(f"sqlite:///{db}")


def _page_size(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()


def test_a_new_database_has_large_pages_and_an_old_one_keeps_its_own(tmp_path: Path) -> None:
    """A run is written in PAGE_SIZE frames (issue 33: 4 KiB frames were half the catching-up
    backup's writer thread); a database made with 4 KiB pages opens, keeps them and its
    messages, and takes runs as before."""
    from brokerha.store.sql import PAGE_SIZE

    new = tmp_path / "new.db"
    node = StoreNode(f"sqlite:///{new}")
    q = node.queue()
    add(node, q, 1, 300)
    node.close()
    assert _page_size(new) == PAGE_SIZE > 4096
    assert [p for p, _, _ in stored(f"sqlite:///{new}")] == list(range(1, 301))

    old = tmp_path / "old.db"
    conn = sqlite3.connect(old)
    conn.execute("PRAGMA page_size=4096")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x)")  # the page size is fixed from the first table on
    conn.commit()
    conn.close()
    node = StoreNode(f"sqlite:///{old}")
    q = node.queue()
    add(node, q, 1, 300)
    node.close()
    assert _page_size(old) == 4096
    got = stored(f"sqlite:///{old}")
    assert [(p, b) for p, b, _ in got] == [(p, body(p)) for p in range(1, 301)]
