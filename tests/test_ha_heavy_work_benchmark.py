"""benchmarks/ha_heavy_work.py's own accounting (issue 33, eleventh session): ``--shares``
refused with ``--burners``, the CPU split of a window (burners, the benchmark's tree,
others), the threads' run-queue waits, and the flow-control seconds read from a node's
``/metrics`` as the node writes them. No broker is started.
"""

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from brokerha.admin.metrics import NodeCollector
from brokerha.broker.flow import PublishFlow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ha_heavy_work  # noqa: E402
from ha_heavy_work import CpuSplit, parse_args, parse_flow, sched_times  # noqa: E402


def test_shares_with_burners_is_refused_either_alone_is_taken(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--shares", "16384", "--burners", "2"])
    assert "kernel's own threads" in capsys.readouterr().err
    assert parse_args(["--shares", "16384"]).shares == 16384
    assert parse_args(["--burners", "2"]).burners == 2


def _until(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_a_burner_started_here_is_ours_and_a_burner_one_left_is_others() -> None:
    before = CpuSplit.now()
    ours = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
    try:  # a child: in this process's tree, named yes
        assert _until(lambda: CpuSplit.now().burners - before.burners >= 0.1)
        after = CpuSplit.now()
        assert after.ours - before.ours >= after.burners - before.burners
    finally:
        ours.kill()
        ours.wait()
    # a burner whose parent exited is not in the tree: its CPU is the others'
    orphan = int(subprocess.run(["sh", "-c", "yes > /dev/null 2>&1 & echo $!"],
                                capture_output=True, text=True, check=True).stdout)
    try:
        start = CpuSplit.now()

        def others() -> float:
            now = CpuSplit.now()
            return now.machine - start.machine - (now.ours - start.ours)

        assert _until(lambda: others() >= 0.1)
        assert CpuSplit.now().burners - start.burners < 0.05  # not counted as ours
        note = CpuSplit.now().note(start, 1.0)
        assert note.startswith("CPU in it (s, 1.00 s x ") and "others" in note
    finally:
        os.kill(orphan, 9)


def test_sched_times_count_this_process_running() -> None:
    loop_wait, wait, ran = sched_times(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert sched_times(os.getpid())[2] >= ran + 0.04
    assert wait >= loop_wait >= 0.0
    assert sched_times(2**22 + 7) == (0.0, 0.0, 0.0)  # no such process


def test_flow_seconds_are_read_as_a_node_exposes_them() -> None:
    now = [100.0]
    flow = PublishFlow(clock=lambda: now[0])
    flow.hold("primary", "backup n2 has not acknowledged", cause="n2")
    now[0] += 1.5
    flow.release("primary")
    flow.hold("primary", "again", cause="n3")
    now[0] += 0.25
    collector = NodeCollector.__new__(NodeCollector)
    collector.node = SimpleNamespace(broker=SimpleNamespace(flow=flow))  # type: ignore[assignment]
    registry = CollectorRegistry()

    class Flow:
        def collect(self) -> object:
            return collector._flow()

    registry.register(Flow())  # type: ignore[arg-type]
    assert parse_flow(generate_latest(registry).decode()) == (1.75, 2.0)
    assert parse_flow("") == (0.0, 0.0)
    assert ha_heavy_work.FLOW_HELD.startswith("brokerha_publisher_flow_held_seconds")
