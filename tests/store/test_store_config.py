"""Choosing the store: [store] keys, --store flags, and what each value opens."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from brokerha.broker.storage import MemoryStore
from brokerha.node import config_from_args, register
from brokerha.node.config import ConfigError, NodeConfig, apply_document
from brokerha.store.factory import open_store
from brokerha.store.sql import SQLStore, StoreError


def test_store_section_is_read_and_checked() -> None:
    cfg = apply_document({"store": {"url": "memory", "synchronous": "NORMAL"}}, NodeConfig())
    assert (cfg.store.url, cfg.store.synchronous) == ("memory", "normal")
    with pytest.raises(ConfigError, match="unknown key"):
        apply_document({"store": {"uri": "x"}}, NodeConfig())
    with pytest.raises(ConfigError, match="store.synchronous"):
        apply_document({"store": {"synchronous": "off"}}, NodeConfig())


def test_flags_override_the_file(tmp_path: Path) -> None:
    toml = tmp_path / "n.toml"
    toml.write_text('[store]\nurl = "memory"\n')
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["--config", str(toml), "--store", "sqlite:///x.db",
                              "--store-synchronous", "normal"])
    cfg, _ = config_from_args(args)
    assert (cfg.store.url, cfg.store.synchronous) == ("sqlite:///x.db", "normal")


def test_default_store_is_sqlite_in_the_data_dir(tmp_path: Path) -> None:
    store = open_store(None, tmp_path / "data")
    assert isinstance(store, SQLStore)
    assert (tmp_path / "data" / "brokerha.db").exists()
    store.close()
    assert isinstance(open_store("memory", tmp_path), MemoryStore)


def test_unusable_store_urls_are_refused(tmp_path: Path) -> None:
    for url in ("nosuchdb://x", "sqlite://", "mysql://u@127.0.0.1/x"):
        with pytest.raises(StoreError):
            open_store(url, tmp_path)
