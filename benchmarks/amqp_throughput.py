"""AMQP throughput of brokerha next to RabbitMQ, measured in the same run.

Starts a brokerha node (``brokerha.testing.NodeProcess``) unless
``--brokerha-url`` is given, and a private RabbitMQ node (``rabbitmq_ref``)
when Debian's rabbitmq-server is installed, unless ``--rabbitmq-url`` or
``--no-rabbitmq`` is given. Runs each workload against each broker back to
back, with each client:

- ``loadgen``: the light load generator of ``loadgen.py`` (pre-encoded frames
  on raw asyncio sockets) -- measures the broker;
- ``pika``: pika's BlockingConnection (``amqp_pika_client.py``) -- what an
  application sees, limited by pika's own CPU cost.

and prints msgs/s per broker, the ratio brokerha / RabbitMQ, and the CPU each
broker (and the client) spent per message during the measured window.

Examples::

    python benchmarks/amqp_throughput.py                      # everything, 5 s per run
    python benchmarks/amqp_throughput.py --workloads pipe --client loadgen --rounds 3
    python benchmarks/amqp_throughput.py --no-brokerha        # RabbitMQ only
    python benchmarks/amqp_throughput.py --tls --workloads pipe,confirm   # both over amqps
    python benchmarks/amqp_throughput.py --workloads pipe --client loadgen \\
        --no-rabbitmq --py-spy-brokerha /tmp/node-stacks.txt  # where the node's time goes
        (or --cprofile-brokerha /tmp/node.prof)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import amqp_pika_client
import loadgen
from amqp_profile import PySpy, make_node, summarize_cprofile, summarize_pyspy
from loadgen import WORKLOADS, Result
from rabbitmq_ref import RabbitMQRef, available

CLIENTS: dict[str, Callable[..., Result]] = {
    "loadgen": lambda url, workload, duration, warmup, *, on_window: asyncio.run(
        loadgen.run_workload(url, workload, duration, warmup, on_window=on_window)),
    "pika": amqp_pika_client.run_workload,
}
CLIENT_NOTES = {
    "loadgen": "light load generator: pre-encoded frames on raw asyncio sockets (measures the broker)",
    "pika": "pika BlockingConnection, consumer in a 2nd process (real client; limits the figures)",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")
PY_SPY_RATE = 250  # samples per second


# -- CPU accounting -----------------------------------------------------------------


def tree_cpu_times(root: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``root`` and its live descendants, from /proc."""
    parent: dict[int, int] = {}
    cpu: dict[int, tuple[float, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK)
    user = system = 0.0
    todo = [root]
    while todo:
        pid = todo.pop()
        u, s = cpu.get(pid, (0.0, 0.0))
        user, system = user + u, system + s
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return user, system


@dataclass
class Broker:
    name: str
    url: str
    pid: int | None = None  # for CPU accounting; None when it runs elsewhere

    def cpu_times(self) -> tuple[float, float]:
        return tree_cpu_times(self.pid) if self.pid else (math.nan, math.nan)

    def cpu(self) -> float:
        return sum(self.cpu_times())


@dataclass
class Measurement:
    broker: str
    workload: str
    client: str
    results: list[Result] = field(default_factory=list)
    broker_cpu_s: list[float | None] = field(default_factory=list)  # one per result
    errors: list[str] = field(default_factory=list)

    def median(self, value: Callable[[Result], float]) -> float | None:
        return statistics.median(value(r) for r in self.results) if self.results else None

    def messages(self, r: Result) -> float:
        return r.msgs_per_s * r.duration

    def broker_us_per_msg(self) -> float | None:
        per = [1e6 * c / max(1.0, self.messages(r))
               for c, r in zip(self.broker_cpu_s, self.results, strict=True) if c is not None]
        return statistics.median(per) if per else None

    def client_us_per_msg(self) -> float | None:
        return self.median(lambda r: 1e6 * r.client_cpu_s / max(1.0, self.messages(r)))


def measure(broker: Broker, workload: str, client: str, duration: float, warmup: float,
            into: Measurement) -> None:
    """One run; its result (or error) is appended to ``into``."""
    cpu: dict[str, float] = {}

    def on_window(edge: str) -> None:
        cpu[edge] = broker.cpu()

    print(f"  {broker.name:9} {workload:8} {client:8} ...", end="", flush=True)
    try:
        result = CLIENTS[client](broker.url, workload, duration, warmup, on_window=on_window)
    except Exception as exc:  # a broker that lacks a feature must not stop the other runs
        if _terminated:  # a client library swallowed our SIGTERM exception
            raise Terminated(143) from exc
        into.errors.append(f"{type(exc).__name__}: {exc}")
        print(f" error: {into.errors[-1]}", flush=True)
        return
    into.results.append(result)
    used = cpu.get("end", math.nan) - cpu.get("start", math.nan)
    into.broker_cpu_s.append(None if math.isnan(used) else used)
    extra = f", {result.commits_per_s:,.0f} commits/s" if result.commits else ""
    for count, what in ((result.nacked, "nacked"), (result.returned, "returned"),
                        (result.blocked_notices, "connection.blocked notices")):
        if count:
            extra += f" (WARNING: {count} {what})"
    print(f" {result.msgs_per_s:,.0f} msgs/s{extra}", flush=True)


def run_matrix(brokers: Sequence[Broker], workloads: Sequence[str], clients: Sequence[str],
               duration: float, warmup: float, rounds: int) -> list[Measurement]:
    """Every workload x client x broker; brokers alternate order between rounds."""
    table = {(b.name, w, c): Measurement(b.name, w, c)
             for w in workloads for c in clients for b in brokers}
    for w in workloads:
        for c in clients:
            for r in range(rounds):
                for b in (brokers if r % 2 == 0 else list(reversed(brokers))):
                    if _terminated:
                        raise Terminated(143)
                    measure(b, w, c, duration, warmup, table[b.name, w, c])
    return list(table.values())


# -- output -------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _cell(m: Measurement | None) -> str:
    if m is None:
        return "-"
    if not m.results:
        return "error" if m.errors else "-"
    rate = _fmt(m.median(lambda r: r.msgs_per_s))
    if WORKLOADS[m.workload].tx_size:
        rate += f" ({_fmt(m.median(lambda r: r.commits_per_s))} commits/s)"
    return rate


def format_table(measurements: Sequence[Measurement], brokers: Sequence[str]) -> str:
    """A Markdown table: one row per workload and client, one column per broker."""
    index = {(m.broker, m.workload, m.client): m for m in measurements}
    rows = sorted({(m.workload, m.client) for m in measurements},
                  key=lambda wc: (list(WORKLOADS).index(wc[0]), wc[1]))
    head = ["workload", "client", *(f"{b} msgs/s" for b in brokers)]
    ratio = "brokerha" in brokers and "RabbitMQ" in brokers
    if ratio:
        head.append("brokerha / RabbitMQ")
    head += [f"{b} CPU µs/msg" for b in brokers] + ["client CPU µs/msg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w, c in rows:
        ms = [index.get((b, w, c)) for b in brokers]
        cells = [w, c, *(_cell(m) for m in ms)]
        if ratio:
            rb, rr = index.get(("brokerha", w, c)), index.get(("RabbitMQ", w, c))
            vb = rb.median(lambda r: r.msgs_per_s) if rb else None
            vr = rr.median(lambda r: r.msgs_per_s) if rr else None
            cells.append(f"{vb / vr:.2f}×" if vb and vr else "-")
        cells += [_fmt(m.broker_us_per_msg() if m else None, ".1f") for m in ms]
        cells.append(" / ".join(_fmt(m.client_us_per_msg() if m else None, ".1f") for m in ms))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------


class Terminated(SystemExit):
    """SIGTERM: unwinds through every ``finally``, so everything we started is stopped."""


_terminated = False


def _raise_on_sigterm(signum: int, _frame: object) -> None:
    global _terminated
    _terminated = True
    raise Terminated(128 + signum)


def amqps_url(port: int, ca: Path) -> str:
    """guest over amqps on 127.0.0.1:``port``, the certificate checked against ``ca``; pika's
    ``ssl_options`` query parameter, which ``loadgen`` reads too."""
    opts = {"ca_certs": str(ca), "server_hostname": "localhost"}
    return f"amqps://guest:guest@127.0.0.1:{port}/%2F?ssl_options={quote(repr(opts))}"


def make_certs(stack: ExitStack) -> Path:
    """A CA and a ``server`` certificate (localhost, 127.0.0.1) in a temporary directory."""
    import tempfile

    from brokerha.certs import make_certs as make

    d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="amqps-bench-")))
    make(d, ["server"], [])
    return d


