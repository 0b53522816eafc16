"""pika BlockingConnection: queue declare/delete/purge, exclusivity, TTLs, limits,
dead-lettering, priorities and consumer life cycle."""

from __future__ import annotations

import time

import pika
import pytest

from .support import channel_error, get_bodies, message_count, queue_exists, wait_for

pytestmark = pytest.mark.timeout(30)


def test_server_named_queue(channel):
    ok = channel.queue_declare("", exclusive=True)
    assert ok.method.queue.startswith("amq.gen-")
    assert channel.queue_declare(ok.method.queue, passive=True).method.queue == ok.method.queue


def test_amq_prefix_is_reserved_for_queues_403(channel, names):
    name = "amq." + names()
    with channel_error(403, f"ACCESS_REFUSED - queue name '{name}' contains reserved "
                            "prefix 'amq.*'"):
        channel.queue_declare(name)


def test_passive_declare_of_missing_queue_is_404(channel, names):
    q = names()
    with channel_error(404, f"NOT_FOUND - no queue '{q}' in vhost '/'"):
        channel.queue_declare(q, passive=True)


def test_passive_declare_reports_counts(connect, names):
    conn = connect()
    ch = conn.channel()
    q = names()
    ch.queue_declare(q)
    for _ in range(3):
        ch.basic_publish("", q, b"x")
    other = connect().channel()
    other.basic_consume(q, lambda *a: None)
    wait_for(other.connection, lambda: message_count(ch, q) == 0)
    ok = ch.queue_declare(q, passive=True).method
    # delivered-but-unacked messages are not counted; the consumer is
    assert (ok.message_count, ok.consumer_count) == (0, 1)


def test_redeclare_queue_with_other_arguments_is_406(channel, names):
    q = names()
    channel.queue_declare(q, arguments={"x-message-ttl": 1000})
    channel.queue_declare(q, arguments={"x-message-ttl": 1000})  # equivalent: fine
    with channel_error(406, f"PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for "
                            f"queue '{q}' in vhost '/'"):
        channel.queue_declare(q, arguments={"x-message-ttl": 2000})


def test_redeclare_queue_with_other_durability_is_406(channel, names):
    q = names()
    channel.queue_declare(q, durable=False)
    with channel_error(406, f"PRECONDITION_FAILED - inequivalent arg 'durable' for queue "
                            f"'{q}' in vhost '/': received 'true' but current is 'false'"):
        channel.queue_declare(q, durable=True)


def test_invalid_queue_argument_is_406(channel, names):
    with channel_error(406, "PRECONDITION_FAILED - invalid arg 'x-max-length'"):
        channel.queue_declare(names(), arguments={"x-max-length": -1})


def test_purge_returns_count(channel, names):
    q = names()
    channel.queue_declare(q)
    for _ in range(4):
        channel.basic_publish("", q, b"x")
    assert channel.queue_purge(q).method.message_count == 4
    assert message_count(channel, q) == 0


