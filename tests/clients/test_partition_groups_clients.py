"""A representative subset of the client conformance suite (pika, aio-pika, kombu, Celery)
against three nodes running partition groups (issue 35 stage 3): ``cluster up
--partitions 9 --partition-groups``, every client connected to one node C and every
queue named into a partition that C does NOT lead -- each declare, bind, purge and
delete goes to another node's leader (partition/declarations.py), each publish is
forwarded, each consume and get is a remote consumer's.

The tests are the suite's own functions, imported here: this module's ``broker`` and
``names`` fixtures replace the session's (a single node) for them. What is left out and
why is in docs/ha.md ("Declarations from any node", the client suites).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from brokerha.cluster.partition_table import hash_partition
from brokerha.testing import LocalCluster
from tests.clients.conftest import Broker, Names, delete_made
from tests.clients.test_aio_pika import (  # noqa: F401 - collected here, with this module's fixtures
    test_all_field_types_round_trip_including_float,
    test_connect_robust_exchange_queue_publish_get,
    test_exclusive_queue_locked_from_other_connection,
    test_publisher_confirms_are_on_by_default_and_returns_raise,
    test_queue_iterator_consumes_in_order,
)
from tests.clients.test_kombu_celery import (  # noqa: F401
    test_celery_task_round_trip_through_in_process_worker,
    test_kombu_producer_consumer_with_declared_exchange_and_queue,
    test_kombu_simple_queue_put_get,
)
from tests.clients.test_pika_basic import (  # noqa: F401
    test_basic_get_on_empty_queue_is_get_empty,
    test_closing_channel_requeues_unacked,
    test_consume_with_prefetch_limits_unacked_deliveries,
    test_declare_publish_get_ack,
    test_mandatory_unroutable_publish_is_returned_312_no_route,
    test_message_properties_and_headers_round_trip_exactly,
    test_nack_without_requeue_drops_message,
    test_publisher_confirms_with_mandatory_return,
    test_publisher_nack_when_queue_rejects_publish,
    test_qos_per_consumer_vs_global,
    test_requeued_message_comes_back_redelivered,
    test_tx_acks_take_effect_at_commit_and_not_at_rollback,
)
from tests.clients.test_pika_exchanges import (  # noqa: F401
    test_bind_missing_queue_is_404,
    test_bind_to_missing_exchange_is_404,
    test_default_exchange_routes_by_queue_name_and_cannot_be_bound,
    test_delete_missing_exchange_is_ok,
    test_direct_exchange,
    test_exchange_delete_if_unused_is_406_when_bound,
    test_exchange_to_exchange_bind_and_unbind,
    test_fanout_exchange_ignores_routing_key,
    test_passive_declare_of_missing_exchange_is_404,
    test_redeclare_exchange_with_other_type_is_406,
    test_topic_exchange_star_and_hash,
)
from tests.clients.test_pika_queues import (  # noqa: F401
    test_delete_if_empty_is_406_when_not_empty,
    test_delete_if_unused_is_406_when_consumed,
    test_delete_returns_count_and_missing_queue_delete_is_ok,
    test_exclusive_consume_on_queue_with_consumers_is_403,
    test_exclusive_consumer_refuses_second_consumer_403,
    test_exclusive_queue_from_another_connection_is_405,
    test_invalid_queue_argument_is_406,
    test_passive_declare_of_missing_queue_is_404,
    test_passive_declare_reports_counts,
    test_purge_returns_count,
    test_redeclare_queue_with_other_arguments_is_406,
    test_redeclare_queue_with_other_durability_is_406,
    test_server_cancels_consumer_when_queue_deleted,
    test_unbind_queue,
)
from tests.failover.groups import until
from tests.failover.test_failover import FAST
from tests.failover.test_partition_declarations import every_node_leads

pytestmark = pytest.mark.timeout(120)

P = 9
GROUPS = [str(g) for g in range(P + 1)]


class Cluster:
    def __init__(self, cluster: LocalCluster, node: str, led: set[int]) -> None:
        self.cluster = cluster
        self.node = node  # every client's node
        self.led = led  # the partitions it leads: no queue is named into them


@contextmanager
def partitioned_cluster(config: str = "") -> Iterator[Cluster]:
    """Three nodes, P = 9, every node leading partitions, ready in every group; the client's
    node one that does not lead the metadata group. ``config``: TOML added to the cluster's
    file (users, for the management API's tests)."""
    options: dict[str, Any] = {**FAST, "partitions": P, "partition_groups": True}
    cluster = LocalCluster(3, options=options)
    if config:
        cluster.config.write_text(cluster.config.read_text() + config)
    with cluster:
        names = cluster.names

        # every node leads a partition: one leading none relays its clients to the
        # metadata primary (the client would be on the coordinator)
        led = every_node_leads(cluster, P)
        until("every node ready in every group", lambda: ready_in_all(cluster, names),
              timeout=60)
        # the client's node: one that is not the metadata group's leader (its exchanges are
        # declared through the coordinator too) and leads the fewest partitions
        others = [n for n in names if n != led["0"]]
        node = min(others, key=lambda n: sum(1 for g, v in led.items() if g != "0" and v == n))
        yield Cluster(cluster, node, {int(g) - 1 for g, v in led.items()
                                      if g != "0" and v == node})


@pytest.fixture(scope="module")
def partitioned() -> Iterator[Cluster]:
    with partitioned_cluster() as cluster:
        yield cluster


def ready_in_all(cluster: LocalCluster, names: list[str]) -> bool:
    """Every node a ready member of the metadata group and of the 9 partitions' groups."""
    for name in names:
        groups = (cluster.status(name) or {}).get("node", {}).get("groups") or {}
        if sorted(groups) != sorted(GROUPS) or not all(g["ready"] for g in groups.values()):
            return False
    return True


@pytest.fixture(scope="module")
def broker(partitioned: Cluster) -> Broker:
    return Broker("127.0.0.1", partitioned.cluster.port(partitioned.node))


class ElsewhereNames(Names):
    """Names whose partition (vhost /) the client's node does not lead."""

    def __init__(self, test: str, led: set[int]) -> None:
        super().__init__(test)
        self.led = led

    def __call__(self, kind: str = "q", prefix: str = "") -> str:
        while True:
            name = f"{prefix}{self.stem}-{kind}-{uuid.uuid4().hex[:8]}"
            if hash_partition("/", name, P) not in self.led:
                self.made.append(name)
                return name


@pytest.fixture
def names(request: pytest.FixtureRequest, broker: Broker,
          partitioned: Cluster) -> Iterator[Names]:
    n = ElsewhereNames(request.node.name, partitioned.led)
    yield n
    delete_made(broker, n)


def test_the_layout_is_what_the_module_says(partitioned: Cluster, names: Names) -> None:
    """The client's node leads none of the partitions the names fall in, and leads fewer
    than all of them (the other tests' premise)."""
    assert len(partitioned.led) < P
    drawn = [names() for _ in range(50)]
    assert all(hash_partition("/", n, P) not in partitioned.led for n in drawn)
