"""Per-queue deduplication window (x-deduplication-window), at the broker model level."""

from __future__ import annotations

import pytest
from pamqp import commands

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header, read_message_id
from brokerha.broker.dedup import MAX_WINDOW, deduplication_id
from brokerha.broker.errors import PreconditionFailed
from brokerha.broker.message import Entry, Message
from brokerha.broker.queue import Queue
from brokerha.broker.storage import QueueRecord, Recovered, StoredMessage
from brokerha.broker.vhost import VirtualHost


def msg(body: bytes = b"x", rk: str = "q", **props: object) -> Message:
    header = build_header(len(body), commands.Basic.Properties(**props))
    return Message("", rk, header, body)


def new_vhost() -> VirtualHost:
    broker = Broker("t")
    return broker.add_vhost("/")


def dedup_queue(window: int = 3, name: str = "q", **args: object) -> Queue:
    return new_vhost().declare_queue(
        name, owner=None, arguments={"x-deduplication-window": window, **args})


def bodies(q: Queue) -> list[bytes]:
    out = []
    while (entry := q.get()) is not None:
        out.append(entry.message.body)
        q.settle(entry)
    return out


def test_a_repeated_message_id_is_dropped_but_accepted() -> None:
    q = dedup_queue()
    assert q.enqueue(msg(b"first", message_id="m1"))
    assert q.enqueue(msg(b"resend", message_id="m1"))  # accepted: a confirm acks it
    assert q.enqueue(msg(b"other", message_id="m2"))
    assert bodies(q) == [b"first", b"other"]
    assert q.dedup_dropped == 1


def test_ids_are_remembered_after_the_message_is_consumed() -> None:
    q = dedup_queue()
    q.enqueue(msg(b"a", message_id="a"))
    assert bodies(q) == [b"a"]
    q.enqueue(msg(b"a again", message_id="a"))
    assert q.message_count == 0 and q.dedup_dropped == 1


def test_messages_without_an_id_are_never_deduplicated() -> None:
    q = dedup_queue()
    for _ in range(5):
        q.enqueue(msg(b"same"))
    q.enqueue(msg(b"empty id", message_id=""))
    q.enqueue(msg(b"empty id", message_id=""))
    assert q.message_count == 7 and q.dedup_dropped == 0
    assert len(q.dedup or ()) == 0


def test_the_window_keeps_the_last_n_ids_and_forgets_the_oldest_first() -> None:
    q = dedup_queue(window=3)
    for i in range(1, 5):  # ids 1..4: 1 falls out of a window of 3
        q.enqueue(msg(b"%d" % i, message_id=str(i)))
    assert q.dedup is not None and q.dedup.ids() == ["2", "3", "4"]
    q.enqueue(msg(b"1 again", message_id="1"))  # forgotten: kept
    q.enqueue(msg(b"2 again", message_id="2"))  # 2 fell out when 1 came back
    q.enqueue(msg(b"4 again", message_id="4"))  # still remembered: dropped
    assert q.dedup.ids() == ["4", "1", "2"]
    assert bodies(q) == [b"1", b"2", b"3", b"4", b"1 again", b"2 again"]
    assert q.dedup_dropped == 1


def test_the_deduplication_header_takes_precedence_over_message_id() -> None:
    q = dedup_queue()
    q.enqueue(msg(b"a", message_id="m", headers={"x-deduplication-id": "producer-1:7"}))
    q.enqueue(msg(b"b", message_id="m", headers={"x-deduplication-id": "producer-1:8"}))
    q.enqueue(msg(b"c", message_id="other", headers={"x-deduplication-id": "producer-1:7"}))
    q.enqueue(msg(b"d", message_id="m"))  # same message_id, no header: "m" was never an id
    q.enqueue(msg(b"e", headers={"x-deduplication-id": 42}))  # integers count, as text
    q.enqueue(msg(b"f", message_id="42"))
    q.enqueue(msg(b"g", message_id="m2", headers={"x-deduplication-id": True}))  # unusable
    q.enqueue(msg(b"h", message_id="m2"))
    assert bodies(q) == [b"a", b"b", b"d", b"e", b"g"]
    assert q.dedup_dropped == 3


def test_message_id_is_read_past_every_property_before_it() -> None:
    m = msg(b"x", content_type="text/plain", content_encoding="gzip", headers={"k": "v"},
            delivery_mode=2, priority=3, correlation_id="c", reply_to="r",
            expiration="60000", message_id="the-id", timestamp=None, message_type="t", user_id="u")
    assert read_message_id(m.header) == "the-id"
    assert deduplication_id(m) == "the-id"
    assert read_message_id(msg(b"x", content_type="text/plain").header) is None
    raw = msg(b"x", message_id="AB").header.replace(b"\x02AB", b"\x02\xff\xfe")
    assert read_message_id(raw) == "\udcff\udcfe"  # not UTF-8: kept distinct


def test_a_queue_without_the_argument_has_no_window() -> None:
    q = new_vhost().declare_queue("plain", owner=None)
    assert q.dedup is None
    q.enqueue(msg(b"a", message_id="m"))
    q.enqueue(msg(b"a", message_id="m"))
    assert q.message_count == 2 and q.dedup_dropped == 0


def test_each_queue_has_its_own_window() -> None:
    vh = new_vhost()
    q1 = vh.declare_queue("q1", owner=None, arguments={"x-deduplication-window": 10})
    q2 = vh.declare_queue("q2", owner=None, arguments={"x-deduplication-window": 10})
    plain = vh.declare_queue("plain", owner=None)
    for q in (q1, q2, plain):
        vh.bind("amq.fanout", q, "")
    fanout = vh.exchange("amq.fanout")
    for _ in range(2):
        m = msg(b"fan", message_id="f1")
        for q in vh.route(fanout, m):
            q.enqueue(m)
    assert (q1.message_count, q2.message_count, plain.message_count) == (1, 1, 2)


