"""Reading another member's admin listener: a JSON document over HTTP/1.1 (HTTPS with the
node's member TLS context), signed with the member token (``http.member_token``) so that
the peer answers a member's read without a user's credentials. Used by the cluster views
(``api.py``) and the partitioned node's lists (``partition_views.py``)."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from brokerha.admin.node_view import NodeView
from brokerha.httpapi.server import REASONS, exchange, member_token

Node = NodeView

Signer = Callable[[str, str], str]


def _signer(node: Node) -> Signer | None:
    """How this node signs its reads of another member (http.member_token), if a member."""
    secret = node.admin.member_secret
    if secret is None:
        return None
    name = node.config.name
    return lambda method, path: member_token(secret, name, method, path)


async def fetch_json(url: str, timeout: float, tls: ssl.SSLContext | None = None,
                     sign: Signer | None = None) -> Any:
    """GET a JSON document over HTTP/1.1 (the admin listeners of peers); ``https://`` URLs
    over TLS with ``tls`` (the node's member context, node/tls.py); ``sign`` (a
    member's) adds its ``X-Brokerha-Member`` header."""
    parts = urlsplit(url)
    if parts.scheme == "https" and tls is None:
        raise ValueError(f"{url}: HTTPS needs this node's [tls] certificates")
    path = parts.path or "/"
    headers = {"Accept": "application/json"}
    if sign is not None:
        headers["X-Brokerha-Member"] = sign("GET", path)
    try:
        target = path + (f"?{parts.query}" if parts.query else "")  # signed: the path
        answer = await asyncio.wait_for(exchange(url, "GET", target, headers, tls=tls), timeout)
    except IndexError:
        raise ValueError(f"{url}: not an HTTP answer") from None
    if answer.status != 200:
        raise ValueError(f"{url}: {answer.status} {REASONS.get(answer.status, 'Error')}")
    return json.loads(answer.body)
