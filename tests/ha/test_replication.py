"""Replication in one datacenter, primary to backups, named by the property checked."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from brokerha.cluster.protocol import PacketCodec
from brokerha.cluster.replication import Events, ReplicationError, StaleEpoch
from brokerha.cluster.state import NodeState
from brokerha.ha.core import DEQUEUE_SEND_DELAY, HACore, PrimarySettings
from brokerha.ha.simulation.transactions import contents
from tests.ha.harness import Cluster, consume, publish, wire


def declare_world(c: Cluster) -> None:
    vh = c.broker.vhosts["/"]
    vh.declare_exchange("x", "topic", durable=True)
    vh.declare_exchange("h", "headers", arguments={"alternate-exchange": "x"})
    q = vh.declare_queue("q", owner=None, durable=True, arguments={"x-max-priority": 5})
    t = vh.declare_queue("t", owner=None)
    vh.bind("x", q, "a.#")
    # pamqp decodes a client's byte array as a bytearray, and so does the codec
    vh.bind("h", t, "", {"x-match": "any", "k": "v", "b": bytearray(b"\x00raw")})
    vh.bind("x", vh.exchange("h"), "h.*")


def same(c: Cluster, *names: str) -> None:
    expected = contents(c.broker)
    for name in names or [n for n in c.nodes if n != c.primary.me]:
        assert contents(c.node(name).broker) == expected, name


def test_fresh_backup_ends_with_the_primarys_definitions_and_messages() -> None:
    c = Cluster(2)
    declare_world(c)
    q = c.broker.vhosts["/"].queues["q"]
    for i in range(5):
        publish(c.broker, b"m%d" % i, rk="a.b", exchange="x", priority=i % 3)
    publish(c.broker, b"headers", rk="h.1", exchange="x", headers={"k": "v"})
    held = q.get()  # acquired, not acknowledged: still on the queue until acked
    assert held is not None
    c.follow("n2")
    c.pump()
    backup_q = c.node("n2").broker.vhosts["/"].queues["q"]
    assert sorted(e.position for e in backup_q.ready) == sorted(
        [held.position] + [e.position for e in q.ready])
    q.requeue(held)  # back in its place on the primary, where the backup has it already
    same(c)
    assert c.node("n2").backup.caught_up  # type: ignore[union-attr]
    assert c.primary.ready_backups() == ["n2"]


def test_live_publish_and_consume_are_replicated() -> None:
    c = Cluster(2)
    declare_world(c)
    c.follow("n2")
    c.pump()
    q = c.broker.vhosts["/"].queues["q"]
    for i in range(10):
        publish(c.broker, b"live%d" % i, rk="a.x", exchange="x")
    c.pump()
    same(c)
    assert consume(q, 4) == [b"live0", b"live1", b"live2", b"live3"]
    entry = q.get()
    assert entry is not None
    q.requeue(entry)  # back in place: nothing to replicate
    c.pump()
    same(c)
    assert consume(q) == [b"live%d" % i for i in range(4, 10)]
    c.pump()
    same(c)


def test_dequeues_in_one_flush_travel_as_one_event() -> None:
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    c.follow("n2")
    c.pump()
    for i in range(100):
        publish(c.broker, b"%d" % i)
    c.pump()
    before = c.sent_events["n2"]
    c.broker.vhosts["/"].purge_queue("q", None)
    c.pump()
    assert c.sent_events["n2"] - before == 1
    same(c)


def test_backups_up_to_date_share_one_packet_packed_once() -> None:
    """Both backups get the same events: one ``Events``, its args packed once by the link."""
    c = Cluster(3)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    c.follow("n2")
    c.pump()
    c.follow("n3")  # its catch-up is made as it is sent: the live events follow it
    for body in (b"a", b"b"):
        publish(c.broker, body)
    out = c.primary.take_outboxes()
    (to_n2,), to_n3 = out["n2"], out["n3"]
    assert all(p is not to_n2 for p in to_n3[:-1])  # its catch-up: packets of its own
    assert to_n3[-1] is to_n2  # its catch-up was sent whole: then the same live events
    c.nodes["n2"].backup.receive(wire(to_n2))  # type: ignore[union-attr]
    for packet in to_n3:
        c.nodes["n3"].backup.receive(wire(packet))  # type: ignore[union-attr]
    c.pump()
    publish(c.broker, b"c")
    publish(c.broker, b"d")
    out = c.primary.take_outboxes()
    (to_n2,), (to_n3,) = out["n2"], out["n3"]
    assert to_n2 is to_n3  # both up to date: the same packet
    assert c.primary.take_outbox("n2") == []  # taken, and nothing of it kept
    codec = PacketCodec()
    first, again = codec.encode_parts(7, to_n2), codec.encode_parts(8, to_n3)
    assert first[1] is again[1]  # the events packed once; only the heads differ
    decoded = PacketCodec().feed(b"".join(first + again))
    assert [msg_id for msg_id, _ in decoded] == [7, 8]
    assert decoded[0][1] == decoded[1][1] == wire(to_n2)
    for name in ("n2", "n3"):
        c.nodes[name].backup.receive(decoded[0][1])  # type: ignore[union-attr, arg-type]
    c.pump()
    same(c)


def test_returning_backup_drops_ids_only_it_has_and_skips_ids_both_have() -> None:
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    q = c.broker.vhosts["/"].queues["q"]
    for i in range(10):
        publish(c.broker, b"old%d" % i)
    c.follow("n2")
    c.pump()
    c.primary.backup_lost("n2", "link down")
    assert consume(q, 3) == [b"old0", b"old1", b"old2"]
    for i in range(4):
        publish(c.broker, b"new%d" % i)
    c.join("n2")
    before = c.sent_events["n2"]
    c.pump()
    same(c)
    status = c.primary.status()["backups"]["n2"]
    assert {k: status["catch_up"][k] for k in ("sent", "skipped", "dropped")} == {
        "sent": 4, "skipped": 7, "dropped": 3}
    assert status["ready"]
    # b, ds (definitions), v, qd, s, one d event, four e events, to (outcomes), c: the
    # seven kept messages are not sent
    assert c.sent_events["n2"] - before == 12


def test_confirm_waits_for_the_guarded_backup_then_runs() -> None:
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    c.follow("n2")
    c.pump()
    publish(c.broker, b"confirm me")
    confirmed: list[str] = []
    c.broker.after_durable(lambda: confirmed.append("a"))
    publish(c.broker, b"and me")
    c.broker.after_durable(lambda: confirmed.append("b"))
    assert confirmed == []
    c.pump()
    assert confirmed == ["a", "b"]
    c.broker.after_durable(lambda: confirmed.append("c"))  # nothing new: at once
    assert confirmed == ["a", "b", "c"]


def test_a_silent_backup_leaves_the_guarded_set_after_the_timeout(
        caplog: pytest.LogCaptureFixture) -> None:
    c, confirmed = three_with_one_owing()
    assert confirmed == []  # n2 and the primary are a majority, but n3 is guarded
    c.clock.now += 4.0
    c.primary.tick(c.clock.now)
    assert confirmed == []
    c.clock.now += 2.0
    with caplog.at_level(logging.WARNING, logger="brokerha.primary.primary"):
        c.primary.tick(c.clock.now)
    assert confirmed == [True]
    assert any("n3" in r.getMessage() and "guarded" in r.getMessage() for r in caplog.records)
    status = c.primary.status()["backups"]["n3"]
    assert status["timed_out"] and not status["ready"]
    assert c.primary.ready_backups() == ["n2"]


def three_with_one_owing() -> tuple[Cluster, list[bool]]:
    c = Cluster(3, timeout=5.0)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    c.follow("n2")
    c.follow("n3")
    c.pump()
    c.no_ack.add("n3")
    publish(c.broker, b"x")
    confirmed: list[bool] = []
    c.broker.after_durable(lambda: confirmed.append(True))
    c.pump()
    return c, confirmed


def test_a_backup_unheard_while_the_other_is_heard_stalls_confirms_half_a_second() -> None:
    """A cut that drops packets (no RST): its heartbeat acks stop too, the other
    backup's go on; confirms stop waiting for it after backup_unheard_timeout (0.5 s),
    not backup_timeout (5 s)."""
    c, confirmed = three_with_one_owing()
    start = c.clock.now
    c.primary.backup_heard("n3", c.clock.now)
    for _ in range(10):  # 0.1 s ticks: n2's heartbeat acks arrive, n3 sends nothing
        c.clock.now += 0.1
        c.primary.backup_heard("n2", c.clock.now)
        c.primary.tick(c.clock.now)
        if confirmed:
            break
    assert confirmed == [True] and 0.5 < c.clock.now - start <= 0.7
    assert c.primary.status()["backups"]["n3"]["timed_out"]
    assert c.primary.ready_backups() == ["n2"]


def test_when_no_backup_is_heard_the_primary_itself_stalled_and_nobody_times_out() -> None:
    c, confirmed = three_with_one_owing()
    c.clock.now += 2.0  # the primary's loop was busy: nothing read from anyone
    c.primary.tick(c.clock.now)
    assert confirmed == [] and c.primary.ready_backups() == ["n2", "n3"]


def test_a_heard_but_slow_backup_keeps_the_backup_timeout() -> None:
    c, confirmed = three_with_one_owing()
    for _ in range(45):  # n3 heard (heartbeat acks) but not acknowledging: 4.5 s
        c.clock.now += 0.1
        c.primary.backup_heard("n2", c.clock.now)
        c.primary.backup_heard("n3", c.clock.now)
        c.primary.tick(c.clock.now)
    assert confirmed == []


def cut_by_the_unheard_rule(c: Cluster) -> None:
    """n3 owes an acknowledgement and is unheard for 0.6 s while n2 is heard."""
    for _ in range(6):
        c.clock.now += 0.1
        c.primary.backup_heard("n2", c.clock.now)
        c.primary.tick(c.clock.now)
    assert c.primary.sessions["n3"].timed_out


def test_a_timed_out_backup_whose_link_flows_again_is_guarded_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stall shorter than the link's idle timeout never closes the link, so n3 never
    joins again: once its acknowledgements cover what may have been confirmed it is
    guarded (and ready) again, in the same session, and confirms wait for it again."""
    c, confirmed = three_with_one_owing()
    cut_by_the_unheard_rule(c)
    assert confirmed == [True]
    publish(c.broker, b"y")  # the primary and n2 confirm it alone
    c.broker.after_durable(lambda: confirmed.append(True))
    c.pump()
    assert confirmed == [True, True]
    session = c.primary.sessions["n3"]
    c.no_ack.discard("n3")  # the link flows: its acknowledgements arrive again
    publish(c.broker, b"z")
    with caplog.at_level(logging.INFO, logger="brokerha.primary.primary"):
        c.pump()
    assert c.primary.sessions["n3"] is session and not session.timed_out
    assert c.primary.ready_backups() == ["n2", "n3"]
    assert any("n3" in r.getMessage() and "guarded again" in r.getMessage()
               for r in caplog.records)
    c.no_ack.add("n3")  # guarded again: a confirm waits for it
    publish(c.broker, b"w")
    c.broker.after_durable(lambda: confirmed.append(True))
    c.pump()
    assert confirmed == [True, True]
    c.no_ack.discard("n3")
    publish(c.broker, b"v")
    c.pump()
    assert confirmed == [True, True, True]


