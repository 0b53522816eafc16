"""Agreement latency between real TxLog master processes, with injected WAN latency.

    PYTHONPATH=. .venv/bin/python -m tests.txlog.measure --one-way-ms 40 --tx 60

Three ``brokerha txlog node`` processes on loopback behind the delaying proxy
of ``tests/txlog/proxy.py``; transactions are submitted one DC after the other
(a few ms apart, so rounds overlap as in real traffic); agreement latency is
creation -> ordered in *every* DC's synchronised queue (one host, one clock),
also given in round trips.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tests.txlog.masters import running_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one-way-ms", type=float, default=40)
    parser.add_argument("--tx", type=int, default=60, help="transactions per DC")
    parser.add_argument("--gap-ms", type=float, default=50, help="between one DC's submissions")
    args = parser.parse_args()
    rtt = 2 * args.one_way_ms
    names = ["dc1", "dc2", "dc3"]
    keys = {"round-timeout": int(max(2 * rtt, 20)), "idle-interval": 1000, "max-peer-lag": 10000}
    with tempfile.TemporaryDirectory() as tmp, running_group(
            Path(tmp), names, one_way_ms=args.one_way_ms, **keys) as group:
        group["dc1"].tx("warm-up", wait="synchronised")
        ids: list[str] = []

        def load(name: str) -> None:
            for i in range(args.tx):
                ids.append(group[name].tx(f"{name}-{i}")["tx_id"])
                time.sleep(args.gap_ms / 1000)

        started = time.monotonic()
        threads = [threading.Thread(target=load, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        group.wait_converged(set(ids), timeout=60)
        elapsed = time.monotonic() - started
        ordered: dict[str, list[int]] = {}
        created: dict[str, int] = {}
        for name in names:
            for e in group[name].entries():
                ordered.setdefault(e["tx_id"], []).append(e["ordered_ms"])
                created[e["tx_id"]] = e["created_ms"]
        lat = sorted(max(ordered[t]) - created[t] for t in ids)
        p50, p99 = statistics.median(lat), lat[min(int(0.99 * len(lat)), len(lat) - 1)]
        def rtts(ms: float) -> str:
            return f" ({ms / rtt:.2f} RTT)" if rtt else ""

        print(f"3 masters, {args.one_way_ms:g} ms one way (RTT {rtt:g} ms), {len(ids)} tx "
              f"in {elapsed:.1f} s: agreement p50 {p50:.0f} ms{rtts(p50)}, "
              f"p99 {p99:.0f} ms{rtts(p99)}, max {lat[-1]} ms")


if __name__ == "__main__":
    main()