def test_delete_returns_count_and_missing_queue_delete_is_ok(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.basic_publish("", q, b"x")
    assert channel.queue_delete(q).method.message_count == 1
    assert channel.queue_delete(q).method.message_count == 0  # RabbitMQ: idempotent


def test_delete_if_empty_is_406_when_not_empty(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.basic_publish("", q, b"x")
    with channel_error(406, f"PRECONDITION_FAILED - queue '{q}' in vhost '/' not empty"):
        channel.queue_delete(q, if_empty=True)


def test_delete_if_unused_is_406_when_consumed(connect, names):
    conn = connect()
    consumer = conn.channel()
    q = names()
    consumer.queue_declare(q)
    consumer.basic_consume(q, lambda *a: None)
    ch = conn.channel()
    with channel_error(406, f"PRECONDITION_FAILED - queue '{q}' in vhost '/' in use"):
        ch.queue_delete(q, if_unused=True)
    assert queue_exists(conn, q)


def test_exclusive_queue_from_another_connection_is_405(connect, names):
    owner = connect().channel()
    q = names()
    owner.queue_declare(q, exclusive=True)
    other = connect()
    for op in (lambda ch: ch.queue_declare(q, passive=True),
               lambda ch: ch.basic_consume(q, lambda *a: None),
               lambda ch: ch.queue_delete(q),
               lambda ch: ch.queue_purge(q),
               lambda ch: ch.queue_bind(q, "amq.direct", "k")):
        with channel_error(405, f"RESOURCE_LOCKED - cannot obtain exclusive access to "
                                f"locked queue '{q}' in vhost '/'"):
            op(other.channel())
    # publishing to it from elsewhere is allowed
    other.channel().basic_publish("", q, b"x")
    assert wait_for(owner.connection, lambda: message_count(owner, q) == 1)


def test_exclusive_queue_is_deleted_with_its_connection(connect, names):
    owner = connect()
    q = names()
    owner.channel().queue_declare(q, exclusive=True)
    owner.close()
    assert not queue_exists(connect(), q)


def test_auto_delete_queue_removed_after_last_consumer_cancels(connect, names):
    conn = connect()
    ch = conn.channel()
    q = names()
    ch.queue_declare(q, auto_delete=True)
    t1 = ch.basic_consume(q, lambda *a: None)
    t2 = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(t1)
    assert queue_exists(conn, q)
    ch.basic_cancel(t2)
    assert not queue_exists(conn, q)


def test_auto_delete_queue_without_consumers_stays(connect, names):
    conn = connect()
    q = names()
    conn.channel().queue_declare(q, auto_delete=True)
    time.sleep(0.2)
    assert queue_exists(conn, q)


def test_server_cancels_consumer_when_queue_deleted(connect, names):
    conn = connect()
    ch = conn.channel()
    q = names()
    ch.queue_declare(q)
    cancelled = []
    ch.add_on_cancel_callback(lambda method: cancelled.append(method.method.consumer_tag))
    tag = ch.basic_consume(q, lambda *a: None)
    connect().channel().queue_delete(q)
    assert wait_for(conn, lambda: cancelled) == [tag]
    assert ch.is_open
    ch.queue_declare("", exclusive=True)  # channel still usable


def test_exclusive_consumer_refuses_second_consumer_403(connect, names):
    ch = connect().channel()
    q = names()
    ch.queue_declare(q)
    ch.basic_consume(q, lambda *a: None, exclusive=True)
    other = connect().channel()
    with channel_error(403, f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use"):
        other.basic_consume(q, lambda *a: None)


def test_exclusive_consume_on_queue_with_consumers_is_403(connect, names):
    ch = connect().channel()
    q = names()
    ch.queue_declare(q)
    ch.basic_consume(q, lambda *a: None)
    other = connect().channel()
    with channel_error(403, f"ACCESS_REFUSED - queue '{q}' in vhost '/' in exclusive use"):
        other.basic_consume(q, lambda *a: None, exclusive=True)


def test_consume_from_missing_queue_is_404(channel, names):
    q = names()
    with channel_error(404, f"NOT_FOUND - no queue '{q}' in vhost '/'"):
        channel.basic_consume(q, lambda *a: None)


def test_queue_message_ttl_expires_messages(channel, names):
    q = names()
    channel.queue_declare(q, arguments={"x-message-ttl": 200})
    channel.basic_publish("", q, b"x")
    time.sleep(0.6)
    assert channel.basic_get(q)[0] is None


def test_per_message_expiration(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.basic_publish("", q, b"short", properties=pika.BasicProperties(expiration="100"))
    channel.basic_publish("", q, b"long", properties=pika.BasicProperties(expiration="60000"))
    time.sleep(0.4)
    assert get_bodies(channel, q) == [b"long"]


def test_zero_ttl_message_is_not_kept(channel, names):
    q = names()
    channel.queue_declare(q, arguments={"x-message-ttl": 0})
    channel.basic_publish("", q, b"x")
    assert channel.basic_get(q)[0] is None


def test_queue_expires_when_unused(conn, channel, names):
    q = names()
    channel.queue_declare(q, arguments={"x-expires": 300})
    time.sleep(1.2)
    assert not queue_exists(conn, q)


def test_queue_with_consumer_does_not_expire(connect, names):
    conn = connect()
    ch = conn.channel()
    q = names()
    ch.queue_declare(q, arguments={"x-expires": 300})
    ch.basic_consume(q, lambda *a: None)
    conn.process_data_events(time_limit=1.0)
    assert queue_exists(connect(), q)


def test_max_length_drops_head(channel, names):
    q = names()
    channel.queue_declare(q, arguments={"x-max-length": 2})
    for body in (b"1", b"2", b"3", b"4"):
        channel.basic_publish("", q, body)
    assert get_bodies(channel, q) == [b"3", b"4"]


def test_max_length_drop_head_dead_letters_dropped(channel, names):
    q, dlq = names(), names("dlq")
    channel.queue_declare(dlq)
    channel.queue_declare(q, arguments={"x-max-length": 1, "x-dead-letter-exchange": "",
                                        "x-dead-letter-routing-key": dlq})
    channel.basic_publish("", q, b"1")
    channel.basic_publish("", q, b"2")
    assert get_bodies(channel, q) == [b"2"]
    _, props, body = channel.basic_get(dlq, auto_ack=True)
    assert body == b"1" and props.headers["x-death"][0]["reason"] == "maxlen"


def _dead_letter_setup(channel, names, **queue_args):
    dlx, dlq, q = names("dlx"), names("dlq"), names("src")
    channel.exchange_declare(dlx, "direct")
    channel.queue_declare(dlq)
    channel.queue_bind(dlq, dlx, "dead")
    channel.queue_declare(q, arguments={"x-dead-letter-exchange": dlx,
                                        "x-dead-letter-routing-key": "dead", **queue_args})
    return dlx, dlq, q


def test_dead_letter_on_reject(channel, names):
    dlx, dlq, q = _dead_letter_setup(channel, names)
    channel.basic_publish("", q, b"bad", properties=pika.BasicProperties(
        headers={"app": "v"}, message_id="m1"))
    m, _, _ = channel.basic_get(q)
    channel.basic_reject(m.delivery_tag, requeue=False)
    method, props, body = wait_for(channel.connection,
                                   lambda: (r := channel.basic_get(dlq, auto_ack=True))[0] and r)
    assert body == b"bad" and props.message_id == "m1"
    assert method.exchange == dlx and method.routing_key == "dead"
    assert props.headers["app"] == "v"
    death = props.headers["x-death"]
    assert len(death) == 1
    d = death[0]
    assert (d["reason"], d["queue"], d["exchange"], d["routing-keys"], d["count"]) == \
        ("rejected", q, "", [q], 1)
    assert "time" in d
    assert props.headers["x-first-death-reason"] == "rejected"
    assert props.headers["x-first-death-queue"] == q
    assert props.headers["x-first-death-exchange"] == ""


def test_dead_letter_on_nack_keeps_original_routing_key_without_dlrk(channel, names):
    dlx, dlq = names("dlx"), names("dlq")
    channel.exchange_declare(dlx, "fanout")
    channel.queue_declare(dlq)
    channel.queue_bind(dlq, dlx)
    q = names()
    channel.queue_declare(q, arguments={"x-dead-letter-exchange": dlx})
    channel.basic_publish("", q, b"x")
    m, _, _ = channel.basic_get(q)
    channel.basic_nack(m.delivery_tag, requeue=False)
    method, props, _ = wait_for(channel.connection,
                                lambda: (r := channel.basic_get(dlq, auto_ack=True))[0] and r)
    assert method.routing_key == q
    assert props.headers["x-death"][0]["reason"] == "rejected"


def test_dead_letter_on_ttl_expiry(channel, names):
    dlx, dlq, q = _dead_letter_setup(channel, names, **{"x-message-ttl": 100})
    channel.basic_publish("", q, b"late")
    method, props, body = wait_for(channel.connection,
                                   lambda: (r := channel.basic_get(dlq, auto_ack=True))[0] and r)
    assert body == b"late"
    d = props.headers["x-death"][0]
    assert (d["reason"], d["queue"], d["count"], d["routing-keys"]) == ("expired", q, 1, [q])
    # the per-message expiration is removed once the message is dead-lettered
    assert props.expiration is None


def test_dead_letter_per_message_expiration_records_original_expiration(channel, names):
    dlx, dlq, q = _dead_letter_setup(channel, names)
    channel.basic_publish("", q, b"late", properties=pika.BasicProperties(expiration="50"))
    time.sleep(0.2)
    assert channel.basic_get(q)[0] is None  # expiry is checked when the head is read
    _, props, _ = wait_for(channel.connection,
                           lambda: (r := channel.basic_get(dlq, auto_ack=True))[0] and r)
    d = props.headers["x-death"][0]
    assert d["reason"] == "expired" and d["original-expiration"] == "50"
    assert props.expiration is None


def test_max_priority_orders_delivery(channel, names):
    q = names()
    channel.queue_declare(q, arguments={"x-max-priority": 10})
    for prio in (1, 5, None, 9, 5, 20):
        channel.basic_publish("", q, str(prio).encode(),
                              properties=pika.BasicProperties(priority=prio))
    # higher first, FIFO within a priority, none = 0, above max treated as max
    assert get_bodies(channel, q) == [b"20", b"9", b"5", b"5", b"1", b"None"]


def test_queue_without_max_priority_ignores_priority(channel, names):
    q = names()
    channel.queue_declare(q)
    for prio in (1, 9, 5):
        channel.basic_publish("", q, str(prio).encode(),
                              properties=pika.BasicProperties(priority=prio))
    assert get_bodies(channel, q) == [b"1", b"9", b"5"]


def test_unbind_queue(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.queue_bind(q, "amq.direct", "k")
    channel.basic_publish("amq.direct", "k", b"1")
    channel.queue_unbind(q, "amq.direct", "k")
    channel.basic_publish("amq.direct", "k", b"2")
    channel.queue_unbind(q, "amq.direct", "never-bound")  # RabbitMQ: ok
    assert get_bodies(channel, q) == [b"1"]
