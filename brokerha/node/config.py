"""Node configuration: a TOML file, overridden by command-line flags.

The full reference is docs/configuration.md; every key read here is listed
there. Unknown keys are errors, so a typo never silently leaves a default.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from brokerha.broker.broker import Limits

DEFAULT_LISTEN = "127.0.0.1:5672"


class ConfigError(ValueError):
    """A configuration file or flag that cannot be used; the message says why."""


@dataclass
class UserConfig:
    name: str
    password: str | None = None
    password_hash: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class PermissionConfig:
    user: str
    vhost: str
    configure: str = ".*"
    write: str = ".*"
    read: str = ".*"


@dataclass
class StoreConfig:
    """Where durable state goes: None = SQLite in the data directory; "memory" = nowhere."""

    url: str | None = None
    synchronous: str = "full"  # SQLite only: "full" (fsync every commit) or "normal"
    oplog: bool = True  # SQLite only: confirms wait for the operation log (brokerha.store.oplog)


STORE_SYNCHRONOUS = ("full", "normal")
LOGIN_FROM = ("common_name", "distinguished_name")


@dataclass
class TLSConfig:
    """``[tls]``: the node's certificate for its amqps and HTTPS listeners (brokerha/node/tls.py)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None             # CAs whose client certificates are accepted
    verify_peer: bool = False          # ask clients for a certificate and check it against ca
    fail_if_no_peer_cert: bool = False  # with verify_peer: refuse clients without one
    login_from: str = "common_name"    # SASL EXTERNAL's user: the CN, or the whole DN (RFC 4514)

    @property
    def configured(self) -> bool:
        return self.cert is not None


DEFAULT_DISK_FREE_LIMIT = 50_000_000  # RabbitMQ's default: 50 MB


@dataclass(frozen=True)
class DiskFreeLimit:
    """``disk_free_limit``: bytes, or a multiple of the machine's memory (RabbitMQ's mem_relative)."""

    absolute: int | None = DEFAULT_DISK_FREE_LIMIT
    mem_relative: float | None = None

    def bytes(self) -> int:
        if self.mem_relative is not None:
            return int(self.mem_relative * total_memory())
        return self.absolute or 0

    def __str__(self) -> str:
        return (f"mem_relative:{self.mem_relative:g}" if self.mem_relative is not None
                else str(self.absolute))


@dataclass
class NodeConfig:
    name: str = "brokerha"
    listen_host: str = "127.0.0.1"
    listen_port: int = 5672
    data_dir: Path = Path("var/brokerha")
    log_level: str = "info"
    event_loop: str = "auto"  # "auto" (uvloop if installed), "uvloop" or "asyncio"
    limits: Limits = field(default_factory=Limits)
    default_user: bool = True
    loopback_users: list[str] = field(default_factory=lambda: ["guest"])
    vhosts: list[str] = field(default_factory=lambda: ["/"])
    users: list[UserConfig] = field(default_factory=list)
    permissions: list[PermissionConfig] = field(default_factory=list)
    tick_interval: float = 0.1
    # added to the nice value of the node's background threads (the store's writer and
    # operation log), 0-19; 0 (default): as the process's (thread_priority.py)
    background_nice: int = 0
    # the disk alarm (node/disk.py): free space under which publishers are blocked
    disk_free_limit: DiskFreeLimit = field(default_factory=DiskFreeLimit)
    store: StoreConfig = field(default_factory=StoreConfig)
    # admin HTTP (status, ctl); None = AMQP port + 10000 when that is a port
    admin_listen: tuple[str, int] | None = None
    admin_enabled: bool = True
    # plain AMQP on listen_host:listen_port ("listen = off" turns it off), amqps, HTTPS admin
    amqp_plain: bool = True
    amqps_listen: tuple[str, int] | None = None
    https_listen: tuple[str, int] | None = None
    tls: TLSConfig = field(default_factory=TLSConfig)
    # the raw [cluster] table and the directory its file names are relative to;
    # node/cluster_config.py validates it (None: a standalone node)
    cluster_table: dict[str, Any] | None = None
    config_dir: Path = Path(".")
    # the raw [txlog] table (brokerha/txlog/master/settings.py's from_node_table validates it
    # once the data directory is final) and its parsed form (a NodeTxLog, or None)
    txlog_table: dict[str, Any] | None = None
    txlog: Any = None


