"""Bad input on a real cluster port, from an authenticated peer: old epochs, wrong roles.

Garbage, wrong magic, wrong cluster name, wrong secret and unconfigured peers
are refused in the handshake (tests/cluster/test_link.py). Here a peer that
passes the handshake (it has the secret: a configured member, n3, that is not
running) sends messages of an old epoch: they are refused with an Error
packet and a log line, and the cluster's primary, epoch and data stay as they
were.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from brokerha.cluster.election import Heartbeat, NewEpoch
from brokerha.cluster.link import ClusterLinks
from brokerha.cluster.messages import Error, ErrorCode, Message
from brokerha.cluster.replication import Events, Join
from brokerha.testing import LocalCluster
from tests.failover.test_failover import FAST


@pytest.fixture()
def two_of_three() -> Iterator[LocalCluster]:
    cluster = LocalCluster(3, options=FAST)
    try:
        for name in ("n1", "n2"):
            cluster.start_node(name)
        yield cluster
    finally:
        cluster.close()


def impersonate_n3(cluster: LocalCluster, script: list[tuple[str, Message]],
                   ) -> list[tuple[str, Message]]:
    """Connect as n3 (with the secret), send ``script``, collect the answers for 1 s."""
    secret = (cluster.data_dir / "secret").read_text().strip().encode()
    peers = {n: ("127.0.0.1", cluster.port(n) + 20000) for n in ("n1", "n2")}
    got: list[tuple[str, Message]] = []

    async def run() -> None:
        up: set[str] = set()
        links = ClusterLinks("dc1", "n3", peers, ("127.0.0.1", cluster.port("n3") + 20000),
                             secret, lambda peer, _id, msg: got.append((peer, msg)),
                             up.add, up.discard)
        await links.start()
        deadline = time.monotonic() + 10
        while up != set(peers) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for peer, msg in script:
            links.send(peer, msg)
        await asyncio.sleep(1.0)
        await links.close()

    asyncio.run(run())
    return got


def test_old_epoch_messages_are_refused_and_change_nothing(two_of_three: LocalCluster) -> None:
    cluster = two_of_three
    primary = cluster.wait_primary(30)
    backup = "n2" if primary == "n1" else "n1"
    cluster.wait_ready(backup)
    before = cluster.status(primary)
    assert before is not None
    epoch = before["node"]["epoch"]  # type: ignore[index]
    answers = impersonate_n3(cluster, [
        (backup, Events(epoch - 1, 1, [["e", "/", "q", 1, "", "q", b"", b"forged", None]])),
        (primary, Join(epoch - 1, "n3", 0, 0, [], 1)),
        (backup, Heartbeat(epoch - 1, "n3", 0.0)),
    ])
    errors = [(peer, m.code) for peer, m in answers if isinstance(m, Error)]
    assert (backup, ErrorCode.OLD_EPOCH) in errors
    assert (primary, ErrorCode.OLD_EPOCH) in errors
    assert any(isinstance(m, NewEpoch) and m.epoch == epoch for _, m in answers)
    after = cluster.status(primary)
    assert after is not None and after["node"]["role"] == "primary"  # type: ignore[index]
    assert after["node"]["epoch"] == epoch  # type: ignore[index]
    log = "\n".join(cluster.nodes[backup].log)
    assert "old epoch" in log
    st = cluster.status(backup)
    assert st is not None and st["node"]["role"] == "backup" and st["node"]["ready"]  # type: ignore[index]
