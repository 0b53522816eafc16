"""scripts/pytest_jobs.py: the two sessions of scripts/test cover tests/ once, and their
exit statuses combine so that a failure or an empty run is never a pass."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pytest_jobs", ROOT / "scripts" / "pytest_jobs.py")
assert _spec is not None and _spec.loader is not None
jobs = importlib.util.module_from_spec(_spec)
sys.modules["pytest_jobs"] = jobs
_spec.loader.exec_module(jobs)


def test_the_halves_hold_every_test_directory_and_module_once() -> None:
    a, b = jobs.halves()
    assert a == [f"tests/{d}" for d in jobs.FIRST]
    assert not set(a) & set(b)
    wanted = {f"tests/{p.relative_to(ROOT / 'tests').parts[0]}"
              for p in (ROOT / "tests").rglob("test_*.py")}
    assert set(a) | set(b) == wanted
    assert "tests/test_pytest_jobs.py" in b and "tests/differential" in b


def test_a_new_directory_goes_to_the_second_half(tmp_path: Path) -> None:
    for d in ("failover", "newthing", "helpers_only"):
        (tmp_path / d).mkdir()
    (tmp_path / "failover" / "test_x.py").write_text("")
    (tmp_path / "newthing" / "test_y.py").write_text("")
    (tmp_path / "helpers_only" / "util.py").write_text("")
    (tmp_path / "test_top.py").write_text("")
    (tmp_path / "netns.py").write_text("")
    assert jobs.halves(tmp_path, ("failover", "txlog")) == (
        ["tests/failover"], ["tests/newthing", "tests/test_top.py"])


def test_arguments_naming_a_path_run_one_session() -> None:
    assert jobs.names_a_path(["tests/ha"])
    assert jobs.names_a_path(["-q", "tests/test_slices.py::test_x"])
    assert not jobs.names_a_path(["-m", "slow", "-k", "tests", "--durations", "30"])
    assert not jobs.names_a_path([])


def test_exit_statuses_combine_failing_closed() -> None:
    assert jobs.combined([0, 0]) == 0
    assert jobs.combined([0, 5]) == 0  # one half had nothing under -m slow, the other passed
    assert jobs.combined([5, 5]) == 1  # nothing collected at all
    assert jobs.combined([1, 0]) == 1
    assert jobs.combined([0, 2]) == 2  # interrupted
    assert jobs.combined([5, 1]) == 1


def test_each_session_starts_its_nodes_on_its_own_stripe_of_ports() -> None:
    from brokerha.testing import STRIPE_ENV

    assert [jobs.stripe_env(i)[STRIPE_ENV] for i in (0, 1)] == ["0/2", "1/2"]
