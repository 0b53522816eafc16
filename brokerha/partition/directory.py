"""The queue directory (issue 35, docs/ha.md "Routing on a node outside a partition: the
queue directory").

With N > NR + 1 a node holds no cell of some partitions, so neither their queues nor
the bindings to them (both are in the partition's own log). The directory is what
every node knows of them: per queue its vhost, name, partition, ``x-ha-id``, flags,
arguments and bindings (``DirectoryEntry``), kept by the **metadata group** like the
partition table: ``qe`` events (one partition's entries changed, or all of them: a
*sync*) in the metadata log, ``qs`` (the whole directory) in a join's catch-up, a copy
in every node's store (meta ``queue_directory``, the partitions' epochs, and
``queue_directory/<b>``, JSON, the entries spread over ``BUCKETS`` keys by a hash of
the name: a change rewrites the buckets of the names it changed).
So it is replicated to a majority of all nodes before anyone relies on it, survives
the loss of the coordinator (a new metadata primary holds every committed ``qe``) and
a restart.

- **Who writes** (``DirectoryWriter``): only a partition's leader, which holds the
  partition's log. Per group it serves, one *lane*: the queue names whose declaration,
  bindings or life changed, sent to the metadata leader as one ``MetaRequest``
  (``directory.update``, ``partition/declarations.py``) at a time, each name's entry read
  from the leader's broker when the batch leaves (so the last state wins and a lane
  never reorders); the first batch of an epoch, a batch after a failure and, every
  ``resync`` seconds, a batch whenever the partition's entries differ from what the
  lane last sent (what a path that does not report to the lane changed: an
  auto-deleted or expired queue, the management API on the leader) are *syncs*: the
  partition's entries whole.
- **Fencing**: a ``qe`` carries the partition leader's epoch; the directory ignores one
  below the highest it took for that partition (a deposed leader's late request: its
  change, if durable in the partition, is in the new leader's log and so in its sync).
- **Read-your-writes**: a declaration's answer (``DeclarationHost``) waits for the
  partition's durability, then for the lane's batch holding it to be durable in the
  metadata group (whose barrier waits for every ready backup) and applied on the
  leader's own metadata copy; the asking node then waits for its own metadata copy to
  reach that position too (``MetaReply.position`` carries both).
- **Routing** (``StandIns``): on a node holding no cell of a partition, each of the
  partition's entries is a stand-in ``Queue`` in the vhost (no messages, never stored,
  replicated by no group: made and bound around the observers), bound to the exchanges
  as the entry says; so ``VirtualHost.route`` finds it, and ``GroupClients.publish``
  forwards to it by ``x-ha-id`` like any copy of a group served elsewhere, a consume or
  get goes to its leader. A partition counts as *known* (``known``) only while the node's
  metadata copy is valid (its primary's, or a caught-up backup's) and the directory holds
  a sync of it; otherwise ``GroupClients.check_route`` refuses (540) what the node cannot
  route completely, as before. A node that gains a cell drops the partition's stand-ins
  before its group starts (``PartitionedMember.group_adding``); one that loses its cell
  gets them back at the next tick.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from brokerha.broker.exchange import Binding
from brokerha.broker.queue import Queue
from brokerha.cluster import replication as R
from brokerha.cluster.replication import HA_ID, ReplicationError
from brokerha.partition.coordinator import EventLog, MetaStore
from brokerha.seed_runner import UnsafeRules

log = logging.getLogger("brokerha.partition")

INDEX_KEY = "queue_directory"  # the store's meta: each partition's epoch, synced or not
BUCKET_KEY = "queue_directory/{b}"  # the store's meta: the entries of one bucket
BUCKETS = 64  # entries spread by a hash of (vhost, name): a change rewrites its buckets
UPDATE = "directory.update"  # the MetaRequest op (partition/declarations.py)
RESYNC = 10.0  # a lane compares its partition with what it last sent this often
# exclusive queues (in no partition, on their declaring node alone): their entries carry
# this partition and the owner node's name as ``ha_id`` (docs/ha.md "Exclusive queues on
# a partitioned cluster"); written by the owner node's own lane (``OWNERS_LANE``)
EXCLUSIVE = -1
OWNERS_LANE = -1  # the writer's lane of this node's exclusive queues (no group's)
OWNER_GRACE = 5.0  # the metadata primary drops a node's owner entries once down this long

@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the directory to break on purpose (simulations and tests only)."""

    # the directory takes a change of a partition leader's epoch below the one it holds
    # (a deposed leader's late request undoes the new leader's sync)
    no_fence: bool = False
    # a queue method is answered once its partition holds it, without waiting for the
    # directory (a publish on a node outside the partition right after it is unroutable)
    answer_before_directory: bool = False
    # an exclusive queue's declare-ok sent at once, not once the directory names its
    # owner (a client on another node right after it gets no 405)
    answer_exclusive_before_directory: bool = False