def test_a_timed_out_backup_behind_what_may_be_confirmed_stays_out() -> None:
    """Guarded again only with every event that may have been confirmed meanwhile
    (``replicated()``: what the primary and n2 hold)."""
    c, _ = three_with_one_owing()
    cut_by_the_unheard_rule(c)
    c.silent.add("n3")  # nothing reaches it for a while
    for body in (b"y", b"z", b"w"):
        publish(c.broker, body)
    c.pump()
    assert c.primary.replicated() == c.primary.seq  # n2 acknowledged all of it
    c.primary.take_outbox("n3")  # then it all goes out to n3 at once
    c.primary.backup_acked("n3", c.primary.seq - 1)
    assert c.primary.sessions["n3"].timed_out and c.primary.ready_backups() == ["n2"]
    c.primary.backup_acked("n3", c.primary.seq)
    assert not c.primary.sessions["n3"].timed_out
    assert c.primary.ready_backups() == ["n2", "n3"]


def test_a_backup_timed_out_by_the_backup_timeout_is_guarded_again_once_caught_up() -> None:
    """Heard but slow (a big catch-up to apply): out after backup_timeout, back once
    its acknowledgements reached the others'."""
    c, confirmed = three_with_one_owing()
    for _ in range(51):
        c.clock.now += 0.1
        c.primary.backup_heard("n2", c.clock.now)
        c.primary.backup_heard("n3", c.clock.now)
        c.primary.tick(c.clock.now)
    assert confirmed == [True] and c.primary.sessions["n3"].timed_out
    c.no_ack.discard("n3")
    publish(c.broker, b"y")
    c.pump()
    assert not c.primary.sessions["n3"].timed_out


