"""The disk alarm, on small file systems made for the test (tmpfs; skipped where we may not mount).

Real nodes, real clients: free space under ``disk_free_limit`` blocks pika and
aio-pika publishers while consumers drain; freeing space unblocks them; a disk
filled anyway by another process withholds confirms instead of stopping the
node, and nothing confirmed is lost; a ready backup's full disk blocks the
primary's publishers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pika
import pytest

from brokerha.cluster.ports import ADMIN_OFFSET
from brokerha.node.disk import free_bytes
from brokerha.testing import LocalCluster, NodeProcess, free_port, get_json

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
BODY = b"x" * (64 * 1024)


@contextmanager
def tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A file system of ``size_mib`` MiB at ``path``, unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(disk: Path, leave: int) -> Path:
    """Another process's file: the disk keeps only ``leave`` bytes free."""
    ballast = disk / "ballast"
    with open(ballast, "ab") as f:
        chunk = b"\0" * MiB
        while (short := free_bytes(disk) - leave) > 0:
            try:
                f.write(chunk[:short] if short < MiB else chunk)
                f.flush()
            except OSError:
                break
    return ballast


def wait_until(check: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or check}")


def node(name: str, data: Path, *args: str, port: int | None = None) -> NodeProcess:
    """A standalone node whose admin port was free too (``node.admin_port``)."""
    admin = free_port()
    proc = NodeProcess(name, port=port, data_dir=data, extra_args=["--admin", f"127.0.0.1:{admin}",
                                                                   *args])
    ADMIN_PORTS[proc.port] = admin
    return proc


ADMIN_PORTS: dict[int, int] = {}  # AMQP port -> admin port, for standalone nodes


def admin_url(port: int) -> str:
    return f"http://127.0.0.1:{ADMIN_PORTS.get(port, port + ADMIN_OFFSET)}"


def node_status(port: int) -> dict[str, Any]:
    return dict(get_json(admin_url(port) + "/api/status", 2))


def alarms(port: int) -> dict[str, str]:
    return dict(node_status(port)["node"]["alarms"])


def metrics(port: int) -> str:
    with urllib.request.urlopen(admin_url(port) + "/metrics", timeout=2) as r:
        return str(r.read().decode())


class Publisher:
    """A pika publisher with confirms that notes connection.blocked/unblocked."""

    def __init__(self, url: str, queue: str) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        self.events: list[str] = []
        self.conn.add_on_connection_blocked_callback(lambda *_: self.events.append("blocked"))
        self.conn.add_on_connection_unblocked_callback(lambda *_: self.events.append("unblocked"))
        self.ch = self.conn.channel()
        self.ch.confirm_delivery()
        self.ch.queue_declare(queue, durable=True)
        self.queue = queue

    def publish(self, n: int, body: bytes = BODY, first: int = 0) -> None:
        for i in range(first, first + n):
            self.ch.basic_publish("", self.queue, body,
                                  pika.BasicProperties(delivery_mode=2, message_id=str(i)))

    def in_thread(self, n: int, body: bytes = BODY, first: int = 0) -> threading.Thread:
        """Publish (confirmed) from a thread that owns the connection until it ends."""
        thread = threading.Thread(target=self.publish, args=(n, body, first), daemon=True)
        thread.start()
        return thread

    def pump(self, seconds: float = 0.3) -> None:
        self.conn.process_data_events(time_limit=seconds)


