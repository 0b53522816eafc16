"""Replicas checked (ha/check.py): the digest and report core, then a real Primary and
Backups in one process, one of them altered behind its back."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from brokerha.backup.backup import Backup
from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry, Message
from brokerha.broker.paging import PAGED, paged_copy
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R
from brokerha.cluster.messages import Message as Packet
from brokerha.cluster.replication import CheckReport
from brokerha.ha.check import (
    CHANGING,
    QueueReport,
    ReplicaCheck,
    ReplicaChecks,
    ReportBuilder,
    compare,
    entry_digest,
    subtract,
)
from brokerha.ha.simulation.world import message, wire
from tests.ha.harness import Cluster, consume, publish

# -- the core, without a network ------------------------------------------------------------


def _queue(broker: Broker, name: str = "q", **arguments: Any) -> Queue:
    return broker.vhosts["/"].declare_queue(name, owner=None, durable=True, arguments=arguments)


def _broker() -> Broker:
    broker = Broker("b")
    broker.add_vhost("/")
    return broker


def _no_store(vhost: str, queue: str, positions: list[int]) -> dict[int, tuple[bytes, bytes]]:
    raise AssertionError("no body is paged out")


def test_subtract_is_set_difference_of_runs() -> None:
    rng = random.Random(7)
    for _ in range(300):
        a = sorted(rng.sample(range(60), rng.randint(0, 40)))
        b = sorted(rng.sample(range(60), rng.randint(0, 40)))
        runs_a, runs_b = _runs(a), _runs(b)
        assert _flat(subtract(runs_a, runs_b)) == sorted(set(a) - set(b))


def _runs(positions: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][1] + 1 == p:
            out[-1][1] = p
        else:
            out.append([p, p])
    return out


def _flat(runs: list[list[int]]) -> list[int]:
    return [p for a, b in runs for p in range(a, b + 1)]


def test_a_report_counts_runs_and_digests_in_position_order() -> None:
    broker = _broker()
    q = _queue(broker)
    for i in range(10):
        q.enqueue(message(b"m%d" % i))
    first = min(e.position for e in q.ready)
    q.settle(q.get())  # the first gone
    report, = ReportBuilder([(q, [])], _no_store).run()
    assert (report.count, report.runs, report.unread) == (9, [[first + 1, first + 9]], 0)
    crc = 0
    for e in sorted(q.ready, key=lambda e: e.position):
        crc = entry_digest(crc, e.position, e.message.route, e.message.header, e.message.body)
    assert report.digest == crc


def test_a_priority_queue_reports_in_position_order() -> None:
    """Its ready list runs per priority level: the walk merges them (a backup's and the
    primary's copies hold the same entries in the same levels, but order the digest must
    not depend on)."""
    broker = _broker()
    q = _queue(broker, "pq", **{"x-max-priority": 5})
    other = _queue(broker, "plain")
    for i in range(20):
        body = b"m%d" % i
        q.enqueue(message(body, "k", priority=i % 5))
        other.enqueue(message(body, "k", priority=i % 5))
    pq, plain = ReportBuilder([(q, []), (other, [])], _no_store).run()
    assert pq.runs == plain.runs and len(pq.runs) == 1 and pq.count == 20
    assert pq.digest == plain.digest


def test_slices_are_bounded_and_add_up_to_the_whole() -> None:
    broker = _broker()
    q = _queue(broker)
    small = _queue(broker, "small")
    for i in range(1000):
        q.enqueue(message(b"x" * 100 + b"%d" % i))
    small.enqueue(message(b"one", "small"))
    whole = ReportBuilder([(q, []), (small, [])], _no_store).run()
    builder = ReportBuilder([(q, []), (small, [])], _no_store)
    steps = 0
    while not builder.step(max_entries=64, max_bytes=1 << 20, max_seconds=math.inf):
        steps += 1
        assert builder.entries <= 64 * steps
    assert builder.reports == whole and builder.slices == 16


def test_entries_listed_at_the_check_are_reported_as_they_were() -> None:
    """The walk is of the copy taken at the ``ck``: what the queue does afterwards (a
    consumer, new messages) changes nothing of the report."""
    broker = _broker()
    q = _queue(broker)
    for i in range(100):
        q.enqueue(message(b"m%d" % i))
    before = ReportBuilder([(q, [])], _no_store).run()
    builder = ReportBuilder([(q, [])], _no_store)
    consume(q, 50)
    q.enqueue(message(b"late"))
    assert builder.run() == before


def test_a_paged_out_body_is_read_back_and_digests_alike() -> None:
    broker = _broker()
    q = _queue(broker)
    for i in range(5):
        q.enqueue(message(b"body%d" % i, persistent=True))
    resident, = ReportBuilder([(q, [])], _no_store).run()
    store: dict[int, tuple[bytes, bytes]] = {}
    for e in list(q.ready)[1:4]:
        store[e.position] = (e.message.header, e.message.body)
        e.message, e.paged = paged_copy(e.message), PAGED
    reads: list[list[int]] = []

    def read(vhost: str, queue: str, positions: list[int]) -> dict[int, tuple[bytes, bytes]]:
        reads.append(positions)
        return {p: store[p] for p in positions if p in store}

    paged, = ReportBuilder([(q, [])], read).run()
    assert paged == resident and reads == [sorted(store)]
    del store[min(store)]  # consumed after the check listed it: its body is gone from the store
    gone, = ReportBuilder([(q, [])], read).run()
    assert (gone.digest, gone.unread, gone.runs, gone.count) == (None, 1, resident.runs, 5)
    differences, notes = compare(resident, "all", gone)
    assert differences == [] and notes and "not compared" in notes[0]


def _report(runs: list[list[int]], digest: int | None = 1, ha_id: str = "1.0.q") -> QueueReport:
    return QueueReport("/", "q", ha_id, sum(b - a + 1 for a, b in runs), runs, digest)


def test_compare_names_what_differs() -> None:
    ref = _report([[0, 9]], digest=11)
    assert compare(ref, "all", _report([[0, 9]], digest=11)) == ([], [])
    assert compare(ref, "all", _report([[0, 9]], digest=12)) == (
        [{"what": "digest differs", "digest": 12}], [])
    differences, _ = compare(ref, "all", _report([[0, 3], [6, 12]], digest=11))
    assert [d["what"] for d in differences] == ["missing positions", "extra positions"]
    assert differences[0]["runs"] == [[4, 5]] and differences[0]["count"] == 2
    assert differences[1]["runs"] == [[10, 12]] and differences[1]["count"] == 3
    assert compare(ref, "all", None) == ([{"what": "missing queue"}], [])
    assert compare(None, None, ref)[0][0]["what"] == "extra queue"
    assert compare(ref, "all", _report([[0, 9]], ha_id="2.5.q"))[0][0]["what"] == \
        "another incarnation"
    # messages not replicated: only the queue's existence is compared
    assert compare(ref, "configuration", _report([])) == ([], [])
    # an ha-replicate change under way: the copy is being replaced, not compared
    differences, notes = compare(ref, CHANGING, _report([]))
    assert differences == [] and "not applied" in notes[0]


def test_a_report_crosses_the_wire() -> None:
    report = _report([[0, 3], [5, 5]], digest=2**32 - 1)
    msg = wire(CheckReport(3, "n2", "tok", True, [report.as_wire()]))
    assert isinstance(msg, CheckReport)
    assert [QueueReport.from_wire(w) for w in msg.queues] == [report]
    event = wire(R.Events(3, 10, [R.CheckToken(R.CHECK, "tok")]))
    assert isinstance(event, R.Events) and event.events == [R.CheckToken(R.CHECK, "tok")]


# -- a real Primary and Backups in one process ------------------------------------------------


class Checked:
    """``Cluster`` whose backups take ``ck`` events (as ``HAMember`` makes them) and send
    their reports, through msgpack, to the primary's checks."""

    def __init__(self, members: int = 3) -> None:
        self.c = Cluster(members)
        self.scheduled: list[Callable[[], None]] = []
        c = self.c
        self.checks = ReplicaChecks(c.broker, "n1", None, self.scheduled.append, self._lost,
                                    c.clock)
        for name in list(c.nodes)[1:]:
            self.follow(name)
        c.pump()

    def _lost(self, peer: str, msg: Packet) -> None:
        raise AssertionError("the primary sends no report")

    def follow(self, name: str) -> Backup:
        node = self.c.nodes[name]

        def send(peer: str, msg: Packet) -> None:
            assert peer == "n1"
            report = wire(msg)
            assert isinstance(report, CheckReport)
            self.checks.received(name, report)

        checks = ReplicaChecks(node.broker, name, None, self.scheduled.append, send,
                               self.c.clock)
        node.backup = Backup(node.broker, me=name, epoch=1, position=(-1, -1),
                             layers={R.CHECK: checks.replica(lambda: node.backup, "n1", 1)})
        self.c.join(name)
        return node.backup

    def run_all(self) -> None:
        while self.scheduled:
            self.scheduled.pop(0)()

    def check(self) -> tuple[ReplicaCheck, dict[str, Any]]:
        run = self.checks.start(self.c.primary, list(self.c.nodes))
        self.c.pump()
        self.run_all()
        self.c.pump()
        return run, run.result(self.c.clock.now)

    def queue(self, node: str, name: str = "q") -> Queue:
        return self.c.nodes[node].broker.vhosts["/"].queues[name]


