"""A new primary whose AMQP port is briefly taken keeps trying to open it.

Regression: the elected primary opened its listener once; an EADDRINUSE (the
port held a moment by another socket, e.g. an ephemeral port of some client)
ended the task, and the node stayed primary -- holding its lease and its
backups, so no other node could stand -- without ever serving a client.
"""

from __future__ import annotations

import socket
import time

from brokerha.testing import LocalCluster
from tests.failover.clients import connect_any
from tests.failover.test_failover import FAST


def failed_attempts(cluster: LocalCluster) -> int:
    """The most failed attempts to open its AMQP listener any node has logged."""
    return max(sum("cannot open its AMQP listener" in line for line in list(node.log))
               for node in cluster.nodes.values())


def test_new_primary_retries_a_busy_amqp_port() -> None:
    cluster = LocalCluster(3, options=FAST)
    held = []
    for name in cluster.names:  # every AMQP port taken before the nodes start
        s = socket.socket()
        s.bind(("127.0.0.1", cluster.port(name)))
        s.listen()
        held.append(s)
    with cluster:
        try:
            # a primary is elected meanwhile; its listener cannot open yet, and it tries
            # again (was a fixed 3 s sleep: now until a node logged two failed attempts)
            deadline = time.monotonic() + 30
            while failed_attempts(cluster) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert failed_attempts(cluster) >= 2, cluster.diagnostics()
            assert cluster.primary() is None
        finally:
            for s in held:
                s.close()
        new = cluster.wait_primary(10)
        assert any("cannot open its AMQP listener" in line for line in cluster.nodes[new].log)
        # the backups opened theirs too, once free: every node's URL reaches the primary
        for name in cluster.names:
            connect_any([cluster.url(name)], time.monotonic() + 10).close()
