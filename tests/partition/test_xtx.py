"""Cross-partition commit (``partition/xtx.py``): ``CrossTx`` and ``DecisionRules`` as scenarios.

Each partition primary is a ``DecisionRules`` over ``Branches``, a dict
standing in for its ``DtxManager`` and ``TxOutcomes``; packets are carried
by hand, so each test shows one ordering of the protocol.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from brokerha.broker.dtx import Xid
from brokerha.broker.tx_outcomes import COMMITTED, ROLLED_BACK
from brokerha.partition.forward import ForwardMessage
from brokerha.partition.xtx import (
    HELD,
    Answer,
    CrossTx,
    DecisionRules,
    Effect,
    InDoubt,
    Status,
    ToNode,
    ToPartition,
    Unsafe,
    WhenDurable,
    XBranch,
    XCommit,
    XDecide,
    XDecided,
    XFinished,
    XOutcome,
    XOutcomeReply,
    XPrepare,
    XPrepared,
    XRollback,
    branch_of,
    xid_of,
)


class Branches:
    """A partition's transactions: the state of each gtxid, and what was written."""

    def __init__(self) -> None:
        self.state: dict[str, Status] = {}
        self.prepared_at: dict[str, tuple[XBranch, float]] = {}
        self.written: list[tuple[str, str]] = []
        self.held: dict[str, tuple[str, tuple[int, ...]]] = {}  # all-prepared records (XA)
        self.now = 0.0

    def status(self, gtxid: str) -> Status:
        return self.state.get(gtxid, Status.ABSENT)

    def prepare(self, branch: XBranch) -> None:
        self.state[branch.gtxid] = Status.PREPARING
        self.prepared_at[branch.gtxid] = (branch, self.now)

    def commit(self, gtxid: str) -> None:
        assert self.state[gtxid] is Status.PREPARED
        self.state[gtxid] = Status.COMMITTED
        self.written.append((gtxid, COMMITTED))

    def rollback(self, gtxid: str) -> None:
        self.state[gtxid] = Status.ROLLED_BACK
        self.written.append((gtxid, ROLLED_BACK))

    def in_doubt(self) -> Iterable[InDoubt]:
        return [InDoubt(b, at) for g, (b, at) in self.prepared_at.items()
                if self.state.get(g) is Status.PREPARED]

    def hold(self, gtxid: str, xid: str, participants: Sequence[int]) -> None:
        self.held[gtxid] = (xid, tuple(participants))
        self.written.append((gtxid, HELD))

    def is_held(self, gtxid: str) -> bool:
        return gtxid in self.held

    def held_xa(self) -> Iterable[tuple[str, str, tuple[int, ...]]]:
        return [(xid, g, ps) for g, (xid, ps) in self.held.items()
                if not self.status(g).decided]

    def unhold_decided(self) -> list[str]:
        decided = [g for g in self.held if self.status(g).decided]
        for g in decided:
            del self.held[g]
        return decided

    def prepare_ends(self, rules: DecisionRules, gtxid: str, ok: bool = True) -> list[Effect]:
        if ok:
            self.state[gtxid] = Status.PREPARED
        return rules.prepared(gtxid, ok)


def packets(effects: Sequence[Effect]) -> list[object]:
    """The packets, a ``WhenDurable`` shown as ("durable", packet)."""
    out: list[object] = []
    for e in effects:
        if isinstance(e, WhenDurable):
            out.append(("durable", e.send.packet))
        elif isinstance(e, ToPartition | ToNode):
            out.append(e.packet)
        else:
            out.append(e)
    return out


def unwrap(effects: Sequence[Effect]) -> list[Effect]:
    """The sends, once durable."""
    return [e.send if isinstance(e, WhenDurable) else e for e in effects]


def publish(p: int) -> list[ForwardMessage]:
    return [ForwardMessage("/", (f"1.{p + 1}",), "", f"q{p}", b"", b"m")]


class Cluster:
    """Three partitions' primaries and one coordinator, packets carried by ``deliver``."""

    def __init__(self) -> None:
        self.stores = [Branches() for _ in range(3)]
        self.rules = [DecisionRules(p, s) for p, s in enumerate(self.stores)]
        self.coordinator = CrossTx("n1")

    def deliver(self, effects: Sequence[Effect], now: float = 0.0) -> list[Effect]:
        """Carry every send (durable at once) until only answers are left; prepares end yes."""
        answers: list[Effect] = []
        pending = list(unwrap(effects))
        while pending:
            effect = pending.pop(0)
            if isinstance(effect, ToPartition):
                p = effect.partition
                out = self.rules[p].receive(now, effect.packet)
                if isinstance(effect.packet, XPrepare) and not out:
                    out = self.stores[p].prepare_ends(self.rules[p], effect.packet.gtxid)
                pending += unwrap(out)
            elif isinstance(effect, ToNode):
                pending += unwrap(self.coordinator.receive(now, effect.packet))
            else:
                answers.append(effect)
        return answers


