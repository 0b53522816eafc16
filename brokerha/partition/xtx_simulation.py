"""Cross-partition transactions, simulated (issue 35, stage 4's protocol): ``--workload xtx``.

A deterministic simulation (seeded, virtual clock, one event at a time) of
the product's ``CrossTx`` and ``DecisionRules`` (``partition/xtx.py``):
P partitions (default 3), each a replicated log behind its current primary
running ``DecisionRules``; several coordinator nodes, each a ``CrossTx``
whose clients commit transactions touching 1-3 partitions. What the shell
of stage 4 will do is played here by ``SimPartition`` (the
``PartitionTransactions`` of a primary: a prepare is a round of a few ms
that may say no, then a record in the log; a commit or rollback is a record;
a ``WhenDurable`` is carried out when the log is durable up to where it was)
and by the network (``ToPartition`` goes to whoever leads then).

Faults, for ``duration`` virtual seconds, then none while everything settles:

- packets lost (2 %) or late (3 %, up to 1 s; so also reordered);
- a partition's primary fails over: no leader for 0.05-1.2 s, then a new
  one (a new term) that keeps what was durable on its majority and, half
  the time, some of what was not (a backup held it), and nothing of its
  predecessor's memory (prepares under way, replies waiting); every
  coordinator hears the new leader's notice. The deposed primary runs on
  for up to 1 s (its lease has not lapsed): packets sent to the partition
  while it has no leader reach it, it answers what it can say at once (a
  no; a prepare of its fails, its backups voting for the new primary), and
  nothing it writes becomes durable, so nothing waiting for that is sent;
- a coordinator crashes (its commits and their clients' answers are lost;
  it restarts as a new incarnation 0.2-2 s later), at random and
  *between the rounds*: with 4 % chance when an input moved a commit to
  its decision or its finish, after sending a random part of its packets;
- a coordinator stalls 0.5-3 s (its input waits), long enough for the
  participants' ``resolve_timeout`` (2 s) to ask the decider first.

Checked after every event:

- (a) agreement: no gtxid has a durable ``committed`` record in one
  partition and a durable ``rolled back`` one in another (or the same);
- (b) every answer is backed by a durable record of the partition that
  sends it: ``XPrepared`` yes by its prepared (or committed) record,
  ``XDecided``, ``XFinished``, ``XOutcomeReply`` by the outcome they say;
  ``tx.commit-ok`` by a durable ``committed`` in every participant, a
  refused commit by the decider's durable ``rolled back``;
- at the end (every primary up, every coordinator back, ``settle``
  seconds without faults): (c) nothing in doubt (no branch prepared or
  preparing, no coordinator with a commit under way: liveness once the
  faults stop; a run that does not get there is a violation); (d) a gtxid
  committed anywhere is committed in every participant, and every
  commit-ok'd one is.

**XA** (``XA_SHARE`` of the commits, docs/ha.md "XA over partitions"): the
commit is a client's XA prepare (``CrossTx.begin(xa=...)``); once it is
answered held (``XA_OK``) its TM decides 0.2-6 s later, commit (70 %) or
rollback, through a random live coordinator (``CrossTx.finish``: "any
node"), and again through another if that one crashed (its recovery); the
TM's recovery also rolls back, every 2 s, what a dead coordinator's prepare
left held with no XA_OK heard (presumed abort, the TM's: it lists the
partitions' ``held_xa``, as ``dtx.recover`` does). Checked besides: (f) a
transaction held durably for its TM is never rolled back anywhere unless the
TM asked it, and a TM's commit is answered committed (rule c: the decider's
timeout and a participant's ``XOutcome`` leave it in doubt); (b) a held
answer is backed by the decider's durable all-prepared record; (g) at the
end no primary keeps an all-prepared record apart (``prepared``, in memory)
whose transaction is decided: the decision's own rewrite (an ``u`` entry after
its ``c``/``r``) may be lost with a failover that kept the decision, and the
rules' tick rewrites it (bounded memory without a ``recover``).

``Unsafe`` (``partition.xtx.Unsafe``): ``commit_before_decision`` (rule a),
``presume_without_tombstone`` (rule b) and ``presume_held_abort`` (rule c),
each caught in the first seeds, and ``keep_decided_holds`` (g, within the
first 60) (``tests/partition/test_xtx_simulation.py``).

``brokers``: the partitions whose primary is the product's instead of a log
(``BrokerPartition``): a ``Broker`` over a simulated disk (``DiskStore``: a
sync is the partition's majority holding what was written; a sync of a
deposed primary's never happens), its ``DtxManager`` and ``TxOutcomes``
behind ``BrokerTransactions`` (``partition/xtx_broker.py``), the backups'
votes played by a transaction observer (a round of a few ms that may say
no, a deposed primary's always no); ``WhenDurable`` is the store's
``after_sync``; a failover restores a new ``Broker`` from the disk image
(or, half the time, from all that was written: a backup held it), and the
deposed one runs on. Its coroutines (XA ``prepare``) run on an asyncio loop
the simulation drives between its events, so a seed still replays exactly.
Checked besides: (e) at the end, its queue holds one message per gtxid
committed there, none of the others.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pamqp import commands

from brokerha import seed_runner
from brokerha.broker.broker import Broker
from brokerha.broker.content import build_header
from brokerha.broker.dtx import Xid
from brokerha.broker.message import Entry as QueueEntry
from brokerha.broker.message import Message
from brokerha.broker.queue import Queue
from brokerha.broker.transaction import Transaction, TransactionObserver
from brokerha.broker.tx_outcomes import COMMITTED, DECIDED, group_of
from brokerha.cluster.replication import HA_ID
from brokerha.ha.simulation.disk import DiskStore, Image
from brokerha.ha.simulation.world import SimResult, Violation
from brokerha.partition.forward import ForwardMessage
from brokerha.partition.xtx import (
    HELD,
    Answer,
    CrossTx,
    DecisionRules,
    Effect,
    InDoubt,
    Packet,
    Query,
    Status,
    ToNode,
    ToPartition,
    Unsafe,
    WhenDurable,
    XBranch,
    XDecided,
    XFinished,
    XOutcomeReply,
    XPrepare,
    XPrepared,
)
from brokerha.partition.xtx_broker import BrokerTransactions
from brokerha.primary.verification import Verification, carry_out

__all__ = ["CATCHES", "SimResult", "Unsafe", "XtxSimulation", "run_many", "run_seed"]

CATCHES = tuple(Unsafe.names())
ON_BROKERS = True  # ``brokers="all"`` (``cluster simulate --on-brokers``): BrokerPartitions
SAFE = Unsafe()


def ha_id(p: int) -> str:
    """The ``x-ha-id`` of partition ``p``'s queue ``q<p>`` (a publish names it so)."""
    return f"1.{p + 1}"


