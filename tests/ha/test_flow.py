"""Publishers are held while a backup holding a copy lags (issue 33).

Publishers without confirms outran the backups: the replication link filled
up, the heartbeats queued behind it arrived after the lease, and the primary
stepped down in the middle of a publish burst. The primary now holds
publishers (``broker/flow.py``: their sockets are not read, nothing is sent
to them) while a backup holding a copy has not acknowledged live events for
``flow_lag``, and releases them at half of it.
"""

from __future__ import annotations

from brokerha.amqp.connection import ServerConnection
from brokerha.primary.primary import FLOW
from tests.ha.harness import Cluster, publish


def lagging_cluster() -> tuple[Cluster, list[bool]]:
    c = Cluster(3)
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    for name in ("n2", "n3"):
        c.follow(name)
    c.pump()
    changes: list[bool] = []
    c.broker.flow.listeners.append(changes.append)
    return c, changes


def n2_lags(c: Cluster) -> None:
    """n2 receives a publish and acknowledges nothing from now on."""
    c.no_ack.add("n2")
    publish(c.broker, b"a")
    c.pump()


def later(c: Cluster, seconds: float) -> None:
    c.clock.now += seconds
    c.primary.tick(c.clock.now)


def test_a_backup_that_lags_holds_publishers_until_it_acknowledges() -> None:
    c, changes = lagging_cluster()
    backup = c.nodes["n2"].backup
    assert backup is not None
    n2_lags(c)
    later(c, 0.05)
    assert changes == []  # within flow_lag
    later(c, 0.06)
    assert changes == [True] and FLOW in c.broker.flow.holds
    assert c.primary.status()["publishers_held"]
    c.primary.backup_acked("n2", backup.applied_seq)
    assert changes == [True, False] and not c.broker.flow.held


def test_a_backup_that_times_out_releases_publishers() -> None:
    """A backup no longer guarded does not hold anybody: the majority decides alone."""
    c, changes = lagging_cluster()
    n2_lags(c)
    later(c, 0.2)
    assert changes == [True]
    later(c, c.primary.backup_timeout)
    assert c.primary.sessions["n2"].timed_out and changes == [True, False]


def test_a_primary_that_closes_releases_publishers() -> None:
    c, changes = lagging_cluster()
    n2_lags(c)
    later(c, 0.2)
    c.primary.close()
    assert changes == [True, False]


def test_no_flow_lag_never_holds() -> None:
    c, changes = lagging_cluster()
    c.primary.flow_lag = None
    n2_lags(c)
    later(c, 1.0)
    assert changes == []


def test_a_held_connection_that_published_is_not_read_and_is_not_told() -> None:
    c, _ = lagging_cluster()
    paused: list[bool] = []
    conn = ServerConnection(c.broker, peer=("127.0.0.1", 1))
    conn.on_read_paused = paused.append
    conn.has_published = True
    c.broker.flow.listeners.append(conn._flow)  # as connection.open does
    c.broker.flow.hold(FLOW, "test")
    assert paused == [True] and conn._out == []  # no connection.blocked: not told
    c.broker.set_alarm("memory", "test")
    c.broker.set_alarm("memory", None)  # the alarm clears: still held by the flow
    assert paused == [True]
    c.broker.flow.release(FLOW)
    assert paused == [True, False]


def test_a_purge_goes_as_bounded_dequeue_events() -> None:
    """Dequeues join into one event per queue up to ``DEQUEUES_PER_EVENT`` positions."""
    from brokerha.cluster import replication as R
    from brokerha.primary.events import DEQUEUES_PER_EVENT
    from tests.ha.harness import consume
    from tests.ha.test_replication import same

    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    c.follow("n2")
    n = 2 * DEQUEUES_PER_EVENT + 10
    for i in range(n):
        publish(c.broker, b"%d" % i)
    c.pump()
    assert len(consume(c.broker.vhosts["/"].queues["q"])) == n
    packets = c.primary.take_outbox("n2")
    sizes = [len(e.positions) for p in packets for e in p.events if e.kind == R.DEQUEUED]
    assert sum(sizes) == n and max(sizes) == DEQUEUES_PER_EVENT and len(sizes) == 3
    for packet in packets:
        c.nodes["n2"].backup.receive(packet)  # type: ignore[union-attr]
    c.pump()
    same(c)
