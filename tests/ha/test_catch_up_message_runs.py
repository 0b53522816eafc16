"""A catch-up's runs of enqueues (``er``, issue 33): one packed blob per run of a queue.

The primary sends the messages of a queue at consecutive positions, without
expiry, as runs whose contents are the store's run format; the backup makes
its entries from it and its store keeps that same blob as one message run.
What must hold: the backup ends with exactly the primary's messages (positions,
routing, headers, bodies, in order), a run is cut at every gap in the
positions, and a backup whose catch-up was cut short by a crash joins again
and ends equal.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgpack
import pytest

from brokerha.backup.backup import INVALID, Backup
from brokerha.backup.queue_replicator import QueueReplicator
from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R
from brokerha.cluster.replication import Events, ReplicationError
from brokerha.ha.simulation.world import message, wire
from brokerha.primary.catch_up import CATCH_UP_SPAN, Pace
from brokerha.primary.events import event_size
from brokerha.store.batch import ENQUEUED_MANY, ENQUEUED_RUN, pack_run, runs_of
from brokerha.store.factory import open_store
from brokerha.store.runs import PackedEntries
from tests.ha.harness import Cluster, Node, carry, publish

# slices of 40 KB: a run is at most 10 KB (a quarter), about 70 messages of ~140 bytes
PACE = Pace(slice_bytes=40_000, slice_work=256, window_bytes=120_000)


def messages(q: Queue) -> list[tuple[Any, ...]]:
    """Everything of a queue's entries that the catch-up carries, in the queue's order."""
    return [(e.position, e.message.exchange, e.message.routing_key, e.message.header,
             e.message.body, e.expires_at is not None) for e in q.ready]


def sent_events(c: Cluster, name: str) -> list[Any]:
    """Every event the primary sends ``name`` from now on (the harness's packets)."""
    seen: list[Any] = []
    take = c.primary.take_outbox

    def recording(node: str, hold_lazy: bool = False) -> list[Events]:
        packets = take(node, hold_lazy)
        if node == name:
            seen.extend(e for p in packets for e in p.events)
        return packets

    c.primary.take_outbox = recording  # type: ignore[method-assign]
    return seen


def fill(c: Cluster, n: int, size: int = 100) -> Queue:
    q = c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    for i in range(n):
        publish(c.broker, b"%d:" % i + b"x" * size, persistent=True, rk="q",
                headers={"i": i % 7})
    return q


def test_a_catch_up_in_runs_gives_the_backup_the_primarys_messages_in_order() -> None:
    c = Cluster(2, pace=PACE)
    q = fill(c, 300)
    taken = [q.get() for _ in range(40)]  # 1..40 delivered; some acked, out of order
    for entry in taken[5:12] + taken[30:33]:
        assert entry is not None
        q.settle(entry)  # gaps among the acquired ones
    for i in range(3):  # a gap of positions in the ready part (ttl), a transient, a big one
        publish(c.broker, b"ttl%d" % i, persistent=True, expiration="60000")
    publish(c.broker, b"transient", persistent=False)
    publish(c.broker, b"B" * 12_000, persistent=True)  # over a run's bytes
    for i in range(50):
        publish(c.broker, b"tail%d" % i, persistent=True)
    middle = [e for e in list(q.ready) if 150 <= e.position < 160]
    for e in middle:  # a gap in the ready part: taken off by position
        taken_off = q.take_position(e.position)
        assert taken_off is not None
        q.settle(taken_off)
    seen = sent_events(c, "n2")
    c.follow("n2")
    c.pump()
    held = [e for e in taken if e is not None and e.position not in
            {t.position for t in taken[5:12] + taken[30:33] if t is not None}]
    for e in held:
        q.requeue(e)  # back in their places: the backup has them as ready already
    backup_q = c.node("n2").broker.vhosts["/"].queues["q"]
    assert messages(backup_q) == messages(q)
    runs = [e for e in seen if e.kind == R.ENQUEUED_RUN]
    singles = [e for e in seen if e.kind == R.ENQUEUED]
    assert len(runs) >= 4 and sum(r.length for r in runs) > 250
    on_primary = {e.position for e in q.ready}
    for run in runs:  # cut at every gap, within bounds, no expiry in a run
        positions = range(run.first, run.first + run.length)
        assert set(positions) <= on_primary
        assert PACE.run_min <= run.length and event_size(run) <= PACE.run_bytes + 64 + 8
        assert [b for _, _, _, b in msgpack.unpackb(run.contents)] == [
            e.message.body for e in q.ready if e.position in positions]
    assert {e.body[:3] for e in singles} >= {b"ttl", b"BBB"}  # expiring, big: each its e
    assert c.node("n2").backup.caught_up  # type: ignore[union-attr]
    assert c.primary.status()["backups"]["n2"]["catch_up"]["sent"] == sum(
        r.length for r in runs) + len(singles)


def test_live_changes_during_a_catch_up_in_runs_converge() -> None:
    """Consumed, purged and published between slices: the live events follow the runs."""
    c = Cluster(2, pace=PACE)
    q = fill(c, 400)
    backup = c.follow("n2")
    carry(c.primary, backup)  # a slice or two of runs
    for i in range(20):
        publish(c.broker, b"live%d" % i, persistent=True)
    for _ in range(30):
        entry = q.get()
        assert entry is not None
        q.settle(entry)
    carry(c.primary, backup)
    taken = q.take_position(300)
    assert taken is not None
    q.settle(taken)
    c.pump()
    assert messages(c.node("n2").broker.vhosts["/"].queues["q"]) == messages(q)


def test_a_run_across_a_gap_gives_the_backup_other_messages_at_those_positions() -> None:
    """The rule the runs keep: cut at a gap. Broken (``Unsafe.runs_across_gaps``), the
    backup numbers the messages after a gap as others: caught here (and by the simulation,
    tests/ha/test_simulation.py)."""
    c = Cluster(2, pace=PACE)
    q = fill(c, 60)
    for position in (20, 21, 40):
        taken = q.take_position(position)
        assert taken is not None
        q.settle(taken)
    c.primary.runs_across_gaps = True
    c.follow("n2")
    c.pump()
    backup_q = c.node("n2").broker.vhosts["/"].queues["q"]
    assert [e.message.body for e in backup_q.ready] == [e.message.body for e in q.ready]
    assert messages(backup_q) != messages(q)  # same bodies, at the wrong positions


def test_the_backups_store_keeps_each_run_as_it_came_and_restores_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'n2.db'}"
    c = Cluster(2, pace=PACE, stores={"n2": open_store(url, tmp_path)})
    q = fill(c, 200)
    publish(c.broker, b"transient", persistent=False)  # a run with it is not stored whole
    for i in range(30):
        publish(c.broker, b"after%d" % i, persistent=True)
    seen = sent_events(c, "n2")
    c.follow("n2")
    c.pump()
    c.node("n2").broker.store.close()
    blobs = {e.contents for e in seen if e.kind == R.ENQUEUED_RUN}
    db = sqlite3.connect(tmp_path / "n2.db")
    stored = {bytes(row[0]) for row in db.execute("SELECT contents FROM message_runs")}
    db.close()
    assert len(blobs) >= 3
    whole = {b for b in blobs if b"transient" not in b}
    assert whole and whole <= stored  # the blob as it came
    assert len(whole) >= len(blobs) - 1  # only the run holding the transient one was repacked

    store = open_store(url, tmp_path)
    broker = Broker("n2", clock=c.clock, store=store)
    broker.restore(store.load())
    expected = [m for m in messages(q) if m[4] != b"transient"]
    assert messages(broker.vhosts["/"].queues["q"]) == expected
    store.close()