Key = tuple[str, str]  # (vhost, queue name)


def bucket_of(key: Key) -> int:
    return zlib.crc32(f"{key[0]}\0{key[1]}".encode()) % BUCKETS
BindingKey = tuple[str, str, bytes]  # (exchange, routing key, arguments as a field table)


@dataclass(frozen=True)
class DirectoryEntry:
    """What every node knows of a queue of a partition: enough to route to it and to name
    it to its leader."""

    partition: int
    ha_id: str
    durable: bool
    auto_delete: bool
    arguments: bytes  # an AMQP field table (``replication.encode_table``)
    bindings: tuple[BindingKey, ...]  # sorted

    def wire(self) -> list[Any]:
        return [self.partition, self.ha_id, self.durable, self.auto_delete, self.arguments,
                [list(b) for b in self.bindings]]

    @classmethod
    def from_wire(cls, w: Any) -> DirectoryEntry:
        partition, ha_id, durable, auto_delete, arguments, bindings = w
        if not isinstance(partition, int) or not isinstance(ha_id, str):
            raise ValueError(f"not a directory entry: {w!r:.80}")
        return cls(partition, ha_id, bool(durable), bool(auto_delete), bytes(arguments),
                   tuple(sorted((str(e), str(k), bytes(a)) for e, k, a in bindings)))

    def to_json(self) -> list[Any]:
        return [self.partition, self.ha_id, self.durable, self.auto_delete,
                self.arguments.hex(), [[e, k, a.hex()] for e, k, a in self.bindings]]

    @classmethod
    def from_json(cls, j: Any) -> DirectoryEntry:
        partition, ha_id, durable, auto_delete, arguments, bindings = j
        return cls.from_wire([partition, ha_id, durable, auto_delete,
                              bytes.fromhex(arguments),
                              [[e, k, bytes.fromhex(a)] for e, k, a in bindings]])


Item = tuple[Key, "DirectoryEntry | None"]


def items_wire(items: Iterable[Item]) -> list[Any]:
    return [[v, n, None if e is None else e.wire()] for (v, n), e in items]


def items_from_wire(raw: Any) -> list[Item]:
    return [((str(v), str(n)), None if e is None else DirectoryEntry.from_wire(e))
            for v, n, e in raw]


class Directory:
    """The directory's state (the same on every node that applied the same log)."""

    def __init__(self, unsafe: Unsafe | None = None) -> None:
        self.entries: dict[Key, DirectoryEntry] = {}
        self.epochs: dict[int, int] = {}  # partition -> the highest leader epoch taken
        self.synced: set[int] = set()  # partitions a leader's sync reached
        self.unsafe = unsafe or Unsafe()
        self.buckets: dict[int, set[Key]] = {}  # bucket_of(key) -> the keys held in it

    def apply(self, partition: int, epoch: int, sync: bool,
              items: list[Item]) -> set[Key] | None:
        """The names whose entry changed; None: ignored (a deposed leader's, fenced).
        ``EXCLUSIVE``: owner entries, neither fenced nor synced (each owner node sends
        its own whole, with None for the names it holds no more)."""
        if partition == EXCLUSIVE:
            return self._owners(items)
        fence = self.epochs.get(partition, -1)
        if epoch < fence and not self.unsafe.no_fence:
            return None
        self.epochs[partition] = max(epoch, fence)
        changed: set[Key] = set()
        if sync:
            named = {key for key, entry in items if entry is not None}
            for key, old in list(self.entries.items()):
                if old.partition == partition and key not in named:
                    self._drop(key)
                    changed.add(key)
            self.synced.add(partition)
        return changed | self._change(partition, items, f"partition {partition}")

    def _owners(self, items: list[Item]) -> set[Key]:
        return self._change(EXCLUSIVE, items, "the exclusive queues")

    def _change(self, partition: int, items: list[Item], of: str) -> set[Key]:
        """The items of one change of ``partition`` (``of`` names it) applied: None drops
        the name if ``partition`` holds it, an entry of another partition is refused.
        (An owner entry over a partition's queue by that name leaves that queue: the
        owner's node refused the declaration unless the two declarations raced; the last
        one wins.)"""
        changed: set[Key] = set()
        for key, entry in items:
            held = self.entries.get(key)
            if entry is None:
                if held is not None and held.partition == partition:
                    self._drop(key)
                    changed.add(key)
            elif entry.partition != partition:
                raise ValueError(f"entry {key} of partition {entry.partition} in a change "
                                 f"of {of}")
            elif held != entry:
                self.entries[key] = entry
                self.buckets.setdefault(bucket_of(key), set()).add(key)
                changed.add(key)
        return changed

    def owned_by(self, node: str) -> dict[Key, DirectoryEntry]:
        """The owner entries of ``node``'s exclusive queues."""
        return {k: e for k, e in self.entries.items()
                if e.partition == EXCLUSIVE and e.ha_id == node}

    def of(self, partition: int) -> dict[Key, DirectoryEntry]:
        return {k: e for k, e in self.entries.items() if e.partition == partition}

    def snapshot(self) -> Any:
        return R.DirectorySnapshot(
            R.QUEUE_DIRECTORY,
            [[p, e, p in self.synced] for p, e in sorted(self.epochs.items())],
            items_wire(sorted(self.entries.items())))

    def replace(self, epochs: Any, entries: Any) -> None:
        self.epochs = {int(p): int(e) for p, e, _ in epochs}
        self.synced = {int(p) for p, _, s in epochs if s}
        self.entries = {k: e for k, e in items_from_wire(entries) if e is not None}
        self.buckets = {}
        for key in self.entries:
            self.buckets.setdefault(bucket_of(key), set()).add(key)

    def _drop(self, key: Key) -> None:
        del self.entries[key]
        self.buckets.get(bucket_of(key), set()).discard(key)

    def put(self, key: Key, entry: DirectoryEntry) -> None:
        """(Reading the store back.)"""
        self.entries[key] = entry
        self.buckets.setdefault(bucket_of(key), set()).add(key)


