"""Transactions (tx.select) across partitions on three real nodes (issue 35 stage 4).

P = 3 over 3 nodes, ``[cluster] partition_groups``, each partition led by one node. A
pika client on A (the metadata primary) commits transactions publishing to a queue of
the partition led by B and to one led by C: A's coordinator (``partition/transactions.py``,
``CrossTx``) prepares a branch on each leader, the lower partition's leader decides,
the other commits; commit-ok once both committed durably. Checked: every transaction
committed is on both queues, one rolled back on neither, one to A's own partition is a
local TX; a message of A's queue acknowledged in a transaction publishing to B's queue
(dequeued by A's branch), and given back when the commit is refused; B SIGKILLed mid-stream: each transaction whole or absent, never on one queue
only; A SIGKILLed between the prepares and the decision (``BROKERHA_XTX_HOLD=decide``)
or between the decision and the other's commit (``commit``): B and C resolve their
branches from the decider's outcome (``XOutcome``): absent on both, or on both; nothing
held prepared afterwards.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pika
import pika.exceptions
import pytest

from brokerha.testing import LocalCluster
from tests.failover.groups import (
    OPTIONS,
    Layout,
    connect,
    drain_ids,
    name_in,
    one_leader_each,
    one_partition_each,
    promote,
    props,
    ready_everywhere,
    until,
)

pytestmark = pytest.mark.timeout(120)


def spread(cluster: LocalCluster) -> Layout:
    """One partition a node: as the start placed the leaders, else handed over
    (``ctl promote --partition``) from a node leading two to a cell leading none."""
    names = cluster.names
    for _ in range(3):
        leaders = until("one serving primary per group", lambda: one_leader_each(cluster, names))
        until("every node ready in every group", lambda: ready_everywhere(cluster, names))
        by_node: dict[str, list[int]] = {}
        for p in range(3):
            by_node.setdefault(leaders[str(p + 1)], []).append(p)
        idle = [n for n in names if n not in by_node]
        if not idle:
            return one_partition_each(cluster)
        groups = (cluster.status(idle[0]) or {})["node"]["groups"]
        moved = next(p for node, ps in by_node.items() if len(ps) > 1 for p in ps
                     if idle[0] in groups[str(p + 1)]["members"])
        hand_over(cluster, leaders[str(moved + 1)], idle[0], moved)
    return one_partition_each(cluster)


def hand_over(cluster: LocalCluster, leader: str, to: str, partition: int) -> None:
    until("the hand-over taken", lambda: promote(cluster, leader, to, partition))
    until("the new leader serves", lambda: (one_leader_each(cluster, cluster.names) or {}).get(
        str(partition + 1)) == to)


def setup(cluster: LocalCluster) -> tuple[Layout, dict[str, str]]:
    """The layout and a queue of each node's partition, declared on its leader."""
    layout = spread(cluster)
    queues = {}
    for node in (layout.a, layout.b, layout.c):
        queue = name_in(layout.partitions[node][0], f"tx-{node}")
        conn = connect(cluster, node)
        try:
            conn.channel().queue_declare(queue, durable=True)
        finally:
            conn.close()
        queues[node] = queue
    return layout, queues


def to_kill(layout: Layout, killed: str) -> tuple[str, str, str]:
    """(B, C, B's group) of B and C, the two nodes leading a partition A does not: B the
    one to kill, the leader of the decision partition (the lower of the two's;
    ``killed`` "other": of the higher)."""
    b, c = layout.b, layout.c
    lower = b if layout.partitions[b][0] < layout.partitions[c][0] else c
    if (killed == "decider") != (lower == b):
        b, c = c, b  # b: the node killed
    return b, c, str(layout.partitions[b][0] + 1)


def transactions(cluster: LocalCluster, node: str) -> dict[str, Any]:
    return dict(((cluster.status(node) or {}).get("node") or {}).get("transactions") or {})


