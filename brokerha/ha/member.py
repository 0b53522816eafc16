"""One member of a datacenter's HA cluster, sans-I/O: its election, HA core and verification.

``HAMember`` is everything ``node/ha.py`` decides about HA, with the I/O
left to the layer that drives it (``MemberEffects``): the node's asyncio
shell (links, the state file, the AMQP listener) and the simulation
(``ha/simulation``: simulated links, a disk image, a virtual clock) drive
the same object. It owns:

- the ``Election`` (``cluster/election.py``) and carries out its actions:
  ``Persist`` before anything sent after it, ``BecomePrimary``,
  ``BecomeBackup``, ``StopServing``;
- the ``HACore`` (``ha/core.py``): the role's Primary or Backup, positions,
  acknowledgements after durability, the confirm barrier;
- the **verification phase** of a new primary (``primary/verification.py``,
  NEO's VERIFYING): the request to every reachable node, the replies, the
  timeout on ``tick``, the decisions; only then does the primary take the
  joins it held and serve clients (``MemberEffects.serving``);
- the dispatch of every cluster message: replication messages of an epoch
  older than ours are refused (``Error`` OLD_EPOCH), the rest go to the
  election or the role object they are for.

``Unsafe`` breaks a rule of this module on purpose (simulations only).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from brokerha.backup.backup import Backup, LayerReplica
from brokerha.broker.broker import Broker
from brokerha.broker.placement import GroupScope
from brokerha.cluster import election as el
from brokerha.cluster import replication as R
from brokerha.cluster.messages import Error, ErrorCode, Message
from brokerha.cluster.replication import (
    Ack,
    CheckReport,
    Events,
    Join,
    ResourceAlarm,
    TxVote,
    VerifyReply,
    VerifyRequest,
)
from brokerha.cluster.state import NodeState
from brokerha.ha import admission
from brokerha.ha.admission import ClientAdmission
from brokerha.ha.check import CheckRefused, ReplicaCheck, ReplicaChecks
from brokerha.ha.core import Effects, HACore, PrimarySettings
from brokerha.ha.core import Unsafe as CoreUnsafe
from brokerha.primary import verification as verify
from brokerha.primary.backup_alarms import BackupAlarms
from brokerha.primary.primary import Primary
from brokerha.seed_runner import UnsafeRules

log = logging.getLogger("brokerha.ha")

TICK = 0.05  # how often the driver calls ``tick`` (election timers, backup timeouts)

# what only a primary's role objects take; anything of an older epoch is refused
REPLICATION = (Events, Join, Ack, TxVote, VerifyRequest, VerifyReply)


class MemberEffects(Effects, Protocol):
    """What the member asks of its driver, beyond the core's ``Effects``."""

    def persist(self, epoch: int, voted_for: str | None) -> None:
        """Make the election's vote durable now (before anything sent after it)."""

    def reply(self, peer: str, msg_id: int, message: Message) -> None:
        """Answer message ``msg_id`` of ``peer``."""

    def peers_up(self) -> list[str]:
        """The peers whose links are up now."""

    def elected(self, epoch: int, primary: Primary) -> None:
        """We won ``epoch``: a Primary exists and verifies; no client is served yet."""

    def serving(self, epoch: int, decisions: dict[str, str]) -> None:
        """Verification is done (``decisions``: txid -> commit, rollback or in doubt): serve
        clients as the primary of ``epoch``."""

    def demoted(self, reason: str) -> None:
        """We stop being the primary (stepped down or deposed): stop serving clients."""

    def follow(self, primary: str, epoch: int) -> None:
        """We follow ``primary`` (clients of this node are relayed to it)."""


class PrimaryLayer(Protocol):
    """A layer above HA that follows the node's role: the TxLog bridge
    (``txlog/bridge/broker_bridge.py``). Its master's journal goes through the
    primary's log while this node is the primary, and its copy of that journal
    (``replica``) takes the events of the primary this node follows."""

    @property
    def replica(self) -> LayerReplica: ...

    def attach_primary(self, primary: Primary) -> None:
        """This node is the primary: a master started from now on replicates through it."""

    def detach_primary(self) -> None:
        """This node stops being the primary."""


