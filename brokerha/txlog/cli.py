"""``brokerha txlog …``: the deterministic simulation, a master process, and its ctl.

``brokerha txlog node --config FILE`` runs one TxLog master in the foreground
(:mod:`brokerha.txlog.master.node`); ``brokerha txlog ctl --node URL …`` acts on a
running one (:mod:`brokerha.txlog.master.ctl`).

``brokerha txlog simulate --seeds N`` prints exactly one summary line
``seeds: N, violations: V`` (then, if V > 0, the first failing seed and its
trace) and exits non-zero on any violation, so CI can run it as is; a failing
seed is reproduced with ``--seeds 1 --start-seed S``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

from brokerha.txlog.engine.config import ConfigError, SplitRecovery
from brokerha.txlog.engine.rules import RULE_NAMES, Rules
from brokerha.txlog.master.export import export, source_for
from brokerha.txlog.simulation.faults import PROFILES, run_seed
from brokerha.txlog.simulation.search import params_for, run_parallel
from brokerha.txlog.simulation.simulation import SimResult, Simulation


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="txlog_command", metavar="SUBCOMMAND", required=True)
    sim = sub.add_parser("simulate", help="run the deterministic TxLog simulation over many seeds")
    sim.add_argument("--seeds", type=int, required=True, help="number of seeds to run")
    sim.add_argument("--start-seed", type=int, default=0, help="first seed (default 0)")
    sim.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                     help="processes to spread the seeds over (default: every core)")
    sim.add_argument("--masters", type=int, choices=(3, 4, 5), help="masters per seed (default: 3-5 by seed)")
    sim.add_argument("--export", type=Path, metavar="DIR", help="write the last seed's Parquet exports here")
    sim.add_argument(
        "--unsafe",
        nargs="+",
        action="extend",
        default=[],
        choices=(*RULE_NAMES, "all"),
        metavar="RULE",
        help=f"turn safety rules off ({', '.join(RULE_NAMES)}, all) to reproduce the seed's literal protocol",
    )
    sim.add_argument("--strategy", type=_strategy, help="none|simple|smart (default: all three in turn)")
    sim.add_argument("--profile", choices=sorted(PROFILES), default="mixed", help="fault profile")
    sim.set_defaults(handler=simulate)
    node = sub.add_parser("node", help="run one TxLog master in the foreground (real processes)")
    node.add_argument("--config", type=Path, required=True, metavar="FILE", help="TOML file")
    node.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    node.set_defaults(handler=run_node)
    from brokerha.txlog.master import ctl

    ctl.register(sub)


def run_node(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from brokerha.txlog.master import node, settings

    try:
        master = settings.load(args.config)
    except (ConfigError, OSError) as exc:
        print(f"brokerha txlog node: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=(args.log_level or master.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(node.serve(master))


def _strategy(value: str) -> SplitRecovery:
    try:
        return SplitRecovery.parse(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def force_split(sim: Simulation) -> None:
    """Cut one master from the others for longer than MaxPeerLag, so the seed splits and rejoins."""
    ids = sorted(sim.masters)
    lonely, rest = ids[-1], ids[:-1]
    pairs = {(lonely, m) for m in rest} | {(m, lonely) for m in rest}
    start = 300
    end = start + 2 * sim.params.max_peer_lag_ms
    sim.at(start, lambda: sim.net.cut(pairs))
    sim.at(end, lambda: sim.net.faults.cut.difference_update(pairs))
    for m in ids:
        sim.at(start + 200, functools.partial(sim.transaction, m))
        sim.at(end - 300, functools.partial(sim.transaction, m))


def simulate(args: argparse.Namespace) -> int:
    rules = Rules.without(args.unsafe)
    seeds = range(args.start_seed, args.start_seed + args.seeds)
    started = time.monotonic()
    # every seed over the cores; the exported one (the last, with a forced split) here
    spread = seeds[:-1] if args.export else seeds
    outcomes = run_parallel(spread, jobs=args.jobs, rules=rules, masters=args.masters,
                            strategy=args.strategy, profile=args.profile)
    failing = [o.seed for o in outcomes if o.violation]
    last: SimResult | None = None
    if args.export:
        last = run_seed(seeds[-1], params_for(seeds[-1], args.masters, args.strategy), rules,
                        args.profile, force_split)
        if last.violation:
            failing.append(last.seed)
    elapsed = time.monotonic() - started
    print(f"seeds: {args.seeds}, violations: {len(failing)}, {elapsed:.1f}s "
          f"({args.seeds / max(elapsed, 1e-9):.0f} seeds/s over {args.jobs} processes)")
    if failing:  # its trace, from a run here (the workers return outcomes only)
        seed = failing[0]
        first = run_seed(seed, params_for(seed, args.masters, args.strategy), rules,
                         args.profile, force_split if last is not None and seed == last.seed
                         else None)
        print(f"first failing seed: {first.seed} ({first.violation})")
        print("\n".join(first.trace[-60:]))
    if args.export and last is not None:
        for name, master in last.masters.items():
            source = source_for(master.durable, master.engine, master.events, name)
            export(source, args.export, exported_ms=last.ended_ms + master.offset_ms)
    return 1 if failing else 0
