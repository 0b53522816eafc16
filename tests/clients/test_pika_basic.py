"""pika BlockingConnection: publish/get/consume/ack, confirms, transactions, properties."""

from __future__ import annotations

import datetime
import decimal

import pika
import pytest

from .support import (
    channel_error,
    closed_by_broker,
    count_becomes,
    get_bodies,
    message_count,
    wait_for,
)

pytestmark = pytest.mark.timeout(30)


def test_declare_publish_get_ack(channel, names):
    q = names()
    ok = channel.queue_declare(q)
    assert (ok.method.queue, ok.method.message_count, ok.method.consumer_count) == (q, 0, 0)
    channel.basic_publish("", q, b"hello")
    channel.basic_publish("", q, b"world")
    method, props, body = channel.basic_get(q)
    assert body == b"hello" and method.delivery_tag == 1 and not method.redelivered
    assert method.exchange == "" and method.routing_key == q
    assert method.message_count == 1  # messages left after this one
    channel.basic_ack(method.delivery_tag)
    assert count_becomes(channel, q, 1) == 1
    assert get_bodies(channel, q) == [b"world"]


def test_basic_get_on_empty_queue_is_get_empty(channel, names):
    q = names()
    channel.queue_declare(q)
    assert channel.basic_get(q) == (None, None, None)


