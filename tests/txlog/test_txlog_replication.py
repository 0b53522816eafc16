"""The TxLog master's journal replicated to its HA datacenter's backups (txlog/bridge/replica.py).

In process: an HA ``Primary`` and its ``Backup``s joined by the test harness's
pump (every packet through msgpack, tests/ha/harness.py), a real
``TxLogDriver`` on the primary whose ``replication`` is the primary's log, and
each backup writing the records into its own journal directory. dc2, when
there is one, is a plain driver on a loopback link.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from brokerha.backup.backup import Backup
from brokerha.testing import free_port
from brokerha.txlog.bridge.replica import PrimaryJournal, TxLogReplica, snapshot_events
from brokerha.txlog.engine.messages import Bodies, FetchBodies, Persist
from brokerha.txlog.engine.records import Operation
from brokerha.txlog.engine.state import DurableState
from brokerha.txlog.master.driver import TxLogDriver
from brokerha.txlog.master.journal import JOURNAL, Journal
from brokerha.txlog.master.settings import MasterSettings, flatten, from_properties
from brokerha.txlog.master.wire import decode
from tests.ha.harness import Cluster
from tests.txlog.test_broker_bridge import in_loop

pytestmark = pytest.mark.timeout(30)


def settings(me: str, data: Path, peers: dict[str, int], listen: int = 0) -> MasterSettings:
    doc = {"node-id": me, "listen": f"127.0.0.1:{listen}", "group": "g", "secret": "s",
           "data-dir": str(data), "idle-interval": 200, "max-peer-lag": 5000,
           "peer": {str(i): {"id": p, "url": f"txlog://127.0.0.1:{port}"}
                    for i, (p, port) in enumerate(sorted(peers.items()), 1)}}
    return from_properties(flatten(doc))


def summary(state: DurableState) -> tuple[Any, ...]:
    """What a promoted backup's master must find: the durable state, field by field."""
    return (state.sync.ids(), [e.outcome for e in state.sync.entries], sorted(state.own),
            sorted(state.bodies), state.counter_reserved, state.id_last, state.generation,
            sorted(state.members), state.split_at, state.model.queues, state.model.applied)


def load(path: Path, master: MasterSettings) -> DurableState:
    journal = Journal(path, fsync=False)
    try:
        return journal.load(master.txlog)
    finally:
        journal.close()


class DC1:
    """An HA datacenter of ``members`` nodes: n1 primary (the master), the others backups."""

    def __init__(self, tmp: Path, members: int, peers: dict[str, int], listen: int = 0) -> None:
        self.tmp = tmp
        self.cluster = Cluster(members, timeout=5.0)
        self.settings = settings("dc1", tmp / "n1", peers, listen)
        self.replicas: dict[str, TxLogReplica] = {}
        self.applied: dict[str, list[int]] = {}
        self.driver = TxLogDriver(self.settings, fsync=False,
                                  replication=PrimaryJournal(self.cluster.primary))
        # what the bridge registers (TxLogBridge.catch_up_events): a joining backup gets
        # the state, since the records before its join are not sent to it
        self.cluster.primary.catch_up_providers.append(
            lambda: snapshot_events(self.driver.journal.seq, self.driver.engine.durable))
        self.sent: list[tuple[str, Any]] = []
        real_send = self.driver.links.send

        def send(peer: str, packet: Any, msg_id: int | None = None) -> int | None:
            self.sent.append((peer, packet))
            return real_send(peer, packet, msg_id)

        self.driver.links.send = send  # type: ignore[method-assign]

    def follow(self, name: str) -> TxLogReplica:
        applied = self.applied.setdefault(name, [])
        replica = TxLogReplica(self.tmp / name, self.settings.txlog, on_applied=applied.append,
                               fsync=False)
        self.replicas[name] = replica
        node = self.cluster.nodes[name]
        node.backup = Backup(node.broker, me=name, epoch=self.cluster.epoch,
                             position=(-1, -1), txlog=replica)
        self.cluster.join(name)
        return replica

    async def pumping(self, work: Awaitable[Any], stop: Callable[[], bool] | None = None) -> Any:
        task = asyncio.ensure_future(work)
        while not task.done() or (stop is not None and not stop()):
            self.cluster.pump()
            await asyncio.sleep(0.002)
        self.cluster.pump()
        return await task


def enqueue(gid: str) -> list[Operation]:
    return [Operation("enqueue", "%2F/orders", gid, gid.encode())]


