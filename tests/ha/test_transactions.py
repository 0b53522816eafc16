"""Transactional HA in one process: tx-queues, votes, the skip set, TxTrackers, atomicity."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from brokerha.backup.backup import Backup
from brokerha.broker.broker import Broker
from brokerha.broker.dtx import XA, Xid
from brokerha.broker.transaction import Transaction
from brokerha.cluster import replication as R
from brokerha.cluster.replication import Events
from brokerha.ha.simulation.transactions import contents
from brokerha.primary import tx_observer
from tests.ha.harness import Cluster, publish, route, settle, wire

PRIMARY = "n1"
XID = Xid(1, b"gtrid-1", b"b1")


def world(c: Cluster, *queues: str) -> None:
    vh = c.broker.vhosts["/"]
    for name in queues or ("q1", "q2", "q3"):
        vh.declare_queue(name, owner=None, durable=True)
    vh.declare_exchange("fan", "fanout", durable=True)
    vh.bind("fan", vh.queues[(queues or ("q1",))[0]], "")
    if len(queues or "xx") > 1:
        vh.bind("fan", vh.queues[(queues or ("q1", "q2"))[1]], "")


def joined(members: int, *backups: str, old: Sequence[bytes] = ()) -> Cluster:
    """A cluster with ``world`` declared, ``old`` messages on q3, and ``backups`` caught up."""
    c = Cluster(members)
    world(c)
    for body in old:
        publish(c.broker, body, rk="q3", persistent=True)
    for name in backups:
        c.follow(name)
    c.pump()
    return c


def same(c: Cluster, *names: str) -> None:
    expected = contents(c.broker)
    for name in names or [n for n in c.nodes if n != c.primary.me]:
        assert contents(c.node(name).broker) == expected, name


def bodies(broker: Broker, queue: str) -> list[bytes]:
    return [e.message.body for e in broker.vhosts["/"].queues[queue].ready]


def tx_work(c: Cluster, tag: str, n: int = 3, take: int = 0) -> Transaction:
    """A TX publishing ``n`` messages to the fanout (q1 and q2) and accepting ``take`` of q3."""
    tx = c.broker.new_transaction()
    for i in range(n):
        queues, msg = route(c.broker, b"%s-%d" % (tag.encode(), i), rk="", exchange="fan",
                            persistent=True)
        tx.publish(queues, msg)
    q3 = c.broker.vhosts["/"].queues["q3"]
    held = [q3.get() for _ in range(take)]
    tx.accept([(q3, e) for e in held if e is not None], [])
    return tx


def whole_or_absent(tags: list[str], n: int) -> Any:
    """A checker: on every queue, each transaction's messages are all there or none."""

    def check(backup: Backup) -> None:
        for queue in ("q1", "q2"):
            vh = backup.broker.vhosts.get("/")
            q = vh.queues.get(queue) if vh else None
            if q is None:
                continue
            held = {e.message.body for e in q.ready}
            for tag in tags:
                mine = {b"%s-%d" % (tag.encode(), i) for i in range(n)}
                assert held & mine in (set(), mine), (backup.me, queue, tag, sorted(held & mine))

    return check


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- commit, atomicity and the skip set --------------------------------------------------------

def test_a_committed_tx_reaches_every_backup_whole_at_every_seq_boundary() -> None:
    async def scenario() -> None:
        c = Cluster(3)
        world(c)
        for i in range(4):
            publish(c.broker, b"old%d" % i, rk="q3", persistent=True)
        c.follow("n2")
        c.follow("n3")
        c.pump()
        c.check = whole_or_absent(["a", "b"], 3)
        await settle(c, tx_work(c, "a", take=2).commit())
        await settle(c, tx_work(c, "b", take=1).commit())
        same(c)
        assert bodies(c.node("n2").broker, "q1") == [b"a-0", b"a-1", b"a-2", b"b-0", b"b-1",
                                                     b"b-2"]
        assert bodies(c.node("n3").broker, "q3") == [b"old3"]
        assert c.primary.tx_queues == {}  # gone once the outcome was sent

    run(scenario())


