"""XA (``amq.dtx``) across partitions on three real nodes (issue 35, docs/ha.md "XA over
partitions").

P = 3 over 3 nodes, one partition led by each (``test_partition_transactions.setup``). A
pika client on A drives XA branches (``PikaXAResource``) publishing to B's and C's
queues: prepared then committed, both queues hold the message; rolled back, neither; a
one-phase commit is a TX across partitions; a branch on A's own partition stays today's
local XA. A SIGKILLed right after ``prepare`` answered XA_OK: from B, ``recover`` lists
the xid (after the resolve timeout: rule (c) kept it in doubt) and ``commit`` commits it
on both queues.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pika.exceptions
import pytest

from brokerha.client.dtx import XA_OK, PikaXAResource
from brokerha.client.dtx.resources import XAException, Xid
from brokerha.testing import LocalCluster
from tests.failover.groups import OPTIONS, connect, drain_ids, one_leader_each, props, until
from tests.failover.test_partition_transactions import settled, setup, to_kill, transactions

pytestmark = pytest.mark.timeout(120)


def new_xid() -> Xid:
    return Xid(1, uuid.uuid4().bytes, b"\x01")


def xa_leftovers(cluster: LocalCluster, node: str) -> int:
    """Branches the node's coordinator still has under way."""
    return len(transactions(cluster, node)["commits"])


def xa_on(cluster: LocalCluster, node: str,
          timeout: float = 20.0) -> tuple[Any, Any, PikaXAResource]:
    """A connection to ``node``, a channel of it and an XA resource on the channel."""
    conn = connect(cluster, node)
    ch = conn.channel()
    return conn, ch, PikaXAResource(ch, timeout=timeout)


def branch(xa: PikaXAResource, ch: object, xid: Xid, queues: list[str], i: int) -> None:
    """One message ``i`` to each of ``queues`` in branch ``xid``, ended."""
    xa.start(xid)
    for queue in queues:
        ch.basic_publish("", queue, b"x", props(i))  # type: ignore[attr-defined]
    xa.end(xid)


def test_xa_branches_across_partitions_commit_and_roll_back_whole() -> None:
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a, b, c = layout.a, layout.b, layout.c
        conn, ch, xa = xa_on(cluster, a)
        started = time.monotonic()
        committed, rolled_back, one_phase = new_xid(), new_xid(), new_xid()
        branch(xa, ch, committed, [queues[b], queues[c]], 1)
        assert xa.prepare(committed) == XA_OK
        assert xa.recover() == [committed]  # in doubt: the partitions' leaders list it
        xa.commit(committed)
        branch(xa, ch, rolled_back, [queues[b], queues[c]], 2)
        assert xa.prepare(rolled_back) == XA_OK
        xa.rollback(rolled_back)
        branch(xa, ch, one_phase, [queues[b], queues[c]], 3)
        xa.commit(one_phase, one_phase=True)  # a TX across partitions
        single = new_xid()
        branch(xa, ch, single, [queues[b]], 6)  # one partition led elsewhere: its decider alone
        assert xa.prepare(single) == XA_OK
        xa.commit(single)
        local = new_xid()
        branch(xa, ch, local, [queues[a]], 4)  # A's own partition: today's local XA
        assert xa.prepare(local) == XA_OK
        xa.commit(local)
        took = time.monotonic() - started
        assert xa.recover() == []
        with pytest.raises(XAException) as unknown:
            xa.commit(rolled_back)  # finished: no partition holds it
        assert unknown.value.status == "XAER_NOTA"
        status = transactions(cluster, a)
        conn.close()
        assert drain_ids(cluster, b, queues[b]) == ["1", "3", "6"]
        assert drain_ids(cluster, c, queues[c]) == ["1", "3"]
        assert drain_ids(cluster, a, queues[a]) == ["4"]
        assert status["xa_prepared"] == 3 and status["xa_finished"] == 3, status
        assert status["committed"] == 1 and status["refused"] == 0, status  # the one-phase
        # an xid reused (issue 35 task H): prepared through A, committed through B, prepared
        # again through B, rolled back through A within XA_KNOWN_FOR -- A's entry for the
        # first transaction must not finish it (its decider would answer "committed"): the
        # second is found through the partitions and rolled back
        conn, ch, xa = xa_on(cluster, a)
        on_b, bch, tm = xa_on(cluster, b)
        reused = new_xid()
        branch(xa, ch, reused, [queues[b], queues[c]], 7)
        assert xa.prepare(reused) == XA_OK
        tm.commit(reused)
        branch(tm, bch, reused, [queues[b], queues[c]], 8)
        assert tm.prepare(reused) == XA_OK
        xa.rollback(reused)
        assert xa.recover() == []  # nothing left prepared: the second one was rolled back
        stale = transactions(cluster, a)["xa_known_stale"]
        on_b.close()
        conn.close()
        assert drain_ids(cluster, b, queues[b]) == ["7"]
        assert drain_ids(cluster, c, queues[c]) == ["7"]
        assert stale == 1
        # what a transaction across partitions cannot take is refused whole (540), as a TX
        refused = connect(cluster, a)
        rch = refused.channel()
        mine = rch.queue_declare("", exclusive=True).method.queue
        rxa = PikaXAResource(rch, timeout=20.0)
        bad = new_xid()
        branch(rxa, rch, bad, [mine, queues[b]], 5)
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            rxa.prepare(bad)
        assert closed.value.reply_code == 540 and "exclusive queue" in closed.value.reply_text
        assert xa_leftovers(cluster, a) == 0
        until("nothing held prepared", lambda: settled(cluster, [a, b, c]))
        print(f"5 XA branches (2 across partitions prepared, 1 one-phase, 1 of one partition "
              "led elsewhere, 1 local) in "
              f"{took:.2f}s; coordinator {status}")


