"""The [cluster] section: a node finds itself in the member list, bad tables are refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from brokerha.node import config_from_args, register
from brokerha.node.cluster_config import parse_cluster
from brokerha.node.config import ConfigError

SECRET = "0123456789abcdef0123"


def table(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "name": "dc1", "secret": SECRET,
        "nodes": [{"name": "n1", "amqp": "127.0.0.1:5672"},
                  {"name": "n2", "amqp": "127.0.0.1:5673", "admin": "127.0.0.1:9000",
                   "cluster": "127.0.0.1:9100"}],
    }
    base.update(overrides)
    return base


def test_ports_default_to_rabbitmq_offsets_unless_given() -> None:
    cfg = parse_cluster(table(), "t", Path("."))
    n1, n2 = cfg.members
    assert (n1.admin, n1.cluster) == (("127.0.0.1", 15672), ("127.0.0.1", 25672))
    assert (n2.admin, n2.cluster) == (("127.0.0.1", 9000), ("127.0.0.1", 9100))
    assert cfg.secret == SECRET.encode() and cfg.replicate == "all"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"secret": "short"}, "at least 16"),
    ({"secret": ""}, "at least 16"),
    ({"name": "bad name!"}, "cluster.name"),
    ({"nodes": []}, "list every node"),
    ({"nodes": [{"name": "a", "amqp": "127.0.0.1:1"}, {"name": "a", "amqp": "127.0.0.1:2"}]},
     "duplicate"),
    ({"nodes": [{"name": "a"}]}, "'amqp'"),
    ({"nodes": [{"name": "a", "amqp": "127.0.0.1:50000"}]}, "not a port"),
    ({"lease_timeout": 2.0}, "lease_timeout < election_timeout"),
    ({"heartbeat_interval": 0}, "positive"),
    ({"backup_unheard_timeout": 0.15}, "exceed two heartbeat intervals"),
    ({"replicate": "some"}, "cluster.replicate"),
    ({"colour": "blue"}, "unknown key"),
    ({"tls": {"cert": "a.pem"}}, "missing"),
])
def test_bad_cluster_tables_are_refused_with_the_reason(overrides: dict[str, object],
                                                         message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cluster(table(**overrides), "t", Path("."))


def test_secret_file_is_read_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(SECRET + "\n")
    tbl = table()
    del tbl["secret"]
    tbl["secret_file"] = "secret"
    assert parse_cluster(tbl, "t", tmp_path).secret == SECRET.encode()


def _args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    (tmp_path / "c.toml").write_text(
        f'[cluster]\nname = "dc1"\nsecret = "{SECRET}"\n'
        '[[cluster.nodes]]\nname = "n1"\namqp = "127.0.0.1:5800"\n'
        '[[cluster.nodes]]\nname = "n2"\namqp = "127.0.0.1:5801"\n')
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(["--config", str(tmp_path / "c.toml"), *argv])


def test_node_takes_its_addresses_from_its_cluster_entry(tmp_path: Path) -> None:
    cfg, cluster = config_from_args(_args(tmp_path, "--name", "n2"))
    assert cluster is not None and cluster.name == "dc1"
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 5801)
    assert cfg.admin_listen == ("127.0.0.1", 15801)


def test_unlisted_node_and_contradicting_listen_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not listed"):
        config_from_args(_args(tmp_path, "--name", "n9"))
    with pytest.raises(ConfigError, match="contradicts"):
        config_from_args(_args(tmp_path, "--name", "n1", "--listen", "127.0.0.1:5999"))


def test_partition_groups_are_off_unless_switched_on_with_p_above_one() -> None:
    """``[cluster] partition_groups`` (issue 35 stage 2): off by default; on, the nodes run
    partition groups only when P > 1 (P defaults to 3 x nodes)."""
    assert not parse_cluster(table(), "t", Path(".")).groups_on
    assert parse_cluster(table(partition_groups=True), "t", Path(".")).groups_on
    assert not parse_cluster(table(partition_groups=True, partitions=1), "t",
                             Path(".")).groups_on
    with pytest.raises(ConfigError, match="partition_groups: expected true or false"):
        parse_cluster(table(partition_groups="yes"), "t", Path("."))


def test_cluster_up_writes_the_partition_groups_switch(tmp_path: Path) -> None:
    from brokerha.admin.cluster_cli import cluster_file

    text = cluster_file(tmp_path / "on", 3, 41000, "dc1", partitions=3,
                        partition_groups=True).read_text()
    assert "partitions = 3\npartition_groups = true\n" in text
    assert "partition_groups" not in cluster_file(tmp_path / "off", 3, 41000, "dc1").read_text()
