"""The SQL store against SQLite and PostgreSQL: what is written, when callbacks run."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from brokerha.broker.storage import PreparedBranch
from brokerha.store.batch import ENQUEUED_MANY, Batch
from brokerha.store.sql import SQLStore, StoreError
from tests.store.harness import StoreNode, message


@pytest.fixture
def node(store_url: str) -> Iterator[StoreNode]:
    n = StoreNode(store_url)
    yield n
    if not n.loop.is_closed():
        n.close()


def block_writer(n: StoreNode) -> threading.Event:
    """Make the writer stop inside its next commit until the returned event is set."""
    gate = threading.Event()
    real = n.store._writer._commit

    def slow_commit(conn: Any, batch: Batch) -> None:
        assert gate.wait(20), "test never released the writer"
        real(conn, batch)

    n.store._writer._commit = slow_commit  # type: ignore[method-assign]
    return gate


def stored_bodies(n: StoreNode) -> dict[int, tuple[bytes, bool]]:
    return {m.position: (m.body, m.delivered) for m in n.store.load().messages}


# -- definitions -----------------------------------------------------------------------------

def test_definitions_round_trip(node: StoreNode) -> None:
    args = {"x-max-length": 10, "x-b": b"\x00\x01", "x-nested": {"k": [1, "two"]}}
    v = node.vhost
    v.declare_exchange("dx", "topic", durable=True, arguments={"alternate-exchange": "ae"})
    v.declare_exchange("ae", "fanout", durable=True)
    v.declare_exchange("tx", "direct", durable=False)
    q = v.declare_queue("dq", owner=None, durable=True, arguments=args)
    t = v.declare_queue("tq", owner=None, durable=False)
    v.bind("dx", q, "a.*", {"x-match": "all"})
    v.bind("dx", v.exchange("ae"), "b.#")
    v.bind("dx", t, "c")  # transient destination: not durable
    v.bind("tx", q, "d")  # transient source: not durable
    node.sync()
    node = node.reopen()
    defs = node.store.load()
    assert {(e.name, e.type) for e in defs.exchanges} == {("dx", "topic"), ("ae", "fanout")}
    dx = next(e for e in defs.exchanges if e.name == "dx")
    assert dx.arguments == {"alternate-exchange": "ae"}
    assert [(r.name, r.arguments) for r in defs.queues] == [("dq", args)]
    assert sorted((b.destination_kind, b.destination, b.routing_key, b.arguments)
                  for b in defs.bindings) == [("exchange", "ae", "b.#", {}),
                                              ("queue", "dq", "a.*", {"x-match": "all"})]
    restored = node.vhost
    assert "dq" in restored.queues and "tq" not in restored.queues
    assert restored.exchanges["dx"].alternate == "ae"
    node.close()


def test_deletes_remove_definitions(node: StoreNode) -> None:
    v = node.vhost
    v.declare_exchange("dx", "direct", durable=True)
    q = node.queue("dq")
    v.bind("dx", q, "k")
    node.sync()
    v.unbind("dx", q, "k")
    node.sync()
    assert node.store.load().bindings == []
    v.bind("dx", q, "k")
    v.delete_exchange("dx")
    v.delete_queue("dq", owner=None)
    node.sync()
    defs = node.store.load()
    assert (defs.exchanges, defs.queues, defs.bindings) == ([], [], [])


# -- messages --------------------------------------------------------------------------------

def test_persistent_message_lifecycle(node: StoreNode) -> None:
    q = node.queue()
    for body in (b"a", b"b", b"c"):
        q.enqueue(message(body))
    node.sync()
    assert stored_bodies(node) == {1: (b"a", False), 2: (b"b", False), 3: (b"c", False)}
    first = q.get()
    assert first is not None
    node.sync()
    assert stored_bodies(node)[1] == (b"a", True)
    q.settle(first)
    node.sync()
    assert sorted(stored_bodies(node)) == [2, 3]
    second = q.get()
    assert second is not None
    node.sync()
    node = node.reopen()  # the delivered, unacked message comes back redelivered
    entries = list(node.vhost.queues["q"].ready)
    assert [(e.message.body, e.redelivered) for e in entries] == [(b"b", True), (b"c", False)]
    assert entries[0].message.persistent
    node.close()


def test_transient_messages_and_non_durable_queues_are_not_stored(node: StoreNode) -> None:
    node.queue("dq").enqueue(message(b"transient", persistent=False))
    node.queue("tq", durable=False).enqueue(message(b"p", rk="tq"))
    node.sync()
    assert node.store.load().messages == []
    assert node.store.stats()["rows"] == 2  # the vhost's and the durable queue's definitions


def test_queue_delete_removes_its_messages(node: StoreNode) -> None:
    q = node.queue("dq")
    q.enqueue(message(b"old", rk="dq"))
    node.sync()
    q.enqueue(message(b"pending", rk="dq"))  # same batch as the delete and re-declare
    node.vhost.delete_queue("dq", owner=None)
    node.queue("dq").enqueue(message(b"new", rk="dq"))
    node.sync()
    assert [m.body for m in node.store.load().messages] == [b"new"]


def test_enqueue_and_dequeue_in_one_batch_are_never_written(node: StoreNode) -> None:
    q = node.queue()
    node.sync()
    rows_before = node.store.stats()["rows"]
    gate = block_writer(node)
    node.queue("other")  # a write for the writer to hold while the consumer runs
    blocked = node.barrier()
    node.spin(0.05)
    for i in range(50):  # a fast consumer: published and acked while a commit runs
        q.enqueue(message(b"%d" % i))
        entry = q.get()
        assert entry is not None and entry.message.body == b"%d" % i
        q.settle(entry)
    gate.set()
    node.wait(blocked)
    node.sync()
    stats = node.store.stats()
    assert stats["cancelled"] == 50
    assert stats["rows"] - rows_before == 1  # the "other" queue; no message row at all
    assert stored_bodies(node) == {}


# -- the durability barrier ------------------------------------------------------------------

def test_after_sync_waits_for_the_commit_covering_earlier_writes(node: StoreNode) -> None:
    q = node.queue()
    node.sync()
    gate = block_writer(node)
    seen: list[str] = []
    q.enqueue(message(b"one"))
    first = node.barrier(seen, "one")
    node.spin(0.05)  # the writer is now inside the commit of "one"
    q.enqueue(message(b"two"))
    second = node.barrier(seen, "two")
    node.spin(0.3)
    assert seen == []
    assert stored_bodies(node) == {}
    gate.set()
    node.wait(first)
    # "two" was recorded during the first commit: it needs a commit of its own
    node.wait(second)
    assert seen == ["one", "two"]
    assert [b for b, _ in stored_bodies(node).values()] == [b"one", b"two"]


def test_after_sync_runs_at_once_when_nothing_is_pending(node: StoreNode) -> None:
    node.sync()
    seen: list[str] = []
    node.barrier(seen)
    assert seen == ["synced"]


def test_a_transaction_lands_in_one_commit(node: StoreNode) -> None:
    q = node.queue()
    node.sync()
    gate = block_writer(node)
    q.enqueue(message(b"before"))
    node.spin(0.05)  # the writer is inside the commit of "before"
    tx = node.broker.new_transaction()
    for i in range(20):
        tx.publish([q], message(b"tx%d" % i))
    node.call(tx.apply)
    node.spin(0.05)
    waiting = node.store._writer._units  # handed over, not yet taken by the blocked writer
    # one unit (never split by a commit), with one operation for the 20 enqueues
    assert [[(op[0], len(op[3])) for op in unit.ops] for unit in waiting] == [[(ENQUEUED_MANY, 20)]]
    gate.set()
    node.sync()
    assert len(stored_bodies(node)) == 21


def test_failed_commit_calls_the_failure_hook_and_never_confirms(node: StoreNode) -> None:
    failures: list[tuple[BaseException, int]] = []
    node.store.on_failure = lambda exc: failures.append((exc, threading.get_ident()))
    q = node.queue()
    node.sync()
    node.store._writer.statements.put_message = "INSERT INTO no_such_table VALUES (1)"
    q.enqueue(message(b"lost"))
    seen: list[str] = []
    node.barrier(seen)
    node.spin(0.5)
    assert seen == []
    assert len(failures) == 1 and failures[0][1] == node.loop_thread
    assert node.store.failed is failures[0][0]
    q.enqueue(message(b"later"))
    node.barrier(seen)
    node.spin(0.2)
    assert seen == []


# -- prepared XA branches, schema ----------------------------------------------------------

def test_prepared_branch_round_trip(node: StoreNode) -> None:
    branch = PreparedBranch("1:abc:def", [("/", ["q"], "", "q", b"hdr", b"body")],
                            [("/", "q", 7)])
    done: list[str] = []
    node.store.dtx_prepared(branch, lambda: done.append("prepared"))
    node.spin(0.3)
    assert done == ["prepared"]
    assert node.store.load().prepared == [branch]
    node.store.dtx_finished(branch.xid)
    node.sync()
    assert node.store.load().prepared == []


def test_meta_values_commit_with_the_data_recorded_before_them(node: StoreNode) -> None:
    """The HA position is a meta value: durable in the same commit as the events it covers."""
    q = node.queue()
    gate = block_writer(node)
    q.enqueue(message(b"covered"))
    node.store.put_meta("ha_position", "[3, 17, 3, 17]")
    synced = node.barrier()
    assert SQLStore(node.url).get_meta("ha_position") is None  # nothing committed yet
    gate.set()
    node.wait(synced)
    other = SQLStore(node.url)
    assert other.get_meta("ha_position") == "[3, 17, 3, 17]"
    assert [m.body for m in other.load().messages] == [b"covered"]
    node.store.put_meta("ha_position", "[4, 0, 4, 0]")  # an upsert
    node.sync()
    assert SQLStore(node.url).get_meta("ha_position") == "[4, 0, 4, 0]"
    assert other.get_meta("missing") is None


def test_a_newer_schema_version_is_refused(node: StoreNode) -> None:
    with node.store.engine.begin() as conn:
        conn.execute(text("UPDATE brokerha_meta SET value = '99' WHERE key = 'schema_version'"))
    with pytest.raises(StoreError, match="schema version 99"):
        SQLStore(node.url)


# -- SQLite specifics ---------------------------------------------------------------------------

def test_sqlite_checkpoints_keep_the_wal_small(tmp_path: Path) -> None:
    from brokerha.store.sql import PAGE_SIZE

    path = tmp_path / "s.db"
    limit = 16 * PAGE_SIZE  # a commit of one message writes a page or two to the WAL
    node = StoreNode(f"sqlite:///{path}", wal_limit=limit)
    q = node.queue()
    for i in range(200):
        q.enqueue(message(b"x" * 1024 + b"%d" % i))
        node.sync()
    stats = node.store.stats()
    assert 1 <= stats["checkpoints"] < stats["commits"] / 3  # not after every commit
    assert os.path.getsize(f"{path}-wal") < 4 * limit
    node.close()
    assert not os.path.exists(f"{path}-wal") or os.path.getsize(f"{path}-wal") == 0
    journal = SQLStore(f"sqlite:///{path}").engine.connect()
    assert journal.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    journal.close()


def test_sqlite_synchronous_mode_is_applied(tmp_path: Path) -> None:
    for mode, level in (("full", 2), ("normal", 1)):
        store = SQLStore(f"sqlite:///{tmp_path / mode}.db", synchronous=mode)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == level
            assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
        store.close()
    with pytest.raises(StoreError):
        SQLStore(f"sqlite:///{tmp_path / 'x.db'}", synchronous="off")
