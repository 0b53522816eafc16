"""Real nodes with the default (SQLite) store, SIGKILLed and restarted on the same data dir.

What a client was told must hold after the restart: confirmed messages are
there exactly once, tx.commit-ok'd transactions are there whole, rolled-back
ones are not, delivered-but-unacked messages come back redelivered, durable
definitions survive and transient ones do not.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pika
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from brokerha.testing import NodeProcess

PERSISTENT = pika.BasicProperties(delivery_mode=2)
CRASH_SEED = 20240611
KILLS = 5
TX_SIZE = 5
RUN_TX_SIZE = 40  # every other transaction: stored as a message run (store/batch.py RUN_MIN)
LOST = (pika.exceptions.AMQPError, OSError)


@dataclass
class Ledger:
    """What the clients were told, across every round."""

    confirmed: set[str] = field(default_factory=set)
    committed: list[list[str]] = field(default_factory=list)  # got tx.commit-ok
    in_doubt: list[list[str]] = field(default_factory=list)  # commit sent, no answer
    rolled_back: set[str] = field(default_factory=set)


def connect(node: NodeProcess) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(node.url))


def publish(ch: BlockingChannel, body: str, queue: str = "crash") -> None:
    ch.basic_publish("", queue, body.encode(), PERSISTENT)


def run_transaction(tx: BlockingChannel, ledger: Ledger, name: str, commit: bool,
                    size: int = TX_SIZE) -> None:
    bodies = [f"{name}-{j}" for j in range(size)]
    for body in bodies:
        publish(tx, body)
    if not commit:
        tx.tx_rollback()
        ledger.rolled_back.update(bodies)
        return
    ledger.in_doubt.append(bodies)
    tx.tx_commit()
    ledger.committed.append(ledger.in_doubt.pop())


def publish_until_killed(node: NodeProcess, ledger: Ledger, rnd: random.Random, round_no: int) -> None:
    """Confirmed publishes interleaved with transactions until the node dies under us."""
    conn = connect(node)
    confirms, tx = conn.channel(), conn.channel()
    confirms.confirm_delivery()
    confirms.queue_declare("crash", durable=True)
    tx.tx_select()
    killer = threading.Timer(rnd.uniform(0.2, 0.8), node.kill)
    killer.start()
    i = 0
    try:
        while True:
            i += 1
            if i % 7 == 0:
                run_transaction(tx, ledger, f"t{round_no}.{i}", commit=rnd.random() < 0.7,
                                size=RUN_TX_SIZE if i % 14 == 0 else TX_SIZE)
            else:
                publish(confirms, f"c{round_no}.{i}")
                ledger.confirmed.add(f"c{round_no}.{i}")
    except LOST:
        pass
    finally:
        killer.join()


def drain(ch: BlockingChannel, queue: str) -> list[tuple[str, bool]]:
    """Every message on ``queue`` as (body, redelivered), auto-acked."""
    count = ch.queue_declare(queue, durable=True, passive=True).method.message_count
    out: list[tuple[str, bool]] = []
    for method, _props, body in ch.consume(queue, auto_ack=True, inactivity_timeout=2):
        if method is None:
            break
        out.append((body.decode(), method.redelivered))
        if len(out) == count:
            break
    ch.cancel()
    return out


def check(ledger: Ledger, found: list[tuple[str, bool]]) -> None:
    counts = Counter(body for body, _ in found)
    duplicates = {b for b, n in counts.items() if n > 1}
    first_seen: set[str] = set()
    for body, redelivered in found:  # a duplicate may only come back as a redelivery
        if body in duplicates and body in first_seen:
            assert redelivered, f"{body} duplicated without redelivered=true"
        first_seen.add(body)
    assert ledger.confirmed <= counts.keys(), sorted(ledger.confirmed - counts.keys())[:10]
    for bodies in ledger.committed:
        assert set(bodies) <= counts.keys(), f"committed transaction lost: {bodies}"
    for bodies in ledger.in_doubt:
        present = [b in counts for b in bodies]
        assert all(present) or not any(present), f"partial transaction: {bodies}"
    assert not (ledger.rolled_back & counts.keys())


def test_confirmed_and_committed_messages_survive_sigkill(tmp_path: Path) -> None:
    rnd = random.Random(CRASH_SEED)
    ledger = Ledger()
    for round_no in range(KILLS):
        node = NodeProcess("crash", data_dir=tmp_path)
        node.start()
        try:
            publish_until_killed(node, ledger, rnd, round_no)
        finally:
            node.close()
    assert len(ledger.confirmed) > 50 and ledger.committed
    assert any(len(bodies) == RUN_TX_SIZE for bodies in ledger.committed)  # runs replayed
    with NodeProcess("crash", data_dir=tmp_path) as node:
        conn = connect(node)
        found = drain(conn.channel(), "crash")
        conn.close()
    check(ledger, found)


def declare_definitions(ch: BlockingChannel) -> None:
    ch.exchange_declare("d.x", "topic", durable=True)
    ch.exchange_declare("d.x2", "fanout", durable=True)
    ch.exchange_declare("t.x", "direct", durable=False)
    ch.queue_declare("d.q", durable=True, arguments={"x-max-priority": 5})
    ch.queue_declare("t.q", durable=False)
    ch.queue_bind("d.q", "d.x", "k.*")
    ch.exchange_bind("d.x2", "d.x", "e.#")
    ch.queue_bind("d.q", "d.x2")
    ch.queue_bind("t.q", "d.x", "t")


def test_definitions_and_unacked_deliveries_after_sigkill(tmp_path: Path) -> None:
    with NodeProcess("defs", data_dir=tmp_path) as node:
        conn = connect(node)
        ch = conn.channel()
        ch.confirm_delivery()
        declare_definitions(ch)
        for i in range(10):
            ch.basic_publish("d.x", "k.a", b"m%d" % i, PERSISTENT)
        taker = conn.channel()
        held = [taker.basic_get("d.q", auto_ack=False) for _ in range(4)]
        assert all(method is not None for method, _, _ in held)
        publish(ch, "barrier", "d.q")  # its confirm follows the commit of the deliveries
        node.kill()
    with NodeProcess("defs", data_dir=tmp_path) as node:
        conn = connect(node)
        ch = conn.channel()
        for name, kind in (("d.x", "topic"), ("d.x2", "fanout")):
            ch.exchange_declare(name, kind, durable=True, passive=True)
        ch.queue_declare("d.q", durable=True, passive=True, arguments={"x-max-priority": 5})
        ch.basic_publish("d.x", "e.z", b"via-e2e", PERSISTENT)  # d.x -> d.x2 -> d.q survived
        found = drain(ch, "d.q")
        assert found[:4] == [(f"m{i}", True) for i in range(4)]
        assert found[4:] == [(f"m{i}", False) for i in range(4, 10)] + [
            ("barrier", False), ("via-e2e", False)]
        for passive in (lambda c: c.exchange_declare("t.x", passive=True),
                        lambda c: c.queue_declare("t.q", passive=True)):
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
                passive(conn.channel())
            assert info.value.reply_code == 404
        conn.close()