def start_brokers(args: argparse.Namespace, stack: ExitStack) -> list[Broker]:
    """The brokers to measure; what is started here is stopped when ``stack`` closes."""
    brokers: list[Broker] = []
    certs = make_certs(stack) if args.tls else None
    if args.rabbitmq_url:
        brokers.append(Broker("RabbitMQ", args.rabbitmq_url, args.rabbitmq_pid))
    elif not args.no_rabbitmq:
        if available():
            print("starting a private RabbitMQ node ...", flush=True)
            ref = RabbitMQRef(tls=None if certs is None else
                              (certs / "server.pem", certs / "server.key", certs / "ca.pem"))
            url = stack.enter_context(ref)
            assert ref.server is not None
            if certs is not None:
                assert ref.ssl_port is not None
                url = amqps_url(ref.ssl_port, certs / "ca.pem")
            brokers.append(Broker("RabbitMQ", url, ref.server.pid))
        else:
            print("rabbitmq-server is not installed: brokerha only", flush=True)
    if args.brokerha_url:
        brokers.append(Broker("brokerha", args.brokerha_url, args.brokerha_pid))
    elif not args.no_brokerha:
        print("starting a brokerha node ...", flush=True)
        node = make_node("amqp-bench", args.cprofile_brokerha)
        if args.brokerha_store:
            store = args.brokerha_store
            if store == "pg":
                from brokerha.testing_postgres import create_database, throwaway_server

                print("starting a throwaway PostgreSQL server ...", flush=True)
                server = stack.enter_context(throwaway_server())
                store = create_database(server, "amqp_bench")
            node.extra_args += ["--store", store]
        url = node.url
        if certs is not None:
            from brokerha.testing import free_port

            port = free_port()
            node.extra_args += ["--amqps-listen", f"127.0.0.1:{port}",
                                "--tls-cert", str(certs / "server.pem"),
                                "--tls-key", str(certs / "server.key")]
            url = amqps_url(port, certs / "ca.pem")
        stack.enter_context(node)
        assert node.proc is not None
        brokers.append(Broker("brokerha", url, node.proc.pid))
    return brokers