def sent_events(c: Cluster) -> list[Any]:
    """Every event the primary sends from now on, in order (its outbox spied on)."""
    sent: list[Any] = []
    take = c.primary.take_outbox

    def spy(node: str, hold_lazy: bool = False) -> list[Any]:
        packets = take(node, hold_lazy)
        sent.extend(e for p in packets for e in p.events)
        return packets

    c.primary.take_outbox = spy  # type: ignore[method-assign]
    return sent


def test_a_backup_receives_each_tx_message_body_once() -> None:
    async def scenario() -> None:
        c = joined(2, "n2")
        sent = sent_events(c)
        await settle(c, tx_work(c, "a", n=5).commit())
        kinds = [e[0] for e in sent]
        # no tp (a TX has no vote round), no e events (the skip set)
        assert kinds == ["tb"] + ["te"] * 5 + ["tc"]
        commit = sent[-1]
        # references, not bodies: per queue one run of the five te events
        assert [(op[0], op[2], op[4], op[5]) for op in commit[3]] == [
            (R.OP_REFS, "q1", 0, 5), (R.OP_REFS, "q2", 0, 5)]
        body_bytes = sum(len(e[7]) for e in sent if e[0] == "te")
        assert body_bytes == sum(len(b"a-%d" % i) for i in range(5))
        same(c)

    run(scenario())


