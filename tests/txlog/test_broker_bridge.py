"""The TxLog bridge in process: a broker, its global queues and a real (lone) TxLog master.

A master without peers orders its own transactions alone, so the whole path
runs here without a second datacenter: a commit submits to the master, the
master confirms and delivers the order, the bridge applies it to the queues.
Other datacenters are stood in for by submitting operations to the master
directly (as a peer's transaction would arrive: ordered, then delivered).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header, read_message_id
from brokerha.broker.errors import PreconditionFailed
from brokerha.broker.message import Message
from brokerha.broker.transaction import TransactionAborted
from brokerha.testing import free_port
from brokerha.txlog.bridge.broker_bridge import TxLogBridge
from brokerha.txlog.bridge.global_queues import pack_message, queue_key, unpack_message
from brokerha.txlog.engine.config import ConfigError
from brokerha.txlog.engine.records import Operation
from brokerha.txlog.master.driver import TxLogDriver
from brokerha.txlog.master.settings import from_node_table

pytestmark = pytest.mark.timeout(30)


def in_loop(test: Any) -> Any:
    """Run an async test in a fresh event loop (no asyncio plugin here)."""
    def run(tmp_path: Path) -> None:
        asyncio.run(test(tmp_path))
    run.__name__ = test.__name__
    return run


def table(**extra: Any) -> dict[str, Any]:
    return {"node-id": "dc1", "master-url": f"txlog://127.0.0.1:{free_port()}",
            "group": "test", "secret": "s3cret", **extra}


async def started(tmp_path: Path, **extra: Any) -> tuple[Broker, TxLogBridge]:
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(work: Any, on_done: Any) -> None:
        async def run() -> None:
            try:
                await work
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                on_done(exc)
            else:
                on_done(None)
        task = asyncio.get_running_loop().create_task(run())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    broker = Broker("n1", spawn=spawn)
    broker.add_vhost("/")
    config = from_node_table(table(**extra), "test", tmp_path, tmp_path)
    bridge = TxLogBridge(broker, config, commit_timeout=5.0,
                         driver_factory=lambda s, on_action: TxLogDriver(s, on_action=on_action,
                                                                         fsync=False))
    return broker, bridge


def message(body: bytes, message_id: str | None = None) -> Message:
    from pamqp import commands

    props = commands.Basic.Properties(message_id=message_id, delivery_mode=2)
    return Message("", "q", build_header(len(body), props), body)


async def wait_until(check: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def bodies(queue: Any) -> list[bytes]:
    return [e.message.body for e in queue.ready]


@in_loop
async def test_global_publishes_apply_when_ordered_and_acks_dequeue(tmp_path: Path) -> None:
    broker, bridge = await started(tmp_path)
    vhost = broker.vhost("/")
    glob = vhost.declare_queue("orders", owner=None, durable=True, arguments={"x-global": True})
    local = vhost.declare_queue("audit", owner=None, durable=True)
    assert not glob.ordered  # only while the master runs on this node
    await bridge.start()
    try:
        assert glob.ordered and not local.ordered
        tx = broker.new_transaction()
        tx.publish([glob, local], message(b"m1"))
        tx.publish([glob], message(b"m2", message_id="id-2"))
        await tx.commit()
        assert bodies(local) == [b"m1"]  # local queues at commit
        await wait_until(lambda: len(glob.ready) == 2)  # global ones once ordered
        assert bodies(glob) == [b"m1", b"m2"]
        ids = [read_message_id(e.message.header) for e in glob.ready]
        assert ids[0] is not None and ids[0].startswith("dc1.") and ids[1] == "id-2"

        entry = glob.get()
        assert entry is not None
        ack = broker.new_transaction()
        ack.accept([(glob, entry)], [])
        await ack.commit()  # waits for the order and the validation
        assert bodies(glob) == [b"m2"] and glob.unacked == 0
        status = bridge.status()
        assert status["running"] and status["bridge"]["applied_committed"] == 2
        assert status["global_queues"] == {queue_key("/", "orders"): 1}
    finally:
        await bridge.stop()
    assert not glob.ordered


@in_loop
async def test_a_transaction_on_local_queues_keeps_the_one_round_trip_commit(
        tmp_path: Path) -> None:
    """A [txlog] node awaits phase one only for transactions that touch a global queue."""
    broker, bridge = await started(tmp_path)
    vhost = broker.vhost("/")
    glob = vhost.declare_queue("orders", owner=None, durable=True, arguments={"x-global": True})
    local = vhost.declare_queue("audit", owner=None, durable=True)
    await bridge.start()
    try:
        tx = broker.new_transaction()
        assert any(type(o).__name__ == "GlobalTxObserver" for o in tx.observers)
        tx.publish([local], message(b"m1"))
        assert not tx.needs_prepare()  # tx.commit applies in the same loop callback
        await tx.commit()
        assert bodies(local) == [b"m1"]

        entry = local.get()
        assert entry is not None
        ack = broker.new_transaction()
        ack.accept([(local, entry)], [])
        assert not ack.needs_prepare()
        await ack.commit()
        assert bodies(local) == [] and local.unacked == 0

        both = broker.new_transaction()
        both.publish([glob, local], message(b"m2"))
        assert both.needs_prepare()  # the TxLog must order it first
        await both.commit()
        await wait_until(lambda: len(glob.ready) == 1)
    finally:
        await bridge.stop()


@in_loop
async def test_a_dequeue_another_datacenter_ordered_first_fails_and_drops_the_held_message(
        tmp_path: Path) -> None:
    broker, bridge = await started(tmp_path)
    await bridge.start()
    try:
        glob = broker.vhost("/").declare_queue("jobs", owner=None, arguments={"x-global": True})
        tx = broker.new_transaction()
        tx.publish([glob], message(b"job", message_id="job-1"))
        await tx.commit()
        await wait_until(lambda: len(glob.ready) == 1)
        entry = glob.get()  # delivered here ...
        assert entry is not None
        # ... while another DC's consumer acks it first (its dequeue is ordered first)
        assert bridge.driver is not None
        other = await bridge.driver.submit([Operation("dequeue", queue_key("/", "jobs"), "job-1")])
        assert other["outcome"] == "committed"
        assert glob.withdrawn(entry)
        mine = broker.new_transaction()
        mine.accept([(glob, entry)], [])
        with pytest.raises(TransactionAborted, match="failed validation"):
            await mine.commit()
        glob.requeue(entry)  # the channel closes with the 406: its requeue drops the message
        assert len(glob.ready) == 0 and glob.unacked == 0
        assert bridge.counters["validation_failed"] == 1
    finally:
        await bridge.stop()


@in_loop
async def test_commit_on_a_global_queue_is_refused_when_the_master_stopped(tmp_path: Path) -> None:
    broker, bridge = await started(tmp_path)
    await bridge.start()
    glob = broker.vhost("/").declare_queue("g", owner=None, arguments={"x-global": True})
    tx = broker.new_transaction()  # created while running: it has the observer
    tx.publish([glob], message(b"x"))
    await bridge.stop("test")
    with pytest.raises(TransactionAborted, match="not running"):
        await tx.commit()
    assert len(glob.ready) == 0


@in_loop
async def test_policy_makes_queues_global_and_the_order_survives_a_restart(tmp_path: Path) -> None:
    extra = {"global": [{"pattern": "^g\\."}]}
    broker, bridge = await started(tmp_path, **extra)
    await bridge.start()
    vhost = broker.vhost("/")
    g = vhost.declare_queue("g.one", owner=None, durable=True)
    other = vhost.declare_queue("h.one", owner=None, durable=True)
    assert g.ordered and not other.ordered
    tx = broker.new_transaction()
    tx.publish([g], message(b"a", message_id="a"))
    await tx.commit()
    await wait_until(lambda: len(g.ready) == 1)
    await bridge.stop()
    # a restart on the same journal: nothing is applied twice, the index is rebuilt
    bridge2 = TxLogBridge(broker, bridge.config,
                          driver_factory=lambda s, on_action: TxLogDriver(s, on_action=on_action,
                                                                          fsync=False))
    broker.observers.transactions.remove(bridge.tx_observers)
    await bridge2.start()
    try:
        await asyncio.sleep(0.2)
        assert bodies(g) == [b"a"]
        assert bridge2.queues.index[queue_key("/", "g.one")] == {"a": g.ready.peek()}
    finally:
        await bridge2.stop()


@in_loop
async def test_an_enqueue_for_a_queue_missing_here_declares_it(tmp_path: Path) -> None:
    broker, bridge = await started(tmp_path)
    await bridge.start()
    try:
        assert bridge.driver is not None
        data = pack_message(message(b"far"), message(b"far", message_id="f").header)
        await bridge.driver.submit([Operation("enqueue", queue_key("/", "remote"), "f", data)],
                                   wait="synchronised")
        queue = broker.vhost("/").queues["remote"]
        assert queue.ordered and queue.durable and bodies(queue) == [b"far"]
        assert unpack_message(data).body == b"far"
    finally:
        await bridge.stop()


def test_x_global_must_be_a_boolean_and_excludes_local_drops() -> None:
    broker = Broker("n1")
    vhost = broker.add_vhost("/")
    with pytest.raises(PreconditionFailed, match="x-global"):
        vhost.declare_queue("q", owner=None, arguments={"x-global": "yes"})
    with pytest.raises(PreconditionFailed, match="incompatible_with,x-message-ttl"):
        vhost.declare_queue("q", owner=None, arguments={"x-global": True, "x-message-ttl": 5})
    vhost.declare_queue("q", owner=None, arguments={"x-global": False, "x-message-ttl": 5})


def test_the_txlog_section_uses_the_master_keys(tmp_path: Path) -> None:
    cfg = from_node_table(table(**{"MaxPeerLag": 9000, "peer": {"1": {"id": "dc2", "url":
                                   "txlog://127.0.0.1:1"}}, "global": [{"pattern": "^o"}]}),
                          "f.toml", tmp_path, tmp_path / "data")
    assert cfg.settings.txlog.max_peer_lag_ms == 9000
    assert cfg.settings.data_dir == tmp_path / "data" / "txlog"
    assert [p.node_id for p in cfg.settings.txlog.peers] == ["dc2"]
    assert cfg.policies[0].matches("/", "orders") and not cfg.policies[0].matches("/", "x")
    for bad, text in (({"admin": "127.0.0.1:1"}, "admin"), ({"bogus": 1}, "unknown"),
                      ({"split-recovery": "maybe"}, "split"),
                      ({"global": [{"pattern": "("}]}, "bad pattern"),
                      ({"global": [{"vhost": "/"}]}, "pattern")):
        with pytest.raises(ConfigError, match=text):
            from_node_table(table(**bad), "f.toml", tmp_path, tmp_path)


@in_loop
async def test_a_global_queue_that_would_drop_messages_locally_is_refused(tmp_path: Path) -> None:
    broker, bridge = await started(tmp_path, **{"global": [{"pattern": "^g\\."}]})
    await bridge.start()
    try:
        vhost = broker.vhost("/")
        with pytest.raises(PreconditionFailed, match="x-message-ttl.*policy"):
            vhost.declare_queue("g.ttl", owner=None, arguments={"x-message-ttl": 5})
        with pytest.raises(PreconditionFailed, match="cannot be exclusive"):
            vhost.declare_queue("x", owner=object(), exclusive=True, arguments={"x-global": True})
        with pytest.raises(PreconditionFailed, match="cannot be auto-delete"):
            vhost.declare_queue("g.auto", owner=None, auto_delete=True)
        vhost.declare_queue("h.ttl", owner=None, arguments={"x-message-ttl": 5})  # not global
    finally:
        await bridge.stop()


@in_loop
async def test_a_joining_backups_catch_up_carries_a_splits_broker_backup(tmp_path: Path) -> None:
    from brokerha.cluster import replication as R
    from brokerha.txlog.bridge.broker_state import BrokerBackup, write_backup_file

    broker, bridge = await started(tmp_path)
    events = bridge.catch_up_events()  # no split: no backup to pass on
    assert R.TXLOG_BROKER_BACKUP not in [e[0] for e in events]
    data = BrokerBackup(3, {"%2F/orders": [("dc1.x", b"m")]}).encode()
    write_backup_file(bridge.recovery.path.parent, data)
    events = bridge.catch_up_events()
    assert [e[1] for e in events if e[0] == R.TXLOG_BROKER_BACKUP] == [data]
    assert events[-1][0] == R.TXLOG_APPLIED
