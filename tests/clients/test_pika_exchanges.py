"""pika BlockingConnection: exchange types, bindings, alternate/internal exchanges, errors."""

from __future__ import annotations

import pika
import pytest

from .support import channel_error, connection_error, exchange_exists, get_bodies

pytestmark = pytest.mark.timeout(30)


def bound_queues(ch, names, exchange: str, bindings: dict[str, list]) -> dict[str, str]:
    """Declare one queue per label, bound with each (routing_key, arguments) given."""
    queues = {}
    for label, specs in bindings.items():
        q = names(label)
        ch.queue_declare(q)
        for key, args in specs:
            ch.queue_bind(q, exchange, routing_key=key, arguments=args)
        queues[label] = q
    return queues


def drain(ch, queues: dict[str, str]) -> dict[str, list[bytes]]:
    return {label: get_bodies(ch, q) for label, q in queues.items()}


def test_default_exchange_routes_by_queue_name_and_cannot_be_bound(channel, names):
    q = names()
    channel.queue_declare(q)
    channel.basic_publish("", q, b"x")
    assert get_bodies(channel, q) == [b"x"]
    with channel_error(403, "ACCESS_REFUSED - operation not permitted on the default exchange"):
        channel.queue_bind(q, "", routing_key="other")


def test_predeclared_amq_exchanges_exist(conn):
    for name in ("amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"):
        assert exchange_exists(conn, name), name


def test_direct_exchange(channel, names):
    x = names("x")
    channel.exchange_declare(x, "direct")
    qs = bound_queues(channel, names, x, {"a": [("red", None)], "b": [("red", None),
                                                                   ("green", None)]})
    for key in ("red", "green", "blue"):
        channel.basic_publish(x, key, key.encode())
    assert drain(channel, qs) == {"a": [b"red"], "b": [b"red", b"green"]}


def test_fanout_exchange_ignores_routing_key(channel, names):
    x = names("x")
    channel.exchange_declare(x, "fanout")
    qs = bound_queues(channel, names, x, {"a": [("", None)], "b": [("whatever", None)]})
    channel.basic_publish(x, "any.key", b"m")
    assert drain(channel, qs) == {"a": [b"m"], "b": [b"m"]}


def test_topic_exchange_star_and_hash(channel, names):
    x = names("x")
    channel.exchange_declare(x, "topic")
    qs = bound_queues(channel, names, x, {
        "star": [("stock.*.nyse", None)],
        "hash": [("stock.#", None)],
        "all": [("#", None)],
        "mid": [("*.usd.#", None)],
        "exact": [("stock.usd.nyse", None)],
    })
    for key in ("stock.usd.nyse", "stock.eur", "stock", "fx.usd", "fx.usd.spot.now",
                "stock.usd.nyse.extra", ""):
        channel.basic_publish(x, key, key.encode() or b"<empty>")
    assert drain(channel, qs) == {
        "star": [b"stock.usd.nyse"],
        "hash": [b"stock.usd.nyse", b"stock.eur", b"stock", b"stock.usd.nyse.extra"],
        "all": [b"stock.usd.nyse", b"stock.eur", b"stock", b"fx.usd", b"fx.usd.spot.now",
                b"stock.usd.nyse.extra", b"<empty>"],
        "mid": [b"stock.usd.nyse", b"fx.usd", b"fx.usd.spot.now", b"stock.usd.nyse.extra"],
        "exact": [b"stock.usd.nyse"],
    }


def test_headers_exchange_x_match_all_and_any(channel, names):
    x = names("x")
    channel.exchange_declare(x, "headers")
    qs = bound_queues(channel, names, x, {
        "all": [("", {"x-match": "all", "format": "pdf", "type": "report"})],
        "any": [("", {"x-match": "any", "format": "pdf", "type": "log"})],
        "default": [("", {"format": "zip"})],  # x-match defaults to all
    })

    def pub(body: bytes, headers: dict) -> None:
        channel.basic_publish(x, "ignored", body,
                              properties=pika.BasicProperties(headers=headers))

    pub(b"pdf-report", {"format": "pdf", "type": "report", "extra": 1})
    pub(b"pdf-only", {"format": "pdf"})
    pub(b"log", {"type": "log"})
    pub(b"zip", {"format": "zip"})
    pub(b"none", {})
    assert drain(channel, qs) == {
        "all": [b"pdf-report"],
        "any": [b"pdf-report", b"pdf-only", b"log"],
        "default": [b"zip"],
    }


def test_exchange_to_exchange_bind_and_unbind(channel, names):
    src, dst = names("src"), names("dst")
    channel.exchange_declare(src, "topic")
    channel.exchange_declare(dst, "fanout")
    q = names()
    channel.queue_declare(q)
    channel.queue_bind(q, dst)
    channel.exchange_bind(destination=dst, source=src, routing_key="a.*")
    channel.basic_publish(src, "a.b", b"routed")
    channel.basic_publish(src, "b.b", b"not-routed")
    assert get_bodies(channel, q) == [b"routed"]
    channel.exchange_unbind(destination=dst, source=src, routing_key="a.*")
    channel.basic_publish(src, "a.b", b"after-unbind")
    assert get_bodies(channel, q) == []