def test_gtxids_are_time_based_and_strictly_increasing_on_a_node() -> None:
    tx = CrossTx("n1")
    first = tx.new_gtxid(5.0)
    assert first == "0000000005000000000-n1"
    assert [tx.new_gtxid(5.0) for _ in range(2)] == ["0000000005000000001-n1",
                                                     "0000000005000000002-n1"]
    assert tx.new_gtxid(4.0) > first  # a clock that stepped back still gives a later id
    assert CrossTx("n2").new_gtxid(5.0) != first


def test_all_yes_commits_at_the_decider_first_then_the_others() -> None:
    cluster = Cluster()
    tx = cluster.coordinator
    gtxid, effects = tx.begin(0.0, {2: publish(2), 0: publish(0)})
    assert packets(effects) == [XPrepare(XBranch(gtxid, 0, 0, (0, 2), "n1", tuple(publish(0)))),
                                XPrepare(XBranch(gtxid, 2, 0, (0, 2), "n1", tuple(publish(2))))]
    # the yes votes: the decision goes to partition 0 alone
    after_votes = tx.receive(0.0, XPrepared(gtxid, 0, True))
    assert after_votes == []
    decide = tx.receive(0.0, XPrepared(gtxid, 2, True))
    assert decide == [ToPartition(0, XDecide(gtxid, True, "n1"))]
    cluster.stores[0].state[gtxid] = Status.PREPARED
    cluster.stores[2].state[gtxid] = Status.PREPARED
    decided = cluster.rules[0].receive(0.0, decide[0].packet)  # type: ignore[union-attr]
    # the decider's commit and outcome record are the decision; answered once durable
    assert cluster.stores[0].written == [(gtxid, COMMITTED)]
    assert decided == [WhenDurable(ToNode("n1", XDecided(gtxid, COMMITTED)))]
    assert cluster.stores[2].written == []  # nobody else commits before the decision
    finish = tx.receive(0.0, XDecided(gtxid, COMMITTED))
    assert finish == [ToPartition(2, XCommit(gtxid, "n1"))]
    assert cluster.deliver(finish) == [Answer(gtxid, True)]
    assert cluster.stores[2].written == [(gtxid, COMMITTED)]
    assert tx.commits == {}


def test_a_no_vote_rolls_back_everywhere_and_refuses_the_commit() -> None:
    cluster = Cluster()
    gtxid, effects = cluster.coordinator.begin(0.0, {0: publish(0), 1: publish(1)})
    cluster.rules[0].receive(0.0, effects[0].packet)  # type: ignore[union-attr]
    cluster.rules[1].receive(0.0, effects[1].packet)  # type: ignore[union-attr]
    no = cluster.stores[1].prepare_ends(cluster.rules[1], gtxid, ok=False)
    assert no == [ToNode("n1", XPrepared(gtxid, 1, False))]  # a no needs no sync
    assert cluster.stores[1].written == [(gtxid, ROLLED_BACK)]
    yes = cluster.stores[0].prepare_ends(cluster.rules[0], gtxid)
    answers = cluster.deliver(no + yes)
    assert answers == [Answer(gtxid, False, "partition 1 refused to prepare")]
    assert cluster.stores[0].written == [(gtxid, ROLLED_BACK)]


def test_a_prepare_that_does_not_answer_in_time_rolls_back() -> None:
    tx = CrossTx("n1", prepare_timeout=5.0, retry=0.5)
    gtxid, _ = tx.begin(0.0, {0: publish(0), 1: publish(1)})
    tx.receive(0.1, XPrepared(gtxid, 0, True))
    assert packets(tx.tick(0.6)) == [XPrepare(XBranch(gtxid, 1, 0, (0, 1), "n1",
                                                      tuple(publish(1))))]  # resent
    assert tx.tick(0.7) == []
    assert tx.tick(5.0) == [ToPartition(0, XDecide(gtxid, False, "n1"))]