def _workload(k: Checked) -> None:
    broker = k.c.broker
    for name in ("q", "r"):
        broker.vhosts["/"].declare_queue(name, owner=None, durable=True)
    for i in range(300):
        publish(broker, b"body %d" % i, "q" if i % 3 else "r", persistent=True)
    consume(broker.vhosts["/"].queues["q"], 40)
    k.c.pump()


def test_replicas_of_a_workload_agree() -> None:
    k = Checked()
    _workload(k)
    q = k.queue("n1")
    held = [q.get() for _ in range(5)]  # delivered, not acknowledged: ready on the backups
    assert all(held)
    run, result = k.check()
    assert run.done and result["agree"] and result["complete"], result
    assert result["differences"] == 0
    assert sorted(result["replicas"]) == ["n1", "n2", "n3"]
    rows = {row["name"]: row for row in result["queues"]}
    assert rows["q"]["count"] == 160 and rows["r"]["count"] == 100
    for row in rows.values():
        assert set(row["replicas"]) == {"n2", "n3"}
        assert all(v["agree"] for v in row["replicas"].values())
    # the ck is an ordinary event of the log: acknowledged and applied in seq order
    assert all(k.c.nodes[n].backup.applied_seq == run.seq for n in ("n2", "n3"))  # type: ignore[union-attr]


