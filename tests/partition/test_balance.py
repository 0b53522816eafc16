"""``partition/balance.py``: which partition ``ctl partitions balance`` moves next, why it
skips one, and how it follows a hand-over to its end (sans-I/O)."""

from __future__ import annotations

from brokerha.partition.balance import (
    BALANCED,
    MOVED,
    SKIPPED,
    Balancer,
    CellView,
    Done,
    GroupView,
    Promote,
    Wait,
    observe,
)

NODES = ["n1", "n2", "n3"]


def group(leader: str | None, epoch: int = 2, *, down: tuple[str, ...] = (),
          catching_up: tuple[str, ...] = (), other_epoch: dict[str, int] | None = None,
          none: tuple[str, ...] = ()) -> GroupView:
    cells = {}
    for name in NODES:
        if name in down:
            continue
        role = "primary" if name == leader else "none" if name in none else "backup"
        cells[name] = CellView(role, (other_epoch or {}).get(name, epoch), name == leader,
                               name not in catching_up)
    return GroupView(leader, epoch if leader is not None else epoch, cells)


def test_balanced_partitions_are_left_and_the_first_unbalanced_one_is_moved() -> None:
    balancer = Balancer(["n1", "n2", "n3"], timeout=5)
    groups = {0: group("n1"), 1: group("n3", 3), 2: group("n3", 1)}
    action = balancer.step(0.0, groups)
    assert action == Promote(1, "n3", "n2") and action.group == 2
    # one move at a time: nothing else asked while partition 1's is under way
    assert balancer.step(0.5, groups) == Wait(1)
    groups[1] = group(None, 4)  # the hand-over's election: no leader serving
    assert balancer.step(0.6, groups) == Wait(1)
    groups[1] = group("n2", 4)
    done = balancer.step(0.8, groups)
    assert isinstance(done, Done)
    assert [(line.partition, line.status) for line in done.report] == [
        (0, BALANCED), (1, MOVED), (2, BALANCED)]
    moved = done.report[1]
    assert (moved.leader, moved.preferred, moved.epoch, moved.new_epoch) == ("n3", "n2", 3, 4)
    assert moved.seconds == 0.8
    assert "moved n3 -> n2 (epoch 3 -> 4" in moved.text()
    assert balancer.unbalanced() == []


def test_skip_reasons() -> None:
    balancer = Balancer(["n1", "n2", "n3", "n1", "n2", "n3"], timeout=5)
    groups = {
        0: group("n2", down=("n1",)),  # the preferred cell is down
        1: group("n1", catching_up=("n2",)),  # catching up
        2: group("n1", other_epoch={"n3": 1}),  # not in the leader's epoch yet
        3: group(None),  # no leader serving
        4: group("n1", none=("n2",)),  # not a backup (role none)
        # 5: no group answered
    }
    done = balancer.step(0.0, groups)
    assert isinstance(done, Done)
    lines = {line.partition: line for line in done.report}
    assert all(line.status == SKIPPED for line in lines.values())
    assert "n1 is down" in lines[0].reason
    assert "n2 is catching up" in lines[1].reason
    assert "in epoch 1, the leader n1 in 2" in lines[2].reason
    assert "no leader serving" in lines[3].reason
    assert "not a backup of the group (role none)" in lines[4].reason
    assert "no partition group answered" in lines[5].reason
    assert balancer.unbalanced() == [0, 1, 2, 3, 4, 5]
    assert lines[0].text().startswith("partition 0: skipped: ")


def test_a_refused_hand_over_is_asked_again_then_given_up_at_the_timeout() -> None:
    balancer = Balancer(["n1", "n2"], timeout=2)
    groups = {0: group("n2"), 1: group("n2")}
    assert balancer.step(0.0, groups) == Promote(0, "n2", "n1")
    balancer.refused(0.05, 0, "409 n1 is not a ready backup")
    assert balancer.step(0.1, groups) == Wait(0)  # not before RETRY
    assert balancer.step(0.3, groups) == Promote(0, "n2", "n1")  # asked again
    balancer.refused(0.35, 0, "409 n1 is not a ready backup")
    assert balancer.step(1.0, groups) == Promote(0, "n2", "n1")
    # never served by n1: skipped at the timeout, the last refusal said; the next one
    # (already led by its preferred n2) balanced in the same step
    done = balancer.step(2.5, groups)
    assert isinstance(done, Done)
    first, second = done.report
    assert first.status == SKIPPED and "not served by n1 within 2 s" in first.reason
    assert "last refusal: 409 n1 is not a ready backup" in first.reason
    assert second.status == BALANCED
    assert balancer.unbalanced() == [0]


def test_a_move_whose_leader_changed_meanwhile_asks_the_new_leader() -> None:
    balancer = Balancer(["n1"], timeout=5)
    assert balancer.step(0.0, {0: group("n2", 2)}) == Promote(0, "n2", "n1")
    balancer.refused(0.1, 0, "409 n2 is not the primary")
    # n2 lost the group to n3 meanwhile: n3 is asked
    assert balancer.step(0.5, {0: group("n3", 3)}) == Promote(0, "n3", "n1")
    done = balancer.step(1.0, {0: group("n1", 4)})
    assert isinstance(done, Done) and done.report[0].status == MOVED
    assert (done.report[0].leader, done.report[0].epoch) == ("n3", 3)


def test_a_leader_already_preferred_at_a_later_epoch_is_not_a_move_of_this_run() -> None:
    """The same epoch with the target named leader is not the move's end (a stale view):
    only a newer epoch is."""
    balancer = Balancer(["n1"], timeout=5)
    assert balancer.step(0.0, {0: group("n2", 2)}) == Promote(0, "n2", "n1")
    stale = GroupView("n1", 2, {"n1": CellView("primary", 2, True, True)})
    assert balancer.step(0.1, {0: stale}) == Wait(0)


def test_observe_takes_the_serving_primary_in_the_highest_epoch_as_the_leader() -> None:
    def g(role: str, epoch: int, serving: bool = False, ready: bool = True) -> dict[str, object]:
        return {"role": role, "epoch": epoch, "serving": serving, "ready": ready}

    nodes = [
        {"name": "n1", "groups": {"0": g("primary", 1, True), "1": g("primary", 2, True),
                                  "2": g("primary", 3, False)}},  # its lease lapsed in 2
        {"name": "n2", "groups": {"0": g("backup", 1), "1": g("backup", 2),
                                  "2": g("none", 4, ready=False)}},
        {"name": "n3", "role": "down"},  # no groups: not a cell that answered
    ]
    seen = observe(nodes)
    assert sorted(seen) == [0, 1]  # the metadata group is no partition
    assert (seen[0].leader, seen[0].epoch) == ("n1", 2)
    assert seen[0].cells["n2"] == CellView("backup", 2, False, True)
    assert (seen[1].leader, seen[1].epoch) == (None, 4)  # an election under way
    assert "n3" not in seen[0].cells
