"""The ``[cluster]`` section: who the datacenter's nodes are and how they talk.

Reference: docs/ha.md ("Configuration") and docs/configuration.md. Every node
of a datacenter reads the same file and finds itself in ``[[cluster.nodes]]``
by its name; a node that is not listed does not start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from brokerha.cluster.election import ElectionTiming
from brokerha.cluster.link import tls_contexts
from brokerha.cluster.ports import ADMIN_OFFSET, CLUSTER_OFFSET
from brokerha.node.config import ConfigError, NodeConfig, check_keys, parse_listen
from brokerha.primary.policy import ReplicationPolicy

REPLICATE = ("all", "configuration", "none")

_CLUSTER_KEYS = {"name", "secret", "secret_file", "nodes", "tls", "heartbeat_interval",
                 "lease_timeout", "election_timeout", "backup_timeout",
                 "backup_unheard_timeout", "flow_lag", "replicate",
                 "verification_timeout", "tx_prepare_timeout", "policies", "partitions",
                 "partition_replicas", "partition_groups"}
_POLICY_KEYS = {"pattern", "replicate", "vhost"}
_NODE_KEYS = {"name", "amqp", "amqps", "admin", "https", "cluster", "cluster_bind"}
_TLS_KEYS = {"cert", "key", "ca"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def offset_address(amqp: tuple[str, int], offset: int, what: str) -> tuple[str, int]:
    port = amqp[1] + offset
    if port > 65535:
        raise ConfigError(f"{what}: AMQP port {amqp[1]} + {offset} is not a port; set it explicitly")
    return amqp[0], port


@dataclass
class ClusterMember:
    name: str
    amqp: tuple[str, int]
    admin: tuple[str, int]
    cluster: tuple[str, int]
    # where the node listens for peers when that differs from the address they
    # dial (NAT, a TCP proxy in front of it); None = ``cluster``
    cluster_bind: tuple[str, int] | None = None
    # its amqps listener (brokerha/node/tls.py), if it has one
    amqps: tuple[str, int] | None = None
    # its HTTPS admin listener, if it has one: the other members read its status there
    https: tuple[str, int] | None = None

    @property
    def amqp_url(self) -> str:
        return f"amqp://{self.amqp[0]}:{self.amqp[1]}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin[0]}:{self.admin[1]}"

    @property
    def https_url(self) -> str | None:
        return None if self.https is None else f"https://{self.https[0]}:{self.https[1]}"


@dataclass
class TLSFiles:
    cert: Path
    key: Path
    ca: Path


@dataclass
class ClusterConfig:
    name: str
    secret: bytes
    members: list[ClusterMember] = field(default_factory=list)
    tls: TLSFiles | None = None
    heartbeat_interval: float = ElectionTiming.heartbeat_interval
    lease_timeout: float = ElectionTiming.lease_timeout
    election_timeout: float = ElectionTiming.election_timeout
    backup_timeout: float = 5.0
    # a backup owing an ack that sent nothing for this long while another is heard leaves
    # the guarded set (a stalled link: confirms stop waiting for it); docs/ha.md
    backup_unheard_timeout: float = 0.5
    flow_lag: float = 0.1  # publishers held while a backup lags more (primary/primary.py)
    verification_timeout: float = 2.0
    tx_prepare_timeout: float = 5.0  # backups' votes on an XA branch's prepare (TX has none)
    replicate: str = "all"
    policies: list[ReplicationPolicy] = field(default_factory=list)
    # the partition table (issue 35, brokerha/partition/coordinator.py), made once at the
    # cluster's first start: P (None: 3 x nodes) and NR (capped at nodes - 1)
    partitions: int | None = None
    partition_replicas: int = 2
    # issue 35 stage 2: each node runs one replication group per partition cell it holds
    # (node/ha_groups.py) when P > 1; off by default: a queue is then served on its
    # partition's leader only (stage 3 forwards from any node)
    partition_groups: bool = False

    @property
    def groups_on(self) -> bool:
        """Whether the nodes run partition groups: switched on, with P > 1 configured."""
        partitions = self.partitions if self.partitions is not None else 3 * len(self.members)
        return self.partition_groups and partitions > 1

    def member(self, name: str) -> ClusterMember:
        for m in self.members:
            if m.name == name:
                return m
        raise ConfigError(f"node '{name}' is not listed in [[cluster.nodes]] "
                          f"({', '.join(m.name for m in self.members)})")


def _positive(table: dict[str, Any], key: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"cluster.{key}: expected a positive number of seconds, got {value!r}")
    return float(value)


def _count(table: dict[str, Any], key: str, least: int, default: int = 0) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"cluster.{key}: expected an integer >= {least}, got {value!r}")
    return value


def _member(entry: dict[str, Any], where: str) -> ClusterMember:
    check_keys(entry, _NODE_KEYS, f"{where} [[cluster.nodes]]")
    name = str(entry.get("name", ""))
    if not _NAME.match(name):
        raise ConfigError(f"{where} [[cluster.nodes]]: bad node name {name!r}")
    if "amqp" not in entry:
        raise ConfigError(f"{where} [[cluster.nodes]] '{name}': 'amqp' (HOST:PORT) is required")
    amqp = parse_listen(str(entry["amqp"]))
    admin = (parse_listen(str(entry["admin"])) if "admin" in entry
             else offset_address(amqp, ADMIN_OFFSET, f"node '{name}' admin"))
    cluster = (parse_listen(str(entry["cluster"])) if "cluster" in entry
               else offset_address(amqp, CLUSTER_OFFSET, f"node '{name}' cluster"))
    bind = parse_listen(str(entry["cluster_bind"])) if "cluster_bind" in entry else None
    amqps = parse_listen(str(entry["amqps"])) if "amqps" in entry else None
    https = parse_listen(str(entry["https"])) if "https" in entry else None
    return ClusterMember(name, amqp, admin, cluster, bind, amqps, https)


def _policy(entry: dict[str, Any], where: str) -> ReplicationPolicy:
    check_keys(entry, _POLICY_KEYS, f"{where} [[cluster.policies]]")
    try:
        pattern = re.compile(str(entry["pattern"]))
    except KeyError as exc:
        raise ConfigError(f"{where} [[cluster.policies]]: 'pattern' is required") from exc
    except re.error as exc:
        raise ConfigError(f"{where} [[cluster.policies]]: bad pattern: {exc}") from exc
    replicate = str(entry.get("replicate", "")).lower()
    if replicate not in REPLICATE:
        raise ConfigError(f"{where} [[cluster.policies]] '{pattern.pattern}': replicate must be "
                          f"one of {', '.join(REPLICATE)}, got {replicate!r}")
    vhost = entry.get("vhost")
    return ReplicationPolicy(pattern, replicate, None if vhost is None else str(vhost))


def parse_cluster(table: dict[str, Any], where: str, base: Path) -> ClusterConfig:
    """Validate a ``[cluster]`` table; relative file names are relative to ``base``."""
    check_keys(table, _CLUSTER_KEYS, f"{where} [cluster]")
    name = str(table.get("name", ""))
    if not _NAME.match(name):
        raise ConfigError(f"cluster.name: expected a name such as 'dc1', got {name!r}")
    if "secret" in table and "secret_file" in table:
        raise ConfigError("cluster: give secret or secret_file, not both")
    if "secret_file" in table:
        try:
            secret = (base / str(table["secret_file"])).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cluster.secret_file: {exc}") from exc
    else:
        secret = str(table.get("secret", "")).encode()
    if len(secret) < 16:
        raise ConfigError("cluster.secret: at least 16 characters are required (peers "
                          "authenticate with it); none is configured by default")
    members = [_member(e, where) for e in table.get("nodes", [])]
    if not members:
        raise ConfigError("cluster.nodes: list every node of the datacenter")
    names = [m.name for m in members]
    if len(set(names)) != len(names):
        raise ConfigError(f"cluster.nodes: duplicate node names in {names}")
    cfg = ClusterConfig(name, secret, members)
    cfg.heartbeat_interval = _positive(table, "heartbeat_interval", cfg.heartbeat_interval)
    cfg.lease_timeout = _positive(table, "lease_timeout", cfg.lease_timeout)
    cfg.election_timeout = _positive(table, "election_timeout", cfg.election_timeout)
    cfg.backup_timeout = _positive(table, "backup_timeout", cfg.backup_timeout)
    cfg.backup_unheard_timeout = _positive(table, "backup_unheard_timeout",
                                           cfg.backup_unheard_timeout)
    cfg.flow_lag = _positive(table, "flow_lag", cfg.flow_lag)
    if not cfg.flow_lag < cfg.lease_timeout:
        raise ConfigError(f"cluster: flow_lag ({cfg.flow_lag}) must be below lease_timeout "
                          f"({cfg.lease_timeout}): heartbeats queue behind the replication "
                          "a backup has not acknowledged")
    cfg.verification_timeout = _positive(table, "verification_timeout",
                                         cfg.verification_timeout)
    cfg.tx_prepare_timeout = _positive(table, "tx_prepare_timeout", cfg.tx_prepare_timeout)
    if not cfg.backup_unheard_timeout > 2 * cfg.heartbeat_interval:
        raise ConfigError(f"cluster: backup_unheard_timeout ({cfg.backup_unheard_timeout}) must "
                          f"exceed two heartbeat intervals ({2 * cfg.heartbeat_interval}): "
                          "a backup is heard at every heartbeat")
    if not cfg.heartbeat_interval < cfg.lease_timeout < cfg.election_timeout:
        raise ConfigError("cluster: need heartbeat_interval < lease_timeout < election_timeout "
                          "(a deposed primary must stop serving before anyone else is elected)")
    replicate = str(table.get("replicate", "all")).lower()
    if replicate not in REPLICATE:
        raise ConfigError(f"cluster.replicate: expected one of {', '.join(REPLICATE)}, "
                          f"got {replicate!r}")
    cfg.replicate = replicate
    if "partitions" in table:
        cfg.partitions = _count(table, "partitions", 1)
    cfg.partition_replicas = _count(table, "partition_replicas", 0, cfg.partition_replicas)
    groups = table.get("partition_groups", False)
    if not isinstance(groups, bool):
        raise ConfigError(f"cluster.partition_groups: expected true or false, got {groups!r}")
    cfg.partition_groups = groups
    cfg.policies = [_policy(p, where) for p in table.get("policies", [])]
    if "tls" in table:
        tls = table["tls"]
        check_keys(tls, _TLS_KEYS, f"{where} [cluster.tls]")
        missing = _TLS_KEYS - set(tls)
        if missing:
            raise ConfigError(f"cluster.tls: missing {', '.join(sorted(missing))}")
        cfg.tls = TLSFiles(*(base / str(tls[k]) for k in ("cert", "key", "ca")))
        try:  # loads now, so a bad file stops the start-up with its name
            tls_contexts(cfg.tls.cert, cfg.tls.key, cfg.tls.ca)
        except ValueError as exc:
            raise ConfigError(f"cluster.tls: {exc}") from exc
    return cfg


def apply_cluster(cfg: NodeConfig, cluster: ClusterConfig) -> None:
    """Take this node's addresses from its entry (flags may not contradict it)."""
    me = cluster.member(cfg.name)
    cfg.listen_host, cfg.listen_port = me.amqp
    cfg.admin_listen = me.admin
    if me.amqps is not None:
        cfg.amqps_listen = me.amqps
    if me.https is not None:
        cfg.https_listen = me.https
