"""The election, one property per test, on a hand-driven in-memory network (etcd-raft style).

Messages are queued until the test delivers them, so every scenario is built
explicitly: who ticks when, what arrives, who is cut off.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import pytest

from brokerha.cluster.election import (
    LATE_WARNING_EVERY,
    Action,
    BecomeBackup,
    BecomePrimary,
    Election,
    ElectionTiming,
    Heartbeat,
    HeartbeatAck,
    NewEpoch,
    Persist,
    Position,
    PromoteRefused,
    Send,
    StopServing,
    TransferPrimary,
    Unsafe,
    VoteReply,
    VoteRequest,
)
from brokerha.cluster.messages import REGISTRY, Message

TIMING = ElectionTiming(heartbeat_interval=0.2, lease_timeout=1.0, election_timeout=1.5)
STEP = 0.05


@dataclass
class Mesh:
    nodes: dict[str, Election]
    now: float = 0.0
    inflight: list[tuple[str, str, Message]] = field(default_factory=list)
    actions: dict[str, list[Action]] = field(default_factory=dict)
    cut: set[str] = field(default_factory=set)       # isolated nodes: nothing in or out
    paused: set[str] = field(default_factory=set)    # neither ticked nor delivered to
    dropped: set[tuple[str, str]] = field(default_factory=set)  # one way only: (from, to)

    @classmethod
    def of(cls, n: int = 3, positions: dict[str, Position] | None = None,
           unsafe: Unsafe | None = None, timing: ElectionTiming = TIMING) -> Mesh:
        names = [f"n{i + 1}" for i in range(n)]
        positions = positions or {}
        nodes = {name: Election(name, names, epoch=0, voted_for=None,
                                position=positions.get(name, Position(0, 0)), timing=timing,
                                rng=random.Random(i), unsafe=unsafe)
                 for i, name in enumerate(names)}
        mesh = cls(nodes)
        for name, node in nodes.items():
            mesh.carry(name, node.start(0.0))
        return mesh

    def carry(self, name: str, actions: list[Action]) -> list[Action]:
        self.actions.setdefault(name, []).extend(actions)
        for action in actions:
            if isinstance(action, Send):
                self.inflight.append((name, action.to, action.message))
        return actions

    def deliver(self) -> None:
        while self.inflight:
            src, dst, msg = self.inflight.pop(0)
            if src in self.cut or dst in self.cut or (src, dst) in self.dropped:
                continue
            if dst in self.paused:
                continue
            self.carry(dst, self.nodes[dst].receive(self.now, src, msg))

    def run(self, until: float) -> None:
        while self.now < until - 1e-9:
            self.now = round(self.now + STEP, 6)
            for name, node in self.nodes.items():
                if name not in self.paused:
                    self.carry(name, node.tick(self.now))
            self.deliver()

    def primaries(self) -> list[str]:
        return [n for n, e in self.nodes.items() if e.role == "primary"]

    def serving(self) -> list[str]:
        return [n for n, e in self.nodes.items() if e.lease_valid(self.now)]

    def elect(self, until: float = 6.0) -> str:
        self.run(until)
        assert len(self.primaries()) == 1, self.status()
        return self.primaries()[0]

    def status(self) -> list[dict[str, object]]:
        return [e.status() for e in self.nodes.values()]

    # -- the scenarios' usual moves ----------------------------------------------------

    def close_links_to(self, name: str) -> None:
        """Every other node sees its link to ``name`` close (a SIGKILL, a reset)."""
        for other, node in self.nodes.items():
            if other != name:
                self.carry(other, node.link_down(self.now, name))

    def elect_other_than(self, old: str) -> str:
        """Run a step at a time until a node other than ``old`` is primary: that node.
        Meanwhile at most one of the others serves."""
        while not (new := [n for n in self.primaries() if n != old]):
            self.run(self.now + STEP)
            assert len([n for n in self.serving() if n != old]) <= 1, self.status()
        return new[0]

    def backups_hold(self, primary: str, position: Position) -> None:
        """The replication layer reports every node but ``primary`` at ``position``."""
        for name, node in self.nodes.items():
            if name != primary:
                node.set_position(position)

    def promote(self, old: str, target: str) -> list[Action]:
        """``old``, the primary, hands its role over to ``target`` (its actions)."""
        return self.carry(old, self.nodes[old].promote(self.now, target))


def member(name: str, epoch: int, position: Position, seed: int, *,
           voted_for: str | None = None, vote_floor: Position | None = None) -> Election:
    """One of n1, n2, n3 on its own, started from what it persisted; the test delivers."""
    return Election(name, ["n1", "n2", "n3"], epoch=epoch, voted_for=voted_for,
                    position=position, timing=TIMING, rng=random.Random(seed),
                    vote_floor=vote_floor)


def kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ if not isinstance(a, Send) else f"Send:{type(a.message).__name__}"
            for a in actions]


# ---- elections ----------------------------------------------------------------------------


def test_first_election_on_a_fresh_cluster_elects_exactly_one_serving_primary() -> None:
    mesh = Mesh.of(3)
    primary = mesh.elect()
    assert mesh.serving() == [primary]
    epoch = mesh.nodes[primary].epoch
    assert epoch == 1
    for name, node in mesh.nodes.items():
        assert node.epoch == epoch and node.primary == primary
        assert node.role == ("primary" if name == primary else "backup")
    assert [a for a in mesh.actions[primary] if isinstance(a, BecomePrimary)] == [BecomePrimary(1)]


def test_a_single_node_cluster_elects_itself() -> None:
    node = Election("solo", ["solo"], epoch=3, voted_for=None, position=Position(3, 7),
                    timing=TIMING, rng=random.Random(0))
    node.start(0.0)
    actions = node.tick(3.0)
    assert kinds(actions) == ["Persist", "BecomePrimary"]
    assert node.epoch == 4 and node.lease_valid(100.0)


def test_the_epoch_is_persisted_before_any_vote_request_is_sent() -> None:
    node = member("n1", 5, Position(5, 9), seed=1)
    node.start(0.0)
    pre = node.tick(3.0)  # pre-vote: nothing changes, nothing to persist
    assert kinds(pre) == ["Send:VoteRequest"] * 2 and node.epoch == 5
    assert all(a.message.pre and a.message.epoch == 6 for a in pre if isinstance(a, Send))
    actions = node.receive(3.0, "n2", VoteReply(6, "n2", True, True, 5, 9))
    assert actions[0] == Persist(6, "n1")
    assert kinds(actions) == ["Persist", "Send:VoteRequest", "Send:VoteRequest"]
    assert node.epoch == 6 and node.voted_for == "n1" and node.role == "candidate"


def test_a_voter_persists_its_vote_before_it_replies() -> None:
    voter = member("n2", 5, Position(5, 9), seed=2)
    voter.start(0.0)
    actions = voter.receive(3.0, "n1", VoteRequest(6, "n1", 5, 9))
    assert actions == [Persist(6, "n1"), Send("n1", VoteReply(6, "n2", True, False, 5, 9))]


def test_a_voter_never_grants_twice_in_one_epoch() -> None:
    voter = member("n3", 1, Position(1, 4), seed=3)
    voter.start(0.0)
    first = voter.receive(3.0, "n1", VoteRequest(2, "n1", 1, 4))
    second = voter.receive(3.1, "n2", VoteRequest(2, "n2", 1, 9))
    again = voter.receive(3.2, "n1", VoteRequest(2, "n1", 1, 4))  # a duplicate: same answer
    assert first[-1] == Send("n1", VoteReply(2, "n3", True, False, 1, 4))
    assert second == [Send("n2", VoteReply(2, "n3", False, False, 1, 4))]
    assert again == [Send("n1", VoteReply(2, "n3", True, False, 1, 4))]
    # after a restart from what was persisted, the vote is remembered
    restarted = member("n3", 2, Position(1, 4), seed=3, voted_for="n1")
    restarted.start(10.0)
    assert restarted.receive(10.0, "n2", VoteRequest(2, "n2", 1, 9))[-1].message.granted is False


def test_a_less_advanced_candidate_does_not_win() -> None:
    mesh = Mesh.of(3, {"n1": Position(2, 5), "n2": Position(2, 9), "n3": Position(2, 9)})
    mesh.nodes["n1"]._deadline = 0.1  # n1 times out first ...
    mesh.run(1.0)
    assert mesh.nodes["n1"].role != "primary"  # ... and is refused by both
    primary = mesh.elect()
    assert primary in ("n2", "n3")


def test_the_most_advanced_reachable_node_wins_even_when_it_asks_last() -> None:
    mesh = Mesh.of(3, {"n1": Position(1, 3), "n2": Position(1, 3), "n3": Position(1, 8)})
    mesh.cut = {"n2"}
    mesh.nodes["n3"]._deadline = 99.0  # n3 would not stand by itself yet
    mesh.run(8.0)
    assert mesh.primaries() == []  # n1 stood again and again: n3 refused each time
    assert mesh.nodes["n1"].epoch == 0  # refused at the pre-vote: no epoch was spent
    mesh.nodes["n3"]._deadline = mesh.now
    assert mesh.elect(mesh.now + 1.0) == "n3"


def test_a_catching_up_node_never_stands() -> None:
    node = member("n1", 4, Position.INVALID, seed=4)
    node.start(0.0)
    for t in range(1, 30):
        assert node.tick(float(t)) == []
    assert node.role == "joining" and node.epoch == 4


def test_a_catching_up_voter_still_refuses_a_candidate_behind_what_it_acknowledged() -> None:
    voter = member("n2", 3, Position(3, 10), seed=5)
    voter.start(0.0)
    voter.set_position(Position.INVALID)  # joining a primary again: catching up
    behind = voter.receive(5.0, "n1", VoteRequest(4, "n1", 3, 9))
    assert behind[-1].message.granted is False
    ahead = voter.receive(5.0, "n3", VoteRequest(5, "n3", 3, 10))
    assert ahead[-1].message.granted is True
    # the floor survives a restart when the caller persists it
    restarted = member("n2", 5, Position.INVALID, seed=5, vote_floor=Position(3, 10))
    restarted.start(9.0)
    assert restarted.receive(9.0, "n1", VoteRequest(6, "n1", 3, 9))[-1].message.granted is False


# ---- leases and epochs --------------------------------------------------------------------


def test_a_primary_without_a_majority_stops_serving_within_lease_timeout() -> None:
    """It serves nobody once its lease ran out; it keeps its role for ``lapse_timeout``
    (a stall it comes back from renews the lease), then steps down."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    cut_at = mesh.now
    mesh.cut = {primary}
    while node.serving:
        mesh.run(mesh.now + STEP)
    assert mesh.now - cut_at <= TIMING.lease_timeout + STEP
    assert node.role == "primary" and node.lapsed(mesh.now)
    while node.role == "primary":
        mesh.run(mesh.now + STEP)
    assert mesh.now - cut_at <= TIMING.lease_timeout + node.lapse_timeout + STEP
    stops = [a for a in mesh.actions[primary] if isinstance(a, StopServing)]
    assert len(stops) == 1 and "no majority" in stops[0].reason
    assert not node.serving and node.status()["lapses"] == 1


