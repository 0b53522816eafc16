"""Retention, delayed execution and what survives a restart, at engine level."""

from brokerha.txlog.engine.config import SplitRecovery
from brokerha.txlog.engine.messages import CatchUp, DeliverOrdered, Persist, Post, Vote
from brokerha.txlog.engine.records import Operation, TxBody, TxRecord
from brokerha.txlog.engine.rounds import RoundEngine


def test_retention_prunes_what_every_master_holds_and_keeps_agreeing(mesh_factory) -> None:
    mesh = mesh_factory(3, tx_log_max_size=2)
    for i in range(6):
        mesh.tx(f"dc{i % 3 + 1}")
        mesh.settle(rounds=3)
    mesh.settle(rounds=30, dt=200)
    engines = mesh.engines.values()
    assert {len(e.sync) for e in engines} == {6}
    assert {e.merge_base() for e in engines} and len({e.merge_base() for e in engines}) == 1
    assert all(e.sync.offset.length > 0 and len(e.sync.entries) < 6 for e in engines)
    assert any(isinstance(a, Persist) and a.key == "sync.prune" for a in mesh.actions["dc1"])
    tx = mesh.tx("dc2")
    mesh.settle()
    assert all(e.sync.contains(tx) for e in engines)


def test_retention_by_age(mesh_factory) -> None:
    mesh = mesh_factory(3, tx_log_max_depth_hours=0.0001)  # 360 ms
    mesh.tx("dc1")
    mesh.settle()
    mesh.settle(rounds=20, dt=100)
    assert all(e.sync.offset.length == 1 and not e.sync.entries for e in mesh.engines.values())


def _catch_up(engine: RoundEngine) -> CatchUp:
    record = TxRecord("0000000000010000.dc1", 1, "dc1", 0)
    body = TxBody(record.tx_id, (Operation("enqueue", "/q", "m1"),))
    return CatchUp("dc1", 0, engine.members, engine.merge_base(), (record,), (body,))


def test_simple_and_smart_delay_execution_while_a_member_is_silent(mesh_factory) -> None:
    mesh = mesh_factory(3, split_recovery=SplitRecovery.SMART)
    mesh.settle(rounds=2)
    for _ in range(10):  # dc3 silent for 2 s: suspected, not yet dropped (MaxPeerLag 30 s)
        mesh.drop(src="dc3")
        mesh.deliver()
        mesh.tick("dc1", "dc2", dt=200)
    engine = mesh.engines["dc2"]
    actions = engine.received(_catch_up(engine), mesh.now)
    assert len(engine.sync) == 1 and not any(isinstance(a, DeliverOrdered) for a in actions)
    post = Post("dc3", 0, engine.members, engine.merge_base(), mesh.now, ())
    assert any(isinstance(a, DeliverOrdered) for a in engine.received(post, mesh.now))


def test_strategy_none_does_not_delay_execution(mesh_factory) -> None:
    mesh = mesh_factory(3, split_recovery=SplitRecovery.NONE)
    mesh.tick("dc2", dt=2_000)
    engine = mesh.engines["dc2"]
    assert any(isinstance(a, DeliverOrdered) for a in engine.received(_catch_up(engine), mesh.now))


def test_a_master_that_voted_still_votes_with_the_same_ballot_after_a_restart(mesh_factory) -> None:
    mesh = mesh_factory(3)
    engine = mesh.engines["dc1"]
    engine.received(Post("dc2", 1, frozenset({"dc2"}), engine.merge_base(), 5, ()), 10)  # a later generation
    assert engine.voting
    ballot = engine.durable.ballot
    restarted = RoundEngine(engine.config, 500, engine.durable)
    assert restarted.voting and restarted.votes == {"dc1": ballot}
    sent = [a.message for a in restarted.tick(1_000) if hasattr(a, "message")]
    assert sent and all(isinstance(m, Vote) and m.ballots == (ballot,) for m in sent)


def test_the_counter_and_ids_never_go_back_across_a_restart(mesh_factory) -> None:
    mesh = mesh_factory(3)
    engine = mesh.engines["dc1"]
    first, _ = engine.local_tx([Operation("enqueue", "/q", "m")], 5_000)
    restarted = RoundEngine(engine.config, 100, engine.durable)  # on a host whose clock is behind
    second, _ = restarted.local_tx([Operation("enqueue", "/q", "n")], 100)
    assert second.timestamp > first.timestamp and second.tx_id > first.tx_id
    assert first.tx_id in restarted.incoming  # own unsynchronised transactions are durable


def test_a_peer_added_at_runtime_joins_through_a_vote(mesh_factory) -> None:
    mesh = mesh_factory(4)
    ids = sorted(mesh.engines)
    for m in ids[:3]:  # dc1..dc3 do not know dc4 yet
        config = mesh.engines[m].config.without_peer("dc4")
        mesh.engines[m] = RoundEngine(config, 0)
    mesh.inflight.clear()
    mesh.tx("dc1")
    mesh.settle(rounds=5)
    assert "dc4" not in mesh.engines["dc1"].members
    for m in ids[:3]:
        mesh.take(m, mesh.engines[m].add_peer("dc4", "brokerha://dc4", mesh.now))
    mesh.settle(rounds=40, dt=100)
    assert all(e.members == frozenset(ids) and e.generation == 1 for e in mesh.engines.values())
    tx = mesh.tx("dc4")
    mesh.settle(rounds=10, dt=50)
    logs = {tuple(e.sync.ids()) for e in mesh.engines.values()}
    assert len(logs) == 1 and tx in next(iter(logs))
