"""The `brokerha node` process: start, ready line, clean shutdown, config errors."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pika
import pytest

from brokerha.node.config import ConfigError, NodeConfig, apply_document, parse_size
from brokerha.testing import NodeProcess


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_sigterm_closes_clients_with_connection_forced(tmp_path: Path, event_loop: str) -> None:
    """On both event loops (``[node] event_loop``): serve, then shut down cleanly."""
    with NodeProcess("n1", data_dir=tmp_path / "data",
                     extra_args=["--event-loop", event_loop]) as node:
        assert any(f"event loop: {event_loop}" in line for line in node.log)
        assert (tmp_path / "data").is_dir()
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        ch = conn.channel()
        ch.queue_declare("q")
        closed: list[BaseException] = []

        def wait() -> None:
            try:
                conn.process_data_events(time_limit=10)
            except pika.exceptions.ConnectionClosedByBroker as exc:
                closed.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.2)
        assert node.stop() == 0
        t.join(15)
        assert closed and closed[0].reply_code == 320
        assert "shutdown" in closed[0].reply_text
        assert any("stopped" in line for line in node.log)


def test_config_file_users_and_vhosts(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text(
        '[node]\nname = "cfg"\n\n[[vhosts]]\nname = "vh1"\n\n'
        '[[users]]\nname = "alice"\npassword = "secret"\n\n'
        '[[permissions]]\nuser = "alice"\nvhost = "vh1"\nconfigure = "^alice-"\n'
    )
    with NodeProcess("cfg", data_dir=tmp_path / "d", extra_args=["--config", str(cfg)]) as node:
        url = f"amqp://alice:secret@127.0.0.1:{node.port}/vh1"
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        ch.queue_declare("alice-q")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
            ch.queue_declare("other")
        assert info.value.reply_code == 403
        conn.close()
        bad = f"amqp://alice:wrong@127.0.0.1:{node.port}/vh1"
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            pika.BlockingConnection(pika.URLParameters(bad))


def test_bad_config_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[node]\nlisten = 'nowhere'\n")
    proc = subprocess.run([sys.executable, "-m", "brokerha.cli", "node", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "listen: expected HOST:PORT" in proc.stderr


def test_event_loop_choice() -> None:
    cfg = NodeConfig()
    assert cfg.event_loop == "auto"
    apply_document({"node": {"event_loop": "asyncio"}}, cfg)
    assert cfg.event_loop == "asyncio"
    with pytest.raises(ConfigError, match="event_loop: expected one of auto, uvloop, asyncio"):
        apply_document({"node": {"event_loop": "trio"}}, NodeConfig())


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        apply_document({"node": {"nmae": "typo"}}, NodeConfig())
    with pytest.raises(ConfigError, match="unknown vhost"):
        apply_document({"permissions": [{"user": "guest", "vhost": "nope"}]}, NodeConfig())


def test_sizes() -> None:
    assert parse_size("512MiB", "k") == 512 * 2**20
    assert parse_size(1000, "k") == 1000
    with pytest.raises(ConfigError):
        parse_size("lots", "k")


def test_port_in_use_fails_cleanly(tmp_path: Path) -> None:
    with NodeProcess("a", data_dir=tmp_path / "a") as node:
        proc = subprocess.run(
            [sys.executable, "-m", "brokerha.cli", "node", "--listen",
             f"127.0.0.1:{node.port}", "--data", str(tmp_path / "b")],
            capture_output=True, text=True, timeout=30)
        assert proc.returncode == 1
        assert "cannot start" in proc.stdout + proc.stderr
