"""The operation log in front of an SQLite store (brokerha.store.oplog).

Confirms wait for an append and an fdatasync of the log; the writer applies the
log to SQL later, and a store opened after a crash replays what SQL lacks.

Two tricks make these tests deterministic:

- ``lazy_writer`` + ``lazy()``: the writer applies only when it must (a log file
  is complete, someone waits in ``after_readable``, or the store closes): the
  idle apply (``writer.IDLE_SECONDS``) and the age/size limits are pushed out to
  an hour, so "logged but not in SQL yet" is a state a test can look at.
- ``crash(node)``: the writer's commits become no-ops and it deletes no log
  file (``freeze``), then the store is closed, which stops its threads and
  releases the log lock as the kernel would for a killed process. The disk is
  left as after a SIGKILL: the log holds everything confirmed, SQL holds what
  was applied before the freeze.
"""

from __future__ import annotations

import argparse
import logging
import sqlite3
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from brokerha.broker.broker import Limits
from brokerha.broker.paging import PAGED
from brokerha.broker.queue import Queue
from brokerha.files import drop_cached
from brokerha.node import config_from_args, register
from brokerha.node.config import ConfigError, NodeConfig, apply_document
from brokerha.store import oplog as oplog_module
from brokerha.store import writer as writer_module
from brokerha.store.batch import APPLIED_KEY, ENQUEUED, ENQUEUED_RUN, Batch, pack_run
from brokerha.store.factory import open_store
from brokerha.store.oplog import MAGIC
from brokerha.store.sql import SQLStore, StoreError
from brokerha.store.writer import ApplyPolicy
from tests.store.harness import LIMIT, SIZE, StoreNode, body, message, resident

_RECORD = struct.Struct("<II")
END = 0xFFFFFFFF  # the length field of a file's end record


# -- helpers ----------------------------------------------------------------------------------

@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


def url_of(db: Path) -> str:
    return f"sqlite:///{db}"


@pytest.fixture
def lazy_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """No idle apply: with ``lazy()`` the writer applies only when it must."""
    monkeypatch.setattr(writer_module, "IDLE_SECONDS", 3600.0)


def lazy() -> ApplyPolicy:
    """A fresh policy per store (the store sets its ``on_applied``)."""
    return ApplyPolicy(max_age=3600.0, max_ops=10**9, idle=3600.0)


def open_node(db: Path, **options: Any) -> StoreNode:
    return StoreNode(url_of(db), oplog=True, **options)


def freeze(store: SQLStore) -> None:
    """From now on the writer drops what it would apply and deletes no log file."""
    writer = store._writer
    writer._commit = lambda conn, batch: None  # type: ignore[method-assign]
    assert writer.policy is not None
    writer.policy.on_applied = None


def crash(node: StoreNode) -> None:
    """Stop the node as a crash would (see the module docstring): no end record either."""
    freeze(node.store)
    oplog = node.store.oplog
    assert oplog is not None

    def cut_off() -> int:
        oplog.sync()
        oplog.close()
        return oplog.generation

    oplog.finish = cut_off  # type: ignore[method-assign]
    node.close()


def log_files(db: Path) -> list[Path]:
    """The numbered log files next to ``db`` (not the spare, not the lock)."""
    return sorted(p for p in db.parent.glob(db.name + ".oplog.*")
                  if p.name.rsplit(".", 1)[1].isdigit())


def spare(db: Path) -> Path:
    return db.with_name(db.name + ".oplog.spare")


def sql_messages(db: Path) -> list[tuple[str, int, bytes, bool]]:
    """(queue, position, body, delivered) as SQL holds them, read on a connection of our own."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute('SELECT "queue", "position", "body", "delivered" FROM "messages" '
                            'ORDER BY "vhost", "queue", "position"').fetchall()
    finally:
        conn.close()
    return [(q, p, bytes(b), bool(d)) for q, p, b, d in rows]


def sql_bodies(db: Path) -> list[bytes]:
    return [body for _q, _p, body, _d in sql_messages(db)]


def sql_meta(db: Path, key: str) -> str | None:
    conn = sqlite3.connect(db)
    try:
        row = conn.execute('SELECT "value" FROM "brokerha_meta" WHERE "key" = ?',
                           (key,)).fetchone()
    finally:
        conn.close()
    return None if row is None else row[0]


def logged_bodies(store: SQLStore) -> list[bytes]:
    """The bodies of the enqueues in the store's log files, in order."""
    oplog = store.oplog
    assert oplog is not None
    return [op[4].body for g in oplog.generations() for ops in oplog.read(g, newest=True)
            for op in ops if op[0] == ENQUEUED]