@in_loop
async def test_a_backups_journal_equals_the_primarys_and_loads_as_a_restarted_master(
        tmp_path: Path) -> None:
    port1, port2 = free_port(), free_port()
    dc1 = DC1(tmp_path, 3, {"dc2": port2}, port1)
    for name in ("n2", "n3"):
        dc1.follow(name)
    dc1.cluster.pump()
    dc2 = TxLogDriver(settings("dc2", tmp_path / "dc2", {"dc1": port1}, port2), fsync=False)
    dc1.driver.replicate_state()
    await dc1.driver.start()
    await dc2.start()
    try:
        work = asyncio.gather(
            *(dc1.driver.submit(enqueue(f"a{i}"), "synchronised", 10) for i in range(5)),
            *(dc2.submit(enqueue(f"b{i}"), "synchronised", 10) for i in range(5)),
            dc1.driver.submit([Operation("dequeue", "%2F/orders", "b0")], "synchronised", 10))
        await dc1.pumping(work)
        assert len(dc1.driver.engine.sync) == len(dc2.engine.sync) == 11
        assert dc1.driver.engine.sync.ids() == dc2.engine.sync.ids()
        assert dc1.driver.counters["held_batches"] > 0
        master = dc1.driver.engine.durable
        for name, replica in dc1.replicas.items():
            # the replica's in-memory state, and its directory loaded as a restarted master would
            assert replica.state is not None and summary(replica.state) == summary(master)
            assert replica.seq == dc1.driver.journal.seq
            replica.close()
            assert summary(load(tmp_path / name, dc1.settings)) == summary(master), name
            assert (tmp_path / name / JOURNAL).stat().st_size > 0
    finally:
        await dc1.driver.close()
        await dc2.close()
    # and the primary's own journal says the same
    assert summary(load(tmp_path / "n1", dc1.settings)) == summary(master)


@in_loop
async def test_no_send_leaves_before_the_record_is_on_the_quorum(tmp_path: Path) -> None:
    """Every guarded backup plus a majority (cluster/quorum.py), the confirm rule."""
    dc1 = DC1(tmp_path, 3, {"dc2": free_port()})
    for name in ("n2", "n3"):
        dc1.follow(name)
    dc1.driver.replicate_state()
    dc1.cluster.pump()
    await dc1.driver.start()
    try:
        assert dc1.replicas["n3"].seq == 0  # the master's state at its start (empty here)
        dc1.cluster.no_ack.add("n3")  # guarded (caught up) but acknowledges nothing now
        submit = asyncio.ensure_future(dc1.driver.submit(enqueue("x1"), "confirm", 10))
        for _ in range(30):
            dc1.cluster.pump()
            await asyncio.sleep(0.005)
        # the record and its post are there, held: n2 acknowledged, n3 did not
        assert dc1.driver.journal.seq > 0 and dc1.driver.engine.durable.own
        assert dc1.sent == [] and not submit.done()
        assert dc1.replicas["n2"].seq == dc1.replicas["n3"].seq == dc1.driver.journal.seq
        sessions = dc1.cluster.primary.sessions
        assert sessions["n2"].acked == dc1.cluster.primary.seq > (sessions["n3"].acked or 0)
        # n3 times out of the guarded set: the primary and n2 are a majority of three
        dc1.cluster.clock.now += 6.0
        dc1.cluster.primary.tick(dc1.cluster.clock.now)
        result = await asyncio.wait_for(submit, 5)
        assert result["outcome"] == "committed"
        assert [peer for peer, _ in dc1.sent][:1] == ["dc2"]  # the post went after the quorum
    finally:
        await dc1.driver.close()


@in_loop
async def test_without_a_backup_a_three_node_dc_sends_nothing(tmp_path: Path) -> None:
    dc1 = DC1(tmp_path, 3, {"dc2": free_port()})
    dc1.driver.replicate_state()
    await dc1.driver.start()
    try:
        submit = asyncio.ensure_future(dc1.driver.submit(enqueue("x1"), "confirm", 10))
        await asyncio.sleep(0.2)
        assert dc1.sent == [] and not submit.done()
        dc1.follow("n2")  # a backup joins: catch-up (snapshot) then acks: majority of three
        result = await dc1.pumping(submit)
        assert result["outcome"] == "committed" and dc1.sent
        assert summary(dc1.replicas["n2"].state) == summary(dc1.driver.engine.durable)  # type: ignore[arg-type]
    finally:
        await dc1.driver.close()


