"""Global queues across datacenters: three standalone broker nodes as real processes.

Each node (one "datacenter") has a ``[txlog]`` section naming the other two
as sync peers, so it runs a TxLog master beside its broker. A queue declared
with ``x-global: true`` in every DC is ordered through the TxLog: publishes
(transactions and confirms) and acks in any DC reach every DC's copy in the
same order; a message two DCs consume at once is dequeued by exactly one
commit, the other gets a 406; other queues stay local.

The links between the DCs' masters run with TLS (``[txlog.tls]``: each DC's
certificate names it, signed by one CA, peer names checked), as a WAN
deployment would have them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from brokerha.certs import issue, make_ca
from brokerha.testing import NodeProcess, free_port, get_json

pytestmark = pytest.mark.timeout(90)

DCS = ["dc1", "dc2", "dc3"]
GLOBAL = "orders"
LOCAL = "audit"


def peek_ids(ch: Any, queue: str) -> list[str]:
    """The queue's message ids (else bodies) in order, read without consuming: the gets stay
    unacked, so they are requeued when the channel closes."""
    ids = []
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=False)
        if method is None:
            return ids
        ids.append(props.message_id or body.decode())


class DC:
    def __init__(self, name: str, node: NodeProcess, admin: str) -> None:
        self.name, self.node, self.admin = name, node, admin

    def connect(self) -> pika.BlockingConnection:
        return pika.BlockingConnection(pika.URLParameters(self.node.url))

    def contents(self, queue: str) -> list[str]:
        with self.connect() as conn:
            return peek_ids(conn.channel(), queue)

    def txlog(self) -> dict[str, Any]:
        return dict(get_json(f"{self.admin}/api/txlog", 5))


def peer_entries(urls: dict[str, str]) -> str:
    """``peer.N.id`` / ``peer.N.url`` lines of a ``[txlog]`` section, in the given order."""
    return "".join(f'peer.{i}.id = "{p}"\npeer.{i}.url = "{u}"\n'
                   for i, (p, u) in enumerate(urls.items(), 1))


@pytest.fixture(scope="module")
def dcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DC]]:
    root = tmp_path_factory.mktemp("dcs")
    ports = {name: free_port() for name in DCS}
    (root / "secret").write_text("dc-secret\n")
    ca = make_ca(root / "certs")
    nodes: dict[str, DC] = {}
    try:
        for name in DCS:
            admin_port = free_port()
            peers = peer_entries({p: f"txlog://127.0.0.1:{ports[p]}" for p in DCS if p != name})
            cfg = root / f"{name}.toml"
            cfg.write_text(
                f'[node]\nadmin = "127.0.0.1:{admin_port}"\n\n'
                f'[txlog]\nnode-id = "{name}"\nmaster-url = "txlog://127.0.0.1:{ports[name]}"\n'
                f'group = "test-dcs"\nsecret-file = "secret"\nsplit-recovery = "Smart"\n'
                f'idle-interval = 300\nMaxPeerLag = 5000\n{peers}\n'
                f'[txlog.tls]\ncert = "certs/{name}.pem"\nkey = "certs/{name}.key"\n'
                f'ca = "certs/ca.pem"\ncheck-peer-name = true\n\n'
                f'[[txlog.global]]\npattern = "^shipments$"\n')
            issue(ca, root / "certs", name)
            node = NodeProcess(name, data_dir=root / name, extra_args=["--config", str(cfg)])
            nodes[name] = DC(name, node.start(), f"http://127.0.0.1:{admin_port}")
        for dc in nodes.values():
            with dc.connect() as conn:
                ch = conn.channel()
                ch.queue_declare(GLOBAL, durable=True, arguments={"x-global": True})
                ch.queue_declare(LOCAL, durable=True)
                ch.queue_declare("shipments", durable=True)  # global by [[txlog.global]]
        yield nodes
    finally:
        for dc in nodes.values():
            dc.node.close()


def wait_for(check: Any, timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last: {value!r})")
        time.sleep(0.1)


def publish_tx(dc: DC, ids: list[str], queue: str = GLOBAL) -> None:
    with dc.connect() as conn:
        ch = conn.channel()
        ch.tx_select()
        for mid in ids:
            ch.basic_publish("", queue, mid.encode(),
                             pika.BasicProperties(message_id=mid, delivery_mode=2))
            ch.tx_commit()


def publish_confirmed(dc: DC, ids: list[str], queue: str = GLOBAL) -> None:
    with dc.connect() as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for mid in ids:
            ch.basic_publish("", queue, mid.encode(),
                             pika.BasicProperties(message_id=mid, delivery_mode=2))


def same_everywhere(dcs: dict[str, DC], queue: str, count: int) -> list[str] | None:
    views = [dc.contents(queue) for dc in dcs.values()]
    if len(views[0]) == count and all(v == views[0] for v in views):
        return views[0]
    return None


def test_publishes_in_two_dcs_reach_every_dc_in_the_same_order(dcs: dict[str, DC]) -> None:
    ids1 = [f"dc1-tx-{i}" for i in range(6)]
    ids2 = [f"dc2-confirm-{i}" for i in range(6)]
    ids3 = [f"dc3-tx-{i}" for i in range(3)]
    threads = [threading.Thread(target=publish_tx, args=(dcs["dc1"], ids1)),
               threading.Thread(target=publish_confirmed, args=(dcs["dc2"], ids2)),
               threading.Thread(target=publish_tx, args=(dcs["dc3"], ids3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    order = wait_for(lambda: same_everywhere(dcs, GLOBAL, 15), what="equal global queues")
    assert all(dc.txlog()["tls"]["check_peer_name"] for dc in dcs.values())  # links over TLS
    assert sorted(order) == sorted(ids1 + ids2 + ids3)
    for ids in (ids1, ids2, ids3):  # each publisher's own order is kept
        assert [m for m in order if m in ids] == ids

    # a policy-global queue, and a message without message_id gets a generated global id
    with dcs["dc3"].connect() as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", "shipments", b"no-id", pika.BasicProperties(delivery_mode=2))
    shipped = wait_for(lambda: same_everywhere(dcs, "shipments", 1), what="shipments everywhere")
    assert shipped[0].startswith("dc3.")

    # a local queue stays local
    publish_tx(dcs["dc1"], ["local-1"], queue=LOCAL)
    assert dcs["dc1"].contents(LOCAL) == ["local-1"]
    time.sleep(0.5)
    assert dcs["dc2"].contents(LOCAL) == [] and dcs["dc3"].contents(LOCAL) == []


def test_an_ack_in_one_dc_dequeues_the_message_everywhere(dcs: dict[str, DC]) -> None:
    before = wait_for(lambda: same_everywhere(dcs, GLOBAL, 15), what="settled queues")
    with dcs["dc2"].connect() as conn:
        ch = conn.channel()
        method, props, _ = ch.basic_get(GLOBAL, auto_ack=False)
        assert props.message_id == before[0]  # published in another DC (or here), same head
        ch.basic_ack(method.delivery_tag)
    after = wait_for(lambda: same_everywhere(dcs, GLOBAL, 14), what="dequeue everywhere")
    assert after == before[1:]

    # consumers with acks outside transactions: each ack is ordered, the queue drains everywhere
    got: list[str] = []
    with dcs["dc1"].connect() as conn:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=3)
        for method, props, _ in ch.consume(GLOBAL, inactivity_timeout=1.0):
            if method is None or len(got) == 4:
                break
            got.append(props.message_id)
            ch.basic_ack(method.delivery_tag)
        ch.cancel()
    assert got == after[:4]
    assert wait_for(lambda: same_everywhere(dcs, GLOBAL, 10), what="4 more dequeues") == after[4:]


def test_two_dcs_consuming_the_same_message_in_transactions_one_commit_wins(
        dcs: dict[str, DC]) -> None:
    head = wait_for(lambda: same_everywhere(dcs, GLOBAL, 10), what="settled queues")[0]
    barrier = threading.Barrier(2)
    outcomes: dict[str, Any] = {}

    def consume(name: str) -> None:
        with dcs[name].connect() as conn:
            ch = conn.channel()
            ch.tx_select()
            method, props, _ = ch.basic_get(GLOBAL, auto_ack=False)
            assert props.message_id == head
            ch.basic_ack(method.delivery_tag)
            barrier.wait(10)
            try:
                ch.tx_commit()
                outcomes[name] = "committed"
            except pika.exceptions.ChannelClosedByBroker as exc:
                outcomes[name] = (exc.reply_code, exc.reply_text)

    threads = [threading.Thread(target=consume, args=(n,)) for n in ("dc1", "dc3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(v == "committed" for v in outcomes.values()) == [False, True], outcomes
    code, text = next(v for v in outcomes.values() if v != "committed")
    assert code == 406 and "failed validation" in text
    rest = wait_for(lambda: same_everywhere(dcs, GLOBAL, 9), what="one dequeue everywhere")
    assert head not in rest


def test_operators_see_the_txlog_of_a_node(dcs: dict[str, DC], tmp_path: Path) -> None:
    status = dcs["dc1"].txlog()
    assert status["running"] and status["master"] == "dc1"
    assert sorted(status["members"]) == DCS and not status["split"]
    assert status["bridge"]["applied_committed"] >= 15
    out = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node", dcs["dc2"].admin,
                          "txlog", "status"], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and "TxLog master dc2 running" in out.stdout, out
    out = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node", dcs["dc2"].admin,
                          "txlog", "export", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "synchronised.parquet" in out.stdout, out
    with urllib.request.urlopen(f"{dcs['dc3'].admin}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert "brokerha_txlog_running 1.0" in metrics
    assert 'brokerha_txlog_applied_total{outcome="failed"} 1.0' in metrics


def test_in_an_ha_datacenter_the_serving_primary_runs_the_master(tmp_path: Path) -> None:
    """dc1 is a 3-node HA cluster, dc2 a standalone node; the dc1 primary is SIGKILLed.

    Only the serving primary runs the master (listening at its AMQP port +
    30000: dc1's section has no ``listen``; dc2 lists dc1's three URLs); the
    new primary starts it from the journal its backup replicated, so dc1 comes
    back in generation 0 without a recovery vote and both DCs end equal.
    (tests/txlog/test_txlog_ha_failover.py: the same under traffic.)
    """
    from brokerha.cluster.ports import loopback_txlog_urls
    from brokerha.testing import LocalCluster

    cluster = LocalCluster(3, data_dir=tmp_path / "dc1")
    ports = {"dc2": free_port()}
    urls = {"dc1": loopback_txlog_urls(3, cluster.base_port),
            "dc2": f"txlog://127.0.0.1:{ports['dc2']}"}

    def section(me: str, other: str) -> str:
        listen = f'listen = "127.0.0.1:{ports[me]}"\n' if me in ports else ""
        return (f'\n[txlog]\nnode-id = "{me}"\n{listen}'
                f'group = "ha-test"\nsecret = "s"\nidle-interval = 300\nMaxPeerLag = 10000\n'
                f'peer.1.id = "{other}"\npeer.1.url = "{urls[other]}"\n')

    cluster.config.write_text(cluster.config.read_text() + section("dc1", "dc2"))
    admin2 = free_port()
    cfg2 = tmp_path / "dc2.toml"
    cfg2.write_text(f'[node]\nadmin = "127.0.0.1:{admin2}"\n' + section("dc2", "dc1"))
    dc2 = NodeProcess("dc2", data_dir=tmp_path / "dc2", extra_args=["--config", str(cfg2)])
    try:
        dc2.start()
        cluster.start()
        first = cluster.wait_primary()

        def dc1(name: str) -> DC:
            return DC("dc1", cluster.nodes[name], cluster.admin_url(name))

        other = DC("dc2", dc2, f"http://127.0.0.1:{admin2}")
        assert {n: dc1(n).txlog()["running"] for n in cluster.names} == {
            n: n == first for n in cluster.names}
        for dc in (dc1(first), other):
            with dc.connect() as conn:
                conn.channel().queue_declare(GLOBAL, durable=True, arguments={"x-global": True})
        publish_confirmed(dc1(first), ["a1", "a2"])
        publish_tx(other, ["b1"])
        pair = {"dc1": dc1(first), "dc2": other}
        wait_for(lambda: same_everywhere(pair, GLOBAL, 3), what="equal before the failover")

        cluster.kill(first)
        second = cluster.wait_primary(other_than=first)
        pair["dc1"] = dc1(second)
        assert wait_for(lambda: dc1(second).txlog()["running"], what="master on the new primary")
        publish_confirmed(dc1(second), ["a3"])
        order = wait_for(lambda: same_everywhere(pair, GLOBAL, 4), timeout=20,
                         what="equal after the failover")
        assert sorted(order) == ["a1", "a2", "a3", "b1"]
        for dc in pair.values():  # the replicated state: no split, no recovery vote
            assert dc.txlog()["generation"] == 0
    finally:
        cluster.close()
        dc2.close()


# ---- local-only operations on global queues (docs/txlog.md, "Operations that would diverge") ----


def declare_everywhere(dcs: dict[str, DC], setup: Any) -> None:
    for dc in dcs.values():
        with dc.connect() as conn:
            setup(conn.channel())


def closed_by_broker(action: Any) -> tuple[int, str]:
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as info:
        action()
    return info.value.reply_code, info.value.reply_text


def test_purge_and_delete_of_a_non_empty_global_queue_are_refused(dcs: dict[str, DC]) -> None:
    declare_everywhere(dcs, lambda ch: ch.queue_declare("g.purge", durable=True,
                                                        arguments={"x-global": True}))
    publish_confirmed(dcs["dc1"], ["keep-1"], queue="g.purge")
    wait_for(lambda: same_everywhere(dcs, "g.purge", 1), what="keep-1 everywhere")
    with dcs["dc2"].connect() as conn:
        code, text = closed_by_broker(lambda: conn.channel().queue_purge("g.purge"))
        assert code == 406 and "queue.purge not supported on global queue" in text
        code, text = closed_by_broker(lambda: conn.channel().queue_delete("g.purge"))
        assert code == 406 and "global queue and not empty" in text
    assert same_everywhere(dcs, "g.purge", 1) == ["keep-1"]  # nothing dropped anywhere
    with dcs["dc2"].connect() as conn:  # emptied by an ordered ack, it can be deleted
        ch = conn.channel()
        method, _, _ = ch.basic_get("g.purge", auto_ack=False)
        ch.basic_ack(method.delivery_tag)
    wait_for(lambda: same_everywhere(dcs, "g.purge", 0) is not None, what="emptied everywhere")
    for dc in dcs.values():
        with dc.connect() as conn:
            conn.channel().queue_delete("g.purge")


def test_a_rejected_message_is_dead_lettered_once_by_the_dc_that_rejected_it(
        dcs: dict[str, DC]) -> None:
    def setup(ch: Any) -> None:
        ch.exchange_declare("g.dlx", "fanout", durable=True)
        ch.queue_declare("g.work", durable=True,
                         arguments={"x-global": True, "x-dead-letter-exchange": "g.dlx"})
        ch.queue_declare("g.dead", durable=True, arguments={"x-global": True})
        ch.queue_declare("dead.local", durable=True)
        ch.queue_bind("g.dead", "g.dlx")
        ch.queue_bind("dead.local", "g.dlx")

    declare_everywhere(dcs, setup)
    publish_confirmed(dcs["dc1"], ["poison"], queue="g.work")
    wait_for(lambda: same_everywhere(dcs, "g.work", 1), what="poison everywhere")
    with dcs["dc2"].connect() as conn:
        ch = conn.channel()
        method, _, _ = ch.basic_get("g.work", auto_ack=False)
        ch.basic_reject(method.delivery_tag, requeue=False)  # ordered, like an ack
        conn.process_data_events(0.5)
    wait_for(lambda: same_everywhere(dcs, "g.work", 0) is not None, what="rejected everywhere")
    # the dead letter into a global queue is an ordered enqueue: once, in every DC
    assert wait_for(lambda: same_everywhere(dcs, "g.dead", 1), what="dead letter") == ["poison"]
    # into a local queue: in the rejecting DC only, like the consumer's own decision
    assert [dcs[n].contents("dead.local") for n in DCS] == [[], ["poison"], []]
    with dcs["dc3"].connect() as conn:
        _, props, _ = conn.channel().basic_get("g.dead", auto_ack=False)
        assert props.headers["x-death"][0]["reason"] == "rejected"


def test_a_message_expiring_from_a_local_queue_into_a_global_one_is_ordered(
        dcs: dict[str, DC]) -> None:
    declare_everywhere(dcs, lambda ch: ch.queue_declare("g.expired", durable=True,
                                                        arguments={"x-global": True}))
    with dcs["dc3"].connect() as conn:
        ch = conn.channel()
        ch.queue_declare("ttl.local", durable=True, arguments={
            "x-message-ttl": 200, "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "g.expired"})
        ch.basic_publish("", "ttl.local", b"late", pika.BasicProperties(message_id="late-1"))
    assert wait_for(lambda: same_everywhere(dcs, "g.expired", 1),
                    what="expired message in every DC") == ["late-1"]


def test_a_per_message_ttl_on_a_global_queue_is_refused(dcs: dict[str, DC]) -> None:
    props = pika.BasicProperties(message_id="ttl-1", expiration="60000")
    with dcs["dc1"].connect() as conn:
        ch = conn.channel()
        ch.tx_select()
        ch.basic_publish("", GLOBAL, b"x", props)
        code, text = closed_by_broker(ch.tx_commit)
        assert code == 406 and "expiration (per-message TTL)" in text
    with dcs["dc1"].connect() as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish("", GLOBAL, b"x", props)
    assert "ttl-1" not in dcs["dc2"].contents(GLOBAL)


def test_sighup_reloads_the_txlog_link_certificates(dcs: dict[str, DC]) -> None:
    """SIGHUP reads [txlog.tls] again (with the node's own TLS, none here); the links carry on."""
    proc = dcs["dc3"].node.proc
    assert proc is not None
    proc.send_signal(signal.SIGHUP)

    def tls() -> dict[str, Any]:
        return dict(get_json(f"{dcs['dc3'].admin}/api/tls", 5))

    status = wait_for(lambda: (lambda t: t if t["reloads"] == 1 else None)(tls()),
                      what="dc3 reloaded")
    assert status["links"] == ["[txlog.tls]"] and not status["configured"]
    before = len(dcs["dc1"].contents(GLOBAL))
    publish_confirmed(dcs["dc3"], ["after-sighup"])
    wait_for(lambda: same_everywhere(dcs, GLOBAL, before + 1), what="ordered after the reload")
