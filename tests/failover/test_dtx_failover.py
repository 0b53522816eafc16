"""XA branches through ``brokerha.client.dtx`` on three real nodes, the primary SIGKILLed.

- A branch (3 publishes to a durable queue + the ack of the one message on its
  own input queue) is prepared (``XA_OK``), the primary is SIGKILLed; on the
  new primary ``recover`` lists the branch and the test commits or rolls it
  back. The effects are all or nothing on the new primary and, once every node
  is stopped, in every node's store (no prepared branch or tx-queue record
  left behind anywhere).
- The same through the ``Coordinator`` with PostgreSQL (a local initdb
  cluster; skipped when there is none): the coordinator's decision, taken
  before the kill, is carried out by ``recover()`` on the new primary and in
  the database.
- A seeded loop: the primary is killed right after a prepare request is sent,
  right after its ``XA_OK``, or right after a commit request is sent; after
  each failover ``recover`` lists the branch exactly when it may be in doubt,
  the test decides, and at the end every branch is wholly applied exactly when
  it was committed, on every node.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from brokerha.client.dtx import XA_OK, Coordinator, CoordinatorLog
from brokerha.client.dtx.resources import Xid
from brokerha.store.factory import open_store
from brokerha.testing import LocalCluster
from tests.dtx.xa_client import OUT, XAClient
from tests.failover.clients import connect_any, stop_all_and_read
from tests.failover.test_failover import FAST, wait_all_ready

PER_BRANCH = 3
KILL_POINTS = ("prepare-sent", "prepare-ok", "commit-sent")
pytestmark = pytest.mark.timeout(600)


def in_queue(i: int) -> str:
    return f"xa-in-{i}"


class Client(XAClient):
    """A connection to whichever node serves: an XA channel and a confirming plain channel."""

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(connect_any(cluster.urls, time.monotonic() + 30))

    def input_message(self, i: int) -> None:
        """One confirmed (so replicated) message on branch ``i``'s own input queue."""
        self.plain.queue_declare(in_queue(i), durable=True)
        self.plain.basic_publish("", in_queue(i), f"in-{i}".encode(),
                                 pika.BasicProperties(delivery_mode=2))

    def branch_work(self, i: int, xid: Xid) -> None:
        """start; 3 publishes; ack the input message; end."""
        self.xa.start(xid)
        for j in range(PER_BRANCH):
            self.channel.basic_publish("", OUT, f"b{i}-{j}".encode(),
                                       pika.BasicProperties(delivery_mode=2))
        method, _, _ = self.channel.basic_get(in_queue(i))
        assert method is not None
        self.channel.basic_ack(method.delivery_tag)
        self.xa.end(xid)

def fail_over(cluster: LocalCluster, primary: str) -> str:
    """SIGKILL the primary; the killed node comes back as a ready backup; the new primary."""
    cluster.kill(primary)
    new = cluster.wait_primary(30, other_than=primary)
    cluster.restart(primary)
    cluster.wait_ready(primary, 30)
    return new


def live_outcome(client: Client, branches: dict[int, bool]) -> None:
    """On the serving primary: each branch applied (3 out, input acked) or absent (0, input back)."""
    ch = client.conn.channel()
    seen: Counter[str] = Counter()
    depth = ch.queue_declare(OUT, durable=True, passive=True).method.message_count
    for _ in range(depth):
        method, _, body = ch.basic_get(OUT)
        assert method is not None
        seen[body.decode().split("-")[0]] += 1
    ch.close()  # nothing acked: the messages stay for the store check
    for i, applied in branches.items():
        left = client.plain.queue_declare(in_queue(i), passive=True).method.message_count
        got = (seen.pop(f"b{i}", 0), left)
        assert got == ((PER_BRANCH, 0) if applied else (0, 1)), (i, applied, got)
    assert not seen, f"messages of unknown branches: {seen}"


def check_stores(cluster: LocalCluster, branches: dict[int, bool]) -> None:
    """Every node stopped; in each store each branch applied exactly when committed."""
    queues = [OUT, *(in_queue(i) for i in branches)]
    stores = stop_all_and_read(cluster, queues)
    for name, found in stores.items():
        out = Counter(b.decode() for b in found[OUT])
        assert all(n == 1 for n in out.values()), (name, "stored twice", out.most_common(3))
        for i, applied in branches.items():
            mine = [j for j in range(PER_BRANCH) if out.pop(f"b{i}-{j}", 0)]
            got = (len(mine), len(found[in_queue(i)]))
            assert got == ((PER_BRANCH, 0) if applied else (0, 1)), (name, i, applied, got)
        assert not out, (name, "messages of unknown branches", out)
        store = open_store(None, cluster.data_dir / name)
        try:
            loaded = store.load()
        finally:
            store.close()
        assert loaded.prepared == [], (name, "prepared branches left", loaded.prepared)
        assert loaded.ha_transactions == [], (name, "prepared tx-queue records left",
                                              [t for t, _ in loaded.ha_transactions])


@pytest.fixture()
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options=FAST) as c:
        yield c


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "rollback"])
def test_prepared_branch_is_recovered_on_the_new_primary(cluster: LocalCluster, commit: bool) -> None:
    primary = wait_all_ready(cluster)
    client = Client(cluster)
    client.input_message(0)
    xid = Xid(0x4252, f"failover-{uuid.uuid4().hex[:8]}".encode(), b"b1")
    client.branch_work(0, xid)
    assert client.xa.prepare(xid) == XA_OK
    client.close()
    primary = fail_over(cluster, primary)
    client = Client(cluster)
    assert client.xa.recover() == [xid], "the prepared branch is not in doubt on the new primary"
    client.xa.commit(xid) if commit else client.xa.rollback(xid)
    assert client.xa.recover() == []
    live_outcome(client, {0: commit})
    client.close()
    wait_all_ready(cluster)
    time.sleep(0.5)  # the last acknowledgements
    check_stores(cluster, {0: commit})


