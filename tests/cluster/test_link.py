"""Cluster links over real sockets on 127.0.0.1: mesh, request/response, reconnection,
and every class of bad input on the cluster port (refused, logged, bystanders unharmed)."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from brokerha.cluster.link import ClusterLinks, tls_contexts
from brokerha.cluster.messages import Error, ErrorCode, Message
from brokerha.cluster.protocol import (
    MAGIC,
    Authenticate,
    Dialer,
    Established,
    PacketCodec,
)

pytestmark = pytest.mark.timeout(30)

SECRET = b"0123456789abcdef0123"
LOGGER = "brokerha.cluster"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_until(pred: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)


def note(text: str) -> Error:
    """A payload any test can send: the generic Error packet carries a string."""
    return Error(ErrorCode.UNKNOWN, text)


class Node:
    """A ClusterLinks with its callbacks recorded."""

    def __init__(self, name: str, ports: dict[str, int], *, cluster: str = "dc1",
                 secret: bytes = SECRET, peers: list[str] | None = None,
                 echo: bool = False, **kw: Any) -> None:
        self.name = name
        self.inbox: list[tuple[str, int, Message]] = []
        self.events: list[tuple[str, str]] = []
        self.echo = echo
        names = peers if peers is not None else [n for n in ports if n != name]
        self.links = ClusterLinks(
            cluster, name, {p: ("127.0.0.1", ports[p]) for p in names},
            ("127.0.0.1", ports[name]), secret, self._on_message,
            lambda p: self.events.append(("up", p)), lambda p: self.events.append(("down", p)),
            **kw)

    def _on_message(self, peer: str, msg_id: int, msg: Message) -> None:
        self.inbox.append((peer, msg_id, msg))
        if self.echo and isinstance(msg, Error) and msg.message.startswith("ask:"):
            self.links.send(peer, note("answer:" + msg.message[4:]), msg_id)

    def texts(self, peer: str | None = None) -> list[str]:
        return [m.message for p, _, m in self.inbox
                if isinstance(m, Error) and (peer is None or p == peer)]


async def started(*nodes: Node) -> tuple[Node, ...]:
    for node in nodes:
        await node.links.start()
    return nodes


async def closed(*nodes: Node) -> None:
    for node in nodes:
        await node.links.close()


def mesh(names: list[str]) -> dict[str, int]:
    return {n: free_port() for n in names}


async def all_up(*nodes: Node) -> None:
    await wait_until(lambda: all(n.links.peers_up() == set(n.links.peers) for n in nodes))


# -- the happy paths -------------------------------------------------------------------


def test_two_nodes_connect_and_exchange_messages() -> None:
    async def main() -> None:
        ports = mesh(["n1", "n2"])
        n1, n2 = await started(Node("n1", ports), Node("n2", ports))
        try:
            await all_up(n1, n2)
            assert n1.events == [("up", "n2")] and n2.events == [("up", "n1")]
            first = n1.links.send("n2", note("hello"))
            ids = n2.links.send_many("n1", [note("a"), note("b"), note("c")])
            assert first is not None and ids is not None and len(set(ids)) == 3
            await wait_until(lambda: n2.texts() == ["hello"] and n1.texts() == ["a", "b", "c"])
            assert n2.inbox[0][:2] == ("n1", first)
            assert [i for _, i, _ in n1.inbox] == ids
            assert n1.links.buffered("n2") == 0 and n1.links.connected("n2")
        finally:
            await closed(n1, n2)
    asyncio.run(main())


def test_slow_handling_is_sliced_timers_run_between_and_the_order_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: one read of many packets was handled in one step of the loop (a
    backup applying 256 KiB of dequeue events: 0.1-0.5 s, its heartbeats behind it)."""
    import time as _time

    from brokerha.cluster import link

    monkeypatch.setattr(link, "DELIVER_SLICE", 0.005)

    async def main() -> None:
        ports = mesh(["n1", "n2"])
        n1, n2 = await started(Node("n1", ports), Node("n2", ports))
        try:
            await all_up(n1, n2)
            handled = n1._on_message
            ticks: list[int] = []  # how many packets were handled when each tick ran

            def slow(peer: str, msg_id: int, msg: Message) -> None:
                _time.sleep(0.001)  # a packet that costs 1 ms to apply
                handled(peer, msg_id, msg)

            n1.links.on_message = slow
            loop = asyncio.get_running_loop()

            def tick() -> None:
                ticks.append(len(n1.inbox))
                if len(n1.inbox) < 200:
                    loop.call_soon(tick)

            sent = [f"m{i}" for i in range(200)]
            n2.links.send_many("n1", [note(t) for t in sent])
            loop.call_soon(tick)
            await wait_until(lambda: len(n1.inbox) == 200)
            assert n1.texts() == sent  # in order
            # other callbacks ran while the 200 ms of packets were handled, in slices
            progress = sorted(set(t for t in ticks if 0 < t < 200))
            assert len(progress) >= 5, ticks
            assert max(b - a for a, b in zip([0, *progress], [*progress, 200], strict=True)) <= 50
            n2.links.send("n1", note("after"))  # reading resumed
            await wait_until(lambda: n1.texts()[-1:] == ["after"])
        finally:
            await closed(n1, n2)
    asyncio.run(main())


