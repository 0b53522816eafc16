"""Forwarding of publishes and confirms (``brokerha/partition/forward.py``), sans-I/O, and its
``ForwardLog`` over a real ``Broker`` (``brokerha/partition/forward_apply.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from brokerha.broker.broker import Broker
from brokerha.cluster.messages import ErrorCode
from brokerha.cluster.replication import HA_ID
from brokerha.ha.simulation.world import message
from brokerha.partition.forward import (
    Confirm,
    Effect,
    Forward,
    Forwarded,
    ForwardError,
    ForwardMessage,
    ForwardPart,
    ForwardReceiver,
    ForwardSender,
    LeaderNotice,
    Mark,
    ToNode,
    Unsafe,
    WhenDurable,
    mark_name,
    marks_from,
)
from brokerha.partition.forward_apply import BrokerForwardLog, recover_marks


def msg(body: str, queue: str = "1.1") -> ForwardMessage:
    return ForwardMessage("/", (queue,), "", "q", b"h", body.encode())


class Log:
    """A group primary's log: what it applied, in order; ``full`` queues refuse."""

    def __init__(self, full: set[str] | None = None) -> None:
        self.applied: list[tuple[str, int, bytes]] = []
        self.names: list[str] = []
        self.full = full or set()

    def apply(self, origin: str, upto: int,
              messages: Sequence[tuple[int, ForwardMessage]]) -> list[int]:
        refused = [f for f, m in messages if set(m.queues) & self.full]
        self.applied += [(origin, f, m.body) for f, m in messages if f not in refused]
        self.names.append(mark_name(1, origin, upto, refused))
        return refused


def forwards(effects: Sequence[Effect]) -> list[Forward]:
    return [e.packet for e in effects if isinstance(e, ToNode) and isinstance(e.packet, Forward)]


def durable(effects: Sequence[Effect]) -> list[Forwarded]:
    """The answers a receiver gives through the group's gate (all of them, here)."""
    out = []
    for e in effects:
        assert not (isinstance(e, ToNode) and isinstance(e.packet, Forwarded)), \
            "an answer outside the gate"
        if isinstance(e, WhenDurable):
            assert isinstance(e.send.packet, Forwarded)
            out.append(e.send.packet)
    return out


def confirms(effects: Sequence[Effect]) -> list[tuple[int, bool]]:
    return [(e.publish, e.ack) for e in effects if isinstance(e, Confirm)]


def test_a_publish_to_two_groups_is_confirmed_when_both_answered() -> None:
    s = ForwardSender("a.1")
    s.leader(0.0, LeaderNotice(1, 3, "b"))
    s.leader(0.0, LeaderNotice(2, 5, "c"))
    assert s.publish(1, {1: msg("x"), 2: msg("x")}) == []
    assert s.publish(2, {1: msg("y")}) == []
    sent = s.flush(0.0)
    f1, f2 = forwards(sent)
    # one forward per group per turn, fseqs per group, each to its leader in its epoch
    assert (f1.group, f1.epoch, f1.first_fseq, len(f1.messages)) == (1, 3, 1, 2)
    assert (f2.group, f2.epoch, f2.first_fseq, len(f2.messages)) == (2, 5, 1, 1)
    assert [e.node for e in sent if isinstance(e, ToNode)] == ["b", "c"]
    assert confirms(s.receive(0.1, Forwarded(1, "a.1", 2, []))) == [(2, True)]
    assert confirms(s.receive(0.1, Forwarded(2, "a.1", 1, []))) == [(1, True)]


def test_a_message_refused_by_one_group_is_nacked() -> None:
    s = ForwardSender("a.1")
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.leader(0.0, LeaderNotice(2, 1, "c"))
    s.publish(7, {1: msg("x"), 2: msg("x")})
    s.flush(0.0)
    assert s.receive(0.1, Forwarded(1, "a.1", 1, [1])) == []
    assert confirms(s.receive(0.1, Forwarded(2, "a.1", 1, []))) == [(7, False)]


def test_the_receiver_answers_only_through_the_gate_and_up_to_what_it_applied() -> None:
    log = Log(full={"full"})
    r = ForwardReceiver(1, 4, log)
    out = r.receive("a", Forward(1, 4, "a.1", 1, 0, [msg("x").as_wire(),
                                                      msg("y", "full").as_wire()]))
    assert durable(out) == [Forwarded(1, "a.1", 2, [2])]
    assert log.applied == [("a.1", 1, b"x")]
    assert r.marks["a.1"].upto == 2 and r.marks["a.1"].refused == {2}