def test_an_undecided_gtxid_queried_gets_a_durable_tombstone_and_a_late_commit_is_refused() -> None:
    cluster = Cluster()
    tx, store, decider = cluster.coordinator, cluster.stores[0], cluster.rules[0]
    gtxid, effects = tx.begin(0.0, {0: (), 1: ()})
    for p in (0, 1):
        cluster.rules[p].receive(0.0, effects[p].packet)  # type: ignore[union-attr]
        cluster.stores[p].prepare_ends(cluster.rules[p], gtxid)
    # the coordinator stalls; partition 1, in doubt, asks before any XDecide arrives
    answer = decider.receive(3.0, XOutcome(gtxid, 1))
    assert store.written == [(gtxid, ROLLED_BACK)]  # written before it is answered ...
    assert answer == [WhenDurable(ToPartition(1, XOutcomeReply(gtxid, ROLLED_BACK)))]  # ... durable
    cluster.deliver(answer)
    assert cluster.stores[1].written == [(gtxid, ROLLED_BACK)]
    # the coordinator wakes up with both yes votes: its commit comes too late
    tx.receive(3.1, XPrepared(gtxid, 0, True))
    decide = tx.receive(3.1, XPrepared(gtxid, 1, True))
    late = decider.receive(3.1, decide[0].packet)  # type: ignore[union-attr]
    assert late == [WhenDurable(ToNode("n1", XDecided(gtxid, ROLLED_BACK)))]
    assert store.written == [(gtxid, ROLLED_BACK)]  # decided once
    [refused] = cluster.deliver(late)
    assert isinstance(refused, Answer) and not refused.committed
    assert "rolled it back" in refused.reason
    assert cluster.stores[1].written == [(gtxid, ROLLED_BACK)]


def test_a_late_prepare_after_a_tombstone_is_refused() -> None:
    store = Branches()
    rules = DecisionRules(0, store)
    gtxid = "0000000000000000001-n1"
    rules.receive(0.0, XOutcome(gtxid, 1))  # nothing here: the tombstone alone
    assert store.written == [(gtxid, ROLLED_BACK)]
    assert rules.receive(0.1, XPrepare(XBranch(gtxid, 0, 0, (0, 1), "n1"))) == [
        ToNode("n1", XPrepared(gtxid, 0, False))]
    assert store.status(gtxid) is Status.ROLLED_BACK


def test_a_participant_in_doubt_asks_its_decider_and_applies_the_answer() -> None:
    store = Branches()
    rules = DecisionRules(1, store, resolve_timeout=2.0, retry=0.5)
    gtxid = "0000000000000000001-n1"
    rules.receive(0.0, XPrepare(XBranch(gtxid, 1, 0, (0, 1), "n1")))
    store.prepare_ends(rules, gtxid)
    assert rules.tick(1.9) == []
    assert rules.tick(2.0) == [ToPartition(0, XOutcome(gtxid, 1))]
    assert rules.tick(2.1) == []  # asked already
    assert rules.tick(2.5) == [ToPartition(0, XOutcome(gtxid, 1))]  # no answer: again
    rules.receive(2.6, XOutcomeReply(gtxid, COMMITTED))
    assert store.written == [(gtxid, COMMITTED)]
    assert rules.tick(3.0) == []


def test_the_deciders_own_branch_undecided_too_long_is_rolled_back() -> None:
    store = Branches()
    rules = DecisionRules(0, store, resolve_timeout=2.0)
    gtxid = "0000000000000000001-n1"
    rules.receive(0.0, XPrepare(XBranch(gtxid, 0, 0, (0,), "n1")))
    store.prepare_ends(rules, gtxid)
    assert rules.tick(2.0) == []  # nobody to ask: its own tombstone
    assert store.written == [(gtxid, ROLLED_BACK)]
    assert rules.receive(2.1, XDecide(gtxid, True, "n1")) == [
        WhenDurable(ToNode("n1", XDecided(gtxid, ROLLED_BACK)))]


def test_every_packet_is_idempotent_by_gtxid() -> None:
    store = Branches()
    rules = DecisionRules(0, store)
    gtxid = "0000000000000000001-n1"
    branch = XBranch(gtxid, 0, 0, (0, 1), "n1")
    assert rules.receive(0.0, XPrepare(branch)) == []
    assert rules.receive(0.0, XPrepare(branch)) == []  # under way: answered when it ends
    assert packets(store.prepare_ends(rules, gtxid)) == [("durable", XPrepared(gtxid, 0, True))]
    assert packets(rules.receive(0.1, XPrepare(branch))) == [("durable", XPrepared(gtxid, 0, True))]
    for _ in range(2):
        assert packets(rules.receive(0.2, XDecide(gtxid, True, "n1"))) == [
            ("durable", XDecided(gtxid, COMMITTED))]
    assert packets(rules.receive(0.3, XCommit(gtxid, "n1"))) == [
        ("durable", XFinished(gtxid, 0, COMMITTED))]
    assert store.written == [(gtxid, COMMITTED)]
    # a rollback after the commit tells the truth and changes nothing
    assert packets(rules.receive(0.4, XRollback(gtxid, "n1"))) == [
        ("durable", XFinished(gtxid, 0, COMMITTED))]
    assert store.written == [(gtxid, COMMITTED)]


