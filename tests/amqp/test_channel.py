"""Channel semantics: confirms, prefetch, acks in transactions, consumers."""

from __future__ import annotations

from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.amqp.confirms import ConfirmTracker
from tests.amqp.wire import Wire


def test_confirm_tracker_coalesces_in_order() -> None:
    t = ConfirmTracker()
    tags = [t.issue() for _ in range(5)]
    t.settle(2, True)
    assert t.drain() == []  # tag 1 still waiting holds back tag 2
    t.settle(1, True)
    t.settle(3, False)
    t.settle(5, True)
    assert t.drain() == [(2, True, True), (3, False, False)]
    t.settle(4, True)
    assert t.drain() == [(5, True, True)]
    assert tags == [1, 2, 3, 4, 5]


def test_confirms_are_one_multiple_ack_per_flush() -> None:
    w = Wire().connected()
    w.method(1, commands.Confirm.Select())
    w.expect(commands.Confirm.SelectOk)
    w.method(1, commands.Queue.Declare(queue="q"))
    w.methods()
    for i in range(10):
        w.publish(1, "", "q", b"%d" % i)
    acks = [m for m in w.methods() if isinstance(m, commands.Basic.Ack)]
    assert [(a.delivery_tag, a.multiple) for a in acks] == [(10, True)]


def test_nack_when_the_queue_refuses() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q", arguments={"x-max-length": 1,
                                                             "x-overflow": "reject-publish"}))
    w.method(1, commands.Confirm.Select())
    w.methods()
    w.publish(1, "", "q", b"1")
    w.publish(1, "", "q", b"2")
    out = [(type(m).__name__, m.delivery_tag) for m in w.methods()]
    assert out == [("Ack", 1), ("Nack", 2)]


def test_unroutable_mandatory_returns_then_acks() -> None:
    w = Wire().connected()
    w.method(1, commands.Confirm.Select())
    w.methods()
    w.publish(1, "", "nowhere", b"x", mandatory=True)
    out = w.methods()
    assert isinstance(out[0], commands.Basic.Return) and out[0].reply_code == C.NO_ROUTE
    assert isinstance(out[1], commands.Basic.Ack)


def test_tx_and_confirm_modes_exclude_each_other() -> None:
    w = Wire().connected()
    w.method(1, commands.Tx.Select())
    w.method(1, commands.Confirm.Select())
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.PRECONDITION_FAILED
    assert "cannot switch from tx to confirm mode" in close.reply_text


def test_prefetch_limits_unacked_deliveries() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    for i in range(5):
        w.publish(1, "", "q", b"%d" % i)
    w.method(1, commands.Basic.Qos(prefetch_count=2))
    w.method(1, commands.Basic.Consume(queue="q", consumer_tag="c"))
    delivered = [m for m in w.methods() if isinstance(m, commands.Basic.Deliver)]
    assert [d.delivery_tag for d in delivered] == [1, 2]
    w.method(1, commands.Basic.Ack(delivery_tag=2, multiple=True))
    delivered = [m for m in w.methods() if isinstance(m, commands.Basic.Deliver)]
    assert [d.delivery_tag for d in delivered] == [3, 4]


def test_consume_ok_precedes_the_first_delivery() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.publish(1, "", "q", b"x")
    w.methods()
    w.method(1, commands.Basic.Consume(queue="q", consumer_tag="c"))
    names = [type(m).__name__ for m in w.methods()]
    assert names == ["ConsumeOk", "Deliver"]


def test_rolled_back_acks_are_outstanding_again() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.publish(1, "", "q", b"x")
    w.method(1, commands.Tx.Select())
    w.method(1, commands.Basic.Get(queue="q"))
    w.method(1, commands.Basic.Ack(delivery_tag=1))
    w.method(1, commands.Tx.Rollback())
    w.expect(commands.Tx.RollbackOk)
    w.method(1, commands.Basic.Ack(delivery_tag=1))  # still a known tag
    w.method(1, commands.Tx.Commit())
    w.expect(commands.Tx.CommitOk)
    q = w.broker.vhosts["/"].queues["q"]
    assert q.message_count == 0 and q.unacked == 0


def test_unknown_delivery_tag_is_406() -> None:
    w = Wire().connected()
    w.method(1, commands.Basic.Ack(delivery_tag=42))
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.PRECONDITION_FAILED
    assert "unknown delivery tag 42" in close.reply_text


def test_closing_a_channel_requeues_its_unacked_messages() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.publish(1, "", "q", b"x")
    w.method(1, commands.Basic.Get(queue="q"))
    w.method(1, commands.Channel.Close(reply_code=200, reply_text="", class_id=0, method_id=0))
    w.expect(commands.Channel.CloseOk)
    w.open_channel(2)
    w.method(2, commands.Basic.Get(queue="q"))
    ok = w.expect(commands.Basic.GetOk)
    assert ok.redelivered


