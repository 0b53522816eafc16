"""Who is primary: majority vote, epochs and leases, as a sans-I/O state machine.

Inputs are ``start``, ``tick``, ``receive``, ``heard``, ``link_down``,
``set_position`` and ``promote``, each given the current time ``now`` (seconds,
any monotonic origin); outputs
are actions the caller carries out in order (``Send``, ``Persist``,
``BecomePrimary``, ``BecomeBackup``, ``StopServing``). A ``Persist`` must be
durable before any later action of the same list is carried out.

Rules (etcd-raft's election with pre-vote and check-quorum, in the vocabulary
of docs/ha.md):

- A node's *position* ``(epoch, seq)`` says whose state it holds: the primary
  of ``epoch``, up to that primary's event ``seq``. It is ``INVALID`` while
  the node catches up. Its *vote floor* is the highest valid position it ever
  held; it stays while the node catches up, because the data it acknowledged
  may be confirmed and the vote is what protects it.
- A node stands only with a valid position, after an election timeout
  (randomised in ``[T, 1.5T)``) without hearing a primary. It first asks for
  pre-votes (nothing changes on the voters), and only with a majority of them
  increments its epoch, persists it with its own vote, and asks for votes.
- A voter grants one vote per epoch (persisted before the reply is sent), only
  to a valid candidate at least as advanced as its vote floor, and only if it
  has no evidence of a live primary (stickiness: a node that rejoins after a
  partition cannot depose a healthy primary). Evidence is a primary heard
  within ``election_timeout``, unless the voter's own link to that primary
  has closed since (``link_down``: the kernel closes a dead process's
  sockets, so every backup sees it at once). A vote request marked
  ``transfer`` (manual failover, sent after the primary stopped serving)
  skips the stickiness test. A voter that grants counts the vote as hearing
  a primary.
- A backup whose link to its primary closed stands at once (staggered by
  rank among the others, and retrying every ``heartbeat_interval`` or so
  while the link stays down) instead of after the randomised timeout.
- Every message carries its sender's epoch. A newer epoch is adopted (and
  persisted) before anything else, and a primary that adopts one stops
  serving; an older one is never acted on, and a request from an older epoch
  is answered with ``NewEpoch`` so that its sender learns it is deposed.
- The primary sends ``Heartbeat(stamp=now)`` every ``heartbeat_interval``;
  an acknowledgement echoes the stamp. The primary *serves* while a majority
  (itself included) acknowledged a heartbeat stamped within ``lease_timeout``
  (votes count as stamped when the vote requests were sent); a backup whose
  link closes no longer counts. Once the lease runs out the primary is
  *lapsed*: it serves nobody (a confirm waits, ``Broker.after_durable``),
  keeps its role and its heartbeats, and serves again if a majority
  acknowledges one within ``lapse_timeout`` (``election_timeout``: until then
  a majority that heard it elects nobody else, and it grants no pre-vote or
  vote itself: it is a live primary). Past that, or on a newer
  epoch, it emits ``StopServing`` and becomes ``joining``. So a stall of its
  loop longer than the lease (a slow disk, CPU starvation) pauses its clients
  instead of costing them their connections and the cluster an election
  (issue 33; ``Unsafe.step_down_at_lease_end`` is the old rule).
- Progress, not one tick, is what counts (issue 33): a backup counts any
  packet of its primary's epoch as hearing it (``heard``: replication
  events too, which a busy link delivers ahead of the heartbeat queued behind
  them), and a primary whose own heartbeat goes out more than
  ``LATE_HEARTBEAT`` intervals after the previous one says so (a WARNING,
  rate-limited, and ``heartbeats_late``): its loop was held, and the stall's
  WARNING of ``node/loop_monitor.py`` names by what.

Seen by operators (``status``, ``/metrics``): every campaign this node starts
is counted by why it stood (``CAMPAIGN_REASONS``: ``no_primary`` -- none heard
since it started or lost one; ``election_timeout`` -- its primary silent for
the timeout; ``link_down`` -- its link to its primary closed; ``transfer`` --
a manual failover named it), and every end of its primary role by why
(``STEPDOWN_REASONS``: ``lease_lost`` -- no majority within the lease and the
lapse; ``newer_epoch`` -- deposed; ``links_closed`` -- its links to a majority
closed; ``transfer`` -- it handed the role over). A campaign is counted once,
at its first pre-vote round; the rounds that retry it are ``rounds``.

What a deposed primary can do, and for how long. Safety does not rest on one
node serving at a time: nothing a primary does takes hold without a majority
in its epoch (a confirm or commit-ok needs a majority's acknowledgement,
quorum.py, and a node that adopted a newer epoch acknowledges nothing of the
older one). A new primary may therefore serve before the old lease ran out;
the lease only bounds how long a deposed primary that is still alive keeps
its clients (deliveries it makes then are duplicates; publishes it takes are
never confirmed). The bound: say P serves at time t in epoch e and Q was
elected in a later epoch at time v <= t. P's lease at t rests on a majority
that acknowledged heartbeats stamped after t - lease_timeout; Q's election on
a majority of votes; the two share a node X, which acknowledges nothing of
epoch e once it voted in Q's epoch, at w <= v. So t - lease_timeout < stamp
<= w <= v: a deposed primary serves at most ``lease_timeout`` after its
successor's election (the simulation's invariant (b)). Without a closed link
stickiness still makes X wait ``election_timeout`` after the last heartbeat,
so on a silent failure (a pause, a partition) the old lease ran out before v,
and no two nodes serve at once; the gap ``election_timeout - lease_timeout``
is the allowance for clock-rate drift.

Why a confirmed event survives (quorum.py): it is acknowledged by a majority,
whose vote floors are then at least its position; any later majority holds one
of them, and that voter refuses a less advanced candidate; a node that voted
in a newer epoch acknowledges nothing of the older one (the backup refuses
events from an older epoch).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from brokerha.cluster.messages import Message, packet
from brokerha.cluster.quorum import majority
from brokerha.seed_runner import UnsafeRules

log = logging.getLogger("brokerha.ha")

ROLES = ("joining", "candidate", "primary", "backup")
# why a node stands for election (``Election.elections``), and what its log says
CAMPAIGN_REASONS = ("no_primary", "election_timeout", "link_down", "transfer")
# why a primary stopped being one (``Election.stepdowns``, ``StopServing.cause``)
STEPDOWN_REASONS = ("lease_lost", "newer_epoch", "links_closed", "transfer")
LATE_HEARTBEAT = 2.0      # a heartbeat this many intervals after the previous one is late
LATE_WARNING_EVERY = 5.0  # seconds: at most one WARNING about late heartbeats per this


@dataclass(frozen=True, order=True)
class Position:
    """``(epoch, seq)``: the state of the primary of ``epoch`` up to its event ``seq``."""

    epoch: int
    seq: int

    INVALID: ClassVar[Position]

    @property
    def valid(self) -> bool:
        return self.epoch >= 0

    def __str__(self) -> str:
        return f"({self.epoch}, {self.seq})" if self.valid else "(catching up)"


Position.INVALID = Position(-1, -1)


@dataclass(frozen=True)
class ElectionTiming:
    # measured in docs/benchmarks.md ("Where the failover gap goes"): a SIGKILL is
    # detected by the closed links, a hang (SIGSTOP) by the election timeout
    heartbeat_interval: float = 0.1
    lease_timeout: float = 0.4
    election_timeout: float = 0.6

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.lease_timeout:
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval}) must be positive and "
                             f"below lease_timeout ({self.lease_timeout})")
        if not self.lease_timeout < self.election_timeout:
            raise ValueError(f"lease_timeout ({self.lease_timeout}) must be below election_timeout "
                             f"({self.election_timeout}): otherwise two primaries may serve at once")


# ---- messages (codes 10-29) -------------------------------------------------------------


@packet(10)
class VoteRequest(Message):
    """A candidate asks for a vote in ``epoch`` (for a pre-vote: the epoch it would take)."""

    epoch: int
    candidate: str
    pos_epoch: int
    pos_seq: int
    pre: bool = False
    transfer: bool = False


@packet(11)
class VoteReply(Message):
    """The answer; a granted pre-vote carries the pre-vote's epoch, any other the voter's."""

    epoch: int
    voter: str
    granted: bool
    pre: bool
    pos_epoch: int
    pos_seq: int


@packet(12)
class Heartbeat(Message):
    """The primary's lease ping; ``stamp`` is the primary's own clock, echoed back."""

    epoch: int
    primary: str
    stamp: float


@packet(13)
class HeartbeatAck(Message):
    epoch: int
    node: str
    stamp: float
    pos_epoch: int
    pos_seq: int
    ready: bool


@packet(14)
class TransferPrimary(Message):
    """Manual failover: the primary stopped serving; ``target`` stands once it holds ``pos``."""

    epoch: int
    target: str
    pos_epoch: int
    pos_seq: int


@packet(15)
class NewEpoch(Message):
    """Answer to a request from an older epoch: the sender learns the newer one."""

    epoch: int
    node: str


# ---- actions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    to: str
    message: Message


@dataclass(frozen=True)
class Persist:
    """Make ``epoch`` and ``voted_for`` durable before carrying out any later action."""

    epoch: int
    voted_for: str | None


@dataclass(frozen=True)
class BecomePrimary:
    epoch: int


@dataclass(frozen=True)
class BecomeBackup:
    epoch: int
    primary: str


@dataclass(frozen=True)
class StopServing:
    reason: str      # for the log and the failover history
    cause: str = ""  # one of STEPDOWN_REASONS ("" from callers other than the election)


Action = Send | Persist | BecomePrimary | BecomeBackup | StopServing


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the election to break on purpose (simulations only): each must be caught."""

    invalid_grants: bool = False  # a voter forgets its vote floor (grants by its position)
    no_lease: bool = False        # a primary keeps serving without a majority
    # a primary steps down the moment its lease runs out (no lapse): a stall longer than the
    # lease costs it the role, and its clients (the simulation's stability invariant)
    step_down_at_lease_end: bool = False
    # a lapsed primary grants pre-votes and votes as if no primary were heard (the rule
    # before the seed 141 fix): a node just reconnected to it deposes it with its grant
    grant_while_lapsed: bool = False