def test_a_backup_that_crashed_mid_catch_up_joins_again_and_ends_equal(tmp_path: Path) -> None:
    """Its position is invalid until the marker; restarted from its store (a part of the
    runs in it), it joins with that inventory, gets the rest, and holds the primary's."""
    url = f"sqlite:///{tmp_path / 'n2.db'}"
    c = Cluster(2, pace=PACE, stores={"n2": open_store(url, tmp_path)})
    q = fill(c, 1500)
    backup = c.follow("n2")
    for _ in range(3):
        carry(c.primary, backup)
    assert not backup.caught_up and backup.position == INVALID
    assert 0 < len(c.node("n2").broker.vhosts["/"].queues["q"].ready) < 1500
    c.node("n2").broker.store.close()  # what it applied is in its store; then it dies
    c.primary.backup_lost("n2", "crashed")

    store = open_store(url, tmp_path)
    broker = Broker("n2", clock=c.clock, store=store)
    broker.restore(store.load())
    kept = len(broker.vhosts["/"].queues["q"].ready)
    assert 25 < kept < 1500
    for _ in range(25):  # consumed meanwhile: the kept head is dropped on the backup
        entry = q.get()
        assert entry is not None
        q.settle(entry)
    c.nodes["n2"] = Node("n2", c.clock, broker=broker)
    c.follow("n2")
    c.pump()
    assert messages(broker.vhosts["/"].queues["q"]) == messages(q)
    status = c.primary.status()["backups"]["n2"]
    assert status["catch_up"]["skipped"] == kept - 25 and status["caught_up"]
    store.close()