def test_deleting_a_queue_cancels_its_consumers() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.method(1, commands.Basic.Consume(queue="q", consumer_tag="c"))
    w.methods()
    w.open_channel(2)
    w.method(2, commands.Queue.Delete(queue="q"))
    cancels = [m for m in w.methods() if isinstance(m, commands.Basic.Cancel)]
    assert [c.consumer_tag for c in cancels] == ["c"]


def test_reusing_a_consumer_tag_is_530() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.method(1, commands.Basic.Consume(queue="q", consumer_tag="c"))
    w.method(1, commands.Basic.Consume(queue="q", consumer_tag="c"))
    close = w.expect(commands.Connection.Close)
    assert close.reply_code == C.NOT_ALLOWED


def test_exclusive_queue_is_locked_for_other_connections() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="mine", exclusive=True))
    other = Wire(w.broker).connected()
    other.method(1, commands.Basic.Consume(queue="mine"))
    close = other.expect(commands.Channel.Close)
    assert close.reply_code == C.RESOURCE_LOCKED
    w.conn.connection_lost()
    assert "mine" not in w.broker.vhosts["/"].queues


def test_the_owner_redeclaring_its_exclusive_queue_without_exclusive_is_405() -> None:
    """RabbitMQ checks the declare's owner before the fields (aiormq's test_exclusive_queue_locked)."""
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="mine", exclusive=True, durable=True))
    assert w.expect(commands.Queue.DeclareOk).queue == "mine"
    assert not w.broker.vhosts["/"].queues["mine"].durable  # exclusive: never durable
    w.method(1, commands.Queue.Declare(queue="mine", exclusive=True))
    w.expect(commands.Queue.DeclareOk)
    w.method(1, commands.Queue.Declare(queue="mine"))
    assert w.expect(commands.Channel.Close).reply_code == C.RESOURCE_LOCKED
    w.open_channel(2)
    w.method(2, commands.Queue.Declare(queue="shared"))
    w.expect(commands.Queue.DeclareOk)
    w.method(2, commands.Queue.Declare(queue="shared", exclusive=True))
    assert w.expect(commands.Channel.Close).reply_code == C.RESOURCE_LOCKED


def test_forbidden_operation_is_403_on_the_channel() -> None:
    w = Wire()
    w.broker.users.add_user("alice", "pw")
    w.broker.users.set_permissions("alice", "/", configure="^alice-", write=".*", read=".*")
    w.handshake(user="alice", password="pw")
    w.open_channel()
    w.method(1, commands.Queue.Declare(queue="bob-q"))
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.ACCESS_REFUSED
    assert "refused for user 'alice'" in close.reply_text
    w.open_channel(2)
    w.method(2, commands.Queue.Declare(queue="alice-q"))
    w.expect(commands.Queue.DeclareOk)


def test_redeclare_with_other_arguments_is_406() -> None:
    w = Wire().connected()
    w.method(1, commands.Queue.Declare(queue="q", durable=True))
    w.method(1, commands.Queue.Declare(queue="q", durable=False))
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.PRECONDITION_FAILED
    assert "inequivalent arg 'durable'" in close.reply_text


def test_reserved_amq_names_are_403() -> None:
    w = Wire().connected()
    w.method(1, commands.Exchange.Declare(exchange="amq.mine"))
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.ACCESS_REFUSED


def test_publish_to_a_missing_exchange_is_404() -> None:
    w = Wire().connected()
    w.publish(1, "missing", "k", b"x")
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.NOT_FOUND
    assert close.class_id == 60 and close.method_id == 40


def test_large_bodies_are_split_at_the_clients_frame_max() -> None:
    w = Wire()
    w.handshake(frame_max=4096)
    w.open_channel()
    w.method(1, commands.Queue.Declare(queue="q"))
    body = bytes(range(256)) * 40
    w.method(1, commands.Basic.Publish(exchange="", routing_key="q"))
    from pamqp import body as pbody
    from pamqp import frame, header
    w.raw(frame.marshal(header.ContentHeader(0, len(body), commands.Basic.Properties()), 1))
    for i in range(0, len(body), 4000):
        w.raw(frame.marshal(pbody.ContentBody(body[i:i + 4000]), 1))
    w.methods()
    w.method(1, commands.Basic.Get(queue="q"))
    frames = w.frames()
    parts = [v.value for _, v in frames if isinstance(v, pbody.ContentBody)]
    assert b"".join(parts) == body and len(parts) == 3