LOSS = 0.02             # a packet lost
LATE = 0.03             # a packet late ...
LATE_BY = (0.1, 1.0)    # ... by this much
DELAY = (0.0005, 0.005)  # one-way delay otherwise
SYNC = (0.001, 0.02)    # a write is durable on the majority this long after
PREPARE = (0.003, 0.03)  # a prepare round (tb/te/td/tp, the backups' votes)
REFUSE = 0.03           # a prepare says no (it dequeues what a failover requeued)
FAILOVER_EVERY = 4.0    # mean seconds between failovers of one partition's primary
LEADERLESS = (0.05, 1.2)
CRASH_EVERY = 12.0      # mean seconds between random crashes of one coordinator
CRASH_BETWEEN = 0.04    # chance a coordinator crashes when an input moved a commit on
DOWN = (0.2, 2.0)
STALL_EVERY = 8.0       # mean seconds between stalls of one coordinator
STALL = (0.5, 3.0)
TX_EVERY = 0.15         # mean seconds between a coordinator's new commits
TICK = 0.1              # every primary's and coordinator's tick
XA_SHARE = 0.3          # of the commits, a client's XA prepare (held for its TM)
TM_DECIDES = (0.2, 6.0)  # the TM's commit or rollback comes this long after its XA_OK
TM_COMMITS = 0.7        # ... a commit that often
TM_RETRY = 3.0          # a TM whose finish is unanswered and whose node died asks another
TM_RECOVER = 2.0        # every this long the TM's recovery rolls back held, unheard prepares
SETTLE = 40.0           # at most this long after the faults for everything to settle
# the content header of a branch's message: a body of 2 bytes, persistent (kept by the store)
HEADER = build_header(2, commands.Basic.Properties(delivery_mode=2))


@dataclass
class Entry:
    """One record of a partition's log: ``p`` prepared (with its branch), ``c``, ``r``."""

    kind: str
    gtxid: str
    branch: XBranch | None = None
    at: float = 0.0
    xid: str = ""  # ``h``, the all-prepared record: the TM's xid and the participants
    participants: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrepareEnd:
    """A prepare round ended with its record written: ``prepared`` once it is durable."""

    gtxid: str


@dataclass
class SimPartition:
    """A partition: the log its primaries replicate, and the current primary's memory."""

    number: int
    log: list[Entry] = field(default_factory=list)
    durable: int = 0  # log[:durable] is on the majority: no failover loses it
    term: int = 1
    up: bool = True
    status: dict[str, Status] = field(default_factory=dict)   # the primary's view
    branches: dict[str, tuple[XBranch, float]] = field(default_factory=dict)  # prepared
    preparing: dict[str, XBranch] = field(default_factory=dict)
    # what waits for the log to be durable up to a length: a send, or a prepare's end
    waits: list[tuple[int, ToPartition | ToNode | PrepareEnd]] = field(default_factory=list)
    settled: dict[str, str] = field(default_factory=dict)  # durable: gtxid -> p / c / r
    prepared_durably: set[str] = field(default_factory=set)  # whatever came after
    holds: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # the view
    held_durably: set[str] = field(default_factory=set)  # all-prepared records, durable
    rules: DecisionRules | None = None
    sim: XtxSimulation | None = None
    # deposed: it runs on until then, not knowing (its lease has not lapsed yet), but no
    # write of its becomes durable: its majority follows the new primary
    deposed_until: float | None = None

    # -- PartitionTransactions ------------------------------------------------------------

    def status_of(self, gtxid: str) -> Status:
        return self.status.get(gtxid, Status.ABSENT)

    def prepare(self, branch: XBranch) -> None:
        assert self.sim is not None
        self.status[branch.gtxid] = Status.PREPARING
        self.preparing[branch.gtxid] = branch
        self.sim.after(self.sim.rng.uniform(*PREPARE), self.sim.prepare_round_ends, self,
                       branch.gtxid)

    def commit(self, gtxid: str) -> None:
        assert self.status.get(gtxid) is Status.PREPARED, (self.number, gtxid)
        self.write(Entry("c", gtxid))
        self._unhold(gtxid)

    def rollback(self, gtxid: str) -> None:
        assert self.sim is not None
        self.sim.counts["rollback of " + self.status_of(gtxid).value] += 1
        self.preparing.pop(gtxid, None)
        self.write(Entry("r", gtxid))
        self._unhold(gtxid)

    def _unhold(self, gtxid: str) -> None:
        """The decision's own rewrite of the all-prepared record (as ``BrokerTransactions``):
        a later entry of the log, which a failover may lose while keeping the decision."""
        if gtxid in self.holds:
            self.write(Entry("u", gtxid))

    def in_doubt(self) -> Iterable[InDoubt]:
        return [InDoubt(b, since) for b, since in self.branches.values()]

    def hold(self, gtxid: str, xid: str, participants: Sequence[int]) -> None:
        self.write(Entry("h", gtxid, xid=xid, participants=tuple(participants)))

    def is_held(self, gtxid: str) -> bool:
        return gtxid in self.holds

    def held_xa(self) -> Iterable[tuple[str, str, tuple[int, ...]]]:
        return [(xid, g, ps) for g, (xid, ps) in self.holds.items()
                if not self.status_of(g).decided]

    def unhold_decided(self) -> list[str]:
        assert self.sim is not None
        decided = [g for g in self.holds if self.status_of(g).decided]
        for g in decided:
            self.write(Entry("u", g))
        self.sim.counts["held record decided since, rewritten by the rules"] += len(decided)
        return decided

    # -- the log --------------------------------------------------------------------------

    def write(self, entry: Entry) -> None:
        assert self.sim is not None
        self.log.append(entry)
        self.apply(entry)
        self.sim.after(self.sim.rng.uniform(*SYNC), self.sim.synced, self, len(self.log))

    def apply(self, entry: Entry) -> None:
        g = entry.gtxid
        if entry.kind == "p":
            assert entry.branch is not None
            self.status[g] = Status.PREPARED
            self.branches[g] = (entry.branch, entry.at)
        elif entry.kind == "h":
            self.holds[g] = (entry.xid, entry.participants)
        elif entry.kind == "u":  # the record decided: it ages out
            self.holds.pop(g, None)
        else:
            self.status[g] = Status.COMMITTED if entry.kind == "c" else Status.ROLLED_BACK
            self.branches.pop(g, None)


