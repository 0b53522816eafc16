"""``BrokerTransactions`` (partition/xtx_broker.py): ``PartitionTransactions`` over a broker.

The scenarios run the product's ``CrossTx`` and ``DecisionRules`` over the
product's adapter on real ``Broker`` objects, one per partition (or two
partitions on one broker, as a node leading both), packets carried by hand
and every write taken as durable (no HA under them; the HA cases are in
``test_xtx_replication.py``): a commit lands on both brokers' queues, a
tombstone rolls back a held branch (its entries requeued) and refuses the
late commit, a prepared branch restored from the store is found in doubt by
``branch_of`` its xid, and each partition's record is its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header
from brokerha.broker.message import Message
from brokerha.broker.tx_outcomes import ROLLED_BACK
from brokerha.cluster.replication import HA_ID
from brokerha.partition.forward import ForwardMessage
from brokerha.partition.xtx import (
    Answer,
    CrossTx,
    DecisionRules,
    Effect,
    Status,
    ToNode,
    ToPartition,
    WhenDurable,
    XBranch,
    XDecide,
    XDecided,
    XDequeue,
    XOp,
    XOutcome,
    xtx_txid,
)
from brokerha.partition.xtx_broker import BrokerTransactions
from tests.clock import Clock


def spawn(work: Any, on_done: Callable[[BaseException | None], None]) -> None:
    """The node's spawner: a task, its end reported."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: on_done(None if t.cancelled() else t.exception()))


class Partitions:
    """Two partitions (a broker each, or one for both: ``shared``; queue ``q0`` / ``q1``) and
    one coordinator."""

    def __init__(self, shared: bool = False) -> None:
        self.clock = Clock(100.0)
        self.brokers: list[Broker] = []
        self.rules: list[DecisionRules] = []
        for p in range(2):
            if shared and self.brokers:
                broker = self.brokers[0]
            else:
                broker = Broker(f"p{p}", clock=self.clock, spawn=spawn)
                broker.add_vhost("/")
            broker.vhosts["/"].declare_queue(f"q{p}", owner=None, arguments={HA_ID: f"1.{p + 1}"})
            self.brokers.append(broker)
            self.rules.append(DecisionRules(p, BrokerTransactions(broker, p, self._prepared(p))))
        self.coordinator = CrossTx("n1")
        self.answers: list[Answer] = []
        self.dropped: list[Effect] = []
        self.deliver_to_coordinator = True

    def _prepared(self, p: int) -> Callable[[str, bool], None]:
        return lambda gtxid, ok: self.carry(self.rules[p].prepared(gtxid, ok))

    def carry(self, effects: Sequence[Effect]) -> None:
        for effect in effects:
            send = effect.send if isinstance(effect, WhenDurable) else effect
            if isinstance(send, ToPartition):
                self.carry(self.rules[send.partition].receive(self.clock(), send.packet))
            elif isinstance(send, ToNode):
                if self.deliver_to_coordinator:
                    self.carry(self.coordinator.receive(self.clock(), send.packet))
                else:
                    self.dropped.append(send)
            elif isinstance(send, Answer):
                self.answers.append(send)

    def count(self, p: int) -> int:
        return self.brokers[p].vhosts["/"].queues[f"q{p}"].message_count


def message(p: int, body: bytes = b"m") -> XOp:
    return ForwardMessage("/", (f"1.{p + 1}",), "", f"q{p}", build_header(len(body)), body)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_commit_over_two_brokers_lands_on_both() -> None:
    async def scenario() -> None:
        parts = Partitions()
        gtxid, effects = parts.coordinator.begin(parts.clock(), {0: [message(0)],
                                                                   1: [message(1)]})
        parts.carry(effects)
        await settle()  # the XA prepares end, the votes go, the decision, the commits
        assert parts.answers == [Answer(gtxid, True)]
        assert parts.count(0) == parts.count(1) == 1
        assert [b.outcomes.committed(xtx_txid(p, gtxid))
                for p, b in enumerate(parts.brokers)] == [True, True]
        assert all(not b.dtx.branches for b in parts.brokers)
    asyncio.run(scenario())


def test_a_tombstone_requeues_what_the_branch_held_and_refuses_the_late_commit() -> None:
    async def scenario() -> None:
        parts = Partitions()
        queue = parts.brokers[0].vhosts["/"].queues["q0"]
        queue.enqueue(Message("", "q0", build_header(4), b"old!"))
        entry = queue.get()
        assert entry is not None
        parts.rules[0].txs.held[("/", "q0", entry.position)] = entry  # type: ignore[attr-defined]
        gtxid, effects = parts.coordinator.begin(
            parts.clock(), {0: [XDequeue("/", "q0", (entry.position,))], 1: [message(1)]})
        parts.deliver_to_coordinator = False  # the coordinator is gone: nobody decides
        parts.carry(effects)
        await settle()
        rules = parts.rules[0]
        assert rules.txs.status(gtxid) is Status.PREPARED
        # partition 1 asks; the decider writes its tombstone, its branch rolled back
        parts.carry(rules.receive(parts.clock(), XOutcome(gtxid, 1)))
        outcomes, txid = parts.brokers[0].outcomes, xtx_txid(0, gtxid)
        assert outcomes.known(txid) and not outcomes.committed(txid)  # the tombstone
        again = queue.get()
        assert again is entry and again.redelivered  # the held entry is back
        assert parts.rules[1].txs.status(gtxid) is Status.ROLLED_BACK
        late = rules.receive(parts.clock(), XDecide(gtxid, True, "n1"))
        assert late == [WhenDurable(ToNode("n1", XDecided(gtxid, ROLLED_BACK)))]
        assert parts.count(1) == 0
    asyncio.run(scenario())