def test_a_primary_whose_stall_outlasts_the_lease_but_not_the_lapse_keeps_its_role() -> None:
    """Issue 33: a stall of the primary's loop (a big commit, a purge) longer than the lease
    cost it the role, and its clients; now it serves again when the acks come in."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    epoch = node.epoch
    mesh.paused = {primary}
    # past the lease, short of the election timeout: the backups still stand by it
    stalled_to = mesh.now + (TIMING.lease_timeout + TIMING.election_timeout) / 2
    mesh.run(stalled_to)
    mesh.paused = set()
    assert node.lapsed(mesh.now) and node.role == "primary"
    mesh.run(mesh.now + 2 * TIMING.heartbeat_interval + STEP)
    assert node.serving and node.epoch == epoch and mesh.primaries() == [primary]
    assert not [a for a in mesh.actions[primary] if isinstance(a, StopServing)]
    assert node.status()["lapses"] == 1 and node.status()["lapses_renewed"] == 1


def test_with_step_down_at_lease_end_the_same_stall_costs_the_role() -> None:
    mesh = Mesh.of(3, unsafe=Unsafe(step_down_at_lease_end=True))
    primary = mesh.elect()
    mesh.paused = {primary}
    mesh.run(mesh.now + TIMING.lease_timeout + 0.2)
    mesh.paused = set()
    mesh.run(mesh.now + STEP)
    assert [a for a in mesh.actions[primary] if isinstance(a, StopServing)]


def test_at_most_one_node_serves_while_an_isolated_primary_is_replaced() -> None:
    mesh = Mesh.of(5)
    old = mesh.elect()
    mesh.cut = {old}
    end = mesh.now + 6.0
    while mesh.now < end:
        mesh.run(mesh.now + STEP)
        assert len(mesh.serving()) <= 1, mesh.status()
    assert mesh.serving() and mesh.serving() != [old]


def test_a_paused_primary_finds_itself_deposed_and_follows_the_new_one() -> None:
    mesh = Mesh.of(3)
    old = mesh.elect()
    old_epoch = mesh.nodes[old].epoch
    mesh.paused = {old}
    mesh.run(mesh.now + 5.0)
    new = [n for n in mesh.primaries() if n != old]
    assert len(new) == 1 and mesh.nodes[new[0]].epoch > old_epoch
    assert mesh.nodes[old].role == "primary"  # stale view: it has not run since
    assert not mesh.nodes[old].lease_valid(mesh.now)  # but it may not serve anyone
    mesh.paused = set()
    mesh.run(mesh.now + 1.0)
    node = mesh.nodes[old]
    assert node.role == "backup" and node.primary == new[0] and node.epoch == mesh.nodes[new[0]].epoch
    assert any(isinstance(a, StopServing) for a in mesh.actions[old])
    assert BecomeBackup(node.epoch, new[0]) in mesh.actions[old]


def test_a_higher_epoch_deposes_a_primary_which_persists_it_first() -> None:
    mesh = Mesh.of(3)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    other = next(n for n in mesh.nodes if n != primary)
    actions = node.receive(mesh.now, other, NewEpoch(node.epoch + 3, other))
    assert kinds(actions) == ["StopServing", "Persist"]
    assert node.role == "joining" and node.epoch == actions[1].epoch


def test_a_message_of_an_older_epoch_is_not_acted_on() -> None:
    mesh = Mesh.of(3)
    primary = mesh.elect(6.0)
    backup, third = (n for n in mesh.nodes if n != primary)
    node = mesh.nodes[backup]
    epoch = node.epoch
    stale_beat = node.receive(mesh.now, third, Heartbeat(epoch - 1, third, mesh.now))
    assert stale_beat == [Send(third, NewEpoch(epoch, backup))]  # only: "you are deposed"
    assert node.primary == primary and node.role == "backup"
    assert node.receive(mesh.now, third, VoteReply(epoch - 1, third, True, False, 0, 0)) == []
    stale_vote = node.receive(mesh.now + 5.0, third, VoteRequest(epoch - 1, third, 9, 9))
    assert stale_vote == [Send(third, VoteReply(epoch, backup, False, False, 0, 0))]
    assert node.epoch == epoch and node.voted_for == primary
    assert mesh.nodes[primary].receive(mesh.now, backup, HeartbeatAck(epoch - 1, backup, mesh.now,
                                                                      0, 0, True)) == []


def test_a_node_that_heard_a_primary_recently_does_not_vote() -> None:
    mesh = Mesh.of(3)
    primary = mesh.elect()
    backup, other = (n for n in mesh.nodes if n != primary)
    node = mesh.nodes[backup]
    epoch = node.epoch
    assert node.receive(mesh.now, other, VoteRequest(epoch + 1, other, 99, 99)) == []
    pre = node.receive(mesh.now, other, VoteRequest(epoch + 1, other, 99, 99, True))
    assert pre == [Send(other, VoteReply(epoch, backup, False, True, 0, 0))]
    assert node.epoch == epoch and node.voted_for == primary  # not even the epoch was adopted
    # once the primary has been silent for election_timeout, the same request is granted
    later = node.receive(mesh.now + TIMING.election_timeout, other,
                         VoteRequest(epoch + 1, other, 99, 99))
    assert later[-1] == Send(other, VoteReply(epoch + 1, backup, True, False, 0, 0))


def test_a_node_returning_from_a_partition_does_not_depose_a_healthy_primary() -> None:
    mesh = Mesh.of(3)
    primary = mesh.elect()
    loner = next(n for n in mesh.nodes if n != primary)
    epoch = mesh.nodes[primary].epoch
    mesh.cut = {loner}
    mesh.run(mesh.now + 10.0)  # it times out again and again: pre-votes, never a new epoch
    assert mesh.nodes[loner].epoch == epoch
    mesh.cut = set()
    mesh.run(mesh.now + 3.0)
    assert mesh.primaries() == [primary] and mesh.nodes[primary].epoch == epoch
    assert mesh.nodes[loner].role == "backup"


# ---- manual failover ----------------------------------------------------------------------


def test_promote_hands_the_primary_role_over_to_a_ready_backup() -> None:
    mesh = Mesh.of(3)
    old = mesh.elect()
    epoch = mesh.nodes[old].epoch
    target = next(n for n in mesh.nodes if n != old)
    mesh.backups_hold(old, Position(epoch, 0))  # ready
    mesh.run(mesh.now + 0.5)
    actions = mesh.promote(old, target)
    assert isinstance(actions[0], StopServing) and not mesh.nodes[old].lease_valid(mesh.now)
    assert actions[-1] == Send(target, TransferPrimary(epoch, target, epoch, 0))
    mesh.deliver()
    assert mesh.primaries() == [target] and mesh.nodes[target].epoch == epoch + 1
    assert mesh.serving() == [target]
    mesh.run(mesh.now + 1.0)
    assert all(n.primary == target for n in mesh.nodes.values())


def test_a_promoted_target_waits_until_it_holds_what_the_old_primary_held() -> None:
    mesh = Mesh.of(3)
    old = mesh.elect()
    epoch = mesh.nodes[old].epoch
    target = next(n for n in mesh.nodes if n != old)
    mesh.nodes[old].set_position(Position(epoch, 5))
    mesh.backups_hold(old, Position(epoch, 3))
    mesh.run(mesh.now + 0.5)
    mesh.promote(old, target)
    mesh.deliver()
    assert mesh.primaries() == []  # the target still misses events 4 and 5
    actions = mesh.carry(target, mesh.nodes[target].set_position(Position(epoch, 5)))
    assert kinds(actions)[0] == "Persist"
    assert all(m.transfer for m in (a.message for a in actions if isinstance(a, Send)))
    mesh.deliver()
    assert mesh.primaries() == [target]


def test_promote_refuses_an_unknown_or_not_ready_target_and_a_non_primary() -> None:
    mesh = Mesh.of(3)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    backup = next(n for n in mesh.nodes if n != primary)
    with pytest.raises(PromoteRefused, match="not a member"):
        node.promote(mesh.now, "n42")
    with pytest.raises(PromoteRefused, match="already the primary"):
        node.promote(mesh.now, primary)
    with pytest.raises(PromoteRefused, match="not a ready backup"):
        node.promote(mesh.now, backup)  # its position is of epoch 0: not caught up
    with pytest.raises(PromoteRefused, match="not the primary"):
        mesh.nodes[backup].promote(mesh.now, primary)
    assert node.lease_valid(mesh.now)  # a refused promote changes nothing
    assert isinstance(PromoteRefused("x"), ValueError)


# ---- configuration and wire ---------------------------------------------------------------


def test_timing_keeps_the_lease_shorter_than_the_election_timeout() -> None:
    ElectionTiming(0.1, 0.5, 0.6)
    with pytest.raises(ValueError, match="lease_timeout"):
        ElectionTiming(0.2, 1.5, 1.5)
    with pytest.raises(ValueError, match="heartbeat_interval"):
        ElectionTiming(1.0, 1.0, 2.0)
    with pytest.raises(ValueError):
        Election("n1", ["n2", "n3"], epoch=0, voted_for=None, position=Position(0, 0),
                 timing=TIMING, rng=random.Random(0))


def test_positions_order_by_epoch_then_seq_with_invalid_lowest() -> None:
    assert Position.INVALID < Position(0, 0) < Position(1, 0) < Position(1, 5) < Position(2, 0)
    assert not Position.INVALID.valid and Position(0, 0).valid


def test_election_messages_round_trip_through_wire_args() -> None:
    samples: list[Message] = [
        VoteRequest(3, "n1", 2, 9, True, False), VoteReply(3, "n2", True, True, 2, 8),
        Heartbeat(3, "n1", 12.5), HeartbeatAck(3, "n2", 12.5, 3, 4, True),
        TransferPrimary(3, "n2", 3, 4), NewEpoch(4, "n3"),
    ]
    for msg in samples:
        assert 10 <= msg.CODE <= 29 and REGISTRY[msg.CODE] is type(msg)
        assert type(msg).from_args(msg.to_args()) == msg


def _kill_primary_and_time_failover(mesh: Mesh, signal_link_loss: bool) -> float:
    old = mesh.elect()
    killed_at = mesh.now
    mesh.cut = {old}  # the dead primary: nothing in or out
    if signal_link_loss:
        mesh.close_links_to(old)
    mesh.elect_other_than(old)
    return mesh.now - killed_at


def test_a_closed_link_to_the_primary_elects_a_successor_at_once() -> None:
    """The SIGKILL case: every backup's link closes; no stickiness wait, no random wait."""
    fast = [_kill_primary_and_time_failover(Mesh.of(n), True) for n in (3, 5)]
    slow = [_kill_primary_and_time_failover(Mesh.of(n), False) for n in (3, 5)]
    # the first ranked backup stands at once: a pre-vote and a vote round trip (a step each)
    assert max(fast) <= TIMING.heartbeat_interval / 2 + 3 * STEP, (fast, slow)
    assert min(slow) >= TIMING.election_timeout - TIMING.heartbeat_interval  # heard just before


