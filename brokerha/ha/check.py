"""Replicas checked (issue 35; NEO's CheckReplicas): do a group's copies of its queues agree?

``brokerha ctl check-replicas`` asks a group's primary (the one group of an
ordinary cluster, or a partition's leader) to emit a ``ck`` event, a token,
into its replication log (``cluster/replication.py``). Every member takes its
report where it applies that event -- the primary at emit, each backup at the
same seq of its stream -- so every report describes the queues at one point
of the log, whatever came before or after it. Per queue (by name and
``x-ha-id``): the count of messages, the runs of their positions and a digest
of the content at each position. A backup sends its report back
(``CheckReport``); the primary compares each with its own (``compare``):
a queue missing or extra, another incarnation (``x-ha-id``), positions missing
or extra, the digest differs.

Why a digest made at the check rather than kept up to date: keeping an XOR of
``crc32(position, content)`` per queue costs on every enqueue and again on
every dequeue, on every node (measured: 0.6 us for a 1 KiB message, some 5 %
of a primary's CPU per confirmed message with two backups), and a dequeue of a
paged-out message would need its crc kept on the entry (memory per message)
since its body is no longer in memory. A check is rare; its cost is paid by
the check alone.

Bounded: at the ``ck`` a member copies the references to its queues' entries
(C speed, as a join's catch-up does: ``queue_entries``, ~35 ms for 2,000,000);
the digests are then made from that copy in slices (``SLICE_ENTRIES`` entries
or ``SLICE_BYTES`` of content, each paged-out body read back with its batch's
one store query), one slice per loop turn (``schedule``): the loop serves
clients, heartbeats and the replication stream between slices, and the queue
may change meanwhile (the copy holds the entries, and a resident message's
body with them). A paged-out entry that was dequeued on that node after the
``ck`` and before its slice is gone from the store: that queue's digest is
then unknown there (``digest`` None, ``unread``) and its content is not
compared (said so, not a difference); its count and positions still are.

The digest of a queue: a crc32 run over its messages in position order, each
its position, the lengths, exchange and routing key (as the wire's short
strings), header and body. What a replica differs in by content alone
(positions equal) is named per queue, not per message.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from brokerha.backup.backup import Backup
from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry
from brokerha.broker.paging import PAGED
from brokerha.broker.placement import GroupScope
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R
from brokerha.cluster.messages import Message
from brokerha.cluster.replication import CheckReport
from brokerha.primary.primary import Primary

log = logging.getLogger("brokerha.ha")

SLICE_ENTRIES = 4096  # entries digested in one slice (one loop turn) at most
SLICE_BYTES = 4 << 20  # ... and bytes of content
SLICE_SECONDS = 0.002  # ... and time: a slice ends after the chunk that passes it
READ_BATCH = 256  # entries per chunk, and per store read of paged-out bodies
KEEP = 16  # checks a primary remembers (the newest)
PACE = 3.0  # a slice of t seconds is followed by t x PACE of rest (ReplicaChecks)
SHOWN_RUNS = 8  # runs of missing or extra positions a difference lists at most
CHANGING = "changing"  # a queue's mode while its ha-replicate change is not applied
_HEAD = struct.Struct(">qII")  # position, header length, body length
_position = attrgetter("position")

BodyReader = Callable[[str, str, list[int]], dict[int, tuple[bytes, bytes]]]
Schedule = Callable[[Callable[[], None]], None]
Send = Callable[[str, Message], None]
Later = Callable[[float, Callable[[], None]], object]


class CheckRefused(Exception):
    """This member cannot run a check now (not the serving primary of its group)."""


def entry_digest(crc: int, position: int, route: bytes, header: bytes, body: bytes) -> int:
    """The queue's running digest once the message at ``position`` is added to ``crc``."""
    crc = zlib.crc32(_HEAD.pack(position, len(header), len(body)), crc)
    crc = zlib.crc32(route, crc)
    crc = zlib.crc32(header, crc)
    return zlib.crc32(body, crc)


def listed(queue: Queue, acquired: Iterable[Entry]) -> Iterator[Entry]:
    """The queue's entries now, ready and ``acquired`` (delivered, not acknowledged), in
    position order: each priority level's references copied now at C speed (~20 ms for
    2,000,000 entries), merged lazily as they are walked (each level is in position order)."""
    levels = [level for level in queue.ready.levels_copy() if level]
    held = sorted(acquired, key=_position)
    if held:
        levels.append(held)
    if len(levels) == 1:
        return iter(levels[0])
    return heapq.merge(*levels, key=_position)