def start_py_spy(args: argparse.Namespace, brokers: Sequence[Broker],
                 stack: ExitStack) -> PySpy | None:
    """py-spy on the brokerha node; entered after the node, so it stops before the node."""
    if not args.py_spy_brokerha:
        return None
    brokerha = next((b for b in brokers if b.name == "brokerha"), None)
    if brokerha is None or brokerha.pid is None:
        raise SystemExit("--py-spy-brokerha needs a brokerha node started here or --brokerha-pid")
    return stack.enter_context(
        PySpy(brokerha.pid, args.py_spy_brokerha, PY_SPY_RATE, cpu=brokerha.cpu_times))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each run")
    p.add_argument("--rounds", type=int, default=1, help="runs per cell; the median is shown")
    p.add_argument("--workloads", default="pipe,confirm,tx",
                   help=f"comma-separated, of {','.join(WORKLOADS)}")
    p.add_argument("--client", choices=["loadgen", "pika", "both"], default="both")
    p.add_argument("--brokerha-url", help="use this broker instead of starting a brokerha node")
    p.add_argument("--brokerha-pid", type=int, help="its PID, for CPU per message")
    p.add_argument("--no-brokerha", action="store_true", help="measure RabbitMQ only")
    p.add_argument("--brokerha-store", metavar="URL",
                   help="run the brokerha node with --store URL; 'pg' starts a throwaway "
                        "PostgreSQL server (brokerha.testing_postgres) for it")
    p.add_argument("--rabbitmq-url", help="use this RabbitMQ instead of starting one")
    p.add_argument("--rabbitmq-pid", type=int, help="its PID, for CPU per message")
    p.add_argument("--no-rabbitmq", action="store_true")
    p.add_argument("--cprofile-brokerha", type=Path, metavar="FILE.prof",
                   help="run the brokerha node under cProfile, write the stats here")
    p.add_argument("--py-spy-brokerha", type=Path, metavar="FILE.txt",
                   help="sample the brokerha node with py-spy, write raw stacks here")
    p.add_argument("--tls", action="store_true",
                   help="both brokers over amqps (TLS 1.2+, server certificate only, made "
                        "by brokerha.certs); the clients connect with TLS")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write all results as JSON")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    if args.duration <= 0 or args.duration > 120 or not 1 <= args.rounds <= 10:
        p.error("keep runs bounded: 0 < --duration <= 120 and 1 <= --rounds <= 10")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    loadgen.selftest()
    clients = ["loadgen", "pika"] if args.client == "both" else [args.client]
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    with ExitStack() as stack:
        brokers = start_brokers(args, stack)
        py_spy = start_py_spy(args, brokers, stack)
        if not brokers:
            print("no broker to measure", file=sys.stderr)
            return 2
        print(f"measuring {len(args.workloads)} workloads x {len(clients)} clients x "
              f"{len(brokers)} brokers, {args.duration:g} s each (+{args.warmup:g} s warm-up)",
              flush=True)
        t0 = time.monotonic()
        measurements = run_matrix(brokers, args.workloads, clients,
                                  args.duration, args.warmup, args.rounds)
        elapsed = time.monotonic() - t0
    # the brokers are stopped here (the profile is written when the node exits)
    names = [b.name for b in brokers]
    print(f"\n{'amqps' if args.tls else 'AMQP'} throughput, 1 KiB bodies, median of "
          f"{args.rounds} run(s) of "
          f"{args.duration:g} s ({elapsed:.0f} s in all); {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}")
    for c in clients:
        print(f"  {c}: {CLIENT_NOTES[c]}")
    print()
    print(format_table(measurements, names))
    errors = [(m, e) for m in measurements for e in m.errors]
    for m, e in errors:
        print(f"error: {m.broker} {m.workload} {m.client}: {e}")
    delivered = sum(r.total_delivered for m in measurements if m.broker == "brokerha"
                    for r in m.results)
    if args.cprofile_brokerha and args.cprofile_brokerha.exists():
        print("\n" + summarize_cprofile(args.cprofile_brokerha, delivered))
    if py_spy is not None and py_spy.out.exists():
        print("\n" + summarize_pyspy(py_spy.out, PY_SPY_RATE, delivered, py_spy.cpu_times))
    if args.json:
        args.json.write_text(json.dumps([
            {"broker": m.broker, "workload": m.workload, "client": m.client,
             "results": [r.to_dict() for r in m.results], "broker_cpu_s": m.broker_cpu_s,
             "errors": m.errors} for m in measurements], indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