def drain(url: str, queue: str) -> list[str]:
    """Every message of ``queue``, acknowledged, by message id (another connection)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ids = []
        while True:
            method, props, _ = ch.basic_get(queue)
            if method is None:
                return ids
            ids.append(props.message_id)
            ch.basic_ack(method.delivery_tag)
    finally:
        conn.close()


async def aio_publish(url: str, queue: str, message_id: str) -> None:
    import aio_pika

    conn = await aio_pika.connect(url)
    try:
        ch = await conn.channel(publisher_confirms=True)
        await ch.default_exchange.publish(
            aio_pika.Message(BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                             message_id=message_id), routing_key=queue)
    finally:
        await conn.close()


def test_disk_alarm_blocks_publishers_while_consumers_drain(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", 64) as disk, \
            node("disk1", disk / "data", "--disk-free-limit", "16MiB") as one:
        pub = Publisher(one.url, "q")
        pub.publish(20)  # confirmed
        asyncio.run(aio_publish(one.url, "q", "aio-0"))  # a confirmed aio-pika publish
        ballast = fill(disk, leave=8 * MiB)
        why = wait_until(lambda: alarms(one.port).get("disk"), what="the disk alarm")
        assert "below disk_free_limit 16.8 MB" in why, why
        assert "brokerha_disk_alarm 1.0" in metrics(one.port)
        wait_until(lambda: (pub.pump(0.1), "blocked" in pub.events)[1], what="connection.blocked")

        # a publish now waits (pika and aio-pika); consumers and acks go on
        waiting = pub.in_thread(1, first=20)

        async def aio_waits() -> asyncio.Task[None]:
            task = asyncio.create_task(aio_publish(one.url, "q", "aio-1"))
            await asyncio.sleep(0.3)  # connected and published once: its next frames wait
            return task

        loop = asyncio.new_event_loop()
        try:
            aio_task = loop.run_until_complete(aio_waits())
            assert sorted(drain(one.url, "q")) == sorted([str(i) for i in range(20)] + ["aio-0"])
            time.sleep(1.0)
            assert waiting.is_alive(), "a publish was confirmed during the disk alarm"
            assert alarms(one.port).get("disk")

            ballast.unlink()  # the operator frees space
            waiting.join(15)
            assert not waiting.is_alive(), "the publish stayed blocked after space came back"
            loop.run_until_complete(asyncio.wait_for(aio_task, 15))
        finally:
            loop.close()
        wait_until(lambda: (pub.pump(0.1), "unblocked" in pub.events)[1], what="unblocked")
        assert not alarms(one.port)
        assert sorted(drain(one.url, "q")) == ["20", "aio-1"]
        pub.conn.close()


def test_a_disk_filled_anyway_withholds_confirms_and_loses_nothing(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", 48) as disk:
        one = node("disk2", disk / "data", "--disk-free-limit", "0")
        with one:
            pub = Publisher(one.url, "q")
            pub.publish(10)
            ballast = fill(disk, leave=128 * 1024)
            writing = pub.in_thread(10, body=b"y" * (256 * 1024), first=10)
            why = wait_until(lambda: alarms(one.port).get("disk:store"), what="disk:store alarm")
            assert "lack of disk space" in why
            time.sleep(1.0)
            assert one.proc is not None and one.proc.poll() is None, "the node stopped"
            assert writing.is_alive(), "confirmed although the store could not write"

            # deliveries go on: a consumer takes two of the confirmed messages
            conn = pika.BlockingConnection(pika.URLParameters(one.url))
            ch = conn.channel()
            for _ in range(2):
                method, props, _ = ch.basic_get("q")
                assert method is not None and props.message_id in {"0", "1"}
                ch.basic_ack(method.delivery_tag)
            conn.close()

            ballast.unlink()
            writing.join(20)
            assert not writing.is_alive(), "confirms never came once space was back"
            wait_until(lambda: not alarms(one.port), what="the alarm to clear")
            pub.conn.close()
        with node("disk2", disk / "data", port=one.port) as again:
            assert sorted(drain(again.url, "q"), key=int) == [str(i) for i in range(2, 20)]


def test_a_ready_backups_disk_alarm_blocks_the_primarys_publishers(tmp_path: Path) -> None:
    root = tmp_path / "cluster"
    disks = {}
    with contextmanager_all([tmpfs(root / name, 64) for name in ("n1", "n2", "n3")]) as mounted:
        disks = dict(zip(("n1", "n2", "n3"), mounted, strict=True))
        with LocalCluster(3, data_dir=root, extra_args=["--disk-free-limit", "16MiB"]) as cluster:
            primary = cluster.wait_primary()
            backup = next(n for n in ("n1", "n2", "n3") if n != primary)
            cluster.wait_ready(backup)
            pub = Publisher(cluster.url(primary), "q")
            pub.publish(5)
            ballast = fill(disks[backup], leave=8 * MiB)
            port = cluster.port(primary)
            why = wait_until(lambda: alarms(port).get(f"disk:{backup}"),
                             what=f"the primary to take {backup}'s disk alarm")
            assert f"on {backup}" in why and "below disk_free_limit" in why
            assert f'brokerha_resource_alarm{{alarm="disk:{backup}"' in metrics(port)
            wait_until(lambda: (pub.pump(0.1), "blocked" in pub.events)[1],
                       what="connection.blocked on the primary")
            waiting = pub.in_thread(1, first=5)
            time.sleep(1.0)
            assert waiting.is_alive(), "confirmed while a ready backup's disk is short"
            ballast.unlink()
            waiting.join(15)
            assert not waiting.is_alive()
            wait_until(lambda: not alarms(port), what="the alarm to clear on the primary")
            assert sorted(drain(cluster.url(primary), "q"), key=int) == [str(i) for i in range(6)]
            pub.conn.close()


@contextmanager
def contextmanager_all(managers: list[Any]) -> Iterator[list[Any]]:
    from contextlib import ExitStack

    with ExitStack() as stack:
        yield [stack.enter_context(m) for m in managers]


def test_disk_free_limit_parses_like_rabbitmqs() -> None:
    from brokerha.node.config import ConfigError, parse_disk_free_limit, total_memory

    assert parse_disk_free_limit("50MB", "k").bytes() == 50_000_000
    assert parse_disk_free_limit(1024, "k").bytes() == 1024
    assert parse_disk_free_limit("mem_relative:1.5", "k").bytes() == int(1.5 * total_memory())
    assert parse_disk_free_limit({"mem_relative": 1.0}, "k").bytes() == total_memory()
    assert parse_disk_free_limit("0", "k").bytes() == 0
    for bad in ("fifty", "mem_relative", "mem_relative:-1", {"relative": 1}, -5):
        with pytest.raises(ConfigError):
            parse_disk_free_limit(bad, "limits.disk_free_limit")
    assert os.sysconf("SC_PAGE_SIZE") > 0
