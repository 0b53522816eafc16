"""A Jepsen-style partition run: publishers with all three URLs, faults one after another, a drain.

Used by ``tests/failover/test_netns_partition.py`` (bounded) and
``benchmarks/partition.py`` (long runs, a table). The cluster is
``tests/netns.py``'s: three nodes in their own network namespaces, the
shipped election timing, faults by iptables inside the namespaces.

- **Publishers** (pika, all three URLs, reconnecting on any error): in
  ``tx`` mode ``tx.select`` and ``batch`` persistent messages per
  ``tx.commit``, each body a unique id, recorded only after ``commit-ok``; in
  ``confirm`` mode one persistent message per confirm, recorded on
  ``basic.ack``. The node that answered is noted with each record (its
  address), and whether its own status said it was the primary then.
- **Faults**, each held ``hold`` seconds, healed, and the cluster settled
  (one serving primary, every other node its ready backup) before the next:
  the primary cut from both backups but not from the clients; one backup cut
  from everyone; n1 <-> n3 cut; the primary's links to the backups flapping
  every 1-2 s; the primary's packets delayed 150 ms +- 50 ms with 2 % loss.
- **Check**: the queue drained from the final primary; every recorded
  message is there (lost: 0), no transaction partly (partial: 0).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pika
import pika.exceptions

from tests.netns import NamespacedCluster

QUEUE = "jepsen"
RETRYABLE = (pika.exceptions.AMQPError, ConnectionError, OSError, TimeoutError)
FAULTS = ("primary-cut-from-backups", "backup-cut-from-everyone", "bridge-n1-n3",
          "primary-flapping", "primary-slow-lossy")


def params(urls: list[str]) -> list[pika.URLParameters]:
    out = []
    for url in urls:
        p = pika.URLParameters(url)
        p.connection_attempts = 1
        p.socket_timeout = 2
        p.blocked_connection_timeout = 10
        p.heartbeat = 2  # a stalled link (DROP) is noticed, as a real client would
        p.stack_timeout = 5
        out.append(p)
    return out


class Publisher(threading.Thread):
    def __init__(self, key: str, urls: list[str], mode: str, batch: int) -> None:
        super().__init__(daemon=True, name=f"publisher-{key}")
        self.key, self.urls, self.mode, self.batch = key, urls, mode, batch
        self.n = 0  # transactions begun (ids are never reused)
        self.stop_event = threading.Event()
        self.committed: dict[str, list[str]] = {}  # txid -> bodies (confirm: one each)
        self.unknown: set[str] = set()              # sent, no answer (lost connection)
        self.by_host: Counter[str] = Counter()  # answers per node the client dialled
        self.answered_at: list[float] = []  # monotonic time of each commit-ok / confirm
        self.reconnects = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                try:
                    self._session()
                except RETRYABLE:
                    self.reconnects += 1
                    time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    def _session(self) -> None:
        conn = pika.BlockingConnection(params(self.urls))
        host = str(conn._impl.params.host)  # the URL that took it (a backup relays it)
        try:
            ch = conn.channel()
            ch.queue_declare(QUEUE, durable=True)
            if self.mode == "tx":
                ch.tx_select()
            else:
                ch.confirm_delivery()
            props = pika.BasicProperties(delivery_mode=2)
            while not self.stop_event.is_set():
                self.n += 1
                txid = f"{self.key}-{self.n}"
                bodies = [f"{txid}-{i}" for i in range(self.batch if self.mode == "tx" else 1)]
                self.unknown.add(txid)
                for body in bodies:
                    ch.basic_publish("", QUEUE, body.encode(), props)
                if self.mode == "tx":
                    ch.tx_commit()
                self.unknown.discard(txid)
                self.committed[txid] = bodies
                self.by_host[host] += 1
                self.answered_at.append(time.monotonic())
        finally:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - already gone
                pass


@dataclass
class Report:
    mode: str
    committed: int = 0
    messages: int = 0
    unknown: int = 0
    lost_messages: int = 0
    lost: list[str] = field(default_factory=list)      # committed transactions missing
    partial: list[str] = field(default_factory=list)   # committed, some messages missing
    partial_unknown: list[str] = field(default_factory=list)  # unanswered, partly there
    duplicates: int = 0
    drained: int = 0
    by_host: dict[str, int] = field(default_factory=dict)
    epochs: int = 0
    faults: list[tuple[str, float]] = field(default_factory=list)  # fault, settle seconds
    reconnects: int = 0

    @property
    def ok(self) -> bool:
        return not self.lost and not self.partial and not self.partial_unknown

    def table(self) -> str:
        rows = [("mode", self.mode), ("transactions committed" if self.mode == "tx"
                                       else "messages confirmed", self.committed),
                ("messages recorded", self.messages), ("unanswered", self.unknown),
                ("lost (committed, missing)", len(self.lost)),
                ("lost messages", self.lost_messages), ("partial", len(self.partial)),
                ("partial among unanswered", len(self.partial_unknown)),
                ("duplicates drained", self.duplicates), ("drained", self.drained),
                ("answers by node dialled", dict(sorted(self.by_host.items()))),
                ("reconnects", self.reconnects), ("final epoch", self.epochs)]
        width = max(len(str(k)) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"fault {name}: settled {secs:.1f}s after the heal" for name, secs in self.faults]
        return "\n".join(lines)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest time without an answer between ``start`` and ``end``."""
    inside = [start, *(t for t in times if start < t < end), end]
    return max(b - a for a, b in zip(inside, inside[1:], strict=False))