class DirectoryLayer:
    """The metadata group's ``StoreLayer`` (``ha/member.py``) of the directory: its
    ``replica`` applies the primary's ``qe``/``qs``; as the primary, ``update`` applies a
    partition leader's change and appends it; a joiner gets the directory whole.
    ``listeners(keys)`` are told the names changed (None: possibly all)."""

    kinds = R.QUEUE_DIRECTORY_EVENTS

    def __init__(self, store: MetaStore, unsafe: Unsafe | None = None) -> None:
        self.store = store
        self.unsafe = unsafe or Unsafe()
        self.directory = Directory(self.unsafe)
        self.primary: EventLog | None = None
        self.listeners: list[Callable[[set[Key] | None], None]] = []
        self.updates = 0  # changes applied here as the primary
        self.fenced = 0  # changes ignored: a deposed partition leader's
        self._load()

    # -- the store ---------------------------------------------------------------------

    def _load(self) -> None:
        raw = self.store.get_meta(INDEX_KEY)
        if raw is None:
            return
        try:
            header = json.loads(raw)
            for p, epoch, synced in header["epochs"]:
                self.directory.epochs[p] = epoch
                if synced:
                    self.directory.synced.add(p)
            for b in range(header["buckets"]):
                for vhost, name, entry in json.loads(
                        self.store.get_meta(BUCKET_KEY.format(b=b)) or "[]"):
                    self.directory.put((vhost, name), DirectoryEntry.from_json(entry))
        except (ValueError, TypeError, KeyError) as exc:
            # fail closed: no partition is known (a catch-up's ``qs`` brings the directory)
            log.error("store meta %s is not a queue directory (%s); taken as none",
                      INDEX_KEY, exc)
            self.directory = Directory(self.unsafe)

    def _save(self, keys: Iterable[Key] | None) -> None:
        """The header (epochs, synced) and the buckets holding ``keys`` (None: all): a
        change rewrites 1/``BUCKETS`` of the directory, not all of it."""
        d = self.directory
        buckets = set(range(BUCKETS)) if keys is None else {bucket_of(k) for k in keys}
        for b in sorted(buckets):
            held = sorted([k[0], k[1], d.entries[k].to_json()] for k in d.buckets.get(b, ()))
            self.store.put_meta(BUCKET_KEY.format(b=b), json.dumps(held))
        self.store.put_meta(INDEX_KEY, json.dumps({
            "buckets": BUCKETS,
            "epochs": [[p, e, p in d.synced] for p, e in sorted(d.epochs.items())]}))

    # -- LayerReplica ------------------------------------------------------------------

    @property
    def replica(self) -> DirectoryLayer:
        return self

    def apply(self, event: Any) -> None:
        kind = event[0]
        try:
            if kind == R.QUEUE_DIRECTORY_CHANGED:
                _, partition, epoch, sync, raw = event
                self._change(int(partition), int(epoch), bool(sync), items_from_wire(raw))
            elif kind == R.QUEUE_DIRECTORY:
                _, epochs, entries = event
                self.directory.replace(epochs, entries)
                self._save(None)
                self._tell(None)
            else:
                raise ReplicationError(f"not a queue directory event: {kind!r}")
        except (TypeError, ValueError) as exc:
            raise ReplicationError(f"queue directory event refused: {exc}") from exc

    def after_durable(self, callback: Callable[[], None]) -> None:
        callback()  # written to the store: its sync before the acknowledgement covers it

    # -- PrimaryLayer ------------------------------------------------------------------

    def attach_primary(self, primary: Any) -> None:
        self.primary = primary
        primary.catch_up_providers.append(self.catch_up_events)

    def detach_primary(self) -> None:
        self.primary = None

    def catch_up_events(self) -> list[Any]:
        return [self.directory.snapshot()]

    # -- changes -----------------------------------------------------------------------

    def update(self, partition: int, epoch: int, sync: bool, items: list[Item]) -> bool:
        """As the metadata primary: apply a partition leader's change and append it (False:
        fenced, nothing appended)."""
        primary = self.primary
        if primary is None:
            raise ReplicationError("only the metadata primary changes the queue directory")
        if not self._change(partition, epoch, sync, items):
            self.fenced += 1
            return False
        primary.emit(R.DirectoryChanged(R.QUEUE_DIRECTORY_CHANGED, partition, epoch, sync,
                                        items_wire(items)))
        self.updates += 1
        return True

    def _change(self, partition: int, epoch: int, sync: bool, items: list[Item]) -> bool:
        changed = self.directory.apply(partition, epoch, sync, items)
        if changed is None:
            return False
        self._save(changed)
        self._tell(changed)
        return True

    def _tell(self, keys: set[Key] | None) -> None:
        for listener in self.listeners:
            listener(keys)

    def status(self) -> dict[str, Any]:
        d = self.directory
        return {"entries": len(d.entries), "synced": sorted(d.synced),
                "epochs": {str(p): e for p, e in sorted(d.epochs.items())},
                "updates": self.updates, "fenced": self.fenced}