def settled(cluster: LocalCluster, nodes: list[str]) -> bool:
    """No commit under way on any of ``nodes`` and no branch held prepared."""
    for node in nodes:
        status = transactions(cluster, node)
        if not status or status["commits"] or any(status["in_doubt"].values()):
            return False
    return True


def test_commits_across_partitions_are_whole() -> None:
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a, b, c = layout.a, layout.b, layout.c
        conn = connect(cluster, a)
        ch = conn.channel()
        ch.tx_select()
        started = time.monotonic()
        n = 20
        for i in range(n):
            ch.basic_publish("", queues[b], b"b", props(i))
            ch.basic_publish("", queues[c], b"c", props(i))
            if i % 5 == 4:
                ch.tx_rollback()  # discarded: on neither queue
            else:
                ch.tx_commit()
        took = time.monotonic() - started
        ch.basic_publish("", queues[a], b"a", props(1))  # A's own partition: a local TX
        ch.basic_publish("", queues[a], b"a", props(2))
        ch.tx_commit()
        ch.basic_publish("", queues[a], b"a", props(3))  # A's and B's: A's branch in process
        ch.basic_publish("", queues[b], b"b", props(n))
        ch.tx_commit()
        status = transactions(cluster, a)
        conn.close()
        committed = [str(i) for i in range(n) if i % 5 != 4]
        assert drain_ids(cluster, b, queues[b]) == [*committed, str(n)]
        assert drain_ids(cluster, c, queues[c]) == committed
        assert drain_ids(cluster, a, queues[a]) == ["1", "2", "3"]
        assert status["begun"] == status["committed"] == len(committed) + 1, status
        assert status["refused"] == 0, status
        until("nothing held prepared", lambda: settled(cluster, [a, b, c]))
        print(f"{len(committed)} commits across two partitions from {a} in {took:.2f}s "
              f"({took / n * 1000:.0f} ms each with the rollbacks); coordinator {status}")


