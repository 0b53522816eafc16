"""A fault-injecting TCP proxy in front of each node's peer port: WAN latency and partitions.

Used for cluster ports (HA partitions, ``cluster_bind``) and TxLog ports (DC
splits). Peers dial the proxy of a node (the address in their
configuration) and the proxy forwards to the node's real port, delaying every
chunk by a fixed one-way latency in each direction (order preserved; 0 by
default). It reads the
dialer's name from the ``Identify`` packet of the cluster handshake, so it can
cut the links between named masters: ``isolate("dc3")`` cuts every link of
dc3 both ways, ``heal()`` lets the masters reconnect. A cut *aborts* the links
(each side gets an RST at once); a *stall* (``stall``, ``stall_between``)
stops forwarding without closing anything, as iptables DROP does: the links
stay open, bytes pile up in the socket buffers until the senders block, a new
link gets no answer to its handshake, and ``heal()`` lets everything held
through in order (TCP retransmitting after the rule is gone). Runs its own
event loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable

from brokerha.cluster.protocol import MAGIC, Identify, PacketCodec


class TargetProxy:
    def __init__(self, target: str, listen_port: int, target_port: int, delay_s: float) -> None:
        self.target = target
        self.listen_port = listen_port
        self.target_port = target_port
        self.delay_s = delay_s
        self.blocked: set[str] = set()
        self.stalled: set[str] = set()  # dialers whose links forward nothing (DROP)
        # (dialer, its end, the target's end, set while the link forwards)
        self.links: list[tuple[str, asyncio.StreamWriter, asyncio.StreamWriter,
                               asyncio.Event]] = []
        self.server: asyncio.Server | None = None

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
            ((_, msg),) = PacketCodec().feed(length + body)
            if isinstance(msg, Identify):
                dialer = msg.node
        except Exception:  # noqa: BLE001 - not the handshake: forward it untouched
            pass
        while self.stall(dialer) and not self.cut(dialer):  # DROP: the handshake hangs
            await asyncio.sleep(0.02)
        if self.cut(dialer) or writer.is_closing():
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        up_writer.write(magic + length + body)
        flowing = asyncio.Event()
        link = (dialer, writer, up_writer, flowing)
        self.links.append(link)
        self.enforce()  # stalled or cut meanwhile
        await asyncio.gather(self._pipe(reader, up_writer, flowing),
                             self._pipe(up_reader, writer, flowing),
                             return_exceptions=True)
        if link in self.links:
            self.links.remove(link)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    flowing: asyncio.Event) -> None:
        """Forward with a constant delay: a reader task stamps chunks, this one releases
        them; while ``flowing`` is clear neither reads nor writes (a stall)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            try:
                while True:
                    await flowing.wait()
                    data = await reader.read(65536)
                    if not data:
                        break
                    queue.put_nowait((time.monotonic() + self.delay_s, data))
            finally:
                queue.put_nowait((0.0, b""))

        task = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await flowing.wait()
                writer.write(data)
                await writer.drain()
        finally:
            task.cancel()
            writer.transport.abort()

    def cut(self, dialer: str) -> bool:
        return dialer in self.blocked or "*" in self.blocked

    def stall(self, dialer: str) -> bool:
        return dialer in self.stalled

    def enforce(self) -> None:
        for link in list(self.links):
            dialer, a, b, flowing = link
            if self.cut(dialer):
                a.transport.abort()
                b.transport.abort()
                flowing.set()  # the pipes see the abort and end
                self.links.remove(link)
            elif self.stall(dialer):
                flowing.clear()
            else:
                flowing.set()


class Partition:
    """One TargetProxy per master; cut and heal links between named masters."""

    def __init__(self, routes: dict[str, tuple[int, int]], one_way_ms: float = 0) -> None:
        """``routes``: master -> (proxy port peers dial, the master's real listen port)."""
        self.loop = asyncio.new_event_loop()
        self.proxies = {name: TargetProxy(name, listen, target, one_way_ms / 1000)
                        for name, (listen, target) in routes.items()}
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self._call(self._start())

    async def _start(self) -> None:
        for proxy in self.proxies.values():
            await proxy.start()

    def _call(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)  # type: ignore[arg-type]

    def isolate(self, master: str) -> None:
        self.cut_between([master], [m for m in self.proxies if m != master])

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

    def stall(self, master: str) -> None:
        """Every link of ``master`` stops forwarding both ways, without closing (DROP)."""
        self.stall_between([master], [m for m in self.proxies if m != master])

    def stall_between(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        side_a, side_b = list(side_a), list(side_b)

        async def apply() -> None:
            for a in side_a:
                for b in side_b:
                    self.proxies[b].stalled.add(a)
                    self.proxies[a].stalled.add(b)
            for proxy in self.proxies.values():
                proxy.enforce()

        self._call(apply())

    def heal(self) -> None:
        """Cut links may be dialled again; stalled ones forward what they held."""
        async def apply() -> None:
            for proxy in self.proxies.values():
                proxy.blocked.clear()
                proxy.stalled.clear()
                proxy.enforce()

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
