"""The asyncio shell of a node running partition groups (issue 35 stage 2).

With ``[cluster] partition_groups = true`` and P > 1 (``ClusterConfig.groups_on``)
the node drives a ``partition.member.PartitionedMember`` instead of one
``HAMember`` (``node/ha.py``'s ``HANode``): the metadata group (every node,
today's election, the partition table's coordinator in its layers) and, once
the node holds the table, one group per partition cell it holds. Every
decision is the member's; this module only carries its inputs and outputs
(``partition.member.PartitionEffects``):

- the node pair's one cluster link carries every group's packets, wrapped by
  the member's ``GroupMux`` (``Grouped``, bundled ``Heartbeats`` and
  ``HeartbeatAcks``: codes 20-22, ``cluster/protocol.py`` VERSION 3);
- each group's epoch and vote are written in the one state file before
  anything sent after them (``partition/state.py``, ``GroupStateFile``); each
  group's position is in the store under ``ha_position/<g>`` (``HACore``);
- ``serving`` of the metadata group opens the node as today (the listeners,
  the relay off); ``serving`` of a partition group opens that group's client
  admission for its epoch; the member closes a group's clients in the step
  that ends its role; ``follow`` of the metadata group points the relay at
  the metadata primary (a node that serves no group relays its new clients
  there, ``node/relay.py``);
- which connections are served and which queues a client may use here are
  ``partition/clients.py``'s ``GroupClients`` (the node's ``admission`` and
  the broker's ``groups``): a queue on its partition's leader, the
  configuration on the metadata primary, a confirm through the gate and
  barriers of the queues' groups;
- a declaration of a queue or an exchange of a group this node does not serve
  goes to that group's leader (stage 3, ``partition/declarations.py``'s
  ``NodeDeclarations``, packets 50-51 dispatched here before the mux), answered
  once this node's copy holds it; its packets and a remote consumer's go after
  the forwards of what was published before them (``_after_forwards``);
- a publish to a queue of a partition this node does not serve is forwarded
  to its leader (stage 3, ``partition/forwarding.py``'s ``NodeForwarding``:
  the node's ``ForwardSender``, a ``ForwardReceiver`` per group it serves,
  ``LeaderNotice`` at serving, on each link up and every second; packets
  23-26 dispatched here before the mux);
- a consume or get of such a queue goes to its leader (``partition/consuming.py``'s
  ``NodeConsuming``: the node's ``ConsumerProxy``, a ``ConsumerHost`` per group it
  serves; packets 40-47 dispatched here before the mux).

The status adds ``groups`` (per group: role, epoch, leader, phase, members),
read from the members when asked.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from brokerha.broker.placement import METADATA_GROUP
from brokerha.cluster import election as el
from brokerha.cluster.messages import Message
from brokerha.ha.member import HAMember
from brokerha.httpapi.server import HTTPError, Request, Response
from brokerha.node.config import ConfigError
from brokerha.node.ha import GROUPED, Shell, mismatched
from brokerha.node.relay import RelayTarget
from brokerha.partition.clients import GroupClients
from brokerha.partition.consuming import PACKETS as CONSUME_PACKETS
from brokerha.partition.consuming import NodeConsuming
from brokerha.partition.declarations import PACKETS as DECLARATION_PACKETS
from brokerha.partition.declarations import NodeDeclarations
from brokerha.partition.directory import UPDATE as DIRECTORY_UPDATE
from brokerha.partition.directory import DirectoryLayer, DirectoryWriter, NodeDirectory
from brokerha.partition.forwarding import PACKETS, NodeForwarding
from brokerha.partition.member import PartitionedMember
from brokerha.partition.state import GroupStateFile
from brokerha.partition.transactions import PACKETS as XTX_PACKETS
from brokerha.partition.transactions import NodeTransactions

if TYPE_CHECKING:
    from brokerha.node.cluster_config import ClusterConfig
    from brokerha.node.server import Node
    from brokerha.primary.primary import Primary

log = logging.getLogger("brokerha.ha")

PREFERRED_FIRST = 3


def group_role(member: HAMember) -> str:
    """``primary`` (verified, its lease valid or lapsed), ``backup`` (following a primary)
    or ``none``: the member's answer at the instant asked."""
    if member.role_term() is not None:
        return "primary"
    if member.backup is not None:
        return "backup"
    return "none"


