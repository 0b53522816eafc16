"""Remote consumers (``brokerha/partition/remote_consumer.py``), sans-I/O: a
``ConsumerProxy`` on the client's node and a ``ConsumerHost`` over a real
``Broker``'s queue on the group's primary, their packets carried by hand."""

from __future__ import annotations

from collections.abc import Sequence

from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.cluster.messages import ErrorCode
from brokerha.cluster.replication import HA_ID
from brokerha.ha.simulation.world import message
from brokerha.partition.forward import LeaderNotice
from brokerha.partition.forward_apply import BrokerForwardLog
from brokerha.partition.remote_consumer import (
    ACCESS_REFUSED,
    ACK,
    CANCELLED,
    NO_ACK_CREDIT,
    NOT_FOUND,
    REJECT,
    REQUEUE,
    UNAVAILABLE,
    Attached,
    BranchKey,
    Cancelled,
    Consume,
    ConsumeAnswered,
    ConsumeError,
    ConsumerHost,
    ConsumerProxy,
    Credit,
    Deliver,
    Delivered,
    Effect,
    Get,
    GetAnswer,
    GetReply,
    RemoteDelivery,
    SendTo,
    SendWhenDurable,
    Settle,
    SettleAnswered,
    Settled,
    Unsafe,
    hand_how,
    handed_how,
)

GROUP = 1


def primary(bodies: Sequence[bytes] = (b"m1", b"m2", b"m3", b"m4", b"m5")) -> tuple[Broker, Queue]:
    broker = Broker("p")
    q = broker.add_vhost("/").declare_queue("q", owner=None, durable=True,
                                            arguments={HA_ID: "1.1"})
    for body in bodies:
        q.enqueue(message(body, persistent=True))
    return broker, q


class Cluster:
    """One client node (``c``) with its proxy, and group primaries by node name, each a
    host over its broker; ``carry`` delivers packets at once, durable answers too (or
    holds them in ``gate``)."""

    def __init__(self, hosts: dict[str, ConsumerHost]) -> None:
        self.hosts = hosts
        self.proxy = ConsumerProxy("c.1")
        self.seen: list[Effect] = []  # what reached the client's channel
        self.gate: list[SendTo] = []
        self.hold_gate = False

    def carry(self, effects: Sequence[Effect], src: str = "c") -> None:
        for e in effects:
            if isinstance(e, SendWhenDurable):
                if self.hold_gate:
                    self.gate.append(e.send)
                else:
                    self.carry([e.send], src)
            elif isinstance(e, SendTo):
                if e.node == "c":
                    self.carry(self.proxy.receive(src, e.packet))
                else:
                    host = self.hosts[e.node]
                    self.carry(host.receive(src, e.packet), e.node)
                    self.carry(host.flush(), e.node)
            else:
                self.seen.append(e)

    def turn(self) -> None:
        """The end of a loop turn on every node."""
        for name, host in self.hosts.items():
            self.carry(host.flush(), name)
        self.carry(self.proxy.flush())

    def notice(self, node: str, epoch: int) -> None:
        self.carry(self.proxy.leader(LeaderNotice(GROUP, epoch, node)))
        self.turn()

    def delivered(self) -> list[RemoteDelivery]:
        out = [e.delivery for e in self.seen if isinstance(e, Delivered)]
        self.seen = [e for e in self.seen if not isinstance(e, Delivered)]
        return out


def host_on(broker: Broker, epoch: int = 1, unsafe: Unsafe | None = None) -> ConsumerHost:
    return ConsumerHost(GROUP, epoch, BrokerForwardLog(broker, GROUP, lambda q: True),
                        unsafe=unsafe or Unsafe())


def consume(c: Cluster, prefetch: int = 2) -> int:
    consumer, out = c.proxy.consume(GROUP, "/", "1.1", prefetch)
    c.carry(out)
    c.turn()
    return consumer


