"""Definitions survive a restart; the TOML seeds a new store only; --reset-definitions."""

from __future__ import annotations

from pathlib import Path

import pika
import pytest
from pika.exceptions import ProbableAccessDeniedError, ProbableAuthenticationError

from brokerha.testing import NodeProcess, free_base_port
from tests.management_http import call

pytestmark = pytest.mark.timeout(120)

SEED = """
[[vhosts]]
name = "seeded"

[[users]]
name = "svc"
password = "{password}"

[[permissions]]
user = "svc"
vhost = "seeded"
"""


def login(node: NodeProcess, vhost: str, user: str, password: str) -> None:
    pika.BlockingConnection(pika.ConnectionParameters(
        "127.0.0.1", node.port, vhost, pika.PlainCredentials(user, password),
        connection_attempts=1, socket_timeout=5)).close()


def test_the_store_wins_over_the_configuration_until_a_reset(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(SEED.format(password="first"))
    port = free_base_port(1)
    data = tmp_path / "data"

    def node(*extra: str) -> NodeProcess:
        return NodeProcess("defs", port=port, data_dir=data,
                           extra_args=["--config", str(config), *extra])

    with node() as n:
        login(n, "seeded", "svc", "first")
        api = f"http://127.0.0.1:{n.port + 10000}/api"
        assert call(api, "PUT", "/vhosts/runtime")[0] == 201
        assert call(api, "PUT", "/users/added", body={"password": "pw", "tags": ""})[0] == 201
        assert call(api, "PUT", "/permissions/runtime/added",
                    body={"configure": ".*", "write": ".*", "read": ".*"})[0] == 201
        assert call(api, "PUT", "/users/svc", body={"password": "changed", "tags": ""})[0] == 204

    config.write_text(SEED.format(password="second"))  # read for a new store only
    with node() as n:
        login(n, "runtime", "added", "pw")
        login(n, "seeded", "svc", "changed")
        with pytest.raises(ProbableAuthenticationError):
            login(n, "seeded", "svc", "second")

    with node("--reset-definitions") as n:
        login(n, "seeded", "svc", "second")
        with pytest.raises(ProbableAuthenticationError):
            login(n, "runtime", "added", "pw")
        with pytest.raises(ProbableAccessDeniedError):
            login(n, "runtime", "guest", "guest")  # the vhost is gone too
