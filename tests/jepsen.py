"""A Jepsen-style partition run: publishers with all three URLs, faults one after another, a drain.

Used by ``tests/failover/test_netns_partition.py`` (bounded) and
``benchmarks/partition.py`` (long runs, a table). The cluster is
``tests/netns.py``'s: three nodes in their own network namespaces, the
shipped election timing, faults by iptables inside the namespaces.

- **Publishers** (pika, all three URLs, each list starting at another node,
  reconnecting on any error; two keep their connection until it fails, three
  more (one first dialling each node) open a new one every 3 transactions so
  that connections also arrive in the middle of a role change, as
  short-lived clients' do): in
  ``tx`` mode ``tx.select`` and ``batch`` persistent messages per
  ``tx.commit``, each body a unique id, recorded only after ``commit-ok``; in
  ``confirm`` mode one persistent message per confirm, recorded on
  ``basic.ack``. Each answer is noted with the node that served its
  connection (``cluster_name`` in the server properties: a backup's relay
  passes the primary's ``connection.start`` through, so this is the node
  that answered, not the one dialled).
- **Roles, for diagnosis**: a ``StatusSampler`` polls every node's
  ``/api/status`` all along; each answer is classed by what its node's own
  status said around it (the last sample before, the first after): primary
  (serving) both times, not primary both times, or unsure (a change in
  between, or no sample). A commit-ok from a node that said it was not the
  primary is what issue 32's lost transactions looked like.
- **Faults**, each held ``hold`` seconds, healed, and the cluster settled
  (one serving primary, every other node its ready backup) before the next:
  the primary cut from both backups but not from the clients; one backup cut
  from everyone; n1 <-> n3 cut; the primary's links to the backups flapping
  every 1-2 s (DROP on and off; flapping and the next two last ``2 * hold``);
  the primary's packets delayed 150 ms +- 50 ms with 2 % loss (delay by
  ``tests/nfqdelay.py``, loss by ``-m statistic``); and, beyond the issue's
  five network faults, the primary's process stalled 1-2 s (SIGSTOP,
  SIGCONT) every 1.5-3.5 s, for ``pause_phase * hold`` seconds. The stall
  stands in for what made the issue's long runs lose transactions: a
  primary whose event loop was held past its lease (there by a join's
  catch-up over a queue of 250,000 messages; a short run's queue is far
  smaller) while clients reconnected to it. Against the code before the fix
  (8a60c0d^), one round at 8 s a fault lost, with the five network faults
  and two publishers only, 33 transactions in 1 run of 3; with the stall
  and the short-lived clients, 260 transactions (tx) and 800 messages
  (confirm), each in the stall; the bounded run, see
  ``tests/failover/test_netns_partition.py``. A run that catches it shows
  "answers from a non-primary node" in the table.
- **Check**: the queue drained from the final primary; every recorded
  message is there (lost: 0), no transaction partly (partial: 0).
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pika
import pika.adapters.utils.connection_workflow
import pika.exceptions

from tests.netns import NamespacedCluster

# what a node's status said around an answer (StatusSampler.classify)
PRIMARY, NOT_PRIMARY, UNSURE = "primary", "not primary", "unsure"

QUEUE = "jepsen"
RETRYABLE = (pika.exceptions.AMQPError, ConnectionError, OSError, TimeoutError,
             # a handshake that stalled (AMQPConnectorStackTimeout) and the like
             pika.adapters.utils.connection_workflow.AMQPConnectorException)
FAULTS = ("primary-cut-from-backups", "backup-cut-from-everyone", "bridge-n1-n3",
          "primary-flapping", "primary-slow-lossy", "primary-paused")


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
    """Transactions (or confirmed messages) on one connection at a time, reconnecting on
    any error; with ``per_connection`` it also closes and reconnects after that many."""

    def __init__(self, key: str, urls: list[str], mode: str, batch: int,
                 per_connection: int | None = None) -> None:
        super().__init__(daemon=True, name=f"publisher-{key}")
        self.key, self.urls, self.mode, self.batch = key, urls, mode, batch
        self.per_connection = per_connection
        self.n = 0  # transactions begun (ids are never reused)
        self.stop_event = threading.Event()
        self.committed: dict[str, list[str]] = {}  # txid -> bodies (confirm: one each)
        self.unknown: set[str] = set()              # sent, no answer (lost connection)
        self.by_host: Counter[str] = Counter()  # answers per node the client dialled
        self.answers: dict[str, tuple[str, float]] = {}  # txid -> (node that served, when)
        self.answered_at: list[float] = []  # monotonic time of each commit-ok / confirm
        self.reconnects = 0
        self.errors: Counter[str] = Counter()  # what ended each session, by type
        self.error: BaseException | None = None

    def run(self) -> None:
        # reconnect on any error: pika raises more than its AMQPError (its connection
        # workflow's own), and a publisher that died would leave the faults untested;
        # the types are counted in the table, so a mistake here shows as a flood of one
        try:
            while not self.stop_event.is_set():
                try:
                    self._session()
                except Exception as exc:  # noqa: BLE001 - counted, then reconnect
                    self.reconnects += 1
                    self.errors[type(exc).__name__] += 1
                    time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    def _session(self) -> None:
        conn = pika.BlockingConnection(params(self.urls))
        host = str(conn._impl.params.host)  # the URL that took it (a backup relays it)
        # the node whose broker serves this connection (relayed: the primary's start)
        node = str(conn._impl.server_properties.get("cluster_name") or host)
        try:
            ch = conn.channel()
            ch.queue_declare(QUEUE, durable=True)
            if self.mode == "tx":
                ch.tx_select()
            else:
                ch.confirm_delivery()
            props = pika.BasicProperties(delivery_mode=2)
            left = self.per_connection
            while not self.stop_event.is_set() and (left is None or left > 0):
                if left is not None:
                    left -= 1
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
                now = time.monotonic()
                self.by_host[host] += 1
                self.answers[txid] = (node, now)
                self.answered_at.append(now)
        finally:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - already gone
                pass


class StatusSampler:
    """Every node's own ``/api/status``, polled all along (a thread per node).

    A sample is ``(sent, received, primary)``: the node's state at some instant
    between sending the request and reading the answer; ``primary`` is its
    ``role == "primary"`` with ``serving`` true.
    """

    def __init__(self, cluster: NamespacedCluster, interval: float = 0.15) -> None:
        self.cluster, self.interval = cluster, interval
        self.samples: dict[str, list[tuple[float, float, bool]]] = {n: [] for n in cluster.names}
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._poll, args=(name,), daemon=True,
                                         name=f"status-{name}") for name in cluster.names]

    def start(self) -> StatusSampler:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(5)  # each poll times out after 1 s

    def _poll(self, name: str) -> None:
        while not self.stop_event.is_set():
            sent = time.monotonic()
            st = self.cluster.status(name)
            got = time.monotonic()
            if st is not None:
                me = st.get("node") or {}
                self.samples[name].append(
                    (sent, got, me.get("role") == "primary" and bool(me.get("serving"))))
            self.stop_event.wait(max(0.0, self.interval - (got - sent)))

    def classify(self, name: str, at: float) -> str:
        """What ``name``'s status said around ``at``: PRIMARY or NOT_PRIMARY if the last
        sample taken wholly before and the first taken wholly after agree, else UNSURE."""
        samples = self.samples.get(name) or []
        before = bisect.bisect_right([s[1] for s in samples], at) - 1
        after = bisect.bisect_left([s[0] for s in samples], at)
        if before < 0 or after >= len(samples):
            return UNSURE
        said = {samples[before][2], samples[after][2]}
        if said == {True}:
            return PRIMARY
        return NOT_PRIMARY if said == {False} else UNSURE


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
    # node that served -> what its status said (PRIMARY, NOT_PRIMARY, UNSURE) -> answers
    by_node: dict[str, Counter[str]] = field(default_factory=dict)
    lost_by_node: dict[str, Counter[str]] = field(default_factory=dict)  # the same, lost txs
    epochs: int = 0
    faults: list[tuple[str, float]] = field(default_factory=list)  # fault, settle seconds
    # (monotonic start, phase): "steady", a fault's name, "<fault> healing" (until settled)
    phases: list[tuple[float, str]] = field(default_factory=list)
    lost_by_phase: Counter[str] = field(default_factory=Counter)  # when lost txs were answered
    # node -> [first, last] wall-clock time a lost transaction's answer came (for the logs)
    lost_windows: dict[str, list[float]] = field(default_factory=dict)
    reconnects: int = 0
    unsettled: str | None = None  # the cluster did not settle after a fault (the faults ended)
    errors: Counter[str] = field(default_factory=Counter)  # what ended publisher sessions

    def phase(self, at: float) -> str:
        """The phase of the run at monotonic time ``at``."""
        i = bisect.bisect_right([t for t, _ in self.phases], at) - 1
        return self.phases[i][1] if i >= 0 else "before"

    @property
    def non_primary(self) -> int:
        """Answers from a node whose own status said it was not the primary."""
        return sum(c[NOT_PRIMARY] for c in self.by_node.values())

    @property
    def ok(self) -> bool:
        return (not self.lost and not self.partial and not self.partial_unknown
                and self.unsettled is None)

    def table(self) -> str:
        rows = [("mode", self.mode), ("transactions committed" if self.mode == "tx"
                                       else "messages confirmed", self.committed),
                ("messages recorded", self.messages), ("unanswered", self.unknown),
                ("lost (committed, missing)", len(self.lost)),
                ("lost messages", self.lost_messages), ("partial", len(self.partial)),
                ("partial among unanswered", len(self.partial_unknown)),
                ("duplicates drained", self.duplicates), ("drained", self.drained),
                ("answers from a non-primary node", self.non_primary),
                ("answers by node dialled", dict(sorted(self.by_host.items()))),
                ("answers by node, its status", _nested(self.by_node)),
                ("lost by node, its status", _nested(self.lost_by_node)),
                ("lost by phase answered in", dict(self.lost_by_phase.most_common())),
                ("lost answered (wall clock)", {
                    node: " - ".join(_clock(t) for t in window)
                    for node, window in sorted(self.lost_windows.items())}),
                ("reconnects", self.reconnects),
                ("session errors", dict(self.errors.most_common())),
                ("final epoch", self.epochs)]
        width = max(len(str(k)) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"fault {name}: settled {secs:.1f}s after the heal" for name, secs in self.faults]
        if self.unsettled is not None:
            lines.append(f"NOT SETTLED, the faults stopped there: {self.unsettled}")
        return "\n".join(lines)


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def _nested(counts: dict[str, Counter[str]]) -> dict[str, dict[str, int]]:
    return {node: dict(sorted(c.items())) for node, c in sorted(counts.items())}


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
        churn: int = 3, batch: int = 10, seed: int = 0, settle: float = 60.0,
        rounds: int = 1, faults: tuple[str, ...] = FAULTS, pause_phase: float = 2.0,
        log: Callable[[str], None] = print) -> Report:
    """Publish through ``faults`` (``rounds`` times), then drain and check.

    ``publishers`` keep their connection until it fails; ``churn`` more open a
    new one every 3 transactions (or confirms), so that connections arrive at
    every moment, a role change's included. Flapping and the slow link last
    ``2 * hold`` seconds, the stalls ``pause_phase * hold``.
    """
    rng = random.Random(seed)
    cluster.wait_settled(settle)
    urls = [cluster.url(n) for n in cluster.names]

    def rotated(k: int) -> list[str]:  # each client's list starts at another node
        return urls[k % len(urls):] + urls[:k % len(urls)]

    pubs = [Publisher(f"p{k}", rotated(k), mode, batch) for k in range(publishers)]
    pubs += [Publisher(f"c{k}", rotated(k + 1), mode, batch, per_connection=3)
             for k in range(churn)]
    report = Report(mode)
    sampler = StatusSampler(cluster).start()
    try:
        for p in pubs:
            p.start()
        try:
            _publish_through_faults(cluster, report, faults, hold=hold,
                                    pause_phase=pause_phase, rng=rng, settle=settle,
                                    rounds=rounds, log=log)
        except TimeoutError as exc:  # not settled: the faults end, the check still runs
            report.unsettled = str(exc).splitlines()[0][:300]
            log(f"stopped the faults: {report.unsettled}")
    finally:
        sampler.stop()
        for p in pubs:
            p.stop_event.set()
    for p in pubs:
        p.join(30)
        if p.is_alive():
            raise TimeoutError(f"{p.name} did not stop")
        if p.error is not None:
            raise p.error
    try:
        final = cluster.wait_settled(settle)
    except TimeoutError as exc:  # nothing to drain from: say what was committed
        committed = sum(len(p.committed) for p in pubs)
        raise TimeoutError(f"{exc}\nno primary to drain from ({committed} committed; "
                           f"{report.unsettled or 'settled after every fault'})") from None
    report.epochs = int((cluster.status(final) or {"node": {}})["node"].get("epoch") or 0)
    got = drain([cluster.url(final)] + urls, time.monotonic() + 120)
    return check(report, pubs, got, sampler)


def _publish_through_faults(cluster: NamespacedCluster, report: Report,
                            faults: tuple[str, ...], *, hold: float, pause_phase: float,
                            rng: random.Random, settle: float, rounds: int,
                            log: Callable[[str], None]) -> None:
    """The faults one after another, each healed and the cluster settled (TimeoutError
    if it does not within ``settle`` seconds; every rule is removed by then)."""
    net = cluster.net
    report.phases.append((time.monotonic(), "steady"))
    time.sleep(hold)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
    for _ in range(rounds):
        for fault in faults:
            primary = cluster.wait_settled(settle)
            p, backups = cluster.index(primary), [i for i in range(3)
                                                  if cluster.names[i] != primary]
            log(f"fault {fault} (primary {primary})")
            report.phases.append((time.monotonic(), fault))
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
            elif fault == "primary-paused":  # whoever is the primary at each pause
                # longer than an election (0.6-0.9 s), so that the node stalled usually
                # resumes deposed, with its clients' reconnects waiting for it
                end = time.monotonic() + pause_phase * hold
                while time.monotonic() < end:
                    cluster.pause(cluster.primary() or primary, rng.uniform(1.0, 2.0))
                    time.sleep(rng.uniform(0.5, 1.5))
            healed = time.monotonic()
            report.phases.append((healed, f"{fault} healing"))
            net.heal()
            cluster.wait_settled(settle)
            report.faults.append((fault, time.monotonic() - healed))
            report.phases.append((time.monotonic(), "steady"))
            time.sleep(min(hold, 2.0))  # some traffic on the settled cluster


def check(report: Report, pubs: list[Publisher], got: list[str],
          sampler: StatusSampler | None = None) -> Report:
    present = Counter(got)
    to_wall = time.time() - time.monotonic()
    report.drained = len(got)
    report.duplicates = sum(c - 1 for c in present.values() if c > 1)
    for p in pubs:
        report.reconnects += p.reconnects
        report.errors.update(p.errors)
        report.unknown += len(p.unknown)
        for host, count in p.by_host.items():
            report.by_host[host] = report.by_host.get(host, 0) + count
        for txid, bodies in p.committed.items():
            report.committed += 1
            report.messages += len(bodies)
            node, at = p.answers[txid]
            said = UNSURE if sampler is None else sampler.classify(node, at)
            report.by_node.setdefault(node, Counter())[said] += 1
            missing = [b for b in bodies if b not in present]
            if len(missing) == len(bodies):
                report.lost.append(txid)
                report.lost_messages += len(missing)
            elif missing:
                report.partial.append(txid)
                report.lost_messages += len(missing)
            if missing:
                report.lost_by_node.setdefault(node, Counter())[said] += 1
                report.lost_by_phase[report.phase(at)] += 1
                wall = at + to_wall
                window = report.lost_windows.setdefault(node, [wall, wall])
                window[0], window[1] = min(window[0], wall), max(window[1], wall)
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