def test_a_remote_consumer_takes_its_prefetch_and_more_as_it_acks() -> None:
    broker, q = primary()
    c = Cluster({"p": host_on(broker)})
    c.notice("p", 1)
    consume(c, prefetch=2)
    first = c.delivered()
    assert [(d.position, d.body, d.redelivered) for d in first] == [(1, b"m1", False),
                                                                   (2, b"m2", False)]
    assert q.consumer_count == 1 and len(q.ready) == 3
    c.proxy.settle(first[:1], ACK)
    c.turn()
    assert [d.position for d in c.delivered()] == [3]
    # the ack is answered once durable (here at once): the client's node hears it
    assert [e for e in c.seen if isinstance(e, SettleAnswered)] == [
        SettleAnswered(GROUP, 1, 1, "/", "1.1", (1,))]
    assert q.acked == 1


def test_the_consume_is_answered_once_the_leader_took_it_before_any_delivery() -> None:
    broker, q = primary()
    c = Cluster({"p": host_on(broker)})
    consumer, out = c.proxy.consume(GROUP, "/", "1.1", 2)
    assert out == [] and c.seen == []  # no leader known: nothing answered yet
    c.notice("p", 1)
    assert c.seen[0] == ConsumeAnswered(consumer)  # the consume-ok, then the deliveries
    assert [d.position for d in c.delivered()] == [1, 2]
    assert c.seen == [ConsumeAnswered(consumer)]
    c.notice("p", 2)  # a re-attach (a new epoch's leader): no second answer
    assert [e for e in c.seen if isinstance(e, ConsumeAnswered)] == [ConsumeAnswered(consumer)]


def test_an_exclusive_consume_beside_a_consumer_is_refused_never_answered() -> None:
    broker, q = primary()
    c = Cluster({"p": host_on(broker)})
    c.notice("p", 1)
    first = consume(c, prefetch=1)
    c.seen.clear()
    second, out = c.proxy.consume(GROUP, "/", "1.1", 1, exclusive=True)
    c.carry(out)
    c.turn()
    assert [e for e in c.seen if isinstance(e, ConsumeAnswered)] == []
    [refused] = [e for e in c.seen if isinstance(e, Cancelled)]
    assert refused.consumer == second and refused.code == ACCESS_REFUSED
    assert refused.message.endswith("queue 'q' in vhost '/' in exclusive use")
    c.carry(c.proxy.close(first))  # and the other way: an exclusive one holds it
    c.seen.clear()
    third, out = c.proxy.consume(GROUP, "/", "1.1", 1, exclusive=True)
    c.carry(out)
    c.turn()
    assert c.seen[0] == ConsumeAnswered(third)
    fourth, out = c.proxy.consume(GROUP, "/", "1.1", 1)
    c.carry(out)
    assert [(e.consumer, e.code) for e in c.seen if isinstance(e, Cancelled)] == [
        (fourth, ACCESS_REFUSED)]
    assert q.consumer_count == 1


def test_the_deliveries_of_a_turn_go_as_one_deliver_per_consumer() -> None:
    broker, q = primary(())
    host = host_on(broker)
    c = Cluster({"p": host})
    c.notice("p", 1)
    consume(c, prefetch=10)
    for body in (b"a", b"b", b"c"):
        q.enqueue(message(body, persistent=True))
    [deliver] = [e.packet for e in host.flush() if isinstance(e, SendTo)]
    assert isinstance(deliver, Deliver) and [d[5] for d in deliver.deliveries] == [b"a", b"b",
                                                                                    b"c"]


def test_an_ack_is_answered_only_through_the_groups_gate() -> None:
    broker, q = primary()
    c = Cluster({"p": host_on(broker)})
    c.hold_gate = True
    c.notice("p", 1)
    consume(c, prefetch=1)
    c.proxy.settle(c.delivered(), ACK)
    c.turn()
    assert not [e for e in c.seen if isinstance(e, SettleAnswered)]
    assert [type(s.packet) for s in c.gate] == [Settled]
    # unsafe: answered as soon as applied
    broker2, _ = primary()
    c2 = Cluster({"p": host_on(broker2, unsafe=Unsafe(ack_before_durable=True))})
    c2.hold_gate = True
    c2.notice("p", 1)
    consume(c2, prefetch=1)
    c2.proxy.settle(c2.delivered(), ACK)
    c2.turn()
    assert [e for e in c2.seen if isinstance(e, SettleAnswered)] and not c2.gate


