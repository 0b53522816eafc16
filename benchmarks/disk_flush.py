"""Disk flushes on this machine: one writer, and several at once (as the nodes of a local cluster).

Each writer appends 12 KB (about one transaction of 10 x 1 KiB messages in
the store's operation log) to its own file and ``fdatasync``s it, over and
over. With one writer this is the cost of one commit's durability; with
three it is what a 3-node cluster on one machine pays, since all three nodes
sync every commit onto the same device. On the virtual disk here the device
completes about the same number of flushes per second whatever the number of
writers, so each writer's flushes take as many times longer: the nodes of a
local cluster wait for each other's disk syncs, which nodes on their own
machines would not (docs/benchmarks.md, "HA transactions").

    .venv/bin/python benchmarks/disk_flush.py --writers 1,2,3 --duration 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence

RECORD = 12_000
FILE_BYTES = 8 << 20  # the operation log's file size: written over, like the log


def writer(path: str, duration: float, out: list[list[float]]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    data = b"x" * RECORD
    latencies: list[float] = []
    offset = 0
    try:
        end = time.monotonic() + duration
        while time.monotonic() < end:
            os.pwrite(fd, data, offset)
            offset = (offset + RECORD) % FILE_BYTES
            start = time.perf_counter()
            os.fdatasync(fd)  # releases the GIL: the writers' syncs overlap
            latencies.append(time.perf_counter() - start)
    finally:
        os.close(fd)
    out.append(latencies)


def run(writers: int, duration: float, directory: str) -> tuple[float, float, float]:
    """(flushes/s over all writers, mean µs per flush, p99 µs per flush)."""
    results: list[list[float]] = []
    threads = [threading.Thread(target=writer, args=(os.path.join(directory, f"w{i}"), duration,
                                                     results)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = sorted(x for r in results for x in r)
    p99 = every[min(len(every) - 1, int(len(every) * 0.99))]
    return len(every) / duration, statistics.fmean(every) * 1e6, p99 * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", default="1,2,3", help="comma-separated writer counts")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary "
                        "directory beside the project, on the disk the nodes use)")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.writers.split(",")]
    base = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    table: dict[int, list[tuple[float, float, float]]] = {c: [] for c in counts}
    with tempfile.TemporaryDirectory(prefix=".disk-flush-", dir=base) as directory:
        for _ in range(args.rounds):
            for count in counts:
                table[count].append(run(count, args.duration, directory))
    one = statistics.median(r[1] for r in table[counts[0]])
    print(f"fdatasync of {RECORD} B appends, {args.duration:g} s x {args.rounds} rounds "
          f"(medians)\n")
    print("| writers | flushes/s (all) | mean µs per flush | p99 µs | vs 1 writer |")
    print("|---|---|---|---|---|")
    for count in counts:
        rate = statistics.median(r[0] for r in table[count])
        mean = statistics.median(r[1] for r in table[count])
        p99 = statistics.median(r[2] for r in table[count])
        print(f"| {count} | {rate:,.0f} | {mean:,.0f} | {p99:,.0f} | {mean / one:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