def test_a_pre_vote_refused_before_the_voter_saw_its_own_link_close_is_retried_soon() -> None:
    mesh = Mesh.of(3)
    old = mesh.elect()
    first, second = sorted(n for n in mesh.nodes if n != old)
    killed_at = mesh.now
    mesh.cut = {old}
    mesh.carry(first, mesh.nodes[first].link_down(mesh.now, old))
    mesh.run(mesh.now + STEP)  # first stands; second still counts the primary as heard
    assert mesh.primaries() == [old]
    mesh.carry(second, mesh.nodes[second].link_down(mesh.now, old))
    mesh.elect_other_than(old)
    assert mesh.now - killed_at <= 2 * TIMING.heartbeat_interval + 3 * STEP


def test_link_down_for_a_node_that_is_not_our_primary_changes_nothing() -> None:
    mesh = Mesh.of(3)
    primary = mesh.elect()
    backup = next(n for n in mesh.nodes if n != primary)
    other = next(n for n in mesh.nodes if n not in (primary, backup))
    deadline = mesh.nodes[backup]._deadline
    assert mesh.nodes[backup].link_down(mesh.now, other) == []
    assert mesh.nodes[backup]._deadline == deadline


def test_a_live_primary_is_not_deposed_by_a_broken_link_alone() -> None:
    """Only the link from one backup broke: the primary still reaches the other one."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    epoch = mesh.nodes[primary].epoch
    backup = next(n for n in mesh.nodes if n != primary)
    mesh.carry(backup, mesh.nodes[backup].link_down(mesh.now, primary))
    mesh.carry(primary, mesh.nodes[primary].link_down(mesh.now, backup))
    mesh.run(mesh.now + 4 * TIMING.election_timeout)
    assert mesh.primaries() == [primary] and mesh.nodes[primary].epoch == epoch
    assert mesh.nodes[backup].role == "backup"  # its next heartbeat made it follow again


def test_a_primary_whose_links_to_a_majority_close_stops_serving_at_once() -> None:
    mesh = Mesh.of(5)
    primary = mesh.elect()
    backups = sorted(n for n in mesh.nodes if n != primary)
    node = mesh.nodes[primary]
    assert mesh.carry(primary, node.link_down(mesh.now, backups[0])) == []
    assert node.serving  # three acknowledgements left, two needed
    assert mesh.carry(primary, node.link_down(mesh.now, backups[1])) == []
    stops = mesh.carry(primary, node.link_down(mesh.now, backups[2]))
    assert [type(a) for a in stops] == [StopServing] and "links to a majority" in stops[0].reason
    assert not node.serving


def test_a_deposed_primary_that_still_runs_serves_at_most_lease_timeout_after_its_successor() -> None:
    """Both backups' links reset while the primary lives (then a partition keeps it apart).

    They elect a successor at once, before the old lease ran out: two nodes
    serve for a moment. The old one cannot confirm (its backups adopted the
    new epoch) and stops when its lease runs out.
    """
    mesh = Mesh.of(3)
    old = mesh.elect()
    mesh.close_links_to(old)
    mesh.cut = {old}
    mesh.elect_other_than(old)
    elected_at = mesh.now
    assert old in mesh.serving()  # the overlap the simulation's invariant (b) bounds
    while old in mesh.serving():
        mesh.run(mesh.now + STEP)
    assert mesh.now - elected_at <= TIMING.lease_timeout + STEP


def test_a_backup_cut_off_from_a_healthy_primary_backs_off_its_pre_votes() -> None:
    """Its link stays down (the others still hear the primary): its refused pre-vote rounds
    come ever less often, up to the election timeout, instead of every heartbeat interval."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    cut = next(n for n in mesh.nodes if n != primary)
    mesh.carry(cut, mesh.nodes[cut].link_down(mesh.now, primary))
    mesh.cut = {cut}  # its link stays down: no heartbeat reaches it, its pre-votes go nowhere
    started = mesh.now
    sent_before = len([a for a in mesh.actions[cut] if isinstance(a, Send)
                       and isinstance(a.message, VoteRequest) and a.message.pre])
    mesh.run(started + 10.0)
    rounds = len([a for a in mesh.actions[cut] if isinstance(a, Send)
                  and isinstance(a.message, VoteRequest) and a.message.pre]) - sent_before
    rounds //= len(mesh.nodes) - 1
    # without the back-off: about 10 s / 0.25 s = 40 rounds; with it, at most
    # log2(T / hb) fast ones and then one per election timeout
    assert 1 <= rounds <= 12, rounds
    assert mesh.primaries() == [primary]


