"""The TxLog survives a primary failover inside its datacenter (real processes).

dc1 is a 3-node HA cluster with ``[txlog]`` and neither ``listen`` nor
``master-url``: its master runs on the serving primary, at that node's
cluster port + 10000; dc2 is a standalone node whose ``peer.1.url`` lists
dc1's three TxLog URLs. Clients publish with confirms and in transactions on a
global queue in both DCs, and consume with transactional acks in dc2, while
dc1's primary is SIGKILLed. The new dc1 primary starts the master from the
journal its backup replicated (no recovery vote: generation stays 0, dc2
never drops dc1), the TxLog goes on, and in the end both DCs' global queues
hold the same messages in the same order: every confirmed or committed
message exactly once, unless a committed consume took it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from brokerha.cluster.ports import loopback_txlog_urls
from brokerha.testing import LocalCluster, NodeProcess, free_port
from tests.failover.clients import RETRYABLE, connect_any
from tests.txlog.test_broker_txlog import DC, peek_ids, wait_for

pytestmark = pytest.mark.timeout(120)

QUEUE = "orders"
FAST = {"heartbeat_interval": 0.1, "lease_timeout": 0.6, "election_timeout": 1.0,
        "backup_timeout": 3.0}
SECTION = """
[txlog]
node-id = "{me}"
group = "ha-failover"
secret = "txlog-secret"
idle-interval = 300
MaxPeerLag = 15000
{listen}peer.1.id = "{other}"
peer.1.url = "{urls}"
"""


def declare(ch: Any) -> None:
    ch.queue_declare(QUEUE, durable=True, arguments={"x-global": True})


class Client(threading.Thread):
    """Publishes (``confirm`` or ``tx``) or consumes (``consume``) until stopped; reconnects.

    ``done`` holds the ids the broker confirmed / committed; ``maybe`` the ids
    whose answer a lost connection swallowed (present at most once).
    """

    def __init__(self, name: str, urls: list[str], kind: str, pause: float = 0.01) -> None:
        super().__init__(daemon=True, name=name)
        self.prefix, self.urls, self.kind, self.pause = name, urls, kind, pause
        self.done: list[str] = []
        self.maybe: list[str] = []
        self.refused: list[str] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.lost_at: list[float] = []
        self.first_after_loss: list[float] = []

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc

    def _run(self) -> None:
        n = 0
        while not self.stop_event.is_set():
            try:
                conn = connect_any(self.urls, time.monotonic() + 20)
            except TimeoutError as exc:
                self.error = exc
                return
            try:
                ch = conn.channel()
                if self.kind == "confirm":
                    ch.confirm_delivery()
                else:
                    ch.tx_select()
                while not self.stop_event.is_set():
                    if self.kind == "consume":
                        self._consume_one(ch)
                    else:
                        n += 1
                        self._publish_one(ch, f"{self.prefix}-{n}")
                    time.sleep(self.pause)
                conn.close()
            except RETRYABLE:
                self.lost_at.append(time.monotonic())
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - already gone
                    pass

    def _publish_one(self, ch: Any, mid: str) -> None:
        props = pika.BasicProperties(message_id=mid, delivery_mode=2)
        try:
            ch.basic_publish("", QUEUE, mid.encode(), props)
            if self.kind == "tx":
                ch.tx_commit()
        except pika.exceptions.NackError:
            self.refused.append(mid)
            return
        except RETRYABLE:
            self.maybe.append(mid)
            raise
        self._answered(mid)

    def _consume_one(self, ch: Any) -> None:
        method, props, _ = ch.basic_get(QUEUE, auto_ack=False)
        if method is None:
            return
        ch.basic_ack(method.delivery_tag)
        try:
            ch.tx_commit()
        except RETRYABLE:
            self.maybe.append(props.message_id)
            raise
        self._answered(props.message_id)

    def _answered(self, mid: str) -> None:
        if self.lost_at and len(self.first_after_loss) < len(self.lost_at):
            self.first_after_loss.append(time.monotonic())
        self.done.append(mid)


def contents(url: str) -> list[str]:
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        return peek_ids(conn.channel(), QUEUE)


def test_the_txlog_survives_a_primary_failover_in_its_datacenter(tmp_path: Path) -> None:
    run_failovers(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_txlog_survives_three_failovers_in_a_row(tmp_path: Path) -> None:
    run_failovers(tmp_path, 3)


def run_failovers(tmp_path: Path, kills: int) -> None:
    """``kills`` times: SIGKILL dc1's primary under traffic, restart it (it rejoins as a
    backup: the catch-up replaces its TxLog state), traffic again; then check."""
    cluster = LocalCluster(3, data_dir=tmp_path / "dc1", options=FAST)
    dc1_urls = loopback_txlog_urls(3, cluster.base_port)
    dc2_txlog, admin2 = free_port(), free_port()
    cluster.config.write_text(cluster.config.read_text() + SECTION.format(
        me="dc1", other="dc2", listen="", urls=f"txlog://127.0.0.1:{dc2_txlog}"))
    cfg2 = tmp_path / "dc2.toml"
    cfg2.write_text(f'[node]\nadmin = "127.0.0.1:{admin2}"\n' + SECTION.format(
        me="dc2", other="dc1", listen=f'listen = "127.0.0.1:{dc2_txlog}"\n', urls=dc1_urls))
    dc2 = NodeProcess("dc2", data_dir=tmp_path / "dc2", extra_args=["--config", str(cfg2)])
    clients: list[Client] = []
    try:
        dc2.start()
        cluster.start()
        first = cluster.wait_primary()
        for name in cluster.names:
            if name != first:
                cluster.wait_ready(name)
        other = DC("dc2", dc2, f"http://127.0.0.1:{admin2}")

        def dc1(name: str) -> DC:
            return DC("dc1", cluster.nodes[name], cluster.admin_url(name))

        for url in (cluster.url(first), dc2.url):
            conn = pika.BlockingConnection(pika.URLParameters(url))
            declare(conn.channel())
            conn.close()
        clients = [Client("a", cluster.urls, "confirm"), Client("t", cluster.urls, "tx"),
                   Client("b", [dc2.url], "confirm"), Client("c", [dc2.url], "consume", 0.05)]
        for client in clients:
            client.start()
        wait_for(lambda: all(len(c.done) >= 5 for c in clients[:3]), timeout=20,
                 what="traffic in both DCs")
        second = first
        timings = []
        for _ in range(kills):
            before = dc1(second).txlog()
            assert before["running"] and before["generation"] == 0
            killed, killed_at = second, time.monotonic()
            cluster.kill(killed)
            second = cluster.wait_primary(other_than=killed)
            status = wait_for(lambda n=second: (s := dc1(n).txlog())["running"] and s,
                              timeout=20, what="the master on the new primary")
            timings.append(time.monotonic() - killed_at)
            # the replicated state: at least what the old master had ordered, same generation
            assert status["generation"] == 0
            assert status["synchronised"]["length"] >= before["synchronised"]["length"]
            assert status["journal_seq"] >= before["journal_seq"]
            served = {c.prefix: len(c.done) for c in clients}
            wait_for(lambda d=served: all(len(c.done) >= d[c.prefix] + 5 for c in clients[:3]),
                     timeout=20, what="traffic after the failover")
            # the killed node comes back as a backup: its TxLog state is replaced
            cluster.restart(killed)
            cluster.wait_ready(killed)
        for client in clients:
            client.stop_event.set()
        for client in clients:
            client.join(20)
            assert client.error is None, (client.prefix, client.error)

        views: dict[str, list[str]] = {}

        def equal() -> bool:
            views["dc1"] = contents(cluster.url(second))
            views["dc2"] = contents(dc2.url)
            return views["dc1"] == views["dc2"]

        wait_for(equal, timeout=20, what="equal global queues in both DCs")
        final = views["dc1"]
        assert len(final) == len(set(final)), "a message twice"
        consumed = set(clients[3].done)
        for client in clients[:3]:
            mine = [m for m in final if m.split("-")[0] == client.prefix]
            assert mine == sorted(mine, key=lambda m: int(m.split("-")[1])), client.prefix
            for mid in client.done:
                assert (mid in final) != (mid in consumed), (mid, "lost" if mid not in consumed
                                                              else "consumed yet present")
            known = set(client.done) | set(client.maybe) | set(client.refused)
            assert set(mine) <= known
        assert not consumed & set(final)

        # every dc1 backup holds the master's journal (what a promotion would load)
        def replicas_equal() -> bool:
            seq = dc1(second).txlog()["journal_seq"]
            return all(dc1(n).txlog()["replica"]["journal_seq"] == seq
                       for n in cluster.names if n != second)

        wait_for(replicas_equal, timeout=10, what="backups' journals at the master's seq")
        # no split, no vote: dc2 never dropped dc1, both still in generation 0
        for dc in (dc1(second), other):
            st = dc.txlog()
            assert st["generation"] == 0 and not st["split"], st
            assert not [e for e in st["events"] if e["kind"] in ("split-detected", "peer-dropped")]
        gaps = [a - lost for c in clients[:2]
                for lost, a in zip(c.lost_at, c.first_after_loss, strict=False)]
        print(f"\nTxLog failovers: master on the new primary after "
              f"{', '.join(f'{t:.2f}s' for t in timings)} (from the kill); dc1 clients answered "
              f"again {', '.join(f'{g:.2f}s' for g in gaps)} after losing their connection; "
              f"{len(final)} messages, {len(consumed)} consumed in dc2")
    finally:
        for client in clients:
            client.stop_event.set()
        cluster.close()
        dc2.close()
