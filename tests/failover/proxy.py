"""A fault-injecting TCP proxy in front of each node's cluster port (network partitions).

Peers dial the proxy (``cluster`` in the configuration); the proxy forwards to
the node's real port (``cluster_bind``). It reads the dialer's name from the
``Identify`` packet of the handshake (plain TCP), so it can cut the links
between chosen pairs of nodes: ``Partition.isolate("n1")`` blocks every link
of n1 in both directions while the others keep talking; ``heal`` undoes it.
Runs its own event loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

from brokerha.cluster.protocol import MAGIC, Identify, PacketCodec


class TargetProxy:
    """Listens on one port and forwards to one node; drops links from blocked dialers."""

    def __init__(self, target_name: str, listen_port: int, target_port: int) -> None:
        self.target = target_name
        self.listen_port = listen_port
        self.target_port = target_port
        self.blocked: set[str] = set()  # dialer names whose links to ``target`` are cut
        self.links: list[tuple[str, asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.listen_port,
                                                 reuse_address=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            magic = await reader.readexactly(len(MAGIC))
            length = await reader.readexactly(4)
            body = await reader.readexactly(int.from_bytes(length, "big"))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        dialer = "?"
        try:
            (_, msg), = PacketCodec().feed(length + body)
            if isinstance(msg, Identify):
                dialer = msg.node
        except Exception:  # noqa: BLE001 - not our handshake: forward it untouched
            pass
        if self.cut(dialer):
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        up_writer.write(magic + length + body)
        self.links.append((dialer, writer, up_writer))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer),
                             return_exceptions=True)

    def cut(self, dialer: str) -> bool:
        return dialer in self.blocked or "*" in self.blocked

    def enforce(self) -> None:
        for dialer, a, b in list(self.links):
            if self.cut(dialer):
                a.transport.abort()
                b.transport.abort()
                self.links.remove((dialer, a, b))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()


class Partition:
    """One TargetProxy per node; cut and heal links between named nodes."""

    def __init__(self, routes: dict[str, tuple[int, int]]) -> None:
        """``routes``: node -> (proxy port peers dial, the node's real cluster port)."""
        self.loop = asyncio.new_event_loop()
        self.proxies = {name: TargetProxy(name, listen, target)
                        for name, (listen, target) in routes.items()}
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self._call(self._start())

    async def _start(self) -> None:
        for proxy in self.proxies.values():
            await proxy.start()

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def isolate(self, node: str) -> None:
        """Cut every link of ``node``: to it, and from it to everyone."""
        self.cut_between([node], [n for n in self.proxies if n != node])

    def cut_between(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        side_a, side_b = list(side_a), list(side_b)

        async def apply() -> None:
            for a in side_a:
                for b in side_b:
                    self.proxies[b].blocked.add(a)
                    self.proxies[a].blocked.add(b)
            for proxy in self.proxies.values():
                proxy.enforce()

        self._call(apply())

    def heal(self) -> None:
        async def apply() -> None:
            for proxy in self.proxies.values():
                proxy.blocked.clear()

        self._call(apply())

    def close(self) -> None:
        async def stop() -> None:
            for proxy in self.proxies.values():
                if proxy.server is not None:
                    proxy.server.close()
                proxy.blocked.add("*")
                proxy.enforce()

        self._call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
