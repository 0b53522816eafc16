"""The election and replication simulation: a client publishing with confirms through failovers.

The datacenter of ``world.py`` (the product's ``HAMember`` per node, its
``Broker`` on a simulated disk) with one client: it connects to any node through that node's own accept
path (``World.connect``: the node's ``ClientAdmission`` serves it, a backup
relays it, a node that serves nobody refuses it; a paused node's backlog
waits), publishes persistent messages to a durable queue on the node that
serves its connection and waits for each confirm, which the broker gives
from ``Broker.after_durable`` as the channel does and which reaches the
client only while the connection is open; it consumes (basic.get + ack) from
the head of the queue. The client declares the queue on every node it
meets, as a client does when it connects.

Each publish and each get (with its ack) costs the node's loop
``Costs.client_op`` (``world.py``'s cost model).

Checked after every event, beside the world's (a), (b), (e) and (f):
(c) the serving primary holds every confirmed message not consumed since
(checked when a primary starts serving, when the newest server changes and
at each confirm); (d) a ready backup holds every message its position
covers: when a backup reports a valid position ``(epoch, seq)``, every
message the primary of that epoch held at ``seq`` and that no event the
backup applied took away is in its queue; (g) a purge answered stays done: once
the client has purge-ok (after ``Broker.after_durable``, as the channel answers
it), the serving primary holds none of the messages it took off.

A failing seed is replayed by its number (``brokerha cluster simulate
--seeds 1 --start-seed N --trace``; ``cli.py``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from brokerha import seed_runner
from brokerha.broker.message import Entry
from brokerha.broker.queue import Queue
from brokerha.cluster.election import Position
from brokerha.ha.simulation import world
from brokerha.ha.simulation.world import (
    Bounds,
    Faults,
    SimConnection,
    SimNode,
    Unsafe,
    Violation,
    World,
    message,
)
from brokerha.primary.primary import Primary

QUEUE = "q"
GAP_CONSUMES = 0.2  # of the client's gets, those that take the second message, not the head
CATCHES = ("confirm_early", "early_ack", "invalid_grants", "no_lease", "old_epoch_apply",
           "lagging_role", "runs_across_gaps", "local_purge")  # monolithic_catch_up: the heavy workload (heavy.py)

__all__ = ["ConfirmSimulation", "Faults", "SimResult", "Unsafe", "Violation", "run_many",
           "run_seed"]


@dataclass
class SimResult:
    seed: int
    nodes: int
    violation: str | None
    trace: list[str]
    trace_hash: str
    failovers: int = 0
    published: int = 0
    confirmed: int = 0
    consumed: int = 0
    purged: int = 0             # messages taken off by the client's queue.purge (purge_rate)
    purges_answered: int = 0    # of its purges, those answered (purge-ok)
    unserved: float = 0.0       # virtual seconds without a serving primary
    overlap: float = 0.0        # virtual seconds with two serving (a deposed one in its lease)
    deposed_calls: int = 0      # client calls that went to a deposed primary still serving
    events: int = 0
    stable: float = 0.0         # virtual seconds under the stability invariant (f) ...
    lapsed: float = 0.0         # ... of which its primary's lease had lapsed
    longest_step: float = 0.0   # the longest a node's loop was busy at once
    catch_ups: list[float] = field(default_factory=list)  # heavy.py: restart to caught up, s
    work: dict[str, int] = field(default_factory=dict)  # big work (world.WorldStats.big_work)

    def summary(self) -> str:
        head = f"seed {self.seed} ({self.nodes} nodes): "
        if self.violation:
            return head + f"VIOLATION {self.violation}"
        return head + (f"ok, {self.failovers} failovers, {self.confirmed}/{self.published} "
                       f"confirmed, {self.unserved:.1f}s unserved")


def held(node: SimNode) -> set[int]:
    """The message ids on the node's queue (the client's gets are acknowledged at once)."""
    q = client_queue(node)
    if q is None:
        return set()
    return {int(e.message.body) for e in q.ready}


def client_queue(node: SimNode) -> Queue | None:
    vhost = node.broker.vhosts.get("/")
    return vhost.queues.get(QUEUE) if vhost is not None else None


class ConfirmSimulation(World):
    def __init__(self, seed: int, *, publish_rate: float = 2.0, consume_rate: float = 1.6,
                 purge_rate: float = 0.0, **kw: Any) -> None:
        kw.setdefault("stability", True)
        super().__init__(seed, **kw)
        self.publish_rate, self.consume_rate = publish_rate, consume_rate
        self.purge_rate = purge_rate  # the client's queue.purge a second (0: none)
        self.confirmed_live: set[int] = set()
        self.consumed: set[int] = set()
        self.purge_answered: set[int] = set()  # (g): taken off by a purge the client has
        self.next_id = 0
        self.gaps = random.Random(seed ^ 0x9A95)  # its own stream: the others' draws unchanged
        self.holds = random.Random(seed ^ 0x401D)  # and the purges' (which message is held)
        # per epoch, for (d): the primary's seq when it took each message in and gave it away
        self.held_at: dict[int, dict[int, int]] = {}
        self.gone_at: dict[int, dict[int, int]] = {}  # (in the order they went)
        self.alive_at: dict[int, set[int]] = {}  # held_at's messages not gone since
        self._held_memo: tuple[tuple[Any, ...], set[int]] | None = None
        self.result = SimResult(seed, len(self.names), None, [], "")
        self.conn: SimConnection | None = None  # the client's connection, once served
        self.dialled_at = -1.0

    def run(self) -> SimResult:
        result = self.result
        try:
            self.start()
            if self.publish_rate > 0:
                self.after(self.rng.expovariate(self.publish_rate), self._publish)
            if self.consume_rate > 0:
                self.after(self.rng.expovariate(self.consume_rate), self._consume)
            if self.purge_rate > 0:
                self.after(self.rng.expovariate(self.purge_rate), self._purge_queue)
            self.run_until(self.duration)
            self._check_serving(self.serving_now)
        except Violation as exc:
            result.violation = str(exc)
            self.note(f"VIOLATION {exc}")
        stats = self.stats
        result.failovers, result.unserved, result.overlap, result.events = (
            stats.failovers, stats.unserved, stats.overlap, stats.events)
        result.stable, result.lapsed, result.longest_step = (stats.stable, stats.lapsed,
                                                             stats.longest_step)
        result.work = stats.big_work()
        result.trace = list(self.trace)
        self._hash.update(f"{result.published} {result.confirmed} {result.consumed}".encode())
        result.trace_hash = self.trace_hash()
        return result

    # -- invariants ---------------------------------------------------------------------------

    def on_elected(self, node: SimNode, epoch: int) -> None:
        super().on_elected(node, epoch)
        self.held_at[epoch] = dict.fromkeys(held(node), 0)  # its state at seq 0 of the epoch
        self.gone_at[epoch] = {}
        self.alive_at[epoch] = set(self.held_at[epoch])

    def on_serving(self, node: SimNode, epoch: int, decisions: dict[str, str]) -> None:
        self._check_serving(node)

    def on_new_server(self, node: SimNode | None) -> None:
        self._check_serving(node)

    def _check_serving(self, node: SimNode | None) -> None:
        """(c): the serving primary holds every confirmed message not consumed since;
        (g): and none that a purge the client has an answer for took off.

        Only the primary of the newest epoch: a deposed one may still serve for its
        lease (two serve at once, the older one behind: (b) bounds that), and it is
        the newest server while its successor is paused.
        """
        if node is None or node.election.epoch < max(self.primaries, default=0):
            return
        have = held(node)
        missing = self.confirmed_live.difference(have)
        if missing:
            self.violate(f"(c) confirmed messages {sorted(missing)[:5]} lost: not held by "
                         f"{node.name}, primary of epoch {node.election.epoch}")
        back = self.purge_answered.intersection(have)
        if back:
            self.violate(f"(g) purged messages {sorted(back)[:5]} back on {node.name}, primary "
                         f"of epoch {node.election.epoch}, after the client's purge-ok")

    def on_position(self, node: SimNode, pos: Position) -> None:
        """(d): a backup valid at ``pos`` under its primary misses nothing that covers."""
        backup = node.ha.backup
        if not pos.valid or backup is None or pos.epoch not in self.held_at:
            return
        held_at, applied = self.held_at[pos.epoch], backup.applied_seq
        have = held(node)
        # a message the primary held at a seq <= pos.seq, missing from the backup, and not
        # taken away by an event the backup applied: still there, or gone after ``applied``
        missing = [mid for mid in self.alive_at[pos.epoch] - have if held_at[mid] <= pos.seq] \
            if pos.seq + 1 > applied else []
        for mid, gone in reversed(self.gone_at[pos.epoch].items()):  # in seq order
            if gone <= applied:
                break
            seq = held_at.get(mid)
            if seq is not None and seq <= pos.seq and mid not in have:
                missing.append(mid)
        if missing:
            mid = min(missing)
            self.violate(f"(d) backup {node.name} ready at {pos} but misses message {mid} "
                         f"(seq {held_at[mid]}) of the primary of epoch {pos.epoch}")

    # -- the client -----------------------------------------------------------------------------

    def _call(self, work: Callable[[SimNode, SimConnection], object]) -> None:
        """The client's next call, on its connection (dialling any node when it has none);
        a paused node takes it when it resumes."""
        conn = self.conn
        if conn is None or not conn.usable:
            self.conn = None
            if self.now - self.dialled_at > 0.05:  # a refused dial is tried again later
                self.dialled_at = self.now
                self.connect(self.rng.choice(self.names), self._connected)
            return

        def call() -> None:
            if conn.usable:
                self.result.deposed_calls += conn.node is not self.serving_now
                work(conn.node, conn)

        conn.node.run(call)

    def _connected(self, conn: SimConnection) -> None:
        if self.conn is None or not self.conn.usable:
            self.conn = conn
        else:
            conn.force_close()  # the client already has one: it closes the other

    def _client_queue(self, node: SimNode) -> Queue:
        vhost = node.broker.vhosts["/"]
        q = vhost.queues.get(QUEUE)
        if q is None:  # the client declares its queue on each primary it meets
            q = vhost.declare_queue(QUEUE, owner=None, durable=True)
        return q

    def _publish(self) -> None:
        self.after(self.rng.expovariate(self.publish_rate), self._publish)
        self._call(self._publish_on)

    def _publish_on(self, node: SimNode, conn: SimConnection) -> None:
        node.charge(self.costs.client_op)
        primary = node.primary
        self.next_id += 1
        mid = self.next_id
        self.result.published += 1
        # with the bounds of big work small, a body of 8 digits: 8 parts, over 2-3 flushes
        body = b"%08d" % mid if self.bounds != Bounds() else b"%d" % mid
        self._client_queue(node).enqueue(message(body, QUEUE, persistent=True))
        if primary is not None:
            self._took_in(node, primary, mid)

        def confirmed() -> None:
            if not conn.usable:
                return  # its connection closed with the primary role: never confirmed
            self.result.confirmed += 1
            if mid not in self.consumed:
                self._confirmed(mid)

        node.broker.after_durable(confirmed)

    def _took_in(self, node: SimNode, primary: Primary, mid: int) -> None:
        """The primary enqueued ``mid`` (for (d): the seq from which its backups hold it)."""
        self.held_at[primary.epoch][mid] = primary.seq
        self.alive_at[primary.epoch].add(mid)

    def _confirmed(self, mid: int) -> None:
        """``mid`` was confirmed and is not consumed: (c) holds it from now on."""
        self.confirmed_live.add(mid)
        if self.serving_now is not None and mid not in self._held_now(self.serving_now):
            self._check_serving(self.serving_now)

    def _consume(self) -> None:
        self.after(self.rng.expovariate(self.consume_rate), self._consume)
        self._call(self._consume_on)

    def _consume_on(self, node: SimNode, conn: SimConnection) -> bool:
        """basic.get and its ack; False if the queue is empty."""
        node.charge(self.costs.client_op)
        q = self._client_queue(node)
        entry = q.get()
        if entry is None:
            return False
        if self.gaps.random() < GAP_CONSUMES and q.ready:
            # the message behind the head, the head put back: a gap in the queue's positions,
            # which a catch-up's runs must not cross (ha.core.Unsafe.runs_across_gaps)
            head, entry = entry, q.get()
            q.requeue(head)
            if entry is None:
                return False
        self._ack(node, q, entry)
        return True

    def _ack(self, node: SimNode, q: Queue, entry: Entry) -> None:
        """The client acknowledges ``entry``, which it got from ``q`` on ``node``."""
        q.settle(entry)
        self.result.consumed += 1
        self._gone(node, int(entry.message.body))

    def _gone(self, node: SimNode, mid: int) -> None:
        """The client took ``mid`` off the queue on ``node``: (c) no longer asks for it."""
        self.consumed.add(mid)
        self.confirmed_live.discard(mid)
        primary = node.primary
        if primary is not None:
            # (the first time it left the backups' copies: policy_change.py drops them earlier)
            self.gone_at[primary.epoch].setdefault(mid, primary.seq)
            self.alive_at[primary.epoch].discard(mid)

    def _purge_queue(self) -> None:
        self.after(self.rng.expovariate(self.purge_rate), self._purge_queue)
        self._call(self._purge_queue_on)

    def _purge_queue_on(self, node: SimNode, conn: SimConnection) -> None:
        """queue.purge (the broker's own, ``VirtualHost.purge_queue``): every ready message
        off at once; on a primary with nothing acquired on the queue one ``pg`` event to
        the backups (``Primary.purged``). In half of them the client holds a message it
        got (the head, or the one behind it: a gap) across the purge, then acknowledges or
        requeues it: the purge leaves it out, one ``pr`` of the ranges. Its purge-ok as
        the channel's (``Channel.reply_when_done``): after the purge's background work,
        once durable."""
        node.charge(self.costs.client_op)
        broker = node.broker
        q = self._client_queue(node)
        held = None
        if self.holds.random() < 0.5:
            held = q.get()
            if held is not None and self.holds.random() < 0.5 and q.ready:
                head, held = held, q.get()
                q.requeue(head)
        mids = [int(e.message.body) for e in q.ready]
        self.result.purged += broker.vhosts["/"].purge_queue(QUEUE, None)
        for mid in mids:
            self._gone(node, mid)
        if held is not None:
            if self.holds.random() < 0.5:
                q.requeue(held)
            else:
                self._ack(node, q, held)

        def answered() -> None:
            if not conn.usable:
                return  # its connection closed with the primary role: no purge-ok
            self.result.purges_answered += 1
            self.purge_answered.update(mids)
            self._check_serving(self.serving_now)

        broker.background.after(lambda: broker.after_durable(answered))

    def _held_now(self, node: SimNode) -> set[int]:
        """``held(node)``, kept while its queue's entries stay the same (many confirms come
        at once, after one sync)."""
        q = client_queue(node)
        if q is None:
            return set()
        key = (node, q, q.deleted, len(q.ready), q.next_position, q.delivered, q.acked,
               q.unacked)
        memo = self._held_memo
        if memo is None or memo[0] != key:
            memo = self._held_memo = (key, held(node))
        return memo[1]


# ---- running many seeds ---------------------------------------------------------------------


# ``small_bounds``: the bounds of big work small (world.Bounds): the client's bodies of 8
# digits go as 8 parts of a byte, over 2-3 flushes of about a packet, a catch-up's messages
# each its ``e`` in parts too; faults aimed at a backup holding some parts of a message
# (world.Faults.between_parts), at this chance each time
SMALL_BOUNDS = replace(world.SMALL_BOUNDS, body_part_bytes=1, flush_bytes=32)
AIMED = 0.005


def run_seed(seed: int, *, nodes: int = 3, duration: float = 60.0,
             faults: Faults | None = None, small_bounds: bool = False,
             **kw: Any) -> SimResult:
    """One seed; the result names the first violation (and the trace tail leading to it)."""
    if small_bounds:
        kw.setdefault("bounds", SMALL_BOUNDS)
        kw.setdefault("pace", world.SMALL_PACE)
        faults = replace(faults or Faults(), between_parts=AIMED)
    return quietly(ConfirmSimulation(seed, nodes=nodes, duration=duration, faults=faults, **kw))


def quietly(simulation: ConfirmSimulation) -> SimResult:
    """Run it with the nodes' warnings off: the trace says what happened."""
    logging.disable(logging.WARNING)
    try:
        return simulation.run()
    finally:
        logging.disable(logging.NOTSET)


def run_many(seeds: Sequence[int], *, jobs: int = 1, seed_fn: Any = None,
             **kw: Any) -> list[SimResult]:
    """Run every seed (over ``jobs`` processes) with ``seed_fn`` (a module-level function,
    ``run_seed`` by default); results in seed order, traces kept for failures only."""
    results = seed_runner.run_many(seed_fn or run_seed, seeds, jobs=jobs, **kw)
    for result in results:
        if result.violation is None:
            result.trace = []
    return results