def test_nack_with_requeue_comes_back_redelivered_and_reject_drops() -> None:
    broker, q = primary((b"m1", b"m2"))
    c = Cluster({"p": host_on(broker)})
    c.notice("p", 1)
    consume(c, prefetch=1)
    [d] = c.delivered()
    c.proxy.settle([d], REQUEUE)
    c.turn()
    [again] = c.delivered()
    assert (again.position, again.redelivered) == (1, True)
    c.proxy.settle([again], REJECT)
    c.turn()
    [second] = c.delivered()
    assert second.position == 2 and q.message_count == 0
    assert [e.positions for e in c.seen if isinstance(e, SettleAnswered)] == [(1,)]


def test_a_lost_link_requeues_what_the_consumer_held_and_it_attaches_again() -> None:
    broker, q = primary()
    host = host_on(broker)
    c = Cluster({"p": host})
    c.notice("p", 1)
    consume(c, prefetch=2)
    held = c.delivered()
    assert len(held) == 2 and host.held() == 2
    c.carry(host.link_lost("c"), "p")
    assert host.held() == 0 and q.consumer_count == 0
    assert [(e.position, e.redelivered) for e in list(q.ready)[:2]] == [(1, True), (2, True)]
    c.carry(c.proxy.link_lost("p"))
    # an ack of a delivery of the lost attachment is dropped: the message comes again
    c.proxy.settle(held[:1], ACK)
    c.turn()
    assert c.proxy.stats.stale_settles == 1 and q.acked == 0
    c.notice("p", 1)  # the link is up again: the leader's notice
    again = c.delivered()
    assert [(d.position, d.redelivered, d.attach) for d in again] == [(1, True, 2),
                                                                      (2, True, 2)]
    assert c.proxy.stats.reattaches == 1


def test_without_requeue_on_link_loss_what_was_held_is_stranded() -> None:
    broker, q = primary()
    host = host_on(broker, unsafe=Unsafe(no_requeue_on_link_loss=True))
    c = Cluster({"p": host})
    c.notice("p", 1)
    consume(c, prefetch=2)
    c.carry(host.link_lost("c"), "p")
    assert len(q.ready) == 3 and q.unacked == 2  # acquired by nobody, for ever


def test_credit_ignored_hands_over_everything() -> None:
    broker, _ = primary()
    c = Cluster({"p": host_on(broker, unsafe=Unsafe(credit_ignored=True))})
    c.notice("p", 1)
    consume(c, prefetch=2)
    assert len(c.delivered()) == 5


def test_a_new_leader_redelivers_what_the_old_one_delivered_with_its_flag_set() -> None:
    """Delivery state is not replicated: the new primary holds positions 1-5 ready; the
    proxy names the two it held unsettled, so they come flagged; a late delivery of the
    deposed primary and an ack of its delivery are dropped."""
    old_broker, _ = primary()
    new_broker, new_q = primary()
    old, new = host_on(old_broker, 1), host_on(new_broker, 2)
    c = Cluster({"p": old, "n": new})
    c.notice("p", 1)
    consume(c, prefetch=2)
    held = c.delivered()
    c.notice("n", 2)
    redelivered = c.delivered()
    assert [(d.position, d.redelivered, d.epoch) for d in redelivered] == [(1, True, 2),
                                                                           (2, True, 2)]
    assert new.stats.marked == 2
    # the deposed primary's late deliveries are not the channel's
    c.carry(c.proxy.receive("p", Deliver(GROUP, 1, "c.1", 1, 1, [[3, False, "", "q", b"",
                                                                  b"m3"]])))
    assert c.delivered() == [] and c.proxy.stats.stale_deliveries == 1
    # an ack of a tag given before the failover is dropped; the new delivery's goes
    c.proxy.settle(held, ACK)
    c.proxy.settle(redelivered[:1], ACK)
    c.turn()
    assert c.proxy.stats.stale_settles == 2 and new_q.acked == 1
    assert [d.position for d in c.delivered()] == [3]
    # the old host, deposed, gives back what it held
    old.stop()
    assert old_broker.vhosts["/"].queues["q"].unacked == 0