def test_acknowledging_in_a_transaction_across_partitions() -> None:
    """A message of A's queue got and acknowledged on A in a transaction that publishes
    to B's queue (consume, transform, publish): dequeued by A's branch, enqueued by B's,
    both or neither; the message then redelivered on a channel in tx mode and left
    unacknowledged by a rollback. Messages of B's queue got and consumed on A (a remote
    get's and a remote consumer's: B holds them) acknowledged, rejected and nacked in a
    transaction publishing to C's queue: B's branch settles them at the commit (the ack
    and the reject gone, the nack's requeued, flagged), C's enqueues (issue 35 task F;
    was 540)."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a, b, c = layout.a, layout.b, layout.c
        conn = connect(cluster, a)
        ch = conn.channel()
        for i in (7, 8):
            ch.basic_publish("", queues[a], b"a", props(i))
        ch.tx_select()
        method, _props, _body = ch.basic_get(queues[a])
        assert method is not None
        ch.basic_ack(method.delivery_tag)
        ch.basic_publish("", queues[b], b"b", props(70))
        ch.tx_commit()
        method, _props, _body = ch.basic_get(queues[a])  # 8, acknowledged then rolled back
        assert method is not None
        ch.basic_ack(method.delivery_tag)
        ch.basic_publish("", queues[b], b"b", props(80))
        ch.tx_rollback()
        conn.close()  # 8 requeued with the connection
        assert drain_ids(cluster, b, queues[b]) == ["70"]
        assert drain_ids(cluster, a, queues[a]) == ["8"]
        status = transactions(cluster, a)
        assert status["committed"] == 1 and status["refused"] == 0, status
        conn = connect(cluster, b)
        for i in (9, 10, 11, 12):
            conn.channel().basic_publish("", queues[b], b"b", props(i))
        conn.close()
        conn = connect(cluster, a)
        ch = conn.channel()
        ch.tx_select()
        method, _props, _body = ch.basic_get(queues[b])  # 9: a remote get's, acked
        assert method is not None and method.message_count == 3
        ch.basic_ack(method.delivery_tag)
        ch.basic_qos(prefetch_count=3)
        got: list[tuple[int, str, bool]] = []
        ch.basic_consume(queues[b], lambda _c, m, p, _b: got.append(
            (m.delivery_tag, str(p.message_id), m.redelivered)))
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
        assert [m for _, m, _ in got] == ["10", "11", "12"]
        ch.basic_reject(got[0][0], requeue=False)  # 10: dropped at the commit (no DLX)
        ch.basic_nack(got[1][0], requeue=True)     # 11: requeued at the commit
        ch.basic_ack(got[2][0])                    # 12: acked
        ch.basic_publish("", queues[c], b"c", props(90))
        ch.tx_commit()
        deadline = time.monotonic() + 10  # 11 comes again to the consumer, flagged
        while len(got) < 4 and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
        assert [(m, r) for _, m, r in got[3:]] == [("11", True)]
        status = transactions(cluster, a)
        conn.close()  # 11 requeued with the channel
        assert until("B's queue settled", lambda: drain_ids(cluster, b, queues[b])) == ["11"]
        assert drain_ids(cluster, c, queues[c]) == ["90"]
        assert status["committed"] == 2 and status["refused"] == 0, status
        until("nothing held prepared", lambda: settled(cluster, [a, b, c]))


def test_a_refused_commit_gives_its_acknowledged_messages_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A holds its XDecide past the resolve timeout: the decider rolls its own branch back
    (rule b), the other asks and rolls back, the late decision is refused: the channel is
    closed 406; the message A's branch dequeued is back on A's queue once, and so is the one
    of B's queue A's client got remotely and acknowledged in it (B's host handed it to B's
    branch); B's queue holds nothing else."""
    monkeypatch.setenv("BROKERHA_XTX_HOLD", "decide=4")
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a, b = layout.a, layout.b
        conn = connect(cluster, a)
        ch = conn.channel()
        ch.basic_publish("", queues[a], b"a", props(5))
        ch.basic_publish("", queues[b], b"b", props(6))
        ch.tx_select()
        method, _props, _body = ch.basic_get(queues[a])
        assert method is not None
        ch.basic_ack(method.delivery_tag)
        method = None
        deadline = time.monotonic() + 10  # (the publish forwarded to B first)
        while method is None and time.monotonic() < deadline:
            method, _props, _body = ch.basic_get(queues[b])  # a remote get's, acked
        assert method is not None
        ch.basic_ack(method.delivery_tag)
        ch.basic_publish("", queues[b], b"b", props(50))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
            ch.tx_commit()
        assert closed.value.reply_code == 406, closed.value
        assert "rolled it back" in closed.value.reply_text, closed.value
        conn.close()
        assert drain_ids(cluster, a, queues[a]) == ["5"]
        assert until("B's message back", lambda: drain_ids(cluster, b, queues[b])) == ["6"]
        until("nothing held prepared", lambda: settled(cluster, [a, b, layout.c]))


class Committer(threading.Thread):
    """Commits transactions of one message to each of two queues, one after the other;
    ``committed`` the ids answered commit-ok, ``unknown`` those whose commit got no
    answer (the channel or connection closed), reopening the channel (or the
    connection) after each such close until ``stop``."""

    def __init__(self, cluster: LocalCluster, node: str, queues: tuple[str, str]) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.node = node
        self.queues = queues
        self.committed: list[int] = []
        self.unknown: list[int] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        conn: Any = None
        while not self.stop.is_set():
            try:
                if conn is None or not conn.is_open:
                    conn = connect(self.cluster, self.node)
                ch = conn.channel()
                ch.tx_select()
                while not self.stop.is_set():
                    i += 1
                    for queue in self.queues:
                        ch.basic_publish("", queue, b"x", props(i))
                    ch.tx_commit()
                    self.committed.append(i)
            except pika.exceptions.AMQPError as exc:
                self.unknown.append(i)
                self.errors.append(repr(exc)[:200])
                time.sleep(0.1)
        if conn is not None and conn.is_open:
            conn.close()