def test_ack_of_unknown_delivery_tag_is_406(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.basic_ack(42)
    with channel_error(406, "PRECONDITION_FAILED - unknown delivery tag 42"):
        channel.queue_declare(q, passive=True)


def test_consume_with_prefetch_limits_unacked_deliveries(conn, channel, names):
    q = names()
    channel.queue_declare(q)
    for i in range(10):
        channel.basic_publish("", q, b"%d" % i)
    channel.basic_qos(prefetch_count=3)
    got: list = []
    tag = channel.basic_consume(q, lambda ch, m, p, b: got.append((m, b)))
    wait_for(conn, lambda: len(got) >= 3)
    conn.process_data_events(time_limit=0.3)
    assert [b for _, b in got] == [b"0", b"1", b"2"]
    channel.basic_ack(got[0][0].delivery_tag)
    wait_for(conn, lambda: len(got) >= 4)
    conn.process_data_events(time_limit=0.3)
    assert len(got) == 4 and got[3][1] == b"3"
    channel.basic_ack(got[3][0].delivery_tag, multiple=True)  # acks 2..4 as well
    wait_for(conn, lambda: len(got) >= 7)
    conn.process_data_events(time_limit=0.3)
    assert [b for _, b in got] == [b"%d" % i for i in range(7)]
    channel.basic_cancel(tag)


@pytest.mark.parametrize("how", ["nack", "reject", "recover"])
def test_requeued_message_comes_back_redelivered(channel, names, how):
    q = names()
    channel.queue_declare(q)
    channel.basic_publish("", q, b"m1")
    channel.basic_publish("", q, b"m2")
    m1, _, _ = channel.basic_get(q)
    m2, _, _ = channel.basic_get(q)
    assert not m1.redelivered
    if how == "nack":
        channel.basic_nack(m2.delivery_tag, multiple=True, requeue=True)
    elif how == "reject":
        channel.basic_reject(m1.delivery_tag, requeue=True)
        channel.basic_reject(m2.delivery_tag, requeue=True)
    else:
        channel.basic_recover(requeue=True)
    again = []
    while (got := channel.basic_get(q, auto_ack=True))[0] is not None:
        again.append((got[2], got[0].redelivered))
    # requeued messages go back to their original positions
    assert again == [(b"m1", True), (b"m2", True)]


def test_nack_without_requeue_drops_message(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.basic_publish("", q, b"m")
    m, _, _ = channel.basic_get(q)
    channel.basic_nack(m.delivery_tag, requeue=False)
    assert message_count(channel, q) == 0


def test_mandatory_unroutable_publish_is_returned_312_no_route(conn, channel, names):
    returned = []
    channel.add_on_return_callback(lambda ch, m, p, b: returned.append((m, p, b)))
    channel.basic_publish("amq.direct", names("rk"), b"lost", mandatory=True,
                          properties=pika.BasicProperties(message_id="r1"))
    wait_for(conn, lambda: returned)
    method, props, body = returned[0]
    assert (method.reply_code, method.reply_text) == (312, "NO_ROUTE")
    assert method.exchange == "amq.direct" and body == b"lost" and props.message_id == "r1"


def test_non_mandatory_unroutable_publish_is_dropped_silently(conn, channel, names):
    returned = []
    channel.add_on_return_callback(lambda *a: returned.append(a))
    channel.basic_publish("amq.direct", names("rk"), b"lost")
    conn.process_data_events(time_limit=0.3)
    assert returned == []


def test_publisher_confirms_with_mandatory_return(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.confirm_delivery()
    for i in range(5):
        channel.basic_publish("", q, b"%d" % i)  # raises if nacked
    assert count_becomes(channel, q, 5) == 5
    with pytest.raises(pika.exceptions.UnroutableError) as info:
        channel.basic_publish("amq.direct", names("rk"), b"x", mandatory=True)
    assert info.value.messages[0].method.reply_code == 312


def test_publisher_nack_when_queue_rejects_publish(channel, names):
    q = names()
    channel.queue_declare(q, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
    channel.confirm_delivery()
    channel.basic_publish("", q, b"fits")
    with pytest.raises(pika.exceptions.NackError):
        channel.basic_publish("", q, b"overflows")
    assert get_bodies(channel, q) == [b"fits"]


def test_tx_publishes_take_effect_at_commit_and_not_at_rollback(connect, names):
    conn = connect()
    tx, observer = conn.channel(), conn.channel()
    q = names()
    tx.queue_declare(q)
    assert tx.tx_select().method.NAME == "Tx.SelectOk"
    tx.basic_publish("", q, b"a")
    tx.basic_publish("", q, b"b")
    assert message_count(observer, q) == 0
    tx.tx_commit()
    assert count_becomes(observer, q, 2) == 2
    tx.basic_publish("", q, b"c")
    tx.tx_rollback()
    tx.tx_commit()  # still transactional after rollback; nothing pending
    assert get_bodies(observer, q) == [b"a", b"b"]


def test_tx_acks_take_effect_at_commit_and_not_at_rollback(connect, names):
    conn = connect()
    ch = conn.channel()
    q = names()
    ch.queue_declare(q)
    for body in (b"a", b"b"):
        ch.basic_publish("", q, body)
    ch.tx_select()
    m1, _, _ = ch.basic_get(q)
    ch.basic_ack(m1.delivery_tag)
    ch.tx_rollback()
    # the ack was discarded: "a" is still unacked on this channel, so back on close
    m2, _, _ = ch.basic_get(q)
    ch.basic_ack(m2.delivery_tag)
    ch.tx_commit()
    ch.close()
    ch = conn.channel()
    got = []
    while (r := ch.basic_get(q, auto_ack=True))[0] is not None:
        got.append((r[2], r[0].redelivered))
    assert got == [(b"a", True)]


def test_tx_commit_without_select_is_406(channel):
    with channel_error(406, "PRECONDITION_FAILED - channel is not transactional"):
        channel.tx_commit()


def test_tx_rollback_without_select_is_406(channel):
    with channel_error(406, "PRECONDITION_FAILED - channel is not transactional"):
        channel.tx_rollback()


def test_confirm_after_tx_select_is_406(channel):
    channel.tx_select()
    with channel_error(406, "PRECONDITION_FAILED - cannot switch from tx to confirm mode"):
        channel.confirm_delivery()


def test_tx_select_after_confirm_is_406(channel):
    channel.confirm_delivery()
    with channel_error(406, "PRECONDITION_FAILED - cannot switch from confirm to tx mode"):
        channel.tx_select()


def test_message_properties_and_headers_round_trip_exactly(channel, names):
    q = names()
    channel.queue_declare(q)
    when = datetime.datetime(2024, 2, 29, 12, 30, 45, tzinfo=datetime.UTC)
    headers = {
        "str": "héllo wörld",
        "empty": "",
        "bytes": b"\x00\x01\xffraw",
        "int": 7,
        "negative": -123456,
        "int64": 2**40 + 3,
        "int64-negative": -(2**50),
        "true": True,
        "false": False,
        "void": None,
        "decimal": decimal.Decimal("3.14"),
        "timestamp": when,
        "table": {"nested": {"deeper": [1, "two", b"three", {"four": 4}]}},
        "array": [1, "x", None, True, [2, 3], decimal.Decimal("-1.5")],
        "empty-array": [],
        "empty-table": {},
    }
    props = pika.BasicProperties(
        content_type="application/json", content_encoding="gzip", headers=headers,
        delivery_mode=2, priority=7, correlation_id="corr-1", reply_to="reply.q",
        expiration="60000", message_id="msg-1", timestamp=1_700_000_000, type="order.created",
        user_id="guest", app_id="conformance", cluster_id="c1",
    )
    channel.basic_publish("", q, b"{}", properties=props)
    _, got, body = channel.basic_get(q, auto_ack=True)
    assert body == b"{}"
    for field in ("content_type", "content_encoding", "delivery_mode", "priority",
                  "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
                  "type", "user_id", "app_id", "cluster_id"):
        assert getattr(got, field) == getattr(props, field), field
    assert got.headers == headers
    assert type(got.headers["decimal"]) is decimal.Decimal


def test_empty_body_and_multi_frame_body_round_trip(channel, names):
    q = names()
    channel.queue_declare(q)
    big = bytes(range(256)) * 2048  # 512 KiB: several frames at frame_max 128 KiB
    channel.basic_publish("", q, b"")
    channel.basic_publish("", q, big)
    assert get_bodies(channel, q) == [b"", big]


def test_user_id_must_match_authenticated_user(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.basic_publish("", q, b"x", properties=pika.BasicProperties(user_id="mallory"))
    with channel_error(406, "PRECONDITION_FAILED - user_id property set to 'mallory' but "
                            "authenticated user was 'guest'"):
        channel.queue_declare(q, passive=True)


def test_qos_per_consumer_vs_global(connect, names):
    conn = connect()
    ch = conn.channel()
    qs = [names(), names()]
    for q in qs:
        ch.queue_declare(q)
        for i in range(5):
            ch.basic_publish("", q, b"%d" % i)

    def deliveries(global_qos: bool) -> dict[str, int]:
        c = conn.channel()
        c.basic_qos(prefetch_count=2, global_qos=global_qos)
        got = {q: 0 for q in qs}
        for q in qs:
            c.basic_consume(q, lambda ch_, m, p, b, q=q: got.__setitem__(q, got[q] + 1))
        wait_for(conn, lambda: sum(got.values()) >= (2 if global_qos else 4))
        conn.process_data_events(time_limit=0.4)
        c.close()  # requeues everything
        return got

    # per-consumer (global=false, RabbitMQ's reinterpretation): 2 for each consumer
    assert deliveries(False) == {qs[0]: 2, qs[1]: 2}
    # global=true: 2 shared by the whole channel
    assert sum(deliveries(True).values()) == 2


def test_heartbeat_is_negotiated_to_the_lower_nonzero_value(connect):
    offered = []

    def choose(connection, server_value):
        offered.append(server_value)
        return 5

    conn = connect(heartbeat=choose)
    assert offered == [60]  # RabbitMQ's default proposal
    assert conn._impl.params.heartbeat == 5
    conn.process_data_events(time_limit=0.1)
    assert conn.is_open


def test_channel_flow(channel):
    assert channel.flow(True) is True
    # RabbitMQ does not implement client-initiated flow control: a connection error
    with closed_by_broker(540, "NOT_IMPLEMENTED - active=false",
                          exc=pika.exceptions.ConnectionClosedByBroker):
        channel.flow(False)


def test_many_channels_on_one_connection(conn, names):
    q = names()
    chans = [conn.channel() for _ in range(20)]
    chans[0].queue_declare(q)
    for i, ch in enumerate(chans):
        ch.basic_publish("", q, b"%d" % i)
    assert sorted(get_bodies(chans[-1], q)) == sorted(b"%d" % i for i in range(20))
    assert len({ch.channel_number for ch in chans}) == 20


def test_closing_channel_requeues_unacked(connect, names):
    conn = connect()
    ch = conn.channel()
    q = names()
    ch.queue_declare(q)
    ch.basic_publish("", q, b"x")
    ch.basic_get(q)
    ch.close()
    ch2 = conn.channel()
    m, _, body = ch2.basic_get(q, auto_ack=True)
    assert body == b"x" and m.redelivered


def test_no_ack_consumer_with_explicit_tag_and_cancel(conn, channel, names):
    q = names()
    channel.queue_declare(q)
    for i in range(3):
        channel.basic_publish("", q, b"%d" % i)
    got = []
    tag = channel.basic_consume(q, lambda ch, m, p, b: got.append((m.consumer_tag, b)),
                                auto_ack=True, consumer_tag="my-tag")
    assert tag == "my-tag"
    wait_for(conn, lambda: len(got) == 3)
    assert got == [("my-tag", b"0"), ("my-tag", b"1"), ("my-tag", b"2")]
    channel.basic_cancel(tag)
    channel.basic_publish("", q, b"after-cancel")
    conn.process_data_events(time_limit=0.2)
    assert len(got) == 3
    assert count_becomes(channel, q, 1) == 1  # nothing unacked: auto-ack removed them
