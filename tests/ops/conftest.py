"""Fixtures for the container tests: brokerha.testing_containers' own (public) ones."""

from brokerha.testing_containers import (  # noqa: F401 - pytest finds fixtures by name
    brokerha_cluster,
    brokerha_docker,
    brokerha_image,
)
