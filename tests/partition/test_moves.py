"""Stage 5's moves, sans-I/O (``partition/moves.py``, ``cluster/partition_table.py``
``move``, ``Election`` learners, ``Primary.voters``) and the moves simulation's scripted
cases (``partition/move_simulation.py``): one per ordering of ``pt``, ``pm`` and a failure."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from brokerha.broker.storage import Recovered
from brokerha.cluster.election import (
    Election,
    ElectionTiming,
    Heartbeat,
    HeartbeatAck,
    Position,
    PromoteRefused,
    Send,
    VoteReply,
    VoteRequest,
)
from brokerha.cluster.partition_table import (
    Cell,
    CellState,
    PartitionTable,
    PartitionTableError,
)
from brokerha.cluster.quorum import replicated_seq
from brokerha.ha.core import POSITION_KEY
from brokerha.ha.simulation.world import Faults
from brokerha.partition.member import group_of
from brokerha.partition.move_simulation import SCRIPTS, MoveSimulation, run_seed
from brokerha.partition.moves import (
    Change,
    Finished,
    Handover,
    Membership,
    Mover,
    ReplicationDone,
    Unsafe,
    Waiting,
    membership_of,
    next_membership,
    voter_changes,
)

U, OUT, F = CellState.UP_TO_DATE, CellState.OUT_OF_DATE, CellState.FEEDING
TIMING = ElectionTiming(heartbeat_interval=0.2, lease_timeout=1.0, election_timeout=1.5)
NODES = ["n1", "n2", "n3", "n4"]


def placed(partitions: int = 4, nodes: list[str] = NODES, replicas: int = 2) -> PartitionTable:
    table = PartitionTable.empty(partitions, replicas)
    change = table.tweak(nodes)
    assert change is not None
    table.apply(change)
    return table


# -- the table: one move at a time ----------------------------------------------------------


def test_a_move_feeds_the_source_and_adds_a_learner_then_replicated_finishes_it() -> None:
    table = placed()
    row = [c.node for c in table.rows[0]]
    source = row[0]
    target = table.move_target(0, NODES, exclude=[source])
    assert target is not None and target not in row
    table.apply(table.move(0, source, target))
    assert Cell(source, F) in table.rows[0] and Cell(target, OUT) in table.rows[0]
    assert membership_of(table, 0) == Membership(table.ptid, tuple(
        c.node for c in table.rows[0] if c.state in (U, F)), (target,))
    with pytest.raises(PartitionTableError, match="move under way"):
        table.move(0, row[1], source)
    change = table.replicated(0, target)
    assert change is not None
    table.apply(change)
    assert {c.node for c in table.rows[0]} == (set(row) - {source}) | {target}
    assert all(c.state is U for c in table.rows[0])


def test_withdraw_drops_only_a_learner() -> None:
    table = placed()
    source = table.rows[0][0].node
    target = table.move_target(0, NODES, exclude=[source])
    assert target is not None
    table.apply(table.move(0, source, target))
    assert table.withdraw(0, source) is None  # a feeding cell votes: it leaves by replicated
    change = table.withdraw(0, target)
    assert change is not None
    table.apply(change)
    assert [c.node for c in table.rows[0] if c.node == target] == []


# -- the group's walk: one voter at a time ----------------------------------------------------


def test_the_walk_adds_a_learner_promotes_it_when_ready_then_removes_the_drained_voter() -> None:
    current = Membership(1, ("a", "b", "f"))
    moving = Membership(2, ("a", "b", "f"), ("l",))  # the pt: f feeding, l a learner
    done = Membership(3, ("a", "b", "l"))  # replicated: l up to date, f gone
    step = next_membership(current, moving, "a", ready=["b", "f"])
    assert step == Membership(2, ("a", "b", "f"), ("l",))
    assert next_membership(moving, moving, "a", ready=["b", "f", "l"]) is None
    # the table made l a voter, but l is not a ready backup here yet: nothing, and above all
    # f does not leave first (the group never runs fewer voters than the row)
    assert next_membership(moving, done, "a", ready=["b", "f"]) is None
    step = next_membership(moving, done, "a", ready=["b", "f", "l"])
    assert step == Membership(3, ("a", "b", "f", "l"))
    assert isinstance(step, Membership)
    last = next_membership(step, done, "a", ready=["b", "f", "l"])
    assert last == Membership(3, ("a", "b", "l"))
    assert isinstance(last, Membership)
    assert next_membership(last, done, "a", ready=["b", "l"]) is None
    for before, after in ((current, moving), (moving, step), (step, last)):
        assert voter_changes(before, after) <= 1


def test_a_drained_primary_hands_over_to_a_ready_voter_first() -> None:
    running = Membership(3, ("f", "a", "b", "l"))
    target = Membership(3, ("a", "b", "l"))
    assert next_membership(running, target, "f", ready=[]) is None  # nobody ready: later
    assert next_membership(running, target, "f", ready=["b", "l"]) == Handover("b")
    # the next primary removes it
    assert next_membership(running, target, "b", ready=["a", "f", "l"]) == Membership(
        3, ("a", "b", "l"))


def test_two_cells_unsafe_jumps_straight_to_the_row() -> None:
    moving = Membership(2, ("a", "b", "f"), ("l",))
    done = Membership(3, ("a", "b", "l"))
    step = next_membership(moving, done, "a", ready=[], unsafe=Unsafe(two_cells=True))
    assert step == done and isinstance(step, Membership)
    assert voter_changes(moving, step) == 2


# -- learners in the election and the quorum -------------------------------------------------


def election(me: str, voters: list[str], learners: tuple[str, ...] = ()) -> Election:
    return Election(me, voters, epoch=1, voted_for=None, position=Position(1, 5),
                    timing=TIMING, rng=random.Random(1), learners=learners)


def test_a_learner_never_stands_nor_grants_and_its_grant_and_ack_count_for_nothing() -> None:
    learner = election("l", ["a", "b", "c"], ("l",))
    assert not learner.voter
    learner.start(0.0)
    assert learner.tick(100.0) == []  # never stands
    reply = learner.receive(100.0, "a", VoteRequest(2, "a", 1, 5, False, False))
    assert [a.message.granted for a in reply if isinstance(a, Send)
            and isinstance(a.message, VoteReply)] == [False]
    # a primary of three voters and a learner: the learner's ack renews no lease
    primary = election("a", ["a", "b", "c"], ("l",))
    primary.start(0.0)
    actions = primary.tick(10.0)  # pre-vote round
    for voter in ("b",):
        actions = primary.receive(10.0, voter, VoteReply(2, voter, True, True, 1, 5))
    actions = primary.receive(10.0, "b", VoteReply(2, "b", True, False, 1, 5))
    assert primary.role == "primary"
    beats = [a.to for a in actions if isinstance(a, Send) and isinstance(a.message, Heartbeat)]
    assert "l" in beats  # the learner follows
    primary.link_down(10.1, "b")
    primary.receive(10.2, "l", HeartbeatAck(2, "l", 10.0, 2, 0, True))
    assert not primary.lease_valid(11.5)  # b's stamp only, and it went: the learner's is none
    with pytest.raises(PromoteRefused):
        primary.promote(10.3, "l")
    # its grant does not elect either: a candidate counts voters only
    cand = election("b", ["a", "b", "c"], ("l",))
    cand.start(0.0)
    cand.tick(50.0)
    cand.receive(50.0, "l", VoteReply(2, "l", True, True, 1, 5))
    assert cand.role == "candidate" and cand.epoch == 1  # no campaign on a learner's grant


def test_reconfigure_counts_the_new_voters_at_once() -> None:
    node = election("a", ["a", "b", "c"])
    assert node.reconfigure(["a", "b", "c", "l"]) == []
    assert node.members == ("a", "b", "c", "l") and node.voter
    learner = election("l", ["a", "b", "c"], ("l",))
    learner.reconfigure(["a", "b", "c", "l"])
    assert learner.voter and learner.learners == ()


def test_a_learner_ack_is_waited_for_but_never_counted_for_the_majority() -> None:
    # quorum.py's rule over the voters (what Primary.replicated does with ``voters``):
    # voters a (primary, seq 9), b, c; learner l acknowledged 9, b and c nothing yet
    acked = {"b": 2, "c": 2, "l": 9}
    counted = {n: s for n, s in acked.items() if n in {"a", "b", "c"}}
    safe = min(replicated_seq(9, counted, (), 3), replicated_seq(9, acked, ["l"], 1))
    assert safe == 2
    assert replicated_seq(9, acked, (), 3) == 9  # counting the learner: 9, held by a and l


# -- the coordinator's side --------------------------------------------------------------------


def test_a_drain_moves_one_partition_at_a_time_until_the_node_holds_none() -> None:
    table = placed()
    mover = Mover("n2", NODES)
    held = table.cells_of("n2")
    assert held
    done: list[ReplicationDone] = []
    memberships: dict[int, Membership | None] = {}
    steps = 0
    while True:
        steps += 1
        assert steps < 50
        step = mover.step(table, memberships, done)
        if isinstance(step, Finished):
            break
        if isinstance(step, Change):
            table.apply(step.change)
            rows_moving = [p for p, row in enumerate(table.rows)
                           if any(c.state in (OUT, F) for c in row)]
            assert len(rows_moving) <= 1  # one partition at a time
            continue
        assert isinstance(step, Waiting)
        learners = [c.node for c in table.rows[step.partition] if c.state is OUT]
        if learners:  # the group's primary reports its learner caught up
            done = [ReplicationDone(step.partition, learners[0], table.ptid)]
        # and the groups run their rows (what the leaders' status would say)
    assert table.cells_of("n2") == []
    assert len(step.lines) == len(held)
    # a group still running the drained node holds the next move back
    again = Mover("n3", NODES)
    lagging = {0: Membership(table.ptid, ("n1", "n2", "n3"))}
    first = again.step(table, lagging, [])
    assert isinstance(first, Change) or isinstance(first, Waiting)


def test_an_undrain_moves_cells_back_until_the_counts_are_even() -> None:
    table = placed()
    drain = Mover("n1", NODES)
    while not isinstance(step := drain.step(table, {}, _done(table)), Finished):
        if isinstance(step, Change):
            table.apply(step.change)
    assert table.cells_of("n1") == []
    undrain = Mover("n1", NODES, undrain=True)
    while not isinstance(step := undrain.step(table, {}, _done(table)), Finished):
        if isinstance(step, Change):
            table.apply(step.change)
    counts = [len(table.cells_of(n)) for n in NODES]
    assert max(counts) - min(counts) <= 1 and len(table.cells_of("n1")) >= 2


def _done(table: PartitionTable) -> list[ReplicationDone]:
    return [ReplicationDone(p, c.node, table.ptid) for p, row in enumerate(table.rows)
            for c in row if c.state is OUT]


# -- the moves simulation's scripted cases ----------------------------------------------------


QUICK = ("pm", "remove", "stop")  # the default run's; -m slow runs every script


@pytest.mark.parametrize("script", [
    s if s in QUICK else pytest.param(s, marks=pytest.mark.slow) for s in SCRIPTS])
def test_a_scripted_failure_during_a_move_loses_nothing(script: str) -> None:
    """One drain of partition 0's leader, a failure at one point of its first move: after
    the ``pt`` (before any ``pm``), after the learner's ``pm``, after ``replicated``, after
    the ``pm`` removing the drained cell, the coordinator after the ``pt``; the drained node
    stopped once settled (nothing elects); the leader cut from its voters."""
    world = MoveSimulation(1, duration=11.0, script=script)
    result = world.run()
    assert result.violation is None, result.summary() + "\n" + "\n".join(result.trace[-30:])
    stats = result.stats
    assert stats["drains_done"] == 1 and stats["drains_settled"] == 1, dict(stats)
    if script in ("pt", "pm", "done", "remove"):
        assert stats["scripted_crashes"] == 1, dict(stats)
    if script == "stop":
        assert stats["stops_checked"] == 1, dict(stats)
    assert stats["confirmed"] > 0


def test_a_two_cell_change_is_caught_by_its_effect_and_by_the_single_cell_check() -> None:
    """``split``: the leader's links to its old voters fail as it appends its first change
    of voters. One cell at a time, its new voters (four) need one of them: it stops.
    Two at once, the drained cell out and the learner in, its new voters are a majority
    with the learner alone: it confirms on, and the old voters elect without those
    messages (c). (i) names the rule itself."""
    unsafe = Unsafe(two_cells=True)
    result = run_seed(3, duration=6.0, script="split", moves_unsafe=unsafe,
                      single_cell_check=False)
    assert result.violation is not None and result.violation.startswith("(c)"), \
        result.summary()
    result = run_seed(3, duration=6.0, script="split", moves_unsafe=unsafe)
    assert result.violation is not None and result.violation.startswith("(i)")
    assert run_seed(3, duration=6.0, script="split").violation is None


def test_drains_and_undrains_under_random_faults() -> None:
    result = run_seed(0, duration=20.0)
    assert result.violation is None, result.summary()
    assert result.stats["drains_done"] >= 1 and result.stats["undrains_done"] >= 1
    assert result.stats["memberships"] >= 6 and result.stats["drains_settled"] >= 1


@pytest.mark.slow
def test_many_seeds_of_moves_under_faults() -> None:
    for seed in range(100, 140):
        result = run_seed(seed, duration=40.0)
        assert result.violation is None, result.summary()


def test_the_command_line_runs_the_moves_workload() -> None:
    base = [sys.executable, "-m", "brokerha.cli", "cluster", "simulate", "--workload", "moves",
            "--jobs", "1", "--seeds", "1", "--duration", "10"]
    ok = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "moves: seeds 1, violations 0" in ok.stdout and "memberships" in ok.stdout
    bad = subprocess.run([*base, "--unsafe", "two_cells"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "(i)" in bad.stdout, bad.stdout + bad.stderr


# -- a group left, a restart: the partition's queues go, durably (seed 133) ------------------


def _quiet_world() -> MoveSimulation:
    """Four nodes, P = 4, NR = 2, 3 s of publishing without a fault: every node holds three
    partitions' groups and queues (n1: partitions 0, 2, 3 -- none of partition 1)."""
    world = MoveSimulation(2, duration=3.0, faults=Faults(rate=0.0, spike_p=0.0))
    assert world.run().violation is None
    return world


