import pytest

from brokerha.txlog.cli import force_split
from brokerha.txlog.engine.config import SplitRecovery
from brokerha.txlog.engine.messages import Ballot
from brokerha.txlog.engine.queues import GENESIS
from brokerha.txlog.engine.records import TxRecord
from brokerha.txlog.engine.recovery import choose_winner, plan
from brokerha.txlog.simulation.faults import run_seed
from brokerha.txlog.simulation.simulation import SimParams


def ballot(master: str, *ids: str) -> Ballot:
    return Ballot(master, 1, GENESIS, tuple(TxRecord(i, n, i.split(".")[-1], 0) for n, i in enumerate(ids)))


def test_the_vote_picks_the_queue_most_queues_are_prefixes_of() -> None:
    a = ballot("dc1", "t1.dc1", "t2.dc2", "t3.dc1")
    b = ballot("dc2", "t1.dc1", "t2.dc2")
    c = ballot("dc3", "t1.dc1", "x.dc3", "y.dc3", "z.dc3")
    assert choose_winner([a, b, c]).master == "dc1"


def test_the_vote_breaks_ties_by_length_then_smaller_ids() -> None:
    short = ballot("dc1", "t1.dc1")
    long = ballot("dc2", "t2.dc2", "t3.dc2")
    assert choose_winner([short, long]).master == "dc2"
    left, right = ballot("dc1", "a.dc1"), ballot("dc2", "b.dc2")
    assert choose_winner([right, left]).master == "dc1"


def test_every_master_decides_the_same_winner_whatever_the_order() -> None:
    ballots = [ballot("dc1", "a.dc1"), ballot("dc2", "a.dc1", "b.dc2"), ballot("dc3", "c.dc3")]
    assert {choose_winner(order).master for order in (ballots, ballots[::-1])} == {"dc2"}


@pytest.mark.parametrize(
    ("strategy", "winner_restores", "loser_restores"),
    [(SplitRecovery.NONE, False, False), (SplitRecovery.SIMPLE, True, True), (SplitRecovery.SMART, False, True)],
)
def test_strategies_decide_who_restores(strategy, winner_restores: bool, loser_restores: bool) -> None:
    ballots = [
        ballot("dc1", "a.dc1", "b.dc2"),
        ballot("dc2", "a.dc1", "b.dc2"),
        ballot("dc3", "a.dc1", "c.dc3", "d.dc1"),
    ]
    assert plan("dc1", ballots, strategy).restore is winner_restores
    loser = plan("dc3", ballots, strategy)
    assert loser.restore is loser_restores and loser.loser and loser.fork == 1
    assert [r.tx_id for r in loser.tail] == ["b.dc2"]
    assert [r.tx_id for r in loser.renegotiate] == ["c.dc3"]  # only its own post-fork txs


@pytest.mark.parametrize("strategy", list(SplitRecovery))
def test_split_and_rejoin_converge_under_every_strategy(strategy: SplitRecovery) -> None:
    params = SimParams(masters=3, strategy=strategy)
    result = run_seed(7, params, profile="none", setup=force_split)
    assert result.violation is None
    kinds = {e.kind for m in result.masters.values() for e in m.events}
    assert {"peer-dropped", "split-detected", "vote", "rejoin"} <= kinds
    lonely = result.masters["dc3"]
    renegotiated = [e for e in lonely.events if e.kind == "renegotiate"]
    assert renegotiated and all(e.detail["replay_of"] for e in renegotiated)
    logs = {tuple(m.durable.sync.ids()) for m in result.masters.values()}
    assert len(logs) == 1
    replayed = [r for r in result.masters["dc1"].durable.sync.records() if r.replay_of]
    assert {r.replay_of for r in replayed} == {e.detail["replay_of"] for e in renegotiated}
    if strategy is not SplitRecovery.NONE:
        assert any(e.kind == "restore" for e in lonely.events)
        models = {repr(sorted((q, sorted(v)) for q, v in m.durable.model.queues.items())) for m in result.masters.values()}
        assert len(models) == 1  # workers restored and replayed: every DC holds the same messages
    else:
        assert not any(e.kind == "restore" for e in lonely.events)
    if strategy is SplitRecovery.SIMPLE:
        assert all(any(e.kind == "restore" for e in m.events) for m in result.masters.values())
