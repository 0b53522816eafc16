"""The node's admin HTTP listener: status as JSON, operator actions, (later) metrics.

Deliberately tiny (no web framework): HTTP/1.1 requests with
``Connection: close``, a routing table of ``(method, path) -> handler``, JSON
in and out, and prefix routers of their own (``fallback``: RabbitMQ's
management API, which authenticates every request itself). brokerha's own
reads need no credentials (what ``brokerha ctl status`` shows is what a
monitoring probe needs); every action (POST) needs HTTP Basic credentials of a
configured user with the ``administrator`` tag — the same users, hashes and
loopback rule as AMQP, so nobody acts who was not configured.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from brokerha.broker.auth import AuthenticationFailed, UserDatabase

log = logging.getLogger("brokerha.admin")

MAX_REQUEST = 64 * 1024
READ_TIMEOUT = 5.0


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    peer_host: str | None

    def json(self) -> Any:
        if not self.body:
            return {}
        try:
            return json.loads(self.body)
        except ValueError as exc:
            raise HTTPError(400, f"body is not JSON: {exc}") from exc


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Response:
        return cls(status, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Handler = Callable[[Request], Awaitable[Response] | Response]

_REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


# wraps a listener's protocol factory: node/tls.py's NodeTLS.acceptor (HTTPS)
Wrapper = Callable[[Callable[[], asyncio.Protocol]], Callable[[], asyncio.Protocol]]


class AdminServer:
    def __init__(self, users: UserDatabase) -> None:
        self.users = users
        self.routes: dict[tuple[str, str], tuple[Handler, bool]] = {}
        # path prefix -> a router of its own, asked when no exact route matches
        # (None: not its path either); it does its own authentication
        self.fallbacks: list[tuple[str, Callable[[Request], Awaitable[Response | None]]]] = []
        self.servers: list[asyncio.base_events.Server] = []

    def route(self, method: str, path: str, handler: Handler, *, admin: bool = False) -> None:
        """Serve ``handler`` at ``path``; ``admin`` requires administrator credentials."""
        self.routes[(method, path)] = (handler, admin)

    def fallback(self, prefix: str,
                 router: Callable[[Request], Awaitable[Response | None]]) -> None:
        """Ask ``router`` for paths under ``prefix`` that no exact route serves."""
        self.fallbacks.append((prefix, router))

    async def start(self, host: str, port: int,
                    wrap: Wrapper | None = None) -> tuple[str, int]:
        """Listen on ``host:port`` (several listeners may share the routes); ``wrap``
        (HTTPS) runs the TLS handshake first. Returns the bound address."""
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), self._serve,
                                                loop=loop)

        server = await loop.create_server(protocol if wrap is None else wrap(protocol), host,
                                          port, reuse_address=True)
        self.servers.append(server)
        return tuple(server.sockets[0].getsockname()[:2])  # type: ignore[return-value]

    def close(self) -> None:
        for server in self.servers:
            server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            try:
                request = await asyncio.wait_for(_read_request(reader, peer), READ_TIMEOUT)
                response = await self._dispatch(request)
            except HTTPError as exc:
                response = Response.json({"error": str(exc)}, exc.status)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return
            except Exception:  # a bug in a handler must not take the node down
                log.exception("admin request failed")
                response = Response.json({"error": "internal error (see the node's log)"}, 500)
            head = (f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Error')}\r\n"
                    f"Content-Type: {response.content_type}\r\n"
                    f"Content-Length: {len(response.body)}\r\n"
                    "Cache-Control: no-store\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + response.body)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _dispatch(self, request: Request) -> Response:
        entry = self.routes.get((request.method, request.path))
        if entry is None:
            for prefix, router in self.fallbacks:
                if request.path.startswith(prefix):
                    answer = await router(request)
                    if answer is not None:
                        return answer
            if any(path == request.path for _, path in self.routes):
                raise HTTPError(405, f"{request.method} not allowed on {request.path}")
            raise HTTPError(404, f"no such resource: {request.path}")
        handler, admin = entry
        if admin:
            self._authorize(request)
        result = handler(request)
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result
        return result

    def _authorize(self, request: Request) -> None:
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("basic "):
            raise HTTPError(401, "credentials required (HTTP Basic, an administrator user)")
        try:
            name, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        except ValueError as exc:
            raise HTTPError(401, "malformed Basic credentials") from exc
        try:
            user = self.users.authenticate(name, password, request.peer_host)
        except AuthenticationFailed as exc:
            log.warning("admin: refused %s from %s: %s", name, request.peer_host, exc)
            raise HTTPError(401, str(exc)) from exc
        if "administrator" not in user.tags:
            raise HTTPError(403, f"user '{name}' is not an administrator")


async def _read_request(reader: asyncio.StreamReader, peer: Any) -> Request:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as exc:
        raise HTTPError(413, "request head too large") from exc
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError as exc:
        raise HTTPError(400, "malformed request line") from exc
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    length_text = headers.get("content-length", "0") or "0"
    if not length_text.isdigit():
        raise HTTPError(400, "bad Content-Length")
    length = int(length_text)
    if length > MAX_REQUEST:
        raise HTTPError(413, "request body too large")
    body = await reader.readexactly(length) if length else b""
    url = urlsplit(target)
    host = peer[0] if isinstance(peer, tuple) else None
    return Request(method.upper(), url.path, parse_qs(url.query), headers, body, host)
