"""The TxLog round engine: POST / COLLECT / ADD / MERGE as a pure state machine.

Inputs are method calls carrying the node's own wall clock (``tick``,
``received``, ``local_tx``, ``add_peer``...); each returns the actions the
caller must carry out, in order (see :mod:`brokerha.txlog.engine.messages`).  No
sockets, timers or files: a thin asyncio driver sends, sleeps until
:meth:`RoundEngine.wakeup_after` and writes :class:`Persist` actions, and the
deterministic simulation does the same with a virtual network.

Rounds follow seed 000 with the five rules of design/txlog-safety.md:
ADD only with a same-merge-base post from every current member (F1), a
persisted hybrid Lamport counter (F2), posts carrying (generation, member set)
(F3), merge base = (length, running hash) (F4), and ADD only of transactions
whose origin is a member (F5).  Bodies travel with the origin's first post;
a missing body is fetched from the master that listed the transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from brokerha.txlog.engine.clock import HybridCounter
from brokerha.txlog.engine.config import ConfigError, Peer, SplitRecovery, TxLogConfig
from brokerha.txlog.engine.exchange import ExchangeMixin
from brokerha.txlog.engine.executor import Executor
from brokerha.txlog.engine.membership import MembershipMixin
from brokerha.txlog.engine.messages import (
    Action,
    CatchUp,
    Confirm,
    Event,
    Message,
    Persist,
    Post,
    Refused,
    Send,
)
from brokerha.txlog.engine.queues import (
    IncomingQueue,
    MergeBase,
    SyncEntry,
    SynchronisedQueue,
    agreed_prefix,
)
from brokerha.txlog.engine.records import Operation, TxBody, TxIdGenerator, TxRecord
from brokerha.txlog.engine.rules import Rules
from brokerha.txlog.engine.state import DurableState
from brokerha.txlog.engine.validation import COMMITTED, confirmable_on_acquire
from brokerha.txlog.engine.voting import VotingMixin

NEVER = 1 << 62
SAFE = Rules()


class RoundEngine(ExchangeMixin, MembershipMixin, VotingMixin):
    """One master's TxLog: incoming + synchronised queue and the rounds that move between them."""

    def __init__(
        self,
        config: TxLogConfig,
        now: int,
        durable: DurableState | None = None,
        rules: Rules | None = None,
    ) -> None:
        self.config = config
        self.rules = rules or Rules()
        self.me = config.node_id
        self.wall = now
        self.mono = 0
        now = 0
        self.durable = durable or DurableState(members=config.masters, strategy=config.split_recovery)
        self.out: list[Action] = []
        self.counter = HybridCounter.restored(self.durable.counter_reserved, self.rules.lamport)
        self.ids = TxIdGenerator(self.me, self.durable.id_last)
        self.incoming = IncomingQueue(self.durable.own.values())
        self.foreign_bodies: dict[str, TxBody] = {}
        self.pending: dict[str, tuple[TxRecord, str]] = {}  # listed, body not yet acquired
        self.asked: dict[str, int] = {}  # tx_id -> when its body was last requested
        self.acquired_ms: dict[str, int] = {r.tx_id: r.created_ms for r in self.durable.own.values()}
        self.posts: dict[str, Post] = {}  # latest same-view post per member
        self.last_counter: dict[str, int] = {}  # seed's "last known counter" (any post)
        self.last_heard = dict.fromkeys(config.peer_ids, now)
        self.peer_length: dict[str, int] = {}
        self.pushed: set[str] = set()
        self.synced_from: dict[str, str] = {}  # tx_id -> master whose tail carried it
        self.last_post_at = -NEVER
        self.next_post_at = now
        self.busy = True
        self.executor = Executor(self.me, self.durable, self._persist, self.out.append)
        self._init_voting()

    # ---- public API -------------------------------------------------------

    @property
    def sync(self) -> SynchronisedQueue:
        return self.durable.sync

    @property
    def members(self) -> frozenset[str]:
        return self.durable.members

    @property
    def generation(self) -> int:
        return self.durable.generation

    @property
    def split(self) -> bool:
        return self.durable.split

    def merge_base(self) -> MergeBase:
        return self.durable.sync.merge_base()

    def local_tx(self, operations: Iterable[Operation], now: int) -> tuple[TxRecord, list[Action]]:
        """A client committed a transaction on global queues: give it an id and queue it."""
        now = self._clock(now)
        tx_id = self.ids.next(self.wall)
        self._persist("ids", self.ids.last)
        record = TxRecord(tx_id, self.counter.new_timestamp(self.wall), self.me, self.wall)
        self._reserve_counter()
        self._add_own(record, TxBody(tx_id, tuple(operations)), now)
        return record, self._take()

    def received(self, message: Message, now: int) -> list[Action]:
        now = self._clock(now)
        if message.sender not in self.config.peer_ids:
            self.out.append(Refused(message.sender, "not a configured sync peer"))
            return self._take()
        handler = getattr(self, "_on_" + type(message).__name__.lower())
        handler(message, now)
        self._after(now)
        return self._take()

    def tick(self, now: int) -> list[Action]:
        now = self._clock(now)
        if self.voting:
            self._gossip_votes(now)
            return self._take()
        self._drop_silent(now)
        self._refetch(now)
        if now >= self.next_post_at:
            if not self.rules.full and self.busy and now >= self.last_post_at + self.config.round_timeout_ms:
                self._add(timed_out=True, now=now)
            if self.members == {self.me}:
                # alone in my view (one side of a split): no post will ever trigger an
                # ADD, and "every member's post" (F1) holds vacuously
                self._add(timed_out=False, now=now)
            self._post(now)
        self._after(now)
        return self._take()

    def wakeup_after(self) -> int:
        """Milliseconds after the last input at which the caller must call :meth:`tick`."""
        return max(self._next_wakeup() - self.mono, 0)

    def _next_wakeup(self) -> int:
        if self.voting:
            return self.vote_sent_at + self.config.round_timeout_ms
        wake = self.next_post_at
        lag = self.config.max_peer_lag_ms
        for peer in self.members - {self.me}:
            wake = min(wake, self.last_heard[peer] + lag + 1)
        if self.asked:
            wake = min(wake, min(self.asked.values()) + self.config.round_timeout_ms)
        return wake

    def add_peer(self, node_id: str, url: str, now: int) -> list[Action]:
        """Configure a new sync peer; it becomes a member through the next vote."""
        now = self._clock(now)
        self.config = self.config.with_peer(Peer(node_id, url))
        self._persist("peers", self.config.peers)
        self.last_heard[node_id] = now
        self.out.append(Event("peer-added", node_id))
        return self._take()

    def remove_peer(self, node_id: str, now: int) -> list[Action]:
        """Remove a sync peer for good (a configuration change, not a split)."""
        now = self._clock(now)
        if self.voting:
            raise ConfigError(f"peer {node_id!r}: cannot be removed during a recovery vote")
        self.config = self.config.without_peer(node_id)
        self._persist("peers", self.config.peers)
        self.last_heard.pop(node_id, None)
        members = self.members - {node_id}
        split_at = None if members == self.config.masters else self.durable.split_at
        self._persist("view", (self.generation, members, split_at))
        self.posts.pop(node_id, None)
        self.out.append(Event("peer-removed", node_id))
        self._add(timed_out=False, now=now)
        return self._take()

    def set_split_recovery(self, value: str) -> list[Action]:
        strategy = SplitRecovery.parse(value)
        if self.split or self.voting:
            raise ConfigError("split-recovery: cannot be changed during a split")
        self._persist("strategy", strategy)
        return self._take()

    # ---- plumbing -----------------------------------------------------------

    def _clock(self, wall: int) -> int:
        """Timers run on a monotonic clock derived from the wall clock the caller passes.

        A wall clock stepped back (NTP, failover to another host) must not
        stall rounds or the MaxPeerLag timer: backward steps are absorbed here,
        while timestamps and counters keep using the wall clock itself (F2).
        """
        self.mono += max(wall - self.wall, 0)
        self.wall = wall
        return self.mono

    def _take(self) -> list[Action]:
        out = list(self.out)
        self.out.clear()
        return out

    def _persist(self, key: str, value: Any) -> None:
        change = Persist(key, value)
        self.durable.apply(change)
        self.out.append(change)

    def _send(self, peer: str, message: Message) -> None:
        self.out.append(Send(peer, message))

    def _reserve_counter(self) -> None:
        reserved = self.counter.reservation_needed()
        if reserved is not None:
            self._persist("counter", reserved)

    def _post_soon(self, now: int, news: bool = False) -> None:
        """Start a round early: after an ADD, or (F1 rounds only) when news should travel now.

        The seed's rounds (``full`` off) are fixed: POST, COLLECT until every
        post or the timeout, ADD; news waits for the next round.
        """
        if news and self.busy and not self.rules.full:
            return
        self.next_post_at = min(self.next_post_at, max(now, self.last_post_at + self.config.post_spacing_ms))

    def _after(self, now: int) -> None:
        if not self.voting and self._may_execute(now):
            self.executor.advance()

    def _may_execute(self, now: int) -> bool:
        """Simple/Smart delay updates while a member is silent but not yet dropped."""
        if self.durable.strategy is SplitRecovery.NONE:
            return True
        quiet = self.config.idle_interval_ms + 2 * self.config.round_timeout_ms
        return all(now - self.last_heard[p] <= quiet for p in self.members - {self.me})

    def _body(self, tx_id: str) -> TxBody | None:
        return self.durable.bodies.get(tx_id) or self.foreign_bodies.get(tx_id)

    # ---- POST -------------------------------------------------------------------

    def _post(self, now: int) -> None:
        counter = self.counter.for_post(self.wall)
        self._reserve_counter()
        records = tuple(self.incoming.records())
        fresh = tuple(
            self.durable.bodies[r.tx_id] for r in records if r.origin == self.me and r.tx_id not in self.pushed
        )
        self.pushed.update(b.tx_id for b in fresh)
        post = Post(self.me, self.generation, self.members, self.merge_base(), counter, records, fresh)
        for peer in sorted(self.config.peer_ids):
            self._send(peer, post)
        self.busy = bool(records or self.pending)
        self.last_post_at = now
        if not self.rules.full:
            self.posts.clear()  # the seed's COLLECT: this round's posts only
        interval = self.config.round_timeout_ms if self.busy else self.config.idle_interval_ms
        self.next_post_at = now + interval
        self._retain(now)

    def _add_own(self, record: TxRecord, body: TxBody, now: int) -> None:
        self._persist("own.add", (record, body))
        self.incoming.add(record)
        self.acquired_ms[record.tx_id] = self.wall
        if confirmable_on_acquire(body):
            self.out.append(Confirm(record.tx_id, COMMITTED))
        self._post_soon(now, news=True)

    # ---- COLLECT / MERGE ----------------------------------------------------

    def _on_post(self, post: Post, now: int) -> None:
        self.last_counter[post.sender] = post.counter
        if self.voting:
            self._vote_reply(post.sender, post.generation)
            return
        if not self._view_matches(post.sender, post.generation, post.members, now):
            return
        self.last_heard[post.sender] = now
        self.counter.observe(post.counter, [r.timestamp for r in post.incoming])
        mine = self.merge_base()
        same = post.merge_base.same(mine, self.rules.hash)
        if same or self.rules.full:
            self._merge(post.incoming, post.bodies, post.sender, now)
        if same:
            self.peer_length[post.sender] = mine.length
            self.posts[post.sender] = post
            self._add(timed_out=False, now=now)
        else:
            self._compare_bases(post, now)
            rebased = self._rebase(post)
            if rebased is not None:
                self.posts[post.sender] = rebased
                self._add(timed_out=False, now=now)
        if post.incoming and not self.busy:
            self.busy = True
            self._post_soon(now)

    # ---- ADD ----------------------------------------------------------------

    def _add(self, timed_out: bool, now: int) -> None:
        """ADD the agreed prefix: every member's post (F1) or, unsafe, last known counters."""
        if self.voting:
            return
        others = self.members - {self.me}
        missing = [p for p in others if p not in self.posts]
        if missing and not (timed_out and all(p in self.last_counter for p in missing)):
            return
        counters = [self.counter.value] + [self.posts[p].counter for p in others if p in self.posts]
        counters += [self.last_counter[p] for p in missing]
        queues = [self.incoming.records()] + [self.posts[p].incoming for p in others if p in self.posts]
        eligible = set(self.members) if self.rules.origin else None
        prefix = agreed_prefix(queues, min(counters), eligible)
        if prefix:
            self._append(prefix, now)

    def _append(self, records: list[TxRecord] | tuple[TxRecord, ...], now: int, lister: str | None = None) -> None:
        entries = [SyncEntry(r, self.generation, self.wall) for r in records]
        bodies = [self.foreign_bodies[r.tx_id] for r in records if r.tx_id in self.foreign_bodies]
        self._persist("sync.append", (entries, bodies))
        ids = [r.tx_id for r in records]
        self.incoming.remove(ids)
        for tx_id in ids:
            self.foreign_bodies.pop(tx_id, None)
            self.pending.pop(tx_id, None)
            if lister is not None:
                self.synced_from[tx_id] = lister
        self.posts = {p: r for p, post in self.posts.items() if (r := self._rebase(post)) is not None}
        missing = [t for t in ids if t not in self.durable.bodies and t not in self.asked]
        if missing and lister is not None:
            self._fetch(lister, missing, now)
        self._post_soon(now)

    def _rebase(self, post: Post) -> Post | None:
        """Read a lagger's post as a post for my merge base, when that is exactly what it says.

        Within a generation, and with every rule on, a master's synchronised
        queue followed by its incoming queue is one (timestamp, id)-sorted
        sequence of members' transactions.  A post cut at an older base whose
        members' incoming starts with exactly what I added since says the same
        as a post at my base without those entries: the promise of its
        counter is unchanged.  Using it saves the lagger's catch-up round trip.
        """
        if self.rules != SAFE:
            return None
        theirs, sync = post.merge_base, self.sync
        if not (sync.offset.length <= theirs.length < len(sync) and sync.holds_prefix(theirs)):
            return None
        added = [r.tx_id for r in sync.records(theirs.length)]
        members = [r.tx_id for r in post.incoming if r.origin in self.members]
        if members[: len(added)] != added:
            return None
        skip = set(added)
        rest = tuple(r for r in post.incoming if r.tx_id not in skip)
        return replace(post, merge_base=sync.merge_base(), incoming=rest, bodies=())

    # ---- laggers ------------------------------------------------------------

    def _compare_bases(self, post: Post, now: int) -> None:
        """A member posted another merge base: send a lagger my tail, or detect a fork."""
        theirs, sync = post.merge_base, self.sync
        if self.rules.hash:
            behind = theirs.length < len(sync) and sync.holds_prefix(theirs)
            ahead = theirs.length > len(sync)
        else:
            behind = sync.holds_prefix(theirs, by_hash=False)
            ahead = not behind
        if behind:
            self.peer_length[post.sender] = theirs.length
            start = sync.position_after(theirs, self.rules.hash)
            tail = tuple(sync.records(start))
            bodies = tuple(b for b in (self._body(r.tx_id) for r in tail) if b is not None)
            self._send(post.sender, CatchUp(self.me, self.generation, self.members, theirs, tail, bodies))
        elif ahead:
            self._post_soon(now, news=True)  # my post makes the forerunner send its tail
        else:
            self.out.append(Event("diverged", post.sender, {"theirs": theirs.length, "mine": len(sync)}))
            self._start_vote(self.generation + 1, now)

    def _on_catchup(self, message: CatchUp, now: int) -> None:
        if self.voting or not self._view_matches(message.sender, message.generation, message.members, now):
            return
        sync, base = self.sync, message.base
        if self.rules.hash:
            if len(sync) < base.length or not sync.holds_prefix(base):
                return
            have = [r.tx_id for r in sync.records(base.length)]
            if have != [r.tx_id for r in message.tail[: len(have)]]:
                return
            new = message.tail[len(have) :]
        else:
            if self.merge_base().last_id != base.last_id:
                return
            new = message.tail
        for body in message.bodies:
            if self._body(body.tx_id) is None:
                self.foreign_bodies[body.tx_id] = body
        if new:
            self._append(new, now, lister=message.sender)

    # ---- retention ------------------------------------------------------------

    def _retain(self, now: int) -> None:
        """tx-log-max-size / tx-log-max-depth, never past what every master is known to hold."""
        floor = min([len(self.sync)] + [self.peer_length.get(p, 0) for p in self.config.peer_ids])
        floor = self.executor.advance_stable(floor)
        sync = self.sync
        horizon = self.wall - self.config.max_depth_ms
        too_old = bool(sync.entries) and sync.entries[0].record.created_ms < horizon
        if floor > sync.offset.length and (len(sync) - sync.offset.length > self.config.tx_log_max_size or too_old):
            self._persist("sync.prune", (floor, self.config.tx_log_max_size, horizon))