def test_a_forward_resent_is_not_applied_twice_and_says_what_was_refused() -> None:
    log = Log(full={"full"})
    r = ForwardReceiver(1, 4, log)
    batch = [msg("x").as_wire(), msg("y", "full").as_wire()]
    r.receive("a", Forward(1, 4, "a.1", 1, 0, batch))
    out = r.receive("a", Forward(1, 4, "a.1", 1, 0, [*batch, msg("z").as_wire()]))
    assert durable(out) == [Forwarded(1, "a.1", 3, [2])]
    assert [b for _, _, b in log.applied] == [b"x", b"z"]
    assert r.stats.deduped == 2


def test_a_new_primary_drops_what_its_store_holds_of_a_resend_after_a_failover() -> None:
    """The mark travels with the batch (its name); the new primary reads it back."""
    old = Log()
    first = ForwardReceiver(1, 1, old)
    s = ForwardSender("a.1")
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    for i in range(1, 4):
        s.publish(i, {1: msg(f"m{i}")})
    (fwd,) = forwards(s.flush(0.0))
    first.receive("a", fwd)  # applied and replicated; the answer lost with the primary
    s.publish(4, {1: msg("m4")})
    s.flush(0.01)  # this one never reached it
    new = Log()
    second = ForwardReceiver(1, 2, new, marks=marks_from(1, old.names))
    resent = forwards(s.leader(0.5, LeaderNotice(1, 2, "c")))
    assert [(f.epoch, f.first_fseq, len(f.messages)) for f in resent] == [(2, 1, 4)]
    assert s.stats.resent == 4
    answers = durable(second.receive("a", resent[0]))
    assert new.applied == [("a.1", 4, b"m4")]
    assert second.stats.deduped_recovered == 3
    assert confirms(s.receive(0.6, answers[0])) == [(i, True) for i in range(1, 5)]


def test_no_dedupe_enqueues_a_resend_twice() -> None:
    log = Log()
    r = ForwardReceiver(1, 1, log, unsafe=Unsafe(no_dedupe=True))
    fwd = Forward(1, 1, "a.1", 1, 0, [msg("x").as_wire()])
    r.receive("a", fwd)
    r.receive("a", fwd)
    assert len(log.applied) == 2


def test_answer_before_gate_and_confirm_on_send_skip_the_durability() -> None:
    r = ForwardReceiver(1, 1, Log(), unsafe=Unsafe(answer_before_gate=True))
    out = r.receive("a", Forward(1, 1, "a.1", 1, 0, [msg("x").as_wire()]))
    assert out == [ToNode("a", Forwarded(1, "a.1", 1, []))]
    s = ForwardSender("a.1", unsafe=Unsafe(confirm_on_send=True))
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("x")})
    assert confirms(s.flush(0.0)) == [(1, True)]


def test_nothing_is_applied_before_the_metadata_copy_reached_the_forwards_seq() -> None:
    log = Log()
    r = ForwardReceiver(1, 1, log, meta_seq=5)
    fwd = Forward(1, 1, "a.1", 1, 7, [msg("x").as_wire()])
    assert r.receive("a", fwd) == [] and log.applied == []
    assert r.metadata_reached(6) == [] and log.applied == []
    assert durable(r.metadata_reached(7)) == [Forwarded(1, "a.1", 1, [])]
    assert log.applied == [("a.1", 1, b"x")]


def test_a_forward_of_another_epoch_is_not_taken() -> None:
    r = ForwardReceiver(1, 3, Log())
    out = r.receive("a", Forward(1, 2, "a.1", 1, 0, [msg("x").as_wire()]))
    assert len(out) == 1 and isinstance(out[0], ToNode)
    error = out[0].packet
    assert isinstance(error, ForwardError) and error.code == ErrorCode.NOT_PRIMARY


def test_a_sender_waits_for_the_next_notice_after_not_primary_from_its_leader_only() -> None:
    s = ForwardSender("a.1")
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("x")})
    s.flush(0.0)
    s.leader(0.1, LeaderNotice(1, 2, "c"))
    s.receive(0.2, ForwardError(1, "a.1", ErrorCode.NOT_PRIMARY, ""), "b")  # the old leader's
    assert s.lane(1).leader == "c"
    s.receive(0.2, ForwardError(1, "a.1", ErrorCode.NOT_PRIMARY, ""), "c")
    assert s.lane(1).leader is None and s.tick(5.0) == []
    again = forwards(s.leader(5.0, LeaderNotice(1, 2, "c")))  # the same leader, noticed again
    assert [(f.epoch, f.first_fseq) for f in again] == [(2, 1)]


