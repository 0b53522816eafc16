"""The asyncio layer of HA in one datacenter: links, timers, the state file, the AMQP listener.

Every decision is made by ``ha.member.HAMember`` (sans-I/O: the election, the
HA core with its Primary or Backup, the verification phase, the dispatch of
cluster messages), which the simulation (``ha/simulation``) drives too. This
module only carries its inputs and outputs (``ha.member.MemberEffects``):

- packets from ``cluster.link.ClusterLinks``, links up and down, and a tick
  every ``TICK`` go to the member;
- ``persist`` writes the vote to the state file before anything is sent;
- ``serving`` opens the node for clients of that epoch (the TxLog master, the
  listeners; retried while a port is taken); the member itself closes every
  client connection in the step that ends the role (``HAMember.clients``, its
  ``ClientAdmission``: clients get 320 and move on to the next URL), and
  whether a connection is served is its answer when the connection is handed
  over, never a flag of this layer; ``follow`` points the relay of this node's
  clients at the new primary;
- the failover history and the status page are kept here.

It talks to the member only (the role objects, Primary or Backup, are the
member's: the admin endpoints read the primary through ``primary``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from brokerha.cluster import election as el
from brokerha.cluster.link import ClusterLinks, links_reload, tls_contexts
from brokerha.cluster.messages import Message
from brokerha.cluster.state import StateFile
from brokerha.ha.core import Cancellable, PrimarySettings, load_position
from brokerha.ha.member import TICK, HAMember
from brokerha.httpapi.server import HTTPError, Request, Response
from brokerha.node import check_replicas
from brokerha.node.relay import RelayTarget
from brokerha.partition.coordinator import TableCoordinator
from brokerha.partition.mux import Grouped, HeartbeatAcks, Heartbeats

if TYPE_CHECKING:
    from brokerha.node.cluster_config import ClusterConfig
    from brokerha.node.server import Node
    from brokerha.primary.primary import Primary

log = logging.getLogger("brokerha.ha")

FAILOVER_HISTORY = 20
GROUPED = (Grouped, Heartbeats, HeartbeatAcks)  # a partitioned node's packets (mux.py)


def _log_failure(exc: BaseException | None) -> None:
    if exc is not None:
        log.error("HA task failed: %s", exc)


class Shell:
    """What the asyncio shells of one member (``HANode``) and of a partitioned node's groups
    (``node/ha_groups.py``, ``GroupsNode``) share: the cluster links, the partition table's
    coordinator, the tick, the failover history, the AMQP listener's opening."""

    def __init__(self, node: Node, cluster: ClusterConfig) -> None:
        self.node = node
        self.broker = node.broker
        self.cluster = cluster
        self.me = node.config.name
        self.member = cluster.member(self.me)
        ssl_server = ssl_client = None
        if cluster.tls is not None:
            ssl_server, ssl_client = tls_contexts(cluster.tls.cert, cluster.tls.key, cluster.tls.ca)
        self.links = ClusterLinks(
            cluster.name, self.me,
            {m.name: m.cluster for m in cluster.members if m.name != self.me},
            self.member.cluster_bind or self.member.cluster, cluster.secret, self._on_message,
            self._on_peer_up, self._on_peer_down, ssl_server=ssl_server, ssl_client=ssl_client)
        if cluster.tls is not None:
            node.tls.on_reload("[cluster.tls]", links_reload(
                cluster.tls.cert, cluster.tls.key, cluster.tls.ca, lambda: self.links))
        self.failovers: list[dict[str, Any]] = []
        # the partition table (issue 35, stage 1): made by the metadata primary, the same on
        # every node; nothing routes by it yet
        self.partitions = TableCoordinator(
            self.broker.store, [m.name for m in cluster.members],
            partitions=cluster.partitions, replicas=cluster.partition_replicas)
        self._ticker: asyncio.Task[None] | None = None
        node.admin.route("POST", "/api/promote", self._promote_request, admin=True)
        node.admin.route("POST", "/api/check-replicas", self._check_request, admin=True)

    def settings(self) -> PrimarySettings:
        cluster = self.cluster
        return PrimarySettings(len(cluster.members), cluster.backup_timeout, cluster.replicate,
                               # [[cluster.policies]] seeded the definitions' ha-replicate
                               # policies (node/server.py): the broker's policies decide
                               (), cluster.tx_prepare_timeout,
                               backup_unheard_timeout=cluster.backup_unheard_timeout,
                               flow_lag=cluster.flow_lag)

    def timing(self) -> el.ElectionTiming:
        cluster = self.cluster
        return el.ElectionTiming(cluster.heartbeat_interval, cluster.lease_timeout,
                                 cluster.election_timeout)

    # -- what the member asks of either shell ------------------------------------------------

    def connected(self, peer: str) -> bool:
        return self.links.connected(peer)

    def peers_up(self) -> list[str]:
        return sorted(self.links.peers_up())

    def soon(self, callback: Any) -> None:
        asyncio.get_running_loop().call_soon(callback)

    def later(self, delay: float, callback: Any) -> Cancellable:
        return asyncio.get_running_loop().call_later(delay, callback)

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.links.start()
        self._started()
        self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    def _started(self) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        raise NotImplementedError

    def role_term(self) -> int | None:
        """The metadata group's (the one group's) role term: what the listener opens for."""
        raise NotImplementedError

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
                self._tick()
            except Exception:  # keep the node's timers alive; the log says what broke
                log.exception("HA tick failed")

    def _record_failover(self, event: str, **details: Any) -> None:
        self.failovers.append({"at": time.time(), "event": event, **details})
        del self.failovers[:-FAILOVER_HISTORY]

    async def _open_listener(self, epoch: int) -> None:
        """Open the AMQP listener, retrying while we are this epoch's serving primary.

        The port can be briefly taken (EADDRINUSE: another socket's ephemeral
        port); giving up would leave a primary that holds its lease and the
        backups but never serves anyone.
        """
        delay = TICK
        while True:
            if self.role_term() != epoch:
                return
            try:
                if await self.node.serve_clients(epoch):
                    log.warning("node %s is primary (epoch %d): serving AMQP clients on %s:%d",
                                self.me, epoch, *self.member.amqp)
                return
            except OSError as exc:
                log.error("node %s cannot open its AMQP listener on %s:%d (%s); retrying",
                          self.me, *self.member.amqp, exc)
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    def _spawn(self, work: Any) -> None:
        self.node._spawn(work, _log_failure)

    def _promote_request(self, request: Request) -> Response:
        raise NotImplementedError

    async def _check_request(self, request: Request) -> Response:
        """``ctl check-replicas``: a group's replicas compared (node/check_replicas.py)."""
        return await check_replicas.answer(request, self.group_member, self.me)

    def group_member(self, group: int | None) -> HAMember | None:
        """The member of replication group ``group`` (None: the node's one group, or its
        metadata group) this node runs, or None."""
        raise NotImplementedError

    def _on_message(self, peer: str, msg_id: int, msg: Message) -> None:
        raise NotImplementedError

    def _on_peer_up(self, peer: str) -> None:
        raise NotImplementedError

    def _on_peer_down(self, peer: str) -> None:
        raise NotImplementedError

    def _common_status(self, status: dict[str, Any], election: el.Election) -> None:
        me = status["node"]
        me["peers_up"] = sorted(self.links.peers_up())
        status["cluster"] = self.cluster.name
        status["members"] = [{"name": m.name, "amqp_url": m.amqp_url, "admin_url": m.admin_url,
                              "https_url": m.https_url,
                              "amqps_url": None if m.amqps is None
                              else f"amqps://{m.amqps[0]}:{m.amqps[1]}"}
                             for m in self.cluster.members]
        status["failovers"] = list(self.failovers)
        me["election"] = self.election_status(election)
        me["partitions"] = self.partitions.status()
        me["loop"] = self.node.loop_monitor.status()

    @property
    def election(self) -> el.Election:
        """The one group's election, or the metadata group's."""
        raise NotImplementedError

    def election_status(self, election: el.Election | None = None) -> dict[str, Any]:
        """What ``ctl status --json``, ``/metrics`` and the UI show of the election: campaigns
        this node started by reason, its step-downs as primary by reason, the last of each
        (``at`` in Unix time), late heartbeats and lease lapses (docs/operations.md)."""
        st = (election or self.election).status()
        wall = time.time() - self._now()  # the election's clock is time.monotonic()
        out = {k: st[k] for k in ("elections", "rounds", "stepdowns", "heartbeats_late",
                                  "heartbeat_gap_max", "lapses", "lapses_renewed")}
        for key in ("last_election", "last_stepdown"):
            event = st[key]
            out[key] = None if event is None else {**event, "at": round(event["at"] + wall, 3)}
        if "lease_remaining" in st:
            out["lease_remaining"] = st["lease_remaining"]
        return out


