"""Differential, with partition groups (issue 35: "the differential suite against RabbitMQ
passes as it does today"): ``test_replies.py``'s cases -- declarations, bindings, missing
entities, arguments, exclusive queues, aiormq's own calls -- against RabbitMQ and against
three nodes running partition groups, the client on a node that leads NONE of the queues
a case names. Each queue's declare, bind, purge, delete, consume and get then goes to
another node's leader (partition/declarations.py, partition/consuming.py) and each publish
is forwarded; the answer (class, code, text) must still be RabbitMQ's.

The cluster is ``tests/clients/test_partition_groups_clients.py``'s (P = 9, every node
leading partitions, the client's node not the metadata group's leader).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from types import CodeType

import pytest

from brokerha.cluster.partition_table import hash_partition
from tests.clients.test_partition_groups_clients import Cluster, P, partitioned  # noqa: F401
from tests.differential.test_replies import (
    CASES,
    EXCLUSIVE_CASES,
    OWNER_CASES,
    Call,
    aiormq_outcome,
    compare,
    compare_held,
    holding_exclusive,
    normalize,
    outcome,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]

# the queue names the cases make: a prefix, then the case's suffix (test_replies.py)
_QUEUE_NAME = re.compile(r'f"([^"{]*)\{s\}"')


def _prefixes() -> list[str]:
    import inspect

    from tests.differential import test_replies

    return sorted(set(_QUEUE_NAME.findall(inspect.getsource(test_replies))))


PREFIXES = _prefixes()


def _strings(code: CodeType) -> set[str]:
    """The string constants of ``code`` and of the code nested in it (an f-string's
    literal parts are constants: f"q1{s}" holds 'q1')."""
    out: set[str] = set()
    for const in code.co_consts:
        if isinstance(const, str):
            out.add(const)
        elif isinstance(const, CodeType):
            out |= _strings(const)
    return out


def names_of(call: Call, *extra: str) -> list[str]:
    """The prefixes of the names ``call`` makes (its own and those of test_replies.py's
    helpers it calls, ``_owned`` and the like), and ``extra`` (a holder's)."""
    from tests.differential import test_replies

    strings = _strings(call.__code__)
    for name in call.__code__.co_names:
        helper = getattr(test_replies, name, None)
        if callable(helper) and hasattr(helper, "__code__"):
            strings |= _strings(helper.__code__)
    return sorted(set(PREFIXES) & (strings | set(extra)))


def suffix_elsewhere(led: set[int], prefixes: list[str] | None = None) -> str:
    """A suffix that puts every name of ``prefixes`` (all the cases' if None) in a
    partition the client's node does not lead. A case makes one to three names: a
    few draws; all 24 at once took ~17,000 (and failed now and then within 100,000)."""
    wanted = PREFIXES if prefixes is None else prefixes
    for _ in range(1_000_000):
        suffix = f"-{uuid.uuid4().hex[:8]}"
        if all(hash_partition("/", f"{p}{suffix}", P) not in led for p in wanted):
            return suffix
    raise AssertionError(f"no suffix puts {wanted} outside partitions {sorted(led)}")


@pytest.fixture(scope="module")
def grouped_url(partitioned: Cluster) -> Iterator[str]:  # noqa: F811
    yield partitioned.cluster.url(partitioned.node)


def test_the_names_fall_outside_the_client_node_s_partitions(partitioned: Cluster) -> None:  # noqa: F811
    assert len(PREFIXES) >= 15, PREFIXES  # the cases' queue names were all found
    # each case's own names are found (the suffix is drawn for them)
    assert names_of(CASES["queue.unbind from a missing exchange"]) == ["nx", "q1"]
    assert "own" in names_of(next(iter(OWNER_CASES.values())))
    assert 0 < len(partitioned.led) < P
    suffix = suffix_elsewhere(partitioned.led)
    assert all(hash_partition("/", f"{p}{suffix}", P) not in partitioned.led for p in PREFIXES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_reply_as_rabbitmq_from_a_node_leading_none_of_the_queues(
        case: str, rabbitmq_url: str, grouped_url: str, partitioned: Cluster) -> None:  # noqa: F811
    compare(CASES[case], rabbitmq_url, grouped_url,
            suffix_elsewhere(partitioned.led, names_of(CASES[case])))


@pytest.mark.parametrize("case", sorted(OWNER_CASES))
def test_same_reply_for_the_connections_own_exclusive_queue_led_elsewhere(
        case: str, rabbitmq_url: str, grouped_url: str, partitioned: Cluster) -> None:  # noqa: F811
    compare(OWNER_CASES[case], rabbitmq_url, grouped_url,
            suffix_elsewhere(partitioned.led, names_of(OWNER_CASES[case])))


@pytest.mark.parametrize("case", sorted(EXCLUSIVE_CASES))
def test_same_reply_for_another_connections_exclusive_queue_led_elsewhere(
        case: str, rabbitmq_url: str, grouped_url: str, partitioned: Cluster) -> None:  # noqa: F811
    compare_held(EXCLUSIVE_CASES[case], rabbitmq_url, grouped_url,
                 suffix_elsewhere(partitioned.led, names_of(EXCLUSIVE_CASES[case], "ex")))


def _other_node_url(partitioned: Cluster) -> str:  # noqa: F811
    """A node other than the client's (the holder of the exclusive queue)."""
    other = next(n for n in partitioned.cluster.names if n != partitioned.node)
    return partitioned.cluster.url(other)


@pytest.mark.parametrize("case", sorted(EXCLUSIVE_CASES))
def test_same_reply_for_another_node_s_connection_s_exclusive_queue(
        case: str, rabbitmq_url: str, grouped_url: str, partitioned: Cluster) -> None:  # noqa: F811
    """The exclusive queue held by a connection on ANOTHER node than the client's (issue 35
    task I): the queue directory's owner entry answers 405 on every node, as RabbitMQ."""
    compare_held(EXCLUSIVE_CASES[case], rabbitmq_url, grouped_url,
                 suffix_elsewhere(partitioned.led, names_of(EXCLUSIVE_CASES[case], "ex")),
                 holder_url=_other_node_url(partitioned))


@pytest.mark.parametrize("case", sorted(EXCLUSIVE_CASES))
def test_another_node_s_exclusive_queue_goes_with_its_connection(
        case: str, grouped_url: str, partitioned: Cluster) -> None:  # noqa: F811
    """Once the holder's connection (on another node) closes, the name is free on the
    client's node: the same case answers as for a queue that never was exclusive."""
    suffix = suffix_elsewhere(partitioned.led, names_of(EXCLUSIVE_CASES[case], "ex"))
    holding_exclusive(_other_node_url(partitioned), f"ex{suffix}").close()
    deadline = time.monotonic() + 10  # the owner's node drops the entry after the close
    while True:
        got = normalize(outcome(grouped_url, EXCLUSIVE_CASES[case], suffix), suffix)
        if "RESOURCE_LOCKED" not in got or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "RESOURCE_LOCKED" not in got, got


@pytest.mark.parametrize("steps", ["immediate", "channel 65535"])
def test_same_answer_to_aiormq_on_a_partitioned_node(steps: str, rabbitmq_url: str,
                                                     grouped_url: str) -> None:
    assert aiormq_outcome(grouped_url, steps) == aiormq_outcome(rabbitmq_url, steps)
