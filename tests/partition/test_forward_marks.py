"""Forward marks kept apart from the clients' outcome records (``broker/tx_outcomes.py``
``TxOutcomes.marks``, ``partition/forward_apply.py``): the newest per (group, origin), not
counted against the outcomes' retention, durable in one store row each, recovered, and a
group's catch-up replaces its own group's marks only."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from brokerha.backup.transaction_replicator import TransactionReplicator
from brokerha.broker.broker import Broker
from brokerha.broker.tx_outcomes import COMMITTED, TxOutcomes
from brokerha.cluster.replication import HA_ID
from brokerha.ha.simulation.world import message
from brokerha.partition.forward import (
    Forward,
    Forwarded,
    ForwardMessage,
    ForwardReceiver,
    Mark,
    WhenDurable,
    mark_name,
)
from brokerha.partition.forward_apply import BrokerForwardLog, recover_marks


class Rows:
    """A store's outcome rows (what ``TxOutcomes`` writes)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[str, str | None, str, float]] = {}

    def tx_outcome(self, txid: str, client_id: str | None, outcome: str, at: float) -> None:
        self.rows[txid] = (txid, client_id, outcome, at)

    def tx_outcome_deleted(self, txid: str) -> None:
        self.rows.pop(txid, None)


def outcomes(rows: Rows, **kw: Any) -> TxOutcomes:
    return TxOutcomes(rows, clock=lambda: 1000.0, **kw)  # type: ignore[arg-type]


def test_sustained_forwarding_past_the_retention_keeps_the_clients_records_and_dedupes() -> None:
    """300 batches of one origin through a broker whose outcomes keep 10 records: the
    clients' records stay, one mark is held (and one store row), and a resend of the first
    batch to a new primary that read the marks back is dropped."""
    broker = Broker("b")
    rows = Rows()
    broker.outcomes = outcomes(rows, max_records=10)
    vhost = broker.add_vhost("/")
    q = vhost.declare_queue("q", owner=None, durable=True, arguments={HA_ID: "1.1"})
    for i in range(5):
        broker.outcomes.record(f"g1/tx-{i}", f"client-{i}", COMMITTED)
    log = BrokerForwardLog(broker, 1, lambda queue: True)
    header = message(b"x", persistent=True).header
    first = None
    for fseq in range(1, 301):
        m = ForwardMessage("/", ("1.1",), "", "q", header, b"%d" % fseq)
        first = first or m
        log.apply("a.1", fseq, [(fseq, m)])
    assert len(q.ready) == 300
    assert [broker.outcomes.outcome(f"client-{i}") for i in range(5)] == [COMMITTED] * 5
    assert len(broker.outcomes) == 5 and len(broker.outcomes.marks) == 1
    assert len(rows.rows) == 6  # the clients' five and the newest mark
    marks = recover_marks(broker, 1)
    assert marks == {"a.1": Mark(300, set())}
    receiver = ForwardReceiver(1, 2, log, marks=marks)
    late = Forward(1, 2, "a.1", 1, 0, [first.as_wire()] if first else [])
    (answer,) = receiver.receive("a", late)
    assert isinstance(answer, WhenDurable) and answer.send.packet == Forwarded(1, "a.1", 1, [])
    assert receiver.stats.deduped == 1 and len(q.ready) == 300


def test_the_newest_mark_names_the_refused_fseqs_of_the_marks_before() -> None:
    broker = Broker("b")
    vhost = broker.add_vhost("/")
    vhost.declare_queue("full", owner=None, durable=True, arguments={
        HA_ID: "1.2", "x-max-length": 1, "x-overflow": "reject-publish"})
    log = BrokerForwardLog(broker, 1, lambda queue: True)
    header = message(b"x", persistent=True).header
    m = ForwardMessage("/", ("1.2",), "", "q", header, b"x")
    assert log.apply("a.1", 1, [(1, m)]) == []
    assert log.apply("a.1", 2, [(2, m)]) == [2]
    assert log.apply("a.1", 3, [(3, m)]) == [3]
    assert len(broker.outcomes.marks) == 1
    assert recover_marks(broker, 1) == {"a.1": Mark(3, {2, 3})}


def test_marks_restored_from_a_store_of_one_row_per_batch_keep_the_newest() -> None:
    """A store written before the marks were kept apart: every batch's row; the newest
    per origin is held, the others deleted at the next mark's record."""
    rows = Rows()
    o = outcomes(rows)
    old = [(f"g1/fw-{i}", mark_name(1, "a.1", i, []), COMMITTED, 10.0 + i) for i in range(1, 6)]
    other = ("g2/fw-1", mark_name(2, "a.1", 7, [7]), COMMITTED, 11.0)
    client = ("g1/tx-1", "client", COMMITTED, 9.0)
    for r in [*old, other, client]:
        rows.rows[r[0]] = r
    o.restore(rows.rows.values())
    assert o.marks_of(1) == [old[-1]] and o.marks_of(2) == [other]
    assert o.outcome("client") == COMMITTED and len(o) == 1
    o.record("g1/fw-6", mark_name(1, "a.1", 6, []), COMMITTED)
    assert sorted(rows.rows) == ["g1/fw-6", "g1/tx-1", "g2/fw-1"]


