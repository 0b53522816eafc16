"""TX through primary kills on three real nodes: every transaction whole or absent on every node.

A pika publisher runs tx.select / numbered transactions of random size /
tx.commit, each named with ``x-tx-id``, while the primary is SIGKILLed. A
commit whose connection dropped is asked about with ``tx-outcome`` on the
next connection. Afterwards every node is stopped and its SQLite store read
back: on each node, each transaction's messages are all there or none, every
transaction whose commit-ok arrived is there exactly once, and an in-doubt
one is there exactly when ``tx-outcome`` said ``committed``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pika
import pytest

from brokerha.store.factory import open_store
from brokerha.testing import LocalCluster
from tests.failover.clients import RETRYABLE, connect_any
from tests.failover.test_failover import FAST, wait_all_ready

QUEUE = "ha-tx"
pytestmark = pytest.mark.timeout(300)


def ask_outcome(conn: pika.BlockingConnection, tx_id: str, timeout: float = 10.0) -> str:
    """The ``tx-outcome`` control message, answered on a reply queue."""
    ch = conn.channel()
    reply = ch.queue_declare("", exclusive=True).method.queue
    ch.basic_publish("amq.dtx", "tx-outcome", json.dumps({"tx_id": tx_id}).encode(),
                     pika.BasicProperties(reply_to=reply, correlation_id=tx_id))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        method, _, body = ch.basic_get(reply, auto_ack=True)
        if method is not None:
            ch.close()
            return str(json.loads(body)["outcome"])
        time.sleep(0.01)
    raise TimeoutError(f"no tx-outcome answer for {tx_id}")


class TxPublisher(threading.Thread):
    def __init__(self, urls: list[str], seed: int, pad: int = 0) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.pad = b":" + b"x" * pad if pad else b""  # bulk after the message's name
        self.rng = random.Random(seed)
        self.committed: dict[int, int] = {}   # commit-ok received: tx number -> size
        self.in_doubt: dict[int, int] = {}    # the connection dropped during tx.commit
        self.outcomes: dict[int, str] = {}    # tx-outcome's answers for those
        self.reconnects = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported to the test
            self.error = exc

    def _run(self) -> None:
        k = 0
        while not self.stop_event.is_set():
            conn = connect_any(self.urls, time.monotonic() + 30)
            size = 0
            committing = False
            try:
                for doubtful in sorted(set(self.in_doubt) - set(self.outcomes)):
                    self.outcomes[doubtful] = ask_outcome(conn, f"t{doubtful}")
                ch = conn.channel()
                ch.queue_declare(QUEUE, durable=True)
                ch.tx_select()
                while not self.stop_event.is_set():
                    k += 1
                    size = self.rng.randint(1, 6)
                    for i in range(size):
                        ch.basic_publish("", QUEUE, f"{k}:{i}:{size}".encode() + self.pad,
                                         pika.BasicProperties(delivery_mode=2,
                                                              headers={"x-tx-id": f"t{k}"}))
                    committing = True
                    ch.tx_commit()
                    committing = False
                    self.committed[k] = size
                conn.close()
            except RETRYABLE:
                self.reconnects += 1
                if committing:
                    self.in_doubt[k] = size
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - the connection is gone anyway
                    pass


def stored_transactions(data_dir: object) -> Counter[tuple[int, int]]:
    """(tx number, message index) -> copies in a stopped node's store, checking sizes."""
    store = open_store(None, data_dir)  # type: ignore[arg-type]
    try:
        rows = [m for m in store.load().messages if m.queue == QUEUE]
    finally:
        store.close()
    copies: Counter[tuple[int, int]] = Counter()
    sizes: dict[int, int] = {}
    for m in rows:
        k, i, n = (int(x) for x in bytes(m.body).split(b":")[:3])
        copies[(k, i)] += 1
        sizes[k] = n
    for k, n in sizes.items():
        held = [i for i in range(n) if copies[(k, i)]]
        assert len(held) in (0, n), f"transaction {k} partially stored: {held} of {n}"
    return copies