def test_with_three_members_and_both_backups_gone_nothing_is_confirmed() -> None:
    c = Cluster(3)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    c.follow("n2")
    c.follow("n3")
    c.pump()
    c.primary.backup_lost("n2", "link down")
    c.primary.backup_lost("n3", "link down")
    publish(c.broker, b"alone")
    confirmed: list[bool] = []
    c.broker.after_durable(lambda: confirmed.append(True))
    c.clock.now += 100
    c.primary.tick(c.clock.now)
    assert confirmed == []
    c.follow("n2")  # one comes back: primary and n2 are a majority again
    c.pump()
    assert confirmed == [True]


def test_timed_out_backup_still_counts_for_the_majority() -> None:
    c = Cluster(3, timeout=1.0)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    c.follow("n2")
    c.follow("n3")
    c.pump()
    c.primary.backup_lost("n2", "link down")
    c.no_ack.add("n3")
    publish(c.broker, b"x")
    confirmed: list[bool] = []
    c.broker.after_durable(lambda: confirmed.append(True))
    c.pump()
    c.clock.now += 2
    c.primary.tick(c.clock.now)
    assert confirmed == []  # out of the guarded set, but no majority holds it
    c.no_ack.discard("n3")
    c.primary.backup_acked("n3", c.node("n3").backup.ack_message().seq)  # type: ignore[union-attr]
    assert confirmed == [True]


