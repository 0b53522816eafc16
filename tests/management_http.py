"""HTTP calls to a management API (brokerha's or RabbitMQ's), and the users the tests add.

Shared by tests/ops (the API and the UI against a node) and tests/differential (the same
calls against RabbitMQ's management plugin).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

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


def call(base: str, method: str, path: str, user: str | None = "guest",
         password: str = "guest", body: Any = None, timeout: float = 10) -> tuple[int, Any]:
    """``(status, JSON answer or None)`` of ``method base+path`` with HTTP Basic credentials."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if user is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(
            f"{user}:{password}".encode()).decode())
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw) if raw else None
        except ValueError:
            return exc.code, raw.decode("latin-1")[:200]