def run_kills(cluster: LocalCluster, kills: int, seed: int, pad: int = 0) -> TxPublisher:
    primary = wait_all_ready(cluster)
    pub = TxPublisher(cluster.urls, seed, pad)
    pub.start()
    for _ in range(kills):
        before = len(pub.committed)
        deadline = time.monotonic() + 30
        while len(pub.committed) < before + 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pub.error is None, pub.error
        time.sleep(random.Random(seed).random() * 0.05)
        cluster.kill(primary)
        new_primary = cluster.wait_primary(30, other_than=primary)
        cluster.restart(primary)
        cluster.wait_ready(primary, 30)
        primary = new_primary
    before = len(pub.committed)
    deadline = time.monotonic() + 30
    while len(pub.committed) < before + 10 and time.monotonic() < deadline:
        time.sleep(0.02)
    pub.stop_event.set()
    pub.join(30)
    assert pub.error is None, pub.error
    # the last in-doubt answers come from a connection after the publisher stopped
    if set(pub.in_doubt) - set(pub.outcomes):
        conn = connect_any(cluster.urls, time.monotonic() + 30)
        for k in sorted(set(pub.in_doubt) - set(pub.outcomes)):
            pub.outcomes[k] = ask_outcome(conn, f"t{k}")
        conn.close()
    wait_all_ready(cluster)
    return pub


def check_every_node(cluster: LocalCluster, pub: TxPublisher) -> None:
    # every backup's copy as the primary's (positions and content), before the stores are
    # read (ctl check-replicas, ha/check.py; issue 35 asks it of the soak tests). Exit 3 is
    # "not checked" (no primary serving when it asked, e.g. an election on a loaded box
    # right after the kills): asked again of the primary then; a difference (1) is final
    for _ in range(3):
        primary = cluster.wait_primary(30)
        time.sleep(0.5)  # the last acknowledgements
        checked = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                                  cluster.url(primary), "check-replicas", "--timeout", "20"],
                                 capture_output=True, text=True, timeout=60)
        if checked.returncode != 3:
            break
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for name in [n for n in cluster.names if n != primary] + [primary]:
        cluster.nodes[name].stop()
    for name in cluster.names:
        copies = stored_transactions(cluster.data_dir / name)
        present = {k for k, _ in copies}
        for k, n in pub.committed.items():
            assert all(copies[(k, i)] == 1 for i in range(n)), (name, k, "committed, not whole")
        for k in pub.in_doubt:
            committed = pub.outcomes.get(k) == "committed"
            assert (k in present) == committed, (name, k, pub.outcomes.get(k))
        assert all(c == 1 for c in copies.values()), (name, "duplicates")
        unexplained = present - set(pub.committed) - set(pub.in_doubt)
        assert not unexplained, (name, sorted(unexplained)[:10])


@pytest.fixture()
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3, options=FAST) as c:
        yield c


def test_tx_transactions_are_whole_or_absent_on_every_node_after_primary_kills(
        cluster: LocalCluster) -> None:
    pub = run_kills(cluster, kills=2, seed=1)
    assert pub.reconnects >= 2 and len(pub.committed) > 20
    check_every_node(cluster, pub)


def test_big_transactions_sent_ahead_are_whole_or_absent_after_primary_kills(
        cluster: LocalCluster) -> None:
    """Messages of 300 KB: a TX of four or more passes the tc's 1 MiB, and the rest of
    its content goes to the backups as it is published (issue 33), before the commit a
    kill may cut off."""
    pub = run_kills(cluster, kills=2, seed=5, pad=300_000)
    assert pub.reconnects >= 2 and len(pub.committed) > 20
    assert any(n >= 4 for n in pub.committed.values())  # some went ahead as te events
    check_every_node(cluster, pub)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_tx_soak_many_primary_kills(seed: int) -> None:
    with LocalCluster(3, options=FAST) as c:
        pub = run_kills(c, kills=6, seed=seed)
        check_every_node(c, pub)
