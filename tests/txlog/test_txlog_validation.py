from brokerha.txlog.engine.messages import Confirm, DeliverOrdered
from brokerha.txlog.engine.records import Operation, TxBody
from brokerha.txlog.engine.validation import COMMITTED, FAILED, GlobalQueues, confirmable_on_acquire

ENQ = Operation("enqueue", "/orders", "m1")
DEQ = Operation("dequeue", "/orders", "m1")


def test_a_dequeue_of_a_consumed_message_fails_and_changes_nothing() -> None:
    model = GlobalQueues()
    assert model.apply(TxBody("t1", (ENQ,))) == COMMITTED
    assert model.apply(TxBody("t2", (DEQ, Operation("enqueue", "/orders", "m2")))) == COMMITTED
    before = model.snapshot().queues
    assert model.apply(TxBody("t3", (DEQ,))) == FAILED
    assert model.queues == before and model.applied == 3


def test_a_transaction_may_consume_what_it_enqueued_itself_once() -> None:
    model = GlobalQueues()
    assert model.apply(TxBody("t", (ENQ, DEQ))) == COMMITTED
    assert model.apply(TxBody("u", (ENQ, DEQ, DEQ))) == FAILED


def test_enqueue_only_transactions_are_confirmable_on_acquire() -> None:
    assert confirmable_on_acquire(TxBody("t", (ENQ,)))
    assert not confirmable_on_acquire(TxBody("t", (ENQ, DEQ)))


def test_the_same_order_gives_the_same_outcomes_on_every_master(mesh_factory) -> None:
    mesh = mesh_factory(3)
    mesh.tx("dc1", ENQ)
    mesh.settle()
    first = mesh.tx("dc1", DEQ)
    second = mesh.tx("dc3", DEQ)  # both consume m1: exactly one fails, the same one everywhere
    mesh.settle()
    outcomes = {
        m: {e.record.tx_id: e.outcome for e in engine.sync.entries} for m, engine in mesh.engines.items()
    }
    assert outcomes["dc1"] == outcomes["dc2"] == outcomes["dc3"]
    assert sorted([outcomes["dc1"][first], outcomes["dc1"][second]]) == [COMMITTED, FAILED]
    delivered = [a for a in mesh.actions["dc2"] if isinstance(a, DeliverOrdered)]
    assert [d.position for d in delivered] == [0, 1, 2]


def test_dequeues_are_confirmed_once_ordered_enqueues_once_acquired(mesh_factory) -> None:
    mesh = mesh_factory(3)
    enq = mesh.tx("dc1", ENQ)
    assert Confirm(enq, COMMITTED) in mesh.actions["dc1"]  # before any round
    deq = mesh.tx("dc1", DEQ)
    assert not any(isinstance(a, Confirm) and a.tx_id == deq for a in mesh.actions["dc1"])
    mesh.settle()
    assert Confirm(deq, COMMITTED) in mesh.actions["dc1"]
    assert not any(isinstance(a, Confirm) for a in mesh.actions["dc2"])  # only the origin confirms