# ---- failure detection judged on progress (issue 33) ----------------------------------------


def test_a_backup_that_stopped_hearing_the_primary_cannot_depose_it_while_its_peer_hears_it() -> None:
    """Check-quorum and pre-vote with stickiness: only the primary's packets to one backup
    are lost (a half-broken link, a stalled socket). That backup times out and asks for
    pre-votes, again and again; the other backup still hears the primary and refuses, and
    so does the primary, whose lease the other backup's acknowledgements keep: no epoch
    is ever raised, and the primary serves throughout."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    epoch = mesh.nodes[primary].epoch
    deaf, peer = sorted(n for n in mesh.nodes if n != primary)
    mesh.dropped = {(primary, deaf)}
    end = mesh.now + 10 * TIMING.election_timeout
    while mesh.now < end:
        mesh.run(mesh.now + STEP)
        assert mesh.serving() == [primary], mesh.status()
    node = mesh.nodes[deaf]
    assert node.role == "candidate" and node.epoch == epoch  # it stood, never won a pre-vote
    assert all(n.epoch == epoch for n in mesh.nodes.values())
    refused = [a.message for a in mesh.actions[peer] if isinstance(a, Send) and a.to == deaf
               and isinstance(a.message, VoteReply)]
    assert refused and not any(r.granted for r in refused)
    # one campaign, counted once with why it began; the rounds that retried it apart
    assert node.status()["elections"] == {"no_primary": 0, "election_timeout": 1,
                                          "link_down": 0, "transfer": 0}
    assert node.rounds["pre_vote"] >= 5 and node.rounds["vote"] == 0
    mesh.dropped = set()
    mesh.run(mesh.now + 2 * TIMING.heartbeat_interval)
    assert node.role == "backup" and node.primary == primary and mesh.primaries() == [primary]


def test_any_packet_of_the_primary_counts_as_hearing_it() -> None:
    """Replication events fill the link ahead of the heartbeats queued behind them: a backup
    that gets the primary's events (``heard``) and no heartbeat neither stands nor grants a
    pre-vote; only packets of its primary, in its epoch, count."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    epoch = mesh.nodes[primary].epoch
    backup, other = sorted(n for n in mesh.nodes if n != primary)
    node = mesh.nodes[backup]
    mesh.dropped = {(primary, backup)}  # no heartbeat reaches it
    end = mesh.now + 4 * TIMING.election_timeout
    while mesh.now < end:
        mesh.run(mesh.now + STEP)
        node.heard(mesh.now, primary, epoch)  # an Events packet, each step
    assert node.role == "backup" and node.rounds["pre_vote"] == 0
    pre = node.receive(mesh.now, other, VoteRequest(epoch + 1, other, 99, 99, True))
    assert pre == [Send(other, VoteReply(epoch, backup, False, True, 0, 0))]
    # another node's packet, or one of an older epoch, is no evidence of this primary
    silent_from = mesh.now
    while node.role == "backup":
        mesh.run(mesh.now + STEP)
        node.heard(mesh.now, other, epoch)
        node.heard(mesh.now, primary, epoch - 1)
    assert mesh.now - silent_from >= TIMING.election_timeout - STEP
    assert node.elections["election_timeout"] == 1


