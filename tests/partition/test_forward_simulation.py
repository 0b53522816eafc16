"""Publishes forwarded to partition primaries, simulated (``brokerha/partition/forward_simulation.py``,
``--workload forward``).

Three nodes, P = 3, every node running the product's partition groups
(``PartitionedMember``, a real ``HAMember`` and ``Broker`` per group) and
forwarding (``ForwardSender``, ``ForwardReceiver`` over ``BrokerForwardLog``);
clients on random nodes publishing with confirms to one or two partitions;
crashes, pauses, partitions, link failures, late packets and handovers.
(a) every acked message in its queues on the group's majority at the end,
(b) none twice, (c) no ack before every target majority holds it on disk,
(d) order per channel and queue, (e) everything answered once calm; a
consumer on each group's primary takes messages meanwhile. About 1.5 s a
seed of 20 virtual seconds (+ 15 s of calm).
"""

from __future__ import annotations

import pytest

from brokerha.ha.simulation.world import Unsafe as HAUnsafe
from brokerha.partition.forward_simulation import CATCHES, Unsafe, run_many, run_seed
from tests.seeds import first_failing, totals

SEEDS = 16
DURATION = 20.0


def test_a_seed_replays_exactly() -> None:
    first, again = run_seed(3, duration=5.0), run_seed(3, duration=5.0)
    assert first.trace_hash == again.trace_hash and first.stats == again.stats


def test_seeds_of_forwarded_publishes_through_faults_have_no_violation() -> None:
    results = run_many(range(SEEDS), jobs=2, duration=DURATION)
    assert [r.summary() for r in results if r.violation] == []
    seen = totals(results)
    # publishes to one and to two partitions, most of them acknowledged; nacks from the
    # bounded queues' refusals
    assert seen["to 2 partitions"] > 100 * SEEDS and seen["acked"] > 0.8 * seen["published"]
    assert seen["refused"] > 10 * SEEDS and seen["nacked"] > 10 * SEEDS
    # the faults happened and each path of the protocol was taken: group failovers with
    # what was unanswered resent to the new leader, resends dropped below the marks -- some
    # below a mark the new primary read back from its store --, forwards to a node no longer
    # leading refused, a lost forward making the next ones gaps, a forward waiting for the
    # metadata copy, publishers held by a full window
    assert seen["failovers"] > 2 * SEEDS and seen["resent"] > 20 * SEEDS
    # (the retry resends to the same leader only what is older than its delay, backing off
    # while unanswered: about 45 deduped a seed, ~2,000 when it resent everything each 0.5 s)
    assert seen["deduped"] > 20 * SEEDS and seen["deduped_recovered"] > 2 * SEEDS
    assert seen["retries"] > 10 * SEEDS
    assert seen["not primary"] > 2 * SEEDS and seen["gaps"] > SEEDS
    assert seen["held"] > 0 and seen["held by a full window"] > 0
    # consumers on the primaries took messages (their dequeues durable), some before their
    # publisher's ack: a mark outlives its messages
    assert seen["consumed durably"] > 100 * SEEDS and seen["acked once consumed"] > 0


@pytest.mark.parametrize("rule", CATCHES)
def test_each_unsafe_rule_is_caught(rule: str) -> None:
    check = "(b)" if rule == "no_dedupe" else "(c)"
    found = first_failing(run_seed, Unsafe.of([rule]), range(10), duration=DURATION)
    assert found is not None
    seed, violation = found
    assert seed == 0 and violation.startswith(check), violation


@pytest.mark.parametrize(("nodes", "partitions", "seeds"), [
    (5, 5, 3), (3, 9, 3),
    pytest.param(5, 5, 50, marks=pytest.mark.slow), pytest.param(3, 9, 50, marks=pytest.mark.slow)])
def test_five_nodes_of_five_partitions_and_nine_partitions_on_three(
        nodes: int, partitions: int, seeds: int) -> None:
    """Five nodes: each partition on three of them, so some senders hold no cell of the
    groups they forward to; nine partitions: three groups led per node."""
    results = run_many(range(500, 500 + seeds), jobs=2, nodes=nodes, partitions=partitions,
                       duration=DURATION)
    assert [r.summary() for r in results if r.violation] == []
    seen = totals(results)
    assert seen["acked"] > 200 * seeds and seen["failovers"] > 0


@pytest.mark.parametrize("rule", ["confirm_early", "early_ack"])
def test_an_ha_rule_broken_under_the_forwards_is_caught_by_c(rule: str) -> None:
    """A forward's answer is only as good as its group's barriers: the HA member's rules
    broken in every group (the primary's own disk for a quorum; a backup acknowledging
    before its sync) give acks that (c) catches."""
    found = first_failing(run_seed, Unsafe(), range(10), duration=DURATION,
                          ha_unsafe=HAUnsafe.of([rule]))
    assert found is not None
    seed, violation = found
    assert seed == 0 and violation.startswith("(c)"), violation


def test_no_dedupe_is_caught_by_the_resends_to_new_leaders_alone() -> None:
    """With the senders' retry off, what is sent again goes to a new leader after a failover
    (the marks that new primary read back are what stops the duplicates); a lost answer
    then stays unanswered, so liveness (e) is not checked."""
    found = first_failing(run_seed, Unsafe(no_dedupe=True), range(10), duration=DURATION,
                          retry=1e9, liveness=False)
    assert found is not None
    seed, violation = found
    assert seed == 2 and violation.startswith("(b)"), violation


@pytest.mark.slow
def test_many_seeds_have_no_violation() -> None:
    results = run_many(range(1_000, 1_300), jobs=2)
    assert [r.summary() for r in results if r.violation] == []
