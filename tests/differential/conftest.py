"""A private RabbitMQ node and a brokerha node, one each per test session, side by side."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerha.testing import NodeProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rabbitmq_ref import RabbitMQRef, available  # noqa: E402


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
