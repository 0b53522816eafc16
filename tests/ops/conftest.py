"""Fixtures: the container tests' (brokerha.testing_containers' own, public ones), and a
node with users of every management tag for the management API and UI tests."""

from collections.abc import Iterator

import pytest

from brokerha.testing import NodeProcess, free_base_port
from brokerha.testing_containers import (  # noqa: F401 - pytest finds fixtures by name
    brokerha_cluster,
    brokerha_docker,
    brokerha_image,
)
from tests.management_http import USERS


@pytest.fixture(scope="module")
def managed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = tmp_path_factory.mktemp("managed") / "node.toml"
    config.write_text(USERS)
    # the admin listener is at AMQP port + 10000: both must be free (and valid)
    with NodeProcess("mgmt", port=free_base_port(1), extra_args=["--config", str(config)]) as n:
        yield n
