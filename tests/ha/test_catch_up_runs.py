"""A join's per-queue catch-up walk (ReplicatingSubscription.events).

The oracle is the rule as it was written position by position: entries
before the first one the backup lacks are kept (skipped), the rest is sent,
and whatever the backup holds that is not kept is dropped.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry
from brokerha.cluster import replication as R
from brokerha.cluster.ranges import RangeSet, to_ranges
from brokerha.ha.simulation.world import message
from brokerha.primary.events import Event
from brokerha.primary.replicating_subscription import (
    WORK_PER_YIELD,
    ReplicatingSubscription,
    queue_entries,
)


def oracle(positions: list[int], held: set[int]) -> tuple[list[int], set[int], list[int]]:
    ordered = sorted(positions)
    first_gap = next((p for p in ordered if p not in held), None)

    def keeps(p: int) -> bool:
        return p in positions and (first_gap is None or p < first_gap)

    return (sorted(p for p in held if not keeps(p)), {p for p in ordered if keeps(p)},
            [p for p in ordered if not keeps(p)])


def no_bodies(vhost: str, queue: str, positions: list[int]) -> dict[int, tuple[bytes, bytes]]:
    raise AssertionError("nothing is paged here")


def sent_positions(event: Event) -> list[int]:
    """The positions an ``e`` or an ``er`` (a run: consecutive ones) sends."""
    if event.kind == R.ENQUEUED:
        return [event.position]
    if event.kind == R.ENQUEUED_RUN:
        return list(range(event.first, event.first + event.length))
    return []


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 60)), st.sets(st.integers(0, 60)), st.sets(st.integers(0, 60)),
       st.integers(0, 62))
def test_the_walk_gives_what_the_rule_gives_position_by_position(
        ready: set[int], acquired: set[int], held: set[int], below: int) -> None:
    """Ready and acquired entries merged in position order, cut at the guard's position."""
    acquired -= ready
    queue = Broker("t").add_vhost("/").declare_queue("q", owner=None, durable=True)
    for p in sorted(ready):
        queue.ready.append(Entry(p, message(b"%d" % p), None))
    taken = [Entry(p, message(b"%d" % p), None) for p in acquired]
    on_queue = [p for p in ready | acquired if p < below]
    sub = ReplicatingSubscription(queue, RangeSet(to_ranges(held)), run_min=3, run_max=5)
    walk = sub.events(queue_entries(queue, taken, below), lambda: 0.0, no_bodies)
    out: list[Event] = [e for e in walk if e is not None]
    drops, skips, sends = oracle(on_queue, held)
    assert (sub.dropped, sub.skipped, sub.sent) == (len(drops), len(skips), len(sends))
    dropped = [p for e in out if e.kind == R.DEQUEUED for p in e.positions]
    sent = [p for e in out for p in sent_positions(e)]
    assert sorted(dropped) == drops and sent == sends
    first_send = next((i for i, e in enumerate(out) if sent_positions(e)), len(out))
    resent = set(sends) & held
    assert not any(e.kind == R.DEQUEUED and resent & set(e.positions)
                   for e in out[first_send:]), "a position resent is dropped before it comes"


def test_a_backup_holding_a_deep_queue_is_walked_in_bounded_steps() -> None:
    """Skipping what the backup holds yields now and then: the slice can stop there."""
    queue = Broker("t").add_vhost("/").declare_queue("q", owner=None, durable=True)
    n = 3 * WORK_PER_YIELD + 5
    for p in range(1, n + 1):
        queue.ready.append(Entry(p, message(b"x"), None))
    sub = ReplicatingSubscription(queue, RangeSet([[1, n]]))
    out = list(sub.events(queue_entries(queue, [], n + 1), lambda: 0.0, no_bodies))
    assert out == [None, None, None] and sub.skipped == n


@given(st.lists(st.integers(-5, 40)))
def test_runs_of_positions_in_any_order_with_duplicates(positions: list[int]) -> None:
    runs = to_ranges(positions)
    assert [p for a, b in runs for p in range(a, b + 1)] == sorted(set(positions))
    assert all(runs[i][1] + 1 < runs[i + 1][0] for i in range(len(runs) - 1))
