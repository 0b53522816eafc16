"""``brokerha cluster up | simulate``: a local datacenter on loopback, and the HA simulation.

``up`` writes ``DIR/cluster.toml`` (kept on later runs, so the shared secret
stays the same) and starts every node as its own OS process — so a single
node can be SIGKILLed — with ``brokerha node --config DIR/cluster.toml --name
nI --data DIR/nI``. It prints one AMQP URL per node, restarts nothing by
itself, and on SIGTERM/SIGINT stops the nodes it started (by PID). A node
killed by hand is started alone again with that same command; it rejoins as
a backup.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from brokerha.cluster.ports import ADMIN_OFFSET, CLUSTER_OFFSET, loopback_nodes_toml

TLS_TOML = """
[tls]                      # amqps: client certificates asked for, checked against the CA
cert = "tls/server.pem"
key = "tls/server.key"
ca = "tls/ca.pem"
verify_peer = true

[cluster.tls]              # the node-to-node links
cert = "tls/server.pem"
key = "tls/server.key"
ca = "tls/ca.pem"
"""


def cluster_file(data: Path, nodes: int, base_port: int, name: str, *,
                 tls: bool = False, partitions: int | None = None,
                 partition_groups: bool = False) -> Path:
    """DIR/cluster.toml for ``nodes`` nodes on loopback; an existing file is kept.

    ``tls``: certificates in DIR/tls (``brokerha tls make-certs``: a CA, the
    nodes' ``server`` certificate and a ``guest`` client certificate), an amqps
    listener per node and TLS on the node-to-node links.
    """
    data.mkdir(parents=True, exist_ok=True)
    path = data / "cluster.toml"
    if path.exists():
        if tls and "[tls]" not in path.read_text():
            raise SystemExit(f"{path} exists without TLS; remove it (and the nodes' data "
                             "directories if the ports change) to make one with --tls")
        return path
    if base_port + nodes - 1 + CLUSTER_OFFSET > 65535:
        raise SystemExit(f"--base-port {base_port}: ports up to {base_port + nodes - 1} + "
                         f"{CLUSTER_OFFSET} must be valid; use a base port below "
                         f"{65536 - CLUSTER_OFFSET - nodes}")
    secret = data / "secret"
    if not secret.exists():
        secret.write_text(secrets.token_hex(24) + "\n")
        secret.chmod(0o600)
    head = f'[cluster]\nname = "{name}"\nsecret_file = "secret"\n'
    if partitions is not None:  # the partition table's P (docs/ha.md "Partitions")
        head += f"partitions = {partitions}\n"
    if partition_groups:  # each node runs its partitions' groups (issue 35 stage 2)
        head += "partition_groups = true\n"
    lines = [head,
             *loopback_nodes_toml(nodes, base_port, amqps=tls)]
    if tls:
        from brokerha.certs import make_certs

        if not (data / "tls" / "server.pem").exists():
            make_certs(data / "tls", ["server"], ["guest"])
        lines.append(TLS_TOML)
    path.write_text("\n".join(lines))
    return path


def node_command(config: Path, name: str, data: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "brokerha.cli", "node", "--config", str(config),
            "--name", name, "--data", str(data / name), *extra]


def cmd_up(args: argparse.Namespace) -> int:
    data = args.data.resolve()
    config = cluster_file(data, args.nodes, args.base_port, args.cluster_name, tls=args.tls,
                          partitions=args.partitions, partition_groups=args.partition_groups)
    extra = ["--log-level", args.log_level] if args.log_level else []
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for i in range(args.nodes):
        name = f"n{i + 1}"
        (data / name).mkdir(parents=True, exist_ok=True)
        log = open(data / name / "node.log", "ab")  # noqa: SIM115 - owned by the child
        procs[name] = subprocess.Popen(node_command(config, name, data, extra), stdout=log,
                                       stderr=subprocess.STDOUT,
                                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
        log.close()
    print(f"cluster {args.cluster_name}: {args.nodes} nodes, configuration {config}", flush=True)
    for i, (name, proc) in enumerate(procs.items()):
        port = args.base_port + i
        amqps = f"amqps://127.0.0.1:{args.base_port + args.nodes + i}  " if args.tls else ""
        print(f"  {name} pid {proc.pid}  amqp://guest:guest@127.0.0.1:{port}/%2F  {amqps}"
              f"admin http://127.0.0.1:{port + ADMIN_OFFSET}  log {data / name / 'node.log'}",
              flush=True)
    if args.tls:
        print(f"TLS: CA {data / 'tls' / 'ca.pem'}, client certificate for guest (EXTERNAL) "
              f"{data / 'tls' / 'client-guest.pem'} + .key", flush=True)
    print(f"clients: any node's URL works (a backup relays to the primary), e.g. "
          f"amqp://guest:guest@127.0.0.1:{args.base_port}/%2F; give clients that take a list "
          f"all {args.nodes}", flush=True)
    print(f"status: brokerha ctl --node amqp://127.0.0.1:{args.base_port} status; management "
          f"UI and API http://127.0.0.1:{args.base_port + ADMIN_OFFSET}/ (guest/guest; "
          f"rabbitmqadmin -P {args.base_port + ADMIN_OFFSET})\n"
          f"start node nI alone again: brokerha node --config {config} --name nI "
          f"--data {data}/nI", flush=True)
    reported: set[str] = set()
    while not stopping:
        time.sleep(0.2)
        for name, proc in procs.items():
            if proc.poll() is not None and name not in reported:
                reported.add(name)
                print(f"node {name} (pid {proc.pid}) exited with {proc.returncode}; not "
                      "restarting it", flush=True)
    print("stopping the nodes ...", flush=True)
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in procs.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)
    up = sub.add_parser("up", help="start a local N-node cluster on loopback (foreground)")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--base-port", type=int, default=5672,
                    help="AMQP port of n1; nI gets base+I-1, admin +10000, cluster +20000")
    up.add_argument("--data", type=Path, default=Path("var/cluster"))
    up.add_argument("--cluster-name", default="dc1")
    up.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    up.add_argument("--tls", action="store_true",
                    help="certificates in DATA/tls, an amqps listener per node (the ports "
                         "after the AMQP ones) and TLS on the node-to-node links")
    up.add_argument("--partitions", type=int, metavar="P",
                    help="the partition table's P, written as [cluster] partitions in a new "
                         "cluster.toml (default 3 x nodes)")
    up.add_argument("--partition-groups", action="store_true",
                    help="each node runs one replication group per partition it holds, "
                         "written as [cluster] partition_groups = true in a new cluster.toml "
                         "(issue 35 stage 2: a queue is served on its partition's leader "
                         "only, 404 elsewhere; docs/ha.md)")
    up.set_defaults(handler=cmd_up)
    sim = sub.add_parser("simulate", help="deterministic simulation of the HA datacenter "
                         "(election, replication, transactions, the TxLog, the partition "
                         "table, cross-partition commit, forwarded publishes, remote "
                         "consumers)")
    from brokerha.ha.simulation.cli import WORKLOADS
    from brokerha.ha.simulation.cli import register as register_simulation
    from brokerha.partition import (
        forward_simulation,
        group_simulation,
        move_simulation,
        remote_consume_simulation,
        xtx_simulation,
    )
    from brokerha.partition import simulation as table
    from brokerha.txlog.simulation import datacenter

    register_simulation(sim, {**WORKLOADS, "txlog": datacenter, "table": table,
                              "xtx": xtx_simulation, "groups": group_simulation,
                              "forward": forward_simulation,
                              "remote-consume": remote_consume_simulation,
                              "moves": move_simulation})
