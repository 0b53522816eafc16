"""Drive a ServerConnection with real frames and read what it answers (no sockets)."""

from __future__ import annotations

import asyncio
from typing import Any

from pamqp import body as pbody
from pamqp import commands, frame, header, heartbeat

from brokerha.amqp.connection import ServerConnection
from brokerha.broker.broker import Broker, Limits

PLAIN_GUEST = "\x00guest\x00guest"


def make_broker(**limits: Any) -> Broker:
    loop_tasks: list[Any] = []

    def spawn(work: Any, on_done: Any) -> None:
        # run the coroutine to completion right away (tests drive time themselves)
        loop_tasks.append(work)
        try:
            asyncio.run(_await(work))
        except Exception as exc:  # reported like the node does
            on_done(exc)
        else:
            on_done(None)

    broker = Broker("test", limits=Limits(**limits), spawn=spawn)
    broker.add_vhost("/")
    broker.users.add_user("guest", "guest")
    broker.users.set_permissions("guest", "/")
    return broker


async def _await(work: Any) -> Any:
    return await work


class Wire:
    """A fake client: encodes frames with pamqp, decodes the server's output."""

    def __init__(self, broker: Broker | None = None, peer: str = "127.0.0.1") -> None:
        self.broker = broker or make_broker()
        self.conn = ServerConnection(self.broker, peer=(peer, 40000), now=0.0)
        self.now = 0.0
        self._pending = b""

    # sending
    def raw(self, data: bytes) -> None:
        self.conn.receive_data(data, self.now)

    def method(self, channel: int, method: Any) -> None:
        self.raw(frame.marshal(method, channel))

    def content(self, channel: int, body: bytes,
                properties: commands.Basic.Properties | None = None) -> None:
        props = properties or commands.Basic.Properties()
        data = frame.marshal(header.ContentHeader(0, len(body), props), channel)
        if body:
            data += frame.marshal(pbody.ContentBody(body), channel)
        self.raw(data)

    def publish(self, channel: int, exchange: str, routing_key: str, body: bytes,
                properties: commands.Basic.Properties | None = None,
                mandatory: bool = False) -> None:
        self.method(channel, commands.Basic.Publish(exchange=exchange, routing_key=routing_key,
                                                    mandatory=mandatory))
        self.content(channel, body, properties)

    # receiving
    def frames(self) -> list[tuple[int, Any]]:
        """Every frame the server produced since the last call, decoded."""
        data = self._pending + self.conn.data_to_send()
        out: list[tuple[int, Any]] = []
        while data:
            if data.startswith(b"AMQP"):
                out.append((0, data[:8]))
                data = data[8:]
                continue
            try:
                used, channel, value = frame.unmarshal(data)
            except Exception:
                break
            out.append((channel, value))
            data = data[used:]
        self._pending = data
        return out

    def methods(self) -> list[Any]:
        return [v for _, v in self.frames() if not isinstance(v, (header.ContentHeader,
                                                                  pbody.ContentBody,
                                                                  heartbeat.Heartbeat))]

    def expect(self, cls: type) -> Any:
        got = self.methods()
        matches = [m for m in got if isinstance(m, cls)]
        assert matches, f"expected {cls.__name__}, got {got}"
        return matches[-1]

    # scenarios
    def handshake(self, user: str = "guest", password: str = "guest", vhost: str = "/",
                  heartbeat_s: int = 0, frame_max: int = 131072,
                  capabilities: dict[str, Any] | None = None) -> None:
        self.raw(b"AMQP\x00\x00\x09\x01")
        self.expect(commands.Connection.Start)
        caps = capabilities if capabilities is not None else {
            "authentication_failure_close": True, "consumer_cancel_notify": True,
            "connection.blocked": True, "publisher_confirms": True}
        self.method(0, commands.Connection.StartOk(
            client_properties={"product": "wire", "capabilities": caps},
            mechanism="PLAIN", response=f"\x00{user}\x00{password}", locale="en_US"))
        tune = self.methods()
        if not any(isinstance(m, commands.Connection.Tune) for m in tune):
            self.last = tune
            return
        self.method(0, commands.Connection.TuneOk(channel_max=2047, frame_max=frame_max,
                                                  heartbeat=heartbeat_s))
        self.method(0, commands.Connection.Open(virtual_host=vhost))
        self.last = self.methods()

    def open_channel(self, channel: int = 1) -> None:
        self.method(channel, commands.Channel.Open())
        self.expect(commands.Channel.OpenOk)

    def connected(self, channel: int = 1) -> Wire:
        self.handshake()
        assert any(isinstance(m, commands.Connection.OpenOk) for m in self.last), self.last
        self.open_channel(channel)
        return self
