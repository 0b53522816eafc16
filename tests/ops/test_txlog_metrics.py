"""The TxLog in /metrics: two standalone nodes with [txlog] as real processes, scraped.

Each node is one "datacenter" running a TxLog master; a global queue's
transactions (tx.commit in one, publisher confirms in the other) move the
agreement-latency histogram of the node where they were submitted, and the
synchronised length of both.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from brokerha.testing import NodeProcess, free_port, get, get_json

pytestmark = pytest.mark.timeout(90)

QUEUE = "metrics-orders"
HISTOGRAM = "brokerha_txlog_agreement_latency_seconds"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class DC:
    def __init__(self, node: NodeProcess, admin: str) -> None:
        self.node, self.admin = node, admin

    def scrape(self) -> tuple[Samples, dict[str, str]]:
        """Samples by (name, sorted labels), and each family's type, by the client's parser."""
        with urllib.request.urlopen(self.admin + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        samples: Samples = {}
        types = {}
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples, types


@pytest.fixture(scope="module")
def dcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DC]]:
    root = tmp_path_factory.mktemp("txlog-metrics")
    names = ("dc1", "dc2")
    ports = {name: free_port() for name in names}
    out: dict[str, DC] = {}
    try:
        for name in names:
            other = next(n for n in names if n != name)
            admin = free_port()
            cfg = root / f"{name}.toml"
            cfg.write_text(
                f'[node]\nadmin = "127.0.0.1:{admin}"\n\n'
                f'[txlog]\nnode-id = "{name}"\nmaster-url = "txlog://127.0.0.1:{ports[name]}"\n'
                f'group = "metrics-test"\nsecret = "metrics-secret"\nidle-interval = 300\n'
                f'peer.1.id = "{other}"\npeer.1.url = "txlog://127.0.0.1:{ports[other]}"\n')
            node = NodeProcess(name, data_dir=Path(root / name), extra_args=["--config", str(cfg)])
            out[name] = DC(node.start(), f"http://127.0.0.1:{admin}")
        yield out
    finally:
        for dc in out.values():
            dc.node.close()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.1)


def count(samples: Samples) -> float:
    return samples[(HISTOGRAM + "_count", ())]


def test_agreement_latency_histogram_moves_with_global_transactions(
        dcs: dict[str, DC]) -> None:
    for dc in dcs.values():
        samples, types = dc.scrape()
        assert samples[("brokerha_txlog_running", ())] == 1
        assert types[HISTOGRAM] == "histogram"
        assert count(samples) == 0 and samples[("brokerha_txlog_incoming", ())] == 0
        assert samples[("brokerha_txlog_split", ())] == 0
        assert samples[("brokerha_txlog_members", ())] == 2
        assert ("brokerha_txlog_generation", ()) in samples
        with pika.BlockingConnection(pika.URLParameters(dc.node.url)) as conn:
            conn.channel().queue_declare(QUEUE, durable=True, arguments={"x-global": True})
    base = {name: dc.scrape()[0][("brokerha_txlog_synchronised_length", ())]
            for name, dc in dcs.items()}

    with pika.BlockingConnection(pika.URLParameters(dcs["dc1"].node.url)) as conn:
        ch = conn.channel()
        ch.tx_select()
        for i in range(5):
            ch.basic_publish("", QUEUE, b"x", pika.BasicProperties(message_id=f"tx-{i}"))
            ch.tx_commit()
    with pika.BlockingConnection(pika.URLParameters(dcs["dc2"].node.url)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(3):
            ch.basic_publish("", QUEUE, b"y", pika.BasicProperties(message_id=f"confirm-{i}"))

    # each master counts its own transactions once they are ordered; both order all 8
    wait_for(lambda: count(dcs["dc1"].scrape()[0]) == 5, what="dc1's histogram count at 5")
    wait_for(lambda: count(dcs["dc2"].scrape()[0]) == 3, what="dc2's histogram count at 3")
    for name, dc in dcs.items():
        wait_for(lambda dc=dc, name=name: dc.scrape()[0][
            ("brokerha_txlog_synchronised_length", ())] == base[name] + 8,
            what=f"{name}'s synchronised length + 8")
        samples, _ = dc.scrape()
        buckets = sorted(((float(dict(labels)["le"]), value) for (n, labels), value
                          in samples.items() if n == HISTOGRAM + "_bucket"))
        assert buckets[-1] == (float("inf"), count(samples))
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False))
        assert samples[(HISTOGRAM + "_sum", ())] > 0
        assert samples[("brokerha_txlog_incoming", ())] == 0
        assert samples[("brokerha_txlog_applied_total", (("outcome", "committed"),))] >= 8


def test_the_status_page_shows_each_masters_synchronised_position(dcs: dict[str, DC]) -> None:
    """The page's TxLog table: this DC's master and each sync peer, with its position and link."""
    def masters() -> dict[str, tuple[int, str]]:
        page = get(dcs["dc1"].admin + "/status?part=body", 5).decode()
        table = page.split("<table id=txlog-masters>", 1)[1].split("</table>", 1)[0]
        rows = re.findall(r"<tr><td>(dc\d)[^<]*</td><td class=num>(\d+)</td><td>([^<]*)", table)
        return {name: (int(length), link) for name, length, link in rows}

    with pika.BlockingConnection(pika.URLParameters(dcs["dc2"].node.url)) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", QUEUE, b"z", pika.BasicProperties(message_id="page-1"))
    length = get_json(dcs["dc1"].admin + "/api/txlog", 5)["synchronised"]["length"]
    # both rows reach dc1's own length: dc2's from its latest post
    wait_for(lambda: (seen := masters()).get("dc1", (0, ""))[0] >= length
             and seen.get("dc2", (0, ""))[0] >= length, what="both masters' positions")
    seen = masters()
    assert set(seen) == {"dc1", "dc2"} and seen["dc2"][1] == "up"
    page = get(dcs["dc1"].admin + "/status?part=body", 5).decode()
    assert "master <b>dc1</b>" in page and "joined" in page