# -- what a leader's broker holds of a partition ---------------------------------------------


PartitionOf = Callable[[Queue], "int | None"]


def _bindings_by_queue(vhost: Any) -> dict[int, list[BindingKey]]:
    out: dict[int, list[BindingKey]] = {}
    for ex in vhost.exchanges.values():
        if ex.name == "":
            continue
        for b in ex.bindings.values():
            if isinstance(b.destination, Queue):
                out.setdefault(id(b.destination), []).append(
                    (ex.name, b.routing_key, R.encode_table(b.arguments)))
    return out


def _entry(queue: Queue, partition: int, bindings: list[BindingKey]) -> DirectoryEntry | None:
    ha_id = queue.arguments.get(HA_ID)
    if ha_id is None or queue.exclusive_owner is not None:
        return None
    return DirectoryEntry(partition, str(ha_id), queue.durable, queue.auto_delete,
                          R.encode_table(queue.arguments), tuple(sorted(bindings)))


def exclusive_entries(broker: Any, me: str, keys: Iterable[Key] | None = None) -> list[Item]:
    """The owner entries of this node's exclusive queues, with their bindings (another
    node's stand-in is bound so: a publish there through an exchange reaches the queue,
    forwarded to its owner): of ``keys`` (None for one not held here as an exclusive
    queue), or all of them (``keys`` None)."""
    out: list[Item] = []
    if keys is None:
        for vhost in broker.vhosts.values():
            bindings = None
            for q in list(vhost.queues.values()):
                if q.exclusive_owner is not None and not isinstance(q.exclusive_owner, Owner):
                    if bindings is None:
                        bindings = _bindings_by_queue(vhost)
                    out.append(((vhost.name, q.name), _owner_entry(q, me, bindings)))
        return sorted(out)
    by_vhost: dict[str, dict[int, list[BindingKey]]] = {}
    for key in sorted(set(keys)):
        vhost = broker.vhosts.get(key[0])
        q = None if vhost is None else vhost.queues.get(key[1])
        mine = q is not None and q.exclusive_owner is not None \
            and not isinstance(q.exclusive_owner, Owner)
        if not mine or q is None:
            out.append((key, None))
            continue
        if key[0] not in by_vhost:
            by_vhost[key[0]] = _bindings_by_queue(vhost)
        out.append((key, _owner_entry(q, me, by_vhost[key[0]])))
    return out


def _owner_entry(queue: Queue, me: str,
                 bindings: dict[int, list[BindingKey]]) -> DirectoryEntry:
    return DirectoryEntry(EXCLUSIVE, me, queue.durable, queue.auto_delete,
                          R.encode_table(queue.arguments),
                          tuple(sorted(bindings.get(id(queue), []))))


class Owner:
    """The ``exclusive_owner`` of a stand-in of another node's exclusive queue: no
    connection of this node is it, so the vhost answers every one of them 405
    RESOURCE_LOCKED, as RabbitMQ does for another connection's exclusive queue."""

    def __init__(self, node: str) -> None:
        self.node = node

    def __repr__(self) -> str:
        return f"Owner({self.node!r})"


