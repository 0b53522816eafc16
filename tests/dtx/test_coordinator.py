"""Two-phase commit across brokerha and PostgreSQL, with crashes between the phases.

The worked example of docs/dtx.md: consume a message and insert a row exactly
once. Crashes of the coordinator (before and after its commit record), of the
broker (SIGKILL after prepare) and of the database (immediate stop after
prepare) must all end with the row and the ack on both sides, or on neither.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
import sqlalchemy as sa

from brokerha.client.dtx import XA_OK, Coordinator, CoordinatorLog, PikaXAResource
from brokerha.testing import NodeProcess

psycopg = pytest.importorskip("psycopg")

ROWS = sa.Table("orders", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                sa.Column("body", sa.LargeBinary))


@pytest.fixture(scope="module")
def pg_server() -> Iterator[tuple[Any, str]]:
    """(the server, a fresh database URL on it); a local server can be crash-restarted."""
    from brokerha.testing_postgres import create_database, throwaway_server

    try:
        server = throwaway_server()
        url = server.__enter__()
    except LookupError as exc:
        pytest.skip(str(exc))
    try:
        yield url, create_database(url, f"xa_{uuid.uuid4().hex[:8]}")
    finally:
        server.__exit__(None, None, None)


@pytest.fixture()
def engine(pg_server: tuple[Any, str]) -> Iterator[sa.Engine]:
    engine = sa.create_engine(pg_server[1])
    ROWS.metadata.drop_all(engine)
    ROWS.metadata.create_all(engine)
    yield engine
    engine.dispose()


class Rig:
    """A node, a pika channel with an XA resource, a queue with one order in it."""

    def __init__(self, tmp: Path, engine: sa.Engine, server: Any) -> None:
        self.data = tmp / "node"
        self.engine = engine
        self.server = server
        self.log_path = tmp / "tm.log"
        self.queue = "orders-in"
        self.node = NodeProcess("xa", data_dir=self.data).start()
        self.connect()
        self.channel.queue_declare(self.queue, durable=True)
        self.channel.basic_publish("", self.queue, b"order-1",
                                   pika.BasicProperties(delivery_mode=2))

    def connect(self) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(self.node.url))
        self.channel = self.conn.channel()
        self.xa = PikaXAResource(self.channel)
        self.coordinator = Coordinator(CoordinatorLog(self.log_path), self.xa, self.engine)

    def restart_node(self) -> None:
        self.node.kill()
        self.node = NodeProcess("xa", port=self.node.port, data_dir=self.data).start()
        self.connect()

    def prepare_both(self) -> str:
        """Run a global transaction up to (not including) the commit decision."""
        gtrid = uuid.uuid4().hex
        xid = Coordinator.xid(gtrid)
        self.xa.start(xid)
        conn = self.engine.connect()
        db_tx = conn.begin_twophase(Coordinator.db_xid(gtrid))
        method, _, body = self.channel.basic_get(self.queue)
        conn.execute(ROWS.insert().values(body=body))
        self.channel.basic_ack(method.delivery_tag)
        self.xa.end(xid)
        assert self.xa.prepare(xid) == XA_OK
        db_tx.prepare()
        conn.invalidate()  # the coordinator "dies" holding nothing
        return gtrid

    def outcome(self) -> tuple[int, int]:
        """(rows in the table, messages left on the queue)."""
        with self.engine.connect() as c:
            rows = c.execute(sa.select(sa.func.count()).select_from(ROWS)).scalar_one()
        depth = self.channel.queue_declare(self.queue, passive=True).method.message_count
        return int(rows), depth

    def crash_database(self) -> None:
        """pg_ctl -m immediate stop (no checkpoint), then start on the same data dir and port."""
        if not hasattr(self.server, "restart"):
            pytest.skip("the PostgreSQL server in use (a container) cannot be crash-restarted")
        self.server.restart()
        self.engine.dispose()  # pooled connections died with the server

    def in_doubt_on_db(self) -> list[str]:
        with self.engine.connect() as c:
            return [str(x) for x in c.recover_twophase()]

    def close(self) -> None:
        if self.conn.is_open:
            self.conn.close()
        self.node.close()


@pytest.fixture()
def rig(tmp_path: Path, engine: sa.Engine, pg_server: tuple[Any, str]) -> Iterator[Rig]:
    r = Rig(tmp_path, engine, pg_server[0])
    yield r
    r.close()


def test_happy_path_consumes_and_inserts_exactly_once(rig: Rig) -> None:
    with rig.coordinator.transaction() as (db, _gtrid):
        method, _, body = rig.channel.basic_get(rig.queue)
        db.execute(ROWS.insert().values(body=body))
        rig.channel.basic_ack(method.delivery_tag)
    assert rig.outcome() == (1, 0)


def test_failure_inside_the_block_rolls_back_both(rig: Rig) -> None:
    with pytest.raises(RuntimeError), rig.coordinator.transaction() as (db, _gtrid):
        method, _, body = rig.channel.basic_get(rig.queue)
        db.execute(ROWS.insert().values(body=body))
        rig.channel.basic_ack(method.delivery_tag)
        raise RuntimeError("application failure")
    assert rig.outcome() == (0, 1)


def test_coordinator_crash_before_its_commit_record_rolls_back_everywhere(rig: Rig) -> None:
    rig.prepare_both()
    done = rig.coordinator.recover()
    assert list(done.values()) == ["rolled back"]
    assert rig.outcome() == (0, 1)


def test_coordinator_crash_after_its_commit_record_commits_everywhere(rig: Rig) -> None:
    gtrid = rig.prepare_both()
    rig.coordinator.log.append(gtrid, "commit")
    assert rig.coordinator.recover() == {gtrid: "committed"}
    assert rig.outcome() == (1, 0)
    assert rig.coordinator.recover() == {}  # nothing left in doubt


def test_broker_sigkill_after_prepare_keeps_the_branch_in_doubt(rig: Rig) -> None:
    gtrid = rig.prepare_both()
    rig.coordinator.log.append(gtrid, "commit")
    rig.restart_node()
    assert Coordinator.xid(gtrid) in rig.xa.recover()
    assert rig.coordinator.recover() == {gtrid: "committed"}
    assert rig.outcome() == (1, 0)


def test_broker_sigkill_after_prepare_then_rollback(rig: Rig) -> None:
    rig.prepare_both()
    rig.restart_node()
    assert list(rig.coordinator.recover().values()) == ["rolled back"]
    assert rig.outcome() == (0, 1)


def test_db_crash_after_prepare_with_commit_record_commits_both(rig: Rig) -> None:
    gtrid = rig.prepare_both()
    rig.coordinator.log.append(gtrid, "commit")
    rig.crash_database()
    assert Coordinator.db_xid(gtrid) in rig.in_doubt_on_db()  # came back from the WAL
    assert Coordinator.xid(gtrid) in rig.xa.recover()
    assert rig.coordinator.recover() == {gtrid: "committed"}
    assert rig.outcome() == (1, 0)
    assert rig.in_doubt_on_db() == [] and rig.xa.recover() == []
    assert rig.coordinator.recover() == {}


def test_db_crash_after_prepare_without_commit_record_rolls_back_both(rig: Rig) -> None:
    gtrid = rig.prepare_both()
    rig.crash_database()
    assert Coordinator.db_xid(gtrid) in rig.in_doubt_on_db()
    assert rig.coordinator.recover() == {gtrid: "rolled back"}
    assert rig.outcome() == (0, 1)
    assert rig.in_doubt_on_db() == [] and rig.xa.recover() == []