def test_an_ack_while_detached_still_names_the_position_at_the_re_attach() -> None:
    """The leader's link lost (its node killed), the client acks what it held before the
    proxy attaches again: the ack cannot reach the primary that delivered it (dropped),
    and the new primary delivers the message again -- flagged, since the re-attach's
    ``Consume`` still names it (found by tests/failover/test_partition_consuming.py: the
    client acked within the election and got the message again unflagged)."""
    old_broker, _ = primary()
    new_broker, _ = primary()
    old, new = host_on(old_broker, 1), host_on(new_broker, 2)
    c = Cluster({"p": old, "n": new})
    c.notice("p", 1)
    consume(c, prefetch=2)
    held = c.delivered()
    c.carry(c.proxy.link_lost("p"))
    c.proxy.settle(held, ACK)
    c.turn()
    assert c.proxy.stats.stale_settles == 2
    c.notice("n", 2)
    assert [(d.position, d.redelivered) for d in c.delivered()] == [(1, True), (2, True)]


def test_an_ack_not_answered_settled_is_named_at_the_re_attach() -> None:
    """An ack the primary applied but did not make durable before it died (its gate held):
    the new primary holds the message ready and delivers it again, flagged; an ack
    answered ``Settled`` is no longer named."""
    old_broker, _ = primary()
    new_broker, _ = primary()
    old, new = host_on(old_broker, 1), host_on(new_broker, 2)
    c = Cluster({"p": old, "n": new})
    c.notice("p", 1)
    consume(c, prefetch=2)
    first, second = c.delivered()
    c.proxy.settle([first], ACK)
    c.turn()  # answered Settled (the gate open)
    c.hold_gate = True
    c.proxy.settle([second], ACK)
    c.turn()  # applied on p, its Settled held at the gate: p dies
    c.carry(c.proxy.link_lost("p"))
    c.notice("n", 2)
    got = [(d.position, d.redelivered) for d in c.delivered() if d.epoch == 2]
    # named: 2 (acked, not durable) and 3, 4 (delivered meanwhile, held); not 1
    assert new.stats.marked == 3
    assert got == [(1, False), (2, True)]  # (1 is still on this test's new primary)


def test_a_consume_of_another_epoch_or_an_unknown_queue_is_refused() -> None:
    broker, _ = primary()
    host = host_on(broker, epoch=3)
    c = Cluster({"p": host})
    c.notice("p", 2)  # a notice the host has moved past
    consume(c)
    assert c.proxy.stats.refused == 1 and c.proxy.leaders == {}
    assert [s.consumer for s in c.proxy.subs.values()] == [1]  # waits for the next notice
    c.notice("p", 3)
    assert len(c.delivered()) == 2
    consumer, out = c.proxy.consume(GROUP, "/", "9.9", 1)
    c.carry(out)
    assert Cancelled(consumer, NOT_FOUND, "no queue 9.9 in vhost / in group 1") in c.seen
    assert consumer not in c.proxy.subs


def test_a_deleted_queue_cancels_its_remote_consumers() -> None:
    broker, q = primary()
    c = Cluster({"p": host_on(broker)})
    c.notice("p", 1)
    consumer = consume(c)
    q.delete()
    c.turn()
    assert [e for e in c.seen if isinstance(e, Cancelled)] == [
        Cancelled(consumer, CANCELLED, "queue 1.1 deleted")]


def test_cancel_keeps_what_is_held_until_settled_and_close_requeues() -> None:
    broker, q = primary()
    host = host_on(broker)
    c = Cluster({"p": host})
    c.notice("p", 1)
    consumer = consume(c, prefetch=2)
    held = c.delivered()
    c.carry(c.proxy.cancel(consumer))
    assert q.consumer_count == 0 and host.held() == 2
    c.proxy.settle(held[:1], ACK)
    c.turn()
    assert q.acked == 1 and host.held() == 1 and c.delivered() == []
    other = consume(c, prefetch=5)
    assert [d.position for d in c.delivered()] == [3, 4, 5]
    c.carry(c.proxy.close(other))
    assert host.held() == 1 and [e.position for e in q.ready] == [3, 4, 5]


def test_a_get_is_one_request_and_its_ack_one_settle() -> None:
    broker, q = primary((b"m1",))
    c = Cluster({"p": host_on(broker)})
    request, out = c.proxy.get(GROUP, "/", "1.1")
    assert out == [GetAnswer(request, None, UNAVAILABLE)]  # no leader known yet
    c.notice("p", 1)
    request, out = c.proxy.get(GROUP, "/", "1.1")
    assert isinstance(out[0], SendTo) and isinstance(out[0].packet, Get)
    c.carry(out)
    [answer] = [e for e in c.seen if isinstance(e, GetAnswer)]
    assert answer.request == request and answer.delivery is not None
    assert answer.delivery.body == b"m1" and q.unacked == 1
    c.proxy.settle([answer.delivery], ACK)
    c.turn()
    assert q.acked == 1
    c.seen.clear()
    _, out = c.proxy.get(GROUP, "/", "1.1")
    c.carry(out)
    assert [e.delivery for e in c.seen if isinstance(e, GetAnswer)] == [None]  # empty


