"""Round engine scenarios, driven by hand through the Mesh of conftest.py."""

from brokerha.txlog.engine.config import SplitRecovery
from brokerha.txlog.engine.messages import (
    Backup,
    Bodies,
    CatchUp,
    Event,
    FetchBodies,
    Persist,
    Post,
    Send,
)
from brokerha.txlog.engine.queues import SyncEntry
from brokerha.txlog.engine.records import TxRecord
from brokerha.txlog.engine.rules import Rules
from brokerha.txlog.engine.state import DurableState


def test_three_masters_agree_on_one_order(mesh_factory) -> None:
    mesh = mesh_factory(3)
    ids = [mesh.tx(m) for m in ("dc1", "dc2", "dc3", "dc1")]
    mesh.settle()
    assert mesh.sync_ids("dc1") == mesh.sync_ids("dc2") == mesh.sync_ids("dc3")
    assert sorted(mesh.sync_ids("dc1")) == sorted(ids)


def test_timed_out_round_does_not_add_without_every_member(mesh_factory) -> None:
    mesh = mesh_factory(3)
    mesh.settle(rounds=2)  # everyone has posted once: counters are known
    mesh.tx("dc1")
    mesh.tx("dc2")
    for _ in range(5):  # dc3's posts are lost from now on; rounds time out
        mesh.drop(src="dc3")
        mesh.deliver()
        mesh.tick(dt=200)
    assert mesh.sync_ids("dc1") == [] and mesh.sync_ids("dc2") == []


def test_the_seeds_timed_out_round_adds_with_last_known_counters(mesh_factory) -> None:
    mesh = mesh_factory(3, rules=Rules.without(["full"]))
    mesh.settle(rounds=2)
    mesh.tx("dc1")
    mesh.drop(dst="dc3")
    mesh.now += 1_000  # dc3 posts a counter above the new transaction's timestamp
    mesh.tick("dc3")
    mesh.deliver(src="dc3")
    mesh.now -= 1_000
    for _ in range(5):
        mesh.drop(src="dc3")
        mesh.drop(dst="dc3")
        mesh.deliver()
        mesh.tick("dc1", "dc2", dt=200)
    assert len(mesh.sync_ids("dc1")) == 1  # ordered without dc3's post: what F1 forbids


def test_body_is_pushed_with_the_first_post_only(mesh_factory) -> None:
    mesh = mesh_factory(3)
    mesh.settle(rounds=1)
    mesh.inflight.clear()
    tx = mesh.tx("dc1")
    mesh.tick("dc1", dt=5)
    first = [m for s, _, m in mesh.inflight if s == "dc1" and isinstance(m, Post)]
    assert first and all(tx in {b.tx_id for b in p.bodies} for p in first)
    mesh.inflight.clear()
    mesh.tick("dc1", dt=200)
    later = [m for s, _, m in mesh.inflight if s == "dc1" and isinstance(m, Post)]
    assert later and all(tx in {r.tx_id for r in p.incoming} and not p.bodies for p in later)


def test_missing_body_is_fetched_from_the_master_that_listed_it(mesh_factory) -> None:
    mesh = mesh_factory(3)
    mesh.settle(rounds=1)
    tx = mesh.tx("dc1")
    mesh.tick("dc1", dt=5)
    mesh.drop(src="dc1", dst="dc2")  # dc2 misses the post with the body
    mesh.deliver(src="dc1", dst="dc3")
    mesh.drop(src="dc3", dst="dc1")
    mesh.tick("dc3", dt=5)
    mesh.deliver(src="dc3", dst="dc2", kind=Post)  # dc3 lists the tx to dc2
    fetches = [(d, m) for s, d, m in mesh.inflight if s == "dc2" and isinstance(m, FetchBodies)]
    assert fetches == [("dc3", FetchBodies("dc2", (tx,)))]
    mesh.deliver(src="dc2", dst="dc3", kind=FetchBodies)
    assert mesh.deliver(src="dc3", dst="dc2", kind=Bodies) == 1
    assert tx in mesh.engines["dc2"].incoming
    mesh.settle()
    assert mesh.sync_ids("dc2") == [tx]