@pytest.mark.parametrize("killed", ["decider", pytest.param("other", marks=pytest.mark.slow)])
def test_a_participant_s_leader_killed_mid_stream(killed: str) -> None:
    """The leader of the decision partition (the lower of B's and C's; ``other``: of the
    higher) SIGKILLed while A's client commits transactions over B's and C's partitions:
    every transaction answered commit-ok is on both queues; every other one on both or
    on neither; nothing held prepared once the partition has its new leader."""
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a = layout.a
        b, c, group = to_kill(layout, killed)
        client = Committer(cluster, a, (queues[b], queues[c]))
        client.start()
        until("a few committed", lambda: len(client.committed) >= 20, 30)
        before = len(client.committed)
        cluster.kill(b)
        survivors = [a, c]
        new = until("B's partition elects among the survivors",
                    lambda: (one_leader_each(cluster, survivors) or {}).get(group), 30)
        at_failover = len(client.committed)
        until("commits again after the failover",
              lambda: len(client.committed) >= at_failover + 10, 40)
        client.stop.set()
        client.join(20)
        until("nothing held prepared", lambda: settled(cluster, survivors), 20)
        on_b = drain_ids(cluster, new, queues[b])
        on_c = drain_ids(cluster, c, queues[c])
        assert len(on_b) == len(set(on_b)) and len(on_c) == len(set(on_c)), "twice"
        assert set(on_b) == set(on_c), (f"partial: only on B's queue "
                                        f"{sorted(set(on_b) - set(on_c))}, only on C's "
                                        f"{sorted(set(on_c) - set(on_b))}")
        lost = {str(i) for i in client.committed} - set(on_b)
        assert not lost, f"committed and lost: {sorted(lost)}"
        assert set(on_b) <= {str(i) for i in client.committed + client.unknown}
        print(f"killed {b} ({killed}) after {before} commits; new leader {new}; "
              f"{len(client.committed)} "
              f"committed, {len(client.unknown)} unanswered ({client.errors[:3]}), "
              f"{len(on_b)} on both queues")


@pytest.mark.parametrize("hold", ["decide", "commit"])
def test_the_coordinator_s_node_killed_between_the_rounds(
        hold: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A (the coordinator) holds back its XDecide (``decide``: B and C prepared, nothing
    decided) or its XCommit (``commit``: the decider committed, the other prepared) and is
    SIGKILLed: the participants ask the decider (``XOutcome``, after the resolve timeout);
    the decider writes a tombstone (nothing decided: absent on both queues) or answers
    committed (on both); nothing stays prepared."""
    monkeypatch.setenv("BROKERHA_XTX_HOLD", f"{hold}=60")
    with LocalCluster(3, options=OPTIONS) as cluster:
        layout, queues = setup(cluster)
        a, b, c = layout.a, layout.b, layout.c
        conn = connect(cluster, a)
        ch = conn.channel()
        ch.tx_select()
        ch.basic_publish("", queues[b], b"b", props(1))
        ch.basic_publish("", queues[c], b"c", props(1))
        phase = "deciding" if hold == "decide" else "finishing"
        committing = threading.Thread(target=lambda: _commit_quietly(ch), daemon=True)
        committing.start()
        until(f"A's commit {phase}", lambda: any(
            t["phase"] == phase for t in transactions(cluster, a).get("commits", {}).values()),
            20)
        held = {n: transactions(cluster, n)["in_doubt"] for n in (b, c)}
        cluster.kill(a)
        started = time.monotonic()
        until("B and C resolved their branches", lambda: settled(cluster, [b, c]), 30)
        took = time.monotonic() - started
        on_b = drain_ids(cluster, b, queues[b])
        on_c = drain_ids(cluster, c, queues[c])
        expected = [] if hold == "decide" else ["1"]
        assert on_b == on_c == expected, (on_b, on_c)
        print(f"{hold}: A killed; B and C held {held}; resolved in {took:.1f}s; "
              f"on the queues {on_b} {on_c}")


def _commit_quietly(ch: Any) -> None:
    try:
        ch.tx_commit()
    except Exception:  # the coordinator's node is killed: no answer
        pass