def test_a_get_ok_counts_what_is_left_ready_at_the_leader() -> None:
    broker, q = primary()  # five ready: a get leaves four, as a local get-ok says
    c = Cluster({"p": host_on(broker)})
    c.notice("p", 1)
    counts = []
    for _ in range(5):
        _, out = c.proxy.get(GROUP, "/", "1.1")
        c.carry(out)
        [answer] = [e for e in c.seen if isinstance(e, GetAnswer)]
        c.seen.clear()
        assert answer.delivery is not None
        counts.append(answer.message_count)
    assert counts == [4, 3, 2, 1, 0] and q.message_count == 0


def test_a_get_lost_with_its_link_is_answered_unavailable() -> None:
    broker, q = primary()
    c = Cluster({"p": host_on(broker)})
    c.notice("p", 1)
    request, out = c.proxy.get(GROUP, "/", "1.1")
    assert [e for e in c.proxy.link_lost("p")] == [GetAnswer(request, None, UNAVAILABLE)]
    c.carry(out)  # the answer, arriving after all, is nobody's
    assert [e for e in c.seen if isinstance(e, GetAnswer)] == []


def test_a_get_to_a_node_not_serving_is_refused() -> None:
    broker, _ = primary()
    host = ConsumerHost(GROUP, 1, BrokerForwardLog(broker, GROUP, lambda q: True),
                        serving=lambda: False)
    [reply] = host.receive("c", Get(GROUP, 1, "c.1", 7, 1, "/", "1.1", False))
    assert isinstance(reply, SendTo) and reply.packet == GetReply(GROUP, "c.1", 7, [],
                                                                  ErrorCode.NOT_PRIMARY, 0)


def test_the_cluster_links_codec_carries_the_packets() -> None:
    from brokerha.cluster.protocol import PacketCodec

    packets = [Consume(1, 2, "n1.1", 3, 1, "/", "1.1", 5, False, True, [4, 7]),
               Deliver(1, 2, "n1.1", 3, 1, [[4, True, "", "q", b"h", b"body"]]),
               Settle(1, 2, "n1.1", 3, 1, "/", "1.1", [4], ACK),
               Get(1, 2, "n1.1", 9, 1, "/", "1.1", False),
               GetReply(1, "n1.1", 9, [], "", 0),
               ConsumeError(1, "n1.1", 3, 1, NOT_FOUND, "gone"),
               Settled(1, 2, "n1.1", 3, "/", "1.1", [4]),
               Attached(1, "n1.1", 3, 1), Credit(1, 2, "n1.1", 3, 1, 10, 20),
               Settle(1, 2, "n1.1", 3, 1, "/", "1.1", [4], hand_how(REJECT, "g"))]
    codec = PacketCodec()
    data = b"".join(codec.encode(i, p) for i, p in enumerate(packets))
    assert [p for _, p in PacketCodec().feed(data)] == packets


def test_a_host_serving_again_after_a_lapse_hands_out_at_its_tick() -> None:
    broker, q = primary()
    serving = [True]
    host = ConsumerHost(GROUP, 1, BrokerForwardLog(broker, GROUP, lambda q: True),
                        serving=lambda: serving[0])
    serving[0] = False
    host.receive("c", Consume(GROUP, 1, "c.1", 1, 1, "/", "1.1", 2, False, False, []))
    assert host.flush() == []
    serving[0] = True
    host.redispatch()
    assert [len(e.packet.deliveries) for e in host.flush()
            if isinstance(e, SendTo) and isinstance(e.packet, Deliver)] == [2]
    # a settle of no known kind is not taken for an ack
    host.receive("c", Settle(GROUP, 1, "c.1", 1, 1, "/", "1.1", [1], "bogus"))
    assert q.acked == 0 and host.held() == 2


