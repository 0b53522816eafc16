"""The management web UI at ``GET /``: a page and a script over RabbitMQ's management API.

The page (``static/index.html``, ``static/app.js``, ``static/app.css``) holds no
data: it asks for a user's credentials and calls ``/api/...`` (management.py)
with them, so it shows and does exactly what that user may. Overview (message
rates and queued messages over time, charted with the vendored uPlot; the
nodes with their HA role, epoch, readiness and backups' lag, their elections
and step-downs by reason and their event loop's lag; the TxLog),
queues (sortable, with rates; declare, delete, purge, publish, get), exchanges
(declare, delete, publish), connections, channels; the definitions (issue 34):
virtual hosts (add, delete; definitions export as a download, import of a
file: ``/api/definitions``), users (add, delete, change a password, set tags;
set tags sends the user's password hash back, as a PUT without one clears the
password on RabbitMQ), permissions and topic permissions (set, clear), policies
and operator policies (set with a JSON definition, clear). No
external network: everything it loads is served here. The server-rendered
status page (status_page.py) moved to ``/status``.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from brokerha.admin.node_view import NodeView
from brokerha.httpapi.server import HTTPError, Request, Response

Node = NodeView  # what these endpoints read of the node (admin/node_view.py)

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
FILES = ("app.js", "app.css", "vendor/uplot-1.6.31/uPlot.iife.min.js",
         "vendor/uplot-1.6.31/uPlot.min.css")


def _read(name: str) -> bytes:
    return resources.files("brokerha.admin").joinpath("static", name).read_bytes()


def install(node: Node) -> None:
    cache: dict[str, bytes] = {}

    def serve(name: str) -> Any:
        def handler(request: Request) -> Response:
            if name not in cache:
                try:
                    cache[name] = _read(name)
                except OSError as exc:  # a broken installation, not a missing page
                    raise HTTPError(500, f"the UI file {name} is missing: {exc}") from None
            suffix = name[name.rfind("."):]
            return Response(200, cache[name], TYPES[suffix])
        return handler

    node.admin.route("GET", "/", serve("index.html"), public=True)  # no data in them
    for name in FILES:
        node.admin.route("GET", f"/static/{name}", serve(name), public=True)