class PromoteRefused(ValueError):
    """``promote`` cannot hand over: not the primary, unknown or not-ready target."""


class Election:
    def __init__(self, me: str, members: Sequence[str], *, epoch: int, voted_for: str | None,
                 position: Position, timing: ElectionTiming, rng: random.Random,
                 vote_floor: Position | None = None, unsafe: Unsafe | None = None,
                 learners: Sequence[str] = ()) -> None:
        """``members``: the voters; ``learners``: nodes that follow the primary (its
        heartbeats reach them, they acknowledge) but neither vote nor count for the
        majority nor stand (a partition's new cell, ``partition/moves.py``). ``me`` is one
        or the other; ``reconfigure`` changes both."""
        if me not in members and me not in learners:
            raise ValueError(f"{me} is not one of the members {list(members)}")
        self.me = me
        self.members: tuple[str, ...] = ()
        self.learners: tuple[str, ...] = ()
        self.peers: tuple[str, ...] = ()
        self.voter_peers: tuple[str, ...] = ()
        self.timing = timing
        self.rng = rng
        self.unsafe = unsafe or Unsafe()
        self.voted_for = voted_for
        self.position = position
        self.vote_floor = max(position, vote_floor or Position.INVALID)
        self._epoch = epoch
        self._majority = 1
        self._role = "joining"
        self._primary: str | None = None
        self._now = -math.inf
        self._heard_primary_at = -math.inf
        self._primary_link_down = False  # our link to the last primary heard closed since
        self._fast_rounds = 0  # pre-vote rounds stood since then (each waits twice as long)
        self._deadline = math.inf
        self._votes: set[str] = set()
        self._pre = False
        self._campaign_at = -math.inf
        # primary side
        self._stamps: dict[str, float] = {}
        self._peer_pos: dict[str, Position] = {}
        self._peer_ready: dict[str, tuple[bool, float]] = {}
        self._next_heartbeat = math.inf
        self._lease_expiry = -math.inf
        self._lapse_started: float | None = None  # the lease ran out then; not renewed since
        self.lapses = 0  # leases that ran out and were renewed in time or not (status)
        self.lapses_renewed = 0
        # a manual failover this node is the target of: (position to reach, give up at)
        self._transfer: tuple[Position, float] | None = None
        # seen by operators (status, /metrics): campaigns by why, rounds, step-downs by why
        self.elections = dict.fromkeys(CAMPAIGN_REASONS, 0)
        self.rounds = {"pre_vote": 0, "vote": 0}
        self.last_election: tuple[str, float, int] | None = None  # (reason, at, epoch)
        self.stepdowns = dict.fromkeys(STEPDOWN_REASONS, 0)
        self.last_stepdown: tuple[str, float, int] | None = None
        # the primary's own heartbeats: when the last went out, and how many went out late
        self._heartbeat_sent_at = -math.inf
        self.heartbeats_late = 0
        self.heartbeat_gap_max = 0.0  # the longest time between two heartbeats sent, seconds
        self._late_seen: float = -math.inf  # the heartbeat after which a late one was counted
        self._late_logged_at = -math.inf
        self._late_unlogged = 0  # late heartbeats counted since the last WARNING
        self._configure(members, learners)

    def _configure(self, members: Sequence[str], learners: Sequence[str]) -> None:
        self.members = tuple(dict.fromkeys(members))
        self.learners = tuple(n for n in dict.fromkeys(learners) if n not in self.members)
        self.peers = tuple(m for m in (*self.members, *self.learners) if m != self.me)
        self.voter_peers = tuple(m for m in self.members if m != self.me)
        self._majority = majority(len(self.members))

    @property
    def voter(self) -> bool:
        """One of the voters (else a learner: never stands, grants nothing)."""
        return self.me in self.members

    def reconfigure(self, members: Sequence[str], learners: Sequence[str] = ()) -> list[Action]:
        """The group's voters and learners change (a ``pm`` this node holds, applied when
        appended: Raft's single-server change, ``partition/moves.py``). A primary's lease
        is then counted over the new voters at once; a candidate that is no voter any more
        stops campaigning; a primary that is no voter any more steps down (its change
        hands over first, so only an unsafe change gets here)."""
        if self.me not in members and self.me not in learners:
            raise ValueError(f"{self.me} is in neither {list(members)} nor {list(learners)}")
        self._configure(members, learners)
        voters = set(self.voter_peers)
        # a learner's stamps are kept (a learner made a voter renews the lease at once)
        self._stamps = {n: s for n, s in self._stamps.items() if n in self.peers}
        self._votes = {n for n in self._votes if n in voters or n == self.me}
        if self._role == "primary":
            if not self.voter:
                return self._stop(self._now, "no longer a voter of its group", "transfer")
            self._update_lease()
        elif self._role == "candidate" and not self.voter:
            self._role, self._pre, self._votes = "joining", False, set()
        return []

    # ---- properties ---------------------------------------------------------------------

    @property
    def role(self) -> str:
        return self._role

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def primary(self) -> str | None:
        return self._primary

    @property
    def serving(self) -> bool:
        """A primary holding a valid lease as of the latest input (see ``lease_valid``)."""
        return self.lease_valid(self._now)

    def lease_valid(self, now: float) -> bool:
        """Check this before serving a client: a paused primary may not have ticked yet."""
        return self._role == "primary" and now < self._lease_expiry

    @property
    def ready(self) -> bool:
        """Holds a consistent copy of the current primary's state."""
        return self.position.valid and self.position.epoch == self._epoch

    def lapsed(self, now: float) -> bool:
        """A primary whose lease ran out and that has not stepped down (yet): it serves
        nobody, keeps its role, and serves again if a majority acknowledges a heartbeat
        within ``lapse_timeout`` (see ``tick``)."""
        return self._role == "primary" and now >= self._lease_expiry

    @property
    def lapse_timeout(self) -> float:
        """How long a lapsed primary waits for its lease to be renewed before it steps down.

        ``election_timeout``: until then a majority that still hears it will not
        elect anybody else (stickiness), so waiting costs nothing but the time its
        clients wait; after it, somebody may have been elected.
        """
        return 0.0 if self.unsafe.step_down_at_lease_end else self.timing.election_timeout

    @property
    def last_heartbeat(self) -> float:
        """When this primary's last heartbeat went out (-inf: none in this role)."""
        return self._heartbeat_sent_at

    def heartbeat_now(self, now: float) -> list[Action]:
        """A primary's heartbeat now, ahead of its schedule (the next one an interval
        later); nothing for another role. A partitioned node beats every group it leads
        in the tick one of them is due, so that one bundle carries them all
        (``partition/member.py``, ``partition/mux.py``). Early is safe: a heartbeat only
        ever renews the lease from its own stamp."""
        if self._role != "primary":
            return []
        self._now = now
        return self._heartbeats(now)

    def wakeup_at(self) -> float:
        """When ``tick`` next has something to do."""
        if self._role == "primary":
            end = self._lease_expiry
            if end < self._now:  # lapsed: the step-down
                end += self.lapse_timeout
            return min(self._next_heartbeat, end)
        if self._transfer is not None:
            return min(self._deadline, self._transfer[1])
        return self._deadline

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "node": self.me, "role": self._role, "epoch": self._epoch,
            "primary": self._primary, "voted_for": self.voted_for,
            "serving": self.serving, "ready": self.ready,
            "position": [self.position.epoch, self.position.seq],
            "vote_floor": [self.vote_floor.epoch, self.vote_floor.seq],
        }
        if self._role == "primary":
            remaining = self._lease_expiry - self._now
            out["lease_remaining"] = None if remaining == math.inf else round(max(0.0, remaining), 3)
            out["lapsed"] = self._now >= self._lease_expiry
        out["lapses"] = self.lapses
        out["lapses_renewed"] = self.lapses_renewed
        out["elections"] = dict(self.elections)
        out["rounds"] = dict(self.rounds)
        out["last_election"] = _event(self.last_election)
        out["stepdowns"] = dict(self.stepdowns)
        out["last_stepdown"] = _event(self.last_stepdown)
        out["heartbeats_late"] = self.heartbeats_late
        out["heartbeat_gap_max"] = round(self.heartbeat_gap_max, 3)
        if self._role == "primary":
            out["backups"] = {
                peer: {"position": [p.epoch, p.seq], "ready": self._peer_ready[peer][0],
                       "last_ack_ago": round(self._now - self._peer_ready[peer][1], 3)}
                for peer, p in self._peer_pos.items()}
        return out

    # ---- inputs -------------------------------------------------------------------------

    def start(self, now: float, delay: float = 0.0) -> list[Action]:
        """The first campaign no sooner than the election timeout (and ``delay`` more: a
        partition's preferred leader stands first, ``PartitionedMember``)."""
        self._now = now
        self._deadline = now + self._timeout() + delay
        return []

    def tick(self, now: float) -> list[Action]:
        self._now = now
        if self._role == "primary":
            self._check_late(now)
            if now >= self._lease_expiry + self.lapse_timeout:
                return self._stop(now, f"no majority heard within {self.timing.lease_timeout}s "
                                  f"(and {self.lapse_timeout}s more)", "lease_lost")
            if now >= self._lease_expiry and self._lapse_started is None:
                self._lapse_started = now
                self.lapses += 1
            if now >= self._next_heartbeat:
                return self._heartbeats(now)
            return []
        if self._transfer is not None:
            actions = self._transfer_ready(now)
            if actions:
                return actions
        if now < self._deadline:
            return []
        if not self.position.valid or not self.voter:
            self._deadline = now + self._timeout()  # catching up, or a learner: never stand
            return []
        if self._role != "candidate":  # a new campaign; a candidate's is retried
            self._count_election(now, self._why_stand())
        return self._pre_vote(now)

    def set_position(self, pos: Position) -> list[Action]:
        """From the replication layer: the state this node now holds (INVALID while catching up).

        Returns the actions of a pending manual failover this position completes.
        """
        self.position = pos
        if pos > self.vote_floor:
            self.vote_floor = pos
        if self._transfer is not None:
            return self._transfer_ready(self._now)
        return []

    def receive(self, now: float, sender: str, msg: Message) -> list[Action]:
        self._now = now
        if sender == self.me or (sender not in self.members and sender not in self.learners):
            return []
        if self._role == "primary":
            self._check_late(now)
        if self._role == "primary" and now >= self._lease_expiry + self.lapse_timeout:
            # past the lapse: stepped down before anything else is read (a late ack
            # renews nothing; somebody else may have been elected meanwhile)
            return self._stop(now, f"no majority heard within {self.timing.lease_timeout}s "
                              f"(and {self.lapse_timeout}s more)",
                              "lease_lost") + self.receive(now, sender, msg)
        if isinstance(msg, VoteRequest):
            return self._on_vote_request(now, sender, msg)
        if isinstance(msg, VoteReply) and msg.pre and msg.granted:
            return self._on_pre_vote(now, sender, msg)
        epoch = getattr(msg, "epoch", None)
        if not isinstance(epoch, int):
            return []
        if epoch < self._epoch:
            return self._answer_old(sender, msg)
        actions = self._adopt(now, epoch) if epoch > self._epoch else []
        if isinstance(msg, Heartbeat):
            actions += self._on_heartbeat(now, sender, msg)
        elif isinstance(msg, HeartbeatAck):
            self._on_heartbeat_ack(now, sender, msg)
        elif isinstance(msg, VoteReply):
            actions += self._on_vote(now, sender, msg)
        elif isinstance(msg, TransferPrimary):
            actions += self._on_transfer(now, sender, msg)
        return actions

    def promote(self, now: float, target: str) -> list[Action]:
        """Manual failover: stop serving and tell a ready ``target`` to stand at once."""
        self._now = now
        if self._role != "primary":
            raise PromoteRefused(f"{self.me} is not the primary (role {self._role}, "
                                 f"primary {self._primary or 'unknown'})")
        if target not in self.members:  # a learner may not be handed the role
            raise PromoteRefused(f"{target!r} is not a member ({', '.join(self.members)})")
        if target == self.me:
            raise PromoteRefused(f"{self.me} is already the primary")
        ready, seen = self._peer_ready.get(target, (False, -math.inf))
        if not ready or now - seen > self.timing.lease_timeout:
            raise PromoteRefused(f"{target} is not a ready backup (last heard "
                                 f"{'never' if seen == -math.inf else f'{now - seen:.1f}s ago'}, "
                                 f"ready {ready})")
        actions = self._stop(now, f"handing the primary role over to {target}", "transfer")
        pos = self.position
        actions.append(Send(target, TransferPrimary(self._epoch, target, pos.epoch, pos.seq)))
        return actions

    # ---- voting -------------------------------------------------------------------------

    def _on_vote_request(self, now: float, sender: str, msg: VoteRequest) -> list[Action]:
        if msg.candidate != sender:
            return []
        if sender not in self.voter_peers or not self.voter:
            # a learner grants nothing, and nobody grants a learner
            return [Send(sender, VoteReply(self._epoch, self.me, False, msg.pre,
                                           self.position.epoch, self.position.seq))]
        cand = Position(msg.pos_epoch, msg.pos_seq)
        if msg.pre:
            granted = (msg.epoch > self._epoch and self._may_vote_for(cand)
                       and not self._heard_primary(now))
            reply = VoteReply(msg.epoch if granted else self._epoch, self.me, granted, True,
                              self.position.epoch, self.position.seq)
            return [Send(sender, reply)]
        if (msg.epoch > self._epoch and self._heard_primary(now)
                and not (msg.transfer and self._role != "primary")):
            return []  # stickiness: a live primary is not deposed (not even its epoch)
        if msg.epoch < self._epoch:
            return [Send(sender, VoteReply(self._epoch, self.me, False, False,
                                           self.position.epoch, self.position.seq))]
        actions: list[Action] = []
        persist = False
        if msg.epoch > self._epoch:
            actions += self._adopt(now, msg.epoch, persist=False)
            persist = True
        granted = self.voted_for in (None, sender) and self._may_vote_for(cand)
        if granted:
            persist = persist or self.voted_for is None
            self.voted_for = sender
            self._heard_primary_at = now
            self._primary_link_down = False
            self._deadline = now + self._timeout()
        if persist:
            actions.append(Persist(self._epoch, self.voted_for))
        actions.append(Send(sender, VoteReply(self._epoch, self.me, granted, False,
                                              self.position.epoch, self.position.seq)))
        return actions

    def _may_vote_for(self, cand: Position) -> bool:
        if self.unsafe.invalid_grants:
            return cand.valid and cand >= self.position
        return cand.valid and cand >= self.vote_floor

    def _heard_primary(self, now: float) -> bool:
        """Evidence of a live primary (stickiness): a primary heard lately whose link still stands.

        A primary is its own evidence for as long as it keeps the role, its lapse included
        (a lease that ran out less than ``lapse_timeout`` ago): the lapse waits for a
        majority's acknowledgement on the promise that a majority hearing it elects nobody
        else, and the primary is one of that majority. Granting a pre-vote while lapsed
        let a node whose link to it had just come back win a majority of two with the
        primary's own grant (the remote-consume simulation's seed 141, docs/ha.md). Past
        the lapse ``receive`` and ``tick`` step it down first, and it grants as any node.
        """
        if self._role == "primary":
            return not self.unsafe.grant_while_lapsed or self.lease_valid(now)
        if self._primary_link_down:
            return False
        return now - self._heard_primary_at < self.timing.election_timeout

    def _why_stand(self) -> str:
        """Why this node starts a campaign now (one of ``CAMPAIGN_REASONS``)."""
        if self._primary_link_down:
            return "link_down"
        if self._role == "backup":
            return "election_timeout"
        return "no_primary"

    def _count_election(self, now: float, reason: str) -> None:
        self.elections[reason] += 1
        self.last_election = (reason, now, self._epoch + 1)
        primary = self._primary
        if reason == "link_down":
            why = f"its link to primary {primary} closed"
        elif reason == "election_timeout":
            why = (f"nothing heard from primary {primary} for "
                   f"{now - self._heard_primary_at:.3f}s (election_timeout "
                   f"{self.timing.election_timeout}s)")
        elif reason == "transfer":
            why = "a manual failover names it"
        else:
            why = "no primary heard since it started or last lost one"
        log.warning("node %s stands for election (%s: %s); position %s, asks for epoch %d",
                    self.me, reason, why, self.position, self._epoch + 1)

    def _count_stepdown(self, now: float, cause: str) -> None:
        self.stepdowns[cause] += 1
        self.last_stepdown = (cause, now, self._epoch)

    def _pre_vote(self, now: float) -> list[Action]:
        self.rounds["pre_vote"] += 1
        self._role, self._primary, self._pre = "candidate", None, True
        self._votes = {self.me}
        self._deadline = now + self._timeout()
        if self._primary_link_down:
            self._fast_rounds += 1
        log.debug("node %s: pre-vote round %d for epoch %d", self.me, self.rounds["pre_vote"],
                  self._epoch + 1)
        if len(self._votes) >= self._majority:
            return self._campaign(now)
        pos = self.position
        request = VoteRequest(self._epoch + 1, self.me, pos.epoch, pos.seq, True, False)
        return [Send(peer, request) for peer in self.voter_peers]

    def _on_pre_vote(self, now: float, sender: str, msg: VoteReply) -> list[Action]:
        if self._role != "candidate" or not self._pre or msg.epoch != self._epoch + 1:
            return []
        if not self.position.valid:
            return []  # catching up since the round went out: never stand (tick retries)
        if sender not in self.voter_peers or not self.voter:
            return []
        self._votes.add(sender)
        return self._campaign(now) if len(self._votes) >= self._majority else []

    def _campaign(self, now: float, transfer: bool = False) -> list[Action]:
        self.rounds["vote"] += 1
        self._epoch += 1
        self.voted_for = self.me
        self._transfer = None
        self._role, self._primary, self._pre = "candidate", None, False
        self._votes = {self.me}
        self._campaign_at = now
        self._deadline = now + self._timeout()
        actions: list[Action] = [Persist(self._epoch, self.me)]
        if len(self._votes) >= self._majority:
            return actions + self._become_primary(now)
        pos = self.position
        request = VoteRequest(self._epoch, self.me, pos.epoch, pos.seq, False, transfer)
        return actions + [Send(peer, request) for peer in self.voter_peers]

    def _on_vote(self, now: float, sender: str, msg: VoteReply) -> list[Action]:
        if self._role != "candidate" or self._pre or not msg.granted or msg.pre:
            return []
        if sender not in self.voter_peers:
            return []
        self._votes.add(sender)
        return self._become_primary(now) if len(self._votes) >= self._majority else []

    # ---- epochs -------------------------------------------------------------------------

    def _adopt(self, now: float, epoch: int, persist: bool = True) -> list[Action]:
        actions: list[Action] = []
        if self._role == "primary":
            self._count_stepdown(now, "newer_epoch")
            actions.append(StopServing(f"deposed: a node is in epoch {epoch}", "newer_epoch"))
            self._deadline = now + self._timeout()
        self._epoch, self.voted_for = epoch, None
        self._role, self._primary, self._pre = "joining", None, False
        self._votes = set()
        self._transfer = None
        self._lease_expiry = -math.inf
        if persist:
            actions.append(Persist(epoch, None))
        return actions

    def _answer_old(self, sender: str, msg: Message) -> list[Action]:
        if isinstance(msg, Heartbeat | TransferPrimary):
            return [Send(sender, NewEpoch(self._epoch, self.me))]
        return []

    # ---- primary ------------------------------------------------------------------------

    def _become_primary(self, now: float) -> list[Action]:
        self._role, self._primary = "primary", self.me
        self._primary_link_down = False
        self._votes.discard(self.me)
        self._stamps = {voter: self._campaign_at for voter in self._votes}
        self._peer_pos, self._peer_ready = {}, {}
        self._heartbeat_sent_at = -math.inf  # gaps are measured within one role
        self._update_lease()
        self.set_position(Position(self._epoch, 0))  # a primary numbers its events from 0
        return [BecomePrimary(self._epoch), *self._heartbeats(now)]

    def _heartbeats(self, now: float) -> list[Action]:
        gap = now - self._heartbeat_sent_at
        if gap < math.inf:
            self.heartbeat_gap_max = max(self.heartbeat_gap_max, gap)
        self._heartbeat_sent_at = now
        self._next_heartbeat = now + self.timing.heartbeat_interval
        beat = Heartbeat(self._epoch, self.me, now)
        return [Send(peer, beat) for peer in self.peers]

    def _on_heartbeat_ack(self, now: float, sender: str, msg: HeartbeatAck) -> None:
        if self._role != "primary" or msg.node != sender:
            return
        if msg.stamp > self._stamps.get(sender, -math.inf):
            self._stamps[sender] = msg.stamp  # a learner's too: counted once it votes
            self._update_lease()
            if self._lapse_started is not None and now < self._lease_expiry:
                self._lapse_started = None  # renewed within the lapse: serving again
                self.lapses_renewed += 1
        self._peer_pos[sender] = Position(msg.pos_epoch, msg.pos_seq)
        self._peer_ready[sender] = (bool(msg.ready), now)

    def _update_lease(self) -> None:
        need = self._majority - 1
        if need <= 0 or self.unsafe.no_lease:
            self._lease_expiry = math.inf
            return
        stamps = sorted((s for n, s in self._stamps.items() if n in self.voter_peers),
                        reverse=True)
        self._lease_expiry = (stamps[need - 1] + self.timing.lease_timeout
                              if len(stamps) >= need else -math.inf)

    def _stop(self, now: float, reason: str, cause: str) -> list[Action]:
        self._count_stepdown(now, cause)
        self._lapse_started = None
        self._role, self._primary = "joining", None
        self._lease_expiry = -math.inf
        self._next_heartbeat = math.inf
        self._heartbeat_sent_at = -math.inf
        self._deadline = now + self._timeout()
        return [StopServing(reason, cause)]

    def _check_late(self, now: float) -> None:
        """Count (and log, rate-limited) a heartbeat overdue by more than ``LATE_HEARTBEAT``
        intervals: the primary's loop was held (etcd warns the same way). Once per gap
        between two heartbeats sent, however many inputs arrive in it."""
        gap = now - self._heartbeat_sent_at
        interval = self.timing.heartbeat_interval
        if gap <= LATE_HEARTBEAT * interval or self._late_seen == self._heartbeat_sent_at:
            return
        self._late_seen = self._heartbeat_sent_at
        self.heartbeats_late += 1
        self._late_unlogged += 1
        if now - self._late_logged_at < LATE_WARNING_EVERY:
            return
        lease = ("its lease lapsed: it serves nobody until a majority acknowledges again"
                 if now >= self._lease_expiry else "its lease held")
        more = (f"; {self._late_unlogged - 1} more late since the last warning"
                if self._late_unlogged > 1 else "")
        log.warning("node %s (primary, epoch %d): heartbeat %.3fs late (%.3fs since the last "
                    "one, due every %gs): its event loop was held (the 'event loop stalled' "
                    "warning names by what); %s%s", self.me, self._epoch, gap - interval, gap,
                    interval, lease, more)
        self._late_logged_at = now
        self._late_unlogged = 0

    # ---- following ----------------------------------------------------------------------

    def _on_heartbeat(self, now: float, sender: str, msg: Heartbeat) -> list[Action]:
        if self._role == "primary" or msg.primary != sender:
            return []
        self._heard_primary_at = now
        self._primary_link_down = False
        self._deadline = now + self._timeout()
        actions: list[Action] = []
        if self._role != "backup" or self._primary != sender:
            self._role, self._primary, self._pre = "backup", sender, False
            self._votes = set()
            actions.append(BecomeBackup(self._epoch, sender))
        pos = self.position
        actions.append(Send(sender, HeartbeatAck(self._epoch, self.me, msg.stamp, pos.epoch,
                                                 pos.seq, self.ready)))
        return actions

    def heard(self, now: float, sender: str, epoch: int) -> None:
        """Any packet from ``sender`` of ``epoch`` (replication ``Events``, a verification
        request), not only its heartbeat: if it is the primary this backup follows, in
        this epoch, it is alive and its loop makes progress.

        A busy link delivers replication events ahead of the heartbeat queued
        behind them; they are as good evidence of a live primary (stickiness,
        the election timeout) as the heartbeat itself. Nothing else changes:
        the heartbeat alone is acknowledged, so the primary's lease still rests
        on its own stamps.
        """
        self._now = now
        if self._role != "backup" or sender != self._primary or epoch != self._epoch:
            return
        self._heard_primary_at = now
        self._primary_link_down = False
        self._deadline = now + self._timeout()

    def link_down(self, now: float, peer: str) -> list[Action]:
        """The cluster link to ``peer`` closed (its process died, or the connection broke).

        On a backup whose primary that is: the primary most likely died
        (SIGKILL, a crash: the kernel closes its sockets, and every backup
        sees it at once). The link was the evidence of a live primary, so this
        node now grants votes without the stickiness wait, and stands itself
        at once, staggered by rank among the other members (half a heartbeat
        interval apart) so that two backups do not split the vote. A less
        advanced backup that stands first is refused (vote floor) and the
        next one wins a moment later; a pre-vote refused by a voter that has
        not seen its own link close yet is retried after about a heartbeat
        interval. If only this link broke and the primary lives, the other
        voters still hear it and refuse, and its next heartbeat (over the
        redialled link) makes this node a backup again.

        On the primary: that backup's acknowledgements no longer hold up the
        lease; a primary whose links to a majority all closed stops serving
        at once instead of at the end of its lease. One link closing while
        the others still make a majority never does, even during a lapse (a
        stall longer than the lease): the lapse is renewed by the backups
        still linked, or ends as any lapse does.
        """
        if self._role == "primary":
            if self._stamps.pop(peer, None) is None:
                return []
            self._update_lease()
            if sum(n in self.voter_peers for n in self._stamps) < self._majority - 1:
                return self._stop(now, "the cluster links to a majority closed", "links_closed")
            return []  # lapsed or not: the lapse's own rule decides (tick)
        if self._role != "backup" or peer != self._primary:
            return []
        self._primary_link_down = True
        self._fast_rounds = 0
        if not self.voter:
            return []  # a learner never stands
        others = sorted(m for m in self.members if m != peer)
        rank = others.index(self.me)
        self._deadline = min(self._deadline, now + rank * self.timing.heartbeat_interval / 2)
        return []

    def _on_transfer(self, now: float, sender: str, msg: TransferPrimary) -> list[Action]:
        if msg.target != self.me or self._role == "primary" or self._primary not in (None, sender):
            return []
        self._transfer = (Position(msg.pos_epoch, msg.pos_seq),
                          now + self.timing.election_timeout)
        return self._transfer_ready(now)

    def _transfer_ready(self, now: float) -> list[Action]:
        assert self._transfer is not None
        needed, give_up = self._transfer
        if now >= give_up:
            self._transfer = None
            return []
        if not self.position.valid or self.position < needed:
            return []
        self._transfer = None
        self._count_election(now, "transfer")
        return self._campaign(now, transfer=True)

    def _timeout(self) -> float:
        """The randomised wait before standing (again): ``[T, 1.5T)``.

        ``T`` is ``election_timeout``; while our link to the last primary is
        down, ``heartbeat_interval`` doubled for each pre-vote round stood since
        (up to ``election_timeout``): a refused pre-vote or a split vote is
        retried soon, and a backup cut off from a healthy primary (the others
        refuse it) soon asks no more often than it would anyway.
        """
        t = self.timing.election_timeout
        if self._primary_link_down:
            t = min(t, self.timing.heartbeat_interval * 2 ** min(self._fast_rounds, 16))
        return t + self.rng.random() * t / 2


def _event(event: tuple[str, float, int] | None) -> dict[str, Any] | None:
    """A counted election or step-down as ``status`` shows it (``at`` on the election's clock)."""
    if event is None:
        return None
    reason, at, epoch = event
    return {"reason": reason, "at": at, "epoch": epoch}
