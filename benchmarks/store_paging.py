"""Memory of a long durable queue with paging: the node's RSS per queued message.

Starts a ``brokerha node`` (SQLite store) with ``--queue-max-memory``,
publishes N persistent 1 KiB messages to one durable queue (pika, tx.commit
every 1000 messages, so each batch is durable before the next), and reports
the node's resident set size (VmRSS from /proc) when idle before publishing,
after publishing, after a restart on the same data directory, and after
draining the first 1000 messages (which reads paged bodies back). With
``--compare`` it also runs the same load without a limit.

Usage::

    .venv/bin/python benchmarks/store_paging.py                    # 1,000,000 messages
    .venv/bin/python benchmarks/store_paging.py -n 200000 --limit 16MiB --compare
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pika

from brokerha.node.config import parse_size
from brokerha.testing import NodeProcess

BODY = b"x" * 1024
TX_BATCH = 1000


def rss(node: NodeProcess) -> int:
    """The node process's resident set size in bytes."""
    assert node.proc is not None
    for line in Path(f"/proc/{node.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def settle(node: NodeProcess, seconds: float = 1.0) -> int:
    time.sleep(seconds)
    return rss(node)


def publish(node: NodeProcess, count: int) -> float:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    ch.queue_declare("paged", durable=True)
    ch.tx_select()
    props = pika.BasicProperties(delivery_mode=2)
    started = time.monotonic()
    for i in range(count):
        ch.basic_publish("", "paged", BODY, props)
        if (i + 1) % TX_BATCH == 0:
            ch.tx_commit()
    ch.tx_commit()
    elapsed = time.monotonic() - started
    depth = ch.queue_declare("paged", durable=True, passive=True).method.message_count
    assert depth == count, (depth, count)
    conn.close()
    return elapsed


def drain_some(node: NodeProcess, count: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(node.url))
    ch = conn.channel()
    for _ in range(count):
        method, _props, body = ch.basic_get("paged", auto_ack=True)
        assert method is not None and body == BODY
    conn.close()


def run(count: int, limit: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="brokerha-paging-") as data:
        args = ["--queue-max-memory", limit]
        node = NodeProcess("paging", data_dir=data, extra_args=args, ready_timeout=600).start()
        try:
            idle = settle(node)
            seconds = publish(node, count)
            loaded = settle(node, 2.0)
        finally:
            node.stop(120)
        node = NodeProcess("paging", data_dir=data, extra_args=args, ready_timeout=1800)
        started = time.monotonic()
        node.start()
        try:
            restart_seconds = time.monotonic() - started
            restarted = settle(node, 2.0)
            drain_some(node, min(count, 1000))
            drained = settle(node)
        finally:
            node.stop(120)
    limit_bytes = parse_size(limit, "limit")
    per_message = (loaded - idle - limit_bytes) / count if count else 0.0
    return {
        "messages": count, "limit": limit, "publish_msgs_per_s": round(count / seconds),
        "rss_idle_mib": round(idle / 2**20, 1), "rss_loaded_mib": round(loaded / 2**20, 1),
        "rss_restarted_mib": round(restarted / 2**20, 1),
        "rss_after_1000_gets_mib": round(drained / 2**20, 1),
        "restart_seconds": round(restart_seconds, 1),
        "bytes_per_message_beyond_limit": round(per_message),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--messages", type=int, default=1_000_000)
    parser.add_argument("--limit", default="16MiB", help="--queue-max-memory of the node")
    parser.add_argument("--compare", action="store_true", help="also run with no limit (0)")
    args = parser.parse_args()
    results = [run(args.messages, args.limit)]
    if args.compare:
        results.append(run(args.messages, "0"))
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