class StoreLayer(PrimaryLayer, Protocol):
    """A ``PrimaryLayer`` whose replicated state is kept in the store: the partition
    table's coordinator (``partition/coordinator.py``). Its ``replica`` takes the event
    kinds ``kinds`` on a backup; the store's sync before each acknowledgement covers
    what it wrote, so it needs no wait of its own (``LayerReplica.after_durable``)."""

    @property
    def kinds(self) -> frozenset[str]: ...


@dataclass(frozen=True)
class Unsafe(UnsafeRules):
    """Rules of the member to break on purpose (simulations only): each must be caught."""

    old_epoch_apply: bool = False  # take replication messages of an epoch older than ours
    # no durability gate: once the role is gone a confirm waits for the local sync alone
    # (with ``admission.Unsafe.lagging_role``: the race of issue 32)
    lagging_role: bool = False


class HAMember:
    def __init__(self, broker: Broker, me: str, members: list[str], state: NodeState,
                 effects: MemberEffects, settings: PrimarySettings, clock: Callable[[], float],
                 *, timing: el.ElectionTiming, verification_timeout: float,
                 rng: random.Random | None = None,
                 primary_factory: Callable[..., Primary] = Primary,
                 unsafe: Unsafe | None = None, core_unsafe: CoreUnsafe | None = None,
                 election_unsafe: el.Unsafe | None = None,
                 admission_unsafe: admission.Unsafe | None = None,
                 layer: PrimaryLayer | None = None,
                 layers: Sequence[StoreLayer] = (),
                 scope: GroupScope | None = None, gate: bool = True,
                 learners: Sequence[str] = ()) -> None:
        self.broker = broker
        self.me = me
        self.effects = effects
        self.layer = layer  # the TxLog bridge, if any
        self.layers = list(layers)  # the partition table's coordinator (node/ha.py)
        self.clock = clock
        self.verification_timeout = verification_timeout
        self.unsafe = unsafe or Unsafe()
        self.election = el.Election(
            me, members, epoch=state.epoch, voted_for=state.voted_for,
            position=el.Position(state.pos_epoch, state.pos_seq),
            vote_floor=el.Position(state.floor_epoch, state.floor_seq),
            timing=timing, rng=rng or random.Random(), unsafe=election_unsafe,
            learners=learners)  # a partition group's learners (partition/moves.py)
        self.core = HACore(broker, me, state, effects, settings, clock,
                           primary_factory=primary_factory, unsafe=core_unsafe, scope=scope)
        self.verification: verify.Verification | None = None
        # ``ctl check-replicas``: the checks this member runs as primary, its reports as a
        # backup (ha/check.py)
        self.checks = ReplicaChecks(broker, me, scope, effects.soon, effects.send, clock,
                                    effects.later)
        # the client connections this node serves, closed in the step that ends the role
        self.clients = ClientAdmission(self.term, later=effects.later, unsafe=admission_unsafe,
                                       role_term=self.role_term)
        self._lapse_scheduled = False
        self._deferred: list[Callable[[], None]] = []  # confirms waiting out a lapse
        # disk alarms: a primary applies its ready backups'; a backup reports its own
        self.backup_alarms = BackupAlarms(broker.set_alarm)
        self._alarms_sent: dict[str, str] | None = None  # None: report at the next tick
        # ``gate`` False: one group of a partitioned node (partition/member.py), whose
        # confirms pass its own gate (``durability_gate``, ``Broker.after_durable_in``)
        if gate and not self.unsafe.lagging_role:
            broker.durability_gate = self  # nothing is confirmed unless ``term`` says so

    def barriers(self) -> list[Callable[[Callable[[], None]], None]]:
        """The replication barriers this member's role installed in the broker (its
        Primary's quorum barrier and the core's position barrier, as its ``Unsafe`` rules
        left them): what a confirm of this group's data waits for beside the local sync
        (``Broker.after_durable_in``)."""
        own = (self.core, self.core.primary)
        return [b for b in self.broker.replication_barriers
                if getattr(b, "__self__", None) in own]

    @property
    def durability_gate(self) -> HAMember | None:
        """The gate a confirm of this group's data passes (``Broker.after_durable_in``):
        this member; none with ``Unsafe.lagging_role`` (the race of issue 32)."""
        return None if self.unsafe.lagging_role else self

    # -- whether this node serves: read at the instant it matters -------------------------

    def term(self) -> int | None:
        """The epoch in which this node serves clients at this instant, or None.

        The serving primary of the election's current epoch: elected, verified
        (phase ``primary``) and within its lease at this clock reading -- a
        primary whose loop stalled past its lease serves nobody, even before
        its tick notices. The broker's durability gate reads it when a confirm
        is asked for and again when it would be released (``Broker.after_durable``),
        the client admission when a connection is handed over.
        """
        term = self.role_term()
        return term if term is not None and self.election.lease_valid(self.clock()) else None

    def lapsed(self) -> int | None:
        """The epoch whose serving primary this node is, its lease lapsed (``Election.lapsed``):
        it serves nobody now and may again in that epoch if its lease is renewed; None
        otherwise. A confirm asked for or due meanwhile waits (``defer``)."""
        term = self.role_term()
        return term if term is not None and self.election.lapsed(self.clock()) else None

    def role_term(self) -> int | None:
        """The epoch whose verified primary this node is, its lease valid or lapsed (``term``
        or ``lapsed``): what the shell opens for."""
        primary = self.core.primary
        if primary is None or self.core.phase != "primary" or primary.epoch != self.election.epoch:
            return None
        return primary.epoch

    def defer(self, release: Callable[[], None]) -> None:
        """Run ``release`` (which reads ``term`` again) once the lease is renewed; dropped,
        never run, if the role ends first."""
        self._deferred.append(release)

    def _run_deferred(self) -> None:
        if self._deferred and self.term() is not None:
            deferred, self._deferred = self._deferred, []
            for release in deferred:
                release()

    def refused(self) -> None:
        """A confirm was refused (neither ``term`` nor ``lapsed`` is its term any more): if
        the election still holds the primary role, its lapse may be over before its tick
        noticed -- tick it at the next turn, which steps it down and closes the
        connection that waits."""
        if not self._lapse_scheduled:
            self._lapse_scheduled = True
            self.effects.soon(self._lapse)

    def _lapse(self) -> None:
        self._lapse_scheduled = False
        if self.election.role == "primary":
            self.carry_out(self.election.tick(self.clock()))

    # -- the role, as the core holds it ---------------------------------------------------

    @property
    def primary(self) -> Primary | None:
        return self.core.primary

    @property
    def backup(self) -> Backup | None:
        return self.core.backup

    @property
    def phase(self) -> str:
        return self.core.phase

    # -- inputs ----------------------------------------------------------------------------

    def start(self) -> None:
        self.carry_out(self.election.start(self.clock()))

    def tick(self) -> None:
        """The driver's periodic tick: election timers, backup timeouts, verification, sends,
        disk alarms."""
        now = self.clock()
        self.carry_out(self.election.tick(now))
        if self.primary is not None:
            self.primary.tick(now)
        self._verification_due()
        self.core.flush()
        self._alarms()

    def peer_up(self, peer: str) -> None:
        if peer == self.core.following:
            self.core.send_join()

    def peer_down(self, peer: str) -> None:
        if self.primary is not None:
            self.backup_alarms.lost(peer)
            self.primary.backup_lost(peer, "link down")
        # our primary died (stand at once), or a backup left the lease (Election.link_down)
        self.carry_out(self.election.link_down(self.clock(), peer))
        self._alarms()

    # -- disk alarms between a primary and its backups -----------------------------------

    def _alarms(self) -> None:
        """A primary blocks its publishers on a ready backup's disk alarm; a backup tells
        its primary its own when they change (and after each join)."""
        primary, backup, following = self.primary, self.backup, self.core.following
        if primary is not None:
            self.backup_alarms.apply(primary.ready_backups())
            return
        if backup is None or following is None:
            return
        alarms = {name: why for name, why in self.broker.alarms.items()
                  if name.split(":", 1)[0] == "disk"}
        if alarms == self._alarms_sent or not self.effects.connected(following):
            return
        self.effects.send(following, ResourceAlarm(backup.epoch, self.me, alarms))
        self._alarms_sent = alarms

    def joined(self) -> None:
        """A join went out: our disk alarms go to the primary again."""
        self._alarms_sent = None

    def status(self) -> dict[str, object]:
        """This member's role as ``ctl status`` shows it."""
        phase = self.phase
        out: dict[str, object] = {
            "role": phase if phase in ("primary", "backup", "joining") else "joining",
            "ready": phase == "primary" or (self.backup is not None and self.backup.caught_up),
            "phase": phase}
        if self.primary is not None:
            out["replication"] = self.primary.status()
        return out

    def on_message(self, peer: str, msg_id: int, msg: Message) -> None:
        """A cluster message from ``peer``, to the election or the role object it is for."""
        if self.primary is not None:
            self.primary.backup_heard(peer, self.clock())
        if isinstance(msg, Error):
            log.warning("node %s: error from %s: %s %s", self.me, peer, msg.code, msg.message)
            return
        if isinstance(msg, ResourceAlarm):
            if self.primary is not None and msg.epoch == self.primary.epoch:
                self.backup_alarms.report(peer, msg.alarms)
                self.backup_alarms.apply(self.primary.ready_backups())
            return
        if isinstance(msg, REPLICATION) and not self.unsafe.old_epoch_apply:
            epoch = msg.epoch
            if epoch < self.election.epoch:
                log.warning("node %s: refused %s from %s of old epoch %d (ours %d)", self.me,
                            type(msg).__name__, peer, epoch, self.election.epoch)
                self.effects.reply(peer, msg_id, Error(
                    ErrorCode.OLD_EPOCH, f"epoch {epoch} is older than {self.election.epoch}"))
                return
        if isinstance(msg, Events | VerifyRequest):
            # any packet of the primary this node follows counts as hearing it, not only
            # its heartbeat (issue 33): a busy link delivers events ahead of the heartbeat
            self.election.heard(self.clock(), peer, msg.epoch)
        if isinstance(msg, Events):
            self.core.on_events(peer, msg)
        elif isinstance(msg, Join):
            if not self.core.on_join(peer, msg_id, msg):
                self.effects.reply(peer, msg_id, Error(
                    ErrorCode.NOT_PRIMARY, f"{self.me} is not the primary of epoch {msg.epoch}"))
        elif isinstance(msg, Ack):
            if self.primary is not None:
                self.primary.backup_acked(peer, msg.seq)
        elif isinstance(msg, TxVote):
            if self.primary is not None and msg.epoch == self.primary.epoch:
                self.primary.tx_vote(peer, msg.txid, msg.ok, msg.reason)
        elif isinstance(msg, VerifyRequest):
            self.effects.reply(peer, msg_id, verify.answer(self.broker, msg, self.me))
        elif isinstance(msg, VerifyReply):
            if self.verification is not None:
                self.verification.receive(msg)
                self._verification_due()
        elif isinstance(msg, CheckReport):
            self.checks.received(peer, msg)
        else:
            self.carry_out(self.election.receive(self.clock(), peer, msg))
            self._run_deferred()
        self.core.flush()

    def promote(self, target: str) -> None:
        """Manual failover to ``target``; ``el.PromoteRefused`` says why it cannot be done."""
        primary = self.primary
        if primary is None or self.phase != "primary":
            raise el.PromoteRefused(f"{self.me} is not the serving primary; ask the primary")
        session = primary.sessions.get(target)
        if session is not None and session.tx_trackers:
            raise el.PromoteRefused(
                f"{target} is blocked by {len(session.tx_trackers)} TxTrackers (prepared "
                "transactions whose outcome has not reached it)")
        self.carry_out(self.election.promote(self.clock(), target))

    def check_replicas(self) -> ReplicaCheck:
        """Check this group's replicas (``ha/check.py``): a ``ck`` in the log, this node's
        report at it and the backups' as they come; ``CheckRefused`` unless serving."""
        primary = self.primary
        if primary is None or self.phase != "primary":
            raise CheckRefused(f"{self.me} is not the serving primary of its group; ask it")
        return self.checks.start(primary, self.election.members)

    # -- the election's actions ------------------------------------------------------------

    def carry_out(self, actions: list[el.Action]) -> None:
        for action in actions:
            if isinstance(action, el.Persist):
                self.effects.persist(action.epoch, action.voted_for)
            elif isinstance(action, el.Send):
                self.effects.send(action.to, action.message)
            elif isinstance(action, el.BecomePrimary):
                self._become_primary(action.epoch)
            elif isinstance(action, el.BecomeBackup):
                self._become_backup(action.epoch, action.primary)
            elif isinstance(action, el.StopServing):
                log.warning("node %s stops serving clients: %s", self.me, action.reason)
                self._demote(action.reason)

    def _become_primary(self, epoch: int) -> None:
        log.warning("node %s elected primary for epoch %d; verifying", self.me, epoch)
        primary = self.core.become_primary(epoch)
        if self.layer is not None:
            self.layer.attach_primary(primary)
        for layer in self.layers:
            layer.attach_primary(primary)
        self.effects.elected(epoch, primary)
        self._verify(epoch)

    def _demote(self, reason: str) -> None:
        """One step: the role ends and every client connection of it is closed (320)."""
        self.verification = None
        if self.layer is not None and self.primary is not None:
            self.layer.detach_primary()
        if self.primary is not None:
            for layer in self.layers:
                layer.detach_primary()
        self.effects.demoted(reason)
        self._deferred.clear()  # never answered: their connections close below
        self.core.demote()
        self.backup_alarms.clear()
        closed = self.clients.close()
        if closed:
            log.warning("node %s closed %d client connections with the primary role", self.me,
                        len(closed))

    def _become_backup(self, epoch: int, primary: str) -> None:
        if self.primary is not None:
            log.warning("node %s deposed: %s is primary for epoch %d", self.me, primary, epoch)
            self._demote(f"deposed by {primary} (epoch {epoch})")
        self.effects.follow(primary, epoch)
        self.core.become_backup(epoch, primary,
                                None if self.layer is None else self.layer.replica,
                                {R.CHECK: self.checks.replica(lambda: self.core.backup, primary,
                                                              epoch),
                                 **{kind: layer.replica for layer in self.layers
                                    for kind in layer.kinds}})

    # -- verification ----------------------------------------------------------------------

    def _verify(self, epoch: int) -> None:
        """Ask every reachable node which of our prepared transactions it committed.

        With nothing prepared, the decisions are made at once (none).
        """
        peers = sorted(self.effects.peers_up())
        scope = self.core.scope  # a partition group's verification: its transactions only
        verification = verify.Verification.start(self.broker, epoch, self.me, peers,
                                                 self.clock(), self.verification_timeout,
                                                 None if scope is None else scope.group)
        request = verification.request()
        if not request.txids:
            verification.asked.clear()
        self.verification = verification
        for peer in sorted(verification.asked):
            self.effects.send(peer, request)
        self._verification_due()

    def _verification_due(self) -> None:
        """Decide, take the held joins and serve once every reply is in or the time is up."""
        verification = self.verification
        if verification is None or not verification.done(self.clock()):
            return
        self.verification = None
        if self.primary is None or self.election.epoch != verification.epoch:
            return
        decisions = verify.carry_out(self.broker, verification)
        if decisions:
            log.warning("node %s verified %d transactions with %d of %d nodes: %s", self.me,
                        len(decisions), len(verification.replies), len(verification.asked),
                        ", ".join(f"{t} {d}" for t, d in sorted(decisions.items())))
        self.core.verified()
        self.effects.serving(verification.epoch, decisions)
