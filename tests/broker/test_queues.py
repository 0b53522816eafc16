"""Queue behaviour with a virtual clock: TTL, limits, dead-lettering, priorities."""

from __future__ import annotations

from collections import deque

from pamqp import commands

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header, read_headers, scan_properties
from brokerha.broker.message import Message
from brokerha.broker.queue import Queue
from tests.clock import Clock


def broker_with_clock() -> tuple[Broker, Clock]:
    clock = Clock()
    broker = Broker("t", clock=clock)
    broker.add_vhost("/")
    return broker, clock


def msg(body: bytes = b"x", rk: str = "q", **props: object) -> Message:
    header = build_header(len(body), commands.Basic.Properties(**props))
    return Message("", rk, header, body)


def drain(q: Queue) -> list[bytes]:
    out = []
    while (entry := q.get()) is not None:
        out.append(entry.message.body)
        q.settle(entry)
    return out


def test_queue_ttl_expires_from_the_head_on_tick() -> None:
    broker, clock = broker_with_clock()
    vh = broker.vhosts["/"]
    q = vh.declare_queue("q", owner=None, arguments={"x-message-ttl": 1000})
    q.enqueue(msg(b"a"))
    clock.now += 0.5
    q.enqueue(msg(b"b"))
    clock.now += 0.6
    broker.tick()
    assert q.message_count == 1
    assert drain(q) == [b"b"]


def test_per_message_expiration_takes_the_smaller_ttl() -> None:
    broker, clock = broker_with_clock()
    q = broker.vhosts["/"].declare_queue("q", owner=None, arguments={"x-message-ttl": 60000})
    q.enqueue(msg(b"short", expiration="100"))
    clock.now += 0.2
    assert q.get() is None


def test_x_expires_deletes_an_unused_queue() -> None:
    broker, clock = broker_with_clock()
    vh = broker.vhosts["/"]
    vh.declare_queue("q", owner=None, arguments={"x-expires": 2000})
    clock.now += 1.9
    broker.tick()
    assert "q" in vh.queues
    clock.now += 0.2
    broker.tick()
    assert "q" not in vh.queues


def test_max_length_drops_the_head_and_dead_letters_it() -> None:
    broker, _ = broker_with_clock()
    vh = broker.vhosts["/"]
    dlq = vh.declare_queue("dlq", owner=None)
    vh.bind("amq.fanout", dlq, "")
    q = vh.declare_queue("q", owner=None, arguments={
        "x-max-length": 2, "x-dead-letter-exchange": "amq.fanout"})
    for body in (b"1", b"2", b"3"):
        assert q.enqueue(msg(body))
    assert drain(q) == [b"2", b"3"]
    dead = dlq.get()
    assert dead is not None and dead.message.body == b"1"
    death = dead.message.headers["x-death"][0]
    assert death["reason"] == "maxlen" and death["queue"] == "q" and death["count"] == 1
    assert dead.message.headers["x-first-death-reason"] == "maxlen"


def test_reject_publish_refuses_when_full() -> None:
    broker, _ = broker_with_clock()
    q = broker.vhosts["/"].declare_queue("q", owner=None, arguments={
        "x-max-length": 1, "x-overflow": "reject-publish"})
    assert q.enqueue(msg(b"1"))
    assert not q.enqueue(msg(b"2"))
    assert drain(q) == [b"1"]


def test_rejected_message_is_dead_lettered_with_its_routing_key_override() -> None:
    broker, _ = broker_with_clock()
    vh = broker.vhosts["/"]
    dlq = vh.declare_queue("dlq", owner=None)
    vh.bind("amq.direct", dlq, "dead")
    q = vh.declare_queue("q", owner=None, arguments={
        "x-dead-letter-exchange": "amq.direct", "x-dead-letter-routing-key": "dead"})
    q.enqueue(msg(b"m", expiration="60000"))
    entry = q.get()
    assert entry is not None
    q.reject(entry)
    dead = dlq.get()
    assert dead is not None and dead.message.routing_key == "dead"
    assert dead.message.expiration_ms is None  # expiration removed, as RabbitMQ does
    assert dead.message.headers["x-death"][0]["routing-keys"] == ["q"]


def test_priority_queue_delivers_highest_first_and_fifo_within_a_level() -> None:
    broker, _ = broker_with_clock()
    q = broker.vhosts["/"].declare_queue("q", owner=None, arguments={"x-max-priority": 5})
    for body, prio in ((b"low1", 1), (b"high", 9), (b"low2", 1), (b"mid", 3)):
        q.enqueue(msg(body, priority=prio))
    assert drain(q) == [b"high", b"mid", b"low1", b"low2"]