def test_three_nodes_make_one_link_per_pair() -> None:
    async def main() -> None:
        ports = mesh(["n1", "n2", "n3"])
        nodes = await started(*(Node(n, ports) for n in ports))
        try:
            await all_up(*nodes)
            for node in nodes:
                assert sorted(node.events) == sorted(("up", p) for p in node.links.peers)
            for a in nodes:
                for b in nodes:
                    if a is not b:
                        a.links.send(b.name, note(f"{a.name}->{b.name}"))
            await wait_until(lambda: all(len(n.inbox) == 2 for n in nodes))
            assert sorted(nodes[2].texts()) == ["n1->n3", "n2->n3"]
        finally:
            await closed(*nodes)
    asyncio.run(main())


def test_a_response_carries_the_requests_msg_id() -> None:
    async def main() -> None:
        ports = mesh(["n1", "n2"])
        n1, n2 = await started(Node("n1", ports), Node("n2", ports, echo=True))
        try:
            await all_up(n1, n2)
            asked = [n1.links.send("n2", note(f"ask:{i}")) for i in range(5)]
            await wait_until(lambda: len(n1.inbox) == 5)
            assert [(i, m.message) for _, i, m in n1.inbox] == [
                (asked[i], f"answer:{i}") for i in range(5)]
        finally:
            await closed(n1, n2)
    asyncio.run(main())


def test_send_to_a_peer_that_is_down_returns_none() -> None:
    async def main() -> None:
        ports = mesh(["n1", "n2"])
        (n1,) = await started(Node("n1", ports))
        try:
            assert n1.links.send("n2", note("x")) is None
            assert n1.links.send_many("n2", [note("x")]) is None
            assert not n1.links.connected("n2") and n1.links.peers_up() == set()
        finally:
            await closed(n1)
    asyncio.run(main())


@pytest.mark.parametrize("restarted", ["n1", "n2"])  # the dialer, the acceptor
def test_links_come_back_after_a_node_restarts(restarted: str) -> None:
    async def main() -> None:
        ports = mesh(["n1", "n2"])
        nodes = {n: Node(n, ports) for n in ports}
        await started(*nodes.values())
        survivor = nodes["n2" if restarted == "n1" else "n1"]
        try:
            await all_up(*nodes.values())
            await nodes[restarted].links.close()
            await wait_until(lambda: ("down", restarted) in survivor.events)
            assert not survivor.links.connected(restarted)
            nodes[restarted] = Node(restarted, ports)
            await started(nodes[restarted])
            await all_up(*nodes.values())
            assert survivor.events == [("up", restarted), ("down", restarted),
                                       ("up", restarted)]
            nodes[restarted].links.send(survivor.name, note("back"))
            await wait_until(lambda: survivor.texts() == ["back"])
        finally:
            await closed(*nodes.values())
    asyncio.run(main())