def test_a_group_left_asks_the_store_to_sync_its_queues_deletion() -> None:
    """``_drop`` deletes the partition's queues and makes its position invalid; both wait
    for the store's next sync, which nothing else may ask for before a crash: the drop asks
    for one itself (seed 133: a drained node left partition 1's group, crashed 6.7 s later
    with no sync in between, and its restart loaded the queue again)."""
    world = _quiet_world()
    node = world.node("n1")
    store = node.store
    assert ("/", "q0-1") in store.disk.queues
    waiting = len(store.waiting)
    node.ha._drop(group_of(0))
    assert "q0-1" not in node.broker.vhosts["/"].queues
    assert len(store.waiting) == waiting + 1  # the drop's own sync asked for
    store.sync()
    assert ("/", "q0-1") not in store.disk.queues
    assert json.loads(store.disk.meta[f"{POSITION_KEY}/{group_of(0)}"])[:2] == [-1, -1]


def test_a_restart_drops_the_stored_queues_of_partitions_it_holds_no_cell_of() -> None:
    """A node started from a store holding a queue (and a valid position) of a partition the
    table places no cell of here makes no group of it and must not hold its queue: the queue
    goes at the start and the group's position is made invalid (a later cell here catches
    up whole); the other partitions' queues stay."""
    world = _quiet_world()
    n1, n2 = world.node("n1"), world.node("n2")
    assert 1 not in n1.ha._cells and 1 in n2.ha._cells
    n2.store.sync()
    world.crash_node(n1, 1.0)
    disk = world.disks["n1"]
    assert disk is not None
    key = f"{POSITION_KEY}/{group_of(1)}"
    disk.queues[("/", "q1-0")] = n2.store.disk.queues[("/", "q1-0")]
    disk.messages.update({k: m for k, m in n2.store.disk.messages.items() if k[1] == "q1-0"})
    disk.meta[key] = n2.store.disk.meta[key]
    assert json.loads(disk.meta[key])[0] >= 0
    world.restart("n1")
    restarted = world.node("n1")
    queues = restarted.broker.vhosts["/"].queues
    assert group_of(1) not in restarted.ha.groups and "q1-0" not in queues
    assert {"q0-1", "q2-1", "q3-0"} <= set(queues)
    stored = json.loads(restarted.store.meta[key])
    assert stored[:2] == [-1, -1] and stored[2:] == json.loads(disk.meta[key])[2:]
    restarted.store.sync()
    assert ("/", "q1-0") not in restarted.store.disk.queues
    assert not any(k[1] == "q1-0" for k in restarted.store.disk.messages)


