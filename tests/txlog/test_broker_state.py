"""Split recovery of a broker node's global queues (brokerha/txlog/bridge/broker_state.py), in process.

The queues are a real broker's; the "ordered transactions" are applied by
hand the way the bridge applies them (undo record first, then the queue
change), so the tests can choose positions that the engine's stable state
trails — the case a real backup at a split meets.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header, read_message_id
from brokerha.broker.message import Entry, Message
from brokerha.broker.queue import Queue
from brokerha.txlog.bridge.broker_state import BrokerBackup, SplitBackups
from brokerha.txlog.bridge.global_queues import pack_message, unpack_message
from brokerha.txlog.engine.records import Operation, TxBody

KEY = "%2F/orders"


def message(gid: str) -> Message:
    from pamqp import commands

    props = commands.Basic.Properties(message_id=gid, delivery_mode=2)
    return Message("", "orders", build_header(len(gid), props), gid.encode())


class Applier:
    """Applies ordered enqueues and dequeues to one global queue as the bridge does."""

    def __init__(self, tmp_path: Path) -> None:
        self.broker = Broker("n1")
        self.queue = self.broker.add_vhost("/").declare_queue("orders", owner=None, durable=True)
        self.index: dict[str, dict[str, Entry]] = {KEY: {}}
        self.backups = SplitBackups(tmp_path, pack_message, unpack_message)
        self.position = 0

    def enqueue(self, gid: str) -> None:
        self.backups.begin(self.position, stable=0)
        entry = self.queue.add_entry(Entry(self.queue.next_position, message(gid), None))
        self.index[KEY][gid] = entry
        self.backups.enqueued(KEY, gid)
        self.position += 1

    def dequeue(self, gid: str) -> None:
        self.backups.begin(self.position, stable=0)
        entry = self.index[KEY].pop(gid)
        self.backups.dequeued(KEY, gid, entry)
        self.queue.withdraw(entry.position)
        self.position += 1

    def take(self, position: int, **kw: Any) -> tuple[BrokerBackup, int]:
        return self.backups.take(position, self.position, self.index, {KEY: self.queue},
                                 kw.get("log_since", lambda p: iter(())),
                                 kw.get("find_enqueue", lambda k, g: None))

    def restore(self, backup: BrokerBackup) -> Any:
        return self.backups.restore(backup, self.index, lambda key, create: self.queue)


def ready_ids(queue: Queue) -> list[str | None]:
    return [read_message_id(e.message.header) for e in queue.ready]


def test_a_backup_at_an_earlier_position_undoes_what_was_applied_since(tmp_path: Path) -> None:
    a = Applier(tmp_path)
    for gid in ("a", "b", "c"):
        a.enqueue(gid)  # positions 0, 1, 2
    held = a.queue.get()  # a consumer holds "a" ...
    assert held is not None
    a.dequeue("a")  # ... and its ack is ordered (position 3): withdrawn, held still
    a.enqueue("d")  # position 4
    assert ready_ids(a.queue) == ["b", "c", "d"]

    backup, missing = a.take(2)  # after positions 0 and 1: "a" and "b"
    assert missing == 0 and backup.position == 2
    assert [g for g, _ in backup.queues[KEY]] == ["a", "b"]
    on_disk = a.backups.read()
    assert on_disk is not None and on_disk.queues == backup.queues  # durable, same content
    assert unpack_message(on_disk.queues[KEY][0][1]).body == b"a"

    result = a.restore(on_disk)
    assert ready_ids(a.queue) == ["a", "b"]  # "a" is back (a new ready copy), c and d gone
    assert set(a.index[KEY]) == {"a", "b"}
    assert (result.removed, result.rebuilt) == (2, 2)
    assert a.queue.withdrawn(held)  # the old holder's ack is void, a requeue drops it
    a.queue.requeue(held)
    assert ready_ids(a.queue) == ["a", "b"] and a.queue.unacked == 0


def test_a_message_a_consumer_holds_stays_with_it_when_the_backup_has_it(tmp_path: Path) -> None:
    a = Applier(tmp_path)
    for gid in ("a", "b"):
        a.enqueue(gid)
    backup, _ = a.take(2)
    a.enqueue("c")
    held = a.queue.get()  # "a", held across the restore
    assert held is not None
    result = a.restore(backup)
    assert result.kept_held == 1 and result.removed == 1
    assert ready_ids(a.queue) == ["b"] and a.index[KEY]["a"] is held
    assert not a.queue.withdrawn(held)  # its ack will be an ordered dequeue as usual


def test_after_a_restart_the_gap_is_read_from_the_txlog_log(tmp_path: Path) -> None:
    """No undo record since the start: the retained log's bodies stand in for them."""
    a = Applier(tmp_path)
    a.enqueue("a")
    a.enqueue("b")
    a.backups = SplitBackups(tmp_path, pack_message, unpack_message)  # "restarted"
    # positions 2 (dequeue a) and 3 (enqueue c) were applied before the restart
    a.queue.withdraw(a.index[KEY].pop("a").position)
    a.index[KEY]["c"] = a.queue.add_entry(Entry(a.queue.next_position, message("c"), None))
    a.position = 4
    data_a = pack_message(message("a"), message("a").header)
    log = {2: TxBody("t2", (Operation("dequeue", KEY, "a"),)),
           3: TxBody("t3", (Operation("enqueue", KEY, "c", b"x"),))}

    def log_since(p: int) -> Iterator[tuple[int, TxBody]]:
        return iter([(q, b) for q, b in sorted(log.items()) if q >= p])

    backup, missing = a.take(2, log_since=log_since,
                             find_enqueue=lambda k, g: (0, data_a) if g == "a" else None)
    assert missing == 0 and [g for g, _ in backup.queues[KEY]] == ["a", "b"]
    # a dequeued message whose enqueue is past retention cannot be rebuilt: counted
    _, missing = a.take(2, log_since=log_since)
    assert missing == 1


