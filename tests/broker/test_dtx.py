"""The XA branch state machine: every legal path and every illegal transition."""

from __future__ import annotations

import asyncio

import pytest

from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header
from brokerha.broker.dtx import XA, DtxManager, State, XAError, Xid
from brokerha.broker.message import Message
from tests.clock import Clock

X = Xid(1, b"gtrid", b"bq")
A, B = object(), object()


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def manager() -> DtxManager:
    return DtxManager([], Clock(100.0))


def with_work() -> tuple[Broker, DtxManager]:
    broker = Broker("t", clock=Clock(100.0))
    q = broker.add_vhost("/").declare_queue("q", owner=None)
    branch = broker.dtx.start(X, A)
    branch.publish([q], Message("", "q", build_header(1), b"m"))
    broker.dtx.end(X, A)
    return broker, broker.dtx


def xa_error(code: XA):  # type: ignore[no-untyped-def]
    return pytest.raises(XAError, match=code.label)


def test_start_of_a_known_xid_is_dupid() -> None:
    m = manager()
    m.start(X, A)
    with xa_error(XA.ER_DUPID):
        m.start(X, B)


def test_join_and_resume_of_unknown_xid_is_nota() -> None:
    m = manager()
    with xa_error(XA.ER_NOTA):
        m.start(X, A, join=True)
    with xa_error(XA.ER_NOTA):
        m.start(X, A, resume=True)


def test_join_and_resume_together_is_inval() -> None:
    with xa_error(XA.ER_INVAL):
        manager().start(X, A, join=True, resume=True)


def test_resume_of_a_branch_that_is_not_suspended_is_proto() -> None:
    m = manager()
    m.start(X, A)
    m.end(X, A)
    with xa_error(XA.ER_PROTO):
        m.start(X, B, resume=True)


def test_suspend_and_resume() -> None:
    m = manager()
    m.start(X, A)
    assert m.end(X, A, suspend=True) is XA.OK
    assert m.branches[X].state is State.SUSPENDED
    m.start(X, B, resume=True)
    assert m.branches[X].state is State.ACTIVE


def test_join_an_idle_branch() -> None:
    m = manager()
    m.start(X, A)
    m.end(X, A)
    m.start(X, B, join=True)
    assert m.end(X, B) is XA.OK


def test_end_by_a_channel_not_associated_is_proto() -> None:
    m = manager()
    m.start(X, A)
    with xa_error(XA.ER_PROTO):
        m.end(X, B)


def test_end_with_fail_and_suspend_is_inval() -> None:
    m = manager()
    m.start(X, A)
    with xa_error(XA.ER_INVAL):
        m.end(X, A, fail=True, suspend=True)


def test_end_fail_makes_prepare_answer_rbrollback() -> None:
    m = manager()
    m.start(X, A)
    assert m.end(X, A, fail=True) is XA.RBROLLBACK
    assert run(m.prepare(X)) is XA.RBROLLBACK
    assert X not in m.branches


def test_prepare_while_active_is_proto() -> None:
    m = manager()
    m.start(X, A)
    with xa_error(XA.ER_PROTO):
        run(m.prepare(X))


def test_prepare_of_an_empty_branch_is_rdonly() -> None:
    m = manager()
    m.start(X, A)
    m.end(X, A)
    assert run(m.prepare(X)) is XA.RDONLY
    assert m.recover() == []


def test_two_phase_commit() -> None:
    broker, m = with_work()
    assert run(m.prepare(X)) is XA.OK
    assert m.recover() == [X]
    with xa_error(XA.ER_PROTO):
        run(m.prepare(X))
    with xa_error(XA.ER_PROTO):
        run(m.commit(X, one_phase=True))
    assert run(m.commit(X)) is XA.OK
    assert broker.vhosts["/"].queues["q"].message_count == 1
    with xa_error(XA.ER_NOTA):
        run(m.commit(X))


