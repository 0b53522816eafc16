"""Differential, with partition groups (issue 35): ``test_management.py``'s management API
cases against RabbitMQ and against a node of three running partition groups (P = 9) that
leads neither the metadata group nor most partitions -- a queue declared, published to or
deleted through its API goes to the queue's leader; the status and JSON answer must still
be RabbitMQ's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.clients.test_partition_groups_clients import partitioned_cluster
from tests.differential.test_management import (  # noqa: F401 - collected here, with this module's fixtures
    test_same_answer_as_rabbitmqs_management_api,
    test_the_same_fields_on_a_queue_and_the_overview,
)
from tests.management_http import USERS

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def brokerha_api() -> Iterator[str]:
    with partitioned_cluster(USERS) as partitioned:
        yield f"{partitioned.cluster.admin_url(partitioned.node)}/api"
