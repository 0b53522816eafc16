"""XA branches on a real node (SQLite store), SIGKILLed during prepare or commit.

A seeded, bounded loop. Each branch: start; publish 3 persistent messages
(message-id ``b<i>-<j>``) to a durable queue and ack the one message waiting on
its own durable input queue; end; prepare; commit. The node is SIGKILLed at a
point chosen by the seed -- right after the prepare request is sent (before
XA_OK is received), right after XA_OK is received, or right after the commit
request is sent -- and restarted on the same data dir and port.

After each restart: a branch that got XA_OK on prepare is listed by ``recover``
(its commit was not acknowledged); a listed branch is committed (commit was
sent, or the seed decides so) or rolled back (it never got XA_OK, or the seed
decides so). At the end every branch is wholly applied (3 messages, input
acked) or wholly absent (0 messages, input back on its queue): exactly once or
none, and applied exactly when it was committed.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import Counter
from pathlib import Path

import pika
import pytest

from brokerha.client.dtx import XA_OK
from brokerha.client.dtx.resources import Xid
from brokerha.testing import NodeProcess
from tests.dtx.xa_client import OUT, XAClient

SEED = 20261123
PER_BRANCH = 3
KILL_POINTS = ("prepare-sent", "prepare-ok", "commit-sent")


def xid_for(i: int) -> Xid:
    return Xid(0x4252, f"crash-{i}-{uuid.uuid4().hex[:8]}".encode(), b"b1")


def connect(node: NodeProcess) -> XAClient:
    return XAClient(pika.BlockingConnection(pika.URLParameters(node.url)))


def run(tmp: Path, iterations: int, seed: int) -> None:
    rnd = random.Random(seed)
    data = tmp / "node"
    node = NodeProcess("xa-crash", data_dir=data).start()
    expected: dict[int, bool] = {}  # branch -> applied?
    try:
        client = connect(node)
        for i in range(iterations):
            point = rnd.choice(KILL_POINTS)
            inq = f"xa-in-{i}"
            client.plain.queue_declare(inq, durable=True)
            client.plain.basic_publish("", inq, f"in-{i}".encode(),
                                       pika.BasicProperties(delivery_mode=2))  # confirmed
            xid = xid_for(i)
            xa, ch = client.xa, client.channel
            xa.start(xid)
            for j in range(PER_BRANCH):
                ch.basic_publish("", OUT, f"b{i}-{j}".encode(),
                                 pika.BasicProperties(delivery_mode=2, message_id=f"b{i}-{j}"))
            method, _, _ = ch.basic_get(inq)
            assert method is not None
            ch.basic_ack(method.delivery_tag)
            xa.end(xid)
            if point == "prepare-sent":
                client.send_only("prepare", xid)
                time.sleep(rnd.uniform(0, 0.02))
            else:
                assert xa.prepare(xid) == XA_OK
                if point == "commit-sent":
                    client.send_only("commit", xid)
                    time.sleep(rnd.uniform(0, 0.02))
            node.kill()
            client.close()
            node = NodeProcess("xa-crash", port=node.port, data_dir=data).start()
            client = connect(node)
            listed = set(client.xa.recover())
            assert listed <= {xid}, f"branches of earlier rounds still in doubt: {listed}"
            if point == "prepare-ok":
                assert xid in listed, "prepared (XA_OK) and not committed, yet not recovered"
                commit = rnd.random() < 0.5
            else:
                commit = point == "commit-sent"
            if xid in listed:
                client.xa.commit(xid) if commit else client.xa.rollback(xid)
            expected[i] = commit
            assert client.xa.recover() == []
        client.close()
        # The final check, on a fresh restart: every branch all-or-nothing, applied iff committed.
        node.kill()
        node = NodeProcess("xa-crash", port=node.port, data_dir=data).start()
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        ch = conn.channel()
        seen: Counter[str] = Counter()
        while True:
            method, props, _ = ch.basic_get(OUT, auto_ack=True)
            if method is None:
                break
            seen[props.message_id.split("-")[0]] += 1
        for i, applied in expected.items():
            depth = ch.queue_declare(f"xa-in-{i}", passive=True).method.message_count
            got = (seen.pop(f"b{i}", 0), depth)
            want = (PER_BRANCH, 0) if applied else (0, 1)
            assert got == want, f"branch {i}: (published, input left) {got} != {want}"
        assert not seen, f"messages of unknown branches: {seen}"
        conn.close()
    finally:
        node.close()


def test_dtx_sigkill_during_prepare_or_commit(tmp_path: Path) -> None:
    run(tmp_path, iterations=4, seed=SEED)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [SEED + k for k in range(1, 6)])
def test_dtx_sigkill_soak(tmp_path: Path, seed: int) -> None:
    run(tmp_path, iterations=20, seed=seed)
