"""Publisher flow control and the GC governor on real nodes, as operators see them (issue 33).

- Three nodes; a publisher without confirms; one backup SIGSTOPped. It holds a
  copy, so the primary holds publishers once it has not acknowledged for
  ``flow_lag`` (0.1 s), the other backup acknowledging meanwhile, until it is
  cut out of the guarded set (``backup_unheard_timeout``, 2 s here so that the
  hold lasts long enough to be looked at). ``/metrics`` shows the hold while
  it lasts (and the queue taking nothing in meanwhile), then its release, the
  seconds held and the paused backup as its cause; ``ctl status --json`` the
  same; the primary's log a WARNING naming the backup once the hold passed
  ``HELD_WARNING`` (1 s), and the release with its duration; and every
  message published is delivered.
- One node, a queue filled until the cyclic GC collected its middle
  generation: ``/metrics`` shows the collections and their pauses; the frozen
  count is the one taken at start (a scrape never walks the frozen objects).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

import pika
import pytest

from brokerha.testing import LocalCluster, NodeProcess, free_port
from tests.admin.views import samples
from tests.failover.clients import drain

pytestmark = pytest.mark.timeout(120)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
QUEUE = "flow"
UNHEARD = 2.0  # backup_unheard_timeout: how long the paused backup holds publishers
OPTIONS = {"backup_unheard_timeout": UNHEARD}


def scrape(admin_url: str) -> Samples:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=5) as resp:
        return samples(resp.read().decode())


def wait_for(what: str, probe: Callable[[], Samples], test: Callable[[Samples], bool],
             timeout: float) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if test(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout}s: {what}")
        time.sleep(0.05)


class Publisher(threading.Thread):
    """Numbered persistent messages without confirms, about 1,000 a second, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.sent = 0
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.url))
            ch = conn.channel()
            persistent = pika.BasicProperties(delivery_mode=2)
            while not self.stopping.is_set():
                for _ in range(10):
                    ch.basic_publish("", QUEUE, str(self.sent).encode(), persistent)
                    self.sent += 1
                conn.sleep(0.01)
            conn.close()
        except BaseException as exc:  # reported to the test
            self.error = exc