@dataclass
class QueueReport:
    """One member's copy of one queue at the check's seq."""

    vhost: str
    name: str
    ha_id: str | None
    count: int
    runs: list[list[int]]  # [first, last] runs of the positions, ascending
    digest: int | None  # None: a paged-out body was gone before it could be read
    unread: int = 0  # such bodies

    @property
    def key(self) -> tuple[str, str]:
        return self.vhost, self.name

    def as_wire(self) -> list[Any]:
        return [self.vhost, self.name, self.ha_id, self.count, self.runs, self.digest,
                self.unread]

    @classmethod
    def from_wire(cls, wire: Any) -> QueueReport:
        """``ValueError`` or ``TypeError`` on a malformed one."""
        vhost, name, ha_id, count, runs, digest, unread = wire
        return cls(str(vhost), str(name), None if ha_id is None else str(ha_id), int(count),
                   [[int(a), int(b)] for a, b in runs], None if digest is None else int(digest),
                   int(unread))


class _QueueWalk:
    """One queue's report, made from its entries (a copy taken at the ``ck``) a chunk at a
    time."""

    __slots__ = ("queue", "ha_id", "entries", "count", "runs", "crc", "unread", "done")

    def __init__(self, queue: Queue, entries: Iterator[Entry]) -> None:
        self.queue = queue
        ha_id = queue.arguments.get(R.HA_ID)
        self.ha_id = None if ha_id is None else str(ha_id)
        self.entries = entries
        self.count = 0
        self.runs: list[list[int]] = []
        self.crc = 0
        self.unread = 0
        self.done = False

    def chunk(self, read_bodies: BodyReader, limit: int) -> tuple[int, int]:
        """Digest up to ``limit`` entries: (entries, bytes) done."""
        batch = list(itertools.islice(self.entries, limit))
        if len(batch) < limit:
            self.done = True
        if not batch:
            return 0, 0
        q = self.queue
        paged = [e.position for e in batch if e.paged == PAGED]
        bodies = read_bodies(q.vhost, q.name, paged) if paged else {}
        runs = self.runs
        if runs:
            first, last = runs.pop()
        else:
            first = last = batch[0].position
        crc32, pack = zlib.crc32, _HEAD.pack
        crc = self.crc
        size = 0
        for e in batch:
            p = e.position
            if p != last + 1 and p != first:
                runs.append([first, last])
                first = p
            last = p
            m = e.message
            if e.paged == PAGED:
                found = bodies.get(p)
                if found is None:  # paged when listed, dequeued here since
                    self.unread += 1
                    continue
                header, body = found
            else:
                header, body = m.header, m.body
            size += len(body) + len(header)
            crc = crc32(body, crc32(header, crc32(m.route, crc32(
                pack(p, len(header), len(body)), crc))))  # entry_digest, inlined
        runs.append([first, last])
        self.crc = crc
        self.count += len(batch)
        return len(batch), size

    def report(self) -> QueueReport:
        q = self.queue
        return QueueReport(q.vhost, q.name, self.ha_id, self.count, self.runs,
                           None if self.unread else self.crc, self.unread)


class ReportBuilder:
    """A member's report at the ``ck``: its queues' entries listed now (``queues``: each
    queue and its entries held by consumers, which its backups hold as ready), their
    digests made by ``step`` in bounded slices."""

    def __init__(self, queues: Iterable[tuple[Queue, Iterable[Entry] | None]],
                 read_bodies: BodyReader) -> None:
        self.read_bodies = read_bodies
        # acquired None: the queue's messages are not listed (not replicated: count 0)
        self._walks = deque([_QueueWalk(q, iter(()) if acquired is None else listed(q, acquired))
                             for q, acquired in queues])
        self.reports: list[QueueReport] = []
        self.entries = 0
        self.bytes = 0
        self.slices = 0
        self.busy = 0.0  # seconds spent in slices
        self.longest = 0.0  # the longest slice, seconds

    @property
    def done(self) -> bool:
        return not self._walks

    def step(self, max_entries: int = SLICE_ENTRIES, max_bytes: int = SLICE_BYTES,
             max_seconds: float = SLICE_SECONDS) -> bool:
        """One slice; True once every queue is reported (``reports``)."""
        clock = time.perf_counter
        began = clock()
        until = began + max_seconds
        entries = size = 0
        walks = self._walks
        while walks and entries < max_entries and size < max_bytes and clock() < until:
            walk = walks[0]
            n, b = walk.chunk(self.read_bodies, min(READ_BATCH, max_entries - entries))
            entries += n
            size += b
            if walk.done:
                self.reports.append(walk.report())
                walks.popleft()
        spent = clock() - began
        self.entries += entries
        self.bytes += size
        self.slices += 1
        self.busy += spent
        self.longest = max(self.longest, spent)
        return not walks

    def run(self) -> list[QueueReport]:
        """Every slice at once (tests)."""
        while not self.step():
            pass
        return self.reports

    def stats(self) -> dict[str, Any]:
        return {"entries": self.entries, "bytes": self.bytes, "slices": self.slices,
                "busy_seconds": round(self.busy, 4), "longest_slice": round(self.longest, 4)}


