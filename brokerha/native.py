"""The hot path's modules compiled to C with mypyc, and the guard that keeps them honest.

``brokerha native build`` (run by ``scripts/setup``) compiles
:data:`MODULES` in place: each gets a ``<module>.cpython-*.so`` beside its
``.py``, and all of them share one library, ``brokerha/_native__mypyc*.so``.
Python imports an extension module before a source file of the same name, so
from then on the node runs the compiled code (docs/benchmarks.md: about a fifth
more confirms per second with two backups, a tenth more transactions).

The build writes ``brokerha/_native.json``: the SHA-256 of each module's source
as compiled. :func:`guard` (run when ``brokerha`` is imported) compares it with
the sources on disk; if any differs -- someone edited a module since the build
-- every compiled module is imported from its source instead, and a warning
says so (all or none: compiled modules call each other inside the shared
library, so a stale one cannot be swapped out alone). ``BROKERHA_PURE_PYTHON=1``
does the same on purpose (py-spy shows line numbers only in Python code).

Without a C compiler or Python's headers the build says why and the broker
runs as plain Python, unchanged in behaviour. Wheels built by pip do not
contain the compiled modules.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).resolve().parent
MANIFEST = PACKAGE / "_native.json"
SHARED_LIBRARY = "brokerha._native"  # mypyc's group name: brokerha/_native__mypyc.*.so
PURE_ENV = "BROKERHA_PURE_PYTHON"

#: Compiled modules: the AMQP connection, codec, channel and basic methods, the broker,
#: queues and messages, the store's batches, the cluster codec and the replication
#: path on both sides. Each must
#: type-check under mypy (mypyc checks annotations at run time).
MODULES = (
    "brokerha.amqp.frames",
    "brokerha.amqp.channel",
    "brokerha.amqp.confirms",
    "brokerha.amqp.consumer",
    "brokerha.broker.content",
    "brokerha.broker.message",
    "brokerha.broker.queue",
    "brokerha.store.batch",
    "brokerha.cluster.protocol",
    "brokerha.primary.events",
    "brokerha.primary.remote_backup",
    "brokerha.backup.queue_replicator",
    "brokerha.amqp.connection",
    "brokerha.amqp.methods.basic",
    "brokerha.broker.broker",
    "brokerha.primary.replicating_subscription",
)


def source_path(module: str) -> Path:
    return PACKAGE.parent.joinpath(*module.split(".")).with_suffix(".py")


def source_digest(module: str) -> str:
    return hashlib.sha256(source_path(module).read_bytes()).hexdigest()


def compiled_path(module: str) -> Path | None:
    """The module's extension file, if one was built for this interpreter."""
    base = source_path(module).with_suffix("")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = base.with_name(base.name + suffix)
        if candidate.exists():
            return candidate
    return None


def read_manifest() -> dict[str, str]:
    """module -> digest of the source it was compiled from ({} when nothing is built)."""
    try:
        data = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return {}
    modules = data.get("modules") if isinstance(data, dict) else None
    return {str(k): str(v) for k, v in modules.items()} if isinstance(modules, dict) else {}


def stale_modules(manifest: dict[str, str]) -> list[str]:
    """Compiled modules whose source changed since the build (or vanished)."""
    stale = []
    for module, digest in manifest.items():
        try:
            if source_digest(module) != digest:
                stale.append(module)
        except OSError:
            stale.append(module)
    return stale


class SourceFinder(importlib.abc.MetaPathFinder):
    """Imports the named modules from their ``.py`` even where an extension exists."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def guard() -> str:
    """Decide, before any compiled module is imported, whether they may be; says which."""
    manifest = read_manifest()
    reason = ""
    if not manifest:  # extensions left without a manifest are not trusted either
        reason = "not built"
    elif os.environ.get(PURE_ENV, "") not in ("", "0"):
        reason = f"{PURE_ENV} is set"
    else:
        stale = stale_modules(manifest)
        if stale:
            reason = (
                f"{', '.join(stale)} changed since `brokerha native build`; "
                "running every compiled module from its source until it is rebuilt"
            )
            warnings.warn(f"brokerha: {reason}", RuntimeWarning, stacklevel=2)
    if reason:
        if not any(isinstance(f, SourceFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, SourceFinder([*MODULES, *manifest]))
        return f"pure ({reason})"
    return "compiled"


def status() -> dict[str, object]:
    """What runs: per module, compiled or source (``brokerha native status``)."""
    modules = {}
    for module in MODULES:
        loaded = sys.modules.get(module) or importlib.import_module(module)
        origin = getattr(loaded, "__file__", "") or ""
        modules[module] = "compiled" if not origin.endswith(".py") else "source"
    return {"mode": MODE, "modules": modules}


# -- the build ------------------------------------------------------------------------


def build(force: bool = False) -> int:
    """Compile :data:`MODULES` in place (a no-op when the manifest matches the sources)."""
    wanted = {m: source_digest(m) for m in MODULES}
    if not force and read_manifest() == wanted and all(compiled_path(m) for m in MODULES):
        print("brokerha.native: compiled modules are up to date")
        return 0
    clean()
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution
    except ImportError as exc:
        print(f"brokerha.native: not compiled ({exc}); install mypy to build", file=sys.stderr)
        return 1
    root = PACKAGE.parent
    build_dir = root / "build" / "native"
    cwd = Path.cwd()
    os.chdir(root)  # mypyc names modules by their path from here
    try:
        extensions = mypycify(
            ["--ignore-missing-imports", *(str(source_path(m).relative_to(root)) for m in MODULES)],
            group_name=SHARED_LIBRARY,
            target_dir=str(build_dir),
        )
        dist = Distribution({"name": "brokerha-native", "ext_modules": extensions})
        dist.script_args = ["build_ext", "--inplace", "--build-temp", str(build_dir / "temp")]
        dist.parse_command_line()
        dist.run_commands()
    except (SystemExit, Exception) as exc:  # a type error, no compiler, no Python.h
        clean()
        print(f"brokerha.native: not compiled ({exc!r}); the broker runs as plain Python",
              file=sys.stderr)
        return 1
    finally:
        os.chdir(cwd)
    MANIFEST.write_text(json.dumps({"modules": wanted}, indent=1, sort_keys=True) + "\n")
    print(f"brokerha.native: compiled {len(MODULES)} modules")
    return 0


def clean() -> None:
    """Remove every compiled module and the manifest (the broker runs as plain Python)."""
    built = read_manifest()
    MANIFEST.unlink(missing_ok=True)
    for module in {*MODULES, *built}:
        path = compiled_path(module)
        if path is not None:
            path.unlink()
    for lib in PACKAGE.glob("_native__mypyc*"):
        lib.unlink()


MODE = guard()


def register(parser: argparse.ArgumentParser) -> None:
    """``brokerha native build|status|clean`` (brokerha/cli.py)."""
    sub = parser.add_subparsers(dest="native_command", metavar="ACTION", required=True)
    p = sub.add_parser("build", help="compile the hot modules with mypyc (no-op when up to date)")
    p.add_argument("--force", action="store_true", help="rebuild even when up to date")
    p.set_defaults(handler=lambda args: build(force=args.force))
    p = sub.add_parser("status", help="which modules run compiled")
    p.set_defaults(handler=lambda args: print(json.dumps(status(), indent=1)))
    p = sub.add_parser("clean", help="remove the compiled modules (plain Python from then on)")
    p.set_defaults(handler=lambda args: clean())