def test_a_backup_is_ready_only_once_it_acknowledged_the_marker() -> None:
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    for i in range(3):
        publish(c.broker, b"%d" % i)
    c.no_ack.add("n2")
    backup = c.follow("n2")
    c.pump()
    assert backup.caught_up and backup.position == (1, c.primary.seq)
    assert c.primary.ready_backups() == []
    assert not c.primary.status()["backups"]["n2"]["ready"]
    c.primary.backup_acked("n2", backup.applied_seq - 1)  # not yet the marker
    assert c.primary.ready_backups() == []
    assert c.primary.status()["backups"]["n2"]["queues_caught_up"] == 1
    c.primary.backup_acked("n2", backup.applied_seq)
    assert c.primary.ready_backups() == ["n2"]


def test_catching_up_backup_holds_only_confirms_after_its_join() -> None:
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    c.follow("n2")
    c.pump()
    c.silent.add("n2")
    publish(c.broker, b"before")
    early: list[bool] = []
    c.broker.after_durable(lambda: early.append(True))
    c.primary.backup_lost("n2", "link down")
    c.silent.discard("n2")
    assert early == []  # members=2: the backup's copy is needed
    c.join("n2")
    c.no_ack.add("n2")
    publish(c.broker, b"after")
    late: list[bool] = []
    c.broker.after_durable(lambda: late.append(True))
    c.pump()
    assert early == late == []
    c.no_ack.discard("n2")
    c.primary.backup_acked("n2", c.node("n2").backup.applied_seq)  # type: ignore[union-attr]
    assert early == late == [True]


