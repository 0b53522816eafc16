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

# a monitoring user, a management user with permissions in "orders" only, a user without a
# management tag; guest (the default) is the administrator
USERS = """
[[vhosts]]
name = "orders"

[[users]]
name = "watcher"
password = "w-secret"
tags = ["monitoring"]

[[users]]
name = "alice"
password = "a-secret"
tags = ["management"]

[[users]]
name = "app"
password = "p-secret"

[[permissions]]
user = "alice"
vhost = "orders"

[[permissions]]
user = "watcher"
vhost = "/"
"""


@pytest.fixture(scope="module")
def managed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = tmp_path_factory.mktemp("managed") / "node.toml"
    config.write_text(USERS)
    # the admin listener is at AMQP port + 10000: both must be free (and valid)
    with NodeProcess("mgmt", port=free_base_port(1), extra_args=["--config", str(config)]) as n:
        yield n