@dataclass
class BrokerPartition(SimPartition):
    """A partition whose primary is the product's: a ``Broker`` over a ``DiskStore`` with
    ``BrokerTransactions`` (the module's docstring). ``log``/``durable`` stay empty: what
    is durable is the store's disk image."""

    broker: Broker | None = None
    txs: BrokerTransactions | None = None
    sync_due: bool = False  # a sync of its store is scheduled

    @property
    def store(self) -> DiskStore:
        assert self.broker is not None and isinstance(self.broker.store, DiskStore)
        return self.broker.store

    def status_of(self, gtxid: str) -> Status:
        assert self.txs is not None
        return self.txs.status(gtxid)

    def in_doubt(self) -> Iterable[InDoubt]:
        assert self.txs is not None
        return self.txs.in_doubt()

    def hold(self, gtxid: str, xid: str, participants: Sequence[int]) -> None:
        assert self.txs is not None
        self.txs.hold(gtxid, xid, participants)

    def is_held(self, gtxid: str) -> bool:
        assert self.txs is not None
        return self.txs.is_held(gtxid)

    def held_xa(self) -> Iterable[tuple[str, str, tuple[int, ...]]]:
        assert self.txs is not None
        return self.txs.held_xa()

    def unhold_decided(self) -> list[str]:
        assert self.txs is not None and self.sim is not None
        decided = self.txs.unhold_decided()
        self.sim.counts["held record decided since, rewritten by the rules"] += len(decided)
        return decided

    def settled_everything(self) -> bool:
        assert self.broker is not None
        return not self.store.waiting and not self.sync_due and not self.broker.dtx.branches


class SimVote(TransactionObserver):
    """The backups' votes on a branch's prepare: a round of a few ms, sometimes a no."""

    def __init__(self, sim: XtxSimulation, part: BrokerPartition) -> None:
        self.sim, self.part = sim, part

    def publish(self, queue: Queue, message: Message) -> None:
        pass

    def accept(self, acked: list[tuple[Queue, QueueEntry]],
               unacked: list[tuple[Queue, QueueEntry]]) -> None:
        pass

    async def prepare(self) -> bool:
        vote: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.sim.after(self.sim.rng.uniform(*PREPARE), self.sim.vote, self.part, vote)
        return await vote


class SimVotes:
    """The ``TransactionObserverFactory`` of a ``BrokerPartition``'s broker."""

    def __init__(self, sim: XtxSimulation, part: BrokerPartition) -> None:
        self.sim, self.part = sim, part

    def create(self, transaction: Transaction) -> TransactionObserver:
        return SimVote(self.sim, self.part)


class Adapter:
    """``PartitionTransactions`` over a ``SimPartition`` (its ``status`` is a field)."""

    def __init__(self, part: SimPartition) -> None:
        self.part = part

    def status(self, gtxid: str) -> Status:
        return self.part.status_of(gtxid)

    def prepare(self, branch: XBranch) -> None:
        self.part.prepare(branch)

    def commit(self, gtxid: str) -> None:
        self.part.commit(gtxid)

    def rollback(self, gtxid: str) -> None:
        self.part.rollback(gtxid)

    def in_doubt(self) -> Iterable[InDoubt]:
        return self.part.in_doubt()

    def hold(self, gtxid: str, xid: str, participants: Sequence[int]) -> None:
        self.part.hold(gtxid, xid, participants)

    def is_held(self, gtxid: str) -> bool:
        return self.part.is_held(gtxid)

    def held_xa(self) -> Iterable[tuple[str, str, tuple[int, ...]]]:
        return self.part.held_xa()

    def unhold_decided(self) -> list[str]:
        return self.part.unhold_decided()


@dataclass
class Coordinator:
    name: str
    incarnation: int = 0
    tx: CrossTx | None = None
    stalled_until: float = 0.0
    backlog: list[Packet] = field(default_factory=list)


@dataclass
class Begun:
    gtxid: str
    participants: tuple[int, ...]
    answer: Answer | None = None
    xa: str | None = None  # an XA prepare: the TM's xid
    coordinator: tuple[str, int] = ("", 0)  # who began it (name, incarnation)


