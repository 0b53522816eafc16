"""The node's admin HTTP listener: status as JSON, operator actions, (later) metrics.

Deliberately tiny (no web framework): HTTP/1.1 requests with
``Connection: close``, a routing table of ``(method, path) -> handler``, JSON
in and out, and prefix routers of their own (``fallback``: RabbitMQ's
management API, which authenticates every request itself). As in RabbitMQ,
every route needs HTTP Basic credentials — the same users, hashes and loopback
rule as AMQP, so nobody gets in who was not configured — except those
installed ``public`` (``/metrics``, the UI's page and script, which hold no
data): reads need a user with a management tag (administrator, monitoring,
management, policymaker), actions an ``administrator``. A cluster member
reading another (``api.fetch_json``) signs its request with the cluster
secret instead (``member_token``: name, time and path under HMAC-SHA256).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from brokerha.broker.auth import AuthenticationFailed, UserDatabase

log = logging.getLogger("brokerha.admin")

MAX_REQUEST = 64 * 1024
MAX_DEFINITIONS = 20 * 1024 * 1024  # POST /api/definitions[/{vhost}]: a definitions file
READ_TIMEOUT = 5.0
READ_TAGS = frozenset({"administrator", "monitoring", "management", "policymaker"})
MEMBER_HEADER = "x-brokerha-member"
MEMBER_TOKEN_AGE = 30.0  # seconds a member token's time may lag or lead ours


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
    headers: dict[str, str] | None = None

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Response:
        return cls(status, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def json_safe(value: Any) -> Any:
    """JSON-safe: AMQP field values may be bytes, decimals, datetimes."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


