"""The configuration file of a TxLog master process (``brokerha txlog node --config FILE``).

A TOML file whose keys are the seed's names: ``peer.1.id = "dc2"`` is TOML
for the nested table ``peer -> 1 -> id``, flattened back here to the key
``peer.1.id`` that :meth:`TxLogConfig.from_properties` reads. Beside the
engine's keys (``node-id``, ``master-url``, ``peer.N.id``, ``peer.N.url``,
``split-recovery``, ``round-timeout``, ``idle-interval``, ``max-peer-lag``,
``tx-log-max-size``, ``tx-log-max-depth``) the process needs:

``group``        the TxLog group name: the cluster name of the node-to-node
                 handshake (a master of another group is refused);
``secret`` / ``secret-file``  the shared secret of the handshake;
``listen``       where to accept peers (default: the host and port of ``master-url``;
                 in an HA cluster member's ``[txlog]``: the node's cluster address
                 host and cluster port + 10000, i.e. AMQP + ``TXLOG_OFFSET``);
``admin``        loopback HOST:PORT of the local HTTP API (status, peers,
                 export, test transactions), default ``127.0.0.1:0`` (any port);
``data-dir``     where the TxLog state lives (required);
``tls.cert``, ``tls.key``, ``tls.ca``  (a ``[tls]`` table; ``[txlog.tls]`` in a node's
                 file) TLS on the links to the other masters, as ``[cluster.tls]``:
                 each side presents its certificate and requires the other's to be
                 signed by ``ca``; ``tls.check-peer-name = true`` also requires the
                 peer's certificate to name its ``node-id`` (CN or a DNS name).

Unknown keys are refused with the key named. URLs are ``txlog://host:port``; a
``peer.N.url`` may list several, comma-separated: the nodes of an HA
datacenter, tried in turn (only the one running the master listens).
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from brokerha.cluster.link import tls_contexts
from brokerha.txlog.engine.config import ConfigError, TxLogConfig

ENGINE_KEYS = {"node-id", "master-url", "split-recovery", "round-timeout", "idle-interval",
               "max-peer-lag", "tx-log-max-size", "tx-log-max-depth"}
PROCESS_KEYS = {"group", "secret", "secret-file", "listen", "admin", "data-dir", "log-level",
                "tls.cert", "tls.key", "tls.ca", "tls.check-peer-name"}
_TLS_FILES = ("tls.cert", "tls.key", "tls.ca")
BOOLEAN_KEYS = {"tls.check-peer-name"}


@dataclass(frozen=True)
class LinkTLS:
    """TLS on the links between masters (``[tls]``; a node's ``[txlog.tls]``)."""

    cert: Path
    key: Path
    ca: Path
    check_peer_name: bool = False


@dataclass(frozen=True)
class MasterSettings:
    txlog: TxLogConfig
    group: str
    secret: bytes
    listen: tuple[str, int]
    admin: tuple[str, int]
    data_dir: Path
    log_level: str = "info"
    tls: LinkTLS | None = None

    def peer_addresses(self) -> dict[str, list[tuple[str, int]]]:
        return {p.node_id: parse_urls(p.url, f"peer {p.node_id} url") for p in self.txlog.peers}


def parse_url(url: str, key: str) -> tuple[str, int]:
    """``txlog://host:port`` -> (host, port)."""
    parts = urlsplit(url)
    if parts.scheme != "txlog" or not parts.hostname or parts.port is None:
        raise ConfigError(f"{key}: {url!r} is not txlog://host:port")
    return parts.hostname, parts.port


def parse_urls(value: str, key: str) -> list[tuple[str, int]]:
    """``txlog://h1:p1, txlog://h2:p2`` -> [(h1, p1), (h2, p2)]: one datacenter's nodes."""
    urls = [u.strip() for u in value.split(",")]
    if not value.strip() or any(not u for u in urls):
        raise ConfigError(f"{key}: {value!r} is not a comma-separated list of txlog://host:port")
    addresses = [parse_url(u, key) for u in urls]
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"{key}: {value!r} names the same address twice")
    return addresses