def test_each_campaign_is_counted_by_why_the_node_stood(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="brokerha.ha"):
        mesh = Mesh.of(3)
        first = mesh.elect()
    assert mesh.nodes[first].elections["no_primary"] == 1  # nobody was primary at start
    assert mesh.nodes[first].status()["last_election"]["reason"] == "no_primary"
    assert any("stands for election (no_primary" in r.getMessage() for r in caplog.records)
    caplog.clear()

    # a hang: nothing closes, the backups hear nothing for the election timeout
    mesh.paused = {first}
    with caplog.at_level(logging.WARNING, logger="brokerha.ha"):
        second = mesh.elect_other_than(first)
    assert mesh.nodes[second].elections["election_timeout"] == 1
    line = next(r.getMessage() for r in caplog.records if "stands for election" in r.getMessage())
    assert f"election_timeout: nothing heard from primary {first} for" in line
    mesh.paused = set()
    mesh.run(mesh.now + 1.0)
    assert mesh.nodes[first].stepdowns["newer_epoch"] == 1  # it woke up deposed

    # a kill: the links close
    mesh.cut = {second}
    mesh.close_links_to(second)
    third = mesh.elect_other_than(second)
    assert mesh.nodes[third].elections["link_down"] == 1
    assert mesh.nodes[third].status()["last_election"] == {
        "reason": "link_down", "at": mesh.nodes[third].last_election[1],  # type: ignore[index]
        "epoch": mesh.nodes[third].epoch}
    mesh.cut = set()
    mesh.run(mesh.now + 2.0)

    # a manual failover
    epoch = mesh.nodes[third].epoch
    target = next(n for n in mesh.nodes if n != third)
    mesh.backups_hold(third, Position(epoch, 0))
    mesh.run(mesh.now + 0.5)
    mesh.promote(third, target)
    mesh.deliver()
    assert mesh.primaries() == [target] and mesh.nodes[target].elections["transfer"] == 1
    assert mesh.nodes[third].stepdowns["transfer"] == 1
    total = {r: sum(n.elections[r] for n in mesh.nodes.values()) for r in mesh.nodes[first].elections}
    assert total["election_timeout"] >= 1 and total["link_down"] >= 1 and total["transfer"] == 1


