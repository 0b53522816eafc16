"""A join's per-queue catch-up worked out by runs (ReplicatingSubscription.catch_up).

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
from brokerha.primary.replicating_subscription import ReplicatingSubscription


def oracle(positions: list[int], held: set[int]) -> tuple[list[int], set[int], list[int]]:
    ordered = sorted(positions)
    first_gap = next((p for p in ordered if p not in held), None)

    def keeps(p: int) -> bool:
        return p in positions and (first_gap is None or p < first_gap)

    return (sorted(p for p in held if not keeps(p)), {p for p in ordered if keeps(p)},
            [p for p in ordered if not keeps(p)])


def no_bodies(vhost: str, queue: str, positions: list[int]) -> dict[int, tuple[bytes, bytes]]:
    raise AssertionError("nothing is paged here")


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 60)), st.sets(st.integers(0, 60)), st.randoms())
def test_the_runs_give_what_the_rule_gives_position_by_position(
        on_queue: set[int], held: set[int], rnd: object) -> None:
    queue = Broker("t").add_vhost("/").declare_queue("q", owner=None, durable=True)
    entries = [Entry(p, message(b"%d" % p), None) for p in on_queue]
    rnd.shuffle(entries)  # type: ignore[attr-defined]
    sub = ReplicatingSubscription(queue, RangeSet(to_ranges(held)))
    out: list[Event] = sub.catch_up(entries, 0.0, no_bodies)
    drops, skips, sends = oracle(list(on_queue), held)
    assert (sub.dropped, sub.skipped, sub.sent) == (len(drops), len(skips), len(sends))
    assert set(sub.skip_set) == skips
    dropped = [p for e in out if e.kind == R.DEQUEUED for p in e.positions]
    sent = [e.position for e in out if e.kind == R.ENQUEUED]
    assert sorted(dropped) == drops and sent == sends


@given(st.lists(st.integers(-5, 40)))
def test_runs_of_positions_in_any_order_with_duplicates(positions: list[int]) -> None:
    runs = to_ranges(positions)
    assert [p for a, b in runs for p in range(a, b + 1)] == sorted(set(positions))
    assert all(runs[i][1] + 1 < runs[i + 1][0] for i in range(len(runs) - 1))
