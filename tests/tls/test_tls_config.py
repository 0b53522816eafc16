"""amqps in a cluster member's configuration: its [[cluster.nodes]] entry decides, as for AMQP."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from brokerha.node import config_from_args, register
from brokerha.node.config import ConfigError

SECRET = "0123456789abcdef0123"


def args(tmp_path: Path, *argv: str, n1_amqps: bool = True) -> argparse.Namespace:
    amqps = 'amqps = "127.0.0.1:5900"\n' if n1_amqps else ""
    (tmp_path / "c.toml").write_text(
        f'[cluster]\nname = "dc1"\nsecret = "{SECRET}"\n'
        f'[[cluster.nodes]]\nname = "n1"\namqp = "127.0.0.1:5800"\n{amqps}'
        '[[cluster.nodes]]\nname = "n2"\namqp = "127.0.0.1:5801"\n'
        '[tls]\ncert = "n.pem"\nkey = "n.key"\n')
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(["--config", str(tmp_path / "c.toml"), *argv])


def test_a_member_takes_its_amqps_address_from_its_entry(tmp_path: Path) -> None:
    cfg, _ = config_from_args(args(tmp_path, "--name", "n1"))
    assert cfg.amqps_listen == ("127.0.0.1", 5900) and cfg.amqp_plain
    assert cfg.tls.cert == tmp_path / "n.pem"  # relative to the file
    cfg, _ = config_from_args(args(tmp_path, "--name", "n1", "--amqps-listen", "127.0.0.1:5900"))
    assert cfg.amqps_listen == ("127.0.0.1", 5900)
    # plain AMQP off: a member with an amqps address serves (and relays) amqps only
    cfg, _ = config_from_args(args(tmp_path, "--name", "n1", "--listen", "off"))
    assert not cfg.amqp_plain and cfg.amqps_listen == ("127.0.0.1", 5900)
    cfg, _ = config_from_args(args(tmp_path, "--name", "n2"))
    assert cfg.amqps_listen is None
    # one without would serve nobody
    with pytest.raises(ConfigError, match="a cluster member without an amqps address"):
        config_from_args(args(tmp_path, "--name", "n2", "--listen", "off"))


def test_amqps_flags_that_contradict_the_entry_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--amqps-listen 127.0.0.1:5999 contradicts"):
        config_from_args(args(tmp_path, "--name", "n1", "--amqps-listen", "127.0.0.1:5999"))
    with pytest.raises(ConfigError, match="has no amqps address in"):
        config_from_args(args(tmp_path, "--name", "n2", "--amqps-listen", "127.0.0.1:5999"))


def test_link_tls_files_that_do_not_load_are_refused_at_start_naming_them(
        tmp_path: Path, certs: object) -> None:
    from brokerha.node.cluster_config import parse_cluster
    from brokerha.txlog.engine.config import ConfigError as TxLogConfigError
    from brokerha.txlog.master.settings import from_properties

    d = certs.dir  # type: ignore[attr-defined]
    table = {"name": "dc1", "secret": SECRET, "nodes": [{"name": "n1", "amqp": "127.0.0.1:1"}],
             "tls": {"cert": str(d / "server.pem"), "key": str(d / "ca.key"),
                     "ca": str(d / "ca.pem")}}
    with pytest.raises(ConfigError, match=r"cluster.tls: certificate .*server.pem with key "
                                          r".*ca.key: .*KEY_VALUES_MISMATCH"):
        parse_cluster(table, "t", tmp_path)
    props = {"node-id": "dc1", "master-url": "txlog://127.0.0.1:1", "group": "g",
             "secret": "s", "data-dir": "data", "peer.1.id": "dc2",
             "peer.1.url": "txlog://127.0.0.1:2", "tls.cert": str(d / "server.pem"),
             "tls.key": str(d / "server.key"), "tls.ca": str(d / "server.key")}
    with pytest.raises(TxLogConfigError, match=r"tls: CA file .*server.key: "):
        from_properties(props, tmp_path)
