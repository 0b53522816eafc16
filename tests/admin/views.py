"""What operators see of a node, as the admin tests read it: ``/metrics`` samples, the
management UI overview's node entry and script, the status page's body."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from brokerha.admin import status_page
from brokerha.admin.management import ManagementAPI
from brokerha.admin.metrics import NodeMetrics
from brokerha.admin.ui import _read

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Prometheus text as {(name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(node: Any) -> Samples:
    """``node``'s ``/metrics`` (a stand-in carrying what admin/node_view.py names)."""
    return samples(NodeMetrics(node).render().decode())


def ui_entry(node: Any, me: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the management UI's overview gets of ``node`` (its ``/api/nodes`` entry's
    ``brokerha``), from its status or from ``me`` given for it."""
    status = node.status() if me is None else {"node": me}
    entry = ManagementAPI(node)._node_entry(status)  # noqa: SLF001
    return dict(entry["brokerha"])


def assert_overview_renders(*fields: str) -> None:
    """The overview's script (static/app.js) reads and titles exactly these."""
    script = _read("app.js").decode()
    for field in fields:
        assert field in script, field


def status_body(nodes: list[dict[str, Any]], replication: dict[str, Any] | None = None) -> str:
    """The status page's body (status_page.py) showing ``nodes``, asked of the first."""
    return status_page.render_body({"asked": nodes[0]["name"], "at": time.time(),
                                    "replication": replication, "nodes": nodes})
