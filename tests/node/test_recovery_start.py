"""A node recovers its store before it serves (issue 33: a big store takes seconds).

Recovery runs before anything listens, joins a cluster or holds a lease, so
its length stalls nobody; the GC's full collection and freeze of what was
recovered (``tune_gc``, 0.4 s at 1,000,000 messages) runs before the node
serves too (``Node.start``'s ``after_recovery``), and so does no later stall.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from pathlib import Path

from brokerha.node import config_from_args, register
from brokerha.node.server import Node
from brokerha.testing import free_base_port
from tests.store.harness import StoreNode, body, message


def test_the_node_serves_only_once_recovered_and_collected(tmp_path: Path) -> None:
    stored = StoreNode(f"sqlite:///{tmp_path / 'brokerha.db'}", oplog=True)
    q = stored.queue("deep")
    stored.call(lambda: [q.enqueue(message(body(i), rk="deep")) for i in range(500)])
    stored.sync()
    stored.close()
    parser = argparse.ArgumentParser()
    register(parser)
    port = free_base_port(1)
    cfg, _ = config_from_args(parser.parse_args(
        ["--name", "rec", "--listen", f"127.0.0.1:{port}", "--admin", "off",
         "--data", str(tmp_path)]))
    seen: dict[str, object] = {}

    async def run() -> None:
        node = Node(cfg)

        def recovered() -> None:
            seen["messages"] = node.broker.vhosts["/"].queues["deep"].message_count
            seen["listening"] = bool(node.servers)
            seen["gc enabled"] = gc.isenabled()
            seen["slices"] = node.broker.background.schedule is not None

        await node.start(after_recovery=recovered)
        seen["listening after"] = bool(node.servers)
        seen["slices after"] = node.broker.background.schedule is not None
        await node.stop()

    asyncio.run(run())
    assert seen == {"messages": 500, "listening": False, "gc enabled": True, "slices": False,
                    "listening after": True, "slices after": True}