def test_idle_after_an_empty_round_and_busy_on_a_transaction(mesh_factory) -> None:
    mesh = mesh_factory(3, idle_interval_ms=1_000)
    mesh.settle(rounds=3)
    engine = mesh.engines["dc1"]
    assert not engine.busy and engine.wakeup_after() > 500
    mesh.tx("dc1")
    assert engine.wakeup_after() <= engine.config.post_spacing_ms


def test_a_peer_posting_news_wakes_an_idle_master(mesh_factory) -> None:
    mesh = mesh_factory(3, idle_interval_ms=1_000)
    mesh.settle(rounds=3)
    mesh.tx("dc2")
    mesh.tick("dc2", dt=5)
    mesh.deliver(src="dc2", dst="dc1")
    assert mesh.engines["dc1"].busy and mesh.engines["dc1"].wakeup_after() <= 5


def test_persist_actions_rebuild_the_durable_state(mesh_factory) -> None:
    mesh = mesh_factory(3)
    for m in ("dc1", "dc2", "dc3", "dc2"):
        mesh.tx(m)
    mesh.settle()
    engine = mesh.engines["dc2"]
    replica = DurableState(members=engine.config.masters, strategy=engine.config.split_recovery)
    for action in mesh.actions["dc2"]:
        if isinstance(action, Persist):
            replica.apply(action)
    assert replica.sync.ids() == engine.sync.ids()
    assert replica.counter_reserved == engine.durable.counter_reserved >= engine.counter.value
    assert replica.model.queues == engine.durable.model.queues


def test_the_counter_is_persisted_before_the_post_that_relies_on_it(mesh_factory) -> None:
    mesh = mesh_factory(3)
    mesh.actions.clear()
    mesh.tick("dc1", dt=1_000)
    actions = mesh.actions["dc1"]
    persisted = next(i for i, a in enumerate(actions) if isinstance(a, Persist) and a.key == "counter")
    first_send = next(i for i, a in enumerate(actions) if isinstance(a, Send))
    assert persisted < first_send


def test_a_silent_member_is_dropped_after_max_peer_lag_with_a_backup(mesh_factory) -> None:
    mesh = mesh_factory(3, max_peer_lag_ms=2_000, split_recovery=SplitRecovery.SMART)
    mesh.settle(rounds=2)
    for _ in range(12):
        mesh.drop(src="dc3")
        mesh.drop(dst="dc3")
        mesh.deliver()
        mesh.tick("dc1", "dc2", dt=200)
    for m in ("dc1", "dc2"):
        assert mesh.engines[m].members == {"dc1", "dc2"} and mesh.engines[m].split
        kinds = [a.kind for a in mesh.actions[m] if isinstance(a, Event)]
        assert "peer-dropped" in kinds and "split-detected" in kinds
        assert any(isinstance(a, Backup) for a in mesh.actions[m])
    tx = mesh.tx("dc1")
    for _ in range(6):
        mesh.drop(dst="dc3")
        mesh.deliver()
        mesh.tick("dc1", "dc2", dt=100)
    assert mesh.sync_ids("dc1") == mesh.sync_ids("dc2") == [tx]  # continues without dc3: the acknowledged split


def test_no_backup_under_strategy_none(mesh_factory) -> None:
    mesh = mesh_factory(3, max_peer_lag_ms=2_000, split_recovery=SplitRecovery.NONE)
    for _ in range(12):
        mesh.drop(dst="dc3")
        mesh.drop(src="dc3")
        mesh.deliver()
        mesh.tick("dc1", "dc2", dt=200)
    assert mesh.engines["dc1"].split
    assert not any(isinstance(a, Backup) for a in mesh.actions["dc1"])


def test_a_member_posting_a_smaller_set_shrinks_my_view(mesh_factory) -> None:
    mesh = mesh_factory(3, max_peer_lag_ms=2_000)
    mesh.engines["dc1"].tick(2_500)  # dc1 heard nobody: drops both
    mesh.engines["dc2"].received(
        Post("dc3", 0, frozenset({"dc2", "dc3"}), mesh.engines["dc2"].merge_base(), 1, ()), 10
    )
    assert mesh.engines["dc2"].members == {"dc2", "dc3"}


