"""The hot modules compiled with mypyc (brokerha/native.py): built, used, and never stale."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from brokerha import native

# what scripts/ensure-compiler checks before the build
CAN_COMPILE = bool(shutil.which("cc")) and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()


def _run(code: str, **env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != native.PURE_ENV} | env
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment,
        cwd=native.PACKAGE.parent, check=True, timeout=60,
    )
    return done.stdout + done.stderr


SHOW_QUEUE = "import brokerha.broker.queue as q, brokerha.native as n; print(n.MODE); print(q.__file__)"


@pytest.mark.skipif(not CAN_COMPILE, reason="no C compiler or Python.h: the broker runs as plain Python")
def test_the_hot_modules_run_compiled() -> None:
    """scripts/setup built them and nothing changed since: the node imports the C modules."""
    if os.environ.get(native.PURE_ENV, "") not in ("", "0"):
        pytest.skip(f"{native.PURE_ENV} is set: this run tests the plain-Python modules")
    assert native.read_manifest(), "not built: run `brokerha native build` (scripts/setup does)"
    assert native.MODE == "compiled", native.MODE
    assert native.status()["modules"] == {m: "compiled" for m in native.MODULES}
    out = _run(SHOW_QUEUE)
    assert out.splitlines()[0] == "compiled"
    assert not out.splitlines()[1].endswith(".py")


@pytest.mark.skipif(not native.read_manifest(), reason="the compiled modules are not built")
def test_pure_python_on_request() -> None:
    out = _run(SHOW_QUEUE, **{native.PURE_ENV: "1"})
    mode, path = out.splitlines()[:2]
    assert mode == f"pure ({native.PURE_ENV} is set)"
    assert path.endswith("queue.py")


def test_a_changed_source_is_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module edited after the build makes every compiled module load from source."""
    module = "brokerha.broker.queue"
    fresh = {m: native.source_digest(m) for m in native.MODULES}
    assert native.stale_modules(fresh) == []
    edited = fresh | {module: "0" * 64}
    assert native.stale_modules(edited) == [module]
    assert native.stale_modules({"brokerha.gone": "0" * 64}) == ["brokerha.gone"]

    manifest = tmp_path / "_native.json"
    manifest.write_text(json.dumps({"modules": edited}))
    monkeypatch.setattr(native, "MANIFEST", manifest)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    with pytest.warns(RuntimeWarning, match="brokerha.broker.queue changed since"):
        mode = native.guard()
    assert mode.startswith("pure (brokerha.broker.queue changed")
    finder = next(f for f in sys.meta_path if isinstance(f, native.SourceFinder))
    assert finder.modules == set(edited) | set(native.MODULES)  # all of them, not only the edited one
    spec = finder.find_spec("brokerha.amqp.frames", None)
    assert spec is not None and spec.origin == str(native.source_path("brokerha.amqp.frames"))
    assert finder.find_spec("brokerha.broker.exchange", None) is None


def test_nothing_built_is_plain_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "MANIFEST", tmp_path / "missing.json")
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if not isinstance(f, native.SourceFinder)])
    assert native.read_manifest() == {}
    assert native.guard() == "pure (not built)"
    # an extension left behind without its manifest (a half-done clean) is not loaded
    finder = next(f for f in sys.meta_path if isinstance(f, native.SourceFinder))
    assert finder.modules == set(native.MODULES)
    (tmp_path / "missing.json").write_text("not json")
    assert native.read_manifest() == {}


def test_every_compiled_module_is_checked_by_mypy_strict() -> None:
    """CI's mypy run covers what mypyc compiles, so a type error fails the check, not the build."""
    import tomllib

    config = tomllib.loads((native.PACKAGE.parent / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True
    checked = [Path(f) for f in config["files"]]
    root = native.PACKAGE.parent
    for module in native.MODULES:
        path = native.source_path(module).relative_to(root)
        assert any(path == c or c in path.parents for c in checked), f"{path} not in [tool.mypy] files"