def test_a_gap_is_dropped_and_the_retry_resends_from_the_first_unanswered() -> None:
    log = Log()
    r = ForwardReceiver(1, 1, log)
    s = ForwardSender("a.1", retry=0.5)
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("x")})
    s.flush(0.0)  # lost
    s.publish(2, {1: msg("y")})
    (second,) = forwards(s.flush(0.1))
    assert r.receive("a", second) == [] and r.stats.gaps == 1
    assert s.tick(0.4) == []
    (again,) = forwards(s.tick(0.5))  # only what went 0.5 s ago: fseq 1
    assert (again.first_fseq, len(again.messages)) == (1, 1) and s.stats.retried == 1
    (answer,) = durable(r.receive("a", again))
    assert answer == Forwarded(1, "a.1", 1, [])
    s.receive(0.55, answer)
    (last,) = forwards(s.tick(0.65))  # fseq 2 went at 0.1
    assert (last.first_fseq, len(last.messages)) == (2, 1)
    assert durable(r.receive("a", last)) == [Forwarded(1, "a.1", 2, [])]
    assert (s.stats.retries, s.stats.retried) == (2, 2)


def test_the_retry_to_a_silent_leader_backs_off_and_a_new_leader_gets_all_at_once() -> None:
    """The same leader: only what is older than the delay, at most a window's worth, the
    delay doubled at each retry left unanswered (up to retry_max), back to ``retry`` once
    the leader answers; a new leader: everything unanswered at once."""
    s = ForwardSender("a.1", retry=0.5, retry_max=2.0, window=8, batch=4)
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    for i in range(8):
        s.publish(i, {1: msg(f"m{i}")})
    assert [len(f.messages) for f in forwards(s.flush(0.0))] == [4, 4]
    retried_at = [t / 10 for t in range(1, 80) if forwards(s.tick(t / 10))]
    assert retried_at == [0.5, 1.5, 3.5, 5.5, 7.5]  # 0.5, 1, 2, 2, 2 s apart
    assert s.stats.retries == 5 and s.stats.retried == 5 * 8
    s.receive(7.6, Forwarded(1, "a.1", 2, []))  # an answer: the delay is 0.5 again
    assert forwards(s.tick(7.9)) == []
    again = forwards(s.tick(8.0))  # fseq 3..8 went at 7.5
    assert [(f.first_fseq, len(f.messages)) for f in again] == [(3, 4), (7, 2)]
    assert [len(f.messages) for f in forwards(s.tick(8.1))] == []
    moved = forwards(s.leader(8.2, LeaderNotice(1, 2, "c")))
    assert [(f.first_fseq, len(f.messages)) for f in moved] == [(3, 4), (7, 2)]
    assert s.stats.resent == 6


def test_a_full_window_holds_the_publishers_of_that_group_only() -> None:
    s = ForwardSender("a.1", window=3, batch=2)
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    for i in range(3):
        s.publish(i, {1: msg(f"m{i}")})
    assert s.holds([1]) and not s.holds([2])
    assert [len(f.messages) for f in forwards(s.flush(0.0))] == [2, 1]
    s.receive(0.1, Forwarded(1, "a.1", 2, []))
    assert not s.holds([1])


def test_an_answer_to_an_earlier_start_of_the_node_is_ignored() -> None:
    s = ForwardSender("a.2")
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("x")})
    s.flush(0.0)
    assert s.receive(0.1, Forwarded(1, "a.1", 5, [])) == []


def packets(effects: Sequence[Effect]) -> list[Forward | ForwardPart]:
    """What goes to a leader, in order: parts and forwards."""
    return [e.packet for e in effects
            if isinstance(e, ToNode) and isinstance(e.packet, Forward | ForwardPart)]


def deliver(r: ForwardReceiver, sent: Sequence[Forward | ForwardPart]) -> list[Effect]:
    out: list[Effect] = []
    for p in sent:
        out += r.part("a", p) if isinstance(p, ForwardPart) else r.receive("a", p)
    return out


