"""Prometheus metrics of one node, served at ``GET /metrics`` on the admin listener.

Nothing is instrumented on the message path: a per-node ``CollectorRegistry``
holds one collector that reads the live objects when Prometheus scrapes —
the queues (their ``published``/``delivered`` counters and depths), the AMQP
connections, the HA layer (role, epoch, readiness, failover history, elections
and step-downs by reason, late heartbeats, lease lapses) and, on
the primary, each backup's replication session, ha-replicate changes of
existing queues (pending, applied, joins again asked), publisher flow control
(holds, seconds held, whose lag), the cyclic GC (the node's ``GCGovernor``:
collections, pauses, frozen objects), and the TxLog master where
the node runs one (its queues, view and agreement latency). The latency
histograms are kept where the time is measured: the broker's
``stats.commit_latency``, the governor's ``pauses`` and the TxLog driver's
``latency`` (the samples of its ``latency_ms``). Every name is listed with
its meaning in ``docs/operations.md``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector

from brokerha.admin.node_view import NodeView
from brokerha.httpapi.server import Request, Response

Node = NodeView  # what these endpoints read of the node (admin/node_view.py)

ROLES = ("standalone", "primary", "backup", "joining")
FAILOVER_EVENTS = ("elected", "stepped down", "deposed", "promote requested")


class TransactionCounter:
    """A TransactionObserverFactory that counts transactions and observes none of them.

    ``create`` returns None, so no observer is attached and a commit takes
    exactly the path it takes without it.
    """

    def __init__(self) -> None:
        self.tx = 0
        self.dtx = 0

    def create(self, transaction: Any) -> None:
        if getattr(transaction, "xid", None) is not None:  # an XA branch (a DtxBranch)
            self.dtx += 1
        else:
            self.tx += 1


class NodeCollector:
    """Reads a node's live state on each scrape."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.transactions = TransactionCounter()
        node.broker.observers.add_transaction_observer_factory(self.transactions)
        # failovers: HANode keeps a bounded history; count each entry once, by time
        self._failover_counts = dict.fromkeys(FAILOVER_EVENTS, 0)
        self._failover_seen = 0.0

    def _rabbitmq(self, cluster: str) -> Iterator[Metric]:
        """rabbitmq_prometheus's names (its aggregated ``/metrics``) for what brokerha has,
        so a RabbitMQ Grafana dashboard shows this node; docs/operations.md lists them."""
        node, broker = self.node, self.node.broker
        identity = GaugeMetricFamily("rabbitmq_identity_info", "RabbitMQ node & cluster identity "
                                     "info", labels=["rabbitmq_node", "rabbitmq_cluster",
                                                     "rabbitmq_cluster_permanent_id"])
        identity.add_metric([f"brokerha@{node.config.name}", cluster, cluster], 1)
        yield identity
        conns = [p.conn for p in list(node.connections) if p.conn is not None]
        queues = [q for vh in list(broker.vhosts.values()) for q in list(vh.queues.values())]
        gauges = (
            ("rabbitmq_connections", "Connections currently open", len(conns)),
            ("rabbitmq_channels", "Channels currently open",
             sum(len(c.channels) for c in conns)),
            ("rabbitmq_queues", "Queues available", len(queues)),
            ("rabbitmq_consumers", "Consumers currently connected",
             sum(q.consumer_count for q in queues)),
            ("rabbitmq_queue_messages_ready", "Messages ready to be delivered to consumers",
             sum(q.message_count for q in queues)),
            ("rabbitmq_queue_messages_unacked", "Messages delivered to consumers but not yet "
             "acknowledged", sum(q.unacked for q in queues)),
            ("rabbitmq_queue_messages", "Sum of ready and unacknowledged messages",
             sum(q.message_count + q.unacked for q in queues)),
            ("rabbitmq_process_resident_memory_bytes", "Memory used in bytes",
             broker.memory.used),
            ("rabbitmq_resident_memory_limit_bytes", "Memory high watermark in bytes",
             broker.limits.memory_limit),
        )
        for metric, text, value in gauges:
            yield GaugeMetricFamily(metric, text, value=value)
        counters = (
            ("rabbitmq_global_messages_received", "Total number of messages received from "
             "publishers", sum(q.published for q in queues)),
            ("rabbitmq_global_messages_confirmed", "Total number of messages confirmed to "
             "publishers", broker.stats.confirms),
            ("rabbitmq_global_messages_delivered", "Total number of messages delivered to "
             "consumers", sum(q.delivered for q in queues)),
            ("rabbitmq_global_messages_acknowledged", "Total number of messages acknowledged by "
             "consumers", sum(q.acked for q in queues)),
        )
        for metric, text, value in counters:
            yield CounterMetricFamily(metric, text, value=value)

    @staticmethod
    def _disk(status: dict[str, Any]) -> Iterator[Metric]:
        """The disk alarm: this node's free space and limit, and every alarm in force."""
        me = status["node"]
        disk = me["disk"]
        yield GaugeMetricFamily("brokerha_disk_free_limit_bytes", "disk_free_limit (0 = off)",
                                value=disk["disk_free_limit"])
        free = GaugeMetricFamily("brokerha_disk_free_bytes", "Free space where the node writes",
                                 labels=["path"])
        for path, value in disk["free"].items():
            if value is not None:
                free.add_metric([path], value)
        yield free
        alarms = GaugeMetricFamily(
            "brokerha_resource_alarm", "1 per resource alarm blocking publishers here: memory, "
            "disk (free space), disk:store (a write found the disk full), disk:<backup>",
            labels=["alarm", "reason"])
        for alarm, reason in sorted(me["alarms"].items()):
            alarms.add_metric([alarm, reason], 1)
        yield alarms
        yield GaugeMetricFamily("brokerha_disk_alarm", "1 while a disk alarm (this node's or a "
                                "ready backup's) blocks publishers",
                                value=int(any(a.split(":")[0] == "disk" for a in me["alarms"])))

    def describe(self) -> list[Metric]:
        return []  # collected on demand; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        node = self.node
        name = node.config.name
        status = node.status()
        me = status["node"]
        cluster = status.get("cluster") or ""

        info = GaugeMetricFamily("brokerha_node_info", "This node: name and cluster (always 1)",
                                 labels=["node", "cluster"])
        info.add_metric([name, cluster], 1)
        yield info
        role = GaugeMetricFamily("brokerha_role", "1 for this node's current role, 0 for the "
                                 "others", labels=["role"])
        for r in ROLES:
            role.add_metric([r], 1 if me.get("role") == r else 0)
        yield role
        yield GaugeMetricFamily("brokerha_epoch", "Election epoch this node is in (0 standalone)",
                                value=me.get("epoch") or 0)
        yield GaugeMetricFamily("brokerha_ready", "1 when ready: a serving primary, a caught-up "
                                "backup or a standalone node", value=1 if me.get("ready") else 0)
        yield GaugeMetricFamily("brokerha_serving", "1 while the AMQP listener is open",
                                value=1 if me.get("serving") else 0)
        yield from self._failovers(status)
        yield from self._election(me.get("election"))
        yield from self._replication(me.get("replication"))
        yield from self._queues()
        yield from self._connections()
        yield from self._rabbitmq(cluster or name)
        broker = node.broker
        yield CounterMetricFamily(
            "brokerha_durable_requests", "Durability barriers requested: one per publisher "
            "confirm, tx.commit and DTX answer (rate = confirms + commits per second)",
            value=broker.durable_requests)
        yield CounterMetricFamily(
            "brokerha_durable_refused", "Durability barriers never answered because this "
            "node did not serve clients in the same term when asked and when due (an HA "
            "member failing closed; their connections are closed)",
            value=broker.durable_refused)
        yield CounterMetricFamily(
            "brokerha_client_connections_refused", "Client connections handed over when this "
            "node could not serve them (closed at once: the client tries its next URL)",
            value=node.admission.refused)
        stats = broker.stats
        yield CounterMetricFamily("brokerha_confirms", "Publisher confirms (basic.ack/nack) "
                                  "settled", value=stats.confirms)
        yield CounterMetricFamily("brokerha_commits", "tx.commit-ok sent", value=stats.commits)
        monitor = node.loop_monitor
        loop_lag = HistogramMetricFamily(
            "brokerha_event_loop_lag_seconds", "How late the node's event loop woke a timer "
            "due every 20 ms (a stall over the lease lapses a primary's lease, a longer one may "
            "cost it its role: docs/ha.md)")
        loop_lag.add_metric([], monitor.lag.cumulative(), monitor.lag.sum)
        yield loop_lag
        yield CounterMetricFamily("brokerha_event_loop_stalls", "Event loop stalls over 100 ms "
                                  "(each logged at WARNING with what ran)", value=monitor.stalls)
        yield GaugeMetricFamily("brokerha_event_loop_lag_max_seconds", "The longest event loop "
                                "stall since the node started", value=monitor.max_lag)
        yield from self._flow()
        yield from self._gc()
        latency = HistogramMetricFamily(
            "brokerha_commit_latency_seconds", "tx.commit received to tx.commit-ok sent (the "
            "store and every ready backup included)")
        latency.add_metric([], stats.commit_latency.cumulative(), stats.commit_latency.sum)
        yield latency
        tx = CounterMetricFamily("brokerha_transactions_begun", "Transactions begun (TX "
                                 "transactions and DTX branches), committed or not",
                                 labels=["kind"])
        tx.add_metric(["tx"], self.transactions.tx)
        tx.add_metric(["dtx"], self.transactions.dtx)
        yield tx
        yield GaugeMetricFamily("brokerha_memory_queued_bytes", "Bytes of message content held "
                                "in memory by queues", value=broker.memory.used)
        yield GaugeMetricFamily("brokerha_memory_alarm", "1 while publishers are blocked by the "
                                "memory limit", value=1 if broker.memory_blocked else 0)
        yield from self._disk(status)
        yield from self._txlog()
        yield from self._tls()

    def _flow(self) -> Iterator[Metric]:
        """Publisher flow control (broker/flow.py): on an HA primary, publishers are not read
        while a backup holding a copy lags ``flow_lag``; how often, how long, whose lag."""
        flow = self.node.broker.flow
        yield GaugeMetricFamily("brokerha_publishers_held", "1 while publishers are held by flow "
                                "control (not read, not told: a backup lags flow_lag)",
                                value=1 if flow.held else 0)
        yield CounterMetricFamily("brokerha_publisher_flow_holds", "Times publishers were held "
                                  "by flow control (episodes)", value=flow.episodes)
        yield CounterMetricFamily("brokerha_publisher_flow_held_seconds", "Seconds publishers "
                                  "were held by flow control (the hold in force included)",
                                  value=flow.held_seconds())
        by_backup = CounterMetricFamily("brokerha_backup_flow_holds", "Publisher flow holds "
                                        "started by this backup's lag", labels=["backup"])
        for backup, count in sorted(flow.episodes_by_cause.items()):
            by_backup.add_metric([backup], count)
        yield by_backup

    def _gc(self) -> Iterator[Metric]:
        """The cyclic GC of the node's process, as its governor saw it (node/gc_governor.py):
        collections and pauses by generation, survivors frozen, thaws."""
        governor = getattr(self.node, "gc", None)
        if governor is None:
            return
        stats = governor.stats()
        collections = CounterMetricFamily("brokerha_gc_collections", "Cyclic GC collections "
                                          "by generation (2: full)", labels=["generation"])
        pauses = HistogramMetricFamily("brokerha_gc_pause_seconds", "How long each cyclic GC "
                                       "collection held the node (the event loop included), "
                                       "by generation", labels=["generation"])
        for generation, histogram in enumerate(governor.pauses):
            buckets = histogram.cumulative()  # its +Inf bucket: every collection, read once
            collections.add_metric([str(generation)], buckets[-1][1])
            pauses.add_metric([str(generation)], buckets, histogram.sum)
        yield collections
        yield pauses
        yield GaugeMetricFamily("brokerha_gc_pause_max_seconds", "The longest cyclic GC pause "
                                "since the node started", value=stats["pause_seconds_max"])
        yield GaugeMetricFamily("brokerha_gc_frozen_objects", "Objects frozen out of the cyclic "
                                "GC's walk (the survivors of its collections of generation 1 "
                                "and 2: the backlog among them), as counted at start and at "
                                "the last thaw check (counting walks them all)",
                                value=stats["frozen"])
        yield CounterMetricFamily("brokerha_gc_thaws", "Times the frozen objects were thawed "
                                  "and collected once (cycles among them freed)",
                                  value=stats["thaws"])
        yield CounterMetricFamily("brokerha_gc_thaws_skipped", "Thaws put off because too many "
                                  "objects were frozen (a deep backlog)",
                                  value=stats["thaws_skipped"])
        yield CounterMetricFamily("brokerha_gc_bulk_freezes", "Times the young survivors were "
                                  "frozen without a middle or full walk: a bulk made at once "
                                  "(a big commit, a catch-up packet) or a middle collection "
                                  "due over more objects than one walk may take (BULK_WALK)",
                                  value=stats["bulk_freezes"] + stats["bulk_walks_frozen"])

    def _tls(self) -> Iterator[Metric]:
        tls = getattr(self.node, "tls", None)
        cert = tls.certificate if tls is not None else None
        if cert is None:
            return
        yield GaugeMetricFamily("brokerha_tls_certificate_expiry_timestamp_seconds",
                                "When the node certificate in use (amqps, HTTPS) expires, "
                                "Unix time", value=cert["not_after_ts"])
        yield CounterMetricFamily("brokerha_tls_reloads", "Certificate reloads (SIGHUP, POST "
                                  "/api/tls/reload) that took effect", value=tls.reloads)

    def _txlog(self) -> Iterator[Metric]:
        bridge = getattr(self.node, "txlog", None)
        driver = bridge.driver if bridge is not None else None
        yield GaugeMetricFamily("brokerha_txlog_running", "1 when this node runs a TxLog master "
                                "(with [txlog]: a standalone node, or the serving primary)",
                                value=1 if driver is not None else 0)
        if driver is None:
            return
        engine = driver.engine
        yield GaugeMetricFamily("brokerha_txlog_synchronised_length", "Transactions in this "
                                "master's synchronised queue (the agreed order)",
                                value=len(engine.sync))
        yield GaugeMetricFamily("brokerha_txlog_incoming", "Acquired transactions not yet "
                                "ordered", value=len(engine.incoming))
        yield GaugeMetricFamily("brokerha_txlog_split", "1 during an acknowledged split",
                                value=1 if engine.split else 0)
        yield GaugeMetricFamily("brokerha_txlog_members", "Masters in this master's view "
                                "(itself included)", value=len(engine.members))
        yield GaugeMetricFamily("brokerha_txlog_generation", "Generation of this master's "
                                "view (it moves on every membership change)",
                                value=engine.generation)
        agreement = HistogramMetricFamily(
            "brokerha_txlog_agreement_latency_seconds", "A local transaction on global queues "
            "from its acquisition by this master to its place in the synchronised order (the "
            "TxLog rounds with every member), since the master started on this node")
        agreement.add_metric([], driver.latency.cumulative(), driver.latency.sum)
        yield agreement
        applied = CounterMetricFamily("brokerha_txlog_applied", "Ordered transactions applied "
                                      "to this node's global queues, by validation outcome",
                                      labels=["outcome"])
        applied.add_metric(["committed"], bridge.counters["applied_committed"])
        applied.add_metric(["failed"], bridge.counters["applied_failed"])
        yield applied
        yield CounterMetricFamily("brokerha_txlog_refused", "Local commits on global queues "
                                  "refused (TxLog not running, timeout, failed validation)",
                                  value=bridge.counters["refused"]
                                  + bridge.counters["validation_failed"])

    # -- parts -------------------------------------------------------------------------

    def _failovers(self, status: dict[str, Any]) -> Iterator[Metric]:
        for event in status.get("failovers") or []:
            at = float(event.get("at", 0.0))
            if at > self._failover_seen:
                kind = str(event.get("event"))
                self._failover_counts[kind] = self._failover_counts.get(kind, 0) + 1
        if status.get("failovers"):
            self._failover_seen = max(float(e.get("at", 0.0)) for e in status["failovers"])
        family = CounterMetricFamily("brokerha_failovers", "Role changes seen by this node: "
                                     "elected, stepped down, deposed, promote requested",
                                     labels=["event"])
        for kind, count in sorted(self._failover_counts.items()):
            family.add_metric([kind], count)
        yield family
        last = max((float(e.get("at", 0.0)) for e in status.get("failovers") or []), default=0.0)
        yield GaugeMetricFamily("brokerha_last_failover_timestamp_seconds", "Unix time of the "
                                "last role change seen by this node (0: none)", value=last)

    @staticmethod
    def _election(election: dict[str, Any] | None) -> Iterator[Metric]:
        """An HA member's elections by reason, its step-downs as primary by reason, late
        heartbeats and lease lapses (``cluster/election.py``; node/ha.py's status)."""
        if not election:
            return
        started = CounterMetricFamily(
            "brokerha_elections", "Campaigns this node started (it stood for primary), by why: "
            "no_primary (none heard since it started or lost one), election_timeout (its "
            "primary silent for the timeout), link_down (its link to its primary closed), "
            "transfer (a manual failover named it)", labels=["reason"])
        for reason, count in election["elections"].items():
            started.add_metric([reason], count)
        yield started
        rounds = CounterMetricFamily(
            "brokerha_election_rounds", "Vote rounds this node ran as a candidate: pre_vote "
            "(nothing changes on the voters; a refused campaign retries them), vote (each "
            "raised the epoch)", labels=["phase"])
        for phase, count in election["rounds"].items():
            rounds.add_metric([phase], count)
        yield rounds
        last = election.get("last_election")
        yield GaugeMetricFamily("brokerha_last_election_timestamp_seconds", "Unix time of the "
                                "last campaign this node started (0: none)",
                                value=last["at"] if last else 0)
        stepdowns = CounterMetricFamily(
            "brokerha_primary_stepdowns", "Ends of this node's primary role, by why: lease_lost "
            "(no majority within the lease and the lapse after it), newer_epoch (deposed), "
            "links_closed (its links to a majority closed), transfer (it handed the role over)",
            labels=["reason"])
        for reason, count in election["stepdowns"].items():
            stepdowns.add_metric([reason], count)
        yield stepdowns
        yield CounterMetricFamily(
            "brokerha_heartbeats_late", "Heartbeats this node sent as primary more than two "
            "heartbeat intervals after the previous one (its event loop was held; each logged "
            "at WARNING, at most one line per 5 s)", value=election["heartbeats_late"])
        yield GaugeMetricFamily("brokerha_heartbeat_gap_max_seconds", "The longest time "
                                "between two heartbeats this node sent as primary",
                                value=election["heartbeat_gap_max"])
        yield CounterMetricFamily(
            "brokerha_lease_lapses", "Times this node's lease as primary ran out (it served "
            "nobody until a majority acknowledged again, or stepped down)",
            value=election["lapses"])
        yield CounterMetricFamily(
            "brokerha_lease_lapses_renewed", "Lapsed leases renewed in time: the primary "
            "served again without an election", value=election["lapses_renewed"])

    def _replication(self, replication: dict[str, Any] | None) -> Iterator[Metric]:
        if not replication:
            return
        yield GaugeMetricFamily("brokerha_replication_seq", "The primary's last replicated-event "
                                "sequence number in this epoch", value=replication.get("seq", 0))
        yield GaugeMetricFamily("brokerha_replication_replicated_seq", "Highest seq held by the "
                                "quorum (confirms up to it may go)",
                                value=replication.get("replicated", 0))
        yield GaugeMetricFamily("brokerha_replication_waiting_confirms", "Confirms and commits "
                                "waiting for backups", value=replication.get("waiting_confirms", 0))
        backups = replication.get("backups") or {}
        seq = int(replication.get("seq") or 0)
        ready = GaugeMetricFamily("brokerha_backup_ready", "1 when the backup is ready (caught "
                                  "up, not timed out)", labels=["backup"])
        timed_out = GaugeMetricFamily("brokerha_backup_timed_out", "1 when the backup left the "
                                      "guarded set (silent past backup_timeout)", labels=["backup"])
        lag = GaugeMetricFamily("brokerha_backup_lag_events", "Replicated events the backup has "
                                "not acknowledged yet (the primary's seq minus the backup's "
                                "acknowledged seq, catch-up included)", labels=["backup"])
        queues = GaugeMetricFamily("brokerha_backup_queues", "Queues in the backup's catch-up",
                                   labels=["backup"])
        caught = GaugeMetricFamily("brokerha_backup_queues_caught_up", "Queues whose catch-up "
                                   "the backup acknowledged", labels=["backup"])
        primary = getattr(self.node.ha, "primary", None)
        sessions: dict[str, Any] = dict(getattr(primary, "sessions", {}) or {})
        for node, b in sorted(backups.items()):
            ready.add_metric([node], 1 if b.get("ready") else 0)
            timed_out.add_metric([node], 1 if b.get("timed_out") else 0)
            progress = getattr(sessions.get(node), "progress", b.get("acked"))
            if progress is not None:
                lag.add_metric([node], max(0, seq - int(progress)))
            queues.add_metric([node], b.get("queues", 0))
            caught.add_metric([node], b.get("queues_caught_up", 0))
        yield from (ready, timed_out, lag, queues, caught)
        per_queue = GaugeMetricFamily("brokerha_backup_queue_caught_up", "1 when the backup "
                                      "acknowledged this queue's catch-up",
                                      labels=["backup", "vhost", "queue"])
        for node, session in sorted(sessions.items()):
            progress = getattr(session, "progress", None)
            for guard in getattr(session, "guards", []):
                if progress is not None:
                    per_queue.add_metric([node, guard.vhost, guard.queue],
                                         1 if guard.passed(progress) else 0)
        yield per_queue
        yield from self._replicate_changes(replication.get("replicate_changes") or {})

    @staticmethod
    def _replicate_changes(changes: dict[str, Any]) -> Iterator[Metric]:
        """A changed ha-replicate on existing queues (docs/ha.md, "Replication"): the queues
        whose change is not applied yet, those applied, and the joins again asked for them."""
        yield GaugeMetricFamily("brokerha_replicate_changes_pending", "Queues whose "
                                "ha-replicate change is not applied on every backup yet",
                                value=changes.get("queues_pending", 0))
        yield CounterMetricFamily("brokerha_replicate_changes_applied", "Queues whose "
                                  "ha-replicate change was applied on every backup",
                                  value=changes.get("applied_queues", 0))
        yield CounterMetricFamily("brokerha_backup_rejoins_asked", "Times a backup was asked "
                                  "to join again (its catch-up brings the queues now "
                                  "replicated whole)", value=changes.get("joins_asked", 0))

    def _queues(self) -> Iterator[Metric]:
        labels = ["vhost", "queue"]
        ready = GaugeMetricFamily("brokerha_queue_messages_ready", "Messages ready for delivery "
                                  "(queue depth)", labels=labels)
        unacked = GaugeMetricFamily("brokerha_queue_messages_unacked", "Messages delivered and "
                                    "not yet acknowledged", labels=labels)
        ready_bytes = GaugeMetricFamily("brokerha_queue_ready_bytes", "Bytes of the ready "
                                        "messages' content", labels=labels)
        consumers = GaugeMetricFamily("brokerha_queue_consumers", "Consumers on the queue",
                                      labels=labels)
        published = CounterMetricFamily("brokerha_queue_messages_published", "Messages put on "
                                        "the queue (messages in; on a backup: replicated in)",
                                        labels=labels)
        delivered = CounterMetricFamily("brokerha_queue_messages_delivered", "Messages handed "
                                        "to consumers or basic.get (messages out, redeliveries "
                                        "included)", labels=labels)
        dedup = CounterMetricFamily("brokerha_queue_messages_deduplicated", "Publishes dropped "
                                    "as duplicates (x-deduplication-window)", labels=labels)
        from brokerha.admin.partition_views import stand_in

        for vhost in list(self.node.broker.vhosts.values()):
            for q in list(vhost.queues.values()):
                if stand_in(self.node, q):  # another node's queue: that node reports it
                    continue
                key = [q.vhost, q.name]
                ready.add_metric(key, q.message_count)
                unacked.add_metric(key, q.unacked)
                ready_bytes.add_metric(key, q.ready_bytes)
                consumers.add_metric(key, q.consumer_count)
                published.add_metric(key, getattr(q, "published", 0))
                delivered.add_metric(key, getattr(q, "delivered", 0))
                dedup.add_metric(key, q.dedup_dropped)
        yield from (ready, unacked, ready_bytes, consumers, published, delivered, dedup)

    def _connections(self) -> Iterator[Metric]:
        conns = [p.conn for p in list(self.node.connections) if p.conn is not None]
        channels = [ch for c in conns for ch in list(c.channels.values())]
        yield GaugeMetricFamily("brokerha_connections", "Open AMQP client connections",
                                value=len(conns))
        yield GaugeMetricFamily("brokerha_channels", "Open AMQP channels", value=len(channels))
        yield GaugeMetricFamily(
            "brokerha_confirms_outstanding", "Publishes in confirm mode not yet confirmed, on "
            "open channels", value=sum(ch.confirm.waiting for ch in channels
                                       if getattr(ch, "confirm", None) is not None))


class NodeMetrics:
    """The node's registry and its ``/metrics`` handler."""

    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = NodeCollector(node)
        self.registry.register(self.collector)
        try:
            ProcessCollector(namespace="brokerha", registry=self.registry)
        except Exception:  # no /proc (not Linux): the process metrics are left out
            pass
        self.started = time.time()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def handle(self, request: Request) -> Response:
        return Response(200, self.render(), CONTENT_TYPE_LATEST)


def install(node: Node) -> NodeMetrics:
    metrics = NodeMetrics(node)
    node.admin.route("GET", "/metrics", metrics.handle, public=True)  # as rabbitmq_prometheus
    return metrics