def entries_of(broker: Any, partition_of: PartitionOf, partition: int,
               keys: Iterable[Key] | None = None) -> list[Item]:
    """The entries the leader's broker holds now: of ``keys`` (None for one not held), or
    every queue of the partition (``keys`` None)."""
    out: list[Item] = []
    if keys is None:
        for vhost in broker.vhosts.values():
            bindings = _bindings_by_queue(vhost)
            for q in list(vhost.queues.values()):
                if partition_of(q) == partition:
                    entry = _entry(q, partition, bindings.get(id(q), []))
                    if entry is not None:
                        out.append(((vhost.name, q.name), entry))
        return sorted(out)
    by_vhost: dict[str, dict[int, list[BindingKey]]] = {}  # each vhost's, made once a call
    for key in sorted(set(keys)):
        vhost = broker.vhosts.get(key[0])
        q = None if vhost is None else vhost.queues.get(key[1])
        if q is None or partition_of(q) != partition:
            out.append((key, None))
            continue
        if key[0] not in by_vhost:
            by_vhost[key[0]] = _bindings_by_queue(vhost)
        out.append((key, _entry(q, partition, by_vhost[key[0]].get(id(q), []))))
    return out


# -- the partition leader's side: one lane per group served ----------------------------------


Done = Callable[["list[int] | None"], None]  # the metadata position, or None: failed


@dataclass
class _Lane:
    partition: int
    epoch: int
    sync: bool = True
    keys: set[Key] = field(default_factory=set)
    waiting: list[Done] = field(default_factory=list)
    in_flight: int | None = None  # the request asked, unanswered
    flight: list[Done] = field(default_factory=list)
    flight_items: list[Item] = field(default_factory=list)
    flight_sync: bool = False
    sent: dict[Key, DirectoryEntry] = field(default_factory=dict)  # as the directory has it
    checked_at: float = 0.0


@dataclass
class WriterStats:
    batches: int = 0
    syncs: int = 0
    names: int = 0
    failed: int = 0
    resyncs: int = 0  # syncs a difference found by the periodic check sent


