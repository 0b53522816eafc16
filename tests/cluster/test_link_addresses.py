"""A peer given as several addresses (the nodes of an HA datacenter): tried in turn.

Only the node running the TxLog master listens on its TxLog port, so a
dialer that names every node of that datacenter (``peer.N.url = "txlog://a,
txlog://b, txlog://c"``) must skip the refusing ones, and move on when the
listening node goes away and another one starts listening.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from brokerha.cluster.link import ClusterLinks
from brokerha.cluster.messages import Message

pytestmark = pytest.mark.timeout(30)

SECRET = b"0123456789abcdef0123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until(check: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def links(me: str, peers: dict[str, Any], listen: int, up: list[str]) -> ClusterLinks:
    def on_message(peer: str, msg_id: int, msg: Message) -> None:
        pass

    return ClusterLinks("g", me, peers, ("127.0.0.1", listen), SECRET, on_message,
                        lambda p: up.append(p), lambda p: None)


def test_the_dialer_finds_the_one_listening_node_and_follows_it_to_another() -> None:
    async def scenario() -> None:
        ports = [free_port() for _ in range(3)]
        up: list[str] = []
        dialer = links("dc1", {"dc2": [("127.0.0.1", p) for p in ports]}, free_port(), up)
        # dc2's master runs on its third node only
        third = links("dc2", {"dc1": ("127.0.0.1", 1)}, ports[2], [])
        await third.start()
        await dialer.start()
        try:
            await wait_until(lambda: dialer.connected("dc2"))
            # failover: the third node dies, the first one starts the master
            await third.close()
            await wait_until(lambda: not dialer.connected("dc2"))
            first = links("dc2", {"dc1": ("127.0.0.1", 1)}, ports[0], [])
            await first.start()
            try:
                await wait_until(lambda: dialer.connected("dc2"))
                assert up == ["dc2", "dc2"]
            finally:
                await first.close()
        finally:
            await dialer.close()

    asyncio.run(scenario())