@in_loop
async def test_a_late_joiner_gets_a_snapshot_that_replaces_its_stale_state(tmp_path: Path) -> None:
    dc1 = DC1(tmp_path, 3, {"dc2": free_port()})
    dc1.follow("n2")
    dc1.cluster.pump()
    # n3's directory holds an older, different TxLog state (another term's master)
    stale = Journal(tmp_path / "n3", fsync=False)
    stale_state = stale.load(dc1.settings.txlog)
    stale_state.generation = 7
    stale.seq = 99
    stale.snapshot(stale_state)
    stale.close()
    dc1.driver.replicate_state()
    await dc1.driver.start()
    try:
        await dc1.pumping(asyncio.gather(
            *(dc1.driver.submit(enqueue(f"a{i}"), "confirm", 10) for i in range(4))))
        replica = dc1.follow("n3")
        dc1.cluster.pump()
        assert replica.counters["snapshots"] == 1 and replica.counters["records"] == 0
        assert replica.seq == dc1.driver.journal.seq
        await dc1.pumping(dc1.driver.submit(enqueue("a9"), "confirm", 10))
        assert replica.counters["records"] > 0
        master = dc1.driver.engine.durable
        assert summary(replica.state) == summary(master)  # type: ignore[arg-type]
        replica.close()
        assert summary(load(tmp_path / "n3", dc1.settings)) == summary(master)
        assert master.generation == 0  # the stale state (generation 7) is gone
    finally:
        await dc1.driver.close()


@in_loop
async def test_a_backup_acknowledges_only_after_the_fsync(tmp_path: Path) -> None:
    replica = TxLogReplica(tmp_path, settings("dc1", tmp_path, {}).txlog,
                           on_applied=lambda _: None, fsync=True)
    state_seq, _ = replica.open()
    master_dir = tmp_path / "master"
    master = Journal(master_dir, fsync=False)
    state = master.load(settings("dc1", master_dir, {}).txlog)
    body = master.write([Persist("counter", 5)], state)
    assert body is not None
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    os.fsync = counting_fsync  # type: ignore[assignment]
    try:
        replica.apply(["lr", state_seq + 1, body])
        acked: list[int] = []
        replica.after_durable(lambda: acked.append(1))
        assert acked == []  # not before the fsync ran (in a thread)
        for _ in range(100):
            if acked:
                break
            await asyncio.sleep(0.01)
        assert acked == [1] and synced
        replica.after_durable(lambda: acked.append(2))  # nothing new written: at once
        assert acked == [1, 2]
    finally:
        os.fsync = real_fsync  # type: ignore[assignment]
        replica.close()
        master.close()


def test_a_splits_broker_backup_reaches_the_backups_and_a_joiners_catch_up(
        tmp_path: Path) -> None:
    """The global queues backed up at a split (``lb``) are kept by every DC node.

    So a primary elected during the split finds the backup when the rejoin asks
    for a restore (before, only the primary that took it had the file).
    """
    from brokerha.cluster import replication as R
    from brokerha.txlog.bridge.broker_state import BACKUP_FILE, BrokerBackup, write_backup_file

    backup = BrokerBackup(7, {"%2F/global.q": [("dc1.a", b"m-a"), ("dc2.b", b"m-b")]})
    data = backup.encode()
    replica = TxLogReplica(tmp_path / "n2", settings("dc1", tmp_path, {}).txlog,
                           on_applied=lambda _: None, fsync=False)
    replica.apply([R.TXLOG_BROKER_BACKUP, data])
    held = BrokerBackup.decode((tmp_path / "n2" / BACKUP_FILE).read_bytes())
    assert (held.position, held.queues) == (7, backup.queues)
    assert replica.counters["broker_backups"] == 1
    # a newer split's backup replaces it
    newer = BrokerBackup(9, {}).encode()
    replica.apply([R.TXLOG_BROKER_BACKUP, newer])
    assert BrokerBackup.decode((tmp_path / "n2" / BACKUP_FILE).read_bytes()).position == 9
    write_backup_file(tmp_path / "n1", data)
    assert (tmp_path / "n1" / BACKUP_FILE).read_bytes() == data


def test_a_backup_without_a_txlog_section_refuses_the_primarys_txlog() -> None:
    """Its acknowledgements would count for the quorum of records it never kept: fail-stop."""
    from brokerha.cluster import replication as R
    from brokerha.cluster.replication import ConfigurationMismatch

    c = Cluster(2)
    c.follow("n2")  # a Backup built without ``txlog``: a member with no [txlog] section
    c.pump()
    c.primary.emit([R.TXLOG_RECORD, 1, b"record"])
    with pytest.raises(ConfigurationMismatch, match=r"no \[txlog\] section"):
        c.pump()


