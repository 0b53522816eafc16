"""``brokerha node``: run one broker node in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from brokerha import native
from brokerha.node.cluster_config import ClusterConfig, apply_cluster, parse_cluster
from brokerha.node.config import (
    DEFAULT_LISTEN,
    EVENT_LOOPS,
    STORE_SYNCHRONOUS,
    ConfigError,
    NodeConfig,
    check_tls,
    load_file,
    parse_admin,
    parse_amqp_listen,
    parse_choice,
    parse_disk_free_limit,
    parse_listen,
    parse_nice,
    parse_size,
)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML configuration file")
    parser.add_argument("--name", help="node name (default: brokerha)")
    parser.add_argument("--listen", metavar="HOST:PORT|off",
                        help=f"AMQP listen address (default: {DEFAULT_LISTEN}); off: amqps only")
    parser.add_argument("--admin", "--http-listen", metavar="HOST:PORT|off",
                        help="admin HTTP listener: status page (/), /metrics, /api/... and "
                             "brokerha ctl "
                             "(default: the AMQP port + 10000 on the same host)")
    tls = parser.add_argument_group("TLS (docs/operations.md, \"TLS\"; the same keys: [tls])")
    tls.add_argument("--amqps-listen", metavar="HOST:PORT", help="amqps listener (needs "
                     "--tls-cert and --tls-key)")
    tls.add_argument("--https-listen", metavar="HOST:PORT",
                     help="the admin HTTP listener's routes over HTTPS")
    tls.add_argument("--tls-cert", type=Path, metavar="FILE", help="the node's certificate (PEM, "
                     "chain after it)")
    tls.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key (PEM)")
    tls.add_argument("--tls-ca", type=Path, metavar="FILE",
                     help="CA certificates client certificates are checked against")
    tls.add_argument("--tls-verify-peer", action="store_true", default=None,
                     help="ask clients for a certificate and check it (SASL EXTERNAL needs it)")
    tls.add_argument("--tls-fail-if-no-peer-cert", action="store_true", default=None,
                     help="with --tls-verify-peer: refuse clients without a certificate")
    tls.add_argument("--tls-login-from", choices=["common_name", "distinguished_name"],
                     help="SASL EXTERNAL's user name: the certificate's CN (default) or "
                          "its whole subject DN")
    parser.add_argument("--data", type=Path, metavar="DIR", help="data directory (created if missing)")
    parser.add_argument("--memory-limit", metavar="SIZE",
                        help="queued bytes at which publishers are blocked (e.g. 512MiB; 0 = off)")
    parser.add_argument("--disk-free-limit", metavar="SIZE",
                        help="free disk space under which publishers are blocked: e.g. 50MB "
                             "(the default), 1GiB, mem_relative:1.0 (times the machine's "
                             "memory); 0 = off")
    parser.add_argument("--queue-max-memory", metavar="SIZE",
                        help="bytes of message bodies a durable queue keeps in memory; "
                             "persistent ones past it are read back from the store "
                             "(e.g. 64MiB; 0 = unlimited, the default)")
    parser.add_argument("--heartbeat", type=int, metavar="SECONDS",
                        help="heartbeat interval the server proposes (default 60, 0 = off)")
    parser.add_argument("--store", metavar="URL",
                        help="durable store: sqlite:///FILE, postgresql+psycopg://..., or memory "
                             "(default: SQLite in the data directory)")
    parser.add_argument("--store-synchronous", metavar="MODE",
                        help="SQLite fsync policy: full (default) or normal")
    parser.add_argument("--store-oplog", choices=["on", "off"],
                        help="SQLite: confirm after an append to the operation log and apply "
                             "to the database later (on, the default), or commit every batch "
                             "to the database (off)")
    parser.add_argument("--reset-definitions", action="store_true",
                        help="make the vhosts, users and permissions the configuration's "
                             "again, deleting every other one (a vhost with its queues): "
                             "otherwise the store's win once it has any "
                             "(docs/configuration.md)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"],
                        help="auto (default): uvloop if installed, else asyncio's own loop")
    parser.add_argument("--background-nice", metavar="N",
                        help="added to the store threads' nice value, 0-19 (default 0)")
    parser.set_defaults(handler=main)


def config_from_args(args: argparse.Namespace) -> tuple[NodeConfig, ClusterConfig | None]:
    """The node's configuration, and its datacenter's when the file has ``[cluster]``."""
    cfg = load_file(args.config) if args.config else NodeConfig()
    if args.name:
        cfg.name = args.name
    cluster = None
    if cfg.cluster_table is not None:
        cluster = parse_cluster(cfg.cluster_table, str(args.config), cfg.config_dir)
        apply_cluster(cfg, cluster)
        if args.amqps_listen and cfg.amqps_listen is None:
            raise ConfigError(f"--amqps-listen: node '{cfg.name}' has no amqps address in "
                              "[[cluster.nodes]]; add amqps = \"HOST:PORT\" there")
        for flag, value, own in (("--listen", args.listen, (cfg.listen_host, cfg.listen_port)),
                                 ("--amqps-listen", args.amqps_listen, cfg.amqps_listen)):
            if value and value.lower() != "off" and parse_listen(value) != own:
                raise ConfigError(f"{flag} {value} contradicts node '{cfg.name}' in "
                                  "[[cluster.nodes]]; the cluster entry decides")
        if args.listen and args.listen.lower() == "off":
            cfg.amqp_plain = False  # clients on amqps only (the entry's amqp stays its address)
        if not cfg.amqp_plain and cfg.amqps_listen is None:
            raise ConfigError("listen = off: a cluster member without an amqps address in "
                              "[[cluster.nodes]] would serve no clients; add amqps = "
                              "\"HOST:PORT\" to its entry (backups then relay amqps clients "
                              "to the primary's amqps listener, node/relay.py)")
    else:
        if args.listen:
            parse_amqp_listen(args.listen, cfg)
        if args.amqps_listen:
            cfg.amqps_listen = parse_listen(args.amqps_listen)
    if args.https_listen:
        cfg.https_listen = parse_listen(args.https_listen)
    for key in ("cert", "key", "ca", "verify_peer", "fail_if_no_peer_cert", "login_from"):
        value = getattr(args, f"tls_{key}")
        if value is not None:
            setattr(cfg.tls, key, value)
    check_tls(cfg)
    if args.admin:
        parse_admin(args.admin, cfg)
    if cluster is not None and not cfg.admin_enabled and cfg.https_listen is None:
        raise ConfigError("--admin off: a cluster member's status is read by the others; "
                          "give its [[cluster.nodes]] entry https = \"HOST:PORT\" (read there, "
                          "with the [tls] certificates) or keep the plain admin listener")
    if args.data:
        cfg.data_dir = args.data
    if args.memory_limit is not None:
        cfg.limits.memory_limit = parse_size(args.memory_limit, "--memory-limit")
    if args.disk_free_limit is not None:
        cfg.disk_free_limit = parse_disk_free_limit(args.disk_free_limit, "--disk-free-limit")
    if args.queue_max_memory is not None:
        cfg.limits.queue_max_memory = parse_size(args.queue_max_memory, "--queue-max-memory")
    if args.heartbeat is not None:
        cfg.limits.heartbeat = args.heartbeat
    if args.store:
        cfg.store.url = args.store
    if args.store_synchronous:
        cfg.store.synchronous = parse_choice(args.store_synchronous, "--store-synchronous",
                                           STORE_SYNCHRONOUS)
    if args.store_oplog:
        cfg.store.oplog = args.store_oplog == "on"
    if args.event_loop:
        cfg.event_loop = parse_choice(args.event_loop, "--event-loop", EVENT_LOOPS)
    if args.background_nice is not None:
        cfg.background_nice = parse_nice(args.background_nice, "--background-nice")
    if args.log_level:
        cfg.log_level = args.log_level
    if cfg.txlog_table is not None:  # after --data: the TxLog journal lives in the data dir
        from brokerha.txlog.engine.config import ConfigError as TxLogConfigError
        from brokerha.txlog.master.settings import from_node_table

        try:
            member = None if cluster is None else cluster.member(cfg.name)
            cfg.txlog = from_node_table(cfg.txlog_table, str(args.config), cfg.config_dir,
                                        cfg.data_dir.resolve(),
                                        None if member is None
                                        else member.cluster_bind or member.cluster)
        except (TxLogConfigError, OSError) as exc:
            raise ConfigError(str(exc)) from exc
    return cfg, cluster


def run_event_loop(main: Callable[[], Coroutine[Any, Any, int]], choice: str) -> int:
    """Run ``main()`` on uvloop or asyncio's own loop (``[node] event_loop``).

    uvloop (libuv, transports in Cython) spends about a third less CPU per
    replicated transaction on every node (docs/benchmarks.md); "auto" uses it
    when it is installed. The code is the same on both: only the loop differs.
    """
    log = logging.getLogger("brokerha.node")
    log.info("hot modules: %s (brokerha native status)", native.MODE)
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError("node.event_loop = uvloop, but uvloop is not installed "
                                  "(pip install uvloop)") from None
        else:
            log.info("event loop: uvloop %s", uvloop.__version__)
            return uvloop.run(main())
    log.info("event loop: asyncio")
    return asyncio.run(main())


def main(args: argparse.Namespace) -> int:
    try:
        cfg, cluster = config_from_args(args)
    except ConfigError as exc:
        print(f"brokerha node: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), stream=sys.stdout,
        format=f"%(asctime)s %(levelname)s [{cfg.name}] %(name)s: %(message)s",
    )
    from brokerha.admin.endpoints import install as install_admin_api
    from brokerha.node.server import Node, tune_gc
    from brokerha.store.sql import StoreError
    from brokerha.thread_priority import set_background_nice

    async def run() -> int:
        node = Node(cfg, cluster)
        node.reset_definitions = args.reset_definitions
        set_background_nice(cfg.background_nice)  # the store's threads, started by the node
        install_admin_api(node)  # /, /metrics, /api/queues, ... (brokerha/admin/)
        if cluster is not None and cluster.groups_on:  # issue 35 stage 2: partition groups
            from brokerha.node.ha_groups import GroupsNode
            from brokerha.node.partition_balance import BalanceEndpoint

            node.ha = GroupsNode(node, cluster)
            # ctl partitions balance: answered by the metadata primary (its route holds it)
            BalanceEndpoint(node.ha)
        elif cluster is not None:
            from brokerha.node.ha import HANode

            node.ha = HANode(node, cluster)
        # recovered state frozen too, before the node serves (a full collection over it)
        await node.run_until_stopped(after_recovery=lambda: tune_gc(node.gc))
        return node.exit_code

    try:
        return run_event_loop(run, cfg.event_loop)
    except ConfigError as exc:
        print(f"brokerha node: configuration error: {exc}", file=sys.stderr)
        return 2
    except (OSError, StoreError) as exc:
        logging.getLogger("brokerha.node").error("cannot start: %s", exc)
        return 1
