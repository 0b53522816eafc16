"""The recovery vote inside the round engine (rule F3's only way back in).

A master that hears a configured master outside its (generation, member set)
freezes its synchronised queue and casts a ballot for generation g + 1.
Ballots are gossiped (a Vote carries every ballot its sender knows) so one lost
link cannot stall the vote; the vote is decided only with a ballot from every
configured master, by :func:`brokerha.txlog.engine.recovery.plan`, and the decided set
is sent to any master that asks later ("send the vote set to a master that
missed it").
"""

from __future__ import annotations

from brokerha.txlog.engine.engine import Engine
from brokerha.txlog.engine.messages import Ballot, Event, Vote
from brokerha.txlog.engine.queues import IncomingQueue, SyncEntry
from brokerha.txlog.engine.records import TxBody, TxRecord
from brokerha.txlog.engine.recovery import RecoveryPlan, plan


class VotingMixin:
    def _init_voting(self: Engine) -> None:
        ballot = self.durable.ballot
        self.votes: dict[str, Ballot] = {ballot.master: ballot} if ballot else {}
        self.vote_sent_at = -(1 << 62)

    @property
    def voting(self: Engine) -> bool:
        return self.durable.ballot is not None

    def _start_vote(self: Engine, generation: int, now: int) -> None:
        ballot = self.durable.ballot
        if ballot is not None and ballot.generation >= generation:
            return
        sync = self.sync
        ballot = Ballot(self.me, generation, sync.offset, tuple(sync.records()))
        self._persist("vote", ballot)
        self.votes = {self.me: ballot}
        self.posts.clear()
        self.out.append(Event("vote", None, {"generation": generation, "length": len(sync)}))
        self._gossip_votes(now, force=True)

    def _gossip_votes(self: Engine, now: int, force: bool = False) -> None:
        if not force and now < self.vote_sent_at + self.config.round_timeout_ms:
            return
        ballot = self.durable.ballot
        assert ballot is not None
        vote = Vote(self.me, ballot.generation, tuple(self.votes.values()))
        for peer in sorted(self.config.peer_ids):
            self._send(peer, vote)
        self.vote_sent_at = now

    def _vote_reply(self: Engine, peer: str, generation: int) -> None:
        """Help a peer at another generation: my decided ballots, or my open vote."""
        if generation < self.generation and self.durable.decided:
            self._send(peer, Vote(self.me, self.generation, self.durable.decided))
        elif self.voting and generation >= self.durable.ballot.generation:  # type: ignore[union-attr]
            self._send(peer, Vote(self.me, self.durable.ballot.generation, tuple(self.votes.values())))  # type: ignore[union-attr]

    def _on_vote(self: Engine, vote: Vote, now: int) -> None:
        if vote.generation <= self.generation:
            if vote.generation == self.generation and self.durable.decided:
                if {b.master for b in vote.ballots} != {b.master for b in self.durable.decided}:
                    self._send(vote.sender, Vote(self.me, self.generation, self.durable.decided))
            return
        current = self.durable.ballot
        if current is not None and vote.generation > current.generation:
            self._vote_reply(vote.sender, current.generation)
            return
        if vote.generation > self.generation + 1:
            return  # I missed a decision: the sender's reply to my own vote brings it
        self._start_vote(vote.generation, now)
        known = len(self.votes)
        for ballot in vote.ballots:
            if ballot.generation == vote.generation and ballot.master in self.config.masters:
                self.votes.setdefault(ballot.master, ballot)
        if self.config.masters <= self.votes.keys():
            self._decide(now)
        elif len(self.votes) > known:
            self._gossip_votes(now, force=True)

    def _decide(self: Engine, now: int) -> None:
        ballots = tuple(self.votes[m] for m in sorted(self.config.masters))
        generation = ballots[0].generation
        decision = plan(self.me, ballots, self.durable.strategy)
        self._adopt_log(decision, generation, now)
        self._renegotiate(decision.renegotiate, now)
        self._restart_execution(decision)
        self._persist("view", (generation, self.config.masters, None))
        self._persist("decided", ballots)
        self._persist("exec.discard", None)
        self.out.append(
            Event("rejoin", None, {"winner": decision.winner, "common_prefix": decision.fork})
        )
        self.votes = {}
        for peer in self.config.peer_ids:
            self.last_heard[peer] = now
        # tell everyone, so masters still waiting for a ballot decide too
        for peer in sorted(self.config.peer_ids):
            self._send(peer, Vote(self.me, generation, ballots))
        self._post_soon(now)

    def _adopt_log(self: Engine, decision: RecoveryPlan, generation: int, now: int) -> None:
        """Cut back to the fork and append the winner's tail; foreign incoming is volatile: drop it."""
        if len(self.sync) > decision.fork:
            self._persist("sync.truncate", decision.fork)
        entries = [SyncEntry(r, generation, self.wall) for r in decision.tail]
        bodies = [b for b in (self._body(r.tx_id) for r in decision.tail) if b is not None]
        self._persist("sync.append", (entries, bodies))
        in_sync = {r.tx_id for r in decision.tail}
        for record in list(self.durable.own.values()):
            if record.tx_id in in_sync:
                self._persist("own.remove", record.tx_id)
        self.incoming = IncomingQueue(self.durable.own.values())
        self.foreign_bodies.clear()
        self.pending.clear()
        self.asked.clear()
        self.posts.clear()
        self.pushed.clear()
        for record in decision.tail:
            self.synced_from[record.tx_id] = decision.winner
        missing = [r.tx_id for r in decision.tail if r.tx_id not in self.durable.bodies]
        if missing and decision.winner != self.me:
            self._fetch(decision.winner, missing, now)

    def _renegotiate(self: Engine, records: tuple[TxRecord, ...], now: int) -> None:
        """My post-fork transactions the winner lacks come back as new ones (``replay_of``)."""
        for old in records:
            tx_id = self.ids.next(self.wall)
            self._persist("ids", self.ids.last)
            new = TxRecord(tx_id, self.counter.new_timestamp(self.wall), self.me, old.created_ms, old.tx_id)
            self._reserve_counter()
            body = self.durable.bodies[old.tx_id]
            self._persist("own.add", (new, TxBody(tx_id, body.operations)))
            self.incoming.add(new)
            self.acquired_ms[tx_id] = self.wall
            self.out.append(Event("renegotiate", None, {"tx_id": tx_id, "replay_of": old.tx_id}))

    def _restart_execution(self: Engine, decision: RecoveryPlan) -> None:
        """Restore the backup (Simple, or Smart on a loser) or rewind in place, then replay."""
        if decision.restore:
            position = self.executor.restore()
            self.out.append(Event("restore", None, {"position": position}))
        self.executor.rewind(min(self.executor.applied, decision.fork), len(self.sync))
        start = self.executor.applied
        replayed = [r.tx_id for r in self.sync.records(start)]
        if replayed:
            self.out.append(Event("replay", None, {"tx_ids": replayed}))