def primary_queues(primary: Primary) -> tuple[list[tuple[Queue, list[Entry] | None]],
                                               dict[tuple[str, str], str]]:
    """The queues a primary replicates, with their entries held by consumers (None for a
    queue whose messages are not replicated: not listed, its backups hold an empty
    copy), and each one's mode (``all``, ``configuration``, or ``CHANGING``: an
    ``ha-replicate`` change not applied yet)."""
    queues: list[tuple[Queue, list[Entry] | None]] = []
    modes: dict[tuple[str, str], str] = {}
    for vhost in primary.broker.vhosts.values():
        for q in vhost.queues.values():
            mode = primary.replicate_mode(q)
            if mode == "none" or q.exclusive_owner is not None:
                continue
            if primary.replicate_change(q) is not None:
                mode = CHANGING  # its backups' copies are being replaced: not compared
            modes[(q.vhost, q.name)] = mode
            queues.append((q, primary.acquired_entries(q) if mode == "all" else None))
    return queues, modes


def backup_queues(broker: Broker,
                  scope: GroupScope | None) -> list[tuple[Queue, list[Entry] | None]]:
    """The queues a backup holds of its group (no consumers: everything is ready)."""
    return [(q, []) for vhost in broker.vhosts.values() for q in vhost.queues.values()
            if q.exclusive_owner is None and (scope is None or scope.queues(q))]


# -- comparing -------------------------------------------------------------------------------


def subtract(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """The runs of positions in ``a`` and not in ``b`` (both ascending, disjoint runs)."""
    out: list[list[int]] = []
    j = 0
    for first, last in a:
        lo = first
        while j < len(b) and b[j][1] < lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] <= last:
            if b[k][0] > lo:
                out.append([lo, b[k][0] - 1])
            lo = max(lo, b[k][1] + 1)
            if lo > last:
                break
            k += 1
        j = k
        if lo <= last:
            out.append([lo, last])
    return out


def _positions(runs: list[list[int]]) -> dict[str, Any]:
    return {"count": sum(b - a + 1 for a, b in runs), "runs": runs[:SHOWN_RUNS],
            "more_runs": max(0, len(runs) - SHOWN_RUNS)}


def compare(reference: QueueReport | None, mode: str | None,
            copy: QueueReport | None) -> tuple[list[dict[str, Any]], list[str]]:
    """How a replica's copy of a queue differs from the primary's (``reference``, of
    ``mode``): (differences, notes). A note says what could not be compared."""
    if reference is None and copy is None:
        return [], []
    if reference is None:
        assert copy is not None
        return [{"what": "extra queue", "ha_id": copy.ha_id, "count": copy.count}], []
    if copy is None:
        return [{"what": "missing queue"}], []
    if copy.ha_id != reference.ha_id:
        return [{"what": "another incarnation", "ha_id": copy.ha_id,
                 "count": copy.count}], []
    if mode == CHANGING:
        return [], ["its ha-replicate change is not applied on every backup yet: not compared"]
    if mode != "all":  # its messages are not replicated: its copies hold none
        return [], []
    out: list[dict[str, Any]] = []
    missing = subtract(reference.runs, copy.runs)
    extra = subtract(copy.runs, reference.runs)
    if missing:
        out.append({"what": "missing positions", **_positions(missing)})
    if extra:
        out.append({"what": "extra positions", **_positions(extra)})
    if copy.count != reference.count and not (missing or extra):
        out.append({"what": "count differs", "count": copy.count})  # a duplicate position
    notes = []
    if reference.digest is None or copy.digest is None:
        unread = (reference.unread, copy.unread)
        notes.append(f"content not compared: {max(unread)} paged-out messages were consumed "
                     "before the check read them")
    elif not out and copy.digest != reference.digest:
        out.append({"what": "digest differs", "digest": copy.digest})
    return out, notes