def test_undo_records_stay_under_their_bound_and_a_backup_reads_the_rest_from_the_log(
        tmp_path: Path) -> None:
    """A long split: the stable position stands still, so the records would pile up for ever.

    Over the bound the oldest are dropped (down to half of it); a backup that
    reaches back past them reads those positions from the TxLog's retained
    log, as after a restart, and comes out the same.
    """
    size = message("m0").size
    a = Applier(tmp_path)
    a.backups = SplitBackups(tmp_path, pack_message, unpack_message, undo_max_bytes=10 * size)
    log: dict[int, TxBody] = {}
    contents: dict[str, bytes] = {}
    for i in range(40):  # enqueue m0..m39 at positions 0..39
        gid = f"m{i}"
        log[a.position] = TxBody(f"t{a.position}", (Operation("enqueue", KEY, gid, b"x"),))
        contents[gid] = pack_message(message(gid), message(gid).header)
        a.enqueue(gid)
    for i in range(30):  # dequeue m0..m29 at positions 40..69
        log[a.position] = TxBody(f"t{a.position}", (Operation("dequeue", KEY, f"m{i}"),))
        a.dequeue(f"m{i}")
    a.backups.begin(a.position, stable=0)  # the next transaction's record checks the bound
    assert a.backups.undo_bytes <= 10 * size
    assert a.backups.undo_shed > 0 and a.backups.covered_from is not None
    assert a.backups.covered_from > 40, "the oldest dequeues' records were dropped"
    status = a.backups.status()
    assert status["shed"] == a.backups.undo_shed and status["bytes"] == a.backups.undo_bytes

    def log_since(p: int) -> Iterator[tuple[int, TxBody]]:
        return iter([(q, b) for q, b in sorted(log.items()) if q >= p])

    def find_enqueue(key: str, gid: str) -> tuple[int, bytes] | None:
        return int(gid[1:]), contents[gid]

    backup, missing = a.take(35, log_since=log_since, find_enqueue=find_enqueue)
    assert missing == 0
    assert [g for g, _ in backup.queues[KEY]] == [f"m{i}" for i in range(35)]
    backup, missing = a.take(45, log_since=log_since, find_enqueue=find_enqueue)
    assert missing == 0  # m0..m4 were dequeued before 45; m5..m39 remain
    assert [g for g, _ in backup.queues[KEY]] == [f"m{i}" for i in range(5, 40)]


def test_ctl_txlog_status_says_when_undo_records_were_dropped(capsys: Any) -> None:
    from brokerha.admin.ctl import _print_split_recovery

    undo = {"records": 12, "bytes": 3 << 20, "max_bytes": 64 << 20, "covered_from": 90,
            "shed": 0}
    _print_split_recovery({"recovery": {"undo": undo}})
    assert capsys.readouterr().out == ""
    _print_split_recovery({"recovery": {"undo": {**undo, "shed": 7}}})
    assert capsys.readouterr().out == (
        "split recovery: undo records 12 (3 of 64 MiB), 7 dropped over the bound (read from "
        "the TxLog's log if a backup needs them)\n")