def test_alternate_exchange_receives_unroutable(conn, channel, names):
    ae, main = names("ae"), names("main")
    channel.exchange_declare(ae, "fanout")
    channel.exchange_declare(main, "direct", arguments={"alternate-exchange": ae})
    routed, lost = names("routed"), names("lost")
    for q in (routed, lost):
        channel.queue_declare(q)
    channel.queue_bind(routed, main, "known")
    channel.queue_bind(lost, ae)
    returned = []
    channel.add_on_return_callback(lambda *a: returned.append(a))
    channel.basic_publish(main, "known", b"1", mandatory=True)
    channel.basic_publish(main, "unknown", b"2", mandatory=True)
    conn.process_data_events(time_limit=0.3)
    assert returned == []  # routed via the AE counts as routed
    assert get_bodies(channel, routed) == [b"1"]
    assert get_bodies(channel, lost) == [b"2"]


def test_internal_exchange_rejects_publish_403(channel, names):
    internal, front = names("internal"), names("front")
    channel.exchange_declare(internal, "fanout", internal=True)
    channel.exchange_declare(front, "fanout")
    channel.exchange_bind(destination=internal, source=front)
    q = names()
    channel.queue_declare(q)
    channel.queue_bind(q, internal)
    channel.basic_publish(front, "", b"via-binding")  # reaching it through a binding is fine
    assert get_bodies(channel, q) == [b"via-binding"]
    channel.basic_publish(internal, "", b"direct")
    with channel_error(403, f"ACCESS_REFUSED - cannot publish to internal exchange "
                            f"'{internal}' in vhost '/'"):
        channel.queue_declare(q, passive=True)


def test_amq_prefix_is_reserved_for_exchanges_403(channel, names):
    name = "amq." + names("x")
    with channel_error(403, f"ACCESS_REFUSED - exchange name '{name}' contains reserved "
                            "prefix 'amq.*'"):
        channel.exchange_declare(name, "direct")


def test_amq_prefix_passive_declare_of_existing_is_allowed(channel):
    channel.exchange_declare("amq.direct", "direct", passive=True)
    channel.exchange_declare("amq.direct", "direct", durable=True)  # equivalent: ok


def test_passive_declare_of_missing_exchange_is_404(channel, names):
    x = names("x")
    with channel_error(404, f"NOT_FOUND - no exchange '{x}' in vhost '/'"):
        channel.exchange_declare(x, passive=True)


def test_redeclare_exchange_with_other_type_is_406(channel, names):
    x = names("x")
    channel.exchange_declare(x, "direct")
    with channel_error(406, f"PRECONDITION_FAILED - inequivalent arg 'type' for exchange "
                            f"'{x}' in vhost '/': received 'fanout' but current is 'direct'"):
        channel.exchange_declare(x, "fanout")


def test_redeclare_exchange_with_other_durability_is_406(channel, names):
    x = names("x")
    channel.exchange_declare(x, "direct")
    with channel_error(406, f"inequivalent arg 'durable' for exchange '{x}' in vhost '/'"):
        channel.exchange_declare(x, "direct", durable=True)


def test_unknown_exchange_type_is_503_command_invalid(conn, names):
    # RabbitMQ treats an unknown exchange type as a connection error
    ch = conn.channel()
    with connection_error(503, "COMMAND_INVALID - unknown exchange type 'no-such-type'"):
        ch.exchange_declare(names("x"), "no-such-type")


def test_publish_to_missing_exchange_is_404(channel, names):
    x = names("x")
    channel.basic_publish(x, "rk", b"x")
    with channel_error(404, f"NOT_FOUND - no exchange '{x}' in vhost '/'"):
        channel.queue_declare("", exclusive=True)


def test_bind_to_missing_exchange_is_404(channel, names):
    q, x = names(), names("x")
    channel.queue_declare(q)
    with channel_error(404, f"NOT_FOUND - no exchange '{x}' in vhost '/'"):
        channel.queue_bind(q, x)


def test_bind_missing_queue_is_404(channel, names):
    q = names()
    with channel_error(404, f"NOT_FOUND - no queue '{q}' in vhost '/'"):
        channel.queue_bind(q, "amq.direct")


def test_auto_delete_exchange_goes_when_last_binding_goes(conn, channel, names):
    x = names("x")
    channel.exchange_declare(x, "direct", auto_delete=True)
    assert exchange_exists(conn, x)  # never bound: stays
    q = names()
    channel.queue_declare(q)
    channel.queue_bind(q, x, "k1")
    channel.queue_bind(q, x, "k2")
    channel.queue_unbind(q, x, "k1")
    assert exchange_exists(conn, x)
    channel.queue_unbind(q, x, "k2")
    assert not exchange_exists(conn, x)


def test_exchange_delete_if_unused_is_406_when_bound(conn, channel, names):
    x = names("x")
    channel.exchange_declare(x, "fanout")
    q = names()
    channel.queue_declare(q)
    channel.queue_bind(q, x)
    with channel_error(406, f"PRECONDITION_FAILED - exchange '{x}' in vhost '/' in use"):
        channel.exchange_delete(x, if_unused=True)
    ch = conn.channel()
    ch.queue_unbind(q, x)
    ch.exchange_delete(x, if_unused=True)
    assert not exchange_exists(conn, x)


def test_delete_missing_exchange_is_ok(channel, names):
    channel.exchange_delete(names("x"))  # RabbitMQ: idempotent, no 404


def test_deleting_exchange_removes_its_bindings(channel, names):
    x = names("x")
    channel.exchange_declare(x, "fanout")
    q = names()
    channel.queue_declare(q)
    channel.queue_bind(q, x)
    channel.exchange_delete(x)
    channel.exchange_declare(x, "fanout")
    channel.basic_publish(x, "", b"x")
    assert get_bodies(channel, q) == []
