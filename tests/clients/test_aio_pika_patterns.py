"""aio-pika's RPC and JSON-RPC patterns against a node: create, call, close.

Their close() unbinds and deletes what they declared, some of it auto-deleted
already; with an unbind that answered 404 for what was gone, every close()
failed (RabbitMQ's unbind is idempotent, and so is brokerha's now).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from brokerha.testing import NodeProcess

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with NodeProcess("patterns") as node:
        yield node.url


async def multiply(*, x: int, y: int) -> int:
    return x * y


@pytest.mark.parametrize("pattern", ["RPC", "JsonRPC"])
def test_rpc_pattern_create_call_close(url: str, pattern: str) -> None:
    import aio_pika
    from aio_pika import patterns

    async def run() -> None:
        connection = await aio_pika.connect(url)
        try:
            cls = getattr(patterns, pattern)
            for _ in range(2):  # close() must leave nothing behind that a new one trips on
                server_channel = await connection.channel()
                server = await cls.create(server_channel)
                await server.register("multiply", multiply, auto_delete=True)
                client_channel = await connection.channel()
                client = await cls.create(client_channel)
                assert await client.proxy.multiply(x=6, y=7) == 42
                results = await asyncio.gather(*(client.call("multiply", kwargs={"x": i, "y": 2})
                                                 for i in range(20)))
                assert results == [2 * i for i in range(20)]
                await client.close()
                await server.close()
                assert not client_channel.is_closed and not server_channel.is_closed
                await client_channel.close()
                await server_channel.close()
        finally:
            await connection.close()

    asyncio.run(run())