def test_the_client_s_node_killed_after_prepare_the_tm_commits_from_another_node() -> None:
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a, b, c = layout.a, layout.b, layout.c
        conn, ch, xa = xa_on(cluster, a)
        xid = new_xid()
        branch(xa, ch, xid, [queues[b], queues[c]], 7)
        assert xa.prepare(xid) == XA_OK
        cluster.kill(a)
        killed = time.monotonic()
        other, och, tm = xa_on(cluster, b)

        def listed() -> list[Xid] | None:
            try:
                return tm.recover()
            except XAException as exc:  # A's partition without a leader yet: XAER_RMFAIL
                assert exc.status == "XAER_RMFAIL", exc
                return None

        found = until("recover answers from every partition", listed, timeout=30.0)
        waited = time.monotonic() - killed
        assert found == [xid]
        held = {n: transactions(cluster, n)["xa_held"] for n in (b, c)}
        assert sum(sum(h.values()) for h in held.values()) == 1, held  # at its decider
        time.sleep(max(0.0, 2.5 - waited))  # past the resolve timeout (2 s)
        assert tm.recover() == [xid]  # rule (c): still in doubt, not rolled back
        tm.commit(xid)
        other.close()
        assert drain_ids(cluster, b, queues[b]) == ["7"]
        assert drain_ids(cluster, c, queues[c]) == ["7"]
        until("nothing held prepared", lambda: settled(cluster, [b, c]))
        print(f"A killed after XA_OK; B's recover listed the xid {waited:.1f}s later; "
              "committed on both queues")