def test_a_new_link_from_a_peer_replaces_the_old_one() -> None:
    async def main() -> None:
        ports = mesh(["n1", "n2"])
        (n2,) = await started(Node("n2", ports))
        try:
            old = await RawPeer.identified(ports["n2"], "n1")
            await wait_until(lambda: n2.links.connected("n1"))
            new = await RawPeer.identified(ports["n2"], "n1")   # n1 restarted
            assert await old.read_to_eof() == b""                # the old link is closed
            assert n2.events == [("up", "n1"), ("down", "n1"), ("up", "n1")]
            n2.links.send("n1", note("to the new one"))
            (_, msg), = await new.read_packets(1)
            assert msg == note("to the new one")
            old.close()
            new.close()
        finally:
            await closed(n2)
    asyncio.run(main())



def test_a_silent_link_is_closed_and_reported_down(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def main() -> None:
        ports = mesh(["n1", "n2"])
        (n2,) = await started(Node("n2", ports, ping_interval=0.05, idle_timeout=0.3))
        try:
            raw = await RawPeer.identified(ports["n2"], "n1")   # never answers pings
            (_, ping), = await raw.read_packets(1)
            assert type(ping).__name__ == "Ping"
            await wait_until(lambda: ("down", "n1") in n2.events)
            assert any("cluster link with n1: silent for" in r.getMessage()
                       for r in caplog.records)
            raw.close()
        finally:
            await closed(n2)
    asyncio.run(main())

# -- bad input on the cluster port -----------------------------------------------------


class RawPeer:
    """A hand-driven client on the cluster port (streams are fine for a test)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.codec = PacketCodec()

    @classmethod
    async def connect(cls, port: int) -> RawPeer:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    @classmethod
    async def identified(cls, port: int, name: str, acceptor: str = "n2") -> RawPeer:
        raw = await cls.connect(port)
        dialer = Dialer("dc1", name, acceptor, SECRET)
        raw.write(dialer.start())
        while True:
            data = await asyncio.wait_for(raw.reader.read(65536), 3)
            assert data, "closed during the handshake"
            step = dialer.receive(data)
            raw.write(step.out)
            if isinstance(step.outcome, Established):
                raw.codec.feed(step.outcome.leftover)
                return raw
            assert step.outcome is None, step.outcome

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def read_to_eof(self) -> bytes:
        try:
            return await asyncio.wait_for(self.reader.read(), 3)
        except ConnectionResetError:
            return b""

    async def read_packets(self, n: int) -> list[tuple[int, Message]]:
        got: list[tuple[int, Message]] = []
        while len(got) < n:
            data = await asyncio.wait_for(self.reader.read(65536), 3)
            assert data, "closed"
            got += self.codec.feed(data)
        return got

    def close(self) -> None:
        self.writer.close()


Scenario = Callable[[int], Awaitable[bytes]]


async def send_raw(port: int, data: bytes) -> bytes:
    raw = await RawPeer.connect(port)
    raw.write(data)
    got = await raw.read_to_eof()
    raw.close()
    return got


async def dial_as(port: int, *, cluster: str = "dc1", name: str = "n1") -> bytes:
    return await send_raw(port, Dialer(cluster, name, "n2", SECRET).start())


async def forge_proof(port: int) -> bytes:
    """An impostor who knows the names but not the secret: it sends a made-up proof."""
    raw = await RawPeer.connect(port)
    dialer = Dialer("dc1", "n1", "n2", b"a-guess-at-the-secret")
    raw.write(dialer.start())
    first = await asyncio.wait_for(raw.reader.readexactly(len(MAGIC)), 3)
    assert first == MAGIC
    await raw.read_packets(1)                           # the Challenge
    raw.write(raw.codec.encode(0, Authenticate(b"\x00" * 32)))
    got = await raw.read_to_eof()
    raw.close()
    return first + got


async def after_identification(port: int, data: bytes) -> bytes:
    raw = await RawPeer.identified(port, "n1")
    raw.write(data)
    got = await raw.read_to_eof()
    raw.close()
    return MAGIC + got  # so every answered case reads the same


async def oversized(port: int) -> bytes:
    return await after_identification(port, struct.pack(">I", 2 * 1024 * 1024) + b"xx")


async def malformed(port: int) -> bytes:
    body = msgpack.packb([1, 12345, []])
    return await after_identification(port, struct.pack(">I", len(body)) + body)


async def silent(port: int) -> bytes:
    raw = await RawPeer.connect(port)
    got = await raw.read_to_eof()
    raw.close()
    return got


BAD_INPUT: dict[str, tuple[Scenario, str, str | None]] = {
    # name: (scenario, reason in the log line, ErrorCode answered or None for no answer)
    "garbage": (lambda p: send_raw(p, b"\x16\x03\x01\x02\x00garbage"),
                "wrong magic: b'\\x16\\x03", None),
    "wrong magic": (lambda p: send_raw(p, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
                    "wrong magic: b'GET / HT'", None),
    "other version": (lambda p: send_raw(p, b"BRKRHA\x00\x07" + b"\x00" * 8),
                      "protocol version 7 is not ours", None),
    "wrong cluster": (lambda p: dial_as(p, cluster="dc2"),
                      "node 'n1' of cluster 'dc2' is not of cluster 'dc1'", ErrorCode.REFUSED),
    "unconfigured node": (lambda p: dial_as(p, name="zz"),
                          "node 'zz' is not a configured peer of 'n2'", ErrorCode.REFUSED),
    "wrong secret": (forge_proof, "bad secret from node 'n1'", ErrorCode.REFUSED),
    "oversized packet": (oversized, "exceeds the limit of 1048576", ErrorCode.PROTOCOL),
    "malformed packet": (malformed, "unknown packet code 12345", ErrorCode.PROTOCOL),
    "silence": (silent, "no identification within 0.5s", None),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_on_the_cluster_port_is_refused_and_logged(
        case: str, caplog: pytest.LogCaptureFixture) -> None:
    scenario, reason, answered = BAD_INPUT[case]
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def main() -> None:
        # n2 is attacked; n2 <-> n3 is the bystander link; n1 is a configured
        # peer that only the test impersonates (neither dials it: it sorts first)
        ports = mesh(["n1", "n2", "n3"])
        n2 = Node("n2", ports, handshake_timeout=0.5, max_packet=1024 * 1024)
        n3 = Node("n3", ports)
        await started(n2, n3)
        try:
            await wait_until(lambda: n2.links.connected("n3") and n3.links.connected("n2"))
            got = await scenario(ports["n2"])
            if answered is None:
                assert got == b""
            else:
                assert got.startswith(MAGIC)
                packets = PacketCodec().feed(got[len(MAGIC):])
                errors = [m for _, m in packets if isinstance(m, Error)]
                assert len(errors) == 1 and errors[0].code == answered
                assert reason in errors[0].message
            warnings = [r.getMessage() for r in caplog.records
                        if r.name == LOGGER and r.levelno == logging.WARNING]
            assert any(reason in w for w in warnings), warnings
            assert "n1" not in n2.links.peers_up()
            # the bystander link still works, both ways
            n2.links.send("n3", note("still here"))
            n3.links.send("n2", note("me too"))
            await wait_until(lambda: n3.texts() == ["still here"] and n2.texts() == ["me too"])
            assert ("down", "n3") not in n2.events and ("down", "n2") not in n3.events
        finally:
            await closed(n2, n3)
    asyncio.run(main())


@pytest.mark.parametrize("mismatch, reason", [
    ({"secret": b"another-secret-of-20b"}, "bad secret from node 'n2'"),
    ({"cluster": "dc2"}, "node 'n1' of cluster 'dc2' is not of cluster 'dc1'"),
])
def test_a_misconfigured_node_never_comes_up(mismatch: dict[str, Any], reason: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def main() -> None:
        ports = mesh(["n1", "n2"])
        n1, n2 = await started(Node("n1", ports, **mismatch), Node("n2", ports))
        try:
            await wait_until(lambda: any(reason in r.getMessage() for r in caplog.records))
            await asyncio.sleep(0.2)
            assert n1.events == [] and n2.events == [] and n2.inbox == []
        finally:
            await closed(n1, n2)
    asyncio.run(main())


# -- TLS -------------------------------------------------------------------------------


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, pem = d / f"{name}.key", d / f"{name}.pem"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", key, "-out", pem, "-days", "2", "-subj", f"/CN={name}")
    return pem, key


def make_cert(d: Path, name: str, ca: tuple[Path, Path]) -> tuple[Path, Path]:
    key, csr, pem = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem"
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
            "-out", pem, "-days", "2")
    return pem, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(d, "ca"), make_ca(d, "other-ca")
    files: dict[str, Path] = {"ca": ca[0], "other-ca": other_ca[0]}
    for name, issuer in (("n1", ca), ("n2", ca), ("rogue", other_ca)):
        files[name], files[f"{name}.key"] = make_cert(d, name, issuer)
    return files


def tls_node(name: str, ports: dict[str, int], pki: dict[str, Path], cert: str | None = None,
             ca: str = "ca") -> Node:
    cert = cert or name
    server, client = tls_contexts(pki[cert], pki[f"{cert}.key"], pki[ca])
    return Node(name, ports, ssl_server=server, ssl_client=client)


def test_tls_links_connect_and_carry_messages(pki: dict[str, Path]) -> None:
    async def main() -> None:
        ports = mesh(["n1", "n2"])
        n1, n2 = await started(tls_node("n1", ports, pki), tls_node("n2", ports, pki))
        try:
            await all_up(n1, n2)
            conn = n1.links._conns["n2"]
            assert conn.transport is not None and conn.transport.get_extra_info("ssl_object")
            n1.links.send("n2", note("over tls"))
            await wait_until(lambda: n2.texts() == ["over tls"])
        finally:
            await closed(n1, n2)
    asyncio.run(main())


@pytest.mark.parametrize("rogue, reason", [
    ("n1", "TLS handshake failed"),   # a dialer with a cert of another CA: the acceptor refuses
    ("n2", "TLS refused"),            # an acceptor with a cert of another CA: the dialer refuses
])
def test_a_peer_with_a_cert_from_another_ca_is_refused(
        pki: dict[str, Path], rogue: str, reason: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def main() -> None:
        ports = mesh(["n1", "n2"])
        good = "n2" if rogue == "n1" else "n1"
        nodes = [tls_node(good, ports, pki), tls_node(rogue, ports, pki, cert="rogue")]
        await started(*nodes)
        try:
            await wait_until(lambda: any(reason in r.getMessage() for r in caplog.records))
            await asyncio.sleep(0.2)
            assert all(n.events == [] for n in nodes)
        finally:
            await closed(*nodes)
    asyncio.run(main())


def test_plain_tcp_to_a_tls_port_is_refused(pki: dict[str, Path],
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def main() -> None:
        ports = mesh(["n1", "n2"])
        (n2,) = await started(tls_node("n2", ports, pki))
        try:
            await dial_as(ports["n2"])
            await wait_until(lambda: any("TLS handshake failed" in r.getMessage()
                                         for r in caplog.records))
            assert n2.events == []
        finally:
            await closed(n2)
    asyncio.run(main())

