"""The asyncio layer of HA in one datacenter: links, timers, disk, and the AMQP listener.

The decisions are made by sans-I/O cores — ``cluster.election.Election``
(who is primary, epochs, leases), ``ha.core.HACore`` (the role's Primary or
Backup, positions, acknowledgements after durability, the confirm barrier),
``primary.primary.Primary`` (what to send each backup, what is replicated)
and ``backup.backup.Backup`` (applying the primary's events). This module
only carries their inputs and outputs:

- packets from ``cluster.link.ClusterLinks`` go to the core they are for;
  every election and replication message is checked against our epoch;
- ``Persist`` actions and backup positions are written to the state file
  (``cluster.state``) before anything that depends on them is sent;
- on ``BecomePrimary`` the node runs the verification phase, registers a
  ``Primary`` with the broker and opens the AMQP listener; on ``BecomeBackup``
  or ``StopServing`` it closes the listener (clients get 320 and move on to
  the next URL) and follows the new primary as a ``Backup``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from brokerha.admin.http import HTTPError, Request, Response
from brokerha.backup.backup import Backup
from brokerha.cluster import election as el
from brokerha.cluster.link import ClusterLinks, links_reload, tls_contexts
from brokerha.cluster.messages import Error, ErrorCode, Message
from brokerha.cluster.replication import (
    Ack,
    Events,
    Join,
    ResourceAlarm,
    TxVote,
    VerifyReply,
    VerifyRequest,
)
from brokerha.cluster.state import StateFile
from brokerha.ha.core import Cancellable, HACore, PrimarySettings, load_position
from brokerha.node.relay import RelayTarget
from brokerha.primary import verification as verify
from brokerha.primary.backup_alarms import BackupAlarms
from brokerha.primary.primary import Primary

if TYPE_CHECKING:
    from brokerha.node.cluster_config import ClusterConfig
    from brokerha.node.server import Node
    from brokerha.txlog.bridge.broker_bridge import TxLogBridge

log = logging.getLogger("brokerha.ha")

TICK = 0.05
FAILOVER_HISTORY = 20


def _log_failure(exc: BaseException | None) -> None:
    if exc is not None:
        log.error("HA task failed: %s", exc)


class HANode:
    def __init__(self, node: Node, cluster: ClusterConfig) -> None:
        self.node = node
        self.broker = node.broker
        self.cluster = cluster
        self.me = node.config.name
        self.member = cluster.member(self.me)
        self.state = StateFile(node.config.data_dir)
        load_position(self.broker, self.state.state)
        st = self.state.state
        self.election = el.Election(
            self.me, [m.name for m in cluster.members], epoch=st.epoch,
            voted_for=st.voted_for, position=el.Position(st.pos_epoch, st.pos_seq),
            vote_floor=el.Position(st.floor_epoch, st.floor_seq),
            timing=el.ElectionTiming(cluster.heartbeat_interval, cluster.lease_timeout,
                                     cluster.election_timeout),
            rng=random.Random())
        ssl_server = ssl_client = None
        if cluster.tls is not None:
            ssl_server, ssl_client = tls_contexts(cluster.tls.cert, cluster.tls.key, cluster.tls.ca)
        self.links = ClusterLinks(
            cluster.name, self.me,
            {m.name: m.cluster for m in cluster.members if m.name != self.me},
            self.member.cluster_bind or self.member.cluster, cluster.secret, self._on_message, self._on_peer_up,
            self._on_peer_down, ssl_server=ssl_server, ssl_client=ssl_client)
        if cluster.tls is not None:
            node.tls.on_reload("[cluster.tls]", links_reload(
                cluster.tls.cert, cluster.tls.key, cluster.tls.ca, lambda: self.links))
        self.failovers: list[dict[str, Any]] = []
        self.core = HACore(
            self.broker, self.me, st, self,
            PrimarySettings(len(cluster.members), cluster.backup_timeout, cluster.replicate,
                            tuple(cluster.policies), cluster.tx_prepare_timeout),
            self._now)
        self._ticker: asyncio.Task[None] | None = None
        self._verification: verify.Verification | None = None
        # disk alarms: a primary applies its ready backups'; a backup reports its own
        self.backup_alarms = BackupAlarms(self.broker.set_alarm)
        self._alarms_sent: dict[str, str] | None = None  # None: report at the next tick
        node.admin.route("POST", "/api/promote", self._promote_request, admin=True)

    # -- the core's role objects, and what it asks of this layer (ha.core.Effects) -------

    @property
    def primary(self) -> Primary | None:
        return self.core.primary

    @property
    def backup(self) -> Backup | None:
        return self.core.backup

    @property
    def following(self) -> str | None:
        return self.core.following

    @property
    def phase(self) -> str:
        return self.core.phase

    def send(self, peer: str, message: Message) -> None:
        self.links.send(peer, message)

    def send_many(self, peer: str, messages: Sequence[Message]) -> None:
        self.links.send_many(peer, messages)

    def connected(self, peer: str) -> bool:
        return self.links.connected(peer)

    def position(self, pos: el.Position) -> None:
        self._carry_out(self.election.set_position(pos))

    def soon(self, callback: Any) -> None:
        asyncio.get_running_loop().call_soon(callback)

    def later(self, delay: float, callback: Any) -> Cancellable:
        return asyncio.get_running_loop().call_later(delay, callback)

    def replication_failed(self, reason: str) -> None:
        self.node.exit_code = 1
        self.node.request_stop()

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.links.start()
        log.info("cluster %s: node %s, epoch %d, position (%d, %d); peers %s", self.cluster.name,
                 self.me, self.election.epoch, self.state.state.pos_epoch,
                 self.state.state.pos_seq, ", ".join(self.links.peers))
        self._carry_out(self.election.start(self._now()))
        self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        await self.links.close()

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            try:
                now = self._now()
                self._carry_out(self.election.tick(now))
                if self.primary is not None:
                    self.primary.tick(now)
                    self.backup_alarms.apply(self.primary.ready_backups())
                self._report_alarms()
                self.core.flush()
            except Exception:  # keep the node's timers alive; the log says what broke
                log.exception("HA tick failed")

    # -- election actions ----------------------------------------------------------------

    def _carry_out(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, el.Persist):
                self.state.save(epoch=action.epoch, voted_for=action.voted_for)
            elif isinstance(action, el.Send):
                self.links.send(action.to, action.message)
            elif isinstance(action, el.BecomePrimary):
                self._become_primary(action.epoch)
            elif isinstance(action, el.BecomeBackup):
                self._become_backup(action.epoch, action.primary)
            elif isinstance(action, el.StopServing):
                self._stop_serving(action.reason)

    def _record_failover(self, event: str, **details: Any) -> None:
        self.failovers.append({"at": time.time(), "event": event, **details})
        del self.failovers[:-FAILOVER_HISTORY]

    def _become_primary(self, epoch: int) -> None:
        log.warning("node %s elected primary for epoch %d; verifying", self.me, epoch)
        self._record_failover("elected", node=self.me, epoch=epoch)
        self.node.set_relay_target(None)  # our clients: served here once verified
        primary = self.core.become_primary(epoch)
        if self._txlog is not None:  # the master started later replicates its journal here
            self._txlog.attach_primary(primary)
        self._spawn(self._verify_and_serve(epoch))

    async def _verify_and_serve(self, epoch: int) -> None:
        """NEO's VERIFYING: settle what a failover left half done before serving clients.

        Ask every reachable node which of our prepared transactions it
        committed (``primary.verification``), decide each of them, and only
        then take the backups' joins (held meanwhile, so their catch-up is
        the decided state) and open the AMQP listener.
        """
        if self.election.epoch != epoch or self.primary is None:
            return
        peers = sorted(self.links.peers_up())
        verification = verify.Verification.start(
            self.broker, epoch, self.me, peers, self._now(), self.cluster.verification_timeout)
        self._verification = verification
        request = verification.request()
        if request.txids:
            for peer in peers:
                self.links.send(peer, request)
            while not verification.done(self._now()):
                await asyncio.sleep(TICK / 5)
                if self.election.epoch != epoch or self.primary is None:
                    self._verification = None
                    return
        else:
            verification.asked.clear()
        self._verification = None
        decisions = verify.carry_out(self.broker, verification)
        if decisions:
            log.warning("node %s verified %d transactions with %d of %d nodes: %s", self.me,
                        len(decisions), len(verification.replies), len(verification.asked),
                        ", ".join(f"{t} {d}" for t, d in sorted(decisions.items())))
        self.core.verified()
        if not await self._open_listener(epoch):
            return
        log.warning("node %s is primary (epoch %d): serving AMQP clients on %s:%d", self.me,
                    epoch, *self.member.amqp)

    async def _open_listener(self, epoch: int) -> bool:
        """Open the AMQP listener, retrying while we are this epoch's primary.

        The port can be briefly taken (EADDRINUSE: another socket's ephemeral
        port); giving up would leave a primary that holds its lease and the
        backups but never serves anyone.
        """
        delay = TICK
        while True:
            if self.election.epoch != epoch or self.primary is None or self.phase != "primary":
                return False
            try:
                await self.node.serve_clients(True)
                return True
            except OSError as exc:
                log.error("node %s cannot open its AMQP listener on %s:%d (%s); retrying",
                          self.me, *self.member.amqp, exc)
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    def _demote(self) -> None:
        self._verification = None
        self.node.set_relay_target(None)
        self.backup_alarms.clear()
        if self.primary is not None and self._txlog is not None:
            self._txlog.detach_primary()
        self.core.demote()
        self._spawn(self.node.serve_clients(False))

    def _stop_serving(self, reason: str) -> None:
        log.warning("node %s stops serving clients: %s", self.me, reason)
        self._record_failover("stepped down", node=self.me, reason=reason)
        self._demote()

    def _become_backup(self, epoch: int, primary: str) -> None:
        if self.primary is not None:
            log.warning("node %s deposed: %s is primary for epoch %d", self.me, primary, epoch)
            self._record_failover("deposed", node=self.me, by=primary, epoch=epoch)
            self._demote()
        member = self.cluster.member(primary)  # unchanged: a no-op (set_relay_target)
        self.node.set_relay_target(RelayTarget(member.amqp, member.amqps))
        self.core.become_backup(epoch, primary, self._txlog_replica())

    @property
    def _txlog(self) -> TxLogBridge | None:
        """The node's TxLog bridge (``txlog/bridge/broker_bridge.py``), with ``[txlog]``."""
        return self.node.txlog

    def _txlog_replica(self) -> Any:
        """This node's copy of the DC's TxLog master (``txlog/bridge/replica.py``), with ``[txlog]``."""
        return self._txlog.replica if self._txlog is not None else None

    def joined(self, primary: str, epoch: int) -> None:
        """The core sent a join (ha.core.Effects): our disk alarms go to the primary again."""
        self._alarms_sent = None
        log.info("node %s joining primary %s (epoch %d)", self.me, primary, epoch)

    def _report_alarms(self) -> None:
        """A backup tells its primary its disk alarms when they change (and after a join)."""
        if self.backup is None or self.following is None:
            return
        alarms = {name: why for name, why in self.broker.alarms.items()
                  if name.split(":", 1)[0] == "disk"}
        if alarms == self._alarms_sent or not self.links.connected(self.following):
            return
        self.links.send(self.following, ResourceAlarm(self.backup.epoch, self.me, alarms))
        self._alarms_sent = alarms

    # -- packets -------------------------------------------------------------------------

    def _on_peer_up(self, peer: str) -> None:
        if peer == self.following:
            self.core.send_join()

    def _on_peer_down(self, peer: str) -> None:
        if self.primary is not None:
            self.primary.backup_lost(peer, "link down")
            self.backup_alarms.lost(peer)
            self.backup_alarms.apply(self.primary.ready_backups())
        # our primary died (stand at once), or a backup left the lease (see Election.link_down)
        self._carry_out(self.election.link_down(self._now(), peer))

    def _on_message(self, peer: str, msg_id: int, msg: Message) -> None:
        if isinstance(msg, Error):
            log.warning("node %s: error from %s: %s %s", self.me, peer, msg.code, msg.message)
            return
        epoch = getattr(msg, "epoch", None)
        if isinstance(msg, (Events, Join, Ack, TxVote, VerifyRequest, VerifyReply)):
            if epoch is not None and epoch < self.election.epoch:
                log.warning("node %s: refused %s from %s of old epoch %d (ours %d)", self.me,
                            type(msg).__name__, peer, epoch, self.election.epoch)
                self.links.send(peer, Error(ErrorCode.OLD_EPOCH,
                                            f"epoch {epoch} is older than {self.election.epoch}"),
                                msg_id)
                return
        if isinstance(msg, Events):
            self.core.on_events(peer, msg)
        elif isinstance(msg, Join):
            self._on_join(peer, msg_id, msg)
        elif isinstance(msg, Ack):
            if self.primary is not None:
                self.primary.backup_acked(peer, msg.seq)
        elif isinstance(msg, TxVote):
            if self.primary is not None and msg.epoch == self.primary.epoch:
                self.primary.tx_vote(peer, msg.txid, msg.ok, msg.reason)
        elif isinstance(msg, VerifyRequest):
            self.links.send(peer, verify.answer(self.broker, msg, self.me), msg_id)
        elif isinstance(msg, VerifyReply):
            if self._verification is not None:
                self._verification.receive(msg)
        elif isinstance(msg, ResourceAlarm):
            if self.primary is not None and msg.epoch == self.primary.epoch:
                self.backup_alarms.report(peer, msg.alarms)
                self.backup_alarms.apply(self.primary.ready_backups())
        else:
            self._carry_out(self.election.receive(self._now(), peer, msg))
        self.core.flush()

    def _on_join(self, peer: str, msg_id: int, msg: Join) -> None:
        if not self.core.on_join(peer, msg_id, msg):
            self.links.send(peer, Error(ErrorCode.NOT_PRIMARY,
                                        f"{self.me} is not the primary of epoch {msg.epoch}"),
                            msg_id)

    def _spawn(self, work: Any) -> None:
        self.node._spawn(work, _log_failure)

    def _promote_request(self, request: Request) -> Response:
        target = str(request.json().get("node", ""))
        if self.primary is None or self.phase != "primary":
            raise HTTPError(409, f"{self.me} is not the serving primary; ask the primary")
        if target == self.me:
            return Response.json({"message": f"{self.me} is already the primary"})
        session = self.primary.sessions.get(target)
        if session is not None and session.tx_trackers:
            raise HTTPError(409, f"{target} is blocked by {len(session.tx_trackers)} TxTrackers "
                                 "(prepared transactions whose outcome has not reached it)")
        try:
            actions = self.election.promote(self._now(), target)
        except ValueError as exc:
            raise HTTPError(409, str(exc)) from exc
        log.warning("node %s hands the primary role to %s (operator request)", self.me, target)
        self._record_failover("promote requested", node=target, by=self.me)
        self._carry_out(actions)
        return Response.json({"message": f"{self.me} handed over to {target}; it stands for "
                                         "election now"})

    # -- status --------------------------------------------------------------------------

    def add_status(self, status: dict[str, Any]) -> None:
        me = status["node"]
        st = self.state.state
        role = self.phase if self.phase in ("primary", "backup", "joining") else "joining"
        me.update(role=role, epoch=self.election.epoch, primary=self.election.primary,
                  position=[st.pos_epoch, st.pos_seq],
                  ready=(self.phase == "primary" or (self.backup is not None
                                                     and self.backup.caught_up)),
                  phase=self.phase, peers_up=sorted(self.links.peers_up()))
        if self.primary is not None:
            me["replication"] = self.primary.status()
        status["cluster"] = self.cluster.name
        status["members"] = [{"name": m.name, "amqp_url": m.amqp_url, "admin_url": m.admin_url,
                              "https_url": m.https_url,
                              "amqps_url": None if m.amqps is None
                              else f"amqps://{m.amqps[0]}:{m.amqps[1]}"}
                             for m in self.cluster.members]
        status["failovers"] = list(self.failovers)
