"""A private RabbitMQ node and a brokerha node, one each per test session, side by side;
and per module, each with its management API (``rabbit_api``, ``brokerha_api``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from brokerha.testing import NodeProcess, free_base_port, free_port
from tests.management_http import USERS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rabbitmq_ref import RabbitMQRef, available  # noqa: E402


@dataclass
class ManagedRabbit:
    ref: RabbitMQRef
    management_port: int


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    if not available():
        pytest.skip("rabbitmq-server is not installed (scripts/ensure-rabbitmq installs it)")
    with RabbitMQRef() as url:
        yield url


@pytest.fixture(scope="session")
def brokerha_url() -> Iterator[str]:
    with NodeProcess("differential") as node:
        yield node.url


@pytest.fixture(scope="module")
def rabbit_node() -> Iterator[ManagedRabbit]:
    """A private RabbitMQ node with the management plugin (``management_port``) and the
    users of tests/management_http.py's ``USERS`` that the differential cases use."""
    if not available():
        pytest.skip("rabbitmq-server is not installed (scripts/ensure-rabbitmq installs it)")
    port = free_port()
    ref = RabbitMQRef(plugins=("rabbitmq_management",),
                      extra_config=f"management.tcp.port = {port}\n"
                                   "management.tcp.ip = 127.0.0.1\n")
    with ref:
        for args in (("add_user", "watcher", "w-secret"),
                     ("set_user_tags", "watcher", "monitoring"),
                     ("set_permissions", "watcher", ".*", ".*", ".*"),
                     ("add_user", "app", "p-secret")):
            done = ref.ctl(*args)
            assert done.returncode == 0, done.stderr
        yield ManagedRabbit(ref, port)


@pytest.fixture(scope="module")
def rabbit_api(rabbit_node: ManagedRabbit) -> str:
    return f"http://127.0.0.1:{rabbit_node.management_port}/api"


@pytest.fixture(scope="module")
def brokerha_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A brokerha node with the users of ``USERS``; its management API at port + 10000."""
    config = tmp_path_factory.mktemp("diff-mgmt") / "node.toml"
    config.write_text(USERS)
    with NodeProcess("diff-mgmt", port=free_base_port(1),
                     extra_args=["--config", str(config)]) as node:
        yield node


@pytest.fixture(scope="module")
def brokerha_api(brokerha_node: NodeProcess) -> str:
    return f"http://127.0.0.1:{brokerha_node.port + 10000}/api"