class DirectoryWriter:
    """A partition leader's changes to the directory. ``ask(args, done)`` sends a
    ``directory.update`` to the metadata leader (``NodeDeclarations.ask_internal``) and
    calls ``done(code, position)`` with its answer."""

    def __init__(self, broker: Any, partition_of: Callable[[], PartitionOf | None],
                 ask: Callable[[list[Any], Callable[[int, list[int]], None]], None],
                 clock: Callable[[], float], resync: float = RESYNC) -> None:
        self.broker = broker
        self.partition_of = partition_of
        self.ask = ask
        self.clock = clock
        self.resync = resync
        self.lanes: dict[int, _Lane] = {}  # group -> its lane
        self.stats = WriterStats()
        self.me: str | None = None  # set with ``owners``: the lane of exclusive queues
        self.directory: Directory | None = None

    def owners(self, me: str, directory: Directory) -> None:
        """Keep this node's exclusive queues in the directory (``OWNERS_LANE``): its first
        batch is their whole, with None for the owner entries of this node the
        directory still holds (a restart's, a lost update's)."""
        self.me, self.directory = me, directory
        self.lanes[OWNERS_LANE] = _Lane(EXCLUSIVE, 0, checked_at=self.clock())
        self._send(OWNERS_LANE)

    def serving(self, group: int, epoch: int) -> None:
        self._fail(self.lanes.pop(group, None))
        self.lanes[group] = _Lane(group - 1, epoch, checked_at=self.clock())
        self._send(group)

    def demoted(self, group: int) -> None:
        self._fail(self.lanes.pop(group, None))

    def record(self, group: int, keys: Iterable[Key], done: Done) -> None:
        """``keys`` changed in the group's partition: ``done(position)`` once the directory
        holds them (as they are when the batch leaves), None if that failed."""
        lane = self.lanes.get(group)
        if lane is None:
            done(None)
            return
        lane.keys.update(keys)
        lane.waiting.append(done)
        self._send(group)

    def tick(self) -> None:
        now = self.clock()
        owners = self.lanes.get(OWNERS_LANE)
        if owners is not None and owners.sent:
            # a closed connection's exclusive queues: gone from the broker since sent
            gone = [k for k, e in exclusive_entries(self.broker, self.me or "", owners.sent)
                    if e is None]
            owners.keys.update(gone)
        for group, lane in list(self.lanes.items()):
            if lane.partition == EXCLUSIVE:
                if lane.in_flight is None and not lane.sync \
                        and now - lane.checked_at >= self.resync:
                    lane.checked_at = now
                    if dict(self._whole(lane, lambda q: None)) != \
                            self._held_of_mine():
                        lane.sync = True
                        self.stats.resyncs += 1
                self._send(group)
                continue
            if lane.in_flight is None and not lane.sync and now - lane.checked_at >= self.resync:
                lane.checked_at = now
                of = self.partition_of()
                if of is not None and dict(self._whole(lane, of)) != lane.sent:
                    lane.sync = True
                    self.stats.resyncs += 1
            self._send(group)

    def _held_of_mine(self) -> dict[Key, DirectoryEntry]:
        return {} if self.directory is None or self.me is None \
            else self.directory.owned_by(self.me)

    def _whole(self, lane: _Lane, of: PartitionOf) -> list[Item]:
        if lane.partition == EXCLUSIVE:
            items = exclusive_entries(self.broker, self.me or "")
            held = {k for k, _ in items}
            return sorted(items + [(k, None) for k in self._held_of_mine() if k not in held])
        return entries_of(self.broker, of, lane.partition)

    def _some(self, lane: _Lane, of: PartitionOf, keys: Iterable[Key]) -> list[Item]:
        if lane.partition == EXCLUSIVE:  # (never a None for another node's entry)
            held = {} if self.directory is None else self.directory.entries
            return [(k, e) for k, e in exclusive_entries(self.broker, self.me or "", keys)
                    if e is not None or (h := held.get(k)) is None or h.ha_id == self.me]
        return entries_of(self.broker, of, lane.partition, keys)

    def _send(self, group: int) -> None:
        lane = self.lanes.get(group)
        of = self.partition_of()
        if lane is not None and lane.partition == EXCLUSIVE:
            of = lambda q: None  # noqa: E731 (unused: no partition's)
        if lane is None or lane.in_flight is not None or of is None \
                or not (lane.sync or lane.keys):
            return
        if lane.sync:
            items = self._whole(lane, of)
            if not items and lane.partition == EXCLUSIVE and not lane.waiting:
                lane.sync, lane.sent = False, {}  # none here, none in the directory: nothing
                return
            self.stats.syncs += 1
        else:
            items = self._some(lane, of, lane.keys)
        lane.flight, lane.waiting = lane.waiting, []
        lane.flight_items, lane.flight_sync = items, lane.sync
        lane.keys, lane.sync = set(), False
        lane.in_flight = -1
        self.stats.batches += 1
        self.stats.names += len(items)
        epoch = lane.epoch
        self.ask([lane.partition, epoch, lane.flight_sync, items_wire(items)],
                 lambda code, position: self._answered(group, epoch, code, position))

    def _answered(self, group: int, epoch: int, code: int, position: list[int]) -> None:
        lane = self.lanes.get(group)
        if lane is None or lane.epoch != epoch:
            return  # the lane went (demoted): its waiters were failed then
        flight, lane.flight, lane.in_flight = lane.flight, [], None
        if code != 0:
            self.stats.failed += 1
            lane.sync = True  # the directory may lack any of it: the whole partition next
            for done in flight:
                done(None)
        else:
            if lane.flight_sync:
                lane.sent = {}
            for key, entry in lane.flight_items:
                if entry is None:
                    lane.sent.pop(key, None)
                else:
                    lane.sent[key] = entry
            for done in flight:
                done(list(position))
        self._send(group)

    def _fail(self, lane: _Lane | None) -> None:
        if lane is None:
            return
        for done in lane.flight + lane.waiting:
            done(None)
        lane.flight, lane.waiting = [], []

    def status(self) -> dict[str, Any]:
        return {"lanes": {str(g): {"epoch": lane.epoch, "queued": len(lane.keys),
                                       "in_flight": lane.in_flight is not None}
                          for g, lane in sorted(self.lanes.items())},
                **vars(self.stats)}


# -- every node: the stand-ins of the queues of partitions it holds no cell of ---------------