def test_a_message_removed_behind_a_backups_back_is_reported() -> None:
    k = Checked()
    _workload(k)
    q = k.queue("n3")
    gone = sorted(q.ready, key=lambda e: e.position)[10]
    q.ready.remove(gone)  # no event: as a store that lost a row
    _, result = k.check()
    assert not result["agree"] and result["differences"] == 1
    rows = {row["name"]: row for row in result["queues"]}
    assert rows["r"]["replicas"]["n3"]["agree"] and rows["q"]["replicas"]["n2"]["agree"]
    diff = rows["q"]["replicas"]["n3"]
    assert diff["agree"] is False
    assert diff["differences"] == [{"what": "missing positions", "count": 1,
                                    "runs": [[gone.position, gone.position]], "more_runs": 0}]


def test_a_message_changed_behind_a_backups_back_is_reported() -> None:
    k = Checked()
    _workload(k)
    q = k.queue("n2", "r")
    entry = sorted(q.ready, key=lambda e: e.position)[7]
    m = entry.message
    entry.message = Message(m.exchange, m.routing_key, m.header, b"bodx 21")  # same length
    _, result = k.check()
    rows = {row["name"]: row for row in result["queues"]}
    assert [d["what"] for d in rows["r"]["replicas"]["n2"]["differences"]] == ["digest differs"]
    assert rows["r"]["replicas"]["n3"]["agree"] and rows["q"]["replicas"]["n2"]["agree"]
    assert result["differences"] == 1 and not result["agree"]