def test_requeued_entry_goes_back_to_its_original_place() -> None:
    broker, _ = broker_with_clock()
    q = broker.vhosts["/"].declare_queue("q", owner=None)
    for body in (b"1", b"2", b"3"):
        q.enqueue(msg(body))
    first = q.get()
    second = q.get()
    assert first and second
    q.requeue(second)
    q.requeue(first)
    entry = q.get()
    assert entry is not None and entry.message.body == b"1" and entry.redelivered


def test_headers_exchange_all_and_any() -> None:
    broker, _ = broker_with_clock()
    vh = broker.vhosts["/"]
    all_q = vh.declare_queue("all", owner=None)
    any_q = vh.declare_queue("any", owner=None)
    vh.bind("amq.headers", all_q, "", {"x-match": "all", "a": 1, "b": "x"})
    vh.bind("amq.headers", any_q, "", {"x-match": "any", "a": 1, "b": "x"})
    ex = vh.exchange("amq.headers")
    both = Message("amq.headers", "", build_header(1, commands.Basic.Properties(
        headers={"a": 1, "b": "x"})), b"1")
    one = Message("amq.headers", "", build_header(1, commands.Basic.Properties(
        headers={"a": 1})), b"2")
    assert {q.name for q in vh.route(ex, both)} == {"all", "any"}
    assert {q.name for q in vh.route(ex, one)} == {"any"}


def test_exchange_to_exchange_and_alternate_exchange_routing() -> None:
    broker, _ = broker_with_clock()
    vh = broker.vhosts["/"]
    vh.declare_exchange("unrouted", "fanout")
    vh.declare_exchange("front", "direct", arguments={"alternate-exchange": "unrouted"})
    vh.declare_exchange("back", "topic")
    routed = vh.declare_queue("routed", owner=None)
    lost = vh.declare_queue("lost", owner=None)
    vh.bind("front", vh.exchange("back"), "k")
    vh.bind("back", routed, "#")
    vh.bind("unrouted", lost, "")
    front = vh.exchange("front")
    assert [q.name for q in vh.route(front, msg(rk="k"))] == ["routed"]
    assert [q.name for q in vh.route(front, msg(rk="other"))] == ["lost"]


def test_exchange_binding_cycles_terminate() -> None:
    broker, _ = broker_with_clock()
    vh = broker.vhosts["/"]
    vh.declare_exchange("a", "fanout")
    vh.declare_exchange("b", "fanout")
    vh.bind("a", vh.exchange("b"), "")
    vh.bind("b", vh.exchange("a"), "")
    q = vh.declare_queue("q", owner=None)
    vh.bind("b", q, "")
    assert [x.name for x in vh.route(vh.exchange("a"), msg())] == ["q"]


def test_scan_properties_reads_what_pamqp_wrote() -> None:
    props = commands.Basic.Properties(content_type="a/b", content_encoding="gzip",
                                      headers={"h": [1, 2]}, delivery_mode=2, priority=7,
                                      correlation_id="c", reply_to="r", expiration="1500")
    header = build_header(10, props)
    scanned = scan_properties(header)
    assert scanned.persistent and scanned.priority == 7 and scanned.expiration == "1500"
    assert read_headers(header, scanned.headers_at) == {"h": [1, 2]}


def test_memory_meter_tracks_ready_bytes() -> None:
    broker, _ = broker_with_clock()
    q = broker.vhosts["/"].declare_queue("q", owner=None)
    q.enqueue(msg(b"x" * 100))
    used = broker.memory.used
    assert used >= 100
    drain(q)
    assert broker.memory.used == 0


def test_missing_positions_reports_what_no_ready_entry_has_and_stops_at_the_last_found() -> None:
    broker, _ = broker_with_clock()
    q = broker.vhosts["/"].declare_queue("q", owner=None, arguments={"x-max-priority": 2})
    for i in range(1000):
        q.enqueue(msg(str(i).encode(), priority=i % 3))
    positions = sorted(e.position for e in q.ready)
    head = [e.position for e in list(q.ready)[:3]]
    assert q.missing_positions([]) == []
    assert q.missing_positions(head) == []
    assert q.missing_positions([positions[-1], positions[0]]) == []
    assert q.missing_positions([positions[5], 10**9, 7 * 10**9]) == [10**9, 7 * 10**9]
    taken = q.get()
    assert taken is not None
    assert q.missing_positions([taken.position, head[1]]) == [taken.position]  # acquired

    visited = 0

    class Counting(deque):  # type: ignore[type-arg]  # how far the scan went
        def __iter__(self):  # type: ignore[no-untyped-def]
            nonlocal visited
            for entry in super().__iter__():
                visited += 1
                yield entry

    # each priority level's deque counts what the scan takes from it (the queue's own
    # ReadyList iterates them: this works whether broker/queue.py runs compiled or not)
    q.ready._levels = [Counting(level) for level in q.ready._levels]
    assert q.missing_positions(head[1:3]) == []
    assert visited == 2, "a dequeue of the oldest messages does not walk the whole queue"