class XtxSimulation:
    def __init__(self, seed: int, *, duration: float = 20.0, partitions: int = 3,
                 coordinators: int = 3, unsafe: Unsafe = SAFE, faults: bool = True,
                 check_answers: bool = True, trace: bool = False,
                 brokers: Sequence[int] | str = ()) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.duration = duration
        self.unsafe = unsafe
        self.faults = faults
        self.check_answers = check_answers
        self.keep_trace = trace
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.trace: list[str] = []
        self.counts: Counter[str] = Counter()
        if brokers == "all":
            brokers = range(partitions)
        # the product's brokers' coroutines run on this loop, between the events
        self.loop = asyncio.new_event_loop() if brokers else None
        self.loop_due = False
        self.tasks: set[asyncio.Task[Any]] = set()
        self.parts: list[SimPartition] = [
            self.broker_partition(p, 1, None) if p in brokers else SimPartition(p)
            for p in range(partitions)]
        self.deposed: dict[int, SimPartition] = {}  # each partition's last deposed primary
        for part in self.parts:
            part.sim = self
            part.rules = self.new_rules(part)
        self.coords = {f"c{i}": Coordinator(f"c{i}") for i in range(1, coordinators + 1)}
        for coord in self.coords.values():
            self.restart(coord)
        self.begun: dict[str, Begun] = {}
        self.committed_in: dict[str, set[int]] = {}
        self.rolled_back_in: dict[str, set[int]] = {}
        # XA: gtxids held durably for their TM; the TM's decisions (gtxid -> commit?),
        # those awaiting their answer (gtxid -> the coordinator running the finish), and
        # those told XA_OK whose decision is still to come
        self.held: set[str] = set()
        self.tm: dict[str, bool] = {}
        self.tm_pending: dict[str, tuple[str, int]] = {}
        self.tm_waiting: set[str] = set()

    # -- the event loop ---------------------------------------------------------------------

    def after(self, delay: float, action: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (self.now + delay, next(self._seq), action, args))

    def log(self, text: str) -> None:
        self.trace.append(f"{self.now:9.4f} {text}")
        if len(self.trace) > 400:
            del self.trace[:200]

    @property
    def faulty(self) -> bool:
        return self.faults and self.now < self.duration

    def run(self) -> SimResult:
        violation: str | None = None
        try:
            self.start()
            end = self.duration + SETTLE
            while self._queue and self._queue[0][0] <= end:
                when, _, action, args = heapq.heappop(self._queue)
                self.now = when
                action(*args)
                if self.loop_due:
                    self.run_loop()
                if self.now > self.duration + 2.0 and self.quiet():
                    break
            self.finish()
        except Violation as v:
            violation = str(v)
            self.log("VIOLATION " + violation)
        finally:
            self.close_loop()
        stats = dict(self.counts)
        return SimResult(self.seed, violation and f"{violation} (seed {self.seed})",
                         self.trace[-60:] if violation or self.keep_trace else [], stats)

    def start(self) -> None:
        for part in self.parts:
            self.after(TICK * self.rng.random(), self.tick_partition, part.number)
            if self.faults:
                self.after(self.rng.expovariate(1 / FAILOVER_EVERY), self.failover, part.number)
        self.after(TM_RECOVER, self.tm_recover)
        for coord in self.coords.values():
            self.after(TICK * self.rng.random(), self.tick_coordinator, coord.name)
            self.after(self.rng.expovariate(1 / TX_EVERY), self.new_commit, coord.name)
            if self.faults:
                self.after(self.rng.expovariate(1 / CRASH_EVERY), self.random_crash, coord.name)
                self.after(self.rng.expovariate(1 / STALL_EVERY), self.stall, coord.name)

    def violate(self, text: str) -> None:
        raise Violation(text)

    # -- the product's brokers ------------------------------------------------------------------

    def spawn(self, work: Any, on_done: Callable[[BaseException | None], None]) -> None:
        """A broker's spawner: a task of the simulation's loop, run before the next event."""
        assert self.loop is not None
        task = self.loop.create_task(work)
        task.add_done_callback(lambda t: on_done(None if t.cancelled() else t.exception()))
        # kept until done: a dead primary's prepare waits for ever (cancelled at the end)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.loop_due = True

    def run_loop(self) -> None:
        """Let the tasks run until each waits for something of the simulation again."""
        assert self.loop is not None
        self.loop_due = False

        async def turns() -> None:
            for _ in range(8):
                await asyncio.sleep(0)
        self.loop.run_until_complete(turns())

    def close_loop(self) -> None:
        loop = self.loop
        if loop is None:
            return
        tasks = set(self.tasks)  # a dead primary's prepares, waiting for ever
        for task in tasks:
            task.cancel()

        async def ended() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
        loop.run_until_complete(ended())
        loop.close()

    def broker_partition(self, p: int, term: int, image: Image | None,
                         **kw: Any) -> BrokerPartition:
        """The product's primary of partition ``p``: a new broker, from a disk image."""
        part = BrokerPartition(p, term=term, sim=self, **kw)
        store = DiskStore(image, on_wait=lambda: self.store_waits(part))
        broker = Broker(f"p{p}.{term}", store=store, clock=lambda: self.now, spawn=self.spawn)
        broker.observers.add_transaction_observer_factory(SimVotes(self, part))
        if image is None:
            broker.add_vhost("/").declare_queue(f"q{p}", owner=None, durable=True,
                                                arguments={HA_ID: ha_id(p)})
            store.waiting.clear()
            store.sync()
        else:
            broker.restore(store.load())
        part.broker = broker
        part.txs = BrokerTransactions(broker, p, lambda g, ok: self.broker_prepared(part, g, ok))
        return part

    def broker_prepared(self, part: BrokerPartition, gtxid: str, ok: bool) -> None:
        if self.alive(part):
            assert part.rules is not None
            self.carry_out(part, part.rules.prepared(gtxid, ok))

    def vote(self, part: BrokerPartition, vote: asyncio.Future[bool]) -> None:
        if vote.done() or not self.alive(part):
            return  # a primary that is gone: its prepare waits for ever
        ok = True
        if part.deposed_until is not None:  # its backups vote for the new primary: no
            self.counts["prepare failed on a deposed primary"] += 1
            ok = False
        elif self.rng.random() < REFUSE:
            self.counts["prepare refused"] += 1
            ok = False
        vote.set_result(ok)
        self.loop_due = True

    def store_waits(self, part: BrokerPartition) -> None:
        if not part.sync_due:
            part.sync_due = True
            self.after(self.rng.uniform(*SYNC), self.sync_store, part)

    def sync_store(self, part: BrokerPartition) -> None:
        """What the broker wrote is on the partition's majority: settle it, check (a)."""
        part.sync_due = False
        if part is not self.parts[part.number] or not part.up:
            return  # a deposed primary's write never reaches its majority
        image = part.store.image()
        prefix = f"g{part.number + 1}/xtx:"
        for txid, record in image.outcomes.items():
            if group_of(txid) == part.number + 1 and txid.startswith(prefix):
                gtxid = txid[len(prefix):]
                kind = "c" if record[2] == COMMITTED else "r"
                if part.settled.get(gtxid) != kind:
                    self.settle(part, Entry(kind, gtxid))
        held = f"g{part.number + 1}/xa:"
        for txid, record in image.outcomes.items():
            # a record decided since (the TM's decision before this sync) was held before
            if txid.startswith(held) and record[2] in (HELD, DECIDED) \
                    and txid[len(held):] not in part.held_durably:
                self.settle(part, Entry("h", txid[len(held):]))
        for key in image.prepared:
            part.prepared_durably.add(Xid.from_key(key).gtrid.decode())
        part.store.sync()  # its callbacks: WhenDurable sends, prepares' records
        self.loop_due = True

    # -- partitions ---------------------------------------------------------------------------

    def new_rules(self, part: SimPartition) -> DecisionRules:
        if isinstance(part, BrokerPartition):
            assert part.txs is not None
            return DecisionRules(part.number, part.txs, unsafe=self.unsafe)
        return DecisionRules(part.number, Adapter(part), unsafe=self.unsafe)

    def alive(self, part: SimPartition | None) -> bool:
        """A primary that runs: the partition's, or a deposed one whose lease holds yet."""
        return (part is not None and part.up and part.rules is not None
                and (part.deposed_until is None or self.now < part.deposed_until))

    def tick_partition(self, p: int) -> None:
        for part in (self.parts[p], self.deposed.get(p)):
            if part is not None and self.alive(part):
                assert part.rules is not None
                self.carry_out(part, part.rules.tick(self.now))
        self.after(TICK, self.tick_partition, p)

    def prepare_round_ends(self, part: SimPartition, gtxid: str) -> None:
        if not self.alive(part) or gtxid not in part.preparing:
            return  # the primary that ran it is gone, or the branch was rolled back meanwhile
        branch = part.preparing.pop(gtxid)
        assert part.rules is not None
        if part.deposed_until is not None:  # its backups vote for the new primary: no
            self.counts["prepare failed on a deposed primary"] += 1
            self.carry_out(part, part.rules.prepared(gtxid, False))
            return
        if self.rng.random() < REFUSE:
            self.counts["prepare refused"] += 1
            self.carry_out(part, part.rules.prepared(gtxid, False))
            return
        part.write(Entry("p", gtxid, branch, self.now))
        part.waits.append((len(part.log), PrepareEnd(gtxid)))

    def synced(self, part: SimPartition, upto: int) -> None:
        if part is not self.parts[part.number] or not part.up or upto <= part.durable:
            return  # a deposed primary's write never reaches its majority
        for entry in part.log[part.durable:upto]:
            self.settle(part, entry)
        part.durable = upto
        ready = [w for w in part.waits if w[0] <= upto]
        part.waits = [w for w in part.waits if w[0] > upto]
        for _, send in ready:
            if isinstance(send, PrepareEnd):
                assert part.rules is not None
                self.carry_out(part, part.rules.prepared(send.gtxid, True))
            else:
                self.send_from(part, send)

    def settle(self, part: SimPartition, entry: Entry) -> None:
        """``entry`` is durable now: no failover will lose it. Check (a)."""
        g = entry.gtxid
        if entry.kind == "u":
            return  # a decided transaction's record rewritten: nothing decided by it
        if entry.kind == "h":
            part.held_durably.add(g)
            self.held.add(g)
            return
        part.settled[g] = entry.kind
        if entry.kind == "p":
            part.prepared_durably.add(g)
            return
        if entry.kind == "r" and g in self.held and self.tm.get(g) is not False:
            self.violate(f"(f) {g}, held for its TM, rolled back in p{part.number} without "
                         f"the TM ({'its TM committed' if g in self.tm else 'no TM decision'})")
        mine, other = ((self.committed_in, self.rolled_back_in) if entry.kind == "c"
                       else (self.rolled_back_in, self.committed_in))
        mine.setdefault(g, set()).add(part.number)
        if other.get(g):
            self.violate(f"(a) {g} committed in partitions {sorted(self.committed_in[g])} and "
                         f"rolled back in {sorted(self.rolled_back_in[g])}")

    def failover(self, p: int) -> None:
        if not self.faulty:
            return
        old = self.parts[p]
        if old.up:
            keep = old.durable
            beyond = self.rng.random() < 0.5  # a backup held some of what was not durable
            if beyond:
                keep = self.rng.randint(old.durable, len(old.log))
            lease = self.rng.uniform(0.0, 1.0)
            self.log(f"p{p} primary of term {old.term} deposed (runs {lease:.2f}s more): the "
                     f"next keeps {keep} of {len(old.log)} records ({old.durable} durable)")
            self.counts["failover"] += 1
            self.counts["undurable records lost"] += len(old.log) - keep
            old.deposed_until = self.now + lease
            self.deposed[p] = old
            new: SimPartition
            if isinstance(old, BrokerPartition):
                store = old.store  # all that was written, or what its majority held
                written = store.image()
                if written != store.disk:
                    self.counts["undurable writes " + ("kept" if beyond else "lost")] += 1
                image = written if beyond else store.disk.copy()
                new = self.broker_partition(p, old.term + 1, image, up=False,
                                            settled=old.settled,
                                            prepared_durably=old.prepared_durably,
                                            held_durably=old.held_durably)
            else:
                new = SimPartition(p, log=old.log[:keep], durable=old.durable,
                                   term=old.term + 1, up=False, settled=old.settled,
                                   prepared_durably=old.prepared_durably,
                                   held_durably=old.held_durably, sim=self)
            self.parts[p] = new
            self.after(self.rng.uniform(*LEADERLESS), self.new_leader, p, new.term)
        self.after(self.rng.expovariate(1 / FAILOVER_EVERY), self.failover, p)

    def new_leader(self, p: int, term: int) -> None:
        part = self.parts[p]
        if part.term != term:
            return
        part.up = True
        for entry in part.log:
            part.apply(entry)
        part.rules = self.new_rules(part)
        self.log(f"p{p} new primary, term {term}, {len(list(part.in_doubt()))} branches "
                 "prepared")
        if isinstance(part, BrokerPartition):
            # the new primary's verification (primary/verification.py), with nobody to ask:
            # what it restored is what its majority holds
            assert part.broker is not None
            verification = Verification.start(part.broker, term, f"p{p}", [], self.now, 0.0)
            for decision in carry_out(part.broker, verification).values():
                self.counts[f"verification: {decision}"] += 1
            self.after(self.rng.uniform(*SYNC), self.sync_store, part)
            part.sync_due = True
        else:
            self.after(self.rng.uniform(*SYNC), self.synced, part, len(part.log))
        for coord in self.coords.values():  # its LeaderNotice
            self.after(self.rng.uniform(*DELAY), self.notice, coord.name, coord.incarnation, p)

    # -- coordinators ---------------------------------------------------------------------------

    def restart(self, coord: Coordinator) -> None:
        coord.incarnation += 1
        coord.tx = CrossTx(f"{coord.name}.{coord.incarnation}", unsafe=self.unsafe)
        coord.backlog = []
        coord.stalled_until = 0.0  # a crash ended its stall (whose end finds a new incarnation)

    def live(self, name: str, incarnation: int) -> Coordinator | None:
        coord = self.coords[name]
        ok = coord.incarnation == incarnation and coord.tx is not None
        return coord if ok else None

    def random_crash(self, name: str) -> None:
        coord = self.coords[name]
        if self.faulty and coord.tx is not None:
            self.crash(coord)
        self.after(self.rng.expovariate(1 / CRASH_EVERY), self.random_crash, name)

    def crash(self, coord: Coordinator) -> None:
        name, incarnation = coord.name, coord.incarnation
        assert coord.tx is not None
        self.log(f"{name}.{incarnation} crashes with {len(coord.tx.commits)} commits under way")
        self.counts["coordinator crash"] += 1
        self.counts["commits lost with their coordinator"] += len(coord.tx.commits)
        coord.tx = None
        self.after(self.rng.uniform(*DOWN), self.come_back, name)

    def come_back(self, name: str) -> None:
        self.restart(self.coords[name])
        self.log(f"{name}.{self.coords[name].incarnation} starts")

    def stall(self, name: str) -> None:
        coord = self.coords[name]
        if self.faulty and coord.tx is not None:
            length = self.rng.uniform(*STALL)
            coord.stalled_until = self.now + length
            self.counts["coordinator stall"] += 1
            self.log(f"{name} stalls {length:.2f}s")
            self.after(length, self.unstall, name, coord.incarnation)
        self.after(self.rng.expovariate(1 / STALL_EVERY), self.stall, name)

    def unstall(self, name: str, incarnation: int) -> None:
        coord = self.live(name, incarnation)
        if coord is None:
            return
        backlog, coord.backlog = coord.backlog, []
        for packet in backlog:
            if coord.tx is None:
                break  # crashed between the rounds on one of them
            self.coordinator_receives(coord, packet)

    def tick_coordinator(self, name: str) -> None:
        coord = self.coords[name]
        if coord.tx is not None and self.now >= coord.stalled_until:
            self.coordinator_does(coord, coord.tx.tick(self.now), moved=False)
        self.after(TICK, self.tick_coordinator, name)

    def notice(self, name: str, incarnation: int, p: int) -> None:
        coord = self.live(name, incarnation)
        if coord is not None and self.now >= coord.stalled_until:
            assert coord.tx is not None
            self.coordinator_does(coord, coord.tx.leader_changed(self.now, p), moved=False)

    def new_commit(self, name: str) -> None:
        if self.now < self.duration:
            self.after(self.rng.expovariate(1 / TX_EVERY), self.new_commit, name)
        coord = self.coords[name]
        if self.now >= self.duration or coord.tx is None or self.now < coord.stalled_until:
            return
        width = self.rng.choices((1, 2, 3), (3, 4, 3))[0]
        chosen = sorted(self.rng.sample(range(len(self.parts)), min(width, len(self.parts))))
        branches = {p: [ForwardMessage("/", (ha_id(p),), "", f"q{p}", HEADER,
                                       f"m{p}".encode())]
                    for p in chosen}
        xa = None
        if self.rng.random() < XA_SHARE:
            xa = f"1:{self.rng.getrandbits(64):016x}:00"
            self.counts["xa prepares"] += 1
        gtxid, effects = coord.tx.begin(self.now, branches, xa=xa)
        self.begun[gtxid] = Begun(gtxid, tuple(chosen), xa=xa,
                                  coordinator=(coord.name, coord.incarnation))
        self.counts["begun"] += 1
        self.counts[f"over {len(chosen)} partitions"] += 1
        self.log(f"{coord.tx.node} begins {gtxid} over {chosen}")
        self.coordinator_does(coord, effects, moved=False)

    def coordinator_receives(self, coord: Coordinator, packet: Packet) -> None:
        if self.now < coord.stalled_until:
            coord.backlog.append(packet)
            return
        assert coord.tx is not None
        before = self.phase_of(coord, packet.gtxid)
        effects = coord.tx.receive(self.now, packet)
        self.coordinator_does(coord, effects, moved=self.phase_of(coord, packet.gtxid) != before)

    def phase_of(self, coord: Coordinator, gtxid: str) -> str:
        assert coord.tx is not None
        commit = coord.tx.commits.get(gtxid)
        return "done" if commit is None else commit.phase.value

    def coordinator_does(self, coord: Coordinator, effects: Sequence[Effect], *,
                         moved: bool) -> None:
        sends: list[Effect] = list(effects)
        if moved and sends and self.faulty and self.rng.random() < CRASH_BETWEEN:
            sent = self.rng.randint(0, len(sends))
            self.log(f"{coord.name} crashes between the rounds, {sent} of {len(sends)} sent")
            self.counts["coordinator crash between the rounds"] += 1
            sends = sends[:sent]
            for effect in sends:
                self.carry_out_coordinator(coord, effect)
            self.crash(coord)
            return
        for effect in sends:
            self.carry_out_coordinator(coord, effect)

    def carry_out_coordinator(self, coord: Coordinator, effect: Effect) -> None:
        if isinstance(effect, Answer):
            self.answered(effect)
        elif isinstance(effect, ToPartition):
            self.send(effect)

    def answered(self, answer: Answer) -> None:
        if answer.gtxid in self.tm_pending:
            self.tm_answered(answer)
            return
        begun = self.begun[answer.gtxid]
        begun.answer = answer
        if answer.held:
            self.counts["xa held for the TM"] += 1
            self.log(f"answer {answer.gtxid}: XA_OK (held for its TM)")
            decider = self.parts[begun.participants[0]]
            if self.check_answers and answer.gtxid not in decider.held_durably:
                self.violate(f"(b) XA_OK for {answer.gtxid} while its decider holds no "
                             "durable all-prepared record")
            self.tm_waiting.add(answer.gtxid)
            self.after(self.rng.uniform(*TM_DECIDES), self.tm_decides, answer.gtxid,
                       self.rng.random() < TM_COMMITS)
            return
        self.counts["commit-ok" if answer.committed else "refused"] += 1
        if not answer.committed:
            why = answer.reason.split(" (")[0].replace(f"partition {answer.gtxid}", "")
            self.counts["refused: " + ("a no vote" if "refused" in why else why)] += 1
        self.log(f"answer {answer.gtxid}: {'commit-ok' if answer.committed else answer.reason}")
        if not self.check_answers:
            return
        if answer.committed:
            late = [p for p in begun.participants
                    if self.parts[p].settled.get(answer.gtxid) != "c"]
            if late:
                self.violate(f"(b) commit-ok for {answer.gtxid} while partitions {late} hold "
                             "no durable commit")
        elif self.parts[begun.participants[0]].settled.get(answer.gtxid) != "r":
            self.violate(f"(b) {answer.gtxid} refused while its decider holds no durable "
                         "rollback")

    # -- the XA transaction manager ------------------------------------------------------------

    def tm_decides(self, gtxid: str, commit: bool) -> None:
        """The TM's commit or rollback, through a random live coordinator (any node)."""
        if gtxid in self.tm_pending:
            return
        live = [c for c in self.coords.values()
                if c.tx is not None and gtxid not in c.tx.commits]
        if not live:
            self.after(TM_RETRY, self.tm_decides, gtxid, commit)
            return
        coord = self.rng.choice(live)
        assert coord.tx is not None
        self.tm[gtxid] = commit
        self.tm_pending[gtxid] = (coord.name, coord.incarnation)
        self.counts["tm " + ("commit" if commit else "rollback")] += 1
        self.log(f"TM {'commits' if commit else 'rolls back'} {gtxid} through {coord.tx.node}")
        participants = self.begun[gtxid].participants
        self.coordinator_does(coord, coord.tx.finish(self.now, gtxid, participants, commit),
                              moved=False)
        self.after(TM_RETRY, self.tm_retry, gtxid, commit)

    def tm_retry(self, gtxid: str, commit: bool) -> None:
        running = self.tm_pending.get(gtxid)
        if running is None:
            return  # answered
        if self.live(*running) is not None:
            self.after(TM_RETRY, self.tm_retry, gtxid, commit)  # its node retries itself
            return
        del self.tm_pending[gtxid]  # that node died: the TM's recovery asks another
        self.counts["tm asks again"] += 1
        self.tm_decides(gtxid, commit)

    def tm_answered(self, answer: Answer) -> None:
        del self.tm_pending[answer.gtxid]
        self.tm_waiting.discard(answer.gtxid)
        commit = self.tm[answer.gtxid]
        self.counts["tm answered " + ("committed" if answer.committed else "rolled back")] += 1
        self.log(f"TM answer {answer.gtxid}: {'committed' if answer.committed else 'rolled back'}")
        begun = self.begun[answer.gtxid]
        if answer.committed != commit:
            self.violate(f"(f) the TM's {'commit' if commit else 'rollback'} of held "
                         f"{answer.gtxid} answered {answer}")
        want = "c" if commit else "r"
        late = [p for p in begun.participants
                if self.parts[p].settled.get(answer.gtxid) != want]
        if self.check_answers and late:
            self.violate(f"(b) the TM's answer for {answer.gtxid} while partitions {late} "
                         f"hold no durable {want}")

    def tm_recover(self) -> None:
        """The TM's recovery: ``recover`` (every primary's ``held_xa``), and what a dead
        coordinator's prepare left held, XA_OK never heard, is rolled back."""
        self.after(TM_RECOVER, self.tm_recover)
        for part in self.parts:
            if not self.alive(part) or part.deposed_until is not None:
                continue
            for _, gtxid, _ in list(part.held_xa()):
                begun = self.begun.get(gtxid)
                if (begun is None or begun.answer is not None or gtxid in self.tm_pending
                        or self.live(*begun.coordinator) is not None):
                    continue
                self.counts["tm recovery rolls back"] += 1
                self.tm_waiting.add(gtxid)
                self.tm_decides(gtxid, False)

    # -- the network ----------------------------------------------------------------------------

    def delay(self) -> float | None:
        """A packet's delay, or None when it is lost."""
        if self.faulty:
            if self.rng.random() < LOSS:
                self.counts["packets lost"] += 1
                return None
            if self.rng.random() < LATE:
                return self.rng.uniform(*LATE_BY)
        return self.rng.uniform(*DELAY)

    def send(self, effect: ToPartition) -> None:
        """To the partition's primary; while it has none, to the deposed one, if it runs."""
        part: SimPartition | None = self.parts[effect.partition]
        if part is not None and not part.up:
            part = self.deposed.get(effect.partition)
        delay = self.delay()
        if delay is not None and part is not None and self.alive(part):
            self.after(delay, self.deliver_to_partition, part, effect.packet)

    def deliver_to_partition(self, part: SimPartition, packet: Packet) -> None:
        if not self.alive(part):
            return  # sent to a primary that is gone
        assert part.rules is not None
        if part.deposed_until is not None:
            self.counts["packets to a deposed primary"] += 1
        if not isinstance(packet, XPrepare):
            self.log(f"p{part.number}{'(deposed)' if part.deposed_until else ''} <- {packet}")
        self.carry_out(part, part.rules.receive(self.now, packet))

    def deliver_to_node(self, name: str, incarnation: int, packet: Packet) -> None:
        coord = self.live(name, incarnation)
        if coord is not None:
            self.coordinator_receives(coord, packet)

    def carry_out(self, part: SimPartition, effects: Sequence[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, WhenDurable) and isinstance(part, BrokerPartition):
                part.store.after_sync(self.sender(part, effect.send))
            elif isinstance(effect, WhenDurable):
                if len(part.log) <= part.durable:
                    self.send_from(part, effect.send)
                else:
                    part.waits.append((len(part.log), effect.send))
            elif isinstance(effect, ToPartition | ToNode):
                self.send_from(part, effect)

    def sender(self, part: SimPartition, send: ToPartition | ToNode) -> Callable[[], None]:
        return lambda: self.send_from(part, send)

    def send_from(self, part: SimPartition, send: ToPartition | ToNode) -> None:
        """A primary's packet: an answer must be backed by a durable record (b)."""
        packet = send.packet
        if self.check_answers:
            self.check_backed(part, packet)
        if isinstance(packet, XOutcomeReply):
            begun = self.begun.get(packet.gtxid)
            xa = "xa " if begun is not None and begun.xa is not None else ""
            self.counts[f"{xa}outcome asked: {packet.outcome}"] += 1
        if isinstance(send, ToPartition):
            self.send(send)
            return
        name, _, incarnation = send.node.partition(".")
        delay = self.delay()
        if delay is not None:
            self.after(delay, self.deliver_to_node, name, int(incarnation), packet)

    def check_backed(self, part: SimPartition, packet: Packet | Query) -> None:
        if isinstance(packet, Query):
            return
        if isinstance(packet, XDecided | XOutcomeReply) and packet.outcome == HELD:
            if packet.gtxid not in part.held_durably:
                self.violate(f"(b) p{part.number} answered {HELD} for {packet.gtxid} "
                             f"({type(packet).__name__}) holding no durable all-prepared "
                             "record")
            return
        held = part.settled.get(packet.gtxid)
        if isinstance(packet, XPrepared):
            # a yes says "prepared, durably": still true if a decision came since (a rollback
            # the decider's tombstone or the coordinator ordered; it cannot be a commit)
            if packet.ok and packet.gtxid not in part.prepared_durably:
                self.violate(f"(b) p{part.number} voted yes for {packet.gtxid} holding "
                             f"{held or 'nothing'} durably")
            return
        if isinstance(packet, XDecided | XFinished | XOutcomeReply):
            said = "c" if packet.outcome == Status.COMMITTED.value else "r"
            if held != said:
                self.violate(f"(b) p{part.number} answered {packet.outcome} for {packet.gtxid} "
                             f"({type(packet).__name__}) holding {held or 'nothing'} durably")

    # -- the end ---------------------------------------------------------------------------------

    def quiet(self) -> bool:
        return self.settled() and not any(self.decided_holds(part) for part in self.parts)

    def settled(self) -> bool:
        return (all(part.up and part.durable == len(part.log) and not part.branches
                    and not part.preparing
                    and (not isinstance(part, BrokerPartition) or part.settled_everything())
                    for part in self.parts)
                and all(c.tx is not None and not c.tx.commits and not c.backlog
                        for c in self.coords.values())
                and not self.tm_pending and not self.tm_waiting)

    @staticmethod
    def decided_holds(part: SimPartition) -> list[str]:
        """The all-prepared records a primary keeps apart (memory) though decided."""
        if isinstance(part, BrokerPartition):
            assert part.txs is not None
            return [g for g, _ in part.txs.holds() if part.status_of(g).decided]
        return [g for g in part.holds if part.status_of(g).decided]

    def finish(self) -> None:
        if not self.settled():
            doubt = {f"p{p.number}": sorted(p.branches) + sorted(p.preparing)
                     + ([] if not isinstance(p, BrokerPartition) or p.broker is None
                        else sorted(b.id for b in p.broker.dtx.branches.values()))
                     for p in self.parts}
            open_ = {c.name: sorted(c.tx.commits) if c.tx else "down" for c in self.coords.values()}
            self.violate(f"(c) still in doubt {SETTLE:.0f}s after the faults: branches {doubt}, "
                         f"commits {open_}, the TM's {sorted(self.tm_waiting)} (finishing "
                         f"{sorted(self.tm_pending)})")
        kept = {f"p{p.number}": gs for p in self.parts if (gs := self.decided_holds(p))}
        if kept:
            self.violate(f"(g) all-prepared records kept apart (in memory) {SETTLE:.0f}s after "
                         f"the faults though their transaction is decided: {kept}")
        for g, begun in self.begun.items():
            held = {p: self.parts[p].status_of(g) for p in begun.participants}
            committed = any(s is Status.COMMITTED for s in held.values())
            if committed or (begun.answer is not None and begun.answer.committed):
                if any(s is not Status.COMMITTED for s in held.values()):
                    self.violate(f"(d) {g} committed in part: {held}, answered {begun.answer}")
                self.counts["committed everywhere"] += 1
        self.counts["unanswered"] = sum(1 for b in self.begun.values() if b.answer is None)
        for part in self.parts:
            if not isinstance(part, BrokerPartition):
                continue
            assert part.broker is not None
            commits = sum(1 for g, b in self.begun.items() if part.number in b.participants
                          and part.status_of(g) is Status.COMMITTED)
            messages = part.broker.vhosts["/"].queues[f"q{part.number}"].message_count
            if messages != commits:
                self.violate(f"(e) p{part.number}'s queue holds {messages} messages; {commits} "
                             "transactions committed there")
            self.counts["broker partition messages"] += messages


def run_seed(seed: int, *, unsafe: Unsafe = SAFE, faults: Any = True,
             duration: float = 20.0, **kw: Any) -> SimResult:
    """One seed. ``faults``: a bool, or ``world.Faults`` (``Faults.none()``: no faults)."""
    on = bool(getattr(faults, "rate", faults))
    logging.disable(logging.WARNING)  # the brokers' verification warnings: the trace tells
    try:
        return XtxSimulation(seed, unsafe=unsafe, faults=on, duration=duration, **kw).run()
    finally:
        logging.disable(logging.NOTSET)


def run_many(seeds: Iterable[int], *, jobs: int = 1, **kw: Any) -> list[SimResult]:
    return seed_runner.run_many(run_seed, seeds, jobs=jobs, **kw)