class HANode(Shell):
    """The asyncio shell of ``ha.member.HAMember``: the links, the state file, the listener."""

    def __init__(self, node: Node, cluster: ClusterConfig) -> None:
        super().__init__(node, cluster)
        self.state = StateFile(node.config.data_dir)
        load_position(self.broker, self.state.state)
        self.ha = HAMember(
            self.broker, self.me, [m.name for m in cluster.members], self.state.state, self,
            self.settings(), self._now, timing=self.timing(),
            verification_timeout=cluster.verification_timeout, layer=node.txlog,
            layers=[self.partitions])
        node.admission = self.ha.clients  # the member decides which connections are served

    @property
    def election(self) -> el.Election:
        return self.ha.election

    # -- what the admin endpoints read of the member (admin/node_view.py, HAView) ---------

    @property
    def primary(self) -> Primary | None:
        return self.ha.primary

    @property
    def phase(self) -> str:
        return self.ha.phase

    # -- what the member asks of this layer (ha.member.MemberEffects) ---------------------

    def send(self, peer: str, message: Message) -> None:
        self.links.send(peer, message)

    def send_many(self, peer: str, messages: Sequence[Message]) -> None:
        self.links.send_many(peer, messages)

    def reply(self, peer: str, msg_id: int, message: Message) -> None:
        self.links.send(peer, message, msg_id)

    def persist(self, epoch: int, voted_for: str | None) -> None:
        self.state.save(epoch=epoch, voted_for=voted_for)

    def position(self, pos: el.Position) -> None:
        self.ha.carry_out(self.election.set_position(pos))

    def replication_failed(self, reason: str) -> None:
        self.node.exit_code = 1
        self.node.request_stop()

    def elected(self, epoch: int, primary: Primary) -> None:
        self._record_failover("elected", node=self.me, epoch=epoch)
        self.node.set_relay_target(None)  # our clients: served here once verified

    def serving(self, epoch: int, decisions: dict[str, str]) -> None:
        self._spawn(self._open_listener(epoch))

    def demoted(self, reason: str) -> None:
        self._record_failover("stepped down", node=self.me, reason=reason)
        self.node.stopped_serving()  # the member closes the connections in this same step

    def follow(self, primary: str, epoch: int) -> None:
        member = self.cluster.member(primary)  # unchanged: a no-op (set_relay_target)
        self.node.set_relay_target(RelayTarget(member.amqp, member.amqps))

    def joined(self, primary: str, epoch: int) -> None:
        """The core sent a join: our disk alarms go to the primary again."""
        self.ha.joined()
        log.info("node %s joining primary %s (epoch %d)", self.me, primary, epoch)

    # -- life cycle ----------------------------------------------------------------------

    def _started(self) -> None:
        log.info("cluster %s: node %s, epoch %d, position (%d, %d); peers %s", self.cluster.name,
                 self.me, self.election.epoch, self.state.state.pos_epoch,
                 self.state.state.pos_seq, ", ".join(self.links.peers))
        self.ha.start()

    def _tick(self) -> None:
        self.ha.tick()

    def role_term(self) -> int | None:
        return self.ha.role_term()

    # -- packets -------------------------------------------------------------------------

    def _on_peer_up(self, peer: str) -> None:
        self.ha.peer_up(peer)

    def _on_peer_down(self, peer: str) -> None:
        self.ha.peer_down(peer)

    def _on_message(self, peer: str, msg_id: int, msg: Message) -> None:
        if isinstance(msg, GROUPED):
            mismatched(self.me, peer, "sends partition groups' packets")
            return
        self.ha.on_message(peer, msg_id, msg)

    def group_member(self, group: int | None) -> HAMember | None:
        return self.ha if group in (None, 0) else None

    def _promote_request(self, request: Request) -> Response:
        target = str(request.json().get("node", ""))
        if target == self.me and self.phase == "primary":
            return Response.json({"message": f"{self.me} is already the primary"})
        try:
            self.ha.promote(target)
        except ValueError as exc:
            raise HTTPError(409, str(exc)) from exc
        log.warning("node %s hands the primary role to %s (operator request)", self.me, target)
        self._record_failover("promote requested", node=target, by=self.me)
        return Response.json({"message": f"{self.me} handed over to {target}; it stands for "
                                         "election now"})

    # -- status --------------------------------------------------------------------------

    def add_status(self, status: dict[str, Any]) -> None:
        me = status["node"]
        st = self.state.state
        me.update(self.ha.status())
        me.update(epoch=self.election.epoch, primary=self.election.primary,
                  position=[st.pos_epoch, st.pos_seq])
        self._common_status(status, self.election)


_mismatch_logged: set[tuple[str, str]] = set()


def mismatched(me: str, peer: str, what: str) -> None:
    """A peer that runs partition groups when this node does not, or the reverse: their
    packets are dropped (each side's groups cannot be the other's); said once per peer."""
    if (me, peer) not in _mismatch_logged:
        _mismatch_logged.add((me, peer))
        log.error("node %s: peer %s %s; its packets are dropped: is [cluster] "
                  "partition_groups the same on every node?", me, peer, what)