def test_a_large_body_goes_in_parts_and_is_put_back_together() -> None:
    """A body over ``part_bytes`` goes as ForwardParts, then its message alone in a Forward
    naming its size; the small ones around it go in their own Forwards."""
    s = ForwardSender("a.1", part_bytes=4)
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("ab")})
    s.publish(2, {1: msg("0123456789")})
    s.publish(3, {1: msg("cd")})
    sent = packets(s.flush(0.0))
    assert [type(p).__name__ for p in sent] == ["Forward", "ForwardPart", "ForwardPart",
                                                "ForwardPart", "Forward", "Forward"]
    parts = [p for p in sent if isinstance(p, ForwardPart)]
    assert [(p.fseq, p.size, p.offset, p.data) for p in parts] == \
        [(2, 10, 0, b"0123"), (2, 10, 4, b"4567"), (2, 10, 8, b"89")]
    big = sent[4]
    assert isinstance(big, Forward) and big.first_fseq == 2
    assert big.messages == [["/", ["1.1"], "", "q", b"h", b"", 10]]
    assert s.stats.parts == 3
    log = Log()
    r = ForwardReceiver(1, 1, log)
    answers = durable(deliver(r, sent))
    assert [b for _, _, b in log.applied] == [b"ab", b"0123456789", b"cd"]
    assert [a.upto_fseq for a in answers] == [1, 2, 3] and r.partial == {}
    assert r.stats.parts == 3
    assert confirms(s.receive(0.1, answers[-1])) == [(1, True), (2, True), (3, True)]


def test_a_body_missing_a_part_is_not_applied_and_the_retry_sends_it_whole() -> None:
    log = Log()
    r = ForwardReceiver(1, 1, log)
    s = ForwardSender("a.1", part_bytes=4, retry=0.5)
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("0123456789")})
    sent = packets(s.flush(0.0))
    assert deliver(r, [sent[0], sent[2], sent[3]]) == []  # the second part lost
    assert log.applied == [] and r.stats.parts_lost == 1 and r.stats.incomplete == 1
    assert "a.1" not in r.marks
    again = packets(s.tick(0.5))
    assert [type(p).__name__ for p in again] == ["ForwardPart"] * 3 + ["Forward"]
    assert durable(deliver(r, again)) == [Forwarded(1, "a.1", 1, [])]
    assert log.applied == [("a.1", 1, b"0123456789")]


