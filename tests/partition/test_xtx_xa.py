"""XA over partitions (``partition/xtx.py`` rule (c)): a client's XA branch prepared across
partitions is held for its TM by the decider's all-prepared record, and only the TM's
commit or rollback decides it (docs/ha.md "XA over partitions")."""

from __future__ import annotations

from brokerha.broker.broker import Broker
from brokerha.broker.tx_outcomes import COMMITTED, DECIDED, ROLLED_BACK
from brokerha.partition.xtx import (
    HELD,
    Answer,
    CrossTx,
    DecisionRules,
    ToNode,
    ToPartition,
    Unsafe,
    WhenDurable,
    XBranch,
    XDecide,
    XDecided,
    XHeld,
    XHold,
    XOutcome,
    XOutcomeReply,
    XPrepare,
    XPrepared,
    XRecover,
)
from brokerha.partition.xtx_broker import BrokerTransactions
from tests.partition.test_xtx import Branches, Cluster, publish, unwrap

XID = "1:6162:01"


def prepared_and_held(cluster: Cluster) -> str:
    """An XA transaction over partitions 0 and 1, prepared: held for its TM."""
    gtxid, effects = cluster.coordinator.begin(0.0, {0: publish(0), 1: publish(1)}, xa=XID)
    [answer] = cluster.deliver(effects)
    assert answer == Answer(gtxid, False, "", held=True)
    return gtxid


def test_an_xa_prepare_holds_at_the_decider_instead_of_committing() -> None:
    cluster = Cluster()
    gtxid, effects = cluster.coordinator.begin(0.0, {0: publish(0), 1: publish(1)}, xa=XID)
    for p in (0, 1):
        cluster.rules[p].receive(0.0, effects[p].packet)  # type: ignore[union-attr]
        cluster.stores[p].prepare_ends(cluster.rules[p], gtxid)
    cluster.coordinator.receive(0.1, XPrepared(gtxid, 0, True))
    hold = cluster.coordinator.receive(0.1, XPrepared(gtxid, 1, True))
    assert hold == [ToPartition(0, XHold(gtxid, XID, [0, 1], "n1"))]  # the decider only
    out = cluster.rules[0].receive(0.2, hold[0].packet)  # type: ignore[union-attr]
    assert cluster.stores[0].written == [(gtxid, HELD)]  # written before it is answered ...
    assert out == [WhenDurable(ToNode("n1", XDecided(gtxid, HELD)))]  # ... durable
    assert cluster.coordinator.receive(0.3, XDecided(gtxid, HELD)) == [
        Answer(gtxid, False, "", held=True)]
    assert cluster.coordinator.commits == {}  # the TM's now: nothing of it on the node
    assert [s.status(gtxid).value for s in cluster.stores[:2]] == ["prepared", "prepared"]


def test_a_held_transaction_is_never_decided_by_the_timeout() -> None:
    cluster = Cluster()
    gtxid = prepared_and_held(cluster)
    decider, participant = cluster.rules[0], cluster.rules[1]
    assert decider.tick(60.0) == []  # rule (c): its own branch stays prepared
    ask = participant.tick(60.0)
    assert ask == [ToPartition(0, XOutcome(gtxid, 1))]
    reply = decider.receive(60.1, ask[0].packet)  # type: ignore[union-attr]
    assert reply == [WhenDurable(ToPartition(1, XOutcomeReply(gtxid, HELD)))]  # no tombstone
    participant.receive(60.2, XOutcomeReply(gtxid, HELD))
    assert participant.tick(61.0) == []  # told: it asks again only after hold_retry
    assert participant.tick(60.2 + participant.hold_retry) == [ToPartition(0, XOutcome(gtxid, 1))]
    assert [s.status(gtxid).value for s in cluster.stores[:2]] == ["prepared", "prepared"]
    assert (gtxid, ROLLED_BACK) not in cluster.stores[0].written


