"""TxLog configuration: the keys of seeds 000/001 plus the knobs of the safety note.

Keys as a cluster config file names them (``node-id``, ``master-url``,
``peer.N.id``, ``peer.N.url``, ``split-recovery``, ``max-peer-lag``,
``round-timeout``, ``tx-log-max-size``, ``tx-log-max-depth``) are parsed by
:meth:`TxLogConfig.from_properties`; every value is validated with an error
that names the key, because a mistyped peer id silently refused is the kind of
mistake an operator cannot see.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cached_property


class ConfigError(ValueError):
    """A TxLog setting is invalid (the message names the key and the accepted values)."""


class SplitRecovery(StrEnum):
    """What a master does at a split and at the rejoin (seed 000, "Split recovery strategies")."""

    NONE = "none"
    SIMPLE = "simple"
    SMART = "smart"

    @classmethod
    def parse(cls, value: str) -> SplitRecovery:
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ConfigError(
                f"split-recovery: {value!r} is not one of None, Simple, Smart (case-insensitive)"
            ) from None


@dataclass(frozen=True)
class Peer:
    node_id: str
    url: str


@dataclass(frozen=True)
class TxLogConfig:
    """A master's TxLog settings; times in milliseconds unless the key says hours."""

    node_id: str
    master_url: str = ""
    peers: tuple[Peer, ...] = ()
    split_recovery: SplitRecovery = SplitRecovery.SMART
    round_timeout_ms: int = 160  # ~2 RTT for 40 ms one way
    max_peer_lag_ms: int = 30_000
    idle_interval_ms: int = 1_000
    post_spacing_ms: int = 5
    tx_log_max_size: int = 100_000
    tx_log_max_depth_hours: float = 168.0

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ConfigError("node-id: required")
        ids = [p.node_id for p in self.peers]
        if self.node_id in ids:
            raise ConfigError(f"peer ids: {self.node_id!r} is this master's own node-id")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"peer ids: duplicate in {ids}")
        for key, value in (
            ("round-timeout", self.round_timeout_ms),
            ("max-peer-lag", self.max_peer_lag_ms),
            ("idle-interval", self.idle_interval_ms),
            ("tx-log-max-size", self.tx_log_max_size),
        ):
            if value <= 0:
                raise ConfigError(f"{key}: must be positive, got {value}")
        if self.tx_log_max_depth_hours <= 0:
            raise ConfigError(f"tx-log-max-depth: must be positive, got {self.tx_log_max_depth_hours}")
        if self.max_peer_lag_ms <= self.idle_interval_ms + self.round_timeout_ms:
            raise ConfigError(
                "max-peer-lag: must exceed idle-interval + round-timeout, "
                "or a quiet spell becomes a split"
            )

    @cached_property
    def peer_ids(self) -> frozenset[str]:
        return frozenset(p.node_id for p in self.peers)

    @cached_property
    def masters(self) -> frozenset[str]:
        """Every configured master, this one included."""
        return self.peer_ids | {self.node_id}

    @property
    def max_depth_ms(self) -> int:
        return int(self.tx_log_max_depth_hours * 3_600_000)

    def with_peer(self, peer: Peer) -> TxLogConfig:
        if peer.node_id == self.node_id or peer.node_id in self.peer_ids:
            raise ConfigError(f"peer {peer.node_id!r}: already configured")
        if not peer.node_id:
            raise ConfigError("peer id: required")
        return replace(self, peers=(*self.peers, peer))

    def without_peer(self, node_id: str) -> TxLogConfig:
        if node_id not in self.peer_ids:
            raise ConfigError(f"peer {node_id!r}: not a configured peer")
        return replace(self, peers=tuple(p for p in self.peers if p.node_id != node_id))

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> TxLogConfig:
        """Parse ``node-id``, ``peer.N.id``/``peer.N.url`` etc. from a flat key/value map."""
        peers: dict[str, dict[str, str]] = {}
        for key, value in props.items():
            if key.startswith("peer."):
                parts = key.split(".")
                if len(parts) != 3 or parts[2] not in ("id", "url"):
                    raise ConfigError(f"{key}: expected peer.<n>.id or peer.<n>.url")
                peers.setdefault(parts[1], {})[parts[2]] = value.strip()
        peer_list = []
        for n, fields in sorted(peers.items()):
            if "id" not in fields:
                raise ConfigError(f"peer.{n}.id: required when peer.{n}.url is set")
            peer_list.append(Peer(fields["id"], fields.get("url", "")))

        def number(key: str, default: float) -> float:
            raw = props.get(key)
            if raw is None:
                return default
            try:
                return float(raw)
            except ValueError:
                raise ConfigError(f"{key}: {raw!r} is not a number") from None

        return cls(
            node_id=props.get("node-id", "").strip(),
            master_url=props.get("master-url", "").strip(),
            peers=tuple(peer_list),
            split_recovery=SplitRecovery.parse(props.get("split-recovery", "smart")),
            round_timeout_ms=int(number("round-timeout", 160)),
            max_peer_lag_ms=int(number("max-peer-lag", 30_000)),
            idle_interval_ms=int(number("idle-interval", 1_000)),
            tx_log_max_size=int(number("tx-log-max-size", 100_000)),
            tx_log_max_depth_hours=number("tx-log-max-depth", 168.0),
        )
