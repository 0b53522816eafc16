"""TX commits/s with many publishers at once: brokerha vs RabbitMQ in the same run.

Each publisher is the load generator's ``tx`` workload (tx.select; 10
persistent 1 KiB publishes + tx.commit; wait for commit-ok; repeat) on its own
connection and queue. With one publisher a commit costs one disk sync in both
brokers; with several, brokerha's store commits what all of them sent in one
database transaction (group commit), so commits/s should grow with them.

    python benchmarks/tx_channels.py --publishers 1,4,16 --duration 4

``--txlog`` adds a third broker: a brokerha node with a ``[txlog]`` section (a
lone master, no peers) and no global queue. Its transactions touch no global
queue, so they keep the one-round-trip commit: its figure should be within noise
of the plain node's (the ``txlog / plain`` column).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import loadgen
from rabbitmq_ref import RabbitMQRef, available

from brokerha.testing import NodeProcess, free_port


async def parallel_tx(url: str, publishers: int, duration: float, warmup: float) -> float:
    """Commits per second summed over ``publishers`` concurrent tx workloads."""
    results = await asyncio.gather(*(
        loadgen.run_workload(url, "tx", duration, warmup) for _ in range(publishers)))
    return sum(r.commits_per_s for r in results)


def txlog_node(stack: ExitStack) -> NodeProcess:
    """A node whose ``[txlog]`` section runs a lone master (no peers, no global queue)."""
    root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="txbench-txlog-")))
    (root / "secret").write_text("bench-secret\n")
    cfg = root / "node.toml"
    cfg.write_text(f'[txlog]\nnode-id = "dc1"\nmaster-url = "txlog://127.0.0.1:{free_port()}"\n'
                   f'group = "bench"\nsecret-file = "secret"\n')
    return NodeProcess("txbench-txlog", data_dir=root / "data",
                       extra_args=["--config", str(cfg)])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--publishers", default="1,4,16")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--no-rabbitmq", action="store_true")
    p.add_argument("--txlog", action="store_true",
                   help="also a node with [txlog] (no global queue): should match the plain one")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.publishers.split(",")]
    with ExitStack() as stack:
        brokers = {"brokerha": stack.enter_context(NodeProcess("txbench")).url}
        if args.txlog:
            brokers["brokerha+txlog"] = stack.enter_context(txlog_node(stack)).url
        if not args.no_rabbitmq and available():
            brokers["RabbitMQ"] = stack.enter_context(RabbitMQRef())
        rows = []
        for n in counts:
            figures = {name: asyncio.run(parallel_tx(url, n, args.duration, args.warmup))
                       for name, url in brokers.items()}
            rows.append((n, figures))
            print(f"  {n:>3} publishers: " + ", ".join(
                f"{name} {v:,.0f} commits/s" for name, v in figures.items()), flush=True)
    names = list(brokers)
    ratios = [(label, num, den) for label, num, den in (
        ("brokerha / RabbitMQ", "brokerha", "RabbitMQ"),
        ("txlog / plain", "brokerha+txlog", "brokerha")) if num in names and den in names]
    print("\n| publishers | " + " | ".join(f"{n} commits/s" for n in names)
          + "".join(f" | {label}" for label, _, _ in ratios) + " |")
    print("|---" * (len(names) + 1 + len(ratios)) + "|")
    for n, figures in rows:
        cells = [f"{figures[name]:,.0f}" for name in names]
        cells += [f"{figures[num] / max(figures[den], 1e-9):.2f}×" for _, num, den in ratios]
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