def drain(urls: list[str], deadline: float) -> list[str]:
    """Every message on the queue (a consumer, acknowledging in batches); what a lost
    connection left unacknowledged comes again and is counted once."""
    got: dict[str, None] = {}
    # delivered twice on one connection, the second time without the redelivered flag: on
    # the queue twice (across connections a failover may redeliver without the flag)
    twice: list[str] = []
    while time.monotonic() < deadline:
        try:
            conn = pika.BlockingConnection(params(urls))
            try:
                ch = conn.channel()
                ch.queue_declare(QUEUE, durable=True)
                ch.basic_qos(prefetch_count=2000)
                last = None
                session: set[str] = set()
                for method, _props, body in ch.consume(QUEUE, inactivity_timeout=2.0):
                    if method is None:
                        break
                    text = body.decode()
                    if text in session and not method.redelivered:
                        twice.append(text)
                    session.add(text)
                    got[text] = None
                    last = method.delivery_tag
                    if last % 1000 == 0:
                        ch.basic_ack(last, multiple=True)
                if last is not None:
                    ch.basic_ack(last, multiple=True)
                ch.cancel()
                if ch.queue_declare(QUEUE, durable=True, passive=True).method.message_count == 0:
                    return [*got, *twice]
            finally:
                conn.close()
        except RETRYABLE:
            time.sleep(0.2)
    raise TimeoutError(f"the drain did not finish ({len(got)} messages so far)")

def run(cluster: NamespacedCluster, *, mode: str, hold: float, publishers: int = 2,
        batch: int = 10, seed: int = 0, settle: float = 60.0, rounds: int = 1,
        log: Callable[[str], None] = print) -> Report:
    """Publish through every fault of ``FAULTS`` (``rounds`` times), then drain and check."""
    rng = random.Random(seed)
    net = cluster.net
    primary = cluster.wait_settled(settle)
    urls = [cluster.url(n) for n in cluster.names]
    pubs = [Publisher(f"p{k}", urls[k % len(urls):] + urls[:k % len(urls)], mode, batch)
            for k in range(publishers)]
    for p in pubs:
        p.start()
    report = Report(mode)
    time.sleep(hold)
    for _ in range(rounds):
        for fault in FAULTS:
            primary = cluster.wait_settled(settle)
            p, backups = cluster.index(primary), [i for i in range(3)
                                                  if cluster.names[i] != primary]
            log(f"fault {fault} (primary {primary})")
            if fault == "primary-cut-from-backups":
                for b in backups:
                    net.cut(p, b)
                time.sleep(hold)
            elif fault == "backup-cut-from-everyone":
                net.isolate(rng.choice(backups))
                time.sleep(hold)
            elif fault == "bridge-n1-n3":
                net.cut(0, 2)
                time.sleep(hold)
            elif fault == "primary-flapping":  # whoever is the primary at each flap
                end = time.monotonic() + 2 * hold
                while time.monotonic() < end:
                    now = cluster.primary() or primary
                    for b in range(len(cluster.names)):
                        if cluster.names[b] != now:
                            net.cut(cluster.index(now), b)
                    time.sleep(rng.uniform(1.0, 2.0))
                    net.heal()
                    time.sleep(rng.uniform(1.0, 2.0))
            elif fault == "primary-slow-lossy":
                net.slow(p, 0.15, 0.05, 0.02, seed=rng.randrange(1 << 30))
                time.sleep(2 * hold)
            healed = time.monotonic()
            net.heal()
            cluster.wait_settled(settle)
            report.faults.append((fault, time.monotonic() - healed))
            time.sleep(min(hold, 2.0))  # some traffic on the settled cluster
    for p in pubs:
        p.stop_event.set()
    for p in pubs:
        p.join(30)
        if p.is_alive():
            raise TimeoutError(f"{p.name} did not stop")
        if p.error is not None:
            raise p.error
    final = cluster.wait_settled(settle)
    report.epochs = int((cluster.status(final) or {"node": {}})["node"].get("epoch") or 0)
    got = drain([cluster.url(final)] + urls, time.monotonic() + 120)
    return check(report, pubs, got)


def check(report: Report, pubs: list[Publisher], got: list[str]) -> Report:
    present = Counter(got)
    report.drained = len(got)
    report.duplicates = sum(c - 1 for c in present.values() if c > 1)
    for p in pubs:
        report.reconnects += p.reconnects
        report.unknown += len(p.unknown)
        for host, count in p.by_host.items():
            report.by_host[host] = report.by_host.get(host, 0) + count
        for txid, bodies in p.committed.items():
            report.committed += 1
            report.messages += len(bodies)
            missing = [b for b in bodies if b not in present]
            if len(missing) == len(bodies):
                report.lost.append(txid)
                report.lost_messages += len(missing)
            elif missing:
                report.partial.append(txid)
                report.lost_messages += len(missing)
        if report.mode == "tx":
            by_tx: Counter[str] = Counter(b.rsplit("-", 1)[0] for b in present
                                          if b.startswith(p.key + "-"))
            for txid in p.unknown:
                if 0 < by_tx.get(txid, 0) < p.batch:
                    report.partial_unknown.append(txid)
    return report


def describe(report: Report, cluster: NamespacedCluster) -> str:
    """The table, and the logs around the first loss (for a failing test)."""
    out = [report.table()]
    if report.lost or report.partial:
        out.append(f"first lost: {(report.lost or report.partial)[:10]}")
        out.append(cluster.diagnostics())
    return "\n".join(out)