def test_a_lane_with_large_bodies_unanswered_retries_no_sooner_than_they_take(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry waits at least the time the unanswered bodies in parts take at
    ``RETRY_BYTES_PER_SECOND`` (here 5 bytes a second: 10 bytes, 2 s), not ``retry``:
    a leader still applying a large message is not sent every part again."""
    monkeypatch.setattr("brokerha.partition.forward.RETRY_BYTES_PER_SECOND", 5)
    s = ForwardSender("a.1", part_bytes=4, retry=0.5)
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("0123456789")})
    s.flush(0.0)
    assert [t / 10 for t in range(1, 40) if packets(s.tick(t / 10))] == [2.0]
    assert s.stats.parts == 6


def test_a_failover_mid_message_resends_it_whole_to_the_new_leader() -> None:
    """The old leader got two parts of three and died: the new leader gets every part
    again, then the Forward, and applies the body once; a later Forward whose parts went
    to the old leader only is a gap there."""
    s = ForwardSender("a.1", part_bytes=4)
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("0123456789")})
    old = ForwardReceiver(1, 1, Log())
    deliver(old, packets(s.flush(0.0))[:2])
    assert old.partial["a.1"].have == 8
    new_log = Log()
    new = ForwardReceiver(1, 2, new_log)
    moved = packets(s.leader(0.3, LeaderNotice(1, 2, "c")))
    assert [type(p).__name__ for p in moved] == ["ForwardPart"] * 3 + ["Forward"]
    assert {(p.group, p.epoch) for p in moved} == {(1, 2)}
    assert durable(deliver(new, moved)) == [Forwarded(1, "a.1", 1, [])]
    assert new_log.applied == [("a.1", 1, b"0123456789")]
    # a part of the old epoch reaching the new leader is not held
    assert new.part("a", ForwardPart(1, 1, "a.1", 2, 10, 0, b"0123")) == [] and not new.partial
    # a Forward naming a body in parts that never came: nothing applied
    assert new.receive("a", Forward(1, 2, "a.1", 2, 0, [
        ForwardMessage.in_parts(msg("0123456789").as_wire())])) == []
    assert new.stats.incomplete == 1 and len(new_log.applied) == 1


def test_a_resent_body_in_parts_is_dropped_below_the_mark_new_primary_included() -> None:
    """Dedupe holds for large bodies: the retry's parts of a message applied are not held,
    its Forward is answered, nothing applied twice -- by the same receiver, and by a new
    primary that read the mark back from its store."""
    log = Log()
    r = ForwardReceiver(1, 1, log)
    s = ForwardSender("a.1", part_bytes=4, retry=0.5)
    s.leader(0.0, LeaderNotice(1, 1, "b"))
    s.publish(1, {1: msg("0123456789")})
    deliver(r, packets(s.flush(0.0)))  # applied; the answer lost
    again = packets(s.tick(0.5))
    assert durable(deliver(r, again)) == [Forwarded(1, "a.1", 1, [])]
    assert len(log.applied) == 1 and r.stats.parts_deduped == 3 and not r.partial
    new_log = Log()
    second = ForwardReceiver(1, 2, new_log, marks=marks_from(1, log.names))
    moved = packets(s.leader(0.6, LeaderNotice(1, 2, "c")))
    answers = durable(deliver(second, moved))
    assert answers == [Forwarded(1, "a.1", 1, [])] and new_log.applied == []
    assert second.stats.parts_deduped == 3 and second.stats.deduped_recovered == 1
    assert confirms(s.receive(0.7, answers[0])) == [(1, True)]
    # unsafe: without the marks the resend is put together and enqueued again
    twice = Log()
    unsafe = ForwardReceiver(1, 1, twice, unsafe=Unsafe(no_dedupe=True))
    deliver(unsafe, again)
    deliver(unsafe, again)
    assert [b for _, _, b in twice.applied] == [b"0123456789"] * 2


def test_marks_read_back_from_their_names() -> None:
    names = [mark_name(2, "n1:x.3", 4, [2]), mark_name(2, "n1:x.3", 9, []),
             mark_name(3, "n1:x.3", 99, []), None, "a client's own tx id"]
    assert marks_from(2, names) == {"n1:x.3": Mark(9, {2})}


def test_a_forward_applied_to_a_broker_records_its_mark_and_refuses_when_full() -> None:
    broker = Broker("b")
    vhost = broker.add_vhost("/")
    q = vhost.declare_queue("q", owner=None, durable=True, arguments={HA_ID: "1.1"})
    full = vhost.declare_queue("full", owner=None, durable=True, arguments={
        HA_ID: "1.2", "x-max-length": 1, "x-overflow": "reject-publish"})
    placed: list[tuple[str, int, str, int]] = []
    log = BrokerForwardLog(broker, 1, lambda queue: True,
                           placed=lambda o, f, queue, p: placed.append((o, f, queue.name, p)))
    m = message(b"x", persistent=True)
    both = ForwardMessage("/", ("1.1", "1.2"), "", "q", m.header, b"x")
    gone = ForwardMessage("/", ("9.9",), "", "q", m.header, b"y")
    assert log.apply("a.1", 3, [(1, both), (2, both), (3, gone)]) == [2]
    assert [e.message.body for e in q.ready] == [b"x", b"x"]
    assert [e.message.body for e in full.ready] == [b"x"]
    assert log.unknown_queues == 1
    assert placed == [("a.1", 1, "q", 1), ("a.1", 1, "full", 1), ("a.1", 2, "q", 2)]
    assert recover_marks(broker, 1) == {"a.1": Mark(3, {2})}
    assert recover_marks(broker, 2) == {}


def test_a_batchs_mark_reaches_the_backup_in_the_event_that_carries_its_enqueues() -> None:
    """A product ``Primary`` and its ``Backup`` (tests/ha/harness.py): after every single
    event the backup applied, it holds the batch's enqueues and its mark together or
    neither (a backup's position may stop between any two events); promoted, it reads
    the mark back."""
    from tests.ha.harness import Cluster

    c = Cluster(2)
    q = c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    c.follow("n2")
    c.pump()
    backup = c.node("n2").broker
    seen: list[tuple[int, dict[str, Mark]]] = []

    def check(_: object) -> None:
        held = len(backup.vhosts["/"].queues["q"].ready)
        seen.append((held, recover_marks(backup, 1)))

    c.check = check
    m = message(b"x", persistent=True)
    ha_id = str(q.arguments[HA_ID])
    log = BrokerForwardLog(c.broker, 1, lambda queue: True)
    log.apply("a.1", 2, [(1, ForwardMessage("/", (ha_id,), "", "q", m.header, b"x")),
                         (2, ForwardMessage("/", (ha_id,), "", "q", m.header, b"y"))])
    c.pump()
    assert seen and all(s in ((0, {}), (2, {"a.1": Mark(2, set())})) for s in seen), seen
    assert [e.message.body for e in backup.vhosts["/"].queues["q"].ready] == [b"x", b"y"]
    assert recover_marks(backup, 1) == {"a.1": Mark(2, set())}