def test_the_tms_commit_from_another_node_commits_every_partition() -> None:
    cluster = Cluster()
    gtxid = prepared_and_held(cluster)
    other = CrossTx("n2")  # the client's node is gone; the TM asks another
    cluster.coordinator = other
    held = [cluster.rules[p].receive(0.0, XRecover("n2", 7)) for p in range(3)]  # recover
    assert [unwrap(h)[0].packet for h in held] == [  # type: ignore[union-attr]
        XHeld(7, 0, [[XID, gtxid, [0, 1]]]), XHeld(7, 1, []), XHeld(7, 2, [])]
    [answer] = cluster.deliver(other.finish(1.0, gtxid, (0, 1), True), now=1.0)
    assert answer == Answer(gtxid, True, "")
    assert [s.status(gtxid).value for s in cluster.stores[:2]] == [COMMITTED, COMMITTED]
    assert cluster.rules[0].receive(1.1, XRecover("n2", 8)) == [
        WhenDurable(ToNode("n2", XHeld(8, 0, [])))]  # decided: no longer listed


def test_the_tms_rollback_rolls_back_every_partition() -> None:
    cluster = Cluster()
    gtxid = prepared_and_held(cluster)
    [answer] = cluster.deliver(cluster.coordinator.finish(5.0, gtxid, (0, 1), False), now=5.0)
    assert answer.committed is False  # type: ignore[union-attr]
    assert [s.status(gtxid).value for s in cluster.stores[:2]] == [ROLLED_BACK, ROLLED_BACK]


def test_a_decider_that_decided_first_makes_the_prepare_roll_back() -> None:
    """A participant asked before the hold: the tombstone wins, XA_RBROLLBACK."""
    cluster = Cluster()
    gtxid, effects = cluster.coordinator.begin(0.0, {0: (), 1: ()}, xa=XID)
    for p in (0, 1):
        cluster.rules[p].receive(0.0, effects[p].packet)  # type: ignore[union-attr]
        cluster.stores[p].prepare_ends(cluster.rules[p], gtxid)
    cluster.deliver(cluster.rules[0].receive(3.0, XOutcome(gtxid, 1)))  # the tombstone
    cluster.coordinator.receive(3.1, XPrepared(gtxid, 0, True))
    hold = cluster.coordinator.receive(3.1, XPrepared(gtxid, 1, True))
    [answer] = cluster.deliver(hold, now=3.2)
    assert isinstance(answer, Answer) and not answer.committed and not answer.held
    assert cluster.stores[0].held == {}  # never held: the record and the tombstone exclude
    assert cluster.stores[1].status(gtxid).value == ROLLED_BACK


def test_a_hold_waits_for_the_deciders_own_prepare() -> None:
    store = Branches()
    rules = DecisionRules(0, store)
    gtxid = "0000000000000000001-n1"
    rules.receive(0.0, XPrepare(XBranch(gtxid, 0, 0, (0, 1), "n1")))
    assert rules.receive(0.0, XHold(gtxid, XID, [0, 1], "n1")) == []  # its yes not said
    assert store.held == {}


def test_a_commit_of_a_held_transaction_nobody_prepared_is_refused() -> None:
    """An XDecide(commit) of an unknown gtxid writes the tombstone (as for a TX)."""
    store = Branches()
    rules = DecisionRules(0, store)
    gtxid = "0000000000000000001-n1"
    assert rules.receive(0.0, XDecide(gtxid, True, "n2")) == [
        WhenDurable(ToNode("n2", XDecided(gtxid, ROLLED_BACK)))]


def test_unsafe_presume_held_abort_rolls_back_what_the_tm_was_told_is_prepared() -> None:
    cluster = Cluster()
    unsafe = Unsafe(presume_held_abort=True)
    cluster.rules = [DecisionRules(p, s, unsafe=unsafe) for p, s in enumerate(cluster.stores)]
    gtxid = prepared_and_held(cluster)
    cluster.rules[0].tick(60.0)
    assert cluster.stores[0].status(gtxid).value == ROLLED_BACK  # decided without the TM


