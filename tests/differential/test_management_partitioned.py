"""Differential, with partition groups (issue 35): ``test_management.py``'s management API
cases against RabbitMQ and against a node of three running partition groups (P = 9) that
leads neither the metadata group nor most partitions -- a queue declared, published to or
deleted through its API goes to the queue's leader; the status and JSON answer must still
be RabbitMQ's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from brokerha.testing import LocalCluster
from tests.clients.test_partition_groups_clients import P, ready_in_all
from tests.differential.test_management import (  # noqa: F401 - collected here, with this module's fixtures
    test_same_answer_as_rabbitmqs_management_api,
    test_the_same_fields_on_a_queue_and_the_overview,
)
from tests.failover.groups import until
from tests.failover.test_failover import FAST
from tests.failover.test_partition_declarations import every_node_leads
from tests.management_http import USERS

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def brokerha_api() -> Iterator[str]:
    options: dict[str, Any] = {**FAST, "partitions": P, "partition_groups": True}
    cluster = LocalCluster(3, options=options)
    cluster.config.write_text(cluster.config.read_text() + USERS)
    with cluster:
        led = every_node_leads(cluster, P)
        until("every node ready in every group", lambda: ready_in_all(cluster, cluster.names),
              timeout=60)
        others = [n for n in cluster.names if n != led["0"]]
        node = min(others, key=lambda n: sum(1 for g, v in led.items() if g != "0" and v == n))
        yield f"{cluster.admin_url(node)}/api"