def test_each_step_down_is_counted_by_why_the_primary_stopped() -> None:
    mesh = Mesh.of(3)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    mesh.cut = {primary}
    while node.role == "primary":
        mesh.run(mesh.now + STEP)
    stop = next(a for a in mesh.actions[primary] if isinstance(a, StopServing))
    assert stop.cause == "lease_lost" and node.stepdowns["lease_lost"] == 1
    assert node.status()["last_stepdown"]["reason"] == "lease_lost"

    five = Mesh.of(5)
    primary = five.elect()
    node = five.nodes[primary]
    for backup in sorted(n for n in five.nodes if n != primary)[:3]:
        five.carry(primary, node.link_down(five.now, backup))
    assert node.stepdowns == {"lease_lost": 0, "newer_epoch": 0, "links_closed": 1,
                              "transfer": 0}


def test_a_lapsed_primary_losing_one_link_of_two_keeps_its_role() -> None:
    """The stall lapsed its lease; one backup's link closes meanwhile. The other backup
    (a majority with the primary) still hears it: the lapse is renewed, nobody is elected."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    epoch = node.epoch
    gone, stays = sorted(n for n in mesh.nodes if n != primary)
    mesh.paused = {primary}
    mesh.cut = {gone}
    mesh.run(mesh.now + TIMING.lease_timeout + 0.1)
    mesh.paused = set()
    assert node.lapsed(mesh.now)
    assert mesh.carry(primary, node.link_down(mesh.now, gone)) == []
    mesh.run(mesh.now + 2 * TIMING.heartbeat_interval)
    assert node.serving and node.epoch == epoch and mesh.primaries() == [primary]
    assert node.lapses_renewed == 1 and sum(node.stepdowns.values()) == 0


def _lapse_while_cut_from(unsafe: Unsafe | None) -> tuple[Mesh, str, str, str]:
    """The remote-consume simulation's seed 141: the primary's link to ``back`` closed;
    the other backup's acknowledgements are late (a spiked packet) past the lease, not
    past the lapse: the primary is lapsed, and ``back``'s link to it has just come back."""
    mesh = Mesh.of(3, unsafe=unsafe)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    mesh.backups_hold(primary, Position(node.epoch, 0))
    back, other = sorted(n for n in mesh.nodes if n != primary)
    mesh.carry(back, mesh.nodes[back].link_down(mesh.now, primary))
    mesh.carry(primary, node.link_down(mesh.now, back))
    mesh.dropped = {(primary, back), (back, primary), (other, primary)}
    mesh.run(mesh.now + TIMING.lease_timeout + 0.2)
    assert node.lapsed(mesh.now) and node.role == "primary"
    assert mesh.nodes[other].role == "backup"  # it hears the primary: refuses ``back``
    mesh.dropped = set()
    return mesh, primary, back, other


