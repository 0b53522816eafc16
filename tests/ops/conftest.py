"""Fixtures: the container tests' (brokerha.testing_containers' own, public ones), and a
node with users of every management tag for the management API and UI tests.

When container tests were collected, the Docker engine starts and the node image
builds (1.5-3.5 minutes on the vfs driver) in a background thread as soon as
collection ends, while the tests before tests/ops run; the container fixtures
wait for it (brokerha.testing_containers.Preparation).
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerha.testing import NodeProcess, free_base_port
from brokerha.testing_containers import (  # noqa: F401 - pytest finds fixtures by name
    brokerha_cluster,
    brokerha_docker,
    brokerha_image,
    prepare_in_background,
    stop_engine,
)
from tests.management_http import USERS


@pytest.fixture(scope="module")
def managed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    config = tmp_path_factory.mktemp("managed") / "node.toml"
    config.write_text(USERS)
    # the admin listener is at AMQP port + 10000: both must be free (and valid)
    with NodeProcess("mgmt", port=free_base_port(1), extra_args=["--config", str(config)]) as n:
        yield n


def pytest_collection_finish(session: pytest.Session) -> None:
    here = Path(__file__).parent
    wanted = any(
        "brokerha_image" in getattr(item, "fixturenames", ()) and here in item.path.parents
        for item in session.items
    )
    if not wanted or session.config.option.collectonly:
        return
    preparation = prepare_in_background()

    def stop_if_left() -> None:
        # the engine fixture stops an engine the preparation started; this is for a run
        # that ended before any container test asked for it (stop_engine is idempotent)
        if preparation.started_engine:
            stop_engine()

    session.config.add_cleanup(stop_if_left)
