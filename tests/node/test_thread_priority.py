"""A node's store threads run at a lower CPU priority than its event loop (issue 33)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerha import thread_priority
from brokerha.node.config import ConfigError, NodeConfig, apply_document
from brokerha.store.sql import SQLStore
from brokerha.testing import NodeProcess

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values: Linux")


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def background_nice() -> Iterator[None]:
    yield
    thread_priority.set_background_nice(0)


def test_the_setting_is_a_nice_increment_from_0_to_19() -> None:
    assert NodeConfig().background_nice == 0  # off: not shown to help (docs/operations.md)
    cfg = NodeConfig()
    apply_document({"node": {"background_nice": 0}}, cfg)
    assert cfg.background_nice == 0
    for wrong in (-1, 20, "high", True, 2.5):
        with pytest.raises(ConfigError, match="background_nice: expected a whole number"):
            apply_document({"node": {"background_nice": wrong}}, NodeConfig())


@linux_only
@pytest.mark.usefixtures("background_nice")
def test_a_background_thread_lowers_its_own_priority_not_the_loops() -> None:
    base = nice_of(threading.get_native_id())
    thread_priority.set_background_nice(5)
    seen: dict[str, int | None] = {}

    def background() -> None:
        seen["set"] = thread_priority.lower_this_thread()
        seen["now"] = nice_of(threading.get_native_id())

    thread = threading.Thread(target=background)
    thread.start()
    thread.join(10)
    assert seen == {"set": min(19, base + 5), "now": min(19, base + 5)}
    assert nice_of(threading.get_native_id()) == base  # the calling (loop's) thread: unchanged
    thread_priority.set_background_nice(0)
    thread = threading.Thread(target=background)
    thread.start()
    thread.join(10)
    assert seen == {"set": None, "now": base}  # 0: left alone


@linux_only
@pytest.mark.usefixtures("background_nice")
def test_the_stores_writer_and_log_threads_run_lowered(tmp_path: Path) -> None:
    thread_priority.set_background_nice(7)
    base = nice_of(threading.get_native_id())
    store = SQLStore(f"sqlite:///{tmp_path / 'b.db'}", oplog=True)
    store.load()
    store.start(None)
    try:
        threads = [t for t in threading.enumerate() if t.name.startswith("brokerha-store-")]
        assert {t.name for t in threads} == {"brokerha-store-writer", "brokerha-store-oplog"}
        deadline = time.monotonic() + 10
        while any(nice_of(t.native_id or 0) != min(19, base + 7) for t in threads):
            assert time.monotonic() < deadline, [nice_of(t.native_id or 0) for t in threads]
            time.sleep(0.01)
    finally:
        store.close()
    assert nice_of(threading.get_native_id()) == base


def _thread_nice_values(pid: int) -> list[int]:
    values = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        values.append(int(stat.rsplit(")", 1)[1].split()[16]))  # field 19: nice
    return values


@linux_only
@pytest.mark.timeout(60)
def test_a_node_runs_its_loop_at_its_own_priority_and_its_store_lower(tmp_path: Path) -> None:
    """The node's own process with ``--background-nice 10``: its two store threads at +10,
    every other thread (the loop's, the watchdog, the I/O pool) as started."""
    with NodeProcess("p", data_dir=tmp_path / "p", extra_args=["--background-nice", "10"]) as node:
        assert node.proc is not None
        base = nice_of(node.proc.pid)
        deadline = time.monotonic() + 10
        while True:
            values = _thread_nice_values(node.proc.pid)
            if sorted(values) == sorted([base] * (len(values) - 2) + [min(19, base + 10)] * 2):
                break
            assert time.monotonic() < deadline, values
            time.sleep(0.05)