def test_a_lapsed_primary_grants_no_pre_vote_nor_vote() -> None:
    """A lapsed primary is a live primary (stickiness): it does not grant a pre-vote or a
    vote to a node whose link to it comes back, which with its grant had a majority of
    two and deposed it (seed 141); its lapse is renewed, nobody is elected."""
    mesh, primary, back, _ = _lapse_while_cut_from(None)
    node = mesh.nodes[primary]
    epoch = node.epoch
    pos = Position(epoch, 0)
    pre = node.receive(mesh.now, back, VoteRequest(epoch + 1, back, pos.epoch, pos.seq, True))
    assert len(pre) == 1 and isinstance(pre[0], Send)
    assert isinstance(pre[0].message, VoteReply) and pre[0].message.granted is False
    assert node.receive(mesh.now, back, VoteRequest(epoch + 1, back, pos.epoch, pos.seq)) == []
    assert node.role == "primary" and node.epoch == epoch
    mesh.run(mesh.now + 2 * TIMING.heartbeat_interval + STEP)
    assert node.serving and mesh.primaries() == [primary]
    assert {e.epoch for e in mesh.nodes.values()} == {epoch}
    assert node.lapses_renewed == 1 and sum(node.stepdowns.values()) == 0


def test_with_grant_while_lapsed_the_reconnected_node_deposes_the_primary() -> None:
    mesh, primary, back, _ = _lapse_while_cut_from(Unsafe(grant_while_lapsed=True))
    node = mesh.nodes[primary]
    epoch = node.epoch
    pos = Position(epoch, 0)
    pre = node.receive(mesh.now, back, VoteRequest(epoch + 1, back, pos.epoch, pos.seq, True))
    assert isinstance(pre[0], Send) and isinstance(pre[0].message, VoteReply)
    assert pre[0].message.granted is True
    actions = node.receive(mesh.now, back, VoteRequest(epoch + 1, back, pos.epoch, pos.seq))
    assert any(isinstance(a, StopServing) and a.cause == "newer_epoch" for a in actions)
    assert node.role != "primary" and node.epoch == epoch + 1