def test_add_entry_builds_the_window_as_a_backup_does() -> None:
    """A backup receives replicated entries through add_entry: never dropped there,
    but remembered, so after a promotion it drops the client's resend."""
    primary = dedup_queue(window=5)
    backup = dedup_queue(window=5)
    backup.hooks.enqueued.clear()
    replicated: list[Entry] = []
    primary.hooks.enqueued.append(lambda q, e: replicated.append(e))
    for i in range(4):
        primary.enqueue(msg(b"%d" % i, message_id=f"id-{i}"))
    primary.enqueue(msg(b"dup", message_id="id-1"))
    for entry in replicated:  # what the replication does on the backup
        backup.add_entry(Entry(entry.position, entry.message, None))
    assert primary.dedup is not None and backup.dedup is not None
    assert backup.dedup.ids() == primary.dedup.ids() == [f"id-{i}" for i in range(4)]
    assert bodies(backup) == [b"0", b"1", b"2", b"3"]  # consumed: still remembered
    # promoted: the client resends what was not confirmed
    assert backup.enqueue(msg(b"resend", message_id="id-3"))
    assert backup.message_count == 0 and backup.dedup_dropped == 1


def test_add_entry_never_drops_a_replicated_entry() -> None:
    q = dedup_queue()
    q.add_entry(Entry(1, msg(b"a", message_id="same"), None))
    q.add_entry(Entry(2, msg(b"b", message_id="same"), None))
    assert q.message_count == 2


def test_restore_rebuilds_the_window_from_the_stored_messages() -> None:
    broker = Broker("t")
    args = {"x-deduplication-window": 100}
    stored = []
    for pos in (3, 4):
        m = msg(b"%d" % pos, message_id=f"id-{pos}", delivery_mode=2)
        stored.append(StoredMessage("/", "q", pos, "", "q", m.header, m.body))
    broker.restore(Recovered(queues=[QueueRecord("/", "q", arguments=args)], messages=stored))
    q = broker.vhosts["/"].queues["q"]
    assert q.dedup is not None and q.dedup.ids() == ["id-3", "id-4"]
    q.enqueue(msg(b"resend", message_id="id-4"))
    q.enqueue(msg(b"consumed before the restart: not remembered", message_id="id-1"))
    assert bodies(q) == [b"3", b"4", b"consumed before the restart: not remembered"]
    assert q.next_position == 6


def test_dead_lettering_back_into_the_queue_is_not_deduplicated() -> None:
    """A DLX retry loop: the broker's republish keeps the message_id but must arrive."""
    vh = new_vhost()
    q = vh.declare_queue("work", owner=None, arguments={
        "x-deduplication-window": 10, "x-dead-letter-exchange": "amq.fanout"})
    vh.bind("amq.fanout", q, "")
    q.enqueue(msg(b"job", rk="work", message_id="job-1"))
    entry = q.get()
    assert entry is not None
    q.reject(entry)  # dead-lettered to amq.fanout, routed back to work
    again = q.get()
    assert again is not None and again.message.body == b"job"
    assert again.message.headers["x-death"][0]["reason"] == "rejected"
    q.settle(again)
    q.enqueue(msg(b"client resend", rk="work", message_id="job-1"))
    assert q.message_count == 0 and q.dedup_dropped == 1


def test_a_duplicate_is_dropped_before_the_overflow_policy_sees_it() -> None:
    q = dedup_queue(window=10, **{"x-max-length": 1, "x-overflow": "reject-publish"})
    assert q.enqueue(msg(b"a", message_id="a"))
    assert q.enqueue(msg(b"a", message_id="a"))  # duplicate of a stored one: acked
    assert not q.enqueue(msg(b"b", message_id="b"))  # refused (nack): not remembered
    assert bodies(q) == [b"a"]
    assert q.enqueue(msg(b"b", message_id="b"))  # the client's retry is taken
    assert bodies(q) == [b"b"]


def test_redeclare_must_match_the_window() -> None:
    vh = new_vhost()
    vh.declare_queue("q", owner=None, arguments={"x-deduplication-window": 5})
    vh.declare_queue("q", owner=None, arguments={"x-deduplication-window": 5})
    with pytest.raises(PreconditionFailed) as info:
        vh.declare_queue("q", owner=None, arguments={"x-deduplication-window": 6})
    assert "inequivalent arg 'x-deduplication-window'" in info.value.text
    with pytest.raises(PreconditionFailed):
        vh.declare_queue("q", owner=None)


@pytest.mark.parametrize(("value", "why"), [
    (0, "{value_zero,0}"),
    (-1, "{value_negative,-1}"),
    ("10", "{unacceptable_type,str}"),
    (True, "{unacceptable_type,bool}"),
    (1.5, "{unacceptable_type,float}"),
    (MAX_WINDOW + 1, f"{{value_too_large,{MAX_WINDOW + 1},{MAX_WINDOW}}}"),
])
def test_bad_window_values_are_refused_with_406(value: object, why: str) -> None:
    vh = new_vhost()
    with pytest.raises(PreconditionFailed) as info:
        vh.declare_queue("q", owner=None, arguments={"x-deduplication-window": value})
    assert info.value.code == 406
    assert info.value.text == (
        f"invalid arg 'x-deduplication-window' for queue 'q' in vhost '/': {why}")
    assert "q" not in vh.queues