def test_a_start_drops_them_from_what_the_shell_recovered_after_making_the_groups() -> None:
    """A node's shell restores its broker from the store after it made its
    ``PartitionedMember`` (node/server.py ``start``): ``PartitionedMember.start`` drops the
    recovered queues of partitions without a cell here, from the broker and the store."""
    world = _quiet_world()
    n1, n2 = world.node("n1"), world.node("n2")
    assert 1 not in n1.ha._cells
    n2.store.sync()
    record = n2.store.disk.queues[("/", "q1-0")]
    messages = [m for k, m in n2.store.disk.messages.items() if k[1] == "q1-0"]
    n1.store.queues[("/", "q1-0")] = record
    n1.store.messages.update({k: m for k, m in n2.store.disk.messages.items()
                              if k[1] == "q1-0"})
    n1.broker.restore(Recovered(queues=[record], messages=messages))  # recovered late
    assert "q1-0" in n1.broker.vhosts["/"].queues
    n1.ha.start()
    assert "q1-0" not in n1.broker.vhosts["/"].queues
    assert ("/", "q1-0") not in n1.store.queues
    assert not any(k[1] == "q1-0" for k in n1.store.messages)
    assert {"q0-1", "q2-1", "q3-0"} <= set(n1.broker.vhosts["/"].queues)


