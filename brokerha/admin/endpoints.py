"""Everything the admin listener serves besides ``/api/status``, installed in one call."""

from __future__ import annotations

from brokerha.admin import api, management, metrics, status_page, ui
from brokerha.admin.node_view import NodeView


def install(node: NodeView) -> None:
    """Register brokerha's API (api.py), RabbitMQ's management API (management.py),
    ``/metrics`` (metrics.py), ``/status`` (status_page.py) and the UI at ``/`` (ui.py)."""
    api.install(node)
    node.management = management.install(node)
    node.metrics = metrics.install(node)
    status_page.install(node)
    ui.install(node)
