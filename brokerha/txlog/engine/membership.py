"""Membership as a view, not an opinion (safety rule F3).

Every post carries (generation, member set).  Within a generation the set only
shrinks: a member silent for MaxPeerLag is dropped, a member's smaller set is
intersected, a member whose set excludes me is dropped.  A dropped master
comes back only through the recovery vote (:mod:`brokerha.txlog.engine.voting`),
which starts generation g + 1 for everyone.  Dropping is how a split starts:
it is acknowledged here, with a backup when the strategy asks for one.
"""

from __future__ import annotations

from brokerha.txlog.engine.config import SplitRecovery
from brokerha.txlog.engine.engine import Engine
from brokerha.txlog.engine.messages import Event


class MembershipMixin:

    def _view_matches(self: Engine, sender: str, generation: int, members: frozenset[str], now: int) -> bool:
        """Accept only my (generation, member set); shrink or vote when they differ."""
        if not self.rules.view:
            if sender not in self.members:
                self._readmit(sender, now)
            return True
        if generation == self.generation and members == self.members:
            return sender in self.members
        if generation == self.generation and sender in self.members:
            if self.me not in members:
                self._drop({sender}, now, f"{sender} dropped me")
            elif members < self.members:
                self._drop(self.members - members, now, f"view of {sender}")
            return False
        if generation < self.generation:
            self._vote_reply(sender, generation)
        else:
            self._start_vote(max(generation, self.generation + 1), now)
        return False

    def _drop_silent(self: Engine, now: int) -> None:
        lag = self.config.max_peer_lag_ms
        silent = {p for p in self.members - {self.me} if now - self.last_heard[p] > lag}
        if silent:
            self._drop(silent, now, "max-peer-lag")

    def _drop(self: Engine, peers: set[str] | frozenset[str], now: int, reason: str) -> None:
        """Continue without ``peers``: an acknowledged split (backup first if the strategy asks)."""
        peers = peers & (self.members - {self.me})
        if not peers:
            return
        first = not self.split
        split_at = len(self.sync) if first else self.durable.split_at
        self._persist("view", (self.generation, self.members - peers, split_at))
        self.posts.clear()  # posts cast under the old view vouch for nothing in the new one
        for peer in sorted(peers):
            self.out.append(Event("peer-dropped", peer, {"reason": reason}))
        if first:
            self.out.append(Event("split-detected", None, {"position": split_at}))
            if self.durable.strategy is not SplitRecovery.NONE:
                self.executor.back_up()
        self._add(timed_out=False, now=now)

    def _readmit(self: Engine, peer: str, now: int) -> None:
        """Seed's literal rule (view off): a dropped peer is back as soon as it posts."""
        members = self.members | {peer}
        split_at = None if members == self.config.masters else self.durable.split_at
        self._persist("view", (self.generation, members, split_at))
        self.posts.clear()
        self.out.append(Event("rejoin", peer, {"winner": None, "common_prefix": len(self.sync)}))
