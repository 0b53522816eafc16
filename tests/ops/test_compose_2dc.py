"""docker/compose.2dc.yml as shipped: two datacenters of three nodes joined by the TxLog.

Starts the compose file with the real Compose tool (``docker/engine.sh compose``:
``docker compose`` or Debian's ``docker-compose``, installed with apt if
missing), on the image the other container tests use, then transacts on a
global queue (``global.*``, global by the ``[[txlog.global]]`` policy of
config/dc1.toml and dc2.toml) in both datacenters — ``tx.select``/``tx.commit``
in dc1, publisher confirms in dc2 — and checks that both primaries' TxLog
masters hold the same synchronised log (``brokerha ctl ... txlog status
--json``: length and digest) and both datacenters the same queue contents, in
the same order, on their primaries and their backups. Then dc2's primary is
SIGKILLed (``docker kill``): dc2 elects another, whose TxLog master goes on
from the old one's (the TxLog state is replicated inside the DC) and is found
by dc1's master in its peer URL list (all three dc2 nodes' TxLog addresses),
and both DCs go on with the same log. Fixed ports (the compose file's):
5672-5674 and 5772-5774, each + 10000, + 20000 and + 30000; skipped if one is
taken or a container of that name exists. Marker ``docker``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pika.exceptions
import pytest

from brokerha.cluster.ports import ADMIN_OFFSET, CLUSTER_OFFSET, TXLOG_OFFSET
from brokerha.testing import ClusterView, get_json
from brokerha.testing_containers import ENGINE_SCRIPT, REPO_DOCKER_DIR
from tests.txlog.test_broker_txlog import peek_ids

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]

COMPOSE_FILE = REPO_DOCKER_DIR / "compose.2dc.yml"
PROJECT = "brokerha2dctest"
BASES = {"dc1": 5672, "dc2": 5772}
QUEUE = "global.orders"  # global by the [[txlog.global]] policy of dc1.toml / dc2.toml
N = 10  # messages published in each DC


class ComposeDC(ClusterView):
    """One datacenter of the compose file, seen through its nodes' admin listeners."""

    poll_interval = 0.2

    def __init__(self, name: str, base_port: int) -> None:
        self.name = name
        self.names = ["n1", "n2", "n3"]
        self.base_port = base_port
        self.killed: set[str] = set()  # containers the tests docker-killed
        self.serving = ""  # the primary, once found

    def is_running(self, name: str) -> bool:
        return name not in self.killed

    @property
    def live(self) -> list[str]:
        return [n for n in self.names if n not in self.killed]

    def container(self, node: str) -> str:
        return f"brokerha-{self.name}-{node}"

    def get(self, node: str, path: str) -> Any:
        return get_json(self.admin_url(node) + path, 3)

    def status(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.get(name, "/api/status"))
        except (OSError, ValueError):
            return None

    def contents(self, node: str) -> list[str]:
        """The global queue's message ids in order, read without consuming (then requeued)."""
        with pika.BlockingConnection(pika.URLParameters(self.url(node))) as conn:
            return peek_ids(conn.channel(), QUEUE)

    def depth(self, node: str) -> int | None:
        for q in self.get(node, "/api/brokerha/queues")["queues"]:
            if q["name"] == QUEUE:
                return int(q["messages_ready"]) + int(q["messages_unacked"])
        return None


def compose(*args: str, env: dict[str, str] | None = None,
            timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ENGINE_SCRIPT), "compose", "-p", PROJECT, "-f", str(COMPOSE_FILE),
                           *args], capture_output=True, text=True, timeout=timeout, env=env)


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, pika.exceptions.AMQPError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout:g} s (last: {last!r})")