def test_a_delivery_on_its_way_when_the_host_takes_a_cancel_goes_back_to_the_queue() -> None:
    broker, q = primary()
    host = host_on(broker)
    c = Cluster({"p": host})
    c.notice("p", 1)
    consumer = consume(c, prefetch=1)
    [held] = c.delivered()
    # the ack frees credit: the host hands out position 2, whose Deliver is still on the way
    # when the client cancels
    c.proxy.settle([held], ACK)
    in_flight = host.receive("c", Settle(GROUP, 1, "c.1", consumer, 1, "/", "1.1", [1], ACK))
    c.proxy.settles.clear()
    late = [e for e in host.flush() if isinstance(e, SendTo) and isinstance(e.packet, Deliver)]
    assert [[d[0] for d in e.packet.deliveries] for e in late
            if isinstance(e.packet, Deliver)] == [[2]]
    c.carry(c.proxy.cancel(consumer))
    assert host.held() == 1 and q.consumer_count == 0
    c.carry(late, "p")
    assert c.delivered() == [] and c.proxy.stats.returned == 1
    c.turn()  # sent back as a requeue: nothing left held at the host
    assert host.held() == 0 and [e.position for e in q.ready][:1] == [2]
    assert in_flight  # (the ack's answer)


def test_large_bodies_go_in_parts_and_a_deliver_is_bounded_in_bytes() -> None:
    """A body over ``part_bytes`` goes as DeliverParts, then alone in its Deliver; the
    small ones around it in Delivers of at most ``max_bytes``; the proxy hands each to the
    channel whole, in the queue's order."""
    bodies = [b"s1", b"0123456789", b"s2s2", b"s3s3", b"s4"]
    broker, q = primary(bodies)
    header = len(message(b"").header)
    host = ConsumerHost(GROUP, 1, BrokerForwardLog(broker, GROUP, lambda q: True),
                        part_bytes=4, max_bytes=2 * (header + 4))
    proxy = ConsumerProxy("c.1")
    proxy.leader(LeaderNotice(GROUP, 1, "p"))
    _, out = proxy.consume(GROUP, "/", "1.1", 10)
    [attach] = [e.packet for e in out if isinstance(e, SendTo)]
    host.receive("c", attach)
    sent = [e.packet for e in host.flush() if isinstance(e, SendTo)]
    assert [type(p).__name__ for p in sent] == [
        "Deliver", "DeliverPart", "DeliverPart", "DeliverPart", "Deliver", "Deliver", "Deliver"]
    assert [len(p.deliveries) for p in sent if isinstance(p, Deliver)] == [1, 1, 2, 1]
    header_of_big = message(b"0123456789", persistent=True).header
    assert isinstance(sent[4], Deliver)
    assert sent[4].deliveries == [[2, False, "", "q", header_of_big, b"", 10]]
    assert host.stats.parts == 3
    got: list[Effect] = []
    for p in sent:
        got += proxy.receive("p", p)
    assert [e.delivery.body for e in got if isinstance(e, Delivered)] == bodies
    assert proxy.stats.parts == 3 and proxy.partial == {}


def test_a_body_missing_a_part_is_sent_back_and_comes_again_whole_and_flagged() -> None:
    broker, q = primary((b"0123456789",))
    host = ConsumerHost(GROUP, 1, BrokerForwardLog(broker, GROUP, lambda q: True),
                        part_bytes=4)
    proxy = ConsumerProxy("c.1")
    proxy.leader(LeaderNotice(GROUP, 1, "p"))
    _, out = proxy.consume(GROUP, "/", "1.1", 1)
    host.receive("c", out[0].packet)  # type: ignore[union-attr]
    sent = [e.packet for e in host.flush() if isinstance(e, SendTo)]
    got: list[Effect] = []
    for p in [sent[0], *sent[2:]]:  # the second part lost
        got += proxy.receive("p", p)
    assert got == [ConsumeAnswered(1)]  # (the Deliver came without its Attached here)
    assert proxy.stats.parts_lost == 1 and proxy.stats.incomplete == 1
    back: list[Effect] = []
    for e in proxy.flush():  # a requeue of it
        assert isinstance(e, SendTo) and isinstance(e.packet, Settle)
        assert e.packet.how == REQUEUE and e.packet.positions == [1]
        back += host.receive("c", e.packet)
    again = [e.packet for e in host.flush() if isinstance(e, SendTo)]
    for p in again:
        got += proxy.receive("p", p)
    [d] = [e.delivery for e in got if isinstance(e, Delivered)]
    assert (d.body, d.redelivered) == (b"0123456789", True)


