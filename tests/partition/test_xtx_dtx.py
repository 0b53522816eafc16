"""``PartitionTransactions`` backed by today's ``DtxManager`` and ``TxOutcomes``.

A reference for stage 4's integration: ``DtxTransactions`` below is the
adapter in a few lines (an XA branch per gtxid, ``xid_of``; outcome records
by gtxid in the branch's loop callback), and the scenarios run the product's
``CrossTx`` and ``DecisionRules`` over two real ``Broker`` objects, one per
partition, packets carried by hand and every write taken as durable (no
HA under them). So the Protocol is known to fit what exists: a commit lands
on both brokers' queues, a tombstone rolls back a held branch (its entries
requeued) and refuses the late commit, and a prepared branch restored from
the store is found in doubt by ``branch_of`` its xid.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header
from brokerha.broker.dtx import XA, State, Xid
from brokerha.broker.message import Entry, Message
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK
from brokerha.partition.xtx import (
    XTX_FORMAT,
    Answer,
    CrossTx,
    DecisionRules,
    Effect,
    InDoubt,
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
    XPublish,
    branch_of,
    xid_of,
)
from tests.clock import Clock

OWNER = object()  # the "channel" a cross-partition branch is associated with, briefly


def done(coro: Coroutine[Any, Any, XA]) -> XA:
    """A DtxManager verb that awaits nothing on this path (a two-phase commit), run now."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    raise AssertionError("the verb waited")


class DtxTransactions:
    """``PartitionTransactions`` over one broker's ``DtxManager`` and ``TxOutcomes``."""

    def __init__(self, broker: Broker, prepared: Callable[[str, bool], None]) -> None:
        self.broker = broker
        self.prepared = prepared  # the shell's report: DecisionRules.prepared, carried out
        # what the remote consumers hold, by (vhost, queue, position): an XDequeue's entries
        self.held: dict[tuple[str, str, int], Entry] = {}

    def _xid(self, gtxid: str) -> Xid | None:
        for xid in self.broker.dtx.branches:
            if xid.format_id == XTX_FORMAT and xid.gtrid == gtxid.encode():
                return xid
        return None

    def status(self, gtxid: str) -> Status:
        outcomes = self.broker.outcomes
        if outcomes.known(gtxid):
            return Status.COMMITTED if outcomes.committed(gtxid) else Status.ROLLED_BACK
        xid = self._xid(gtxid)
        if xid is None:
            return Status.ABSENT
        prepared = self.broker.dtx.branches[xid].state is State.PREPARED
        return Status.PREPARED if prepared else Status.PREPARING

    def prepare(self, branch: XBranch) -> None:
        dtx, xid = self.broker.dtx, xid_of(branch)
        work = dtx.start(xid, OWNER)
        missing = False
        for op in branch.ops:
            vhost = self.broker.vhosts[op.vhost]
            if isinstance(op, XPublish):
                work.publish([vhost.queues[q] for q in op.queues],
                             Message(op.exchange, op.routing_key, op.header, op.body))
                continue
            keys = [(op.vhost, op.queue, n) for n in op.positions]
            missing |= any(k not in self.held for k in keys)
            work.accept([(vhost.queues[op.queue], self.held.pop(k)) for k in keys
                         if k in self.held], [])
        # a dequeue of an entry no longer held (a failover requeued it) is a no
        dtx.end(xid, OWNER, fail=missing)
        task = asyncio.get_running_loop().create_task(dtx.prepare(xid))

        def ended(task: asyncio.Task[XA]) -> None:
            ok = not task.cancelled() and task.exception() is None and task.result() is XA.OK
            self.prepared(branch.gtxid, ok)
        task.add_done_callback(ended)

    def commit(self, gtxid: str) -> None:
        xid = self._xid(gtxid)
        assert xid is not None
        assert done(self.broker.dtx.commit(xid)) is XA.OK
        self.broker.outcomes.record(gtxid, None, COMMITTED)  # same loop callback: same batch

    def rollback(self, gtxid: str) -> None:
        xid = self._xid(gtxid)
        if xid is not None:
            self.broker.dtx.rollback(xid)
        self.broker.outcomes.record(gtxid, None, ROLLED_BACK)  # alone: the tombstone

    def in_doubt(self) -> Iterable[InDoubt]:
        out = []
        for xid, work in self.broker.dtx.branches.items():
            branch = branch_of(xid)
            if branch is not None and work.state is State.PREPARED:
                out.append(InDoubt(branch, work.started))
        return out


class Partitions:
    """Two partitions (a broker each, queue ``q0`` / ``q1``) and one coordinator."""

    def __init__(self) -> None:
        self.clock = Clock(100.0)
        self.brokers: list[Broker] = []
        self.rules: list[DecisionRules] = []
        for p in range(2):
            broker = Broker(f"p{p}", clock=self.clock)
            broker.add_vhost("/").declare_queue(f"q{p}", owner=None)
            self.brokers.append(broker)
            self.rules.append(DecisionRules(p, DtxTransactions(broker, self._prepared(p))))
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
    return XPublish("/", (f"q{p}",), "", f"q{p}", build_header(len(body)), body)


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
        assert [b.outcomes.committed(gtxid) for b in parts.brokers] == [True, True]
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
        outcomes = parts.brokers[0].outcomes
        assert outcomes.known(gtxid) and not outcomes.committed(gtxid)  # the tombstone
        again = queue.get()
        assert again is entry and again.redelivered  # the held entry is back
        assert parts.rules[1].txs.status(gtxid) is Status.ROLLED_BACK
        late = rules.receive(parts.clock(), XDecide(gtxid, True, "n1"))
        assert late == [WhenDurable(ToNode("n1", XDecided(gtxid, ROLLED_BACK)))]
        assert parts.count(1) == 0
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
        fresh = Broker("p1-again", clock=parts.clock)
        fresh.add_vhost("/").declare_queue("q1", owner=None)
        fresh.restore(record)
        rules = DecisionRules(1, DtxTransactions(fresh, lambda g, ok: None))
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
