"""A throw-away PostgreSQL server for the store tests and benchmarks.

With a reachable Docker engine and testcontainers installed, a
PostgresContainer; otherwise a local cluster made with ``initdb`` and started
with ``pg_ctl`` on a free loopback port in a temporary directory (as the
``postgres`` user when running as root, since PostgreSQL refuses to run as
root). ``scripts/ensure-postgresql`` installs the binaries.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from brokerha.testing import free_port

PG_USER = "brokerha"


def find_pg_bin() -> Path | None:
    """The newest /usr/lib/postgresql/*/bin holding initdb, or one on PATH."""
    def version(initdb: str) -> int:
        name = Path(initdb).parent.parent.name
        return int(name) if name.isdigit() else 0

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).resolve().parent if on_path else None


POSTGRES_IMAGE = "postgres:16-alpine"


def _postgres_container_class() -> Any:
    """testcontainers' PostgresContainer (``community`` since 4.x; the old path before)."""
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:
        from testcontainers.postgres import PostgresContainer  # type: ignore[no-redef]
    return PostgresContainer


def docker_available() -> bool:
    """A Docker engine answers, testcontainers is installed and the image is at hand.

    The image must already be in the engine (or a registry reachable): an
    engine without a registry, as on the project's machines, falls back to a
    local initdb cluster instead of failing on a pull.
    """
    if shutil.which("docker") is None:
        return False
    try:
        _postgres_container_class()
    except ImportError:
        return False
    probe = subprocess.run(["docker", "image", "inspect", POSTGRES_IMAGE], capture_output=True,
                           timeout=10)
    return probe.returncode == 0


@contextlib.contextmanager
def throwaway_server() -> Iterator[str]:
    """A server URL (``postgresql+psycopg://``) for the duration of the block.

    Raises LookupError when there is neither a Docker engine nor initdb.
    """
    if docker_available():
        with container_server() as url:
            yield url
        return
    bin_dir = find_pg_bin()
    if bin_dir is None:
        raise LookupError("PostgreSQL binaries absent (no Docker engine, no initdb): "
                          "run scripts/ensure-postgresql")
    with local_server(bin_dir) as url:
        yield url


@contextlib.contextmanager
def container_server() -> Iterator[str]:
    PostgresContainer = _postgres_container_class()  # noqa: N806

    with PostgresContainer(POSTGRES_IMAGE, driver="psycopg") as pg:
        yield pg.get_connection_url()


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL will not run as root: drop to the postgres user when we are root."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def _run(cmd: list[str]) -> None:
    done = subprocess.run(_as_postgres(cmd), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")


class LocalServerURL(str):
    """The server URL (a plain ``str`` to existing callers) that can also restart the server.

    ``.url`` is the URL; ``.restart()`` stops the server with ``pg_ctl -m immediate``
    (a crash: no checkpoint, prepared transactions must come back from the WAL) and
    starts it again on the same data directory and port.
    """

    pg_ctl: Path
    data: Path
    logfile: Path
    options: str

    @property
    def url(self) -> str:
        return str(self)

    def stop(self) -> None:
        _run([str(self.pg_ctl), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def start(self) -> None:
        _run([str(self.pg_ctl), "-D", str(self.data), "-l", str(self.logfile), "-o", self.options,
              "-w", "-t", "60", "start"])

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def local_server(bin_dir: Path) -> Iterator[LocalServerURL]:
    """initdb + pg_ctl start in a temporary directory; the cluster is removed afterwards.

    Yields a ``LocalServerURL``: a ``str`` with ``.url`` and ``.restart()``.
    """
    root = Path(tempfile.mkdtemp(prefix="brokerha-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    try:
        _run([str(bin_dir / "initdb"), "-D", str(data), "-U", PG_USER, "-A", "trust",
              "--no-sync", "-E", "UTF8"])
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=50 -c max_prepared_transactions=20"
        server = LocalServerURL(f"postgresql+psycopg://{PG_USER}@127.0.0.1:{port}/postgres")
        server.pg_ctl, server.data, server.logfile = bin_dir / "pg_ctl", data, root / "log"
        server.options = options
        server.start()
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def create_database(server_url: str, name: str) -> str:
    """A fresh, empty database on the server; returns its URL."""
    import psycopg

    dsn = server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server_url.rsplit("/", 1)[0] + f"/{name}"