@pytest.fixture(scope="module")
def two_dcs(brokerha_image: str, request: pytest.FixtureRequest) -> Iterator[dict[str, ComposeDC]]:
    version = compose("version", timeout=300)
    if version.returncode == 2:
        pytest.skip(f"no Docker Compose here: {version.stderr.strip()[-300:]}")
    assert version.returncode == 0, version.stderr
    ports = [base + i + offset for base in BASES.values() for i in range(3)
             for offset in (0, ADMIN_OFFSET, CLUSTER_OFFSET, TXLOG_OFFSET)]
    # the TxLog ports (35672...) lie in the kernel's ephemeral range: an outgoing
    # connection of the other test session may hold one for a while
    deadline = time.monotonic() + 60
    while taken := [p for p in ports if port_taken(p)]:
        if time.monotonic() > deadline:
            pytest.skip(f"ports {taken} of compose.2dc.yml are taken here (waited 60 s)")
        time.sleep(1)
    dcs = {name: ComposeDC(name, base) for name, base in BASES.items()}
    names = [dc.container(n) for dc in dcs.values() for n in dc.names]
    existing = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}"],
                              capture_output=True, text=True, timeout=30).stdout.split()
    if set(names) & set(existing):
        pytest.skip(f"containers of compose.2dc.yml exist already: "
                    f"{sorted(set(names) & set(existing))}")
    env = dict(os.environ, BROKERHA_IMAGE=brokerha_image,
               BROKERHA_DC1_SECRET=secrets.token_hex(24),
               BROKERHA_DC2_SECRET=secrets.token_hex(24),
               BROKERHA_TXLOG_SECRET=secrets.token_hex(24))
    failed = request.session.testsfailed
    try:
        started = time.monotonic()
        up = compose("up", "-d", env=env)
        assert up.returncode == 0, f"compose up failed:\n{up.stderr[-3000:]}"
        print(f"compose up -d: {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield dcs
    finally:
        if request.session.testsfailed > failed:
            logs = compose("logs", "--no-color", "--tail", "40", env=env, timeout=60)
            print(logs.stdout[-20000:], file=sys.stderr)
        started = time.monotonic()
        down = compose("down", "-v", "-t", "5", env=env, timeout=180)
        print(f"compose down -v: {time.monotonic() - started:.1f} s", file=sys.stderr)
        if down.returncode != 0:  # leave nothing behind: remove ours by name
            subprocess.run(["docker", "rm", "-f", "-v", *names], capture_output=True, timeout=120)


def primaries(dcs: dict[str, ComposeDC]) -> bool:
    """Each DC's serving primary found (``dc.serving``); fails at once if a container exited."""
    found = {dc.name: dc.primary() for dc in dcs.values()}
    if all(found.values()):
        for dc in dcs.values():
            dc.serving = str(found[dc.name])
        return True
    killed = {dc.container(n) for dc in dcs.values() for n in dc.killed}
    states = subprocess.run(["docker", "ps", "-a", "--filter", "name=brokerha-dc",
                             "--format", "{{.Names}} {{.State}}"],
                            capture_output=True, text=True, timeout=30).stdout.split("\n")
    exited = sorted(line.split()[0] for line in states
                    if line.endswith(" exited") and line.split()[0] not in killed)
    if exited:
        logs = subprocess.run(["docker", "logs", "--tail", "15", exited[0]],
                              capture_output=True, text=True, timeout=30)
        raise AssertionError(f"containers exited: {exited}; {exited[0]}'s last lines:\n"
                             f"{logs.stdout}{logs.stderr}")
    return False


def joined(dc: ComposeDC) -> bool:
    """The DC's primary runs its master, whose view holds both DCs, linked to the other's."""
    st = dc.get(dc.serving, "/api/txlog")
    return bool(st.get("running") and sorted(st.get("members") or []) == ["dc1", "dc2"]
                and all(p.get("connected") for p in st.get("peers") or [{}]))


def same_queues(dcs: dict[str, ComposeDC], count: int) -> list[str] | None:
    """The global queue's ids on both primaries, if equal and ``count`` long."""
    views = [dc.contents(dc.serving) for dc in dcs.values()]
    return views[0] if len(views[0]) == count and views[0] == views[1] else None


def same_logs(dcs: dict[str, ComposeDC]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Both masters' ``ctl txlog status --json``, if their synchronised logs are equal.

    dc1's is asked from the host, dc2's from inside its container (the image's ctl).
    """
    dc1, dc2 = dcs["dc1"], dcs["dc2"]
    a = ctl_txlog([sys.executable, "-m", "brokerha.cli"], dc1.admin_url(dc1.serving))
    b = ctl_txlog(["docker", "exec", dc2.container(dc2.serving), "brokerha"],
                  dc2.admin_url(dc2.serving))
    if a["synchronised"] == b["synchronised"] and not a["incoming"] and not b["incoming"]:
        return a, b
    return None


def publish_both(dcs: dict[str, ComposeDC], ids1: list[str], ids2: list[str]) -> None:
    """``ids1`` with tx.commit in dc1 and ``ids2`` with confirms in dc2, at the same time."""
    errors: list[BaseException] = []

    def run(target: Callable[[str, list[str]], None], url: str, ids: list[str]) -> None:
        try:
            target(url, ids)
        except BaseException as exc:  # reported below
            errors.append(exc)

    dc1, dc2 = dcs["dc1"], dcs["dc2"]
    threads = [threading.Thread(target=run, args=(publish_tx, dc1.url(dc1.serving), ids1)),
               threading.Thread(target=run, args=(publish_confirmed, dc2.url(dc2.serving),
                                                  ids2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def ctl_txlog(argv_prefix: list[str], admin: str) -> dict[str, Any]:
    out = subprocess.run([*argv_prefix, "ctl", "--node", admin, "txlog", "status", "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out
    return dict(json.loads(out.stdout))


def publish_tx(url: str, ids: list[str]) -> None:
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.tx_select()
        for mid in ids:
            ch.basic_publish("", QUEUE, mid.encode(),
                             pika.BasicProperties(message_id=mid, delivery_mode=2))
            ch.tx_commit()


def publish_confirmed(url: str, ids: list[str]) -> None:
    with pika.BlockingConnection(pika.URLParameters(url)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for mid in ids:
            ch.basic_publish("", QUEUE, mid.encode(),
                             pika.BasicProperties(message_id=mid, delivery_mode=2))


def test_two_datacenters_joined_by_the_txlog_hold_the_same_log(
        two_dcs: dict[str, ComposeDC]) -> None:
    started = time.monotonic()
    dc1, dc2 = two_dcs["dc1"], two_dcs["dc2"]
    wait_for(lambda: primaries(two_dcs), "a serving primary in each DC", 120)
    for dc in (dc1, dc2):
        for node in dc.names:
            dc.wait_ready(node, 60)
    for dc in (dc1, dc2):  # the primary runs the DC's master, and it found the other DC's
        wait_for(lambda dc=dc: joined(dc), f"{dc.name}'s TxLog master joined", 90)
        for node in dc.names:
            if node != dc.serving:
                assert not dc.get(node, "/api/txlog")["running"], f"{dc.name} {node}"
        with pika.BlockingConnection(pika.URLParameters(dc.url(dc.serving))) as conn:
            conn.channel().queue_declare(QUEUE, durable=True)

    ids1 = [f"dc1-tx-{i}" for i in range(N)]
    ids2 = [f"dc2-confirm-{i}" for i in range(N)]
    publish_both(two_dcs, ids1, ids2)
    order = wait_for(lambda: same_queues(two_dcs, 2 * N), "the same global queue in both DCs")
    assert sorted(order) == sorted(ids1 + ids2)
    for ids in (ids1, ids2):  # each publisher's own order is kept
        assert [m for m in order if m in ids] == ids

    # an ack in dc2 (outside a transaction: one ordered dequeue) removes the head in both
    with pika.BlockingConnection(pika.URLParameters(dc2.url(dc2.serving))) as conn:
        ch = conn.channel()
        method, props, _ = ch.basic_get(QUEUE, auto_ack=False)
        assert props.message_id == order[0]
        ch.basic_ack(method.delivery_tag)
    assert wait_for(lambda: same_queues(two_dcs, 2 * N - 1), "the dequeue in both DCs") == order[1:]

    a, b = wait_for(lambda: same_logs(two_dcs), "equal synchronised logs")
    assert (a["master"], b["master"]) == ("dc1", "dc2")
    assert a["synchronised"]["length"] >= 2 * N + 1  # 20 publishes and the ack, at least
    assert not a["split"] and not b["split"]
    assert a["global_queues"] == b["global_queues"] == {f"%2F/{QUEUE}": 2 * N - 1}

    # the backups of each DC hold the applied order too (HA replication of the global queue)
    for dc in (dc1, dc2):
        for node in dc.names:
            if node != dc.serving:
                wait_for(lambda dc=dc, node=node: dc.depth(node) == 2 * N - 1,
                         f"{dc.name} backup {node}'s copy of {QUEUE}")

    # and the agreement latency histogram counted dc1's own transactions
    with urllib.request.urlopen(dc1.admin_url(dc1.serving) + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    line = next(x for x in text.splitlines()
                if x.startswith("brokerha_txlog_agreement_latency_seconds_count"))
    assert float(line.split()[-1]) >= N
    print(f"two DCs joined and checked in {time.monotonic() - started:.1f} s", file=sys.stderr)


def test_after_a_failover_in_dc2_the_other_dc_finds_its_new_master(
        two_dcs: dict[str, ComposeDC]) -> None:
    """docker kill of dc2's primary: dc1's master finds dc2's new one in its peer URL list."""
    started = time.monotonic()
    dc1, dc2 = two_dcs["dc1"], two_dcs["dc2"]
    if not dc1.serving or not dc2.serving:
        pytest.skip("the first test did not bring both DCs up")
    before = same_queues(two_dcs, 2 * N - 1)
    assert before is not None, "the first test left the DCs different"
    old = dc2.serving
    subprocess.run(["docker", "kill", dc2.container(old)], check=True, capture_output=True,
                   timeout=30)
    dc2.killed.add(old)
    wait_for(lambda: primaries(two_dcs) and dc2.serving != old, "a new primary in dc2", 60)
    for dc in (dc2, dc1):
        wait_for(lambda dc=dc: joined(dc), f"{dc.name}'s TxLog master joined again", 90)
    # the new primary's copy of the global queue, and its master's log, went on from the old
    assert wait_for(lambda: same_queues(two_dcs, 2 * N - 1), "dc2's new primary") == before

    ids1 = [f"dc1-after-{i}" for i in range(N // 2)]
    ids2 = [f"dc2-after-{i}" for i in range(N // 2)]
    publish_both(two_dcs, ids1, ids2)
    order = wait_for(lambda: same_queues(two_dcs, 2 * N - 1 + N), "equal after the failover")
    assert order[:2 * N - 1] == before and sorted(order[2 * N - 1:]) == sorted(ids1 + ids2)
    a, b = wait_for(lambda: same_logs(two_dcs), "equal synchronised logs after the failover")
    assert a["synchronised"]["length"] >= 3 * N + 1
    assert a["global_queues"] == b["global_queues"] == {f"%2F/{QUEUE}": 3 * N - 1}
    print(f"dc2 failed over and rejoined in {time.monotonic() - started:.1f} s",
          file=sys.stderr)
