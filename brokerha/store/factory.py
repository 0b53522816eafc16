"""Choosing a store from the node's configuration.

The default is SQLite in the data directory, so a node started with no store
option is durable; ``memory`` keeps the old non-durable MemoryStore (tests,
throw-away nodes). Anything else is an SQLAlchemy URL.
"""

from __future__ import annotations

from pathlib import Path

from brokerha.broker.storage import MemoryStore, Store

MEMORY = "memory"
DEFAULT_FILE = "brokerha.db"


def default_url(data_dir: Path) -> str:
    return f"sqlite:///{(data_dir / DEFAULT_FILE).absolute()}"


def open_store(url: str | None, data_dir: Path, synchronous: str = "full",
               oplog: bool = True) -> Store:
    """The store for ``url`` (None: SQLite in ``data_dir``); opens and migrates the schema.

    ``oplog`` puts the operation log in front of an SQLite store (docs/store.md);
    a PostgreSQL store commits every batch to the database either way.
    """
    if url == MEMORY:
        return MemoryStore()
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from brokerha.store.sql import SQLStore, StoreError

    target = url or default_url(data_dir)
    try:
        return SQLStore(target, synchronous=synchronous,
                        oplog=oplog and target.startswith("sqlite"))
    except (ArgumentError, SQLAlchemyError, ImportError) as exc:
        raise StoreError(f"cannot open store {target}: {exc}") from exc