def test_a_queue_only_a_backup_holds_and_one_it_lacks_are_named() -> None:
    k = Checked()
    _workload(k)
    k.c.nodes["n2"].broker.vhosts["/"].declare_queue("stray", owner=None, durable=True)
    k.c.nodes["n3"].broker.vhosts["/"].delete_queue("r", owner=None)
    _, result = k.check()
    rows = {row["name"]: row for row in result["queues"]}
    assert rows["stray"]["count"] is None
    assert rows["stray"]["replicas"] == {"n2": {"agree": False, "notes": [], "differences": [
        {"what": "extra queue", "ha_id": None, "count": 0}]}}
    assert rows["r"]["replicas"]["n3"]["differences"] == [{"what": "missing queue"}]
    assert result["differences"] == 2


def test_a_backup_not_following_and_one_that_never_reports() -> None:
    k = Checked()
    _workload(k)
    k.c.silent.add("n3")  # in session, gets nothing: never applies the ck
    run, result = k.check()
    assert not run.done and result["agree"] and not result["complete"]
    assert result["replicas"]["n3"]["reported"] is False
    assert "no report" in result["replicas"]["n3"]["why"]
    del k.c.primary.sessions["n3"]  # gone from the session before the next check
    run, result = k.check()
    assert run.done and not result["complete"]
    assert "not following" in result["replicas"]["n3"]["why"]


def test_the_check_sees_the_log_at_its_seq_not_what_follows() -> None:
    """Work after the ``ck`` reaches the backups before their slices run: their reports are
    still of the queues at the ck, as the primary's is."""
    k = Checked()
    _workload(k)
    run = k.checks.start(k.c.primary, list(k.c.nodes))
    k.c.pump()  # the backups applied the ck: their listings are taken
    consume(k.c.broker.vhosts["/"].queues["q"], 30)
    publish(k.c.broker, b"after", "r", persistent=True)
    k.c.pump()
    k.run_all()
    result = run.result(k.c.clock.now)
    assert result["agree"] and result["complete"], result
    assert {row["name"]: row["count"] for row in result["queues"]} == {"q": 160, "r": 100}


def test_entries_are_entry_objects_of_the_queue() -> None:
    """Guard of the test's own assumption: the backups' queues hold ``Entry`` objects."""
    k = Checked()
    _workload(k)
    assert all(isinstance(e, Entry) for e in k.queue("n2").ready)


def test_a_check_rests_between_slices_in_proportion_to_their_work() -> None:
    """With ``later`` (a node's), a slice of t seconds is followed by t x pace of rest: the
    node's process is busy with a check a quarter of the time (PACE 3), so its loop and
    the others' on a shared machine keep their pace (benchmarks/check_replicas.py)."""
    broker = _broker()
    q = _queue(broker)
    for i in range(20_000):  # more than a slice of 2 ms digests, on any machine
        q.enqueue(message(b"m%d" % i))
    soon: list[Callable[[], None]] = []
    rests: list[float] = []
    later_calls: list[Callable[[], None]] = []

    def later(delay: float, callback: Callable[[], None]) -> None:
        rests.append(delay)
        later_calls.append(callback)

    checks = ReplicaChecks(broker, "n1", None, soon.append, lambda p, m: None, lambda: 0.0,
                           later, pace=3.0)
    builder = ReportBuilder([(q, [])], _no_store)
    done: list[bool] = []
    checks._pump(builder, lambda: done.append(True))
    soon.pop()()  # the first slice, the next loop turn
    while not done:
        assert not soon and len(later_calls) == 1
        later_calls.pop()()
    assert builder.slices == len(rests) + 1 >= 2
    # every slice but the last is followed by three times its time
    assert 3.0 * (builder.busy - builder.longest) <= sum(rests) * (1 + 1e-9)
    assert sum(rests) <= 3.0 * builder.busy * (1 + 1e-9)