def test_a_candidate_catching_up_since_its_pre_vote_round_does_not_campaign() -> None:
    """Its pre-vote round went out with a valid position; it joined a primary and catches
    up (INVALID) before a grant came: it stands only with a valid position, so it takes
    no epoch (seed 141 asked for votes with position (catching up))."""
    node = member("n1", 1, Position(1, 1), 0)
    node.start(0.0)
    actions = node.tick(10.0)
    assert node.role == "candidate" and any(
        isinstance(a, Send) and isinstance(a.message, VoteRequest) and a.message.pre
        for a in actions)
    node.set_position(Position.INVALID)
    assert node.receive(10.01, "n2", VoteReply(2, "n2", True, True, 1, 1)) == []
    assert node.epoch == 1 and node.voted_for is None


def test_a_late_heartbeat_is_counted_and_warned_once_per_stall(
        caplog: pytest.LogCaptureFixture) -> None:
    """etcd warns when a leader missed a heartbeat because it was busy: so does the primary,
    once per stall and at most once per ``LATE_WARNING_EVERY`` (the rest counted)."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    mesh.run(mesh.now + 5.0)
    assert node.heartbeats_late == 0  # on time: one every interval, ticks of STEP
    assert node.heartbeat_gap_max <= TIMING.heartbeat_interval + STEP + 1e-9

    def stall(seconds: float) -> None:
        mesh.paused = {primary}
        mesh.run(mesh.now + seconds)
        mesh.paused = set()
        mesh.run(mesh.now + 4 * STEP)

    with caplog.at_level(logging.WARNING, logger="brokerha.ha"):
        stall(3 * TIMING.heartbeat_interval)
        stall(3 * TIMING.heartbeat_interval)  # within LATE_WARNING_EVERY: counted, not logged
        mesh.run(mesh.now + LATE_WARNING_EVERY)
        stall(4 * TIMING.heartbeat_interval)
    assert node.heartbeats_late == 3 and node.role == "primary"
    assert node.status()["heartbeats_late"] == 3
    assert node.heartbeat_gap_max >= 4 * TIMING.heartbeat_interval
    lines = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert len(lines) == 2, lines
    assert f"node {primary} (primary, epoch {node.epoch}): heartbeat 0." in lines[0]
    assert "late" in lines[0] and "its lease held" in lines[0]
    assert "1 more late since the last warning" in lines[1]


SHIPPED = ElectionTiming()  # heartbeat 0.1, lease 0.4, election 0.6 (docs/ha.md)


def _stall_the_primary(seconds: float, seed: int) -> tuple[Election, int, Mesh]:
    """A 3-node cluster with the shipped timing; its primary's loop held ``seconds`` from
    one tick after a heartbeat (as a real loop: nothing read, nothing sent)."""
    mesh = Mesh.of(3, timing=SHIPPED)
    for i, node in enumerate(mesh.nodes.values()):
        node.rng = random.Random(seed * 10 + i)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    mesh.backups_hold(primary, node.position)  # caught up: they hold what it holds
    while node._heartbeat_sent_at != mesh.now:  # noqa: SLF001 -- a heartbeat just went out
        mesh.run(mesh.now + STEP)
    mesh.run(mesh.now + STEP)
    epoch = node.epoch
    mesh.paused = {primary}
    mesh.run(mesh.now + seconds)
    mesh.paused = set()
    mesh.run(mesh.now + 3.0)
    return node, epoch, mesh


@pytest.mark.parametrize("seed", range(5))
def test_what_a_stall_of_the_primary_costs_with_the_shipped_timing(seed: int) -> None:
    """docs/ha.md "When the primary's loop is busy": below the lease nothing; past it a
    lapse, renewed once the loop runs; past the backups' election timeout an election."""
    node, epoch, mesh = _stall_the_primary(0.2, seed)
    assert node.epoch == epoch and node.lapses == 0 and node.heartbeats_late == 1
    node, epoch, mesh = _stall_the_primary(0.45, seed)
    assert node.epoch == epoch and node.role == "primary"
    assert node.lapses == 1 and node.lapses_renewed == 1
    node, epoch, mesh = _stall_the_primary(1.0, seed)
    assert node.epoch > epoch and sum(node.stepdowns.values()) == 1
    assert sum(n.elections["election_timeout"] for n in mesh.nodes.values()) >= 1


def test_the_heartbeat_gap_is_measured_within_one_primary_role() -> None:
    """Deposed, then elected again: the time between its two roles is no late heartbeat."""
    mesh = Mesh.of(3)
    primary = mesh.elect()
    node = mesh.nodes[primary]
    other = next(n for n in mesh.nodes if n != primary)
    mesh.carry(primary, node.receive(mesh.now, other, NewEpoch(node.epoch + 1, other)))
    mesh.backups_hold(primary, Position.INVALID)  # catching up: only the old primary stands
    mesh.run(mesh.now + 5.0)
    assert mesh.primaries() == [primary] and node.stepdowns["newer_epoch"] == 1
    assert node.heartbeats_late == 0
    assert node.heartbeat_gap_max <= TIMING.heartbeat_interval + STEP + 1e-9