def test_a_run_that_is_not_what_it_says_is_a_replication_error() -> None:
    broker = Broker("n2")
    broker.add_vhost("/").declare_queue("q", owner=None, durable=True)
    first = -CATCH_UP_SPAN
    good = pack_run([message(b"a", persistent=True), message(b"b", persistent=True)])
    for contents, count in ((good, 3), (b"\xc1", 1), (msgpack.packb([[1, 2]]), 1)):
        backup = Backup(broker, me="n2", epoch=1, position=(0, 0))
        join = backup.join_message()
        begin = [R.CatchUpBegins(R.CATCH_UP_BEGINS, join.session)]
        run = R.EnqueuedRun(R.ENQUEUED_RUN, "/", "q", 1, count, contents)
        with pytest.raises(ReplicationError):
            backup.receive(wire(Events(1, first, [*begin, run])))  # type: ignore[arg-type]
    assert len(broker.vhosts["/"].queues["q"].ready) == 0  # nothing of it applied


def test_entries_that_came_packed_are_one_run_of_the_same_bytes() -> None:
    msgs = [message(b"m%d" % i, persistent=True) for i in range(3)]
    contents = pack_run(msgs)
    entries = PackedEntries([Entry(7 + i, m, None) for i, m in enumerate(msgs)], contents)
    ops = runs_of((ENQUEUED_MANY, "/", "q", entries))
    assert ops == [(ENQUEUED_RUN, "/", "q", 7, 9, contents)] and ops[0][5] is contents
    mixed = PackedEntries([Entry(7, msgs[0], None), Entry(8, message(b"t"), None)],
                          pack_run([msgs[0], message(b"t")]))
    assert [op[0] for op in runs_of((ENQUEUED_MANY, "/", "q", mixed))] == [0]  # ENQUEUED


def test_a_priority_queues_runs_land_on_their_levels() -> None:
    """A run crosses priority levels (it is cut by position only): the backup's ready list
    puts each entry on its level, so deliveries come in the primary's order."""
    c = Cluster(2, pace=PACE)
    q = c.broker.vhosts["/"].declare_queue("pq", owner=None, durable=True,
                                           arguments={"x-max-priority": 3})
    for i in range(200):
        publish(c.broker, b"p%d" % i, rk="pq", persistent=True, priority=i % 4)
    seen = sent_events(c, "n2")
    c.follow("n2")
    c.pump()
    assert any(e.kind == R.ENQUEUED_RUN for e in seen)
    backup_q = c.node("n2").broker.vhosts["/"].queues["pq"]
    assert messages(backup_q) == messages(q)
    order = []
    while (entry := backup_q.get()) is not None:
        order.append(entry.message.body)
    assert order == _delivery_order(q) and len(order) == 200


def _delivery_order(q: Queue) -> list[bytes]:
    """The bodies in the order ``basic.get`` hands them out (highest priority first)."""
    out = []
    while (entry := q.get()) is not None:
        out.append(entry.message.body)
    return out


def test_a_runs_messages_share_the_routing_key_and_properties_they_repeat() -> None:
    """A row that repeats the last one's exchange, routing key or header holds that same
    object, not a copy of its own (a catching-up backup holds ~100 B less of fresh memory a
    message, issue 33); every message keeps its own values."""
    q = Broker("n2").add_vhost("/").declare_queue("q", owner=None, durable=True)
    msgs = [message(b"a1", rk="orders", persistent=True), message(b"a2", rk="orders", persistent=True),
            message(b"a3", rk="orders", persistent=True, priority=1),
            message(b"a4", rk="jobs", exchange="ex1", persistent=True, priority=1),
            message(b"a5", rk="jobs", exchange="ex1", persistent=True, priority=1)]
    QueueReplicator(q, lambda: 0.0).enqueue_packed(10, len(msgs), pack_run(msgs))
    assert messages(q) == [(10 + i, m.exchange, m.routing_key, m.header, m.body, False)
                           for i, m in enumerate(msgs)]
    held = [e.message for e in q.ready]
    assert held[1].routing_key is held[0].routing_key and held[2].routing_key is held[0].routing_key
    assert held[1].header is held[0].header and held[2].header is not held[1].header
    assert held[4].header is held[3].header is held[2].header  # the same properties
    assert held[4].exchange is held[3].exchange and held[4].routing_key is held[3].routing_key
