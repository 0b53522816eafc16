"""The asyncio driver of one TxLog master: the round engine on a real clock, network and disk.

The engine (:mod:`brokerha.txlog.engine.rounds`) is sans-I/O; this module carries
out its actions and nothing else:

* every input (a peer's message, a local transaction, a timer, an operator's
  peer change) is one engine call with the wall clock in milliseconds;
* the ``Persist`` actions of that call are written to the journal and fsynced
  (:mod:`brokerha.txlog.master.journal`) *before* any of its ``Send`` actions leaves
  the node; on an HA primary (``replication``, :mod:`brokerha.txlog.bridge.replica`)
  the record also goes to the DC's backups, and the call's other actions are
  carried out only once the record is on the DC's quorum (the confirm rule,
  ``cluster/quorum.py``) -- in call order, never blocking the loop;
* ``Send`` goes over the cluster transport (:mod:`brokerha.cluster.link`) as a
  ``TxLogPacket`` (:mod:`brokerha.txlog.master.wire`); a message to a peer that is
  not connected is dropped, which the rounds tolerate like a lost packet;
* the next ``tick`` is scheduled ``wakeup_after()`` ms after the call;
* ``Confirm`` resolves the submitter's future; ``Confirm``,
  ``DeliverOrdered``, ``Backup``, ``Restore`` and ``Event`` also go to the
  ``on_action`` callback (later: the broker's commit path).

The transport only accepts configured peers of the same group with the shared
secret; a message whose ``sender`` is not the authenticated peer is refused
here, and one from an unconfigured sender is refused by the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from brokerha.broker.stats import LatencyHistogram
from brokerha.cluster.link import ClusterLinks, tls_contexts
from brokerha.cluster.messages import Message as ClusterMessage
from brokerha.files import fsync_off_loop, replace_durably
from brokerha.ha.core import Cancellable
from brokerha.seed_runner import UnsafeRules
from brokerha.txlog.engine.config import Peer, TxLogConfig
from brokerha.txlog.engine.messages import (
    Action,
    Backup,
    Confirm,
    DeliverOrdered,
    Event,
    Persist,
    Refused,
    Restore,
    Send,
)
from brokerha.txlog.engine.records import MasterEvent, Operation
from brokerha.txlog.engine.rounds import RoundEngine
from brokerha.txlog.engine.state import DurableState
from brokerha.txlog.master.journal import Journal
from brokerha.txlog.master.settings import MasterSettings, parse_urls
from brokerha.txlog.master.wire import TxLogPacket, WireError, decode, encode

log = logging.getLogger("brokerha.txlog")

PEERS_FILE = "txlog-peers.json"
EVENTS_FILE = "txlog-events.jsonl"
EVENTS_KEPT = 1000
PEERS_FSYNC_TIMEOUT = 30.0  # seconds a peer change waits for its journal record's fsync
LATENCY_SAMPLES = 2000


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class JournalReplication(Protocol):
    """Where a master's journal is replicated (an HA primary's log: ``txlog.replica``)."""

    def record(self, seq: int, body: bytes) -> None:
        """One journal record, in journal order."""

    def snapshot(self, seq: int, state: DurableState) -> None:
        """The whole state as of record ``seq`` (the backups replace theirs with it)."""

    def barrier(self, callback: Callable[[], None]) -> None:
        """``callback`` once everything handed over so far is on the DC's quorum (FIFO)."""


OnPacket = Callable[[str, int, ClusterMessage], None]
OnPeer = Callable[[str], None]
Fsync = Callable[..., None]  # (fd, done(error), *, sync=True): ``files.fsync_off_loop``'s shape


class MasterLinks(Protocol):
    """The links to the other datacenters' masters (``ClusterLinks``; a simulation's)."""

    address: tuple[str, int] | None

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def send(self, peer: str, message: ClusterMessage) -> int | None: ...

    def connected(self, peer: str) -> bool: ...

    def add_peer(self, peer: str, address: list[tuple[str, int]]) -> None: ...

    def remove_peer(self, peer: str) -> None: ...


def cluster_links(settings: MasterSettings, config: TxLogConfig, on_packet: OnPacket,
                  on_up: OnPeer, on_down: OnPeer) -> MasterLinks:
    """The real links: TCP (TLS with ``settings.tls``), the group's handshake and secret."""
    tls = settings.tls  # the files are read each time a master starts
    ssl_server, ssl_client = (None, None) if tls is None else tls_contexts(
        tls.cert, tls.key, tls.ca)
    return ClusterLinks(
        settings.group, config.node_id, _addresses(config.peers), settings.listen,
        settings.secret, on_packet, on_up, on_down, ssl_server, ssl_client,
        check_peer_name=tls is not None and tls.check_peer_name)


