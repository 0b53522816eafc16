"""Fixtures: a store URL per backend (SQLite file, fresh PostgreSQL database)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerha.testing_postgres import create_database, throwaway_server

_databases = itertools.count(1)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """A PostgreSQL server for the session (container, else a local initdb cluster)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install -e '.[postgresql]')")
    try:
        server = throwaway_server()
        url = server.__enter__()
    except LookupError as exc:
        pytest.skip(str(exc))
    try:
        yield url
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL to an empty store of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    server = request.getfixturevalue("pg_server")
    return create_database(server, f"store_test_{next(_databases)}")
