"""Split recovery: the vote that picks the log, and what each strategy does with it.

A vote needs a ballot from *every* configured master (a DC that is gone for
good is removed by a configuration change, not outvoted), and everyone decides
with the same deterministic rule, so everyone adopts the same log and enters
generation g + 1 together.  The strategies (seed 000) differ only in what the
workers do; the log itself is the winner's for every strategy, which keeps
invariant S1 whatever mix of strategies the masters run:

* ``None``   – no backup; workers keep their state and apply the new entries;
* ``Simple`` – backup of the last known good state; *every* master restores it
  and re-executes the resynced log;
* ``Smart``  – as Simple, but masters whose log already is a prefix of the
  winner's keep their state; only the others restore and replay.

A loser's own post-fork transactions that the winner does not hold are
renegotiated as new transactions (new id, ``replay_of`` = the old id).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from brokerha.txlog.engine.config import SplitRecovery
from brokerha.txlog.engine.messages import Ballot
from brokerha.txlog.engine.queues import chain
from brokerha.txlog.engine.records import TxRecord


def digests(ballot: Ballot) -> dict[int, str]:
    """Running hash of the ballot's queue at every length it can vouch for."""
    out = {ballot.offset.length: ballot.offset.digest}
    digest = ballot.offset.digest
    for i, record in enumerate(ballot.records, start=ballot.offset.length + 1):
        digest = chain(digest, record.tx_id)
        out[i] = digest
    return out


def length(ballot: Ballot) -> int:
    return ballot.offset.length + len(ballot.records)


def is_prefix(a: Ballot, b: Ballot, chains: dict[str, dict[int, str]]) -> bool:
    n = length(a)
    return chains[b.master].get(n) == chains[a.master][n]


def common_length(a: Ballot, b: Ballot, chains: dict[str, dict[int, str]]) -> int:
    """Length of the longest common prefix of two ballots' queues."""
    ca, cb = chains[a.master], chains[b.master]
    n = min(length(a), length(b))
    while n > 0 and ca.get(n) != cb.get(n):
        n -= 1
    return n


def choose_winner(ballots: Iterable[Ballot]) -> Ballot:
    """The maximal queue that most queues are prefixes of; then the longer; then smaller ids."""
    ballots = list(ballots)
    chains = {b.master: digests(b) for b in ballots}

    def rank(b: Ballot) -> tuple[int, int, tuple[str, ...]]:
        support = sum(is_prefix(other, b, chains) for other in ballots)
        return (-support, -length(b), tuple(r.tx_id for r in b.records))

    return min(ballots, key=rank)


@dataclass(frozen=True)
class RecoveryPlan:
    """What one master does with the decided vote."""

    winner: str
    fork: int  # common prefix of my queue and the winner's
    tail: tuple[TxRecord, ...]  # winner's entries after the fork
    restore: bool  # restore the backup and replay (else rewind in place)
    renegotiate: tuple[TxRecord, ...]  # my own post-fork txs the winner lacks
    loser: bool


def plan(me: str, ballots: Iterable[Ballot], strategy: SplitRecovery) -> RecoveryPlan:
    ballots = list(ballots)
    chains = {b.master: digests(b) for b in ballots}
    winner = choose_winner(ballots)
    mine = next(b for b in ballots if b.master == me)
    fork = common_length(mine, winner, chains)
    winner_ids = {r.tx_id for r in winner.records} | {
        r.replay_of for r in winner.records if r.replay_of
    }
    start = fork - mine.offset.length
    post_fork = mine.records[start:]
    loser = bool(post_fork)
    renegotiate = tuple(r for r in post_fork if r.origin == me and r.tx_id not in winner_ids)
    restore = strategy is SplitRecovery.SIMPLE or (strategy is SplitRecovery.SMART and loser)
    tail = winner.records[fork - winner.offset.length :]
    return RecoveryPlan(winner.master, fork, tuple(tail), restore, renegotiate, loser)