def queue_depth(url: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(conn.channel().queue_declare(QUEUE, durable=True, passive=True)
                   .method.message_count)
    finally:
        conn.close()


def test_a_lagging_backup_holds_publishers_and_metrics_and_status_show_it() -> None:
    with LocalCluster(3, options=OPTIONS) as cluster:
        primary = cluster.wait_primary(30)
        lagging, other = (n for n in cluster.names if n != primary)
        for name in (lagging, other):
            cluster.wait_ready(name, 30)
        url, admin = cluster.url(primary), cluster.admin_url(primary)
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_declare(QUEUE, durable=True)
        conn.close()

        def metrics() -> Samples:
            return scrape(admin)

        held = ("brokerha_publishers_held", ())
        holds = ("brokerha_publisher_flow_holds_total", ())
        seconds = ("brokerha_publisher_flow_held_seconds_total", ())
        published = ("brokerha_queue_messages_published_total",
                     (("queue", QUEUE), ("vhost", "/")))
        caused = ("brokerha_backup_flow_holds_total", (("backup", lagging),))
        publisher = Publisher(url)
        publisher.start()
        try:
            wait_for("the publisher's messages on the primary", metrics,
                     lambda m: m.get(published, 0) >= 200, 10)
            # no hold in force (a loaded machine may make a backup lag now and then): the
            # next one is the paused backup's
            before = wait_for("publishers not held", metrics, lambda m: m[held] == 0, 10)
            cluster.pause(lagging)
            paused_at = time.monotonic()
            first = wait_for("publishers held", metrics, lambda m: m[held] == 1, UNHEARD)
            status = cluster.status(primary)
            assert status is not None
            assert status["node"]["replication"]["publishers_held_by"] == lagging, status
            time.sleep(0.4)
            second = metrics()
            if time.monotonic() - paused_at < UNHEARD - 0.2:  # still within the same hold
                assert second[held] == 1 and second[holds] == first[holds], (first, second)
                assert second[published] == first[published], "a held publisher was read"
            assert first[caused] >= 1 + before.get(caused, 0)
            released = wait_for("publishers released", metrics, lambda m: m[held] == 0,
                                UNHEARD + 3)
        finally:
            publisher.stopping.set()
            publisher.join(30)
        assert publisher.error is None, publisher.error
        assert released[holds] >= 1 + before[holds]
        assert released[seconds] - before[seconds] >= 0.5 * (UNHEARD - 0.1)
        assert released[caused] >= 1 + before.get(caused, 0)
        deadline = time.monotonic() + 30
        while queue_depth(url) < publisher.sent and time.monotonic() < deadline:
            time.sleep(0.1)  # what the socket kept while publishers were held

        done = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node", url,
                               "status", "--json"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        replication = json.loads(done.stdout)["replication"]
        assert replication["publishers_held"] is False
        assert replication["publisher_holds"] >= 1
        assert replication["publisher_holds_by"].get(lagging, 0) >= 1
        assert replication["publishers_held_seconds"] >= 0.5 * (UNHEARD - 0.1)
        log = "\n".join(cluster.nodes[primary].log)
        assert f"publishers held (flow): backup {lagging} has not acknowledged" in log, log
        warnings = [line for line in log.splitlines()  # held past HELD_WARNING (1 s)
                    if " WARNING " in line and "publishers held (flow) for " in line]
        assert warnings and f"backup {lagging} has not acknowledged" in warnings[0], log
        assert "publishers released (flow) after " in log, log

        cluster.resume(lagging)
        got = drain([url], QUEUE)
        assert sorted(got) == list(range(publisher.sent)), (len(got), publisher.sent)


def test_the_gc_governor_collects_a_filling_queue_and_metrics_show_it(tmp_path: object) -> None:
    """As a queue fills, the survivors of young collections are frozen out of later walks:
    by a middle collection, or -- when more objects wait for one than a loop step may walk
    (a fast fill: node/gc_governor.py BULK_WALK) -- frozen without it; /metrics counts the
    collections, their pauses and those freezes. The frozen count is the one taken at start
    (or at a thaw check): counting them walks every frozen object, which a scrape must not
    do."""
    admin_port = free_port()
    admin = f"http://127.0.0.1:{admin_port}"
    middle = ("brokerha_gc_collections_total", (("generation", "1"),))
    young = ("brokerha_gc_collections_total", (("generation", "0"),))
    bulk = ("brokerha_gc_bulk_freezes_total", ())
    frozen = ("brokerha_gc_frozen_objects", ())
    with NodeProcess("gc", extra_args=["--admin", f"127.0.0.1:{admin_port}"]) as node:
        start = scrape(admin)
        assert start[frozen] > 10_000  # the modules and recovered state, frozen at start
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        ch = conn.channel()
        ch.queue_declare(QUEUE)
        sent = 0
        got = start
        while (got[middle], got[bulk]) == (start[middle], start[bulk]) and sent < 300_000:
            for _ in range(10_000):
                ch.basic_publish("", QUEUE, b"x")
            sent += 10_000
            ch.queue_declare(QUEUE, passive=True)  # a round trip: the batch was taken in
            got = scrape(admin)
        assert got[middle] + got[bulk] > start[middle] + start[bulk], \
            f"survivors neither walked nor frozen after {sent} messages"
        assert got[young] > start[young]
        for generation in "012":
            label = (("generation", generation),)
            assert (got[("brokerha_gc_pause_seconds_count", label)]
                    == got[("brokerha_gc_collections_total", label)])
        assert got[("brokerha_gc_pause_max_seconds", ())] > 0
        assert got[frozen] == start[frozen]  # not walked again by a scrape
        ch.queue_purge(QUEUE)
        conn.close()
