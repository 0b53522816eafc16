"""Every hook of the plugin layer the HA code uses, seen from an observer."""

from __future__ import annotations

from typing import Any

from pamqp import commands

from brokerha.amqp import constants as C
from brokerha.broker.exchange import Binding, Exchange
from brokerha.broker.message import Entry, Message
from brokerha.broker.observers import ConfigurationObserver, QueueObserver
from brokerha.broker.queue import Queue
from brokerha.broker.transaction import Transaction, TransactionObserver
from tests.amqp.wire import Wire, make_broker


class Recorder(ConfigurationObserver, QueueObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def exchange_declared(self, exchange: Exchange) -> None:
        self.events.append(("exchange_declared", exchange.name))

    def exchange_deleted(self, exchange: Exchange) -> None:
        self.events.append(("exchange_deleted", exchange.name))

    def queue_declared(self, queue: Queue) -> None:
        self.events.append(("queue_declared", queue.name))

    def queue_deleted(self, queue: Queue) -> None:
        self.events.append(("queue_deleted", queue.name))

    def binding_created(self, binding: Binding) -> None:
        self.events.append(("binding_created", (binding.source.name, binding.routing_key)))

    def binding_deleted(self, binding: Binding) -> None:
        self.events.append(("binding_deleted", (binding.source.name, binding.routing_key)))

    def enqueued(self, queue: Queue, entry: Entry) -> None:
        self.events.append(("enqueued", (queue.name, entry.position)))

    def acquired(self, queue: Queue, entry: Entry) -> None:
        self.events.append(("acquired", (queue.name, entry.position)))

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        self.events.append(("dequeued", (queue.name, entry.position)))

    def requeued(self, queue: Queue, entry: Entry) -> None:
        self.events.append(("requeued", (queue.name, entry.position)))


class TxObserver(TransactionObserver):
    def __init__(self, log: list[tuple[str, Any]], vote: bool) -> None:
        self.log = log
        self.vote = vote

    def publish(self, queue: Queue, message: Message) -> None:
        self.log.append(("publish", (queue.name, message.body)))

    def accept(self, acked: list[tuple[Queue, Entry]], unacked: list[tuple[Queue, Entry]]) -> None:
        self.log.append(("accept", [(q.name, e.position) for q, e in acked]))

    async def prepare(self) -> bool:
        self.log.append(("prepare", None))
        return self.vote

    def commit(self) -> None:
        self.log.append(("commit", None))

    def rollback(self) -> None:
        self.log.append(("rollback", None))


class TxFactory:
    def __init__(self, vote: bool = True) -> None:
        self.log: list[tuple[str, Any]] = []
        self.vote = vote
        self.transactions: list[Transaction] = []

    def create(self, transaction: Transaction) -> TxObserver:
        self.transactions.append(transaction)
        return TxObserver(self.log, self.vote)


def wired(**kw: Any) -> tuple[Wire, Recorder]:
    broker = make_broker(**kw)
    rec = Recorder()
    broker.observers.add_configuration_observer(rec)
    broker.observers.add_queue_observer(rec)
    return Wire(broker).connected(), rec


def test_configuration_hooks_see_declare_bind_unbind_delete() -> None:
    w, rec = wired()
    w.method(1, commands.Exchange.Declare(exchange="x", exchange_type="topic"))
    w.method(1, commands.Queue.Declare(queue="q"))
    w.method(1, commands.Queue.Bind(queue="q", exchange="x", routing_key="a.*"))
    w.method(1, commands.Queue.Unbind(queue="q", exchange="x", routing_key="a.*"))
    w.method(1, commands.Queue.Delete(queue="q"))
    w.method(1, commands.Exchange.Delete(exchange="x"))
    assert rec.events == [
        ("exchange_declared", "x"), ("queue_declared", "q"),
        ("binding_created", ("x", "a.*")), ("binding_deleted", ("x", "a.*")),
        ("queue_deleted", "q"), ("exchange_deleted", "x"),
    ]


def test_queue_hooks_follow_a_message_through_requeue_and_ack() -> None:
    w, rec = wired()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.publish(1, "", "q", b"m")
    w.method(1, commands.Basic.Get(queue="q"))
    w.method(1, commands.Basic.Reject(delivery_tag=1, requeue=True))
    w.method(1, commands.Basic.Get(queue="q"))
    w.method(1, commands.Basic.Ack(delivery_tag=2))
    msg_events = [e for e in rec.events if e[0] != "queue_declared"]
    assert msg_events == [
        ("enqueued", ("q", 1)), ("acquired", ("q", 1)), ("requeued", ("q", 1)),
        ("acquired", ("q", 1)), ("dequeued", ("q", 1)),
    ]


def test_replication_ids_are_per_queue_and_monotonic() -> None:
    w, rec = wired()
    for q in ("a", "b"):
        w.method(1, commands.Queue.Declare(queue=q))
    w.method(1, commands.Exchange.Declare(exchange="f", exchange_type="fanout"))
    for q in ("a", "b"):
        w.method(1, commands.Queue.Bind(queue=q, exchange="f"))
    w.publish(1, "", "a", b"1")
    w.publish(1, "f", "", b"2")
    enq = [e[1] for e in rec.events if e[0] == "enqueued"]
    assert enq == [("a", 1), ("a", 2), ("b", 1)]


def test_transaction_observer_sees_publish_accept_prepare_commit() -> None:
    broker = make_broker()
    factory = TxFactory()
    broker.observers.add_transaction_observer_factory(factory)
    w = Wire(broker).connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.publish(1, "", "q", b"before")
    w.method(1, commands.Basic.Get(queue="q"))
    w.method(1, commands.Tx.Select())
    w.publish(1, "", "q", b"in-tx")
    w.method(1, commands.Basic.Ack(delivery_tag=1))
    assert broker.vhosts["/"].queues["q"].message_count == 0  # nothing applied yet
    w.method(1, commands.Tx.Commit())
    w.expect(commands.Tx.CommitOk)
    assert factory.log == [
        ("publish", ("q", b"in-tx")), ("accept", [("q", 1)]), ("prepare", None), ("commit", None),
    ]
    q = broker.vhosts["/"].queues["q"]
    assert q.message_count == 1 and q.unacked == 0


def test_a_no_vote_in_prepare_rolls_back_and_fails_the_commit() -> None:
    broker = make_broker()
    factory = TxFactory(vote=False)
    broker.observers.add_transaction_observer_factory(factory)
    w = Wire(broker).connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.method(1, commands.Tx.Select())
    w.publish(1, "", "q", b"doomed")
    w.method(1, commands.Tx.Commit())
    close = w.expect(commands.Channel.Close)
    assert close.reply_code == C.PRECONDITION_FAILED
    assert factory.log[-2:] == [("prepare", None), ("rollback", None)]
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_rollback_tells_the_observer_and_applies_nothing() -> None:
    broker = make_broker()
    factory = TxFactory()
    broker.observers.add_transaction_observer_factory(factory)
    w = Wire(broker).connected()
    w.method(1, commands.Queue.Declare(queue="q"))
    w.method(1, commands.Tx.Select())
    w.publish(1, "", "q", b"x")
    w.method(1, commands.Tx.Rollback())
    w.expect(commands.Tx.RollbackOk)
    assert factory.log == [("publish", ("q", b"x")), ("rollback", None)]
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_empty_transactions_create_no_observer() -> None:
    broker = make_broker()
    factory = TxFactory()
    broker.observers.add_transaction_observer_factory(factory)
    w = Wire(broker).connected()
    w.method(1, commands.Tx.Select())
    w.method(1, commands.Tx.Commit())
    w.expect(commands.Tx.CommitOk)
    assert factory.transactions == []