def records(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each record of a log file's bytes, up to its end record or its end."""
    assert data[:len(MAGIC)] == MAGIC
    found, pos = [], len(MAGIC)
    while pos + _RECORD.size <= len(data):
        size, _crc = _RECORD.unpack_from(data, pos)
        if size == END or pos + _RECORD.size + size > len(data):
            break
        found.append((pos, pos + _RECORD.size + size))
        pos += _RECORD.size + size
    return found


def wait_until(node: StoreNode, predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    """Run the node's loop until ``predicate()`` holds (reports from the store threads run)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        node.spin(0.01)


def readable(node: StoreNode) -> None:
    """Wait until everything recorded so far is in SQL (``after_readable``)."""
    fut = node.loop.create_future()
    node.store.after_readable(lambda: fut.done() or fut.set_result(None))
    node.wait(fut)


def publish(node: StoreNode, q: Queue, bodies: list[bytes]) -> None:
    """Each body in a log record of its own (enqueue, then sync)."""
    for b in bodies:
        q.enqueue(message(b, rk=q.name))
        node.sync()


def consume(node: StoreNode, q: Queue) -> bytes:
    entry = q.get()
    assert entry is not None
    q.settle(entry)
    return entry.message.body


# -- durability: the log, then SQL --------------------------------------------------------------

def test_a_big_body_is_logged_by_reference_and_replayed_after_a_crash(db: Path) -> None:
    """A body of BIG_BODY bytes or more goes to the log file as it is (os.writev after its
    bin header), not copied through the packer with the GIL held (a 50 MiB message held it
    0.1-0.3 s): the record's bytes are the same as one pack, and it replays."""
    import msgpack

    from brokerha.store.oplog import BIG_BODY, PACK_CHUNK, encode_ops, encode_parts

    big = bytes(range(256)) * (3 * BIG_BODY // 256)
    ops: list[Any] = [(ENQUEUED, "/", "q", 1, message(b"small")),
                      (ENQUEUED, "/", "q", 2, message(big))]
    ops += [(2, "/", "q", i) for i in range(PACK_CHUNK + 3)]
    ops.append((ENQUEUED, "/", "q", 9999, message(big[:BIG_BODY])))
    packer = msgpack.Packer(use_bin_type=True)
    parts = encode_parts(packer, ops)
    assert any(part is big for part in parts)  # not copied
    rows = [(op[0], *op[1:4], op[4].exchange, op[4].routing_key, op[4].header, op[4].body)
            if op[0] == ENQUEUED else op for op in ops]
    assert b"".join(parts) == encode_ops(packer, ops) == packer.pack(rows)

    run = (ENQUEUED_RUN, "/", "r", 5, 7, pack_run([message(big[:BIG_BODY // 2])] * 3))
    parts = encode_parts(packer, [*ops, run])
    assert parts[-1] is run[5]  # a message run's contents (a catch-up's) as it came
    assert b"".join(parts) == packer.pack([*rows, run])

    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    publish(node, q, [b"a", big, b"b", big[:BIG_BODY]])
    assert logged_bodies(node.store) == [b"a", big, b"b", big[:BIG_BODY]]
    crash(node)
    node = open_node(db)
    assert [m.body for m in node.store.load().messages] == [b"a", big, b"b", big[:BIG_BODY]]
    node.close()


@pytest.mark.usefixtures("lazy_writer")
def test_confirmed_writes_are_in_the_log_and_a_crashed_store_replays_them(db: Path) -> None:
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    publish(node, q, [b"a", b"b"])
    # after_sync returned: both are in the log file, and not in SQL (not even the queue)
    assert logged_bodies(node.store) == [b"a", b"b"]
    assert sql_messages(db) == []
    stats = node.store.stats()
    assert stats["appends"] == 2 and stats["commits"] == 0
    generation = node.store.oplog.generation  # type: ignore[union-attr]
    crash(node)
    assert log_files(db) == [db.with_name(f"{db.name}.oplog.{generation:010d}")]
    assert sql_messages(db) == [] and sql_meta(db, APPLIED_KEY) is None

    node = open_node(db)  # the replay runs in the constructor, before load()
    assert [m.body for m in node.store.load().messages] == [b"a", b"b"]
    assert [e.message.body for e in node.vhost.queues["q"].ready] == [b"a", b"b"]
    assert sql_meta(db, APPLIED_KEY) == str(generation)
    # the replayed file is gone; only the new generation is open
    assert node.store.oplog.generation == generation + 1  # type: ignore[union-attr]
    assert [p.name for p in log_files(db)] == [f"{db.name}.oplog.{generation + 1:010d}"]
    node.close()
    assert log_files(db) == []


@pytest.mark.usefixtures("lazy_writer")
def test_a_fast_consumers_messages_never_reach_sql(db: Path) -> None:
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    for i in range(50):  # each publish and each ack confirmed (logged) on its own
        publish(node, q, [b"gone%d" % i])
        assert consume(node, q) == b"gone%d" % i
        node.sync()
    publish(node, q, [b"kept%d" % i for i in range(5)])
    assert len(logged_bodies(node.store)) == 55
    node.close()  # the one apply: everything logged folds into one batch
    stats = node.store.stats()
    assert stats["cancelled"] == 50
    assert stats["commits"] == 1
    # the vhost's definition, the queue, the kept messages, meta oplog_applied
    assert stats["rows"] == 1 + 1 + 5 + 1
    assert sql_bodies(db) == [b"kept%d" % i for i in range(5)]
    assert log_files(db) == []


def test_a_consumer_after_an_apply_deletes_the_row(db: Path) -> None:
    """The other side of the fold: a message already in SQL is deleted when consumed."""
    node = open_node(db)
    q = node.queue()
    publish(node, q, [b"a", b"b"])
    readable(node)
    assert sql_bodies(db) == [b"a", b"b"]
    assert consume(node, q) == b"a"
    readable(node)
    assert sql_bodies(db) == [b"b"]
    node.close()
    assert sql_bodies(db) == [b"b"]


# -- damaged log files ----------------------------------------------------------------------------

def _truncate_in_last(data: bytearray) -> bytearray:
    start, end = records(data)[-1]
    return data[:(start + end) // 2]


def _partial_header_after_last(data: bytearray) -> bytearray:
    end = records(data)[-1][1]
    return data[:end] + struct.pack("<I", 500)[:3]


def _garbage_over_the_zeros(data: bytearray) -> bytearray:
    end = records(data)[-1][1]
    torn = _RECORD.pack(64, 0xDEADBEEF) + b"\x93garbage"
    data[end:end + len(torn)] = torn
    return data


def _bad_checksum_in_last(data: bytearray) -> bytearray:
    start, end = records(data)[-1]
    data[end - 1] ^= 0xFF
    return data


@pytest.mark.usefixtures("lazy_writer")
@pytest.mark.parametrize(("damage", "kept"), [
    (_truncate_in_last, [b"a", b"b"]),
    (_partial_header_after_last, [b"a", b"b", b"c"]),
    (_garbage_over_the_zeros, [b"a", b"b", b"c"]),
    (_bad_checksum_in_last, [b"a", b"b"]),
], ids=["torn-record", "partial-header", "garbage-after", "bad-crc-last"])
def test_a_torn_tail_of_the_newest_file_is_dropped(
        db: Path, caplog: pytest.LogCaptureFixture,
        damage: Callable[[bytearray], bytearray], kept: list[bytes]) -> None:
    node = open_node(db, apply_policy=lazy())
    publish(node, node.queue(), [b"a", b"b", b"c"])
    crash(node)
    [path] = log_files(db)
    data = bytearray(path.read_bytes())
    assert len(records(data)) == 3  # one record per confirmed hand-over
    path.write_bytes(bytes(damage(data)))
    with caplog.at_level(logging.INFO, logger="brokerha.store"):
        node = open_node(db)
    assert "records end at byte" in caplog.text
    assert [m.body for m in node.store.load().messages] == kept
    assert path not in log_files(db)
    q = node.vhost.queues["q"]
    publish(node, q, [b"d"])  # the store goes on in a new file
    node.close()
    assert sql_bodies(db) == [*kept, b"d"]


def _two_generations(db: Path) -> list[Path]:
    """A crashed store whose log is three files: [queue, a], [b], and an empty newest one."""
    node = open_node(db)
    freeze(node.store)  # nothing applied, no file deleted, even when a file completes
    node.store._appender.rotate_bytes = 1  # type: ignore[union-attr]  # a file per append
    oplog = node.store.oplog
    assert oplog is not None
    first = oplog.generation
    publish(node, node.queue(), [b"a", b"b"])
    # the confirm comes before the appender rotates after its append: let it finish the
    # second file (end record) before the crash, or the crash cuts that rotation short
    deadline = time.monotonic() + 5
    while oplog.generation < first + 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    crash(node)
    files = log_files(db)
    assert [len(records(p.read_bytes())) for p in files] == [1, 1, 0]
    return files


def test_a_log_of_several_files_is_replayed_in_order(db: Path) -> None:
    files = _two_generations(db)
    node = open_node(db)
    assert [m.body for m in node.store.load().messages] == [b"a", b"b"]
    assert sql_meta(db, APPLIED_KEY) == files[-1].name.rsplit(".", 1)[1].lstrip("0")
    assert not set(files) & set(log_files(db))
    node.close()


@pytest.mark.parametrize("how", ["bad-crc", "truncated"])
def test_damage_in_an_older_file_refuses_to_start(db: Path, how: str) -> None:
    older = _two_generations(db)[1]
    data = bytearray(older.read_bytes())
    start, end = records(data)[0]
    if how == "bad-crc":
        data[end - 1] ^= 0xFF
    else:
        data = data[:end - 1]
    older.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="older log file"):
        SQLStore(url_of(db), oplog=True)
    assert sql_messages(db) == []  # nothing of the log was applied
    assert older.exists()


@pytest.mark.usefixtures("lazy_writer")
def test_a_file_sql_already_covers_is_not_applied_again(db: Path) -> None:
    """A crash between the SQL commit and the file's deletion leaves a covered file."""
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    publish(node, q, [b"a", b"b"])
    [path] = log_files(db)
    stale = path.read_bytes()  # the file as it was: a and b enqueued, nothing consumed
    generation = node.store.oplog.generation  # type: ignore[union-attr]
    assert consume(node, q) == b"a"
    node.sync()
    node.close()  # applies and deletes generation
    assert sql_bodies(db) == [b"b"] and sql_meta(db, APPLIED_KEY) == str(generation)
    assert log_files(db) == []
    path.write_bytes(stale)  # as if the deletion had not happened
    older = db.with_name(f"{db.name}.oplog.{generation - 1:010d}")
    older.write_bytes(stale)  # an even older leftover
    node = open_node(db)
    # replayed, it would have resurrected "a"
    assert [m.body for m in node.store.load().messages] == [b"b"]
    assert [e.message.body for e in node.vhost.queues["q"].ready] == [b"b"]
    assert path not in log_files(db) and older not in log_files(db)
    assert node.store.oplog.generation == generation + 1  # type: ignore[union-attr]
    node.close()
    assert sql_bodies(db) == [b"b"]


# -- one store per log ------------------------------------------------------------------------------

def test_a_second_store_on_an_open_log_is_refused(db: Path) -> None:
    node = open_node(db)
    publish(node, node.queue(), [b"a"])
    with pytest.raises(StoreError, match="in use"):
        SQLStore(url_of(db), oplog=True)
    assert logged_bodies(node.store) == [b"a"]  # the refused store replayed/deleted nothing
    node.close()
    store = SQLStore(url_of(db), oplog=True)
    assert [m.body for m in store.load().messages] == [b"a"]
    store.close()


# -- reading back: after_readable, get_meta ----------------------------------------------------------

@pytest.mark.usefixtures("lazy_writer")
def test_after_readable_runs_once_sql_holds_the_rows(db: Path) -> None:
    node = open_node(db, apply_policy=lazy())
    store = node.store
    q = node.queue()
    m = message(b"a")
    q.enqueue(m)
    store.put_meta("ha_position", "[1, 2]")
    node.sync()
    # confirmed, not applied: a reader of SQL does not see it, get_meta does
    assert store.read_bodies("/", "q", [1]) == {}
    assert sql_meta(db, "ha_position") is None
    assert store.get_meta("ha_position") == "[1, 2]"
    assert store.get_meta("missing") is None

    entered, gate = threading.Event(), threading.Event()
    real = store._writer._commit

    def held_commit(conn: Any, batch: Batch) -> None:
        entered.set()
        assert gate.wait(20), "test never released the writer"
        real(conn, batch)

    store._writer._commit = held_commit  # type: ignore[method-assign]
    seen: list[Any] = []
    store.after_readable(lambda: seen.append(
        (store.read_bodies("/", "q", [1]), sql_meta(db, "ha_position"))))
    wait_until(node, entered.is_set)  # a reader waits: the writer applies (and is held)
    node.spin(0.2)
    assert seen == []
    gate.set()
    wait_until(node, lambda: seen)
    assert seen == [({1: (m.header, b"a")}, "[1, 2]")]
    assert store.get_meta("ha_position") == "[1, 2]"
    store.put_meta("ha_position", "[3, 4]")  # an upsert, seen at once
    assert store.get_meta("ha_position") == "[3, 4]"
    readable(node)  # nothing pending but the meta: still goes through the writer
    assert sql_meta(db, "ha_position") == "[3, 4]"
    node.close()
    other = SQLStore(url_of(db), oplog=True)
    assert other.get_meta("ha_position") == "[3, 4]"
    other.close()


def test_after_readable_without_the_log_is_after_sync(db: Path) -> None:
    node = StoreNode(url_of(db))
    assert node.store.oplog is None
    q = node.queue()
    q.enqueue(message(b"a"))
    readable(node)
    assert sql_bodies(db) == [b"a"]
    node.close()


# -- rotation ------------------------------------------------------------------------------------

def test_log_files_rotate_and_are_applied_and_deleted_while_publishing(db: Path) -> None:
    node = open_node(db)
    store = node.store
    oplog, appender = store.oplog, store._appender
    assert oplog is not None and appender is not None
    appender.rotate_bytes = 16 * 1024
    oplog.preallocate = 1 << 20  # cheaper spares for the many files of this test
    first = oplog.generation
    q = node.queue()
    kept: list[bytes] = []

    def all_applied() -> int:
        """Wait until SQL covers every completed file and only the open one is left."""
        readable(node)
        current = oplog.generation
        wait_until(node, lambda: log_files(db) == [oplog.path(current)] and spare(db).exists())
        assert sql_meta(db, APPLIED_KEY) == str(current - 1)
        assert sql_bodies(db) == kept  # consumed ones deleted, the rest applied
        return current

    for chunk in range(30):
        bodies = [b"%04d" % (chunk * 10 + i) + b"x" * 1000 for i in range(10)]
        node.call(lambda bodies=bodies: [q.enqueue(message(b)) for b in bodies])
        node.sync()
        for _ in range(5):
            consume(node, q)
        node.sync()
        kept = [e.message.body for e in q.ready]
        if chunk == 14:  # halfway: files were applied and deleted while publishing
            halfway = all_applied()
            assert halfway >= first + 5
    assert store.stats()["rotations"] >= 10
    assert oplog.generation >= halfway + 5
    current = all_applied()
    assert len(kept) == 150
    node.close()
    assert log_files(db) == []
    assert sql_meta(db, APPLIED_KEY) == str(current)
    assert sql_bodies(db) == kept
    node = open_node(db)
    assert node.store.oplog.generation == current + 1  # type: ignore[union-attr]
    assert [e.message.body for e in node.vhost.queues["q"].ready] == kept
    node.close()


# -- paging reads what the log applied ------------------------------------------------------------


def settle_pages(node: StoreNode) -> None:
    """Until no queue waits to page (the page-outs wait for after_readable)."""
    wait_until(node, lambda: not any(q.page_pending for q in node.vhost.queues.values()))


def fill(node: StoreNode, q: Queue, first: int, count: int, chunk: int = 50) -> None:
    for start in range(first, first + count, chunk):
        node.call(lambda s=start: [q.enqueue(message(body(i)))
                                   for i in range(s, min(s + chunk, first + count))])
        node.sync()
        settle_pages(node)
        assert resident(q) <= LIMIT + SIZE


def drain(node: StoreNode, q: Queue, count: int | None = None) -> list[bytes]:
    out: list[bytes] = []
    while count is None or len(out) < count:
        entry = node.call(q.get)
        if entry is None:
            break
        out.append(entry.message.body)
        assert resident(q) <= LIMIT + 2 * SIZE
        node.call(lambda e=entry: q.settle(e))
    return out


def test_a_long_queue_pages_through_the_log(db: Path) -> None:
    limits = Limits(queue_max_memory=LIMIT)
    node = open_node(db, limits=limits)
    q = node.queue()
    fill(node, q, 0, 300)
    assert sum(1 for e in q.ready if e.paged == PAGED) > 250
    assert all(e.paged == 0 for e in list(q.ready)[:10])  # the head stays resident
    assert drain(node, q, 100) == [body(i) for i in range(100)]
    pager = node.broker.memory.pager
    assert pager is not None and pager.read_back >= 80
    fill(node, q, 300, 100)  # paging goes on behind reads
    node.close()
    node = open_node(db, limits=limits)
    q = node.vhost.queues["q"]
    assert len(q.ready) == 300
    assert resident(q) <= LIMIT + SIZE
    assert drain(node, q) == [body(i) for i in range(100, 400)]
    node.close()
    assert sql_messages(db) == []


# -- a representative lifecycle ----------------------------------------------------------------------

def test_lifecycle_through_the_log(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Definitions and messages round-trip through close/reopen and through a crash."""
    node = open_node(db)
    args = {"x-max-length": 10, "x-nested": {"k": [1, "two"]}}
    v = node.vhost
    v.declare_exchange("dx", "topic", durable=True, arguments={"alternate-exchange": "ae"})
    v.declare_exchange("ae", "fanout", durable=True)
    v.declare_exchange("tx", "direct", durable=False)
    dq = v.declare_queue("dq", owner=None, durable=True, arguments=args)
    v.declare_queue("tq", owner=None, durable=False)
    v.bind("dx", dq, "a.*", {"x-match": "all"})
    v.bind("dx", v.exchange("ae"), "b.#")
    q = node.queue()
    publish(node, q, [b"a", b"b", b"c"])
    first = q.get()
    assert first is not None and first.message.body == b"a"
    node.sync()
    q.settle(first)
    second = q.get()  # delivered, never acked: comes back redelivered
    assert second is not None
    publish(node, dq, [b"old"])
    dq.enqueue(message(b"pending", rk="dq"))  # the same hand-over as the delete
    v.delete_queue("dq", owner=None)
    dq = v.declare_queue("dq", owner=None, durable=True, arguments=args)
    publish(node, dq, [b"new"])
    node.close()

    node = open_node(db)
    defs = node.store.load()
    assert {(e.name, e.type) for e in defs.exchanges} == {("dx", "topic"), ("ae", "fanout")}
    assert [(r.name, r.arguments) for r in defs.queues] == [("dq", args), ("q", {})]
    assert sorted((b.destination_kind, b.destination, b.routing_key) for b in defs.bindings) \
        == [("exchange", "ae", "b.#")]  # the queue binding went with the deleted queue
    v = node.vhost
    assert "tq" not in v.queues and v.exchanges["dx"].alternate == "ae"
    assert [(e.message.body, e.redelivered) for e in v.queues["q"].ready] \
        == [(b"b", True), (b"c", False)]
    assert [e.message.body for e in v.queues["dq"].ready] == [b"new"]

    # the same kind of changes, recovered from the log alone
    monkeypatch.setattr(writer_module, "IDLE_SECONDS", 3600.0)
    node.close()
    node = open_node(db, apply_policy=lazy())
    v = node.vhost
    q, dq = v.queues["q"], v.queues["dq"]
    v.bind("dx", dq, "c.#")
    v.delete_exchange("ae")
    assert consume(node, q) == b"b"
    publish(node, q, [b"d"])
    publish(node, dq, [b"newer"])
    v.delete_queue("dq", owner=None)
    v.declare_queue("dq", owner=None, durable=True)
    publish(node, v.queues["dq"], [b"newest"])
    crash(node)
    node = open_node(db)
    defs = node.store.load()
    assert [e.name for e in defs.exchanges] == ["dx"]
    assert [(r.name, r.arguments) for r in defs.queues] == [("dq", {}), ("q", {})]
    assert defs.bindings == []
    assert [(m.queue, m.body) for m in defs.messages] == [
        ("dq", b"newest"), ("q", b"c"), ("q", b"d")]
    node.close()


# -- configuration ------------------------------------------------------------------------------

def test_oplog_configuration(tmp_path: Path) -> None:
    assert NodeConfig().store.oplog is True
    assert apply_document({"store": {"oplog": False}}, NodeConfig()).store.oplog is False
    assert apply_document({"store": {"oplog": True}}, NodeConfig()).store.oplog is True
    for bad in ("false", 0, "yes"):
        with pytest.raises(ConfigError, match="store.oplog"):
            apply_document({"store": {"oplog": bad}}, NodeConfig())
    toml = tmp_path / "n.toml"
    toml.write_text("[store]\noplog = false\n")
    parser = argparse.ArgumentParser()
    register(parser)
    assert config_from_args(parser.parse_args(["--config", str(toml)]))[0].store.oplog is False
    on = parser.parse_args(["--config", str(toml), "--store-oplog", "on"])
    assert config_from_args(on)[0].store.oplog is True
    off = parser.parse_args(["--store-oplog", "off"])
    assert config_from_args(off)[0].store.oplog is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--store-oplog", "maybe"])

    with_log = open_store(None, tmp_path / "a")
    assert isinstance(with_log, SQLStore) and with_log.oplog is not None
    assert log_files(tmp_path / "a" / "brokerha.db")  # its first file is open
    with_log.close()
    without = open_store(None, tmp_path / "b", oplog=False)
    assert isinstance(without, SQLStore) and without.oplog is None
    without.close()
    assert not list((tmp_path / "b").glob("*.oplog*"))


def test_postgresql_has_no_oplog(pg_server: str) -> None:
    from brokerha.testing_postgres import create_database

    url = create_database(pg_server, "store_test_oplog")
    with pytest.raises(StoreError, match="SQLite"):
        SQLStore(url, oplog=True)
    store = open_store(url, Path("/nonexistent"))  # the default oplog=True is not for it
    assert isinstance(store, SQLStore) and store.oplog is None
    store.close()


# -- crash and open edge cases -------------------------------------------------------------------

@pytest.mark.usefixtures("lazy_writer")
def test_a_message_applied_then_consumed_stays_consumed_after_a_crash(db: Path) -> None:
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    publish(node, q, [b"a", b"b"])
    readable(node)  # an apply in the middle of the log file (idle, age, a reader...)
    assert sql_bodies(db) == [b"a", b"b"]
    assert consume(node, q) == b"a"
    node.sync()  # the ack is durable (logged), not applied yet
    crash(node)
    node = open_node(db)
    try:
        assert [m.body for m in node.store.load().messages] == [b"b"]
    finally:
        node.close()


@pytest.mark.usefixtures("lazy_writer")
def test_turning_the_oplog_off_after_a_crash_keeps_what_was_logged(db: Path) -> None:
    node = open_node(db, apply_policy=lazy())
    publish(node, node.queue(), [b"a"])
    crash(node)
    try:
        store = SQLStore(url_of(db))
    except StoreError:
        pytest.fail("a store without the log must still replay what a run with it left")
    try:
        assert [m.body for m in store.load().messages] == [b"a"]
    finally:
        store.close()


def test_a_failed_open_releases_the_log_lock(db: Path) -> None:
    files = _two_generations(db)
    good = files[1].read_bytes()
    data = bytearray(good)
    end = records(data)[0][1]
    data[end - 1] ^= 0xFF
    files[1].write_bytes(bytes(data))
    with pytest.raises(StoreError, match="older log file"):
        SQLStore(url_of(db), oplog=True)
    files[1].write_bytes(good)  # repaired
    store = SQLStore(url_of(db), oplog=True)
    assert [m.body for m in store.load().messages] == [b"a", b"b"]
    store.close()


# -- syncs only for what someone waits for ------------------------------------------------------

@pytest.mark.usefixtures("lazy_writer")
def test_writes_nobody_waits_for_are_synced_by_the_next_barrier(db: Path) -> None:
    """A consumer's acks (no after_sync) are appended but not synced; after_sync syncs them.

    Without the ``synced`` flag of the report, ``after_sync`` would take its
    shortcut (nothing pending, nothing in flight) and call back before the
    dequeues were on disk.
    """
    node = open_node(db, apply_policy=lazy())
    try:
        q = node.queue()
        publish(node, q, [b"a", b"b"])
        syncs, appends = node.store.stats()["syncs"], node.store.stats()["appends"]
        assert consume(node, q) == b"a"
        node.spin(0.05)
        appender = node.store._appender
        assert appender is not None
        wait_until(node, lambda: node.store.stats()["appends"] == appends + 1
                   and appender.appended == node.store._handed)
        assert node.store.stats()["syncs"] == syncs  # appended, not synced
        assert node.store.oplog is not None and node.store.oplog.dirty
        seen: list[str] = []
        node.store.after_sync(lambda: seen.append("synced"))
        assert seen == []                            # no shortcut past the unsynced append
        wait_until(node, lambda: seen == ["synced"])
        assert node.store.stats()["syncs"] == syncs + 1
        assert not node.store.oplog.dirty
        node.store.after_sync(lambda: seen.append("again"))
        assert seen == ["synced", "again"]           # nothing unsynced: at once
    finally:
        node.close()
    node = open_node(db)
    try:
        assert [m.body for m in node.store.load().messages] == [b"b"]
    finally:
        node.close()


def test_a_reused_file_replays_only_its_own_generation(db: Path) -> None:
    """Applied files are written over as later generations; a crash in one of them replays
    its new records and not the older generations' that follow them on disk."""
    node = open_node(db)
    oplog = node.store.oplog
    appender = node.store._appender
    assert oplog is not None and appender is not None
    appender.rotate_bytes = 8 * 1024
    q = node.queue()
    expected: list[bytes] = []
    for i in range(60):
        body = b"m%03d" % i + b"x" * 1000
        publish(node, q, [body])
        expected.append(body)
        if i % 3 == 0:
            assert consume(node, q) == expected.pop(0)
            node.sync()
        wait_until(node, lambda: oplog.generation - 1 <= int(sql_meta(db, APPLIED_KEY) or 0))
    assert oplog.reused >= 3
    crash(node)
    [newest] = log_files(db)
    assert len(newest.read_bytes()) > 8 * 1024  # a reused file: older records follow the new
    node = open_node(db)
    try:
        assert [m.body for m in node.store.load().messages] == expected
    finally:
        node.close()


def test_a_kept_file_leaves_the_page_cache_once_and_is_never_the_spare(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file kept for its stored runs is dropped from the page cache when an apply covers
    it (issue 33: its pages were ~2 GB a node after a 2,000,000 catch-up), once; released
    later it is deleted, not written over as the spare (each page partly written would be
    read back from the disk first)."""
    dropped: list[str] = []
    monkeypatch.setattr(oplog_module, "drop_cached", lambda path: dropped.append(path.name))
    log = oplog_module.OpLog(tmp_path / "n.db")
    try:
        for generation in (1, 2, 3):
            log.open(generation)
            log.append(b"x" * 10_000)
            log.finish()
        log.keep = lambda g: g == 2
        log.remove_through(3)
        log.remove_through(3)
        assert dropped == [log.path(2).name] and log.kept == 1
        assert log.spare.exists() and not log.path(1).exists() and not log.path(3).exists()
        log.spare.unlink()  # no spare now: a released file that was cached would become it
        log.keep = lambda g: False
        log.drop_kept([2])
        assert not log.path(2).exists() and not log.spare.exists()
    finally:
        log.release()
    drop_cached(tmp_path / "n.db.oplog.missing")  # a file gone: nothing to do
    path = tmp_path / "cached"
    path.write_bytes(b"y" * 100_000)
    drop_cached(path)
    assert path.read_bytes() == b"y" * 100_000