async def exchange(url: str, method: str, target: str, headers: dict[str, str],
                   body: bytes = b"", tls: ssl.SSLContext | None = None) -> Response:
    """One HTTP/1.1 request to another node's admin listener (``https://`` over ``tls``):
    ``target`` is the path and query; the answer as a Response. Raises OSError,
    ValueError (no answer, or a garbled one) or IndexError."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
            f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    reader, writer = await asyncio.open_connection(
        host, port, ssl=tls if parts.scheme == "https" else None)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    top, _, content = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    ctype = next((line.split(":", 1)[1].strip() for line in lines[1:]
                  if line.lower().startswith("content-type:")), "application/json")
    return Response(status, content, ctype)


def basic_credentials(request: Request) -> tuple[str, str] | None:
    """``(user, password)`` of an HTTP Basic ``Authorization`` header; None without one.

    Raises ValueError when the header is there but does not decode.
    """
    auth = request.headers.get("authorization", "")
    if not auth.lower().startswith("basic "):
        return None
    try:
        name, _, password = base64.b64decode(auth[6:]).decode().partition(":")
    except (ValueError, binascii.Error) as exc:
        raise ValueError("malformed Basic credentials") from exc
    return name, password


def member_token(secret: bytes, member: str, method: str, path: str,
                 now: float | None = None) -> str:
    """The ``X-Brokerha-Member`` value a cluster member signs a request with."""
    stamp = str(int(time.time() if now is None else now))
    mac = hmac.new(secret, f"{member} {stamp} {method} {path}".encode(), hashlib.sha256)
    return f"{member} {stamp} {mac.hexdigest()}"


def member_token_valid(secret: bytes, value: str, method: str, path: str) -> bool:
    try:
        member, stamp, digest = value.split(" ")
        age = abs(time.time() - int(stamp))
    except ValueError:
        return False
    expected = member_token(secret, member, method, path, float(stamp)).split(" ")[2]
    return age <= MEMBER_TOKEN_AGE and hmac.compare_digest(expected, digest)


Handler = Callable[[Request], Awaitable[Response] | Response]

REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 409: "Conflict",
            413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


# wraps a listener's protocol factory: node/tls.py's NodeTLS.acceptor (HTTPS)
Wrapper = Callable[[Callable[[], asyncio.Protocol]], Callable[[], asyncio.Protocol]]


class AdminServer:
    def __init__(self, users: UserDatabase | None, member_secret: bytes | None = None) -> None:
        self.users = users
        self.member_secret = member_secret  # a cluster member's: its peers may read
        self.routes: dict[tuple[str, str], tuple[Handler, str]] = {}
        # path prefix -> a router of its own, asked when no exact route matches
        # (None: not its path either); it does its own authentication
        self.fallbacks: list[tuple[str, Callable[[Request], Awaitable[Response | None]]]] = []
        self.servers: list[asyncio.base_events.Server] = []

    def route(self, method: str, path: str, handler: Handler, *, admin: bool = False,
              public: bool = False) -> None:
        """Serve ``handler`` at ``path``: to a user with a management tag, to an
        ``administrator`` only (``admin``), or to anyone (``public``: no data)."""
        self.routes[(method, path)] = (handler, "public" if public else
                                       "admin" if admin else "read")

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
        page = False  # a page a browser shows (not /api/...): a 401 makes it ask for a login
        try:
            try:
                request = await asyncio.wait_for(_read_request(reader, peer), READ_TIMEOUT)
                page = not request.path.startswith("/api/")
                response = await self._dispatch(request)
            except HTTPError as exc:
                response = Response.json({"error": str(exc)}, exc.status)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return
            except Exception:  # a bug in a handler must not take the node down
                log.exception("admin request failed")
                response = Response.json({"error": "internal error (see the node's log)"}, 500)
            extra = dict(response.headers or {})
            if response.status == 401 and page:  # the browser asks (the status page)
                extra.setdefault("WWW-Authenticate", 'Basic realm="brokerha"')
            head = (f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Error')}\r\n"
                    f"Content-Type: {response.content_type}\r\n"
                    + "".join(f"{k}: {v}\r\n" for k, v in extra.items()) +
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
            if request.path.startswith("/api/"):  # as RabbitMQ's management API answers
                return Response.json({"error": "Object Not Found", "reason": "Not Found"}, 404)
            raise HTTPError(404, f"no such resource: {request.path}")
        handler, access = entry
        if access != "public":
            self._authorize(request, access == "admin")
        result = handler(request)
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result
        return result

    def _authorize(self, request: Request, admin: bool) -> None:
        token = request.headers.get(MEMBER_HEADER)
        if (token is not None and not admin and self.member_secret is not None
                and member_token_valid(self.member_secret, token, request.method,
                                       request.path)):
            return
        if self.users is None:  # a server without users (a TxLog master's): public routes only
            raise HTTPError(401, "no users on this listener")
        try:
            credentials = basic_credentials(request)
        except ValueError as exc:
            raise HTTPError(401, str(exc)) from exc
        if credentials is None:
            raise HTTPError(401, "credentials required (HTTP Basic: a user with a management "
                            "tag; an administrator for actions)")
        name, password = credentials
        try:
            user = self.users.authenticate(name, password, request.peer_host)
        except AuthenticationFailed as exc:
            log.warning("admin: refused %s from %s: %s", name, request.peer_host, exc)
            raise HTTPError(401, str(exc)) from exc
        if admin and "administrator" not in user.tags:
            raise HTTPError(403, f"user '{name}' is not an administrator")
        if not READ_TAGS.intersection(user.tags):
            raise HTTPError(403, f"user '{name}' has no management tag (administrator, "
                            "monitoring, management)")


def body_limit(method: str, path: str) -> int:
    """The largest body taken: a definitions import is a whole broker's file (RabbitMQ's
    ``management.http.max_body_size``, 20 MiB); every other request a small JSON object."""
    if method == "POST" and path.rstrip("/").split("/")[:3] == ["", "api", "definitions"]:
        return MAX_DEFINITIONS
    return MAX_REQUEST


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
    url = urlsplit(target)
    if length > body_limit(method.upper(), url.path):
        raise HTTPError(413, "request body too large")
    body = await reader.readexactly(length) if length else b""
    host = peer[0] if isinstance(peer, tuple) else None
    return Request(method.upper(), url.path, parse_qs(url.query), headers, body, host)
