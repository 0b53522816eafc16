"""A purge and a transaction's enqueues in the store: one operation each.

The broker records a queue.purge as one ``PURGED`` operation (ranges of
positions) before it lets go of the entries in slices (``broker/drain.py``),
so a crash in the middle brings nothing back; here the slices are turned by
hand, and the node "crashes" between them. A TX's enqueues on one queue are one
``ENQUEUED_MANY`` operation, expanded by the store's threads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from brokerha.broker.broker import Limits
from brokerha.broker.paging import PAGED, PENDING
from brokerha.store.batch import ENQUEUED, ENQUEUED_MANY, PURGED, Batch, Unit, within
from brokerha.store.oplog import decode_ops, encode_ops
from tests.broker.test_purge import Loop
from tests.store.harness import LIMIT, StoreNode, body, message
from tests.store.test_oplog import crash, lazy, lazy_writer, open_node, sql_messages  # noqa: F401
from tests.store.test_paging import fill


def sliced(node: StoreNode, entries: int = 50) -> Loop:
    loop = Loop()
    background = node.broker.background
    background.schedule, background.entries, background.seconds = loop.call_soon, entries, 0.0
    return loop


def stored_bodies(url: str) -> list[tuple[int, bytes, bool]]:
    node = StoreNode(url)
    try:
        return [(m.position, m.body, m.delivered) for m in node.store.load().messages]
    finally:
        node.close()


def test_a_crash_in_the_middle_of_a_purge_brings_none_of_it_back(store_url: str) -> None:
    node = StoreNode(store_url, limits=Limits(queue_max_memory=LIMIT))
    q = node.queue()
    fill(node, q, 300)
    assert any(e.paged == PAGED for e in q.ready)
    loop = sliced(node)
    assert node.call(lambda: node.vhost.purge_queue("q", None)) == 300
    node.sync()  # the purge is durable; its entries are still being let go of
    loop.turn()
    assert loop.calls and q.message_count == 0
    node.close()  # the rest of the slices never run
    assert stored_bodies(store_url) == []


def test_acquired_entries_survive_a_purge_and_a_crash(store_url: str) -> None:
    node = StoreNode(store_url)
    q = node.queue()
    node.call(lambda: [q.enqueue(message(body(i))) for i in range(200)])
    held = node.call(lambda: [q.get(), q.get()])
    loop = sliced(node)
    node.call(lambda: node.vhost.purge_queue("q", None))
    while not any(op[0] == PURGED for op in node.store._ops):
        loop.turn()  # the ranges: found in slices while entries are acquired
    node.sync()
    assert loop.calls  # the entries are still being let go of
    node.close()
    assert stored_bodies(store_url) == [(e.position, e.message.body, True) for e in held]


def test_new_messages_after_a_purge_in_the_same_commit_are_kept(store_url: str) -> None:
    node = StoreNode(store_url)
    q = node.queue()
    node.call(lambda: [q.enqueue(message(body(i))) for i in range(10)])
    node.sync()

    def purge_and_publish() -> None:
        q.enqueue(message(body(10)))  # in the same commit as the purge: purged too
        node.vhost.purge_queue("q", None)
        q.enqueue(message(body(11)))

    node.call(purge_and_publish)
    node.sync()
    node.close()
    assert [b for _, b, _ in stored_bodies(store_url)] == [body(11)]


def test_a_purge_of_a_paged_queue_pages_nothing_more_and_releases_its_memory(
        store_url: str) -> None:
    node = StoreNode(store_url, limits=Limits(queue_max_memory=LIMIT))
    try:
        q = node.queue()
        fill(node, q, 200)

        def burst() -> None:  # past the limit: pending, paged once their insert is readable
            for i in range(200, 260):
                q.enqueue(message(body(i)))

        node.call(burst)
        assert any(e.paged == PENDING for e in q.ready)
        pager = node.broker.memory.pager
        assert pager is not None
        paged_out = pager.paged_out
        loop = sliced(node)
        assert node.call(lambda: node.vhost.purge_queue("q", None)) == 260
        assert (q.ready_bytes, q.paged_bytes) == (0, 0)
        for _ in range(20):  # the page-outs due run as sliced works too
            node.sync()
            loop.run()
            if not q.page_pending:
                break
        assert pager.paged_out == paged_out  # the pending ones were not paged after all
        assert node.broker.memory.used == 0
        node.broker.background.schedule = None  # from here, everything at once
        fill(node, q, 100, start=300)  # the queue pages as before
        assert node.broker.memory.used == q.ready_bytes - q.paged_bytes
        entries = []
        while (e := node.call(q.get)) is not None:
            entries.append(e.message.body)
        assert entries == [body(i) for i in range(300, 400)]
    finally:
        node.close()


@pytest.mark.usefixtures("lazy_writer")
def test_a_logged_purge_is_replayed_after_a_crash(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    node.call(lambda: [q.enqueue(message(body(i))) for i in range(100)])
    node.sync()
    loop = sliced(node)
    node.call(lambda: node.vhost.purge_queue("q", None))
    node.call(lambda: q.enqueue(message(body(100))))
    node.sync()  # logged, not applied
    loop.turn()
    crash(node)
    node = open_node(db)
    try:
        assert [m.body for m in node.store.load().messages] == [body(100)]
    finally:
        node.close()
    assert [p for _, p, _, _ in sql_messages(db)] == [101]


def test_the_fold_drops_pending_rows_in_the_ranges_and_keeps_the_others() -> None:
    m = message(b"x")
    batch = Batch()
    batch.add(Unit([(ENQUEUED, "/", "q", p, m) for p in (1, 2, 5, 9)], []))
    batch.add(Unit([(PURGED, "/", "q", [(1, 2), (5, 5)])], []))
    batch.add(Unit([(ENQUEUED, "/", "q", 10, m)], []))
    inserts, _, deletes = batch.rows()
    assert sorted(row[2] for row in inserts) == [9, 10] and deletes == []
    assert batch.purges == [("/", "q", 1, 2), ("/", "q", 5, 5)] and not batch.empty


def test_ranges_membership_and_the_log_round_trip() -> None:
    inside = within([(20, 30), (1, 5), (7, 7)])
    assert [p for p in range(35) if inside(p)] == [1, 2, 3, 4, 5, 7, *range(20, 31)]
    import msgpack

    ops = [(PURGED, "/", "q", [(1, 5), (7, 7)])]
    assert decode_ops(encode_ops(msgpack.Packer(use_bin_type=True), ops)) == ops


def test_the_store_ignores_dequeues_of_a_deleted_queue(store_url: str) -> None:
    node = StoreNode(store_url)
    vhost = node.vhost
    old = node.queue()
    node.call(lambda: old.enqueue(message(body(0))))
    entry = node.call(old.get)
    node.call(lambda: vhost.delete_queue("q", owner=None))
    new = node.queue()
    node.call(lambda: new.enqueue(message(body(1))))  # position 1 again
    node.call(lambda: old.settle(entry))  # the old queue's ack: not the new queue's row
    node.sync()
    node.close()
    assert stored_bodies(store_url) == [(1, body(1), False)]


# -- a transaction's enqueues: one ENQUEUED_MANY operation ---------------------------------


def test_a_transactions_batch_is_stored_whole_and_recovered(store_url: str) -> None:
    node = StoreNode(store_url)
    q = node.queue()
    tx = node.broker.new_transaction()
    for i in range(20):
        tx.publish([q], message(body(i), persistent=i % 5 != 0))  # transient ones: not stored
    node.call(tx.commit_prepared)
    node.sync()
    node.close()
    assert stored_bodies(store_url) == [(i + 1, body(i), False) for i in range(20) if i % 5]


@pytest.mark.usefixtures("lazy_writer")
def test_a_logged_transaction_is_replayed_after_a_crash(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    node = open_node(db, apply_policy=lazy())
    q = node.queue()
    tx = node.broker.new_transaction()
    for i in range(10):
        tx.publish([q], message(body(i)))
    node.call(tx.commit_prepared)
    node.sync()  # logged, not applied
    crash(node)
    node = open_node(db)
    try:
        assert [m.body for m in node.store.load().messages] == [body(i) for i in range(10)]
    finally:
        node.close()


def test_a_batch_is_logged_as_the_enqueues_it_stands_for() -> None:
    import msgpack

    from brokerha.broker.message import Entry

    entries = [Entry(7, message(b"a"), None), Entry(8, message(b"t", persistent=False), None),
               Entry(9, message(b"b"), None)]
    ops = decode_ops(encode_ops(msgpack.Packer(use_bin_type=True),
                                [(ENQUEUED_MANY, "/", "q", entries)]))
    assert [(op[0], op[3], op[4].body) for op in ops] == [(ENQUEUED, 7, b"a"), (ENQUEUED, 9, b"b")]
    batch = Batch()
    batch.add(Unit([(ENQUEUED_MANY, "/", "q", entries)], []))
    assert sorted(row[2] for row in batch.rows()[0]) == [7, 9]


def test_a_big_record_is_packed_a_chunk_at_a_time_into_the_same_bytes() -> None:
    """One C call over a big commit's rows would hold the GIL (and the loop) for all of it."""
    import msgpack

    from brokerha.store.oplog import PACK_CHUNK

    ops: list[tuple[object, ...]] = [(3, "put_meta", ("k", "v"))]
    ops += [(2, "/", "q", i) for i in range(3 * PACK_CHUNK + 7)]
    packer = msgpack.Packer(use_bin_type=True)
    assert encode_ops(packer, ops) == packer.pack(ops)  # type: ignore[arg-type]


def test_a_big_commit_past_the_limit_is_paged_out_in_slices(store_url: str) -> None:
    node = StoreNode(store_url, limits=Limits(queue_max_memory=LIMIT))
    try:
        q = node.queue()
        loop = sliced(node, entries=50)
        tx = node.broker.new_transaction()
        for i in range(500):
            tx.publish([q], message(body(i)))
        node.call(tx.commit_prepared)
        pager = node.broker.memory.pager
        assert pager is not None
        for _ in range(50):  # the inserts become readable; the page-out is a sliced work
            node.sync()
            if loop.calls:
                break
        paged = [pager.paged_out]
        while loop.calls:
            loop.turn()
            paged.append(pager.paged_out)
        steps = [b - a for a, b in zip(paged, paged[1:], strict=False)]
        assert max(steps) <= 50 and len(steps) >= 9  # ~480 stubs, 50 a slice at most
        assert sum(1 for e in q.ready if e.paged == PAGED) == pager.paged_out > 450
        assert node.broker.memory.used == q.ready_bytes - q.paged_bytes
        node.broker.background.schedule = None
        got = []
        while (e := node.call(q.get)) is not None:
            got.append(e.message.body)
        assert got == [body(i) for i in range(500)]
    finally:
        node.close()