def test_x_ha_replicate_none_and_configuration() -> None:
    c = Cluster(2)
    vh = c.broker.vhosts["/"]
    vh.declare_exchange("x", "direct")
    none = vh.declare_queue("none", owner=None, arguments={"x-ha-replicate": "none"})
    conf = vh.declare_queue("conf", owner=None, arguments={"x-ha-replicate": "configuration"})
    vh.bind("x", none, "k")
    vh.bind("x", conf, "k")
    publish(c.broker, b"m", rk="k", exchange="x")
    c.follow("n2")
    c.pump()
    publish(c.broker, b"m2", rk="k", exchange="x")
    c.pump()
    backup = c.node("n2").broker.vhosts["/"]
    assert "none" not in backup.queues
    assert backup.queues["conf"].message_count == 0
    assert [b.destination.name for b in backup.exchanges["x"].bindings.values()] == ["conf"]
    assert vh.queues["conf"].message_count == 2


def test_node_wide_default_policy_applies_without_the_argument() -> None:
    c = Cluster(2, replicate="configuration")
    vh = c.broker.vhosts["/"]
    vh.declare_queue("q", owner=None)
    vh.declare_queue("all", owner=None, arguments={"x-ha-replicate": "all"})
    c.follow("n2")
    publish(c.broker, b"a")
    publish(c.broker, b"b", rk="all")
    c.pump()
    backup = c.node("n2").broker.vhosts["/"]
    assert backup.queues["q"].message_count == 0
    assert backup.queues["all"].message_count == 1


def test_exclusive_queues_and_their_bindings_are_not_replicated() -> None:
    c = Cluster(2)
    vh = c.broker.vhosts["/"]
    owner = object()
    ex = vh.declare_queue("excl", owner=owner, exclusive=True)
    vh.bind("amq.fanout", ex, "")
    c.follow("n2")
    publish(c.broker, b"m", exchange="amq.fanout")
    vh.declare_queue("excl2", owner=owner, exclusive=True)
    c.pump()
    backup = c.node("n2").broker.vhosts["/"]
    assert "excl" not in backup.queues and "excl2" not in backup.queues
    assert backup.exchanges["amq.fanout"].bindings == {}


def test_deleted_queue_exchange_and_binding_are_replicated() -> None:
    c = Cluster(2)
    declare_world(c)
    c.follow("n2")
    publish(c.broker, b"m", rk="a.b", exchange="x")
    c.pump()
    vh = c.broker.vhosts["/"]
    vh.unbind("x", vh.queues["q"], "a.#")
    vh.delete_exchange("h")
    vh.delete_queue("t", owner=None)
    c.pump()
    same(c)
    backup = c.node("n2").broker.vhosts["/"]
    assert "h" not in backup.exchanges and "t" not in backup.queues
    assert backup.exchanges["x"].bindings == {}
    vh.delete_queue("q", owner=None)
    c.pump()
    assert "q" not in backup.queues
    assert c.node("n2").broker.store.messages == {}  # type: ignore[attr-defined]


def test_a_returning_backup_deletes_what_the_primary_deleted_meanwhile() -> None:
    c = Cluster(2)
    declare_world(c)
    c.follow("n2")
    c.pump()
    c.primary.backup_lost("n2", "link down")
    vh = c.broker.vhosts["/"]
    vh.delete_exchange("h")
    vh.delete_queue("t", owner=None)
    vh.unbind("x", vh.queues["q"], "a.#")
    vh.declare_exchange("new", "fanout")
    c.join("n2")
    c.pump()
    same(c)


