"""``brokerha cluster simulate``: many seeds of a simulation workload, over every core.

``--workload confirms`` (the default, ``confirms.py``) is a client publishing
with confirms through elections and failovers; ``--workload transactions``
(``transactions.py``) is TX clients and an XA TM; ``--workload txlog``
(``txlog/simulation/datacenter.py``, registered by ``admin/cluster_cli.py``:
the TxLog sits above HA) is TX clients on a global queue of two datacenters,
the HA one running the TxLog bridge on its members; ``--workload heavy``
(``heavy.py``) is issue 33's heavy work without faults: deep queues, a backup
restarted behind them, a purge and slow operations, where the stability
invariant (f) must hold; ``--workload policy`` (``policy_change.py``) is the
confirms client while an operator changes its queue's ``ha-replicate`` (issue
34); ``--workload table`` (``partition/simulation.py``, registered by
``admin/cluster_cli.py``: the coordinator sits above HA) is the partition
table's ``TableCoordinator`` on every node while an operator drains nodes,
brings them back and marks learners caught up (issue 35); ``--workload groups``
(``partition/group_simulation.py``) is the confirms client of each partition on
nodes that run a replication group per partition cell (issue 35, stage 2);
``--workload forward`` (``partition/forward_simulation.py``) is clients on random nodes
of that world publishing with confirms to queues of one or two partitions, each
publish forwarded to its partitions' primaries (issue 35, stage 3's protocol core);
``--workload remote-consume`` (``partition/remote_consume_simulation.py``) is that world
with consumers on random nodes taking the messages from the partitions' primaries
(``partition/remote_consumer.py``: deliveries, settles, re-attaches after failovers). All of
these run the product's HA members on the harness of ``world.py``, with its cost
model. ``--workload xtx`` (``partition/xtx_simulation.py``) is apart: commits across
partitions (``partition/xtx.py``'s coordinators and decision rules) over partitions
modelled as logs that keep what was durable on their majority (issue 35, stage 4's
core), or with ``--on-brokers`` each partition's primary the product's broker with its
``BrokerTransactions`` over a simulated disk. ``--small-bounds`` (confirms, transactions) makes every commit slice, every
body go in parts and flushes split, with faults aimed at the middle of them.
``--unsliced-operations`` (heavy, transactions) runs each slow operation in
one step of the node's loop instead of slices: (f) must catch it, as
``--unsafe monolithic_catch_up`` (heavy). The run prints violations (with
the trace tail of each failing seed under ``--trace``), what the seeds
exercised, and seeds per second; it exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from brokerha import seed_runner
from brokerha.ha.simulation import confirms, heavy, policy_change, transactions
from brokerha.ha.simulation.world import Faults

# each workload module: CATCHES, Unsafe (with ``of(names)``), run_many, SimResult; and
# SLOW_OPERATIONS = True if it takes ``unsliced``
WORKLOADS: dict[str, ModuleType] = {"confirms": confirms, "transactions": transactions,
                                    "heavy": heavy, "policy": policy_change}


def register(parser: argparse.ArgumentParser,
             workloads: Mapping[str, ModuleType] = WORKLOADS) -> None:
    rules = sorted({rule for module in workloads.values() for rule in module.CATCHES})
    parser.add_argument("--workload", choices=sorted(workloads), default="confirms",
                        help="what the clients do (default confirms)")
    parser.add_argument("--seeds", type=int, default=1000, help="number of seeds (default 1000)")
    parser.add_argument("--start-seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--nodes", type=int, default=3,
                        help="nodes per datacenter (default 3; the transactions and txlog "
                        "workloads: 3)")
    parser.add_argument("--duration", type=float, default=None,
                        help="virtual seconds per seed (default 60, transactions, heavy, "
                        "txlog and table 30)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--no-faults", action="store_true", help="no network faults or crashes")
    parser.add_argument("--unsafe", nargs="+", action="extend", default=[], choices=rules,
                        metavar="RULE", help="break a rule of the product on purpose ("
                        + "; ".join(f"{name}: {', '.join(module.CATCHES)}"
                                    for name, module in workloads.items()) + ")")
    parser.add_argument("--unsliced-operations", action="store_true",
                        help="slow operations in one step of the loop, not in slices (the "
                        "workloads with slow operations: "
                        + ", ".join(n for n, m in workloads.items()
                                    if getattr(m, "SLOW_OPERATIONS", False)) + ")")
    parser.add_argument("--small-bounds", action="store_true",
                        help="every seed with the bounds of big work small (world.Bounds: "
                        "commits in slices, bodies in parts, flushes split; faults aimed at "
                        "them); the transactions workload does so in seeds 2 and 3 of every 4 "
                        "without it (workloads: "
                        + ", ".join(n for n, m in workloads.items()
                                    if getattr(m, "SMALL_BOUNDS", None) is not None) + ")")
    parser.add_argument("--on-brokers", action="store_true",
                        help="every partition's primary a Broker with BrokerTransactions over a "
                        "simulated disk, not a log (workloads: "
                        + ", ".join(n for n, m in workloads.items() if getattr(m, "ON_BROKERS", False))
                        + ")")
    parser.add_argument("--purge-rate", type=float, default=0.0,
                        help="the client's queue.purge a virtual second (the confirms "
                        "workload; default 0: none; local_purge is caught only with purges)")
    parser.add_argument("--trace", action="store_true", help="print the trace tail of failing seeds")
    parser.set_defaults(handler=simulate, workloads=workloads)


def simulate(args: argparse.Namespace) -> int:
    module = args.workloads[args.workload]
    wrong = [rule for rule in args.unsafe if rule not in module.CATCHES]
    if wrong:
        raise SystemExit(f"the {args.workload} workload cannot catch {', '.join(wrong)}")
    kw: dict[str, Any] = {"unsafe": module.Unsafe.of(args.unsafe)}
    if args.duration is not None:
        kw["duration"] = args.duration
    if args.no_faults:
        kw["faults"] = Faults.none()
    if args.unsliced_operations:
        if not getattr(module, "SLOW_OPERATIONS", False):
            raise SystemExit(f"the {args.workload} workload has no slow operations")
        kw["unsliced"] = True
    if args.small_bounds:
        if getattr(module, "SMALL_BOUNDS", None) is None:
            raise SystemExit(f"the {args.workload} workload has no small bounds")
        kw["small_bounds"] = True
    if args.on_brokers:
        if not getattr(module, "ON_BROKERS", False):
            raise SystemExit(f"the {args.workload} workload runs on no brokers")
        kw["brokers"] = "all"
    if args.purge_rate:
        if args.workload != "confirms":
            raise SystemExit(f"the {args.workload} workload does not purge")
        kw["purge_rate"] = args.purge_rate
    elif "local_purge" in args.unsafe:
        raise SystemExit("local_purge is caught only when the client purges: add --purge-rate")
    if args.workload in ("confirms", "heavy", "policy", "table", "groups", "forward",
                         "remote-consume"):
        kw["nodes"] = args.nodes
    elif args.nodes != 3:
        raise SystemExit(f"the {args.workload} workload runs 3 nodes")
    started = time.monotonic()
    results = module.run_many(range(args.start_seed, args.start_seed + args.seeds),
                              jobs=args.jobs, **kw)
    failing = seed_runner.report_failures(results, trace=args.trace)
    elapsed = time.monotonic() - started
    print(f"{args.workload}: seeds {len(results)}, violations {len(failing)}, "
          f"{summary(results)}, elapsed {elapsed:.1f}s ({len(results) / max(elapsed, 1e-9):.1f} "
          f"seeds/s over {args.jobs} processes)")
    return 1 if failing else 0


def summary(results: Sequence[Any]) -> str:
    if results and isinstance(results[0], confirms.SimResult):
        n = max(1, len(results))
        unserved = sum(r.unserved for r in results) / n
        stable = sum(r.stable for r in results) / n
        lapsed = sum(r.lapsed for r in results) / n
        longest = max(r.longest_step for r in results)
        work: Counter[str] = Counter()
        for r in results:
            work.update({k: v for k, v in r.work.items() if v})
        return (f"failovers {sum(r.failovers for r in results)}, confirmed "
                f"{sum(r.confirmed for r in results)}, unserved {unserved:.1f}s/seed, "
                f"stable {stable:.1f}s/seed (lapsed {lapsed * 1000:.0f} ms/seed), "
                f"longest step {longest:.3f}s"
                + "".join(f", {k} {v}" for k, v in sorted(work.items())))
    totals: Counter[str] = Counter()
    for r in results:
        totals.update(r.stats)
    stuck = sum(1 for r in results if r.stuck)
    return f"stuck {stuck}, " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="brokerha cluster simulate",
                                     description=__doc__.splitlines()[0])
    register(parser)
    return simulate(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
