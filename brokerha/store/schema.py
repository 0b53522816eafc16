"""The SQL schema of the durable store, and the few raw statements of its hot path.

Tables are declared once with SQLAlchemy Core (creation, recovery and admin
paths go through Core). The writer thread runs plain driver SQL instead,
because Core costs 1.5-2.6x on the per-row path (performance-notes.md,
"Durability"); that SQL is generated here from the same ``Table`` objects so a
column is named in one place only. The statements use ``INSERT ... ON CONFLICT
... DO UPDATE``, which SQLite (3.24+) and PostgreSQL spell the same way.

AMQP argument tables are stored as their AMQP field-table encoding: it is the
one format that round-trips every value a client can send (bytes, decimals,
timestamps, nested tables), and binding identity includes the arguments.
"""

from __future__ import annotations

from typing import Any

import msgpack
from pamqp import decode, encode
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

# 2: message runs (``message_runs``, ``run_marks``); a version-1 database is migrated at
# start (the new tables are created, its ``messages`` rows stay as they are)
SCHEMA_VERSION = "2"
MIGRATES_FROM = ("1",)

metadata = MetaData()

meta = Table(
    "brokerha_meta", metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

exchanges = Table(
    "exchanges", metadata,
    Column("vhost", Text, primary_key=True),
    Column("name", Text, primary_key=True),
    Column("type", Text, nullable=False),
    Column("auto_delete", Boolean, nullable=False),
    Column("internal", Boolean, nullable=False),
    Column("arguments", LargeBinary, nullable=False),
)

queues = Table(
    "queues", metadata,
    Column("vhost", Text, primary_key=True),
    Column("name", Text, primary_key=True),
    Column("auto_delete", Boolean, nullable=False),
    Column("arguments", LargeBinary, nullable=False),
)

bindings = Table(
    "bindings", metadata,
    Column("vhost", Text, primary_key=True),
    Column("source", Text, primary_key=True),
    Column("destination_kind", String(8), primary_key=True),
    Column("destination", Text, primary_key=True),
    Column("routing_key", Text, primary_key=True),
    # encoded with sorted keys, so equal argument tables are equal keys
    Column("arguments", LargeBinary, primary_key=True),
)

messages = Table(
    "messages", metadata,
    Column("vhost", Text, primary_key=True),
    Column("queue", Text, primary_key=True),
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("exchange", Text, nullable=False),
    Column("routing_key", Text, nullable=False),
    Column("header", LargeBinary, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Column("delivered", Boolean, nullable=False),
)

# Message runs (brokerha/store/batch.py ENQUEUED_RUN): the persistent messages at
# consecutive positions of one queue as one row, packed (``batch.pack_run``). A position
# taken off a run (or delivered) is marked in ``run_marks`` until the run is empty, then
# the run and its marks go together (brokerha/store/runs.py).
message_runs = Table(
    "message_runs", metadata,
    Column("vhost", Text, primary_key=True),
    Column("queue", Text, primary_key=True),
    Column("first_position", BigInteger, primary_key=True, autoincrement=False),
    Column("last_position", BigInteger, nullable=False),
    Column("contents", LargeBinary, nullable=False),
)

run_marks = Table(
    "run_marks", metadata,
    Column("vhost", Text, primary_key=True),
    Column("queue", Text, primary_key=True),
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("gone", Boolean, nullable=False),  # taken off the queue; else delivered
)

# The definitions (brokerha/broker/definitions.py): vhosts, users, permissions, topic
# permissions, policies and operator policies, one row each, the value as JSON text.
definitions = Table(
    "definitions", metadata,
    Column("kind", String(32), primary_key=True),
    Column("key", Text, primary_key=True),  # the key's fields as a JSON array
    Column("value", Text, nullable=False),
)

# Prepared XA branches: a prepared branch must survive a crash until commit/rollback.
dtx_branches = Table(
    "dtx_branches", metadata,
    Column("xid", Text, primary_key=True),  # the broker's Xid key (format id, gtrid, bqual)
    Column("state", String(16), nullable=False),  # "prepared"
    Column("payload", LargeBinary, nullable=False),  # msgpack: the branch's publishes and acks
)

# Transactions a backup prepared for its primary (brokerha.backup.tx_buffer): kept
# until the commit or rollback event, or the verification phase, decides them.
ha_transactions = Table(
    "ha_transactions", metadata,
    Column("txid", Text, primary_key=True),
    Column("payload", LargeBinary, nullable=False),  # msgpack, brokerha.backup.tx_buffer
)

# Outcomes of finished transactions (brokerha.broker.tx_outcomes), with retention.
tx_outcomes = Table(
    "tx_outcomes", metadata,
    Column("txid", Text, primary_key=True),
    Column("client_id", Text, nullable=True),
    Column("outcome", String(16), nullable=False),
    Column("at", Float, nullable=False),
)


# -- argument tables ---------------------------------------------------------------------

def _encodable(value: Any) -> Any:
    """pamqp encodes byte arrays only as ``bytearray``; decoded tables may hold ``bytes``."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {k: _encodable(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value


def encode_arguments(arguments: dict[str, Any]) -> bytes:
    """The AMQP field-table encoding of ``arguments``, keys sorted (a stable identity)."""
    return encode.field_table(_encodable(arguments))


def decode_arguments(data: bytes) -> dict[str, Any]:
    _, table = decode.field_table(bytes(data))
    return dict(table)


# -- prepared XA branches ------------------------------------------------------------------

def encode_branch(publishes: list[Any], accepts: list[Any]) -> bytes:
    return msgpack.packb({"publishes": publishes, "accepts": accepts}, use_bin_type=True)


def decode_branch(payload: bytes) -> tuple[list[Any], list[Any]]:
    """(publishes, accepts) with the tuples of ``PreparedBranch`` restored."""
    doc = msgpack.unpackb(bytes(payload), raw=False)
    publishes = [(v, list(names), ex, key, bytes(h), bytes(b))
                 for v, names, ex, key, h, b in doc["publishes"]]
    return publishes, [tuple(a) for a in doc["accepts"]]


# -- raw statements for the writer thread ------------------------------------------------

def _q(name: str) -> str:
    return f'"{name}"'


def _key_columns(table: Table) -> list[str]:
    return [c.name for c in table.primary_key.columns]


def upsert_sql(table: Table, placeholder: str) -> str:
    """Insert a full row, replacing the row with the same primary key."""
    cols = [c.name for c in table.columns]
    keys = _key_columns(table)
    rest = [c for c in cols if c not in keys]
    action = ("DO UPDATE SET " + ", ".join(f"{_q(c)} = excluded.{_q(c)}" for c in rest)
              if rest else "DO NOTHING")
    return (f"INSERT INTO {_q(table.name)} ({', '.join(map(_q, cols))}) "
            f"VALUES ({', '.join([placeholder] * len(cols))}) "
            f"ON CONFLICT ({', '.join(map(_q, keys))}) {action}")


def _where(columns: list[str], placeholder: str) -> str:
    return " AND ".join(f"{_q(c)} = {placeholder}" for c in columns)


def delete_sql(table: Table, placeholder: str, columns: list[str] | None = None) -> str:
    """Delete by primary key, or by ``columns`` (e.g. every message of one queue)."""
    return f"DELETE FROM {_q(table.name)} WHERE {_where(columns or _key_columns(table), placeholder)}"


def delete_range_sql(placeholder: str) -> str:
    """Delete one queue's messages whose positions lie in an inclusive range (a purge)."""
    p = placeholder
    return (f"DELETE FROM {_q(messages.name)} WHERE {_q('vhost')} = {p} AND {_q('queue')} = {p} "
            f"AND {_q('position')} >= {p} AND {_q('position')} <= {p}")


def delete_range_of(table: Table, first: str, last: str, placeholder: str) -> str:
    """Delete one queue's rows of ``table`` lying wholly inside an inclusive range."""
    p = placeholder
    return (f"DELETE FROM {_q(table.name)} WHERE {_q('vhost')} = {p} AND {_q('queue')} = {p} "
            f"AND {_q(first)} >= {p} AND {_q(last)} <= {p}")


def insert_or_keep_sql(table: Table, placeholder: str) -> str:
    """Insert a row unless one with its primary key is there."""
    cols = [c.name for c in table.columns]
    return (f"INSERT INTO {_q(table.name)} ({', '.join(map(_q, cols))}) "
            f"VALUES ({', '.join([placeholder] * len(cols))}) "
            f"ON CONFLICT ({', '.join(map(_q, _key_columns(table)))}) DO NOTHING")


def set_delivered_sql(placeholder: str) -> str:
    return (f"UPDATE {_q(messages.name)} SET {_q('delivered')} = {placeholder} "
            f"WHERE {_where(_key_columns(messages), placeholder)}")


class Statements:
    """Every statement the writer runs, in one driver's parameter style."""

    def __init__(self, placeholder: str) -> None:
        p = placeholder
        self.put_exchange = upsert_sql(exchanges, p)
        self.delete_exchange = delete_sql(exchanges, p)
        self.put_queue = upsert_sql(queues, p)
        self.delete_queue = delete_sql(queues, p)
        self.purge_queue = delete_sql(messages, p, ["vhost", "queue"])
        self.put_binding = upsert_sql(bindings, p)
        self.delete_binding = delete_sql(bindings, p)
        self.put_message = upsert_sql(messages, p)
        self.set_delivered = set_delivered_sql(p)
        self.delete_message = delete_sql(messages, p)
        self.delete_message_range = delete_range_sql(p)
        self.put_run = upsert_sql(message_runs, p)
        self.delete_run = delete_sql(message_runs, p)
        self.delete_run_range = delete_range_of(message_runs, "first_position",
                                                "last_position", p)
        self.purge_queue_runs = delete_sql(message_runs, p, ["vhost", "queue"])
        self.put_run_gone = upsert_sql(run_marks, p)
        self.put_run_delivered = insert_or_keep_sql(run_marks, p)
        self.delete_mark_range = delete_range_of(run_marks, "position", "position", p)
        self.purge_queue_marks = delete_sql(run_marks, p, ["vhost", "queue"])
        self.select_runs = ('SELECT "vhost", "queue", "first_position", "last_position" '
                            'FROM "message_runs"')
        self.select_gone = f'SELECT "vhost", "queue", "position" FROM "run_marks" WHERE "gone" = {p}'
        self.put_dtx_branch = upsert_sql(dtx_branches, p)
        self.delete_dtx_branch = delete_sql(dtx_branches, p)
        self.put_ha_transaction = upsert_sql(ha_transactions, p)
        self.delete_ha_transaction = delete_sql(ha_transactions, p)
        self.put_tx_outcome = upsert_sql(tx_outcomes, p)
        self.put_meta = upsert_sql(meta, p)
        self.delete_tx_outcome = delete_sql(tx_outcomes, p)
        self.put_definition = upsert_sql(definitions, p)
        self.delete_definition = delete_sql(definitions, p)