def test_what_a_partition_owes_goes_to_its_new_leader_at_once() -> None:
    tx = CrossTx("n1", retry=10.0)
    gtxid, _ = tx.begin(0.0, {0: (), 1: (), 2: ()})
    tx.receive(0.0, XPrepared(gtxid, 0, True))
    assert tx.leader_changed(0.1, 0) == []  # partition 0 answered
    assert packets(tx.leader_changed(0.1, 2)) == [XPrepare(XBranch(gtxid, 2, 0, (0, 1, 2), "n1"))]
    tx.receive(0.2, XPrepared(gtxid, 1, True))
    tx.receive(0.2, XPrepared(gtxid, 2, True))
    assert tx.leader_changed(0.3, 0) == [ToPartition(0, XDecide(gtxid, True, "n1"))]
    assert tx.receive(0.4, XPrepared(gtxid, 1, True)) == []  # a late duplicate: ignored


def test_one_partition_commits_at_its_decider_alone() -> None:
    cluster = Cluster()
    gtxid, effects = cluster.coordinator.begin(0.0, {1: publish(1)})
    assert cluster.deliver(effects) == [Answer(gtxid, True)]
    assert cluster.stores[1].written == [(gtxid, COMMITTED)]


def test_unsafe_commit_before_decision_tells_the_participants_with_the_decide() -> None:
    tx = CrossTx("n1", unsafe=Unsafe(commit_before_decision=True))
    gtxid, _ = tx.begin(0.0, {0: (), 1: ()})
    tx.receive(0.0, XPrepared(gtxid, 0, True))
    assert tx.receive(0.0, XPrepared(gtxid, 1, True)) == [
        ToPartition(0, XDecide(gtxid, True, "n1")), ToPartition(1, XCommit(gtxid, "n1"))]


def test_unsafe_presume_without_tombstone_answers_what_it_never_wrote() -> None:
    store = Branches()
    rules = DecisionRules(0, store, unsafe=Unsafe(presume_without_tombstone=True))
    gtxid = "0000000000000000001-n1"
    assert rules.receive(0.0, XOutcome(gtxid, 1)) == [
        ToPartition(1, XOutcomeReply(gtxid, ROLLED_BACK))]
    assert store.written == []


def test_a_commit_needs_a_partition() -> None:
    with pytest.raises(ValueError):
        CrossTx("n1").begin(0.0, {})


def test_a_branch_is_an_xa_branch_whose_xid_says_how_to_resolve_it() -> None:
    gtxid = CrossTx("n" * 44).new_gtxid(1e9)  # the longest name: the gtrid's 64 bytes
    branch = XBranch(gtxid, 2, 0, (0, 2), "n1", tuple(publish(2)))
    xid = xid_of(branch)
    assert len(xid.gtrid) == 64 and xid.bqual == b"2/0/0,2"
    assert Xid.from_key(xid.key) == xid  # as the prepared record keeps it
    assert branch_of(xid) == XBranch(gtxid, 2, 0, (0, 2), "")  # no ops, nobody waiting
    assert branch_of(Xid(1, b"a TM's own")) is None
    with pytest.raises(ValueError):
        CrossTx("n" * 45)


def test_a_deciders_new_primary_decides_from_what_was_durable() -> None:
    gtxid = "0000000000000000001-n1"
    # the decision was written but not durable when the primary failed: the new one holds
    # the branch prepared (durable before its yes) and decides again on the retry
    store = Branches()
    store.state[gtxid] = Status.PREPARED
    again = DecisionRules(0, store).receive(1.0, XDecide(gtxid, True, "n1"))
    assert again == [WhenDurable(ToNode("n1", XDecided(gtxid, COMMITTED)))]
    # its tombstone was durable: the retry is refused by the new primary too
    store = Branches()
    store.state[gtxid] = Status.ROLLED_BACK
    refused = DecisionRules(0, store).receive(1.0, XDecide(gtxid, True, "n1"))
    assert refused == [WhenDurable(ToNode("n1", XDecided(gtxid, ROLLED_BACK)))]
    assert store.written == []
