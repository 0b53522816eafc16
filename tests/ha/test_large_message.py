"""A large message goes to the backups in parts, a bounded amount per flush.

Issue 33: one 50 MiB persistent message was one ``e`` event, packed once and
written whole to both backups in one loop step of the primary (0.1 s, 0.2-0.4 s
beside CPU burners), and decoded in one step by each backup. Now its body goes
as ``bp`` events of ``BODY_PART_BYTES`` and the ``e`` last, the primary takes
at most ``FLUSH_BYTES`` of a backup's outbox per flush (a loop turn), and the
confirm still waits for the backups to hold the whole message.
"""

from __future__ import annotations

import asyncio

import pytest

from brokerha.cluster import replication as R
from brokerha.cluster.replication import Events, ReplicationError
from brokerha.primary.events import BODY_PART_BYTES, event_size
from brokerha.primary.remote_backup import BYTES_PER_PACKET, FLUSH_BYTES
from tests.ha.harness import Cluster, consume, publish, route, settle, wire
from tests.ha.test_replication import same

SIZE = 9 * BODY_PART_BYTES + 5  # ten parts, the last of 5 bytes
BODY = bytes(range(256)) * (SIZE // 256) + b"tail!"[: SIZE % 256]


def cluster(*backups: str) -> Cluster:
    c = Cluster(3)
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    for name in backups:
        c.follow(name)
    c.pump()
    return c


def packet_bytes(packets: list[Events]) -> int:
    return sum(event_size(e) for p in packets for e in p.events)


def test_a_large_body_goes_as_parts_then_its_enqueue_a_bounded_amount_per_flush() -> None:
    c = cluster("n2", "n3")
    assert len(BODY) == SIZE
    publish(c.broker, BODY, persistent=True)
    flushes = []
    while True:
        out = c.primary.take_outboxes()
        if not out:
            break
        flushes.append(out)
        # up-to-date backups share the packets: each is packed once for both
        assert [id(p) for p in out["n2"]] == [id(p) for p in out["n3"]]
        assert packet_bytes(out["n2"]) < FLUSH_BYTES + BYTES_PER_PACKET
        for name, packets in out.items():
            backup = c.node(name).backup
            assert backup is not None
            for packet in packets:
                backup.receive(wire(packet))  # type: ignore[arg-type]
    assert len(flushes) >= SIZE // FLUSH_BYTES  # not one flush of everything
    events = [e for out in flushes for p in out["n2"] for e in p.events]
    assert [e.kind for e in events] == [R.BODY_PART] * 10 + [R.ENQUEUED]
    assert max(len(e.data) for e in events[:-1]) == BODY_PART_BYTES
    assert events[-1].body == b""
    for name in ("n2", "n3"):
        [entry] = c.node(name).broker.vhosts["/"].queues["q"].ready
        assert entry.message.body == BODY
    same(c)


def test_the_confirm_waits_for_the_enqueue_not_for_the_parts() -> None:
    c = cluster("n2")
    publish(c.broker, BODY, persistent=True)
    confirmed: list[bool] = []
    c.primary.barrier(lambda: confirmed.append(True))
    backup = c.node("n2").backup
    assert backup is not None
    packets = []
    while out := c.primary.take_outbox("n2"):
        packets += out
    for packet in packets[:-1]:  # every part, not the enqueue
        backup.receive(wire(packet))  # type: ignore[arg-type]
    c.primary.backup_acked("n2", wire(backup.ack_message()).seq)  # type: ignore[attr-defined]
    assert not confirmed
    assert len(c.node("n2").broker.vhosts["/"].queues["q"].ready) == 0
    backup.receive(wire(packets[-1]))  # type: ignore[arg-type]
    c.primary.backup_acked("n2", wire(backup.ack_message()).seq)  # type: ignore[attr-defined]
    assert confirmed == [True]


def test_a_joining_backup_gets_a_large_message_of_its_catch_up_in_parts() -> None:
    c = cluster("n2")
    publish(c.broker, b"small", persistent=True)
    publish(c.broker, BODY, persistent=True)
    c.pump()
    c.follow("n3")
    sent: list[str] = []
    while out := c.primary.take_outbox("n3"):
        backup = c.node("n3").backup
        assert backup is not None
        for packet in out:
            sent += [e.kind for e in packet.events]
            backup.receive(wire(packet))  # type: ignore[arg-type]
        c.primary.backup_acked("n3", backup.applied_seq)
    assert sent.count(R.BODY_PART) == 10
    same(c)
    assert consume(c.node("n3").broker.vhosts["/"].queues["q"]) == [b"small", BODY]


def test_an_event_between_a_bodys_parts_and_its_enqueue_is_refused() -> None:
    c = cluster("n2")
    backup = c.node("n2").backup
    assert backup is not None
    seq = backup.applied_seq + 1
    with pytest.raises(ReplicationError, match="after the parts"):
        backup.receive(wire(Events(1, seq, [[R.BODY_PART, b"abc"],  # type: ignore[arg-type]
                                            [R.DEQUEUED, "/", "q", [1]]])))


def test_a_transactions_large_message_goes_as_parts_then_its_te() -> None:
    async def scenario() -> None:
        c = cluster("n2")
        tx = c.broker.new_transaction()
        queues, msg = route(c.broker, BODY, persistent=True)
        tx.publish(queues, msg)  # past TC_CONTENT_BYTES: a te at once
        queues, msg = route(c.broker, b"small", persistent=True)
        tx.publish(queues, msg)
        sent: list[str] = []
        backup = c.node("n2").backup
        assert backup is not None
        while out := c.primary.take_outbox("n2"):
            for packet in out:
                sent += [e.kind for e in packet.events]
                backup.receive(wire(packet))  # type: ignore[arg-type]
            c.primary.backup_acked("n2", backup.applied_seq)
        assert sent == [R.TX_BEGIN] + [R.BODY_PART] * 10 + [R.TX_ENQUEUE] * 2
        await settle(c, tx.commit())
        same(c, "n2")
        assert consume(c.node("n2").broker.vhosts["/"].queues["q"]) == [BODY, b"small"]

    asyncio.run(scenario())
