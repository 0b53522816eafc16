"""A master's start brings the global queues to its synchronised log (broker_bridge._bring_to_log).

The applied mark (store meta ``txlog_applied``, replicated as ``la``) counts
the synchronised entries whose effects the global queues hold; it is written
after those effects, in the same store (and HA log) order. A crash or a
failover can leave the queues behind the master's journal: the start
re-applies from the mark, once and in order, then makes every global queue
hold exactly what the log says, so a message dequeued by the log while a
consumer held it (its removal waits for the settle) is not resurrected.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry
from brokerha.broker.storage import MemoryStore
from brokerha.txlog.bridge.broker_bridge import APPLIED_KEY, TxLogBridge
from brokerha.txlog.master.driver import TxLogDriver
from tests.txlog.test_broker_bridge import in_loop, message, table, wait_until

pytestmark = pytest.mark.timeout(30)


def bridge_on(broker: Broker, tmp_path: Path, data: Path) -> TxLogBridge:
    from brokerha.txlog.master.settings import from_node_table

    config = from_node_table({**table(), "data-dir": str(data)}, "test", tmp_path, tmp_path)
    return TxLogBridge(broker, config, commit_timeout=5.0,
                       driver_factory=lambda s, on_action: TxLogDriver(s, on_action=on_action,
                                                                       fsync=False))


def new_broker(name: str, applied: int | None, held: list[str]) -> Broker:
    """A node after a crash: its store says ``applied``; the queue holds ``held``."""
    store = MemoryStore()
    if applied is not None:
        store.put_meta(APPLIED_KEY, str(applied))
    broker = Broker(name, store=store)
    broker.add_vhost("/")
    queue = broker.vhost("/").declare_queue("orders", owner=None, durable=True,
                                            arguments={"x-global": True})
    for gid in held:
        queue.add_entry(Entry(queue.next_position, message(gid.encode(), gid), None))
    return broker


def ready(broker: Broker) -> list[bytes]:
    return [e.message.body for e in broker.vhost("/").queues["orders"].ready]


async def history(tmp_path: Path) -> Path:
    """A master's journal: enqueues m1..m4, then a dequeue of m2 (5 entries)."""
    broker = new_broker("n1", None, [])
    bridge = bridge_on(broker, tmp_path, tmp_path / "journal")
    await bridge.start()
    queue = broker.vhost("/").queues["orders"]
    for gid in ("m1", "m2", "m3", "m4"):
        tx = broker.new_transaction()
        tx.publish([queue], message(gid.encode(), gid))
        await tx.commit()
    await wait_until(lambda: len(queue.ready) == 4)
    first, entry = queue.get(), queue.get()  # m1, m2
    assert first is not None and entry is not None and entry.message.body == b"m2"
    ack = broker.new_transaction()
    ack.accept([(queue, entry)], [])
    await ack.commit()
    queue.requeue(first)
    await asyncio.sleep(0.05)
    assert bridge.applied == 5 and broker.store.get_meta(APPLIED_KEY) == "5"
    await bridge.stop()
    return tmp_path / "journal"


@in_loop
async def test_a_restart_re_applies_what_the_store_missed_once_and_in_order(
        tmp_path: Path) -> None:
    journal = await history(tmp_path)
    # the store kept the effects of the first two entries (m1, m2) and the mark 2
    broker = new_broker("n1", 2, ["m1", "m2"])
    bridge = bridge_on(broker, tmp_path, journal)
    await bridge.start()
    try:
        assert ready(broker) == [b"m1", b"m3", b"m4"]
        assert bridge.counters["reapplied_at_start"] == 3
        assert bridge.counters["removed_at_start"] == 0
        await asyncio.sleep(0.01)
        assert broker.store.get_meta(APPLIED_KEY) == "5"
    finally:
        await bridge.stop()
    # a second start has nothing to do
    again = bridge_on(broker, tmp_path, journal)
    broker.observers.transactions.remove(bridge.tx_observers)
    await again.start()
    try:
        assert ready(broker) == [b"m1", b"m3", b"m4"]
        assert again.counters["reapplied_at_start"] == 0
    finally:
        await again.stop()


@in_loop
async def test_a_message_dequeued_while_held_is_not_resurrected(tmp_path: Path) -> None:
    journal = await history(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(journal, copy)
    # every effect recorded (mark 5), but m2's removal waited for its consumer's settle,
    # which the crash cut off: the store still has m2
    broker = new_broker("n1", 5, ["m1", "m2", "m3", "m4"])
    bridge = bridge_on(broker, tmp_path, copy)
    await bridge.start()
    try:
        assert ready(broker) == [b"m1", b"m3", b"m4"]
        assert bridge.counters["reapplied_at_start"] == 0
        assert bridge.counters["removed_at_start"] == 1
    finally:
        await bridge.stop()


@in_loop
async def test_a_store_without_a_mark_re_applies_the_whole_retained_log(tmp_path: Path) -> None:
    """A node that ran before the mark existed (or a fresh store): enqueues by id are idempotent."""
    journal = await history(tmp_path)
    broker = new_broker("n1", None, ["m1", "m3"])
    bridge = bridge_on(broker, tmp_path, journal)
    await bridge.start()
    try:
        assert ready(broker) == [b"m1", b"m3", b"m4"]
        assert bridge.counters["reapplied_at_start"] == 5
    finally:
        await bridge.stop()