@in_loop
async def test_a_masters_sends_wait_for_its_journal_fsync_off_the_loop(tmp_path: Path) -> None:
    """The journal record is fsynced in a worker thread; the call's sends leave after it.

    So a broker node's clients never wait for the TxLog's disk, and no peer
    hears of a state a crash could still lose.
    """
    import threading

    import brokerha.files as files_module
    import brokerha.txlog.master.driver as driver_module
    from brokerha.txlog.engine.messages import Send

    gate, done = threading.Event(), threading.Event()

    def slow_fsync(fd: int) -> None:
        gate.wait(10)
        os.close(fd)
        done.set()

    real = files_module.fsync_and_close, driver_module.encode
    files_module.fsync_and_close = slow_fsync  # type: ignore[assignment]
    driver_module.encode = lambda message: message  # type: ignore[assignment]
    master = settings("dc1", tmp_path / "dc1", {"dc2": free_port()})
    driver = TxLogDriver(master, fsync=True)
    await driver.start()
    sent: list[Any] = []
    driver.links.send = lambda peer, packet: sent.append((peer, packet)) or 1  # type: ignore
    try:
        driver._run([Persist("counter", 7), Send("dc2", "ping")])  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the loop runs on while the fsync is blocked
        assert sent == [] and driver.counters["held_batches"] >= 1
        gate.set()
        for _ in range(200):
            if sent:
                break
            await asyncio.sleep(0.01)
        assert done.is_set() and driver.counters["fsyncs"] >= 1
        assert sent[0] == ("dc2", "ping")  # (the engine's own posts may follow it)
    finally:
        gate.set()
        await driver.close()
        files_module.fsync_and_close, driver_module.encode = real  # type: ignore[assignment]


class HeldQuorum:
    """A DC whose backups acknowledge nothing until ``release``: the driver's replication."""

    def __init__(self) -> None:
        self.snapshots: list[int] = []
        self.records: list[int] = []
        self.waiting: list[Callable[[], None]] = []

    def record(self, seq: int, body: bytes) -> None:
        self.records.append(seq)

    def snapshot(self, seq: int, state: DurableState) -> None:
        self.snapshots.append(seq)

    def barrier(self, callback: Callable[[], None]) -> None:
        self.waiting.append(callback)

    def release(self) -> None:
        waiting, self.waiting = self.waiting, []
        for callback in waiting:
            callback()


@in_loop
async def test_a_starting_master_sends_nothing_before_its_state_is_on_the_quorum(
        tmp_path: Path) -> None:
    """A master may start from records no backup has: its own of an earlier term, written
    before it lost its majority. Its first post would tell another datacenter of them, and
    the next primary would not know them (the HA TxLog simulation's seed 1261)."""
    data = tmp_path / "n1"
    earlier = TxLogDriver(settings("dc1", data, {"dc2": free_port()}), fsync=False)
    record, _ = earlier.engine.local_tx(enqueue("a1"), earlier.clock())
    earlier._run([Persist("own.add", (record, earlier.engine.durable.bodies[record.tx_id]))])
    earlier.journal.close()
    quorum = HeldQuorum()
    driver = TxLogDriver(settings("dc1", data, {"dc2": free_port()}), fsync=False,
                         replication=quorum)
    assert record.tx_id in driver.engine.durable.own  # loaded from this node's journal
    sent: list[Any] = []
    driver.links.send = lambda peer, packet, msg_id=None: sent.append(decode(packet)) or 1  # type: ignore
    loaded = driver.journal.seq
    driver.replicate_state()
    await driver.start()
    try:
        # dc2 asks for the body of the transaction (it heard of it before): the answer
        # writes no record, so only the state's quorum can hold it back
        driver._run(driver.engine.received(FetchBodies("dc2", (record.tx_id,)), driver.clock()))
        driver._tick()
        await asyncio.sleep(0.05)
        assert quorum.snapshots == [loaded] and sent == []  # all wait for the state's quorum
        quorum.release()
        for _ in range(50):
            if any(isinstance(p, Bodies) for p in sent):
                break
            quorum.release()
            await asyncio.sleep(0.01)
        assert any(isinstance(p, Bodies) for p in sent), sent
    finally:
        await driver.close()