def run_kills(cluster: LocalCluster, rounds: int, seed: int) -> None:
    rnd = random.Random(seed)
    primary = wait_all_ready(cluster)
    expected: dict[int, bool] = {}
    points: Counter[str] = Counter()
    client = Client(cluster)
    # every kill point at least once, then seeded choices
    order = rnd.sample(KILL_POINTS, len(KILL_POINTS)) + [rnd.choice(KILL_POINTS)
                                                         for _ in range(rounds)]
    for i in range(rounds):
        point = order[i]
        points[point] += 1
        client.input_message(i)
        xid = Xid(0x4252, f"ha-crash-{i}-{uuid.uuid4().hex[:8]}".encode(), b"b1")
        client.branch_work(i, xid)
        if point == "prepare-sent":
            client.send_only("prepare", xid)
            time.sleep(rnd.uniform(0, 0.02))
        else:
            assert client.xa.prepare(xid) == XA_OK
            if point == "commit-sent":
                client.send_only("commit", xid)
                time.sleep(rnd.uniform(0, 0.02))
        client.close()
        primary = fail_over(cluster, primary)
        client = Client(cluster)
        listed = set(client.xa.recover())
        assert listed <= {xid}, f"round {i}: branches of earlier rounds still in doubt: {listed}"
        if point == "prepare-ok":
            assert xid in listed, f"round {i}: prepared (XA_OK), not committed, yet not recovered"
            commit = rnd.random() < 0.5
        else:
            # a prepare never answered: presumed abort; a commit sent: finish it
            commit = point == "commit-sent"
        if xid in listed:
            client.xa.commit(xid) if commit else client.xa.rollback(xid)
        expected[i] = commit
        assert client.xa.recover() == []
    live_outcome(client, expected)
    client.close()
    wait_all_ready(cluster)
    time.sleep(0.5)
    check_stores(cluster, expected)
    print(f"{rounds} rounds, kill points {dict(points)}, "
          f"{sum(expected.values())} committed / {len(expected)}")


def test_dtx_primary_killed_at_seeded_points(cluster: LocalCluster) -> None:
    run_kills(cluster, rounds=4, seed=20261201)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [20261202, 20261203])
def test_dtx_failover_soak(seed: int) -> None:
    with LocalCluster(3, options=FAST) as c:
        run_kills(c, rounds=15, seed=seed)


# -- the Coordinator (brokerha + PostgreSQL) across a primary failover ---------------------


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    pytest.importorskip("psycopg")
    from brokerha.testing_postgres import create_database, find_pg_bin, local_server

    bin_dir = find_pg_bin()
    if bin_dir is None:
        pytest.skip("no local PostgreSQL (initdb): scripts/ensure-postgresql installs it")
    with local_server(bin_dir) as server:
        yield create_database(server.url, f"xa_{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize("decided", [True, False], ids=["commit-record", "no-record"])
def test_coordinator_recovers_on_the_new_primary(cluster: LocalCluster, pg_url: str,
                                                 tmp_path: Path, decided: bool) -> None:
    import sqlalchemy as sa

    rows = sa.Table("orders", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                    sa.Column("body", sa.LargeBinary))
    engine: Any = sa.create_engine(pg_url)
    try:
        rows.metadata.drop_all(engine)
        rows.metadata.create_all(engine)
        primary = wait_all_ready(cluster)
        client = Client(cluster)
        client.input_message(0)
        log = CoordinatorLog(tmp_path / "tm.log")
        # the happy path first: a whole global transaction through the cluster
        client.input_message(1)
        coordinator = Coordinator(log, client.xa, engine)
        with coordinator.transaction() as (db, _gtrid):
            method, _, body = client.channel.basic_get(in_queue(1))
            db.execute(rows.insert().values(body=body))
            client.channel.basic_ack(method.delivery_tag)
        # then one that stops after both prepares, with or without the commit record
        gtrid = uuid.uuid4().hex
        xid = Coordinator.xid(gtrid)
        client.xa.start(xid)
        conn = engine.connect()
        db_tx = conn.begin_twophase(Coordinator.db_xid(gtrid))
        method, _, body = client.channel.basic_get(in_queue(0))
        conn.execute(rows.insert().values(body=body))
        client.channel.basic_ack(method.delivery_tag)
        client.xa.end(xid)
        assert client.xa.prepare(xid) == XA_OK
        db_tx.prepare()
        conn.invalidate()  # the coordinator "dies" holding nothing
        if decided:
            log.append(gtrid, "commit")
        client.close()
        fail_over(cluster, primary)
        client = Client(cluster)
        assert client.xa.recover() == [xid]
        done = Coordinator(log, client.xa, engine).recover()
        assert done == {gtrid: "committed" if decided else "rolled back"}
        assert client.xa.recover() == []
        with engine.connect() as c:
            bodies = sorted(c.execute(sa.select(rows.c.body)).scalars())
            assert list(c.recover_twophase()) == []
        assert bodies == ([b"in-0", b"in-1"] if decided else [b"in-1"])
        left = client.plain.queue_declare(in_queue(0), passive=True).method.message_count
        assert left == (0 if decided else 1)
        client.close()
        wait_all_ready(cluster)
        time.sleep(0.5)
        stores = stop_all_and_read(cluster, [in_queue(0), in_queue(1)])
        for name, found in stores.items():
            assert found[in_queue(1)] == [], name
            assert found[in_queue(0)] == ([] if decided else [b"in-0"]), (name, found)
    finally:
        engine.dispose()