def test_a_branch_s_rejects_requeue_or_drop_at_its_commit_and_its_acks_dequeue() -> None:
    """A consumer's ack, nack (requeue) and reject (no requeue) in a transaction across
    partitions (issue 35 task F): the branch holds all three from its prepare; its commit
    dequeues the ack's and the reject's, requeues the nack's, flagged."""
    async def scenario() -> None:
        parts = Partitions()
        queue = parts.brokers[0].vhosts["/"].queues["q0"]
        entries = []
        for body in (b"ack!", b"nak!", b"rej!"):
            queue.enqueue(Message("", "q0", build_header(4), body))
            entry = queue.get()
            assert entry is not None
            entries.append(entry)
            parts.rules[0].txs.held[("/", "q0", entry.position)] = entry  # type: ignore[attr-defined]
        acked, nacked, rejected = (e.position for e in entries)
        gtxid, effects = parts.coordinator.begin(parts.clock(), {0: [
            XDequeue("/", "q0", (acked,)), XDequeue("/", "q0", (nacked,), "requeue"),
            XDequeue("/", "q0", (rejected,), "reject")], 1: [message(1)]})
        parts.carry(effects)
        await settle()
        assert parts.answers == [Answer(gtxid, True)]
        again = queue.get()
        assert again is entries[1] and again.redelivered and queue.get() is None
        assert parts.count(1) == 1
    asyncio.run(scenario())


def test_a_prepared_branch_restored_from_the_store_is_in_doubt_and_asks() -> None:
    async def scenario() -> None:
        parts = Partitions()
        gtxid, effects = parts.coordinator.begin(parts.clock(), {0: [message(0)],
                                                                   1: [message(1)]})
        parts.deliver_to_coordinator = False
        parts.carry(effects)
        await settle()
        record = parts.brokers[1].store.load()
        fresh = Broker("p1-again", clock=parts.clock, spawn=spawn)
        fresh.add_vhost("/").declare_queue("q1", owner=None)
        fresh.restore(record)
        rules = DecisionRules(1, BrokerTransactions(fresh, 1, lambda g, ok: None))
        [doubt] = rules.txs.in_doubt()
        assert doubt.branch == XBranch(gtxid, 1, 0, (0, 1), "")
        parts.clock.now += 2.0
        assert rules.tick(parts.clock()) == [ToPartition(0, XOutcome(gtxid, 1))]
    asyncio.run(scenario())


def test_a_dequeue_of_an_entry_no_longer_held_votes_no() -> None:
    async def scenario() -> None:
        parts = Partitions()
        gtxid, effects = parts.coordinator.begin(
            parts.clock(), {0: [XDequeue("/", "q0", (7,))], 1: [message(1)]})
        parts.carry(effects)
        await settle()
        [refused] = parts.answers
        assert not refused.committed and "partition 0 refused" in refused.reason
        assert parts.count(1) == 0 and all(not b.dtx.branches for b in parts.brokers)
    asyncio.run(scenario())


def test_two_partitions_on_one_broker_keep_their_own_records() -> None:
    """A node leading both participants: each partition's branch and record is its own
    (a record by gtxid alone would make partition 1 find partition 0's commit and leave
    its own branch prepared, its message never enqueued)."""
    async def scenario() -> None:
        parts = Partitions(shared=True)
        broker = parts.brokers[0]
        gtxid, effects = parts.coordinator.begin(parts.clock(), {0: [message(0)],
                                                                   1: [message(1)]})
        parts.carry(effects)
        await settle()
        assert parts.answers == [Answer(gtxid, True)]
        assert parts.count(0) == parts.count(1) == 1
        assert [r[0] for r in broker.outcomes.snapshot()] == [xtx_txid(0, gtxid),
                                                               xtx_txid(1, gtxid)]
        assert not broker.dtx.branches
    asyncio.run(scenario())


def test_a_branch_of_a_queue_deleted_meanwhile_votes_no() -> None:
    async def scenario() -> None:
        parts = Partitions()
        parts.brokers[1].vhosts["/"].delete_queue("q1", owner=None)
        gtxid, effects = parts.coordinator.begin(
            parts.clock(), {0: [message(0)], 1: [XDequeue("/", "q1", (0,))]})
        parts.carry(effects)
        await settle()
        [refused] = parts.answers
        assert not refused.committed and parts.count(0) == 0
        assert parts.rules[0].txs.status(gtxid) is Status.ROLLED_BACK
    asyncio.run(scenario())