class StandIns:
    """The directory's entries of partitions this node runs no group of, as stand-in
    queues in its vhosts (see the module's docstring). ``member``: the node's
    ``PartitionedMember``; ``layer``: its metadata group's ``DirectoryLayer``."""

    def __init__(self, member: Any, layer: DirectoryLayer) -> None:
        self.member = member
        self.layer = layer
        self.held: dict[Key, tuple[Queue, DirectoryEntry]] = {}
        self.bound: dict[Key, set[BindingKey]] = {}
        # not made or not bound whole: its vhost is not here yet, a queue of this node's
        # holds its name, a binding's exchange is not here (deleted since)
        self.unbound: set[Key] = set()
        self._groups: frozenset[int] = frozenset()
        # partitions this node is a learner of (a new cell catching up: its copy may lack
        # queues and bindings, and its stand-ins went when its group started)
        self.learning: set[int] = set()
        self.made = 0
        self.removed = 0
        layer.listeners.append(self.changed)

    # -- what the clients' checks ask --------------------------------------------------

    def valid(self) -> bool:
        """This node's metadata copy is its primary's or a caught-up backup's."""
        metadata = self.member.metadata
        if metadata.primary is not None:
            return True
        backup = metadata.backup
        return backup is not None and bool(backup.caught_up)

    def known(self, partition: int) -> bool:
        """Whether this node routes to partition ``partition``'s queues by the directory:
        its copy valid and a sync of the partition in it. (A binding whose exchange this
        node's valid copy does not hold is to an exchange deleted since: the metadata log
        holds an exchange's declaration before any ``qe`` naming a binding to it, as the
        leader bound it only once its own copy held it. It routes nothing; it is skipped,
        counted in ``unbound``, and tried again at each tick.) Not while the node's group of
        it left since the last reconcile (its stand-ins are made at the next tick)."""
        return partition in self.layer.directory.synced and partition + 1 not in self._groups \
            and self.valid()

    # -- keeping them -------------------------------------------------------------------

    def changed(self, keys: set[Key] | None) -> None:
        self.reconcile(keys)

    def group_adding(self, partition: int) -> None:
        """A group of ``partition`` starts here (a cell): its stand-ins go first, the
        group's catch-up brings the queues."""
        for key, (_, entry) in list(self.held.items()):
            if entry.partition == partition:
                self._remove(key)
        self.learning.add(partition)  # until its membership says it votes (``tick``)

    def tick(self) -> None:
        me = self.member.me
        self.learning = {g - 1 for g, layer in self.member.memberships.items()
                         if g in self.member.groups and me in layer.membership.learners}
        groups = frozenset(self.member.groups)
        if groups != self._groups:
            self._groups = groups
            self.reconcile(None)
        elif self.unbound:
            self.reconcile(set(self.unbound))

    def reconcile(self, keys: set[Key] | None) -> None:
        entries = self.layer.directory.entries
        if keys is None:
            keys = set(entries) | set(self.held) | self.unbound
        for key in keys:
            self.unbound.discard(key)
            entry = entries.get(key)
            if entry is not None and (
                    self._has_group(entry.partition) if entry.partition != EXCLUSIVE
                    else entry.ha_id == self.member.me):  # (its own: the queue itself)
                entry = None
            held = self.held.get(key)
            if entry is None:
                if held is not None:
                    self._remove(key)
                continue
            if held is not None and (held[1].ha_id, held[1].arguments, held[1].durable,
                                     held[1].auto_delete) != (entry.ha_id, entry.arguments,
                                                              entry.durable, entry.auto_delete):
                self._remove(key)
                held = None
            if held is None:
                if not self._make(key, entry):  # no such vhost yet, or a queue of its own
                    self.unbound.add(key)  # by that name: tried again at each tick
                    continue
            else:
                self.held[key] = (held[0], entry)
            self._bind(key, entry)

    def _has_group(self, partition: int) -> bool:
        return partition + 1 in self.member.groups

    def _make(self, key: Key, entry: DirectoryEntry) -> bool:
        vhost = self.member.broker.vhosts.get(key[0])
        if vhost is None or key[1] in vhost.queues:
            return False  # a queue of its own (exclusive) by that name: left as it is
        if entry.partition == EXCLUSIVE:
            # another node's exclusive queue: its vhost answers 405 to every connection
            # here; a message routed to it here is forwarded to its node, never enqueued
            # here (``GroupClients.publish``; a dead letter: ``VirtualHost._led``, as
            # followed; x-max-length 0 for any other path)
            queue = Queue(vhost.name, key[1], durable=entry.durable, auto_delete=False,
                          exclusive_owner=Owner(entry.ha_id), arguments={"x-max-length": 0},
                          memory=vhost.memory, clock=vhost.clock, sink=vhost)
            queue.auto_delete = entry.auto_delete
            vhost.queues[key[1]] = queue
            vhost.followed.add(queue)
            self.held[key] = (queue, entry)
            self.bound[key] = set()
            self.made += 1
            return True
        queue = Queue(vhost.name, key[1], durable=entry.durable, auto_delete=False,
                      arguments=R.decode_table(entry.arguments), memory=vhost.memory,
                      clock=vhost.clock, sink=vhost)
        queue.auto_delete = entry.auto_delete  # shown only: the leader deletes it
        vhost.queues[key[1]] = queue  # no observer: never stored, replicated by no group
        # a copy of a queue led elsewhere: a dead letter routed to it is forwarded to its
        # leader (``VirtualHost._led``), never enqueued here
        vhost.followed.add(queue)
        self.held[key] = (queue, entry)
        self.bound[key] = set()
        self.made += 1
        return True

    def _bind(self, key: Key, entry: DirectoryEntry) -> None:
        queue = self.held[key][0]
        vhost = self.member.broker.vhosts[key[0]]
        want = set(entry.bindings)
        have = self.bound[key]
        missing = False
        for b in have - want:
            ex = vhost.exchanges.get(b[0])
            if ex is not None:
                ex.remove_binding(Binding(ex, queue, b[1], R.decode_table(b[2])).key)
            have.discard(b)
        for b in want - have:
            ex = vhost.exchanges.get(b[0])
            if ex is None:
                missing = True
                continue
            ex.add_binding(Binding(ex, queue, b[1], R.decode_table(b[2])))
            have.add(b)
        if missing:
            self.unbound.add(key)
        else:
            self.unbound.discard(key)

    def _remove(self, key: Key) -> None:
        queue, _ = self.held.pop(key)
        self.unbound.discard(key)
        vhost = self.member.broker.vhosts.get(key[0])
        if vhost is None:
            return
        for b in self.bound.pop(key, set()):
            ex = vhost.exchanges.get(b[0])
            if ex is not None:
                binding = ex.bindings.get(Binding(ex, queue, b[1], R.decode_table(b[2])).key)
                if binding is not None and binding.destination is queue:
                    ex.remove_binding(binding.key)
        if vhost.queues.get(key[1]) is queue:
            del vhost.queues[key[1]]
        vhost.followed.discard(queue)
        self.removed += 1

    def is_stand_in(self, queue: Queue) -> bool:
        held = self.held.get((queue.vhost, queue.name))
        return held is not None and held[0] is queue

    def status(self) -> dict[str, Any]:
        return {"stand_ins": len(self.held), "unbound": len(self.unbound), "made": self.made,
                "removed": self.removed}