def loop_later(delay: float, callback: Callable[[], None]) -> Cancellable:
    return asyncio.get_running_loop().call_later(delay, callback)


@dataclass(frozen=True)
class MasterIO:
    """Where a master's I/O goes besides its journal's files: its links, timers, clock and
    fsyncs. The defaults are the process's; the HA simulation (``txlog/simulation/
    datacenter.py``) passes its simulated links and disks and its virtual clock."""

    links: Callable[[MasterSettings, TxLogConfig, OnPacket, OnPeer, OnPeer], MasterLinks] = \
        cluster_links
    later: Callable[[float, Callable[[], None]], Cancellable] = loop_later
    clock: Callable[[], int] = wall_ms  # milliseconds
    fsync: Fsync = fsync_off_loop


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the driver to break on purpose (simulations only): each must be caught."""

    no_quorum_wait: bool = False  # act on a journal record once fsynced here, not on the quorum


class TxLogDriver:
    """One TxLog master: engine + journal + links + timer."""

    def __init__(self, settings: MasterSettings, *,
                 on_action: Callable[[Action], None] | None = None,
                 fsync: bool = True, replication: JournalReplication | None = None,
                 io: MasterIO | None = None, unsafe: Unsafe | None = None) -> None:
        self.settings = settings
        self.io = io = io or MasterIO()
        self.clock = io.clock
        self.unsafe = unsafe or Unsafe()
        self.on_action = on_action
        self.replication = replication
        # engine calls whose actions wait (their record's fsync, its quorum), in call order:
        # [actions, how many of its barriers have not passed yet]
        self._pending: deque[list[Any]] = deque()
        self._fsync_waiters: deque[tuple[int, Callable[[], None]]] = deque()
        self._fsyncing = False
        self.data_dir = Path(settings.data_dir)
        self.journal = Journal(self.data_dir, fsync=fsync)
        self._synced_seq = 0  # the last journal record known to be on disk (set at start)
        config = self._effective_config(settings.txlog)
        durable = self.journal.load(config)
        config = self._journal_peers(config, durable)
        self.restarted = self.journal.seq > 0
        self.engine = RoundEngine(config, self.clock(), durable)
        self.me = config.node_id
        self.links = io.links(settings, config, self._on_packet, self._on_peer_up,
                              self._on_peer_down)
        self.events: deque[dict[str, Any]] = deque(self._read_events(), maxlen=EVENTS_KEPT)
        self.latency_ms: deque[int] = deque(maxlen=LATENCY_SAMPLES)
        # every sample since this master started, for /metrics (latency_ms keeps the last few)
        self.latency = LatencyHistogram()
        self.counters = dict.fromkeys(
            ("sent", "not_connected", "received", "refused", "wire_errors", "delivered",
             "confirmed", "held_batches", "fsyncs", "fsync_errors"), 0)
        self._confirm_waiters: dict[str, asyncio.Future[str]] = {}
        self._sync_waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._own_created: dict[str, int] = {}
        self._timer: Cancellable | None = None
        self._closed = False

    # ---- life cycle --------------------------------------------------------------

    async def start(self) -> None:
        self._synced_seq = self.journal.seq  # what was loaded is on disk
        await self.links.start()
        if self.restarted:
            self._event("restart", None, {"journal_seq": self.journal.seq,
                                          "replayed_records": self.journal.records_replayed})
        self._run([])

    def replicate_state(self) -> None:
        """Hand the whole durable state to ``replication`` (a master starting on a new primary).

        The DC's backups replace whatever TxLog state they hold (an older
        term's, or a record the old primary never got onto the quorum) with
        this one before any record of this master, so no later promotion can
        bring back a state this master's sends did not come from.

        Nothing leaves this master before that state is on the DC's quorum: it
        may hold records no other node has (this node's own master of an
        earlier term wrote them, and lost its majority before they were
        replicated), and a post sent from them would tell another datacenter
        of transactions the next primary never heard of (found by the HA
        TxLog simulation, seed 1261: a transaction synchronised in B that A's
        next master did not know).
        """
        if self.replication is None:
            return
        self.replication.snapshot(self.journal.seq, self.engine.durable)
        self._hold([], [self.replication.barrier])  # no actions: it holds back later calls'

    async def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        # the journal first (before any await): the node's backup side may open the
        # same directory as soon as this node follows another primary
        self.journal.close()
        await self.links.close()
        for fut in [*self._confirm_waiters.values(), *self._sync_waiters.values()]:
            if not fut.done():
                fut.set_exception(ConnectionError("TxLog master stopped"))

    @property
    def address(self) -> tuple[str, int] | None:
        return self.links.address

    # ---- inputs --------------------------------------------------------------------

    async def submit(self, operations: Iterable[Operation], wait: str = "confirm",
                     timeout: float = 30.0) -> dict[str, Any]:
        """A local transaction: answer once confirmed (or, ``wait="synchronised"``, ordered here)."""
        if wait not in ("confirm", "synchronised"):
            raise ValueError(f"wait: {wait!r} is not confirm or synchronised")
        if self._closed:
            raise ConnectionError("TxLog master stopped")
        loop = asyncio.get_running_loop()
        record, actions = self.engine.local_tx(list(operations), self.clock())
        confirmed: asyncio.Future[str] = loop.create_future()
        self._confirm_waiters[record.tx_id] = confirmed
        synced: asyncio.Future[dict[str, Any]] | None = None
        if wait == "synchronised":
            synced = self._sync_waiters[record.tx_id] = loop.create_future()
        self._own_created[record.tx_id] = record.created_ms
        self._run(actions)
        result: dict[str, Any] = {"tx_id": record.tx_id, "timestamp": record.timestamp,
                                  "origin": record.origin, "created_ms": record.created_ms}
        async with asyncio.timeout(timeout):
            result["outcome"] = await confirmed
            if synced is not None:
                result.update(await synced)
        return result

    async def add_peer(self, node_id: str, url: str) -> None:
        """Add a sync peer; returns once the change is on disk (its journal record)."""
        address = parse_urls(url, f"url of peer {node_id}")
        self._run(self.engine.add_peer(node_id, url, self.clock()))
        self.links.add_peer(node_id, address)
        await self._peers_recorded()

    async def remove_peer(self, node_id: str, wait_s: float = 10.0) -> None:
        """Remove a sync peer; during a recovery vote, wait (up to ``wait_s``) for it to end.

        Removing a peer from one master before the others changes that master's
        view first, which can itself start a vote (the others still count the
        peer); the engine refuses a removal while voting, so it waits here.
        """
        deadline = time.monotonic() + wait_s
        while self.engine.voting and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._closed:  # stopped while waiting: its peers file is no longer its own
            raise ConnectionError("TxLog master stopped")
        self._run(self.engine.remove_peer(node_id, self.clock()))
        self.links.remove_peer(node_id)
        await self._peers_recorded()

    def set_split_recovery(self, value: str) -> None:
        self._run(self.engine.set_split_recovery(value))

    def _on_packet(self, peer: str, msg_id: int, packet: ClusterMessage) -> None:
        if self._closed:
            return
        if not isinstance(packet, TxLogPacket):
            log.debug("txlog: ignoring %s from %s", type(packet).__name__, peer)
            return
        try:
            message = decode(packet)
        except WireError as exc:
            self.counters["wire_errors"] += 1
            log.warning("txlog: malformed message from %s dropped: %s", peer, exc)
            return
        if message.sender != peer:
            self._refused(Refused(message.sender, f"sent over the link of {peer}"))
            return
        self.counters["received"] += 1
        self._run(self.engine.received(message, self.clock()))

    def _on_peer_up(self, peer: str) -> None:
        log.info("txlog: link with %s up", peer)

    def _on_peer_down(self, peer: str) -> None:
        log.info("txlog: link with %s down", peer)

    def _tick(self) -> None:
        self._timer = None
        if not self._closed:
            self._run(self.engine.tick(self.clock()))

    # ---- outputs -------------------------------------------------------------------

    def _run(self, actions: list[Action]) -> None:
        """Carry out one engine call's actions: persists first (durable), then the rest in order.

        The record of the persists is written at once and fsynced off the event
        loop (a broker node's clients must not wait for the TxLog's disk); the
        rest waits for that fsync and, with ``replication``, for the record to
        be on the DC's quorum. A call without a record waits too while an
        earlier one is held, so actions leave in call order.
        """
        if self._closed:
            return
        persists = [a for a in actions if isinstance(a, Persist)]
        body = self.journal.write(persists, self.engine.durable, sync=False)
        rest = [a for a in actions if not isinstance(a, Persist)]
        barriers: list[Callable[[Callable[[], None]], None]] = []
        if body is not None:
            barriers.append(self._after_fsync)
            if self.replication is not None:
                self.replication.record(self.journal.seq, body)
                if not self.unsafe.no_quorum_wait:
                    barriers.append(self.replication.barrier)
        if not barriers and not self._pending:
            self._carry_out(rest)
        else:
            self.counters["held_batches"] += 1
            self._hold(rest, barriers)
        self._schedule()

    def _hold(self, actions: list[Action],
              barriers: list[Callable[[Callable[[], None]], None]]) -> None:
        """Carry out ``actions`` once every barrier passed and every earlier held call left."""
        entry: list[Any] = [actions, len(barriers)]
        self._pending.append(entry)
        for barrier in barriers:
            barrier(lambda entry=entry: self._passed(entry))
        self._release()

    def _passed(self, entry: list[Any]) -> None:
        entry[1] -= 1
        self._release()

    def _release(self) -> None:
        """Carry out the held calls whose barriers all passed, oldest first."""
        pending = self._pending
        while pending and pending[0][1] <= 0:
            actions = pending.popleft()[0]
            if not self._closed:
                self._carry_out(actions)

    # ---- the journal's fsync, off the loop ------------------------------------------------

    def _after_fsync(self, callback: Callable[[], None]) -> None:
        """``callback`` once every record written so far is on disk."""
        target = self.journal.seq
        if target <= self._synced_seq or not self.journal.fsync:
            callback()
            return
        self._fsync_waiters.append((target, callback))
        self._start_fsync()

    def _start_fsync(self) -> None:
        if self._fsyncing or self.journal.closed:
            return
        self._fsyncing = True
        target = self.journal.seq
        fd = os.dup(self.journal.fileno())  # a snapshot or close may replace the file meanwhile
        self.io.fsync(fd, lambda exc: self._fsynced(target, exc))

    def _fsynced(self, target: int, exc: BaseException | None) -> None:
        self._fsyncing = False
        if exc is not None:  # never act on what may not be on disk: this master stalls
            self.counters["fsync_errors"] += 1
            log.error("txlog: fsync of the journal failed (%s); this master sends nothing "
                      "more: restart the node", exc)
            return
        self.counters["fsyncs"] += 1
        self._synced_seq = max(self._synced_seq, target)
        waiters = self._fsync_waiters
        while waiters and waiters[0][0] <= self._synced_seq:
            waiters.popleft()[1]()
        if waiters:
            self._start_fsync()

    def _carry_out(self, actions: list[Action]) -> None:
        encoded: dict[int, TxLogPacket] = {}
        for action in actions:
            if isinstance(action, Send):
                pkt = encoded.get(id(action.message))
                if pkt is None:
                    pkt = encoded[id(action.message)] = encode(action.message)
                if self.links.send(action.peer, pkt) is None:
                    self.counters["not_connected"] += 1
                else:
                    self.counters["sent"] += 1
                continue
            if isinstance(action, Confirm):
                self.counters["confirmed"] += 1
                fut = self._confirm_waiters.pop(action.tx_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(action.outcome)
            elif isinstance(action, DeliverOrdered):
                self.counters["delivered"] += 1
            elif isinstance(action, Event):
                self._on_event(action)
            elif isinstance(action, Refused):
                self._refused(action)
            elif isinstance(action, Backup | Restore):
                log.info("txlog: %s at position %d", type(action).__name__.lower(), action.position)
            if self.on_action is not None:
                self.on_action(action)
        self._note_synchronised()

    def _schedule(self) -> None:
        if self._closed:
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max(self.engine.wakeup_after(), 1) / 1000
        self._timer = self.io.later(delay, self._tick)

    def _note_synchronised(self) -> None:
        """Latency samples for own transactions, and answers to ``wait=synchronised``."""
        if not self._own_created:
            return
        sync = self.engine.sync
        for tx_id in [t for t in self._own_created if sync.contains(t)]:
            created = self._own_created.pop(tx_id)
            position = sync.position(tx_id)
            entry = sync.entry(tx_id)
            ordered = entry.ordered_ms if entry is not None else self.clock()
            self.latency_ms.append(ordered - created)
            self.latency.observe(max(ordered - created, 0) / 1000)
            fut = self._sync_waiters.pop(tx_id, None)
            if fut is not None and not fut.done():
                fut.set_result({"position": position, "ordered_ms": ordered,
                                "latency_ms": ordered - created})

    def _on_event(self, event: Event) -> None:
        if event.kind == "renegotiate":
            old, new = event.detail["replay_of"], event.detail["tx_id"]
            for waiters in (self._confirm_waiters, self._sync_waiters):
                if old in waiters:
                    waiters[new] = waiters.pop(old)  # type: ignore[assignment]
            if old in self._own_created:
                self._own_created[new] = self._own_created.pop(old)
        self._event(event.kind, event.peer, event.detail)

    def _refused(self, refused: Refused) -> None:
        self.counters["refused"] += 1
        log.warning("txlog: refused a message from %s: %s", refused.sender, refused.reason)
        self._event("refused", refused.sender, {"reason": refused.reason})

    def _event(self, kind: str, peer: str | None, detail: dict[str, Any]) -> None:
        row = {"at_ms": self.clock(), "kind": kind, "generation": self.engine.generation,
               "peer": peer, "detail": detail}
        self.events.append(row)
        log.info("txlog event %s%s %s", kind, f" {peer}" if peer else "",
                 json.dumps(detail, sort_keys=True, default=str))
        try:
            with open(self.data_dir / EVENTS_FILE, "a") as f:
                f.write(json.dumps(row, sort_keys=True, default=str) + "\n")
        except OSError as exc:
            log.warning("txlog: cannot append to %s: %s", EVENTS_FILE, exc)

    def _read_events(self) -> list[dict[str, Any]]:
        rows = []
        try:
            with open(self.data_dir / EVENTS_FILE) as f:
                for line in f:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        continue  # a torn last line
        except FileNotFoundError:
            pass
        return rows[-EVENTS_KEPT:]

    # ---- runtime peers survive a restart ---------------------------------------------

    def _effective_config(self, config: TxLogConfig) -> TxLogConfig:
        """The configured peers, unless ``add-peer``/``remove-peer`` changed them at runtime.

        On an HA node the file may come from the DC's primary (``lp`` events,
        ``txlog/bridge/replica.py``): a promoted node starts with the peers the
        operator set on the old primary, not the configuration's.
        """
        path = self.data_dir / PEERS_FILE
        data = read_peers_file(self.data_dir)
        if data is None:
            return config
        peers = decode_peers(data)
        if peers != config.peers:
            log.warning("txlog: sync peers from %s (changed at runtime) replace the config "
                        "file's: %s", path, ", ".join(p.node_id for p in peers) or "none")
        return replace(config, peers=peers)

    def _journal_peers(self, config: TxLogConfig, durable: DurableState) -> TxLogConfig:
        """The peers of the journal's last ``peers`` record, which win over the file.

        A runtime change is one journal record (the peers with the view change
        they cause); the file is written after that record is on disk, and a
        crash between the two leaves the file behind: it is written again here.
        """
        if durable.peers is None or durable.peers == config.peers:
            return config
        log.warning("txlog: sync peers from the journal's last runtime change replace %s's: %s",
                    PEERS_FILE, ", ".join(p.node_id for p in durable.peers) or "none")
        write_peers_file(self.data_dir, encode_peers(durable.peers))
        return replace(config, peers=durable.peers)

    async def _peers_recorded(self, timeout: float = PEERS_FSYNC_TIMEOUT) -> None:
        """Once the journal record of a peer change is on disk, write the peers file.

        The file mirrors the journal (which a restart reads first) and never
        runs ahead of it; a journal that cannot be fsynced stalls the master,
        so this gives up with ``TimeoutError`` after ``timeout``.
        """
        recorded: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._after_fsync(lambda: recorded.done() or recorded.set_result(None))
        try:
            async with asyncio.timeout(timeout):
                await recorded
        except TimeoutError:
            raise TimeoutError("the change is not on disk yet: the TxLog journal's fsync "
                               f"stalled for {timeout:g}s (see the node's log)") from None
        write_peers_file(self.data_dir, encode_peers(self.engine.config.peers))

    # ---- views -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        engine, durable = self.engine, self.engine.durable
        now_mono = engine.mono
        peers = []
        for p in engine.config.peers:
            heard = engine.last_heard.get(p.node_id)
            post = engine.posts.get(p.node_id)  # its latest post in our view: its merge base
            peers.append({"id": p.node_id, "url": p.url, "connected": self.links.connected(p.node_id),
                          "member": p.node_id in engine.members,
                          "silent_ms": None if heard is None else now_mono - heard,
                          "synchronised": None if post is None else post.merge_base.length})
        samples = sorted(self.latency_ms)
        return {
            "node_id": self.me,
            "group": self.settings.group,
            "tls": None if self.settings.tls is None else {
                "ca": str(self.settings.tls.ca),
                "check_peer_name": self.settings.tls.check_peer_name},
            "generation": engine.generation,
            "members": sorted(engine.members),
            "split": engine.split,
            "split_at": durable.split_at,
            "voting": engine.voting,
            "split_recovery": durable.strategy.value,
            "busy": engine.busy,
            "peers": peers,
            "synchronised": {"length": len(engine.sync), "offset": engine.sync.offset.length,
                             "digest": engine.merge_base().digest},
            "incoming": len(engine.incoming),
            "own_unsynchronised": len(durable.own),
            "applied": durable.model.applied,
            "journal_seq": self.journal.seq,
            "counters": dict(self.counters),
            "latency_ms": {"samples": len(samples), "p50": _pct(samples, 0.5),
                           "p99": _pct(samples, 0.99)},
            "events": list(self.events)[-20:],
        }

    def log_rows(self, start: int = 0) -> list[dict[str, Any]]:
        sync = self.engine.sync
        first = max(start, sync.offset.length)
        return [
            {"position": first + i, "tx_id": e.record.tx_id, "timestamp": e.record.timestamp,
             "origin": e.record.origin, "generation": e.generation,
             "created_ms": e.record.created_ms, "ordered_ms": e.ordered_ms,
             "outcome": e.outcome, "replay_of": e.record.replay_of}
            for i, e in enumerate(sync.entries[first - sync.offset.length:])
        ]

    async def export(self, out_dir: Path | str) -> Path:
        """Parquet export of this master (docs/txlog-export.md); files written off the loop."""
        from brokerha.txlog.master.export import export, source_for  # pyarrow: lazily

        events = [MasterEvent(e["at_ms"], e["kind"], e["generation"], e["peer"], e["detail"])
                  for e in self.events]
        source = source_for(self.engine.durable, self.engine, events, self.me)
        source.synchronised = [replace(e) for e in source.synchronised]  # a copy, not live entries
        now = self.clock()
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: export(source, out_dir, exported_ms=now))


def encode_peers(peers: Iterable[Peer]) -> bytes:
    """The bytes of ``PEERS_FILE``: what a backup receives in ``lp`` and writes as is."""
    return json.dumps([{"id": p.node_id, "url": p.url} for p in peers]).encode()


def decode_peers(data: bytes) -> tuple[Peer, ...]:
    """``PEERS_FILE``'s peers; ``ValueError`` if it is not a list of ``{"id", "url"}``."""
    rows = json.loads(data)
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("url"), str)
            for r in rows):
        raise ValueError(f"{PEERS_FILE}: expected a list of {{\"id\": ..., \"url\": ...}}")
    return tuple(Peer(r["id"], r["url"]) for r in rows)


def read_peers_file(data_dir: Path | str) -> bytes | None:
    """``PEERS_FILE`` of a TxLog directory, or None (the configuration's peers apply)."""
    try:
        return (Path(data_dir) / PEERS_FILE).read_bytes()
    except FileNotFoundError:
        return None


def write_peers_file(data_dir: Path | str, data: bytes | None) -> None:
    """Replace ``PEERS_FILE`` durably (temporary file, fsync, rename, fsync of the directory).

    ``None`` removes it. The master writes it at a runtime peer change; an HA
    backup writes the copy its primary replicates (``lp``), so a crash
    leaves the old file or the new one, never a torn one a master would
    refuse to start on.
    """
    replace_durably(Path(data_dir) / PEERS_FILE, data)


def _addresses(peers: Iterable[Peer]) -> dict[str, list[tuple[str, int]]]:
    """Each peer's addresses: a list of URLs is the nodes of an HA datacenter, tried in turn."""
    return {p.node_id: parse_urls(p.url, f"url of peer {p.node_id}") for p in peers}


def _pct(samples: list[int], q: float) -> int | None:
    if not samples:
        return None
    return samples[min(int(q * len(samples)), len(samples) - 1)]