def test_a_large_tx_sends_what_exceeds_the_tcs_room_ahead_as_te_events(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tc is one event, so one packet: a TX of any size must still fit the limit."""
    monkeypatch.setattr(tx_observer, "TC_CONTENT_BYTES", 5000)

    async def scenario() -> None:
        c = joined(2, "n2")
        sent = sent_events(c)
        tx = c.broker.new_transaction()
        for i in range(8):
            queues, msg = route(c.broker, b"%d" % i + b"x" * 1500, rk="q3", persistent=True)
            tx.publish(queues, msg)
        c.pump()
        # past the room, the rest went as te events as it was published (issue 33: all
        # at the commit, a TX of 100,000 messages stalled the primary's loop 0.64 s)
        assert [e[0] for e in sent] == ["tb"] + ["te"] * 5
        await settle(c, tx.commit())
        assert [e[0] for e in sent] == ["tb"] + ["te"] * 5 + ["tc"]
        ops = sent[-1][3]
        # 3 fit in 5000; the other 5 are one run of te references
        assert [op[0] for op in ops] == [R.ENQUEUED] * 3 + [R.OP_REFS]
        assert list(ops[-1][3:]) == [ops[2][3] + 1, 0, 5]  # the next positions, te events 0.., five
        assert sum(len(op[7]) for op in ops if op[0] == R.ENQUEUED) <= 5000
        same(c)
        assert [b[:1] for b in bodies(c.node("n2").broker, "q3")] == [b"%d" % i for i in range(8)]

    run(scenario())


def test_a_large_tx_rolled_back_after_its_te_events_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tx_observer, "TC_CONTENT_BYTES", 1000)
    c = joined(2, "n2")
    tx = c.broker.new_transaction()
    for i in range(6):  # a fanout: each te lists both queues
        queues, msg = route(c.broker, b"%d" % i + b"x" * 500, rk="", exchange="fan",
                            persistent=True)
        tx.publish(queues, msg)
    c.pump()
    buffer = c.node("n2").backup.transactions.buffers  # type: ignore[union-attr]
    # the first fits the 1000 bytes of the tc; the other five went as te events
    assert [len(b.messages) for b in buffer.values()] == [5]
    tx.rollback()
    c.pump()
    assert c.node("n2").backup.transactions.buffers == {}  # type: ignore[union-attr]
    assert bodies(c.node("n2").broker, "q1") == bodies(c.node("n2").broker, "q2") == []
    same(c)


def test_tx_rollback_leaves_nothing_on_any_backup() -> None:
    async def scenario() -> None:
        c = joined(2, "n2", old=[b"old"])
        tx = tx_work(c, "a", take=1)
        c.pump()
        # the accept went ahead as a td (the backup checks it at the commit), opening it
        assert c.node("n2").backup.transactions.buffers  # type: ignore[union-attr]
        tx.rollback()
        c.pump()
        assert c.node("n2").backup.transactions.buffers == {}  # type: ignore[union-attr]
        assert bodies(c.node("n2").broker, "q1") == bodies(c.node("n2").broker, "q2") == []
        assert bodies(c.node("n2").broker, "q3") == [b"old"]  # still the client's (unacked)

    run(scenario())


def test_a_tx_sends_nothing_before_its_commit_and_then_its_messages_inside_the_tc() -> None:
    """A TX has no vote round: its publishes travel in its tc, right after its tb."""
    async def scenario() -> None:
        c = joined(2, "n2")
        sent = sent_events(c)
        tx = c.broker.new_transaction()
        for i in range(3):
            queues, msg = route(c.broker, b"one-%d" % i, rk="q3", persistent=True)
            tx.publish(queues, msg)
        c.pump()
        assert sent == [] and c.node("n2").backup.transactions.buffers == {}  # type: ignore[union-attr]
        rolled = c.broker.new_transaction()
        queues, msg = route(c.broker, b"never", rk="q3", persistent=True)
        rolled.publish(queues, msg)
        rolled.rollback()  # nothing was sent for it: nothing to send now
        await settle(c, tx.commit())
        assert [e[0] for e in sent] == ["tb", "tc"]
        commit = sent[-1]
        assert [op[0] for op in commit[3]] == [R.ENQUEUED] * 3  # the content, once each
        assert [op[7] for op in commit[3]] == [b"one-0", b"one-1", b"one-2"]
        same(c)
        assert bodies(c.node("n2").broker, "q3") == [b"one-0", b"one-1", b"one-2"]

    run(scenario())


# -- the commit round trip -------------------------------------------------------------------

def nothing_anywhere(c: Cluster) -> None:
    for node in c.nodes.values():
        assert bodies(node.broker, "q1") == [], node.name
        assert bodies(node.broker, "q2") == [], node.name


def test_a_tx_commit_makes_one_backup_round_trip_and_waits_for_every_guarded_backup() -> None:
    """No vote round for a TX: the commit applies at once, commit-ok waits for the tc's acks.

    A silent backup delays the answer (like a confirm) until ``backup_timeout``
    takes it out of the guarded set; the transaction is not aborted.
    """
    async def scenario() -> None:
        c = joined(3, "n2", "n3")
        c.no_ack.add("n3")
        await settle(c, tx_work(c, "a").commit())
        answered: list[int] = []
        c.broker.after_durable(lambda: answered.append(1))
        c.pump()
        assert answered == []  # n2 acknowledged the tc, n3 (guarded) did not
        assert bodies(c.node("n2").broker, "q1") == [b"a-0", b"a-1", b"a-2"]
        c.clock.now += c.primary.backup_timeout + 0.1
        c.primary.tick(c.clock.now)
        assert answered == [1]  # the primary and n2: a majority of three
        c.no_ack.clear()
        c.pump()
        same(c)

    run(scenario())


def test_a_backup_that_cannot_apply_a_tx_commit_joins_again_and_ends_equal() -> None:
    async def scenario() -> None:
        c = Cluster(3)
        world(c)
        publish(c.broker, b"old", rk="q3", persistent=True)
        c.follow("n2")
        n3 = c.follow("n3")
        c.pump()
        tx = tx_work(c, "a", take=1)
        c.pump()
        q3 = c.node("n3").broker.vhosts["/"].queues["q3"]
        q3.settle(q3.get())  # n3 lost the message the transaction consumes
        c.silent.add("n3")
        await settle(c, tx.commit())
        with pytest.raises(R.ReplicationError, match="lacks positions"):
            for packet in c.primary.take_outbox("n3"):
                n3.receive(wire(packet))  # type: ignore[arg-type]
        c.silent.clear()
        c.follow("n3", position=n3.position)  # the node joins again (node/ha.py)
        c.pump()
        same(c)
        assert bodies(c.node("n3").broker, "q1") == [b"a-0", b"a-1", b"a-2"]

    run(scenario())


# -- XA branches: the vote round -----------------------------------------------------------

def dtx_work(c: Cluster, xid: Xid, take: int = 0) -> None:
    """An XA branch publishing three messages to the fanout and accepting ``take`` of q3."""
    dtx = c.broker.dtx
    branch = dtx.start(xid, "channel")
    for i in range(3):
        queues, msg = route(c.broker, b"a-%d" % i, rk="", exchange="fan", persistent=True)
        branch.publish(queues, msg)
    q3 = c.broker.vhosts["/"].queues["q3"]
    held = [q3.get() for _ in range(take)]
    branch.accept([(q3, e) for e in held if e is not None], [])
    dtx.end(xid, "channel")


def test_a_backup_that_cannot_prepare_votes_no_and_nothing_is_applied() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", "n3", old=[b"old"])
        dtx_work(c, XID, take=1)
        c.pump()
        q3 = c.node("n3").broker.vhosts["/"].queues["q3"]
        q3.settle(q3.get())  # n3 lost the message the branch consumes
        assert await settle(c, c.broker.dtx.prepare(XID)) == XA.RBROLLBACK
        c.pump()
        nothing_anywhere(c)
        assert bodies(c.broker, "q3") == [b"old"]
        assert c.primary.tx_queues == {}
        assert c.node("n2").broker.ha_transactions == {}

    run(scenario())


def test_a_backup_lost_during_the_prepare_rolls_the_branch_back() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", "n3")
        dtx_work(c, XID)
        c.silent.add("n3")
        task = asyncio.ensure_future(c.broker.dtx.prepare(XID))
        for _ in range(5):
            await asyncio.sleep(0)
            c.pump()
        assert not task.done()  # n2 voted yes, n3 has not
        c.primary.backup_lost("n3", "link down")
        assert await task == XA.RBROLLBACK
        c.pump()
        nothing_anywhere(c)
        assert c.node("n2").broker.ha_transactions == {}  # n2 prepared, then rolled back

    run(scenario())


def test_a_prepare_without_every_vote_times_out() -> None:
    async def scenario() -> None:
        c = joined(2, "n2")
        c.no_ack.add("n2")
        dtx_work(c, XID)
        task = asyncio.ensure_future(c.broker.dtx.prepare(XID))
        for _ in range(5):
            await asyncio.sleep(0)
            c.pump()
        assert not task.done()
        c.clock.now += c.primary.tx_prepare_timeout + 0.1
        c.primary.tick(c.clock.now)
        assert await task == XA.RBROLLBACK
        c.pump()
        nothing_anywhere(c)

    run(scenario())


def test_a_backup_that_joins_while_a_tx_is_open_is_in_it() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", old=[b"old"])
        tx = tx_work(c, "a", take=1)  # its accept (a td) opens the tx-queue before the commit
        c.pump()
        c.follow("n3")  # the tx-queue is open: n3 receives it and is in the transaction
        c.pump()
        txq = next(iter(c.primary.tx_queues.values()))
        assert set(txq.members) == {"n2", "n3"}
        c.check = whole_or_absent(["a"], 3)
        await settle(c, tx.commit())
        same(c)
        assert c.primary.ready_backups() == ["n2", "n3"]

    run(scenario())


# -- DTX and TxTrackers ----------------------------------------------------------------------



async def dtx_prepared(c: Cluster, xid: Xid = XID, tag: str = "x", n: int = 3) -> None:
    dtx = c.broker.dtx
    branch = dtx.start(xid, "channel")
    for i in range(n):
        queues, msg = route(c.broker, b"%s-%d" % (tag.encode(), i), rk="", exchange="fan",
                            persistent=True)
        branch.publish(queues, msg)
    dtx.end(xid, "channel")
    assert await settle(c, dtx.prepare(xid)) == 0


def test_backup_with_partial_tx_is_not_ready() -> None:
    """Seed 002's scenario: a backup joins while a transaction A,B,C is prepared.

    It receives the prepared transaction in its catch-up, but not its effects:
    its TxTrackers keep it from being ready (promotable) until the commit
    reached it; the commit then arrives as one event, so at no seq boundary
    does it hold A,B without C.
    """
    async def scenario() -> None:
        c = joined(3, "n2")
        await dtx_prepared(c, tag="abc")
        c.follow("n3")  # expected backup: guarded, joins after the prepare
        c.pump()
        n3 = c.primary.sessions["n3"]
        assert n3.caught_up and n3.holds_copy
        assert not n3.ready and c.primary.ready_backups() == ["n2"]
        assert {t.queue: t.enqueues for t in n3.tx_trackers} == {"q1": 3, "q2": 3}
        assert "n3" not in next(iter(c.primary.tx_queues.values())).members
        c.check = whole_or_absent(["abc"], 3)
        await settle(c, c.broker.dtx.commit(XID))
        assert n3.ready and c.primary.ready_backups() == ["n2", "n3"]
        same(c)

    run(scenario())


def test_trackers_of_several_transactions_on_several_queues_clear_one_by_one() -> None:
    async def scenario() -> None:
        c = joined(4, "n2")
        x1, x2 = Xid(1, b"one"), Xid(1, b"two")
        await dtx_prepared(c, x1, tag="one")
        await dtx_prepared(c, x2, tag="two", n=2)
        c.follow("n3")
        c.follow("n4")
        c.pump()
        for name in ("n3", "n4"):
            trackers = c.primary.sessions[name].tx_trackers
            assert sorted((t.txid, t.queue, t.enqueues) for t in trackers) == [
                (f"dtx:{x1.key}", "q1", 3), (f"dtx:{x1.key}", "q2", 3),
                (f"dtx:{x2.key}", "q1", 2), (f"dtx:{x2.key}", "q2", 2)]
        c.check = whole_or_absent(["one", "two"], 3)
        c.silent.add("n4")
        await settle(c, c.broker.dtx.commit(x1))
        assert [t.txid for t in c.primary.sessions["n3"].tx_trackers] == [f"dtx:{x2.key}"] * 2
        assert len(c.primary.sessions["n4"].tx_trackers) == 4  # it acknowledged nothing
        assert c.broker.dtx.rollback(x2) == 0
        c.silent.clear()
        c.pump()
        assert c.primary.ready_backups() == ["n2", "n3", "n4"]
        same(c)

    run(scenario())


# -- a timed-out backup guarded again (its link stalled, then flowed) ------------------------

def time_out(c: Cluster, name: str) -> None:
    """``name`` owes an acknowledgement past backup_timeout: out of the guarded set."""
    c.no_ack.add(name)
    publish(c.broker, b"owed", rk="q3", persistent=True)
    c.pump()
    c.clock.now += c.primary.backup_timeout + 0.1
    c.primary.tick(c.clock.now)
    assert c.primary.sessions[name].timed_out


def flows_again(c: Cluster, name: str) -> None:
    c.no_ack.discard(name)
    publish(c.broker, b"again", rk="q3", persistent=True)
    c.pump()


def test_guarded_again_a_backup_is_blocked_by_a_branch_prepared_without_its_vote() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", "n3")
        time_out(c, "n3")
        await dtx_prepared(c, tag="abc")  # n2 alone votes: n3 is out
        assert set(next(iter(c.primary.tx_queues.values())).members) == {"n2"}
        flows_again(c, "n3")
        n3 = c.primary.sessions["n3"]
        assert not n3.timed_out and n3.holds_copy and not n3.ready
        assert {t.queue: t.enqueues for t in n3.tx_trackers} == {"q1": 3, "q2": 3}
        c.check = whole_or_absent(["abc"], 3)
        await settle(c, c.broker.dtx.commit(XID))
        assert n3.ready and c.primary.ready_backups() == ["n2", "n3"]
        same(c)

    run(scenario())


def test_guarded_again_a_backup_votes_on_the_branches_still_open() -> None:
    async def scenario() -> None:
        c = joined(3, "n2", "n3")
        time_out(c, "n3")
        dtx_work(c, XID)  # the branch's tx-queue opens while n3 is out
        txq = next(iter(c.primary.tx_queues.values()))
        assert set(txq.members) == {"n2"}
        flows_again(c, "n3")
        assert set(txq.members) == {"n2", "n3"}
        c.no_ack.add("n3")  # its yes is needed now
        task = asyncio.ensure_future(c.broker.dtx.prepare(XID))
        for _ in range(5):
            await asyncio.sleep(0)
            c.pump()
        assert not task.done()
        c.no_ack.discard("n3")
        c.primary.backup_acked("n3", c.node("n3").backup.ack_message().seq)  # type: ignore[union-attr]
        assert await task == 0
        await settle(c, c.broker.dtx.commit(XID))
        assert c.primary.ready_backups() == ["n2", "n3"]
        same(c)

    run(scenario())


def test_guarded_again_only_once_the_outcome_of_a_branch_it_did_not_vote_on_reached_it() -> None:
    """The outcome event ends the tx-queue (no TxTracker to add any more): a backup
    guarded again before acknowledging it would be ready holding the branch only
    prepared."""
    async def scenario() -> None:
        c = joined(3, "n2", "n3")
        time_out(c, "n3")
        await dtx_prepared(c, tag="abc")
        c.silent.update({"n2", "n3"})
        task = asyncio.ensure_future(c.broker.dtx.commit(XID))
        for _ in range(5):
            await asyncio.sleep(0)
        assert c.primary.tx_queues == {}  # the outcome is in the log, not acknowledged
        outcome = c.primary.seq
        c.primary.take_outbox("n3")
        c.primary.backup_acked("n3", outcome - 1)  # ahead of n2: >= replicated()
        assert c.primary.replicated() <= outcome - 1
        assert c.primary.sessions["n3"].timed_out
        c.primary.backup_acked("n3", outcome)
        assert not c.primary.sessions["n3"].timed_out
        c.silent.clear()
        c.pump()
        assert await task == 0

    run(scenario())


def test_a_prepared_dtx_survives_a_restart_of_the_backups_store(tmp_path: Any) -> None:
    from brokerha.store.factory import open_store

    async def scenario() -> None:
        url = f"sqlite:///{tmp_path / 'n2.db'}"
        c = Cluster(2, stores={"n2": open_store(url, tmp_path)})
        world(c)
        c.follow("n2")
        c.pump()
        await dtx_prepared(c)
        c.node("n2").broker.store.close()
        store = open_store(url, tmp_path)
        loaded = store.load()
        assert [txid for txid, _ in loaded.ha_transactions] == [f"dtx:{XID.key}"]
        broker = Broker("n2", store=store)
        broker.restore(loaded)
        assert list(broker.ha_transactions) == [f"dtx:{XID.key}"]
        store.close()

    run(scenario())


def test_the_outcome_of_a_named_tx_is_recorded_on_every_node() -> None:
    async def scenario() -> None:
        c = joined(2, "n2")
        tx = c.broker.new_transaction()
        queues, msg = route(c.broker, b"named", rk="q1", headers={"x-tx-id": "order-17"})
        tx.publish(queues, msg)
        await settle(c, tx.commit())
        assert c.broker.outcomes.outcome("order-17") == "committed"
        assert c.node("n2").broker.outcomes.outcome("order-17") == "committed"
        assert c.broker.outcomes.outcome("never") == "unknown"
        # a backup that joins later gets the outcomes in its catch-up
        c.nodes["n3"] = type(c.node("n2"))("n3", c.clock)
        c.primary.members = 3
        c.follow("n3")
        c.pump()
        assert c.node("n3").broker.outcomes.outcome("order-17") == "committed"

    run(scenario())


def test_events_of_an_older_session_do_not_reach_a_new_tx_buffer() -> None:
    c = Cluster(2)
    world(c)
    backup = c.follow("n2")
    c.pump()
    with pytest.raises(R.ReplicationError):
        backup.receive(wire(Events(1, backup.applied_seq + 1,
                                   [[R.TX_COMMIT, "tx-unknown", None, []]])))  # type: ignore[arg-type]


def test_a_backup_that_timed_out_once_does_not_refuse_every_later_transaction() -> None:
    """Found by the simulation (then tests/ha/tx_simulation.py, now brokerha/ha/simulation/transactions.py).

    A backup silent past ``backup_timeout`` leaves the guarded set and votes no
    on the transactions it is in; its session stays timed out while its link
    is up. It must not be in the transactions that begin after that: before
    the fix every later ``tx.commit`` failed with 406 until its link dropped.
    """
    async def scenario() -> None:
        c = joined(3, "n2", "n3")
        c.no_ack.add("n3")
        publish(c.broker, b"unacked", rk="q3", persistent=True)
        c.pump()
        c.clock.now += c.primary.backup_timeout + 0.1
        c.primary.tick(c.clock.now)
        assert c.primary.sessions["n3"].timed_out
        c.no_ack.clear()
        c.pump()
        await settle(c, tx_work(c, "after").commit())
        assert bodies(c.broker, "q1") == [b"after-0", b"after-1", b"after-2"]
        same(c)

    run(scenario())