def test_seed_133_a_node_drained_while_down_holds_no_queue_of_a_group_it_left() -> None:
    """The slow run's seed 133: n4, drained while down, restarted with its old table, left
    partition 1's and 3's groups by the table (followed no primary in them: the pm removing
    it went out while it was down) and crashed again before any store sync; its second start
    held partition 1's queue without its group: (g)."""
    result = run_seed(133, duration=40.0)
    assert result.violation is None, result.summary() + "\n" + "\n".join(result.trace[-30:])
    assert result.stats["drains_done"] >= 1


@pytest.mark.parametrize("seed", [0, 1])
def test_learner_confirms_is_caught_when_the_voters_disks_stall(seed: int) -> None:
    """The script ``stall``: the drained leader's learner caught up and stays a learner (the
    coordinator held), the two other voters' disks stall -- they renew the lease, acknowledge
    no event, and leave the guarded set after ``backup_timeout`` --, then they and the leader
    crash. Safe, the leader confirms nothing of partition 0 from then on (a majority of the
    voters needs one of them). With ``learner_confirms`` the leader and the learner confirm,
    and the two voters elect without those messages: (c)."""
    unsafe = run_seed(seed, duration=12.0, script="stall",
                      moves_unsafe=Unsafe(learner_confirms=True))
    assert unsafe.violation is not None and unsafe.violation.startswith("(c)") \
        and "of group 1 lost" in unsafe.violation, unsafe.summary()
    safe = run_seed(seed, duration=12.0, script="stall")
    assert safe.violation is None, safe.summary() + "\n" + "\n".join(safe.trace[-30:])
    assert safe.stats["scripted_crashes"] == 1 and safe.stats["confirmed"] > 0