def parse_address(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"{key}: {value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, bool):
            if name not in BOOLEAN_KEYS:
                raise ConfigError(f"{name}: expected a string or a number, not a boolean")
            out[name] = "true" if value else "false"
        else:
            out[name] = str(value)
    return out


def from_properties(props: Mapping[str, str], base_dir: Path = Path("."),
                    default_listen: tuple[str, int] | None = None) -> MasterSettings:
    """``default_listen``: where to listen without a ``listen`` key (an HA member's rule)."""
    for key in props:
        if key not in ENGINE_KEYS | PROCESS_KEYS and not key.startswith("peer."):
            raise ConfigError(f"{key}: unknown TxLog key")
    config = TxLogConfig.from_properties(props)
    for key, value in props.items():
        if key.startswith("peer.") and key.endswith(".url"):
            parse_urls(value, key)
    for peer in config.peers:
        if not peer.url:
            raise ConfigError(f"peer {peer.node_id}: url required (peer.N.url)")
    group = props.get("group", "").strip()
    if not group:
        raise ConfigError("group: required (the TxLog group name all masters share)")
    if "secret-file" in props:
        secret = (base_dir / props["secret-file"]).read_bytes().strip()
    else:
        secret = props.get("secret", "").encode()
    if not secret:
        raise ConfigError("secret (or secret-file): required")
    if "listen" in props:
        listen = parse_address(props["listen"], "listen")
    elif default_listen is not None:
        listen = default_listen
    elif config.master_url:
        listen = parse_url(config.master_url, "master-url")
    else:
        raise ConfigError("listen or master-url: required")
    admin = parse_address(props.get("admin", "127.0.0.1:0"), "admin")
    if admin[0] != "localhost" and not _loopback(admin[0]):
        raise ConfigError(f"admin: {admin[0]} is not a loopback address (the local API "
                          "has no authentication)")
    if "data-dir" not in props:
        raise ConfigError("data-dir: required")
    return MasterSettings(config, group, secret, listen, admin, base_dir / props["data-dir"],
                          props.get("log-level", "info"), _link_tls(props, base_dir))


def _link_tls(props: Mapping[str, str], base_dir: Path) -> LinkTLS | None:
    given = [k for k in (*_TLS_FILES, "tls.check-peer-name") if k in props]
    if not given:
        return None
    missing = [k for k in _TLS_FILES if k not in props]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: required with {', '.join(given)} (TLS on "
                          "the links needs the certificate, its key and the CA)")
    check = props.get("tls.check-peer-name", "false")
    if check not in ("true", "false"):
        raise ConfigError(f"tls.check-peer-name: expected true or false, got {check!r}")
    for key in _TLS_FILES:
        if not (base_dir / props[key]).is_file():
            raise ConfigError(f"{key}: {base_dir / props[key]} is not a readable file")
    tls = LinkTLS(base_dir / props["tls.cert"], base_dir / props["tls.key"],
                  base_dir / props["tls.ca"], check == "true")
    try:  # loads now, so a bad file stops the start-up, not the first link
        tls_contexts(tls.cert, tls.key, tls.ca)
    except ValueError as exc:
        raise ConfigError(f"tls: {exc}") from exc
    return tls


def load(path: Path) -> MasterSettings:
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return from_properties(flatten(doc), Path(path).parent)


# ---- the [txlog] section of a broker node's configuration ---------------------------

NODE_ALIASES = {"MaxPeerLag": "max-peer-lag"}  # the seed's spelling
NODE_PROCESS_KEYS = PROCESS_KEYS - {"admin"}   # the node's own admin API serves the TxLog
GLOBAL_KEYS = {"pattern", "vhost"}


@dataclass(frozen=True)
class GlobalPolicy:
    """Queues whose name matches ``pattern`` (``re.search``; in ``vhost``, or any) are global."""

    pattern: re.Pattern[str]
    vhost: str | None = None

    def matches(self, vhost: str, name: str) -> bool:
        return (self.vhost is None or self.vhost == vhost) and self.pattern.search(name) is not None


@dataclass(frozen=True)
class NodeTxLog:
    """A broker node's ``[txlog]``: its master's settings and the global-queue policies."""

    settings: MasterSettings
    policies: tuple[GlobalPolicy, ...] = ()


def _policy(entry: Any, where: str) -> GlobalPolicy:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} [[txlog.global]]: expected a table")
    unknown = sorted(set(entry) - GLOBAL_KEYS)
    if unknown:
        raise ConfigError(f"{where} [[txlog.global]]: unknown key(s) {', '.join(unknown)}")
    if not isinstance(entry.get("pattern"), str) or not entry["pattern"]:
        raise ConfigError(f"{where} [[txlog.global]]: 'pattern' (a regular expression) is required")
    try:
        pattern = re.compile(entry["pattern"])
    except re.error as exc:
        raise ConfigError(f"{where} [[txlog.global]]: bad pattern {entry['pattern']!r}: {exc}") from exc
    vhost = entry.get("vhost")
    if vhost is not None and not isinstance(vhost, str):
        raise ConfigError(f"{where} [[txlog.global]] {entry['pattern']!r}: vhost must be a string")
    return GlobalPolicy(pattern, vhost)