def test_a_master_dropped_by_a_member_drops_it_too(mesh_factory) -> None:
    mesh = mesh_factory(3)
    engine = mesh.engines["dc2"]
    engine.received(Post("dc1", 0, frozenset({"dc1", "dc3"}), engine.merge_base(), 1, ()), 10)
    assert engine.members == {"dc2", "dc3"}


def _queue_state(engine, ids: list[str], origin: str = "dc1") -> None:
    engine.durable.sync.append(SyncEntry(TxRecord(i, n, origin, 0), 0, 0) for n, i in enumerate(ids))


def test_a_lagger_appends_a_tail_only_onto_the_exact_prefix(mesh_factory) -> None:
    mesh = mesh_factory(3)
    lagger = mesh.engines["dc2"]
    _queue_state(mesh.engines["dc1"], ["a", "b", "c"])
    _queue_state(lagger, ["a"])
    forerunner = mesh.engines["dc1"]
    wrong_base = forerunner.sync.base_at(2)  # a prefix the lagger does not hold
    tail = tuple(forerunner.sync.records(2))
    lagger.received(CatchUp("dc1", 0, lagger.members, wrong_base, tail, ()), 10)
    assert lagger.sync.ids() == ["a"]
    right_base = forerunner.sync.base_at(1)
    lagger.received(CatchUp("dc1", 0, lagger.members, right_base, tuple(forerunner.sync.records(1)), ()), 10)
    assert lagger.sync.ids() == ["a", "b", "c"]
    lagger.received(CatchUp("dc1", 0, lagger.members, right_base, tuple(forerunner.sync.records(1)), ()), 10)
    assert lagger.sync.ids() == ["a", "b", "c"]  # a duplicate tail is not appended twice


def test_a_forerunner_sends_its_tail_to_a_lagger(mesh_factory) -> None:
    mesh = mesh_factory(3)
    _queue_state(mesh.engines["dc1"], ["a", "b"])
    _queue_state(mesh.engines["dc2"], ["a"])
    mesh.inflight.clear()
    mesh.tick("dc2", dt=1_000)
    mesh.deliver(src="dc2", dst="dc1")
    catchups = [m for s, d, m in mesh.inflight if s == "dc1" and d == "dc2" and isinstance(m, CatchUp)]
    assert catchups and [r.tx_id for r in catchups[0].tail] == ["b"]


def _forked(mesh_factory, rules: Rules):
    """dc1 and dc2 hold different histories that end with the same id (an earlier fault)."""
    mesh = mesh_factory(3, rules=rules)
    _queue_state(mesh.engines["dc1"], ["a", "x"])
    _queue_state(mesh.engines["dc2"], ["b", "x"])
    _queue_state(mesh.engines["dc3"], ["a", "x"])
    mesh.inflight.clear()
    mesh.tick("dc2", dt=1_000)
    mesh.deliver(src="dc2", dst="dc1")
    return mesh


def test_merge_base_by_hash_detects_a_fork_that_the_last_id_hides(mesh_factory) -> None:
    mesh = _forked(mesh_factory, Rules())
    kinds = [a.kind for a in mesh.actions["dc1"] if isinstance(a, Event)]
    assert "diverged" in kinds and mesh.engines["dc1"].voting
    mesh.settle(rounds=30, dt=50)
    assert mesh.sync_ids("dc1") == mesh.sync_ids("dc2") == mesh.sync_ids("dc3")


def test_merge_base_by_last_id_never_detects_the_fork(mesh_factory) -> None:
    mesh = _forked(mesh_factory, Rules.without(["hash"]))
    mesh.settle(rounds=30, dt=50)
    kinds = [a.kind for a in mesh.actions["dc1"] if isinstance(a, Event)]
    assert "diverged" not in kinds and not mesh.engines["dc1"].voting
    assert mesh.sync_ids("dc1") != mesh.sync_ids("dc2")  # and nobody ever notices