def test_a_get_of_a_large_body_comes_in_parts() -> None:
    broker, q = primary((b"0123456789",))
    host = ConsumerHost(GROUP, 1, BrokerForwardLog(broker, GROUP, lambda q: True),
                        part_bytes=4)
    proxy = ConsumerProxy("c.1")
    proxy.leader(LeaderNotice(GROUP, 1, "p"))
    request, out = proxy.get(GROUP, "/", "1.1")
    sent = [e.packet for e in host.receive("c", out[0].packet)  # type: ignore[union-attr]
            if isinstance(e, SendTo)]
    assert [type(p).__name__ for p in sent] == ["DeliverPart"] * 3 + ["GetReply"]
    got: list[Effect] = []
    for p in sent:
        got += proxy.receive("p", p)
    [answer] = got
    assert isinstance(answer, GetAnswer) and answer.request == request
    assert answer.delivery is not None and answer.delivery.body == b"0123456789"
    assert q.unacked == 1


def test_the_cluster_links_codec_carries_the_parts() -> None:
    from brokerha.cluster.protocol import PacketCodec
    from brokerha.partition.forward import ForwardPart
    from brokerha.partition.remote_consumer import DeliverPart

    packets = [DeliverPart(1, 2, "n1.1", 3, 1, 4, 10, 4, b"4567"),
               ForwardPart(1, 2, "n1.1", 7, 10, 8, b"89"),
               Deliver(1, 2, "n1.1", 3, 1, [[4, True, "", "q", b"h", b"", 10]])]
    codec = PacketCodec()
    data = b"".join(codec.encode(i, p) for i, p in enumerate(packets))
    assert [p for _, p in PacketCodec().feed(data)] == packets


# -- a transaction's acks and rejects handed to its branch (issue 35 task F) ------------------


def handing(bodies: Sequence[bytes] = (b"m1", b"m2", b"m3")) -> tuple[
        Cluster, Queue, ConsumerHost, dict[BranchKey, Entry]]:
    broker, q = primary(bodies)
    branch: dict[BranchKey, Entry] = {}
    host = ConsumerHost(GROUP, 1, BrokerForwardLog(broker, GROUP, lambda q: True),
                        branches=lambda: branch)
    c = Cluster({"p": host})
    c.notice("p", 1)
    return c, q, host, branch


def test_a_hand_over_moves_what_the_consumer_held_to_the_branch_once() -> None:
    c, q, host, branch = handing()
    consumer = consume(c, prefetch=2)
    held = c.delivered()
    out = c.proxy.hand_over(held, ACK, "g1")
    assert [e.packet.how for e in out if isinstance(e, SendTo) and
            isinstance(e.packet, Settle)] == [hand_how(ACK, "g1")]
    assert handed_how(hand_how(REJECT, "g-2")) == (REJECT, "g-2") and handed_how(ACK) is None
    c.carry(out)
    c.turn()
    assert sorted(branch) == [("/", "q", 1), ("/", "q", 2)]
    # the consumer's credit came back: the next message is delivered (and held)
    assert [d.position for d in c.delivered()] == [3]
    assert host.held() == 1 and host.stats.handed == 2
    del branch[("/", "q", 1)]  # the branch's prepare took position 1
    host.release_handed(lambda gtxid, h: True)  # decided: what it did not take comes back
    assert host.handed == {} and host.stats.handed_back == 1
    host.release_handed(lambda gtxid, h: True)  # once
    c.turn()
    assert [(d.position, d.redelivered) for d in c.delivered()] == [(2, True)]
    assert q.message_count == 0 and host.stats.handed_back == 1
    # the proxy keeps the positions named until the commit is answered
    sub = c.proxy.subs[consumer]
    assert set(sub.held) == {1, 2, 3}
    c.proxy.handed_answered(held, committed=True)
    assert set(sub.held) == {3}