# -- the node's wiring -----------------------------------------------------------------------


class NodeDirectory:
    """A partitioned node's directory: its metadata group's layer, its writer (the
    partitions it leads), its stand-ins (those it holds no cell of)."""

    def __init__(self, member: Any, layer: DirectoryLayer, writer: DirectoryWriter) -> None:
        self.member = member
        self.layer = layer
        self.writer = writer
        self.stand_ins = StandIns(member, layer)
        writer.owners(member.me, layer.directory)
        self.down_since: dict[str, float] = {}  # peers whose link is down, since when
        self.owners_dropped = 0

    def peer_down(self, peer: str) -> None:
        self.down_since.setdefault(peer, self.writer.clock())

    def peer_up(self, peer: str) -> None:
        self.down_since.pop(peer, None)

    def drop_gone_owners(self) -> None:
        """As the metadata primary: the exclusive queues of a node down for ``OWNER_GRACE``
        go from the directory (RabbitMQ deletes the exclusive queues of a connection that
        is gone; that node deletes its own at its restart, and sends its whole again at
        its lane's next check if it was only cut off)."""
        if self.layer.primary is None or not self.down_since:
            return
        now = self.writer.clock()
        gone = {p for p, t in self.down_since.items() if now - t >= OWNER_GRACE}
        items: list[Item] = [(k, None) for k, e in self.layer.directory.entries.items()
                             if e.partition == EXCLUSIVE and e.ha_id in gone]
        if items:
            self.layer.update(EXCLUSIVE, 0, False, items)
            self.owners_dropped += len(items)

    def apply(self, args: list[Any]) -> list[Any]:
        """The metadata leader's side of a ``directory.update`` (``DeclarationHost``)."""
        partition, epoch, sync, raw = args
        self.layer.update(int(partition), int(epoch), bool(sync), items_from_wire(raw))
        return []

    def unknown(self, partitions: Iterable[int]) -> list[int]:
        """Of ``partitions`` (those this node holds no cell of), the ones the directory
        does not give it, and the partitions it is a learner of (``StandIns.learning``)."""
        stand_ins = self.stand_ins
        if stand_ins.valid():  # (``StandIns.known``, its copy's validity asked once)
            synced, had = self.layer.directory.synced, stand_ins._groups
            unknown = [p for p in partitions if p not in synced or p + 1 in had]
        else:
            unknown = list(partitions)
        return sorted(set(unknown) | stand_ins.learning) if stand_ins.learning else unknown

    def tick(self) -> None:
        self.writer.tick()
        self.stand_ins.tick()
        self.drop_gone_owners()

    def status(self) -> dict[str, Any]:
        return {**self.layer.status(), "writer": self.writer.status(),
                **self.stand_ins.status(), "owners_dropped": self.owners_dropped}