def test_a_queue_declared_again_while_the_backup_was_away_is_replaced() -> None:
    c = Cluster(2)
    vh = c.broker.vhosts["/"]
    vh.declare_queue("q", owner=None)
    publish(c.broker, b"first life")
    c.follow("n2")
    c.pump()
    c.primary.backup_lost("n2", "link down")
    vh.delete_queue("q", owner=None)
    vh.declare_queue("q", owner=None)
    publish(c.broker, b"second life")  # position 1 again, another message
    c.join("n2")
    c.pump()
    same(c)
    assert consume(c.node("n2").broker.vhosts["/"].queues["q"]) == [b"second life"]


def test_backup_refuses_events_of_an_older_epoch() -> None:
    c = Cluster(2, epoch=3)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    backup = c.follow("n2")
    c.pump()
    with pytest.raises(StaleEpoch):
        backup.receive(Events(2, backup.applied_seq + 1, [["d", "/", "q", [1]]]))
    with pytest.raises(ReplicationError):
        backup.receive(Events(4, backup.applied_seq + 1, [["d", "/", "q", [1]]]))


def test_a_consumers_dequeues_wait_to_be_sent_and_join_until_something_else_is_emitted() -> None:
    """Nobody waits for a dequeue: a tail of them only may be held (``hold_lazy``)."""
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    backup = c.follow("n2")
    c.pump()
    for body in (b"a", b"b", b"c"):
        publish(c.broker, body)
    c.pump()
    assert consume(c.broker.vhosts["/"].queues["q"], 2) == [b"a", b"b"]
    assert c.primary.take_outbox("n2", hold_lazy=True) == []  # held
    publish(c.broker, b"d")  # an event someone waits for: the tail goes with it
    (packet,) = c.primary.take_outbox("n2", hold_lazy=True)
    assert [e[0] for e in packet.events] == ["d", "e"]  # the two dequeues joined into one
    assert packet.events[0][3] == [1, 2]
    backup.receive(packet)
    consume(c.broker.vhosts["/"].queues["q"], 1)
    assert c.primary.take_outbox("n2", hold_lazy=True) == []
    (packet,) = c.primary.take_outbox("n2")  # when due
    assert [e[0] for e in packet.events] == ["d"]
    backup.receive(packet)
    same(c)


def test_the_core_sends_dequeues_only_after_the_delay_or_with_the_next_event() -> None:
    """``HACore``: a dequeue-only tail waits ``DEQUEUE_SEND_DELAY``; any other event sends it."""
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    c.follow("n2")
    c.pump()
    timers: list[tuple[float, Callable[[], None], list[bool]]] = []
    soon: list[Callable[[], None]] = []
    sent: list[Events] = []

    class Timer:
        def __init__(self, cancelled: list[bool]) -> None:
            self.cancelled = cancelled

        def cancel(self) -> None:
            self.cancelled.append(True)

    def later(delay: float, callback: Callable[[], None]) -> Timer:
        cancelled: list[bool] = []
        timers.append((delay, callback, cancelled))
        return Timer(cancelled)

    effects = SimpleNamespace(soon=soon.append, later=later,
                              send_many=lambda peer, out: sent.extend(out))
    for body in (b"a", b"b"):
        publish(c.broker, body)
    c.pump()
    core = HACore(c.broker, "n1", NodeState(), effects,
                  PrimarySettings(members=2), c.clock)
    core.primary = c.primary
    c.primary.on_output = core.schedule_flush
    consume(c.broker.vhosts["/"].queues["q"], 1)
    (delay, due, cancelled), = timers
    assert delay == DEQUEUE_SEND_DELAY and core.flush not in soon
    core.flush()  # e.g. after a backup's ack: the dequeue still waits
    assert sent == []
    due()
    assert [e[0] for packet in sent for e in packet.events] == ["d"]
    sent.clear()
    consume(c.broker.vhosts["/"].queues["q"], 1)  # a new timer ...
    publish(c.broker, b"c")                       # ... cancelled by an event someone waits for
    assert len(timers) == 2 and timers[1][2] == [True] and core.flush in soon
    core.flush()
    assert [e[0] for packet in sent for e in packet.events] == ["d", "e"]


