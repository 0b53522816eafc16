"""admin/leader_requests.py (issue 35): the marker a leader honours only with a member's
valid signature, what is sent to the leader, and the 503 of a leader that does not
answer."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from brokerha.admin import leader_requests
from brokerha.httpapi.server import MEMBER_HEADER, Request, member_token

SECRET = b"cluster-secret"

pytestmark = pytest.mark.timeout(20)


def node(members: list[Any] | None = None, secret: bytes | None = SECRET) -> Any:
    return SimpleNamespace(
        admin=SimpleNamespace(member_secret=secret), config=SimpleNamespace(name="n1"),
        ha=SimpleNamespace(cluster=SimpleNamespace(members=members or [])),
        tls=SimpleNamespace(member_client=None))


def request(headers: dict[str, str], path: str = "/api/queues/%2F/q/get") -> Request:
    return Request("POST", path, {}, headers, b'{"count": 1}', "127.0.0.1")


def signed(method: str = "POST", path: str = "/api/queues/%2F/q/get",
           secret: bytes = SECRET, now: float | None = None) -> dict[str, str]:
    return {leader_requests.ANSWER_HERE: "1",
            MEMBER_HEADER: member_token(secret, "n2", method, path, now)}


def test_the_marker_is_honoured_only_with_a_valid_member_signature() -> None:
    assert leader_requests.answer_here(node(), request(signed()))
    assert not leader_requests.answer_here(node(), request({leader_requests.ANSWER_HERE: "1"}))
    no_marker = signed()
    del no_marker[leader_requests.ANSWER_HERE]
    assert not leader_requests.answer_here(node(), request(no_marker))
    # another secret, another path or method, an old token, a node with no secret
    assert not leader_requests.answer_here(node(), request(signed(secret=b"other")))
    assert not leader_requests.answer_here(node(), request(signed(path="/api/overview")))
    assert not leader_requests.answer_here(node(), request(signed(method="GET")))
    assert not leader_requests.answer_here(node(), request(signed(now=time.time() - 120)))
    assert not leader_requests.answer_here(node(secret=None), request(signed()))


def api_for(port: int) -> Any:
    member = SimpleNamespace(name="n2", https_url=None, admin_url=f"http://127.0.0.1:{port}")
    return SimpleNamespace(node=node([member]))


def test_the_request_goes_to_the_leader_as_it_came_and_its_answer_is_the_answer() -> None:
    seen: dict[str, Any] = {}

    async def main() -> Any:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (line.partition(":") for line in head[1:] if line)}
            seen["line"], seen["headers"] = head[0], headers
            seen["body"] = await reader.readexactly(int(headers["content-length"]))
            body = b'[{"payload": "x"}]'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            req = Request("POST", "/api/queues/%2F/q/get", {"x": ["1"]},
                          {"authorization": "Basic Z3Vlc3Q6Z3Vlc3Q=",
                           "content-type": "application/json", "cookie": "dropped"},
                          b'{"count": 1}', "127.0.0.1")
            return await leader_requests.ask_leader(api_for(port), "n2", req)

    answer = asyncio.run(main())
    assert (answer.status, json.loads(answer.body)) == (200, [{"payload": "x"}])
    assert seen["line"] == "POST /api/queues/%2F/q/get?x=1 HTTP/1.1"
    headers = seen["headers"]
    assert headers["authorization"] == "Basic Z3Vlc3Q6Z3Vlc3Q=" and "cookie" not in headers
    assert seen["body"] == b'{"count": 1}'
    # the leader would honour it: signed by n1 for this method and path
    assert leader_requests.answer_here(node(), Request(
        "POST", "/api/queues/%2F/q/get", {}, headers, b"", "127.0.0.1"))


def test_a_leader_that_does_not_answer_is_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leader_requests, "LEADER_TIMEOUT", 0.3)

    async def main() -> tuple[Any, Any, Any]:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(5)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        req = request({"authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="})
        async with server:
            quiet = await leader_requests.ask_leader(api_for(port), "n2", req)
        server.close()
        closed = await leader_requests.ask_leader(api_for(port), "n2", req)
        unknown = await leader_requests.ask_leader(api_for(port), "n9", req)
        return quiet, closed, unknown

    for answer in asyncio.run(main()):
        assert answer.status == 503
        assert json.loads(answer.body)["error"] == "service_unavailable"