@pytest.mark.parametrize("killed", ["decider", pytest.param("other", marks=pytest.mark.slow)])
def test_a_participant_s_leader_killed_after_prepare_the_commit_still_commits_both(
        killed: str) -> None:
    """The decision partition's leader (``other``: the other participant's) SIGKILLed
    after XA_OK: its new leader holds the branch prepared and the all-prepared record
    (a ``to`` on its backups), past the resolve timeout too; A's commit then commits
    both queues; a second branch rolled back after the failover is on neither."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a = layout.a
        b, c, group = to_kill(layout, killed)
        conn, ch, xa = xa_on(cluster, a, timeout=30.0)
        kept, dropped = new_xid(), new_xid()
        branch(xa, ch, kept, [queues[b], queues[c]], 1)
        assert xa.prepare(kept) == XA_OK
        branch(xa, ch, dropped, [queues[b], queues[c]], 2)
        assert xa.prepare(dropped) == XA_OK
        cluster.kill(b)
        killed_at = time.monotonic()
        new = until("B's partition elects among the survivors",
                    lambda: (one_leader_each(cluster, [a, c]) or {}).get(group), 30)
        time.sleep(max(0.0, 2.5 - (time.monotonic() - killed_at)))  # past resolve_timeout
        assert sorted(xa.recover(), key=lambda x: x.gtrid) == sorted(
            [kept, dropped], key=lambda x: x.gtrid)  # rule (c) on the new leader too
        xa.commit(kept)
        xa.rollback(dropped)
        took = time.monotonic() - killed_at
        conn.close()
        assert drain_ids(cluster, new, queues[b]) == ["1"]
        assert drain_ids(cluster, c, queues[c]) == ["1"]
        until("nothing held prepared", lambda: settled(cluster, [a, c]))
        print(f"{b} ({killed}) killed after XA_OK; new leader {new}; committed and rolled "
              f"back {took:.1f}s after the kill")


def test_a_remote_get_s_ack_in_an_xa_branch_is_settled_by_the_tm_s_decision() -> None:
    """A's client gets a message of B's queue (a remote get) and one of A's own queue,
    acknowledges both in an XA branch that publishes to C's queue: after prepare and
    commit they are gone and the publish is on C; a second such branch, rolled back
    after prepare, leaves both messages back on their queues."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a, b, c = layout.a, layout.b, layout.c
        feed = connect(cluster, b)
        for i in (1, 2):
            feed.channel().basic_publish("", queues[b], b"in", props(i))
        feed.close()
        conn = connect(cluster, a)
        ch = conn.channel()
        for i in (21, 22):
            ch.basic_publish("", queues[a], b"own", props(i))
        xa = PikaXAResource(ch, timeout=20.0)
        done: list[Xid] = []
        for commit in (True, False):
            xid = new_xid()
            xa.start(xid)
            for queue in (queues[b], queues[a]):  # a remote get's, and one served here
                method, _, _ = ch.basic_get(queue)
                assert method is not None
                ch.basic_ack(method.delivery_tag)
            ch.basic_publish("", queues[c], b"out", props(10 + len(done)))
            xa.end(xid)
            assert xa.prepare(xid) == XA_OK
            if commit:
                xa.commit(xid)
            else:
                xa.rollback(xid)
            done.append(xid)
        conn.close()
        assert drain_ids(cluster, c, queues[c]) == ["10"]
        assert drain_ids(cluster, b, queues[b]) == ["2"]  # 1 settled; 2 back after rollback
        assert drain_ids(cluster, a, queues[a]) == ["22"]
        until("nothing held prepared", lambda: settled(cluster, [a, b, c]))


def test_a_hold_later_than_the_deciders_timeout_makes_the_prepare_roll_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A keeps its XHold back 4 s (``BROKERHA_XTX_HOLD=hold=4``): both branches are
    prepared, nothing is held for the TM yet, so the decider's timeout (2 s) rolls its
    branch back (rule (b)); the late XHold finds it rolled back and ``prepare`` answers
    XA_RBROLLBACK with the reason: on neither queue, nothing left prepared, nothing for
    ``recover``."""
    monkeypatch.setenv("BROKERHA_XTX_HOLD", "hold=4")
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a, b, c = layout.a, layout.b, layout.c
        conn, ch, xa = xa_on(cluster, a)
        xid = new_xid()
        branch(xa, ch, xid, [queues[b], queues[c]], 8)
        with pytest.raises(XAException) as refused:
            xa.prepare(xid)
        assert refused.value.status == "XA_RBROLLBACK"
        assert "rolled it back" in str(refused.value)
        assert xa.recover() == []
        conn.close()
        assert drain_ids(cluster, b, queues[b]) == []
        assert drain_ids(cluster, c, queues[c]) == []
        until("nothing held prepared", lambda: settled(cluster, [a, b, c]))
