"""The asyncio layer of HA in one datacenter: links, timers, disk, and the AMQP listener.

The decisions are made by sans-I/O cores — ``cluster.election.Election``
(who is primary, epochs, leases), ``primary.primary.Primary`` (what to send
each backup, what is replicated) and ``backup.backup.Backup`` (applying the
primary's events). This module only carries their inputs and outputs:

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
import json
import logging
import random
import time
from typing import TYPE_CHECKING, Any

from brokerha.admin.http import HTTPError, Request, Response
from brokerha.backup.backup import Backup
from brokerha.cluster import election as el
from brokerha.cluster.link import ClusterLinks, links_reload, tls_contexts
from brokerha.cluster.messages import Error, ErrorCode, Message
from brokerha.cluster.replication import (
    Ack,
    ConfigurationMismatch,
    Events,
    Join,
    ResourceAlarm,
    TxVote,
    VerifyReply,
    VerifyRequest,
)
from brokerha.cluster.state import StateFile
from brokerha.node.relay import RelayTarget
from brokerha.primary import verification as verify
from brokerha.primary.backup_alarms import BackupAlarms
from brokerha.primary.primary import Primary

if TYPE_CHECKING:
    from brokerha.node.cluster_config import ClusterConfig
    from brokerha.node.server import Node

log = logging.getLogger("brokerha.ha")

# A backup acknowledges replicated dequeues, which nobody waits for, at most this
# much later (or with the next event that needs a prompt ack); until then their
# store writes need no disk sync of their own (Backup.take_ack_due).
DEQUEUE_ACK_DELAY = 0.01

TICK = 0.05
POSITION_KEY = "ha_position"  # [pos_epoch, pos_seq, floor_epoch, floor_seq] in the store
FAILOVER_HISTORY = 20


class HANode:
    def __init__(self, node: Node, cluster: ClusterConfig) -> None:
        self.node = node
        self.broker = node.broker
        self.cluster = cluster
        self.me = node.config.name
        self.member = cluster.member(self.me)
        self.state = StateFile(node.config.data_dir)
        self._load_position()
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
        self.primary: Primary | None = None
        self.backup: Backup | None = None
        self.following: str | None = None  # the primary this backup joined
        self.phase = "joining"              # joining | backup | verifying | primary
        self.failovers: list[dict[str, Any]] = []
        self._ack_pending: Backup | None = None  # the Backup whose ack waits for the disk
        self._deferred_ack: asyncio.TimerHandle | None = None  # dequeues only (Backup.ack_due)
        self._flush_scheduled = False
        self._durable_seq = 0               # the primary's own durable position
        self._durable_waiters: list[Any] = []
        self._position_scheduled = False
        # the position goes into the store batch of the events it covers (see _position_due)
        self.broker.store.before_batch(self._position_due)
        self._ticker: asyncio.Task[None] | None = None
        self._verification: verify.Verification | None = None
        self._pending_joins: dict[str, tuple[int, Join]] = {}  # held while verifying
        # disk alarms: a primary applies its ready backups'; a backup reports its own
        self.backup_alarms = BackupAlarms(self.broker.set_alarm)
        self._alarms_sent: dict[str, str] | None = None  # None: report at the next tick
        node.admin.route("POST", "/api/promote", self._promote_request, admin=True)

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
                self._flush()
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
        if self.backup is not None:
            self.backup.close()
        self.backup, self.following = None, None
        self.node.set_relay_target(None)  # our clients: served here once verified
        self.phase = "verifying"
        self._record_position(epoch, 0)
        self._durable_seq = 0
        self._set_position(el.Position(epoch, 0))
        self.primary = Primary(self.broker, me=self.me, members=len(self.cluster.members),
                               epoch=epoch, start_seq=0, clock=self._now,
                               backup_timeout=self.cluster.backup_timeout,
                               replicate=self.cluster.replicate,
                               policies=self.cluster.policies,
                               on_output=self._schedule_flush,
                               tx_prepare_timeout=self.cluster.tx_prepare_timeout)
        self.broker.replication_barriers.append(self._position_barrier)
        if self._txlog is not None:  # the master started later replicates its journal here
            self._txlog.attach_primary(self.primary)
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
        self.phase = "primary"
        for peer, (msg_id, join) in sorted(self._pending_joins.items()):
            self._on_join(peer, msg_id, join)
        self._pending_joins.clear()
        self._flush()
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
        self._pending_joins.clear()
        self.backup_alarms.clear()
        if self.primary is not None:
            self.primary.close()
            if self._position_barrier in self.broker.replication_barriers:
                self.broker.replication_barriers.remove(self._position_barrier)
            self.primary = None
            # never released: their clients are disconnected, nothing of it is confirmed
            self._durable_waiters.clear()
            if self._txlog is not None:
                self._txlog.detach_primary()
        self._spawn(self.node.serve_clients(False))

    def _stop_serving(self, reason: str) -> None:
        log.warning("node %s stops serving clients: %s", self.me, reason)
        self._record_failover("stepped down", node=self.me, reason=reason)
        self._demote()
        self.phase = "joining"

    def _become_backup(self, epoch: int, primary: str) -> None:
        if self.primary is not None:
            log.warning("node %s deposed: %s is primary for epoch %d", self.me, primary, epoch)
            self._record_failover("deposed", node=self.me, by=primary, epoch=epoch)
            self._demote()
        if self.following == primary and self.backup is not None and self.backup.epoch == epoch:
            return
        if self.backup is not None:
            self.backup.close()
        self.phase = "backup"
        self.following = primary
        member = self.cluster.member(primary)
        self.node.set_relay_target(RelayTarget(member.amqp, member.amqps))
        st = self.state.state
        self.backup = Backup(self.broker, me=self.me, epoch=epoch,
                             position=el.Position(st.pos_epoch, st.pos_seq),
                             txlog=self._txlog_replica())
        self._send_join()

    @property
    def _txlog(self) -> Any:
        """The node's TxLog bridge (``txlog/broker_bridge.py``), with ``[txlog]``."""
        return getattr(self.node, "txlog", None)

    def _txlog_replica(self) -> Any:
        """This node's copy of the DC's TxLog master (``txlog/replica.py``), with ``[txlog]``."""
        return self._txlog.replica if self._txlog is not None else None

    def _send_join(self) -> None:
        if self.backup is None or self.following is None:
            return
        if not self.links.connected(self.following):
            return  # sent when the link comes up
        # from here until the marker our state is a mix: not a consistent copy (the
        # store commits in order, so this is durable before any catch-up event is)
        self._record_position(-1, -1)
        self._set_position(el.Position.INVALID)
        self.links.send(self.following, self.backup.join_message())
        self._alarms_sent = None  # the primary hears them again after the join
        log.info("node %s joining primary %s (epoch %d)", self.me, self.following,
                 self.backup.epoch)

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

    def _set_position(self, pos: el.Position) -> None:
        self._carry_out(self.election.set_position(pos))

    # -- positions: kept in the store, durable with the data they describe ---------------

    def _load_position(self) -> None:
        """Our position and vote floor from the store (older nodes: the state file)."""
        raw = self.broker.store.get_meta(POSITION_KEY)
        if raw is None:
            return
        st = self.state.state
        st.pos_epoch, st.pos_seq, st.floor_epoch, st.floor_seq = (int(v) for v in json.loads(raw))

    def _record_position(self, epoch: int, seq: int) -> None:
        """Record our position into the store's next commit (with the floor, never lowered).

        Durable once an ``after_sync`` registered after this call runs; no
        extra fsync: it commits with the events it describes.
        """
        st = self.state.state
        st.move_to(epoch, seq)
        self.broker.store.put_meta(POSITION_KEY, json.dumps(
            [st.pos_epoch, st.pos_seq, st.floor_epoch, st.floor_seq]))

    def _position_barrier(self, callback: Any) -> None:
        """Run ``callback`` once our own position covering everything so far is durable.

        One position record per loop iteration, however many confirms wait on it.
        """
        primary = self.primary
        if primary is None:
            return
        if primary.seq <= self._durable_seq:
            callback()
            return
        self._durable_waiters.append(callback)
        self._schedule_position()

    def _schedule_position(self) -> None:
        """Record the primary's position once this loop iteration, with the events of it.

        Also without a waiting confirm: a primary that crashes and comes back
        must not claim less than its backups acknowledged (their vote floors),
        or no node of a datacenter whose backups were catching up could win.
        """
        if not self._position_scheduled:
            self._position_scheduled = True
            asyncio.get_running_loop().call_soon(self._position_due)

    def _position_due(self) -> None:
        """Record the scheduled position: as the store hands its next batch over, or after.

        The store calls this right before it hands a batch to its writer
        (``Store.before_batch``), so the position commits with the events it
        covers and a confirm waits for one disk sync; the ``call_soon`` of
        ``_schedule_position`` covers a loop iteration that wrote nothing.
        """
        if self._position_scheduled:
            self._record_primary_position()

    def _record_primary_position(self) -> None:
        self._position_scheduled = False
        primary = self.primary
        if primary is None:
            return
        epoch, seq = primary.epoch, primary.seq
        waiters, self._durable_waiters = self._durable_waiters, []
        self._record_position(epoch, seq)

        def durable() -> None:
            if self.primary is not primary:
                return  # deposed meanwhile: nothing of it is confirmed
            self._durable_seq = max(self._durable_seq, seq)
            self._set_position(el.Position(epoch, seq))
            for callback in waiters:
                callback()

        self.broker.store.after_sync(durable)

    # -- packets -------------------------------------------------------------------------

    def _on_peer_up(self, peer: str) -> None:
        if peer == self.following:
            self._send_join()

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
            self._on_events(peer, msg)
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
        self._flush()

    def _on_join(self, peer: str, msg_id: int, msg: Join) -> None:
        if self.primary is None or msg.epoch != self.primary.epoch:
            self.links.send(peer, Error(ErrorCode.NOT_PRIMARY,
                                        f"{self.me} is not the primary of epoch {msg.epoch}"),
                            msg_id)
            return
        if self.phase == "verifying":
            self._pending_joins[peer] = (msg_id, msg)  # answered once verification decided
            return
        log.info("backup %s joins at position (%d, %d)", peer, msg.pos_epoch, msg.pos_seq)
        self.primary.backup_joined(msg)

    def _on_events(self, peer: str, msg: Events) -> None:
        backup = self.backup
        if backup is None or peer != self.following or msg.epoch != backup.epoch:
            return
        was_caught_up = backup.caught_up
        try:
            backup.receive(msg)
        except ConfigurationMismatch as exc:
            log.error("node %s: %s; stopping", self.me, exc)
            backup.close()
            self.node.exit_code = 1
            self.node.request_stop()
            return
        except Exception as exc:
            log.warning("node %s: replication from %s failed (%s); joining again", self.me,
                        peer, exc)
            backup.close()
            self.backup = Backup(self.broker, me=self.me, epoch=backup.epoch,
                                 position=el.Position.INVALID, txlog=self._txlog_replica())
            self._send_join()
            return
        if backup.caught_up and not was_caught_up:
            log.warning("node %s caught up with primary %s at seq %d: ready", self.me, peer,
                        backup.applied_seq)
        for vote in backup.take_votes():
            self.links.send(peer, vote)
        if backup.take_ack_due():
            self._schedule_ack()
        elif self._deferred_ack is None:  # only dequeues: acknowledged later, or with the next
            self._deferred_ack = asyncio.get_running_loop().call_later(
                DEQUEUE_ACK_DELAY, self._deferred_ack_due)

    def _deferred_ack_due(self) -> None:
        self._deferred_ack = None
        self._schedule_ack()

    def _schedule_ack(self) -> None:
        """Acknowledge what is applied now, once the store made it (and our position) durable.

        The seq is taken now: events applied after this call are not covered
        by the commit the callback waits for, and are acknowledged next time.
        With a TxLog the replicated journal is fsynced first (off the loop), and
        only then is the position recorded: a position never claims TxLog
        records that a crash could still lose.
        """
        if self._deferred_ack is not None:  # this acknowledgement covers what it waited for
            self._deferred_ack.cancel()
            self._deferred_ack = None
        backup = self.backup
        if backup is None or self._ack_pending is backup:
            return
        self._ack_pending = backup  # per Backup: a new one (joined again) schedules its own
        seq, caught_up, session = backup.applied_seq, backup.caught_up, backup.session

        def durable() -> None:
            if self._ack_pending is backup:
                self._ack_pending = None
            if self.backup is not backup or self.following is None:
                return
            if backup.session != session:
                # joined again meanwhile: that seq and position were the old session's,
                # and the state is a catch-up in progress (its position INVALID)
                if backup.applied_seq >= 0:
                    self._schedule_ack()
                return
            if caught_up:
                self._set_position(el.Position(backup.epoch, seq))
            self.links.send(self.following, backup.ack_message(seq))
            if backup.applied_seq > seq:
                self._schedule_ack()

        def journal_synced() -> None:
            if caught_up and self.backup is backup and backup.session == session:
                self._record_position(backup.epoch, seq)
            self.broker.store.after_sync(durable)

        replica = backup.txlog
        if replica is not None:
            replica.after_durable(journal_synced)
        else:
            journal_synced()

    def _schedule_flush(self) -> None:
        self._schedule_position()
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        primary = self.primary
        if primary is None:
            return
        for peer in list(primary.sessions):
            out = primary.take_outbox(peer)
            if out:
                self.links.send_many(peer, out)

    def _spawn(self, work: Any) -> None:
        self.node._spawn(work, lambda exc: exc and log.error("HA task failed: %s", exc))

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