# -- a check, on the primary ------------------------------------------------------------------


@dataclass
class ReplicaCheck:
    """One check, as its group's primary runs it: its own report and the backups'."""

    token: str
    group: int | None
    primary: str
    epoch: int
    seq: int  # the ck's
    members: list[str]  # the group's, the primary included
    sessions: dict[str, bool]  # the backups following at the ck: whether caught up
    started: float
    builder: ReportBuilder
    modes: dict[tuple[str, str], str]
    own: list[QueueReport] | None = None
    own_at: float | None = None
    reports: dict[str, tuple[bool, list[QueueReport], float]] = field(default_factory=dict)
    malformed: dict[str, str] = field(default_factory=dict)
    on_done: list[Callable[[], None]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.own is not None and all(
            n in self.reports or n in self.malformed for n in self.sessions)

    def own_report(self, reports: list[QueueReport], now: float) -> None:
        self.own, self.own_at = reports, now
        self._maybe_done()

    def receive(self, node: str, msg: CheckReport, now: float) -> None:
        if node not in self.sessions or node in self.reports:
            return
        try:
            queues = [QueueReport.from_wire(w) for w in msg.queues]
        except (TypeError, ValueError) as exc:
            self.malformed[node] = f"malformed report: {exc}"
        else:
            self.reports[node] = (bool(msg.caught_up), queues, now)
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.done:
            callbacks, self.on_done = self.on_done, []
            for callback in callbacks:
                callback()

    def result(self, now: float) -> dict[str, Any]:
        """What ``ctl check-replicas`` prints (its ``--json``): per replica whether it
        reported, per queue and replica whether they agree and how they differ."""
        replicas: dict[str, dict[str, Any]] = {
            self.primary: {"role": "primary", "reported": self.own is not None,
                           "caught_up": True,
                           "seconds": None if self.own_at is None
                           else round(self.own_at - self.started, 3),
                           "why": None if self.own is not None else "its own report is not done"}}
        for node in self.members:
            if node == self.primary:
                continue
            entry: dict[str, Any] = {"role": "backup", "reported": node in self.reports,
                                     "caught_up": self.sessions.get(node), "seconds": None,
                                     "why": None}
            if node not in self.sessions:
                entry["why"] = "not following the primary at the check (down or not joined)"
            elif node in self.malformed:
                entry["why"] = self.malformed[node]
            elif node in self.reports:
                caught_up, _, at = self.reports[node]
                entry["caught_up"] = caught_up
                entry["seconds"] = round(at - self.started, 3)
                if not caught_up:
                    entry["why"] = "still catching up at the check: differences expected"
            else:
                entry["why"] = f"no report after {now - self.started:.1f} s"
            replicas[node] = entry
        own = {r.key: r for r in self.own or []}
        copies = {node: {r.key: r for r in queues} for node, (_, queues, _) in self.reports.items()}
        keys = sorted(set(own).union(*(set(c) for c in copies.values())))
        queues = []
        differing = 0
        for key in keys:
            ref = own.get(key)
            mode = self.modes.get(key) if ref is not None else None
            row: dict[str, Any] = {
                "vhost": key[0], "name": key[1], "mode": mode,
                "ha_id": None if ref is None else ref.ha_id,
                "count": None if ref is None else ref.count,
                "digest": None if ref is None else ref.digest, "replicas": {}}
            for node, reports in sorted(copies.items()):
                if ref is None and key not in reports:
                    continue
                differences, notes = compare(ref, mode, reports.get(key))
                caught_up = self.reports[node][0]
                agree: bool | None = not differences
                if not caught_up:
                    agree = None
                    notes = [*notes, "catching up at the check"]
                elif differences:
                    differing += 1
                elif notes:
                    agree = None
                row["replicas"][node] = {"agree": agree, "differences": differences,
                                         "notes": notes}
            queues.append(row)
        # every member reported a consistent copy, every copy of every queue compared
        complete = all(r["reported"] and r["caught_up"] for r in replicas.values()) and all(
            v["agree"] is not None for q in queues for v in q["replicas"].values())
        return {"token": self.token, "group": self.group, "primary": self.primary,
                "epoch": self.epoch, "seq": self.seq,
                "seconds": round(now - self.started, 3), "replicas": replicas,
                "queues": queues, "differences": differing, "agree": differing == 0,
                "complete": complete, "primary_work": self.builder.stats()}


# -- a member's checks --------------------------------------------------------------------------


class ReplicaChecks:
    """A member's checks (``ha/member.py``): those it runs as its group's primary, and the
    reports it makes as a backup. ``schedule``: run a callback next loop turn (a slice
    each); ``send``: a packet to a peer (the member's effects, grouped on a partitioned
    node)."""

    def __init__(self, broker: Broker, me: str, scope: GroupScope | None, schedule: Schedule,
                 send: Send, clock: Callable[[], float],
                 later: Later | None = None, pace: float = PACE) -> None:
        self.broker = broker
        # after a slice of t seconds the next waits t x pace (``later``; without it, the
        # next loop turn): the node's process is busy with a check at most 1 / (1 + pace)
        self.later = later
        self.pace = pace
        self.me = me
        self.scope = scope
        self.schedule = schedule
        self.send = send
        self.clock = clock
        self.runs: dict[str, ReplicaCheck] = {}
        self._counter = itertools.count(1)
        self.reported = 0  # reports sent as a backup

    @property
    def group(self) -> int | None:
        return None if self.scope is None else self.scope.group

    def _pump(self, builder: ReportBuilder, done: Callable[[], None]) -> None:
        def step() -> None:
            before = builder.busy
            if builder.step():
                done()
            elif self.later is not None and self.pace > 0:
                self.later((builder.busy - before) * self.pace, step)
            else:
                self.schedule(step)

        self.schedule(step)

    # -- as the primary ---------------------------------------------------------------------

    def start(self, primary: Primary, members: Iterable[str]) -> ReplicaCheck:
        """Emit a ``ck`` into ``primary``'s log and make this node's report at it."""
        if primary.closed:
            raise CheckRefused(f"{self.me} is no longer the primary")
        token = f"{self.me}.{primary.epoch}.{next(self._counter)}.{time.time_ns() % 10**9}"
        queues, modes = primary_queues(primary)
        builder = ReportBuilder(queues, self.broker.store.read_bodies)  # listed at the ck
        seq = primary.emit(R.CheckToken(R.CHECK, token))
        sessions = {node: s.caught_up for node, s in primary.sessions.items()}
        run = ReplicaCheck(token, self.group, self.me, primary.epoch, seq,
                           list(dict.fromkeys([self.me, *members])), sessions, self.clock(),
                           builder, modes)
        self.runs[token] = run
        while len(self.runs) > KEEP:
            self.runs.pop(next(iter(self.runs)))
        log.info("node %s checks the replicas of %s at seq %d (token %s; %d queues, backups %s)",
                 self.me, "its group" if self.scope is None else str(self.scope), seq, token,
                 len(queues), ", ".join(sorted(sessions)) or "none")
        self._pump(builder, lambda: run.own_report(builder.reports, self.clock()))
        return run

    def received(self, peer: str, msg: CheckReport) -> None:
        """A backup's report."""
        run = self.runs.get(msg.token)
        if run is None or msg.epoch != run.epoch or msg.node != peer:
            return
        run.receive(peer, msg, self.clock())

    # -- as a backup ------------------------------------------------------------------------

    def replica(self, backup: Callable[[], Backup | None], primary: str,
                epoch: int) -> CheckReplica:
        """What takes the ``ck`` events of ``primary`` (epoch ``epoch``) on this backup."""
        return CheckReplica(self, backup, primary, epoch)


class CheckReplica:
    """A backup's ``ck`` (``Backup.layers``): the report of its group's queues as they are
    where it applies the event, made in slices, then sent to the primary."""

    def __init__(self, checks: ReplicaChecks, backup: Callable[[], Backup | None],
                 primary: str, epoch: int) -> None:
        self.checks = checks
        self.backup = backup
        self.primary = primary
        self.epoch = epoch

    def apply(self, event: Any) -> None:
        checks = self.checks
        backup = self.backup()
        caught_up = backup is not None and backup.caught_up
        scope = backup.scope if backup is not None else checks.scope
        builder = ReportBuilder(backup_queues(checks.broker, scope), checks.broker.store.read_bodies)
        token = str(event.token)

        def done() -> None:
            checks.reported += 1
            checks.send(self.primary, CheckReport(
                self.epoch, checks.me, token, caught_up,
                [r.as_wire() for r in builder.reports]))

        checks._pump(builder, done)

    def after_durable(self, callback: Callable[[], None]) -> None:
        callback()  # it writes nothing
