"""Message runs kept in the operation log (issue 33): a run's bytes written once.

A run whose contents went to the log as a buffer of their own (at least
``oplog.BIG_BODY``: a catch-up's runs, a big transaction's) is not copied into
SQL: its row holds a reference to the log file, which is kept while a stored
run refers to it (``store/runs.py``). What must hold: the messages read back
(recovery, with or without the log; paging) are the ones enqueued; the file
stays across restarts and goes once its last run is taken, purged or its queue
deleted; a crash before or after SQL applied the references replays to the
same messages; a kept file that is gone or holds other bytes fails the store
(no message is invented or silently lost).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from brokerha.broker.queue import Queue
from brokerha.store.oplog import BIG_BODY
from brokerha.store.runs import REF_BYTES, ref_of
from brokerha.store.sql import StoreError
from tests.store.harness import SIZE, StoreNode, body
from tests.store.test_oplog import (  # noqa: F401 - lazy_writer is a fixture
    crash,
    lazy,
    lazy_writer,
    log_files,
    open_node,
    readable,
)
from tests.store.test_runs import add, stored, take

BIG = 100  # messages in a run of 100 x 1,000 B: over BIG_BODY, kept in the log
assert BIG * SIZE > BIG_BODY


def run_rows(db: Path) -> list[tuple[int, bytes]]:
    """(first position, contents column) of every stored run."""
    conn = sqlite3.connect(db)
    try:
        return [(int(f), bytes(c)) for f, c in conn.execute(
            'SELECT "first_position", "contents" FROM "message_runs" ORDER BY 1')]
    finally:
        conn.close()


def referred(db: Path) -> set[int]:
    """The log generations the stored runs refer to."""
    return {ref[0] for _, c in run_rows(db) if (ref := ref_of(c)) is not None}


def generations(db: Path) -> set[int]:
    return {int(p.name.rsplit(".", 1)[1]) for p in log_files(db)}


def file_per_append(node: StoreNode) -> None:
    """Every append completes its log file (applied to SQL at once, then kept or removed)."""
    assert node.store._appender is not None
    node.store._appender.rotate_bytes = 1


def everything(n: int, gone: tuple[int, ...] = ()) -> list[tuple[int, bytes, bool]]:
    return [(p, body(p), False) for p in range(1, n + 1) if p not in gone]


def test_a_big_run_is_referred_to_in_the_log_and_read_back_as_it_was(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    node = open_node(db)
    file_per_append(node)
    q = node.queue()
    add(node, q, 1, BIG)
    add(node, q, BIG + 1, 20)  # a small run: a copy in SQL, as before
    node.sync()
    readable(node)
    try:
        rows = run_rows(db)
        assert [(f, len(c) == REF_BYTES) for f, c in rows] == [(1, True), (BIG + 1, False)]
        kept = referred(db)
        assert len(kept) == 1 and kept <= generations(db)
        found = node.store.read_bodies("/", "q", [1, 50, BIG, BIG + 5])
        assert {p: b for p, (_, b) in found.items()} == {p: body(p) for p in (1, 50, BIG, BIG + 5)}
    finally:
        node.close()
    assert generations(db) >= kept  # closing keeps it
    assert stored(f"sqlite:///{db}") == everything(BIG + 20)  # read without the log too
    again = open_node(db)  # a restart with the log keeps the file and reads it
    try:
        assert [(m.position, m.body) for m in again.store.load().messages] == [
            (p, body(p)) for p in range(1, BIG + 21)]
    finally:
        again.close()
    assert generations(db) >= kept


def test_the_kept_file_goes_once_its_run_is_taken_even_after_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    node = open_node(db)
    file_per_append(node)
    q = node.queue()
    add(node, q, 1, BIG)
    node.sync()  # a log file each
    add(node, q, BIG + 1, BIG)
    node.sync()
    readable(node)
    first, second = sorted(referred(db))
    take(node, q, list(range(1, BIG + 1)))  # the first run wholly
    take(node, q, [BIG + 1, BIG + 2])
    node.sync()
    readable(node)
    assert referred(db) == {second}
    assert first not in generations(db) and second in generations(db)
    node.close()
    node = open_node(db)
    file_per_append(node)
    try:
        assert second in generations(db)
        q = node.broker.vhosts["/"].queues["q"]
        assert [e.position for e in q.ready] == list(range(BIG + 3, 2 * BIG + 1))
        take(node, q, list(range(BIG + 3, 2 * BIG + 1)))
        node.sync()
        readable(node)
        assert run_rows(db) == []
        assert second not in generations(db)
    finally:
        node.close()


def test_a_purge_and_a_queue_deleted_release_their_files(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    node = open_node(db)
    file_per_append(node)
    q = node.queue()
    r = node.queue("r")
    add(node, q, 1, BIG)
    add(node, r, 1, BIG)  # the same hand-over: two runs in one log file
    node.sync()
    readable(node)
    try:
        (kept,) = referred(db)
        assert len(run_rows(db)) == 2
        node.call(lambda: node.broker.store.purged(q, [(1, BIG)]))
        node.sync()
        readable(node)
        assert referred(db) == {kept} and kept in generations(db)  # r's run is in it
        node.call(lambda: node.vhost.delete_queue("r", owner=None))
        node.sync()
        readable(node)
        assert run_rows(db) == []
        assert kept not in generations(db)
    finally:
        node.close()


def test_a_crash_before_sql_applied_the_run_replays_it(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    add(node, q, 1, BIG)
    node.sync()
    take(node, q, [7])
    node.sync()
    crash(node)
    assert run_rows(db) == []
    assert stored(f"sqlite:///{db}") == everything(BIG, gone=(7,))


@pytest.mark.usefixtures("lazy_writer")
def test_a_crash_after_sql_referred_to_the_current_file_replays_it_as_copies(
        tmp_path: Path) -> None:
    """SQL applied references into the file being written, then the node died: the replay
    writes the runs again (as copies) and the file goes with the rest of the log."""
    db = tmp_path / "store.db"
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    add(node, q, 1, BIG)
    node.sync()
    readable(node)  # applied, and the file is still the current one
    current = node.store.oplog.generation  # type: ignore[union-attr]
    assert referred(db) == {current}
    take(node, q, [3])
    node.sync()
    crash(node)
    assert stored(f"sqlite:///{db}") == everything(BIG, gone=(3,))
    node = open_node(db)
    try:
        assert [m.position for m in node.store.load().messages] == [
            p for p in range(1, BIG + 1) if p != 3]
    finally:
        node.close()
    assert referred(db) == set()
    assert current not in generations(db)


@pytest.mark.parametrize("damage", ["removed", "overwritten"])
def test_a_kept_file_gone_or_changed_fails_the_store(tmp_path: Path, damage: str) -> None:
    db = tmp_path / "store.db"
    node = open_node(db)
    file_per_append(node)
    q: Queue = node.queue()
    add(node, q, 1, BIG)
    node.sync()
    readable(node)
    node.close()
    (generation,) = referred(db)
    path = next(p for p in log_files(db) if int(p.name.rsplit(".", 1)[1]) == generation)
    if damage == "removed":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="refers to"):
        stored(f"sqlite:///{db}")


def test_without_fdatasync_runs_are_copied_into_sql(tmp_path: Path) -> None:
    """synchronous=normal: the log is not synced, so SQL could outlive what it refers to."""
    db = tmp_path / "store.db"
    node = open_node(db, synchronous="normal")
    file_per_append(node)
    q = node.queue()
    add(node, q, 1, BIG)
    node.sync()
    readable(node)
    node.close()
    assert [(f, len(c) > REF_BYTES) for f, c in run_rows(db)] == [(1, True)]
    assert stored(f"sqlite:///{db}") == everything(BIG)