def test_two_phase_commit_without_prepare_is_proto() -> None:
    _, m = with_work()
    with xa_error(XA.ER_PROTO):
        run(m.commit(X))


def test_one_phase_commit() -> None:
    broker, m = with_work()
    assert run(m.commit(X, one_phase=True)) is XA.OK
    assert broker.vhosts["/"].queues["q"].message_count == 1


def test_rollback_of_prepared_branch_applies_nothing() -> None:
    broker, m = with_work()
    run(m.prepare(X))
    assert m.rollback(X) is XA.OK
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_rollback_while_associated_is_proto() -> None:
    m = manager()
    m.start(X, A)
    with xa_error(XA.ER_PROTO):
        m.rollback(X)


def test_rolled_back_dequeues_go_back_to_the_queue() -> None:
    broker = Broker("t", clock=Clock(100.0))
    q = broker.add_vhost("/").declare_queue("q", owner=None)
    q.enqueue(Message("", "q", build_header(1), b"m"))
    entry = q.get()
    assert entry is not None
    branch = broker.dtx.start(X, A)
    branch.accept([(q, entry)], [])
    broker.dtx.end(X, A)
    broker.dtx.rollback(X)
    again = q.get()
    assert again is entry and again.redelivered


def test_timeout_makes_the_branch_rollback_only() -> None:
    clock = Clock(100.0)
    m = DtxManager([], clock)
    m.start(X, A)
    m.set_timeout(X, 5)
    assert m.get_timeout(X) == 5
    clock.now += 6
    m.tick(clock.now)
    assert m.end(X, A) is XA.RBTIMEOUT
    assert run(m.prepare(X)) is XA.RBTIMEOUT


def test_bad_timeout_is_inval() -> None:
    m = manager()
    m.start(X, A)
    with xa_error(XA.ER_INVAL):
        m.set_timeout(X, -1)


def test_heuristic_outcomes_need_forget() -> None:
    broker, m = with_work()
    run(m.prepare(X))
    m.decide(X, commit=True)
    assert run(m.commit(X)) is XA.HEURCOM
    assert m.recover() == [X]
    assert m.forget(X) is XA.OK
    assert m.recover() == []
    assert broker.vhosts["/"].queues["q"].message_count == 1


def test_heuristic_rollback_answers_heurrb() -> None:
    broker, m = with_work()
    run(m.prepare(X))
    m.decide(X, commit=False)
    assert m.rollback(X) is XA.HEURRB
    assert broker.vhosts["/"].queues["q"].message_count == 0


def test_forget_of_a_branch_not_heuristic_is_proto() -> None:
    _, m = with_work()
    with xa_error(XA.ER_PROTO):
        m.forget(X)
    with xa_error(XA.ER_NOTA):
        m.forget(Xid(9, b"none"))


def test_channel_closing_while_associated_forces_rollback() -> None:
    m = manager()
    m.start(X, A)
    m.owner_gone(A)
    assert run(m.prepare(X)) is XA.RBROLLBACK


def test_prepared_branch_survives_a_restart_through_the_store() -> None:
    broker, m = with_work()
    q = broker.vhosts["/"].queues["q"]
    q.enqueue(Message("", "q", build_header(1, None), b"held"))
    run(m.prepare(X))
    record = broker.store.load()
    assert [p.xid for p in record.prepared] == [X.key]
    fresh = Broker("t2", clock=Clock(100.0))
    fresh.add_vhost("/").declare_queue("q", owner=None)
    fresh.restore(record)
    assert fresh.dtx.recover() == [X]
    assert run(fresh.dtx.commit(X)) is XA.OK
    assert fresh.vhosts["/"].queues["q"].message_count == 1


def test_xid_limits() -> None:
    with xa_error(XA.ER_INVAL):
        Xid(1, b"")
    with xa_error(XA.ER_INVAL):
        Xid(1, b"x" * 65)
    assert Xid.from_key(X.key) == X