def test_a_refused_commit_keeps_the_positions_named_at_the_next_attach() -> None:
    c, q, host, branch = handing()
    consumer = consume(c, prefetch=2)
    held = c.delivered()
    c.carry(c.proxy.hand_over(held, REQUEUE, "g1"))
    c.proxy.handed_answered(held, committed=False)
    assert {1, 2} <= set(c.proxy.subs[consumer].held)


def test_a_hand_over_not_taken_comes_back_at_a_lost_link_or_the_role_s_end() -> None:
    c, q, host, branch = handing()
    consume(c, prefetch=3)
    held = c.delivered()
    c.carry(c.proxy.hand_over(held[:2], ACK, "g1"))
    host.release_handed(lambda gtxid, h: False)  # under way: kept for the branch
    assert len(branch) == 2 and q.message_count == 0
    host.link_lost("c")  # the coordinator's node (and the consumer's): all of it back
    assert branch == {} and sorted(e.position for e in q.ready) == [1, 2, 3]
    c2, q2, host2, branch2 = handing()
    consume(c2, prefetch=3)
    c2.carry(c2.proxy.hand_over(c2.delivered(), REJECT, "g2"))
    host2.stop()
    assert branch2 == {} and [e.position for e in q2.ready] == [1, 2, 3]


def test_a_hand_over_with_no_branch_here_is_requeued_and_a_stale_one_is_not_handed() -> None:
    broker, q = primary((b"m1", b"m2"))
    host = ConsumerHost(GROUP, 1, BrokerForwardLog(broker, GROUP, lambda q: True))
    c = Cluster({"p": host})
    c.notice("p", 1)
    consume(c, prefetch=1)
    [d] = c.delivered()
    c.carry(c.proxy.hand_over([d], ACK, "g1"))
    assert host.stats.handed_back == 1 and host.held() == 1  # m1 again (requeued), flagged
    [again] = c.delivered()
    assert again.position == 1 and again.redelivered
    c.notice("p", 2)  # a re-attach: the delivery of attachment 1 is stale
    assert c.proxy.hand_over([again], ACK, "g2") == []


def test_the_unsafe_hand_over_kept_leaves_it_held_too() -> None:
    broker, q = primary((b"m1",))
    branch: dict[BranchKey, Entry] = {}
    host = ConsumerHost(GROUP, 1, BrokerForwardLog(broker, GROUP, lambda q: True),
                        branches=lambda: branch, unsafe=Unsafe(hand_over_kept=True))
    c = Cluster({"p": host})
    c.notice("p", 1)
    consume(c, prefetch=1)
    c.carry(c.proxy.hand_over(c.delivered(), ACK, "g1"))
    assert len(branch) == 1 and host.held() == 1  # both hold it: a close requeues it


# -- credit: a qos changed after the consume, a no-ack consumer's window (task F item 3) ------


def test_a_prefetch_changed_after_the_consume_is_the_host_s_credit_at_once() -> None:
    broker, q = primary((b"m1", b"m2", b"m3", b"m4", b"m5"))
    c = Cluster({"p": host_on(broker)})
    c.notice("p", 1)
    consumer = consume(c, prefetch=1)
    assert [d.position for d in c.delivered()] == [1]
    out = c.proxy.credit(consumer, 3)
    assert [type(e.packet) for e in out if isinstance(e, SendTo)] == [Credit]
    c.carry(out)
    c.turn()
    assert [d.position for d in c.delivered()] == [2, 3]  # raised: three held
    c.carry(c.proxy.credit(consumer, 1))  # lowered: nothing more until below it
    c.proxy.settle([], ACK)
    assert c.delivered() == [] and q.message_count == 2
    assert c.proxy.subs[consumer].prefetch == 1  # the next attach's Consume carries it


def test_a_no_ack_consumer_takes_its_window_and_more_as_its_writes_are_granted() -> None:
    broker, q = primary([b"m%d" % i for i in range(NO_ACK_CREDIT + 50)])
    c = Cluster({"p": host_on(broker)})
    c.notice("p", 1)
    consumer, out = c.proxy.consume(GROUP, "/", "1.1", 0, no_ack=True)
    c.carry(out)
    c.turn()
    assert len(c.delivered()) == NO_ACK_CREDIT and q.message_count == 50
    c.carry(c.proxy.credit(consumer, 0, granted=20))  # written to the client: 20 more
    c.turn()
    assert len(c.delivered()) == 20 and q.message_count == 30