def ha_listen(cluster_address: tuple[str, int]) -> tuple[str, int]:
    """An HA member's TxLog address without ``listen``: its cluster host, cluster port + 10000.

    With the port conventions (``cluster/ports.py``) that is AMQP + ``TXLOG_OFFSET``.
    """
    from brokerha.cluster.ports import CLUSTER_OFFSET, TXLOG_OFFSET

    host, port = cluster_address
    port += TXLOG_OFFSET - CLUSTER_OFFSET
    if port > 65535:
        raise ConfigError(f"listen: the cluster port + {TXLOG_OFFSET - CLUSTER_OFFSET} is not "
                          "a port; set listen")
    return host, port


def from_node_table(table: Mapping[str, Any], where: str, base_dir: Path,
                    node_data_dir: Path,
                    cluster_address: tuple[str, int] | None = None) -> NodeTxLog:
    """Parse a node's ``[txlog]`` table with the same keys (and checks) as a master's file.

    ``admin`` is not accepted (the node's admin API serves the TxLog);
    ``data-dir`` defaults to ``<node data dir>/txlog``; ``MaxPeerLag`` is
    accepted for ``max-peer-lag``; ``[[txlog.global]]`` entries name global queues.
    ``cluster_address``: an HA member's own cluster address (bind address if
    set); without ``listen`` its master listens at :func:`ha_listen` of it, and
    ``master-url`` may be omitted (the other DCs list every node's URL).
    """
    table = dict(table)
    policies = table.pop("global", [])
    if not isinstance(policies, list):
        raise ConfigError(f"{where} [txlog] global: expected [[txlog.global]] tables")
    try:
        props = flatten(table)
        for alias, key in NODE_ALIASES.items():
            if alias in props:
                if key in props:
                    raise ConfigError(f"{alias} and {key}: the same key twice")
                props[key] = props.pop(alias)
        if "admin" in props:
            raise ConfigError("admin: not a node key (the node's admin API serves the TxLog: "
                              "brokerha ctl --node URL txlog status)")
        props.setdefault("data-dir", str(node_data_dir / "txlog"))
        default_listen = ha_listen(cluster_address) if cluster_address is not None else None
        settings = from_properties(props, base_dir, default_listen)
    except ConfigError as exc:
        raise ConfigError(f"{where} [txlog] {exc}") from exc
    return NodeTxLog(settings, tuple(_policy(p, where) for p in policies))