def group_status(member: HAMember, members: tuple[str, ...]) -> dict[str, Any]:
    election = member.election
    pos = election.position
    backup = member.backup
    return {"role": group_role(member), "phase": member.phase,
            "serving": member.term() is not None,
            "ready": member.phase == "primary" or (backup is not None and backup.caught_up),
            "epoch": election.epoch,
            "leader": election.primary, "members": list(members),
            "voters": list(election.members), "learners": list(election.learners),
            "position": [pos.epoch, pos.seq]}


class GroupsNode(Shell):
    """The asyncio shell of ``partition.member.PartitionedMember``."""

    def __init__(self, node: Node, cluster: ClusterConfig) -> None:
        super().__init__(node, cluster)
        if node.txlog is not None:
            raise ValueError("[txlog] with [cluster] partition_groups: the TxLog master "
                             "follows one group's role; not supported (issue 35)")
        self.state = GroupStateFile(node.config.data_dir)
        if self.state.unpartitioned:
            # its store holds queues of the one group, which no partition group's position
            # covers: a partition group would start at (0, 0) over data its peers lack
            raise ConfigError(
                f"{self.state.path} is an unpartitioned node's: this data directory was "
                "written without [cluster] partition_groups; start it without, or from an "
                "empty data directory (moving a cluster's queues into partitions is stage 5)")
        # a node holding cells of only some partitions routes to the others' queues by the
        # queue directory the metadata group keeps (partition/directory.py); until its copy
        # holds a partition, GroupClients.check_route refuses (540) what it cannot route
        # (with every node in every partition, N <= NR + 1, it holds the owners of the
        # exclusive queues alone: no partition's queue is written to it)
        self.directory_full = len(cluster.members) > cluster.partition_replicas + 1
        self.directory_layer: DirectoryLayer | None = DirectoryLayer(self.broker.store)
        coordinator = self.partitions
        layers: list[Any] = [coordinator]
        if self.directory_layer is not None:
            layers.append(self.directory_layer)
        self.ha = PartitionedMember(
            self.broker, self.me, [m.name for m in cluster.members],
            lambda: coordinator.table, dict(self.state.states), self, self.settings(),
            self._now, timing=self.timing(),
            verification_timeout=cluster.verification_timeout, layers=layers,
            # a partition's preferred cell stands first at a start: leaders spread as the
            # placement spread the preferred cells (PREFERRED_FIRST election timeouts ahead
            # of the others: a node whose process starts a second late still comes first)
            preferred_first=PREFERRED_FIRST * cluster.election_timeout)
        self.clients = GroupClients(self.ha, lambda name: cluster.member(name).amqp_url)
        node.admission = self.clients  # which connections are served: the groups' answers
        self.broker.groups = self.clients  # which queues: their group's leader only
        # publishes to the partitions this node does not serve, forwarded to their leaders
        # (stage 3): one origin per start of the node, so a restart's fseqs start afresh
        origin = f"{self.me}.{uuid.uuid4().hex[:12]}"
        self.forwarding = NodeForwarding(
            self.ha, origin, [m.name for m in cluster.members],
            send=self.send, soon=self.soon, clock=self._now)
        self.clients.forwarding = self.forwarding
        # a publish from another node to one of this node's exclusive queues: answered as
        # its own clients' publishes to it are (whichever group it serves now)
        self.forwarding.owned_durable = lambda callback: self.clients.after_durable((), callback)
        # consumers of queues of the partitions this node does not serve, attached to their
        # leaders (stage 3's remote consumers): the same origin, the same notices
        self.consuming = NodeConsuming(self.ha, origin, send=self._after_forwards,
                                       soon=self.soon, clock=self._now)
        self.forwarding.notice_listeners.append(self.consuming.leader)
        # transactions across partitions (stage 4): the node's coordinator, the rules of the
        # groups it serves; the same origin, the same notices
        self.transactions = NodeTransactions(self.ha, origin, send=self.send, soon=self.soon)
        self.forwarding.notice_listeners.append(self.transactions.leader)
        self.clients.transactions = self.transactions
        self.clients.consuming = self.consuming
        self.consuming.transactions = self.transactions  # its branches take hand-overs
        # declarations of queues and exchanges of groups this node does not serve, asked of
        # their leaders (stage 3's declarations, codes 50-51)
        self.declarations = NodeDeclarations(self.ha, origin, send=self._after_forwards,
                                             soon=self.soon, clock=self._now)
        self.forwarding.notice_listeners.append(self.declarations.notice)
        self.clients.declarations = self.declarations
        self.directory: NodeDirectory | None = None
        if self.directory_layer is not None:
            declarations = self.declarations
            member = self.ha

            def partition_of() -> Any:
                return None if member.placement is None else member.placement.partition

            writer = DirectoryWriter(
                self.broker, partition_of,
                lambda args, done: declarations.ask_internal(0, DIRECTORY_UPDATE, args, done),
                self._now)
            self.directory = NodeDirectory(self.ha, self.directory_layer, writer)
            self.declarations.owners = self.directory  # exclusive queues' owners, always
            self.clients.owners = self.directory
            if self.directory_full:
                self.declarations.directory = self.directory
                self.clients.directory = self.directory
                self.ha.group_adding = self.directory.stand_ins.group_adding

    def _after_forwards(self, peer: str, message: Message) -> None:
        """A remote consumer's or a declaration's packet goes after the forwards of what
        this node's clients published before it and the settles they made (flushed now
        rather than at the end of the turn): a channel's publish then get, purge or
        delete, and its nack (requeue) then get, keep their order, as on one node."""
        self.forwarding.flush()
        if self.consuming.proxy.pending:  # and the settles (a requeue) before a get
            self.consuming.flush()
        self.send(peer, message)

    # -- what the admin endpoints read (admin/node_view.py, HAView): the metadata group -----

    @property
    def election(self) -> el.Election:
        return self.ha.metadata.election

    @property
    def primary(self) -> Primary | None:
        return self.ha.metadata.primary

    @property
    def phase(self) -> str:
        return self.ha.metadata.phase

    def role_term(self) -> int | None:
        return self.ha.metadata.role_term()

    # -- what the member asks of this layer (partition.member.PartitionEffects) -------------

    def send(self, peer: str, message: Message) -> None:
        self.links.send(peer, message)

    def reply(self, peer: str, msg_id: int, message: Message) -> None:
        self.links.send(peer, message, msg_id)

    def persist(self, group: int, epoch: int, voted_for: str | None) -> None:
        self.state.save(group, epoch=epoch, voted_for=voted_for)

    def position(self, group: int, pos: el.Position) -> None:
        pass  # the group's member told its election (GroupEffects.position)

    def replication_failed(self, group: int, reason: str) -> None:
        log.error("node %s cannot follow the primary of group %d: %s; stopping", self.me,
                  group, reason)
        self.node.exit_code = 1
        self.node.request_stop()

    def joined(self, group: int, primary: str, epoch: int) -> None:
        log.info("node %s joining %s in group %d (epoch %d)", self.me, primary, group, epoch)

    def elected(self, group: int, epoch: int, primary: Primary) -> None:
        self._record_failover("elected", node=self.me, epoch=epoch, group=group)
        if group == METADATA_GROUP:
            self.node.set_relay_target(None)  # our clients: served here once verified

    def serving(self, group: int, epoch: int, decisions: dict[str, str]) -> None:
        if group == METADATA_GROUP:
            self._spawn(self._open_listener(epoch))
            return
        member = self.ha.groups[group]
        if member.clients.open(epoch):
            log.warning("node %s leads partition %d (group %d, epoch %d): serving its queues",
                        self.me, group - 1, group, epoch)
        self.forwarding.serving(group, epoch)  # its forwards taken here from now on
        self.consuming.serving(group, epoch)  # and its remote consumers
        self.transactions.serving(group, epoch)  # and its cross-partition branches
        if self.directory is not None and self.directory_full:  # its queues: a sync first
            self.directory.writer.serving(group, epoch)

    def demoted(self, group: int, reason: str) -> None:
        """The member closes the group's connections in this same step; a connection that
        used no group is closed once the node serves none (next turn: after the close)."""
        self._record_failover("stepped down", node=self.me, reason=reason, group=group)
        if group == METADATA_GROUP:
            self.node.stopped_serving()
        self.forwarding.demoted(group)
        self.consuming.demoted(group)
        self.transactions.demoted(group)
        if self.directory is not None:
            self.directory.writer.demoted(group)
        self.soon(self.clients.lost_groups)

    def follow(self, group: int, primary: str, epoch: int) -> None:
        if group == METADATA_GROUP:  # a node serving no group relays to the metadata primary
            member = self.cluster.member(primary)
            self.node.set_relay_target(RelayTarget(member.amqp, member.amqps))

    # -- life cycle and packets ----------------------------------------------------------

    def _started(self) -> None:
        groups = self.ha.groups
        log.info("cluster %s: node %s runs partition groups; %s; peers %s", self.cluster.name,
                 self.me, ", ".join(f"group {g} epoch {m.election.epoch} at "
                                    f"{m.election.position}" for g, m in sorted(groups.items())),
                 ", ".join(self.links.peers))
        self.ha.start()

    def _tick(self) -> None:
        self.ha.tick()
        self.forwarding.tick()
        self.consuming.tick()
        self.transactions.tick()
        self.declarations.tick()
        if self.directory is not None:
            self.directory.tick()

    def _on_peer_up(self, peer: str) -> None:
        self.ha.peer_up(peer)
        self.forwarding.peer_up(peer)  # the groups this node serves: a LeaderNotice each
        if self.directory is not None:
            self.directory.peer_up(peer)  # its exclusive queues' entries stay

    def _on_peer_down(self, peer: str) -> None:
        self.ha.peer_down(peer)
        self.forwarding.link_lost(peer)  # publishes to its exclusive queues unanswered: nacked
        self.consuming.link_lost(peer)  # what its consumers held here requeued; ours re-attach
        self.declarations.link_lost(peer)  # asked of it, unanswered: asked again, or closed
        if self.directory is not None:
            self.directory.peer_down(peer)  # its exclusive queues go after OWNER_GRACE

    def _on_message(self, peer: str, msg_id: int, msg: Message) -> None:
        # every packet of a partitioned node is a mux packet but stage 3's forwards (codes
        # 23-26), which name their group themselves
        if isinstance(msg, PACKETS):
            self.forwarding.on_packet(peer, msg)
            return
        if isinstance(msg, CONSUME_PACKETS):  # remote consumers (codes 40-47)
            self.consuming.on_packet(peer, msg)
            return
        if isinstance(msg, XTX_PACKETS):  # transactions across partitions (codes 63-64)
            self.transactions.on_packet(peer, msg)
            return
        if isinstance(msg, DECLARATION_PACKETS):  # declarations (codes 50-51)
            self.declarations.on_packet(peer, msg)
            return
        if not isinstance(msg, GROUPED):
            mismatched(self.me, peer, "does not run partition groups")
            return
        self.ha.on_message(peer, msg_id, msg)
        self.declarations.moved()  # answers waiting for this node's copies

    def group_member(self, group: int | None) -> HAMember | None:
        return self.ha.groups.get(METADATA_GROUP if group is None else group)

    def _promote_request(self, request: Request) -> Response:
        """``ctl promote NODE`` (the metadata group) or ``{"node", "group"}`` (one group)."""
        body = request.json()
        target = str(body.get("node", ""))
        try:
            group = int(body.get("group", METADATA_GROUP))
        except (TypeError, ValueError):
            raise HTTPError(400, "group: a group number (0: the metadata group)") from None
        member = self.ha.groups.get(group)
        if member is None:
            raise HTTPError(404, f"{self.me} is not a member of group {group}")
        if target == self.me and member.phase == "primary":
            return Response.json({"message": f"{self.me} is already the primary of group "
                                             f"{group}"})
        try:
            self.ha.promote(group, target)
        except ValueError as exc:
            raise HTTPError(409, str(exc)) from exc
        log.warning("node %s hands group %d to %s (operator request)", self.me, group, target)
        self._record_failover("promote requested", node=target, by=self.me, group=group)
        return Response.json({"message": f"{self.me} handed group {group} over to {target}; "
                                         "it stands for election now"})

    # -- status --------------------------------------------------------------------------

    def add_status(self, status: dict[str, Any]) -> None:
        """The metadata group's role as the node's (every field as an unpartitioned node's),
        and ``groups``: each group's, read from its member now."""
        me = status["node"]
        metadata = self.ha.metadata
        pos = metadata.election.position
        me.update(metadata.status())
        me.update(epoch=metadata.election.epoch, primary=metadata.election.primary,
                  position=[pos.epoch, pos.seq])
        self._common_status(status, metadata.election)
        me["groups"] = {str(g): group_status(m, self.ha.members[g])
                        for g, m in sorted(self.ha.groups.items())}
        for p, learner in sorted(self.ha.replication_done):  # stage 5: ReplicationDone
            if str(p + 1) in me["groups"]:
                me["groups"][str(p + 1)].setdefault("caught_up", []).append(learner)
        me["serving_groups"] = self.clients.serving_groups()
        me["forwarding"] = self.forwarding.status()
        me["consuming"] = self.consuming.status()
        me["transactions"] = self.transactions.status()
        me["declarations"] = self.declarations.status()
        if self.directory is not None:
            me["directory"] = self.directory.status()