def test_backup_refuses_a_seq_gap_and_ignores_repeats() -> None:
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    backup = c.follow("n2")
    c.pump()
    publish(c.broker, b"one")
    (packet,) = c.primary.take_outbox("n2")
    backup.receive(packet)
    backup.receive(packet)  # a repeat changes nothing
    assert c.node("n2").broker.vhosts["/"].queues["q"].message_count == 1
    publish(c.broker, b"two")
    publish(c.broker, b"three")
    (packet,) = c.primary.take_outbox("n2")
    with pytest.raises(ReplicationError, match="gap"):
        backup.receive(Events(packet.epoch, packet.first_seq + 1, packet.events[1:]))


def test_a_rejoining_backup_applies_only_the_answer_to_its_last_join() -> None:
    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None)
    publish(c.broker, b"a")
    backup = c.follow("n2")
    first_answer = c.primary.take_outbox("n2")
    c.join("n2")  # joins again before the first answer arrived
    for packet in first_answer:
        backup.receive(packet)  # ignored: not the answer to this join
    assert not backup.caught_up
    publish(c.broker, b"b")
    c.pump()
    same(c)
    assert backup.caught_up


def test_messages_published_during_catch_up_arrive_exactly_once() -> None:
    c = Cluster(2)
    vh = c.broker.vhosts["/"]
    q = vh.declare_queue("q", owner=None)
    for i in range(5):
        publish(c.broker, b"before%d" % i)
    c.follow("n2")  # the catch-up is queued, not delivered yet
    for i in range(5):
        publish(c.broker, b"during%d" % i)
    consume(q, 2)
    c.pump()
    same(c)
    bodies = consume(c.node("n2").broker.vhosts["/"].queues["q"])
    assert bodies == [b"before2", b"before3", b"before4"] + [b"during%d" % i for i in range(5)]


def test_backup_queues_do_not_expire_on_their_own() -> None:
    c = Cluster(2)
    vh = c.broker.vhosts["/"]
    vh.declare_queue("ttl", owner=None, arguments={"x-message-ttl": 1000})
    vh.declare_queue("unused", owner=None, arguments={"x-expires": 1000})
    c.follow("n2")
    publish(c.broker, b"short-lived", rk="ttl")
    c.pump()
    backup = c.node("n2").broker
    c.clock.now += 10
    backup.tick()
    assert backup.vhosts["/"].queues["ttl"].message_count == 1
    assert "unused" in backup.vhosts["/"].queues
    c.broker.tick()  # the primary decides
    c.pump()
    assert backup.vhosts["/"].queues["ttl"].message_count == 0
    assert "unused" not in backup.vhosts["/"].queues


def test_dead_lettering_on_the_primary_reaches_the_backup_and_ttl_travels_as_time_left() -> None:
    c = Cluster(2)
    vh = c.broker.vhosts["/"]
    vh.declare_exchange("dlx", "fanout")
    dead = vh.declare_queue("dead", owner=None)
    vh.bind("dlx", dead, "")
    vh.declare_queue("ttl", owner=None, arguments={"x-message-ttl": 1000,
                                                   "x-dead-letter-exchange": "dlx"})
    c.follow("n2")
    c.pump()
    publish(c.broker, b"m", rk="ttl")
    c.pump()
    c.clock.now += 0.4
    publish(c.broker, b"m2", rk="ttl")  # expiry travels as time left, not as a clock reading
    c.pump()
    first, second = c.node("n2").broker.vhosts["/"].queues["ttl"].ready
    assert first.expires_at == pytest.approx(c.clock.now + 0.6)
    assert second.expires_at == pytest.approx(c.clock.now + 1.0)
    c.clock.now += 1
    c.broker.tick()
    c.pump()
    same(c)
    assert consume(c.node("n2").broker.vhosts["/"].queues["dead"]) == [b"m", b"m2"]