_SIZE = re.compile(r"^\s*(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30}


def parse_size(value: Any, key: str) -> int:
    """A byte count: an integer or a string such as '512MiB'."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{key}: expected a size such as 1048576 or '512MiB', got {value!r}")
    return int(m.group(1)) * _UNITS[(m.group(2) or "b").lower()]


def total_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_disk_free_limit(value: Any, key: str) -> DiskFreeLimit:
    """``50MB``, ``1GiB``, a byte count, ``mem_relative:1.5`` or ``{mem_relative = 1.5}``."""
    relative: Any = None
    if isinstance(value, dict):
        if set(value) != {"mem_relative"}:
            raise ConfigError(f"{key}: the only table form is {{mem_relative = 1.0}}, got {value!r}")
        relative = value["mem_relative"]
    elif isinstance(value, str) and value.strip().lower().startswith("mem_relative"):
        _, sep, relative = value.partition(":")
        if not sep:
            raise ConfigError(f"{key}: expected mem_relative:FACTOR, got {value!r}")
    if relative is not None:
        try:
            factor = float(relative)
        except (TypeError, ValueError):
            factor = -1.0
        if not 0 < factor <= 100:
            raise ConfigError(f"{key}: mem_relative takes a factor such as 1.0 or 2.5, "
                             f"got {relative!r}")
        return DiskFreeLimit(None, factor)
    return DiskFreeLimit(parse_size(value, key), None)


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"listen: expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


_SECTIONS = {"node", "limits", "security", "store", "vhosts", "users", "permissions",
             "cluster", "txlog", "tls"}
_NODE_KEYS = {"name", "listen", "data", "log_level", "tick_interval", "admin", "event_loop",
              "amqps_listen", "https_listen", "background_nice"}
_TLS_KEYS = {"cert", "key", "ca", "verify_peer", "fail_if_no_peer_cert", "login_from"}
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
_LIMIT_KEYS = {"frame_max", "channel_max", "heartbeat", "max_message_size", "memory_limit",
               "memory_resume_ratio", "queue_max_memory", "node_max_memory", "disk_free_limit"}
_SIZE_KEYS = ("max_message_size", "memory_limit", "queue_max_memory", "node_max_memory")
_SECURITY_KEYS = {"default_user", "loopback_users"}
_STORE_KEYS = {"url", "synchronous", "oplog"}


def parse_nice(value: Any, key: str) -> int:
    """A nice value's increment, 0 to 19."""
    if isinstance(value, bool) or not isinstance(value, int | str) or \
            not str(value).strip().isdigit() or int(value) > 19:
        raise ConfigError(f"{key}: expected a whole number from 0 to 19, got {value!r}")
    return int(value)


def check_keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")


def parse_choice(value: Any, key: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case-insensitive), or a ConfigError naming them."""
    choice = str(value).lower()
    if choice not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
    return choice


def _apply_store(table: dict[str, Any], cfg: NodeConfig, where: str) -> None:
    check_keys(table, _STORE_KEYS, f"{where} [store]")
    if "url" in table:
        if not isinstance(table["url"], str) or not table["url"]:
            raise ConfigError(f"store.url: expected a URL or 'memory', got {table['url']!r}")
        cfg.store.url = table["url"]
    if "synchronous" in table:
        cfg.store.synchronous = parse_choice(table["synchronous"], "store.synchronous",
                                             STORE_SYNCHRONOUS)
    if "oplog" in table:
        if not isinstance(table["oplog"], bool):
            raise ConfigError(f"store.oplog: expected true or false, got {table['oplog']!r}")
        cfg.store.oplog = table["oplog"]


def _apply_tls(table: dict[str, Any], cfg: NodeConfig, where: str) -> None:
    check_keys(table, _TLS_KEYS, f"{where} [tls]")
    for key in ("cert", "key", "ca"):
        if key in table:
            if not isinstance(table[key], str) or not table[key]:
                raise ConfigError(f"tls.{key}: expected a file name, got {table[key]!r}")
            setattr(cfg.tls, key, cfg.config_dir / table[key])
    for key in ("verify_peer", "fail_if_no_peer_cert"):
        if key in table:
            if not isinstance(table[key], bool):
                raise ConfigError(f"tls.{key}: expected true or false, got {table[key]!r}")
            setattr(cfg.tls, key, table[key])
    if "login_from" in table:
        cfg.tls.login_from = parse_choice(table["login_from"], "tls.login_from", LOGIN_FROM)


def parse_amqp_listen(value: str, cfg: NodeConfig) -> None:
    """``HOST:PORT`` for the plain AMQP listener, or ``off`` (amqps only)."""
    if value.lower() == "off":
        cfg.amqp_plain = False
    else:
        cfg.listen_host, cfg.listen_port = parse_listen(value)
        cfg.amqp_plain = True


def check_tls(cfg: NodeConfig) -> None:
    """The listeners and ``[tls]`` fit together (after the file and the flags)."""
    tls = cfg.tls
    wants = [k for k, v in (("amqps_listen", cfg.amqps_listen),
                            ("https_listen", cfg.https_listen)) if v is not None]
    if wants and (tls.cert is None or tls.key is None):
        raise ConfigError(f"{' and '.join(wants)}: need tls.cert and tls.key (--tls-cert, "
                          "--tls-key)")
    if (tls.cert is None) != (tls.key is None):
        raise ConfigError("tls: cert and key go together")
    if tls.verify_peer and tls.ca is None:
        raise ConfigError("tls.verify_peer: needs tls.ca (the CA client certificates are "
                          "checked against)")
    if tls.fail_if_no_peer_cert and not tls.verify_peer:
        raise ConfigError("tls.fail_if_no_peer_cert: needs tls.verify_peer = true")
    if not cfg.amqp_plain and cfg.amqps_listen is None:
        raise ConfigError("listen = off: needs amqps_listen (a node without any AMQP "
                          "listener serves nobody)")


def parse_admin(value: str, cfg: NodeConfig) -> None:
    """``HOST:PORT`` for the admin HTTP listener, or ``off``."""
    if value.lower() == "off":
        cfg.admin_enabled = False
    else:
        cfg.admin_listen = parse_listen(value)
        cfg.admin_enabled = True


def load_file(path: Path, config: NodeConfig | None = None) -> NodeConfig:
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    cfg = config or NodeConfig()
    cfg.config_dir = path.parent
    return apply_document(doc, cfg, str(path))


def apply_document(doc: dict[str, Any], cfg: NodeConfig, where: str = "config") -> NodeConfig:
    check_keys(doc, _SECTIONS, where)
    node = doc.get("node", {})
    check_keys(node, _NODE_KEYS, f"{where} [node]")
    if "name" in node:
        cfg.name = str(node["name"])
    if "listen" in node:
        parse_amqp_listen(str(node["listen"]), cfg)
    for key in ("amqps_listen", "https_listen"):
        if key in node:
            setattr(cfg, key, parse_listen(str(node[key])))
    if "data" in node:
        cfg.data_dir = Path(node["data"])
    if "log_level" in node:
        cfg.log_level = str(node["log_level"]).lower()
    if "tick_interval" in node:
        cfg.tick_interval = float(node["tick_interval"])
    if "event_loop" in node:
        cfg.event_loop = parse_choice(node["event_loop"], "node.event_loop", EVENT_LOOPS)
    if "background_nice" in node:
        cfg.background_nice = parse_nice(node["background_nice"], "node.background_nice")
    if "admin" in node:
        parse_admin(str(node["admin"]), cfg)
    if "cluster" in doc:
        cfg.cluster_table = dict(doc["cluster"])
    if "txlog" in doc:
        if not isinstance(doc["txlog"], dict):
            raise ConfigError(f"{where} [txlog]: expected a table")
        cfg.txlog_table = dict(doc["txlog"])
    limits = doc.get("limits", {})
    check_keys(limits, _LIMIT_KEYS, f"{where} [limits]")
    for key in ("frame_max", "channel_max", "heartbeat"):
        if key in limits:
            value = limits[key]
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"limits.{key}: expected a non-negative integer, got {value!r}")
            setattr(cfg.limits, key, value)
    if cfg.limits.frame_max < 4096:
        raise ConfigError("limits.frame_max: must be at least 4096")
    for key in _SIZE_KEYS:
        if key in limits:
            setattr(cfg.limits, key, parse_size(limits[key], f"limits.{key}"))
    if "memory_resume_ratio" in limits:
        cfg.limits.memory_resume_ratio = float(limits["memory_resume_ratio"])
    if "disk_free_limit" in limits:
        cfg.disk_free_limit = parse_disk_free_limit(limits["disk_free_limit"],
                                                    "limits.disk_free_limit")
    security = doc.get("security", {})
    check_keys(security, _SECURITY_KEYS, f"{where} [security]")
    if "default_user" in security:
        cfg.default_user = bool(security["default_user"])
    if "loopback_users" in security:
        cfg.loopback_users = [str(u) for u in security["loopback_users"]]
    _apply_store(doc.get("store", {}), cfg, where)
    _apply_tls(doc.get("tls", {}), cfg, where)
    for vh in doc.get("vhosts", []):
        check_keys(vh, {"name"}, f"{where} [[vhosts]]")
        if vh["name"] not in cfg.vhosts:
            cfg.vhosts.append(str(vh["name"]))
    for user in doc.get("users", []):
        check_keys(user, {"name", "password", "password_hash", "tags"}, f"{where} [[users]]")
        if "password" not in user and "password_hash" not in user:
            raise ConfigError(f"{where}: user '{user.get('name')}' needs password or password_hash")
        cfg.users.append(UserConfig(str(user["name"]), user.get("password"),
                                    user.get("password_hash"), list(user.get("tags", []))))
    for perm in doc.get("permissions", []):
        check_keys(perm, {"user", "vhost", "configure", "write", "read"},
                    f"{where} [[permissions]]")
        try:
            p = PermissionConfig(**perm)
            for regex in (p.configure, p.write, p.read):
                re.compile(regex)
        except (TypeError, re.error) as exc:
            raise ConfigError(f"{where} [[permissions]]: {exc}") from exc
        cfg.permissions.append(p)
    users = {u.name for u in cfg.users} | ({"guest"} if cfg.default_user else set())
    for p in cfg.permissions:
        if p.user not in users:
            raise ConfigError(f"{where}: permissions for unknown user '{p.user}'")
        if p.vhost not in cfg.vhosts:
            raise ConfigError(f"{where}: permissions for unknown vhost '{p.vhost}'")
    return cfg
