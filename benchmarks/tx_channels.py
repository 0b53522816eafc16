"""TX commits/s with many publishers at once: brokerha vs RabbitMQ in the same run.

Each publisher is the load generator's ``tx`` workload (tx.select; 10
persistent 1 KiB publishes + tx.commit; wait for commit-ok; repeat) on its own
connection and queue. With one publisher a commit costs one disk sync in both
brokers; with several, brokerha's store commits what all of them sent in one
database transaction (group commit), so commits/s should grow with them.

    python benchmarks/tx_channels.py --publishers 1,4,16 --duration 4
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from contextlib import ExitStack

import loadgen
from rabbitmq_ref import RabbitMQRef, available

from brokerha.testing import NodeProcess


async def parallel_tx(url: str, publishers: int, duration: float, warmup: float) -> float:
    """Commits per second summed over ``publishers`` concurrent tx workloads."""
    results = await asyncio.gather(*(
        loadgen.run_workload(url, "tx", duration, warmup) for _ in range(publishers)))
    return sum(r.commits_per_s for r in results)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--publishers", default="1,4,16")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--no-rabbitmq", action="store_true")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.publishers.split(",")]
    with ExitStack() as stack:
        brokers = {"brokerha": stack.enter_context(NodeProcess("txbench")).url}
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
    print("\n| publishers | " + " | ".join(f"{n} commits/s" for n in names)
          + (" | brokerha / RabbitMQ |" if "RabbitMQ" in names else " |"))
    print("|---" * (len(names) + 1 + ("RabbitMQ" in names)) + "|")
    for n, figures in rows:
        cells = [f"{figures[name]:,.0f}" for name in names]
        if "RabbitMQ" in figures:
            cells.append(f"{figures['brokerha'] / max(figures['RabbitMQ'], 1e-9):.2f}×")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
