"""The admin HTTP listener of a real node, and ``brokerha ctl`` against it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from brokerha.admin.ctl import admin_url
from brokerha.httpapi.client import CtlError, request
from brokerha.node.server import GC_THRESHOLDS
from brokerha.testing import NodeProcess, free_port


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[NodeProcess, str]]:
    port = free_port()
    with NodeProcess("adm", extra_args=["--admin", f"127.0.0.1:{port}"]) as n:
        yield n, f"http://127.0.0.1:{port}"


def ctl(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", *argv],
                          capture_output=True, text=True, timeout=30)


def test_admin_url_from_amqp_or_http() -> None:
    assert admin_url("amqp://guest:guest@127.0.0.1:5672/%2F") == "http://127.0.0.1:15672"
    assert admin_url("http://10.0.0.1:9000") == "http://10.0.0.1:9000"
    with pytest.raises(CtlError):
        admin_url("ftp://x")


def test_status_of_a_standalone_node(node: tuple[NodeProcess, str]) -> None:
    proc, base = node
    done = ctl("--node", base, "status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    (entry,) = status["nodes"]
    assert entry["name"] == "adm" and entry["role"] == "standalone"
    assert entry["pid"] == proc.proc.pid and entry["amqp_url"].endswith(f":{proc.port}")
    # the node's process tuned its cyclic GC once started (node/server.py tune_gc)
    assert entry["gc"]["thresholds"] == list(GC_THRESHOLDS) and entry["gc"]["frozen"] > 10_000
    human = ctl("--node", base, "status")
    assert "adm" in human.stdout and "standalone" in human.stdout


def test_unknown_path_wrong_method_and_garbage_get_http_errors(node: tuple[NodeProcess, str]) -> None:
    _, base = node
    with pytest.raises(CtlError, match="404"):
        request(base, "/api/nothing")
    with pytest.raises(CtlError, match="405"):
        request(base, "/api/status", body={})
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"\x00\x01garbage\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    # the node is still fine
    assert request(base, "/api/status")["node"]["name"] == "adm"


def test_unreachable_node_is_a_clear_ctl_error() -> None:
    done = ctl("--node", f"http://127.0.0.1:{free_port()}", "status")
    assert done.returncode == 2 and "cannot reach the node" in done.stderr  # 2: down, not refused


def test_actions_need_administrator_credentials() -> None:
    import asyncio

    from brokerha.broker.auth import UserDatabase
    from brokerha.httpapi.server import AdminServer, Response

    users = UserDatabase()
    users.add_user("boss", "pw", tags=["administrator"])
    users.add_user("bob", "pw")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    acted: list[object] = []

    def act(req: object) -> Response:
        acted.append(req)
        return Response.json({"message": "done"})

    async def scenario() -> list[str]:
        server = AdminServer(users)
        server.route("POST", "/api/act", act, admin=True)
        await server.start("127.0.0.1", port)
        outcomes = []
        for user, password in [(None, None), ("bob", "pw"), ("boss", "wrong"), ("boss", "pw")]:
            try:
                answer = await asyncio.to_thread(request, base, "/api/act", body={},
                                                 user=user, password=password)
                outcomes.append(answer["message"])
            except CtlError as exc:
                outcomes.append(str(exc).split(": ", 1)[1][:3])
        server.close()
        return outcomes

    assert asyncio.run(scenario()) == ["401", "403", "401", "done"]
    assert len(acted) == 1