def test_the_all_prepared_record_outlives_the_outcomes_retention_until_decided() -> None:
    """A held transaction's record is kept apart from ``max_records``/``max_age`` (rule (c)
    must hold however long the TM takes, however many transactions commit meanwhile), and
    recorded again ``decided`` once the TM decided, then ages out as any record."""
    broker = Broker("p0")
    outcomes = broker.outcomes
    outcomes.max_records = 3
    sent: list[tuple[str, str]] = []
    outcomes.listeners.append(lambda r: sent.append((r[0], r[2])))
    txs = BrokerTransactions(broker, 0, lambda gtxid, ok: None)
    gtxid = "0000000000000000001-n1"
    txs.hold(gtxid, XID, (0, 1))
    assert sent == [("g1/xa:" + gtxid, HELD)]  # to the group's backups (a ``to``)
    for i in range(10):
        outcomes.record(f"g1/tx-{i}", None, COMMITTED)
    outcomes.prune(now=outcomes.clock() + 30 * 86400.0)
    assert txs.is_held(gtxid) and len(outcomes) == 0  # the others aged out, not it
    assert list(txs.held_xa()) == [(XID, gtxid, (0, 1))]
    assert ("g1/xa:" + gtxid) in {r[0] for r in outcomes.snapshot(1)}  # in a catch-up
    txs.rollback(gtxid)  # the TM's rollback: nothing prepared here, the record decided
    assert not txs.is_held(gtxid) and list(txs.held_xa()) == []
    assert sent[-1] == ("g1/xa:" + gtxid, DECIDED)
    for i in range(10, 15):
        outcomes.record(f"g1/tx-{i}", None, COMMITTED)
    assert outcomes.get("g1/xa:" + gtxid) is None  # aged out with the others


SAFE = Unsafe()


def restored_decided_but_held(gtxid: str, *, unsafe: Unsafe = SAFE) -> tuple[
        DecisionRules, BrokerTransactions, list[tuple[str, str]]]:
    """A decider's new primary that restored a held transaction's decision (its branch's
    ``committed`` record) but not the rewrite ``decided`` of its all-prepared record, which
    the failover cut short: the record is still ``prepared`` (kept apart, in memory)."""
    broker = Broker("p0")
    txs = BrokerTransactions(broker, 0, lambda gtxid, ok: None)
    txs.hold(gtxid, XID, (0, 1))
    broker.outcomes.record(txs.txid(gtxid), None, COMMITTED)
    sent: list[tuple[str, str]] = []
    broker.outcomes.listeners.append(lambda r: sent.append((r[0], r[2])))
    return DecisionRules(0, txs, unsafe=unsafe), txs, sent


def test_reading_the_held_records_changes_nothing() -> None:
    """``held_xa`` (``ctl status``) and ``XRecover`` leave it out and write nothing."""
    gtxid = "0000000000000000001-n1"
    rules, txs, sent = restored_decided_but_held(gtxid)
    assert list(txs.held_xa()) == []
    assert rules.receive(0.0, XRecover("n2", 1)) == [WhenDurable(ToNode("n2", XHeld(1, 0, [])))]
    assert txs.is_held(gtxid) and sent == []


def test_a_decided_record_a_failover_left_held_is_rewritten_by_the_rules_tick() -> None:
    """Bounded memory without a ``recover``: the rules' tick (every ``hold_retry``) records
    it ``decided`` (replicated: the backups drop it too), and a participant asking again
    (``XOutcome``) does at once."""
    gtxid, other = "0000000000000000001-n1", "0000000000000000002-n1"
    rules, txs, sent = restored_decided_but_held(gtxid)
    assert rules.tick(100.0) == []
    assert not txs.is_held(gtxid) and sent == [("g1/xa:" + gtxid, DECIDED)]
    txs.hold(other, XID, (0, 1))
    txs.broker.outcomes.record(txs.txid(other), None, ROLLED_BACK)
    assert rules.tick(101.0) == [] and txs.is_held(other)  # the next sweep: hold_retry on
    assert rules.receive(101.0, XOutcome(other, 1)) == [
        WhenDurable(ToPartition(1, XOutcomeReply(other, ROLLED_BACK)))]
    assert not txs.is_held(other) and sent[-1] == ("g1/xa:" + other, DECIDED)


def test_unsafe_keep_decided_holds_keeps_it_for_good() -> None:
    gtxid = "0000000000000000001-n1"
    rules, txs, sent = restored_decided_but_held(gtxid, unsafe=Unsafe(keep_decided_holds=True))
    for now in (0.0, 100.0, 1000.0):
        rules.tick(now)
    rules.receive(1000.0, XOutcome(gtxid, 1))
    assert txs.is_held(gtxid) and sent == []