def test_old_origins_are_dropped_by_age_and_by_count() -> None:
    now = [0.0]
    o = TxOutcomes(Rows(), clock=lambda: now[0],  # type: ignore[arg-type]
                   mark_max_age=100.0, mark_max_origins=3)
    for i in range(5):
        o.record(f"g1/fw-{i}", mark_name(1, f"n{i}.1", 1, []), COMMITTED)
    o.record("g2/fw-0", mark_name(2, "n0.1", 1, []), COMMITTED)
    assert [k for k in o.marks] == [(1, "n2.1"), (1, "n3.1"), (1, "n4.1"), (2, "n0.1")]
    now[0] = 90.0
    o.record("g1/fw-9", mark_name(1, "n3.1", 2, []), COMMITTED)  # n3.1 heard again
    now[0] = 150.0
    o.record("g1/fw-10", mark_name(1, "n4.1", 2, []), COMMITTED)
    assert [k for k in o.marks] == [(1, "n3.1"), (1, "n4.1")]


def test_a_groups_catch_up_replaces_its_own_marks_and_leaves_the_others() -> None:
    """A backup of group 1 catching up (``TransactionReplicator`` with group 1's scope):
    group 1's marks become the primary's, group 2's (this node is in that group too) stay."""
    broker = Broker("b")
    o = broker.outcomes
    o.record("g1/fw-1", mark_name(1, "a.1", 5, []), COMMITTED)
    o.record("g1/fw-2", mark_name(1, "b.1", 3, []), COMMITTED)
    o.record("g2/fw-1", mark_name(2, "a.1", 9, []), COMMITTED)
    o.record("g2/tx-1", "client-2", COMMITTED)
    scope: Any = SimpleNamespace(group=1)
    tr = TransactionReplicator(broker, lambda vhost, queue: None, "b", 2,  # type: ignore
                               scope=scope)
    tr.catch_up_begins()
    tr.outcomes([["g1/fw-7", mark_name(1, "a.1", 8, []), COMMITTED, 1.0]])
    tr.caught_up()
    assert recover_marks(broker, 1) == {"a.1": Mark(8, set())}
    assert recover_marks(broker, 2) == {"a.1": Mark(9, set())}
    assert o.outcome("client-2") == COMMITTED


def test_a_catch_up_replaces_a_higher_mark_the_primary_never_had() -> None:
    """A backup that applied a deposed primary's forward (mark 28, never committed) and
    joins the new primary, whose mark of that origin is 26: the catch-up's 26 is the
    mark, not none (it was: the 26 ignored as older, the 28 then dropped as unknown to
    the primary -- the remote-consume simulation's seed 511 of five nodes)."""
    broker = Broker("b")
    broker.outcomes.record("g1/fw-9", mark_name(1, "n4.1", 28, []), COMMITTED)
    scope: Any = SimpleNamespace(group=1)
    tr = TransactionReplicator(broker, lambda vhost, queue: None, "b", 2,  # type: ignore
                               scope=scope)
    tr.catch_up_begins()
    tr.outcomes([["g1/fw-5", mark_name(1, "n4.1", 26, []), COMMITTED, 1.0]])
    tr.caught_up()
    assert recover_marks(broker, 1) == {"n4.1": Mark(26, set())}


def test_a_backup_holds_the_newest_mark_only_and_reads_it_back_promoted() -> None:
    """A product ``Primary`` and its ``Backup`` (tests/ha/harness.py), both keeping 5
    outcome records: 30 batches of two origins; the backup holds one mark per origin (its
    store one row each), none of them evicted, and reads them back."""
    from tests.ha.harness import Cluster

    c = Cluster(2)
    q = c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    c.follow("n2")
    c.pump()
    backup = c.node("n2").broker
    for broker in (c.broker, backup):
        broker.outcomes.max_records = 5
    header = message(b"x", persistent=True).header
    ha_id = str(q.arguments[HA_ID])
    log = BrokerForwardLog(c.broker, 1, lambda queue: True)
    for fseq in range(1, 16):
        for origin in ("a.1", "b.1"):
            log.apply(origin, fseq, [(fseq, ForwardMessage("/", (ha_id,), "", "q", header,
                                                           b"%d" % fseq))])
        c.pump()
    assert len(backup.vhosts["/"].queues["q"].ready) == 30
    assert len(backup.outcomes.marks) == 2 and len(backup.outcomes) == 0
    assert recover_marks(backup, 1) == {"a.1": Mark(15, set()), "b.1": Mark(15, set())}
