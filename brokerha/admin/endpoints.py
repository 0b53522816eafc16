"""Everything the admin listener serves besides ``/api/status``, installed in one call."""

from __future__ import annotations

from brokerha.admin import (
    api,
    definitions_api,
    definitions_file,
    management,
    metrics,
    partition_views,
    policies_api,
    status_page,
    ui,
)
from brokerha.admin.node_view import NodeView


def install(node: NodeView) -> None:
    """Register brokerha's API (api.py), RabbitMQ's management API (management.py) with
    its policies (policies_api.py), definitions (definitions_api.py) and definitions files
    (definitions_file.py), ``/metrics`` (metrics.py), ``/status`` (status_page.py) and the
    UI at ``/`` (ui.py)."""
    api.install(node)
    mgmt = management.install(node)
    mgmt.policies = policies_api.install(mgmt)
    # /api/vhosts, users, permissions, topic-permissions changes; their checks serve imports
    checks = definitions_api.install(mgmt)
    definitions_file.install(mgmt, checks)  # /api/definitions: export and import
    partition_views.install(mgmt)  # what a member leads, for the lists of a partitioned node
    node.management = mgmt
    node.metrics = metrics.install(node)
    status_page.install(node)
    ui.install(node)
