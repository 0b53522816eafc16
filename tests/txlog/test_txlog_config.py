import pytest

from brokerha.txlog.engine.config import ConfigError, Peer, SplitRecovery, TxLogConfig
from brokerha.txlog.engine.messages import Post, Refused
from brokerha.txlog.engine.queues import GENESIS
from brokerha.txlog.engine.rounds import RoundEngine

PROPS = {
    "node-id": "dc1",
    "master-url": "brokerha://dc1:5672",
    "peer.1.id": "dc2",
    "peer.1.url": "brokerha://dc2:5672",
    "peer.2.id": "dc3",
    "peer.2.url": "brokerha://dc3:5672",
    "split-recovery": "SiMpLe",
    "max-peer-lag": "60000",
    "tx-log-max-size": "500",
}


def test_properties_parse_into_a_config_with_defaults() -> None:
    config = TxLogConfig.from_properties(PROPS)
    assert config.node_id == "dc1" and config.master_url == "brokerha://dc1:5672"
    assert config.peers == (Peer("dc2", "brokerha://dc2:5672"), Peer("dc3", "brokerha://dc3:5672"))
    assert config.split_recovery is SplitRecovery.SIMPLE
    assert config.tx_log_max_size == 500 and config.tx_log_max_depth_hours == 168.0
    assert config.max_depth_ms == 168 * 3_600_000
    assert TxLogConfig(node_id="x").tx_log_max_size == 100_000


@pytest.mark.parametrize("value", ["none", "NONE", "Simple", " smart "])
def test_split_recovery_is_case_insensitive(value: str) -> None:
    assert SplitRecovery.parse(value).value == value.strip().lower()


def test_unknown_split_recovery_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError, match="split-recovery: 'fast' is not one of None, Simple, Smart"):
        TxLogConfig.from_properties({**PROPS, "split-recovery": "fast"})


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"peer.5.url": "u"}, "peer.5.id: required"),
        ({"peer.1.id": "dc1"}, "own node-id"),
        ({"peer.3.id": "dc2"}, "duplicate"),
        ({"max-peer-lag": "100"}, "max-peer-lag: must exceed"),
        ({"round-timeout": "abc"}, "round-timeout: 'abc' is not a number"),
        ({"node-id": ""}, "node-id: required"),
        ({"peer.x": "1"}, "expected peer.<n>.id"),
    ],
)
def test_invalid_settings_are_refused_with_the_key(props: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TxLogConfig.from_properties({**PROPS, **props})


def test_posts_from_unknown_peers_are_refused() -> None:
    engine = RoundEngine(TxLogConfig.from_properties(PROPS), 0)
    stranger = Post("dc9", 0, frozenset({"dc9"}), GENESIS, 5, ())
    assert engine.received(stranger, 10) == [Refused("dc9", "not a configured sync peer")]


def test_peers_are_added_and_removed_at_runtime() -> None:
    engine = RoundEngine(TxLogConfig.from_properties(PROPS), 0)
    engine.add_peer("dc4", "brokerha://dc4", 10)
    assert "dc4" in engine.config.peer_ids and "dc4" not in engine.members  # joins through a vote
    with pytest.raises(ConfigError, match="already configured"):
        engine.add_peer("dc2", "u", 10)
    engine.remove_peer("dc3", 20)
    assert "dc3" not in engine.members and not engine.split
    with pytest.raises(ConfigError, match="not a configured peer"):
        engine.remove_peer("dc7", 20)


def test_split_recovery_cannot_change_during_a_split() -> None:
    config = TxLogConfig.from_properties({**PROPS, "max-peer-lag": "2000"})
    engine = RoundEngine(config, 0)
    engine.set_split_recovery("none")
    assert engine.durable.strategy is SplitRecovery.NONE
    engine.tick(2_500)  # nobody heard for longer than MaxPeerLag: split
    assert engine.split
    with pytest.raises(ConfigError, match="during a split"):
        engine.set_split_recovery("smart")
