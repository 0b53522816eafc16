"""The Jepsen-style partition run, at any length: a table of what was committed and what was lost.

Three nodes in network namespaces of their own (``tests/netns.py``), the
shipped election timing, two pika publishers with all three URLs, faults by
iptables DROP inside the namespaces one after another (``tests/jepsen.py``:
the primary cut from both backups but not from the clients; one backup cut
from everyone; n1 <-> n3; the primary's links flapping every 1-2 s; the
primary's packets delayed 150 ms +- 50 ms with 2 % loss), the cluster
settled after each, then a drain compared with every commit-ok or confirm.
Needs root, ``ip`` and ``iptables`` (``scripts/ensure-iptables``); creates
and removes its own namespaces, bridge and rules.

    # one round in tx mode, each fault held 8 s (about 2 minutes)
    .venv/bin/python benchmarks/partition.py --mode tx --hold 8

    # what the issue asked: three runs in a row of each mode, three rounds each
    for seed in 1 2 3; do .venv/bin/python benchmarks/partition.py --mode tx \\
        --hold 8 --rounds 3 --seed $seed; done

The table: transactions committed (or messages confirmed), lost (committed
but not drained; whole transactions) and partial (committed, some of their
messages missing), duplicates, and, for diagnosis, the answers per node that
served them with what that node's own ``/api/status`` said around each
answer ("answers from a non-primary node": commit-oks or confirms from a
node that said it was not the serving primary, issue 32's signature), the
lost ones by node, by the fault they were answered in, and the wall-clock
window to look for in the node logs (``--logs DIR`` keeps each node's last
2,000 lines). Exits 1 if anything committed was lost or a transaction is
partial, 2 if it cannot run here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import jepsen  # noqa: E402
from tests.netns import NamespacedCluster, available  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["tx", "confirm"], default="tx")
    parser.add_argument("--hold", type=float, default=8.0, help="seconds each fault is held")
    parser.add_argument("--rounds", type=int, default=1, help="times through the five faults")
    parser.add_argument("--publishers", type=int, default=2,
                        help="publishers that keep their connection until it fails")
    parser.add_argument("--churn", type=int, default=3,
                        help="publishers that reconnect every 3 transactions")
    parser.add_argument("--faults", default=",".join(jepsen.FAULTS),
                        help=f"comma-separated, in order (default: all of {jepsen.FAULTS})")
    parser.add_argument("--batch", type=int, default=10, help="messages per transaction")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pause-phase", type=float, default=2.0,
                        help="the stalls last this many times --hold")
    parser.add_argument("--settle", type=float, default=60.0,
                        help="seconds the cluster may take to settle after a heal")
    parser.add_argument("--logs", type=Path, help="write each node's log here (nI.log)")
    args = parser.parse_args(argv)
    why = available()
    if why is not None:
        print(f"partition: cannot run here: {why}", file=sys.stderr)
        return 2
    start = time.monotonic()

    def log(line: str) -> None:
        print(f"{time.monotonic() - start:7.1f}s {line}", flush=True)

    with NamespacedCluster(seed=args.seed) as cluster:
        report = jepsen.run(cluster, mode=args.mode, hold=args.hold, rounds=args.rounds,
                            publishers=args.publishers, churn=args.churn, batch=args.batch,
                            seed=args.seed, settle=args.settle, pause_phase=args.pause_phase,
                            faults=tuple(f for f in args.faults.split(",") if f), log=log)
        print(report.table() if args.logs else jepsen.describe(report, cluster))
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for name in cluster.names:
                (args.logs / f"{name}.log").write_text("\n".join(cluster.logs(name)) + "\n")
            print(f"node logs in {args.logs}")
    print(f"elapsed {time.monotonic() - start:.0f}s")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
