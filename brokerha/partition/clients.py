"""Which clients a node running partition groups serves, and for which queues (stage 2).

Sans-I/O, as ``ha/admission.py``. A node of a partitioned cluster runs one
``HAMember`` per group it is in (``partition/member.py``), each with its own
``ClientAdmission``: whether it serves *that group's* clients is that
member's answer at the instant asked (its term: the verified primary of its
epoch within its lease, and the shell opened for it), never a flag of this
layer. Until stage 3 forwards a client's work to the partition's leader
(``partition/forward.py``), a node serves a queue only if it leads the
queue's partition:

- **A connection** is served if the node serves some group at the instant it
  is handed over (``admit``): the metadata group's primary, or the leader of
  any partition. Otherwise it is relayed to the metadata primary
  (``node/relay.py``, as today), or refused while none is known.
- **A queue** (declare, bind, purge, delete; a consume or get when the node has no
  ``consuming`` layer or the queue's copy no ``x-ha-id``) is served here
  only while this node serves the queue's group (``check_queue``); otherwise
  its declare, bind, unbind, purge and delete go to the group's leader
  (``queue_remote``, ``queue_request`` for the management API:
  ``partition/declarations.py``, stage 3), and without that layer, or while
  the node holds no table, the channel is closed with 404, RabbitMQ's answer
  for a queue whose home node is down or inaccessible, naming the partition
  and its leader as this node knows it. Never on a copy: a declare is checked
  before the queue exists.
- **A publish** (``publish``, stage 3) is routed here; a routed queue of a
  group this node serves is enqueued here, any other is forwarded to its
  group's leader by ``x-ha-id`` (``partition/forwarding.py``), and another
  node's exclusive queue (its stand-in here) to its owner node by name; the
  confirm waits for both. Every group is checked before anything is enqueued.
- **A consume or get** of a queue of a group this node does not serve goes to
  that group's leader (``consume_remote``, ``get_remote``: ``partition/consuming.py``,
  stage 3's remote consumers); ``cancel_remote`` and ``channel_closed`` carry the
  channel's cancel and release there.
- **The configuration** (a new exchange, a deleted one, exchange-to-exchange
  bindings) is the metadata group's: only its serving primary changes it
  (``check_configuration``).
- **A connection that passed a group's check is that group's client**: it is
  in that member's ``ClientAdmission`` and closed (320) in the step that ends
  the group's role, as a primary's clients are today. A connection that
  touched no group is closed when the node serves none (``lost_groups``).
- **A confirm** of data of a queue passes its group's gate and barriers
  (``after_durable``: ``Broker.after_durable_in`` of that member's
  ``durability_gate`` and ``barriers()``), one group after the other when a
  message went to queues of two groups; a message routed to no queue of any
  group (none, or exclusive ones only) passes the gate of a group this node
  serves now.
- **A transaction** (TX, stage 4): at ``tx.commit`` (``tx_commit``), one whose
  queues are all of one group this node serves (or of none) is today's local
  TX, answered through that group's gate; any other is committed by the
  node's coordinator across the partitions' leaders (``partition/transactions.py``),
  its acks, rejects and nacks settled by the partitions' branches -- a remote
  consumer's handed to its primary's branch (``NodeConsuming.hand_over``). XA
  (``check_transactions``) is a connection's ``partition/xa.py`` ``NodeXa``: a branch of
  one group served here is today's local XA, any other goes across partitions the same
  way (docs/ha.md "XA over partitions").
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from pamqp import commands

from brokerha.broker.errors import NotImplementedByBroker, PreconditionFailed
from brokerha.broker.message import Entry, Message
from brokerha.broker.placement import METADATA_GROUP, NotLeader
from brokerha.broker.queue import Queue
from brokerha.broker.transaction import Transaction
from brokerha.cluster.replication import HA_ID
from brokerha.ha.admission import Admission, ClientLink
from brokerha.ha.member import HAMember
from brokerha.partition.consuming import NodeConsuming
from brokerha.partition.declarations import DIRECTORY_OPS, NodeDeclarations
from brokerha.partition.directory import OWNERS_LANE, NodeDirectory, Owner
from brokerha.partition.forward import ForwardMessage, LaneKey
from brokerha.partition.forwarding import NodeForwarding
from brokerha.partition.member import PartitionedMember, group_of
from brokerha.partition.transactions import XTX_MAX_BYTES, NodeTransactions
from brokerha.partition.xa import NodeXa, copy_work
from brokerha.partition.xtx import XDequeue, XOp

log = logging.getLogger("brokerha.partition")


class GroupClients:
    """A partitioned node's client admission (``node/server.py``'s ``admission``) and the
    checks its AMQP methods make (``Broker.groups``, ``broker/placement.py``'s
    ``GroupGuard``). ``url_of(node)``: where a client reaches a node (for the texts)."""

    def __init__(self, member: PartitionedMember,
                 url_of: Callable[[str], str] = str) -> None:
        self.member = member
        self.url_of = url_of
        self.connections: dict[ClientLink, int] = {}  # served connection -> 0 (node-level)
        self._by_id: dict[int, ClientLink] = {}  # id(link): the AMQP connection's conn_id
        self.refused = 0
        # publishes refused (540) because this node holds no cell of some partition and
        # cannot route them completely (``check_route``)
        self.unroutable_refused = 0
        # the node's forwarding of publishes to the groups it does not serve (stage 3; the
        # shell sets it): None, a publish to such a group's queue is refused (404)
        self.forwarding: NodeForwarding | None = None
        # the node's remote consumers (stage 3; the shell sets it): None, a consume or get
        # of such a group's queue is refused (404)
        self.consuming: NodeConsuming | None = None
        # declarations of queues and exchanges of groups this node does not serve, asked of
        # their leaders (stage 3; the shell sets it): None, refused (404)
        self.declarations: NodeDeclarations | None = None
        # the node's coordinator of transactions across partitions (stage 4; the shell sets
        # it): None, a transaction whose commit is not local is refused (540)
        self.transactions: NodeTransactions | None = None
        # the queue directory (partition/directory.py; the shell sets it when a node holds
        # cells of only some partitions): None, a node outside a partition knows none of
        # its queues (``check_route`` refuses what it cannot route completely)
        self.directory: NodeDirectory | None = None
        # the directory kept for the exclusive queues' owners (always, with a directory
        # or not: ``_owned_listed``)
        self.owners: NodeDirectory | None = None

    # -- the node's admission (node/server.py, node/transport.py) -------------------------

    @property
    def _metadata(self) -> HAMember:
        return self.member.metadata

    @property
    def opened(self) -> int | None:
        """The metadata group's term the shell is open for (listeners, TxLog)."""
        return self._metadata.clients.opened

    def open(self, term: int) -> bool:
        """The shell is ready to serve the metadata group's ``term``."""
        return self._metadata.clients.open(term)

    def serving_groups(self) -> list[int]:
        """The groups whose clients this node serves at this instant."""
        return [g for g, m in sorted(self.member.groups.items()) if m.clients.term() is not None]

    @property
    def serving(self) -> bool:
        return any(m.clients.term() is not None for m in self.member.groups.values())

    def decide(self, can_relay: bool) -> Admission:
        if self.serving:
            return Admission.SERVE
        return Admission.RELAY if can_relay else Admission.REFUSE

    def admit(self, link: ClientLink) -> bool:
        if not self.serving:
            self.refused += 1
            return False
        self.connections[link] = 0
        self._by_id[id(link)] = link
        return True

    def gone(self, link: ClientLink) -> None:
        self.connections.pop(link, None)
        self._by_id.pop(id(link), None)
        for member in self.member.groups.values():
            member.clients.gone(link)

    def lost_groups(self) -> list[ClientLink]:
        """A group's role ended: if the node serves no group now, every connection is
        closed (those of the group closed already, with its role)."""
        if self.serving:
            return []
        closed = list(self.connections)
        for link in closed:
            self.gone(link)
            link.force_close()
        return closed

    # -- what the AMQP methods ask (broker/placement.py, GroupGuard) --------------------------

    def group_of_queue(self, vhost: str, name: str, arguments: Mapping[str, Any] | None,
                       exclusive: bool) -> int | None:
        """The group holding the queue (None: exclusive, in no partition); NotLeader while
        the node holds no table (its partition groups do not exist yet)."""
        if exclusive:
            return None
        placement = self.member.placement
        if placement is None:
            raise NotLeader(f"queue '{name}' in vhost '{vhost}': this node runs no partition "
                            "group yet (it holds no partition table); try again")
        return group_of(placement.of_name(vhost, name, (arguments or {}).get("x-partition")))

    def check_queue(self, client: object, vhost: str, name: str,
                    arguments: Mapping[str, Any] | None, exclusive: bool) -> None:
        group = self.group_of_queue(vhost, name, arguments, exclusive)
        if group is None:
            return
        host = self.member.broker.vhosts.get(vhost)
        local = None if host is None else host.queues.get(name)
        if local is not None and local.exclusive_owner is not None:
            return  # an exclusive queue of this node's: its vhost answers (405 to others)
        self._join(client, group, lambda: f"queue '{name}' in vhost '{vhost}' is in "
                                          f"partition {group - 1}")

    def routable(self, queues: list[Queue]) -> list[Queue]:
        # another node's exclusive queue: its stand-in here holds nothing, the publish is
        # forwarded to the owner node (``publish``: docs/ha.md "Exclusive queues on a
        # partitioned cluster"); without forwarding a publish only it took is
        # unroutable (a ``mandatory`` one returned), never dropped
        if self.forwarding is not None or not any(isinstance(q.exclusive_owner, Owner)
                                                  for q in queues):
            return queues
        return [q for q in queues if not isinstance(q.exclusive_owner, Owner)]

    def publish(self, client: object, vhost: str, queues: Sequence[Queue], message: Message,
                settle: Callable[[bool], None] | None) -> None:
        """A publish routed here to ``queues``: those of groups this node serves are
        enqueued here (the connection becomes their groups' client), the others' are
        forwarded by ``x-ha-id`` to their groups' leaders (``NodeForwarding``); every group
        is checked before anything is enqueued. ``settle(ack)`` once the local part passed
        its groups' gates and every forward was answered (a nack if a queue refused it).
        Another node's exclusive queue (its stand-in here) is forwarded to its owner node
        by name (``NodeForwarding``'s owner lanes: a nack while the link to it is down)."""
        self.check_route(vhost, message.exchange, queues)
        queues = self.routable(list(queues))  # (the management API's publish comes here)
        forwarding = self.forwarding
        local: list[Queue] = []
        remote: dict[LaneKey, list[str]] = {}
        for queue in queues:
            if isinstance(queue.exclusive_owner, Owner):  # another node's exclusive queue
                remote.setdefault(queue.exclusive_owner.node, []).append(queue.name)
                continue
            group = self.group_of_queue(vhost, queue.name, queue.arguments,
                                        queue.exclusive_owner is not None)
            if group is None:
                local.append(queue)
                continue
            member = self.member.groups.get(group)
            if forwarding is None or (member is not None and member.clients.term() is not None
                                      and not forwarding.under_way(group)):
                self.check_queue(client, vhost, queue.name, queue.arguments, False)
                local.append(queue)
                continue
            ha_id = queue.arguments.get(HA_ID)
            if ha_id is None:  # not a replicated copy: nothing names it to its leader
                raise NotLeader(f"queue '{queue.name}' in vhost '{vhost}' is in partition "
                                f"{group - 1}, {self._leader_text(group)}; its copy here has "
                                "no x-ha-id to forward to")
            remote.setdefault(group, []).append(str(ha_id))
        accepted = True
        for queue in local:
            accepted = queue.enqueue(message) and accepted
        if not remote:
            if settle is None:
                return
            if not accepted:
                settle(False)
            else:
                self.after_durable(local, lambda: settle(True))
            return
        assert forwarding is not None
        targets = {g: ForwardMessage(vhost, tuple(ids), message.exchange, message.routing_key,
                                     message.header, message.body)
                   for g, ids in remote.items()}
        if settle is None or not local:
            forwarding.publish(targets, settle, client)
            return
        both = _Both(settle)
        if accepted:
            self.after_durable(local, both.local_done)
        else:
            both.refused = True
            both.local_done()
        forwarding.publish(targets, both.remote_done, client)

    def unknown_partitions(self) -> list[int]:
        """The partitions whose queues and bindings this node does not know: those it runs
        no group of (it holds no cell of them; their declarations and bindings are in
        their own logs only) and the queue directory does not give it (no directory, its
        metadata copy not valid, no sync of the partition in it yet:
        ``directory.StandIns.known``), and with a directory those it is a learner of (a
        new cell catching up). NotLeader while it holds no table."""
        table = self.member.table
        if table is None:
            raise NotLeader("this node runs no partition group yet (it holds no partition "
                            "table): it cannot route a publish; try again")
        groups = self.member.groups
        directory = self.directory
        if len(groups) > table.partitions:  # keys are of 0..P: the metadata group and all P
            # (with a directory, and the partitions this node is a learner of)
            return [] if directory is None else directory.unknown([])
        missing = [p for p in range(table.partitions) if p + 1 not in groups]  # group_of
        return missing if directory is None else directory.unknown(missing)

    def check_route(self, vhost: str, exchange: str, queues: Sequence[Queue]) -> None:
        """Fail closed (docs/ha.md "Routing on a node outside a partition"): a node holding
        no cell of some partition routes to that partition's queues by the queue directory
        (``partition/directory.py``: stand-ins bound as the directory says); a partition
        the directory does not give it (``unknown_partitions``: no sync of it yet, this
        node's metadata copy catching up, a stand-in not bound) is one whose queues and
        bindings it does not know, so a publish it routes may miss queues it cannot see (it
        would be confirmed and dropped). Then it takes only what it routes completely: a
        publish to the default exchange whose routing key names a queue it holds (a name is
        one queue of its vhost). Anything else is refused (540) before anything is enqueued
        or confirmed: on a node holding a cell of, or knowing by the directory, every
        partition, nothing is refused."""
        if exchange == "" and queues:
            return
        missing = self.unknown_partitions()
        if not missing:
            return
        self.unroutable_refused += 1
        target = "the default exchange" if exchange == "" else f"exchange '{exchange}'"
        where = f" in vhost '{vhost}'" if vhost else ""
        raise NotImplementedByBroker(
            f"publish to {target}{where} on {self.member.me}: this node holds no "
            f"cell of partition{'s' if len(missing) > 1 else ''} "
            f"{', '.join(str(p) for p in missing)} and does not know "
            f"{'their' if len(missing) > 1 else 'its'} queues or bindings (not in its copy of "
            "the queue directory yet), so it cannot route the message to every queue it may "
            "reach; publish through a node holding a cell of every partition, or to the "
            "default exchange naming a queue of a partition this node holds (brokerha ctl "
            "partitions)")

    def _remote(self, queue: Queue) -> tuple[NodeConsuming, int, str] | None:
        """The consuming layer, group and x-ha-id of ``queue`` if its group is served
        elsewhere and its copy here names it (else None: ``check_queue`` decides)."""
        consuming = self.consuming
        if consuming is None or queue.exclusive_owner is not None:
            return None
        group = self.group_of_queue(queue.vhost, queue.name, queue.arguments, False)
        if group is None:
            return None
        member = self.member.groups.get(group)
        if member is not None and member.clients.term() is not None:
            return None
        ha_id = queue.arguments.get(HA_ID)
        if ha_id is None:
            return None
        return consuming, group, str(ha_id)

    def consume_remote(self, channel: Any, queue: Queue, tag: str, no_ack: bool,
                       exclusive: bool, nowait: bool) -> bool:
        remote = self._remote(queue)
        if remote is None:
            return False
        consuming, group, ha_id = remote
        consuming.consume(channel, queue, group, ha_id, tag, no_ack=no_ack,
                          exclusive=exclusive, nowait=nowait)
        return True

    def get_remote(self, channel: Any, queue: Queue, no_ack: bool) -> bool:
        remote = self._remote(queue)
        if remote is None:
            return False
        consuming, group, ha_id = remote
        consuming.get(channel, queue, group, ha_id, no_ack)
        return True

    def cancel_remote(self, channel: Any, tag: str) -> None:
        if self.consuming is not None:
            self.consuming.cancel(channel, tag)

    # -- declarations from any node (docs/ha.md "Declarations", partition/declarations.py) ---

    def queue_remote(self, channel: Any, method: Any, name: str) -> bool:
        """queue.declare, bind, unbind, purge or delete (``method``) of the queue ``name``
        (resolved), after the channel's permission checks: True if its group is served
        elsewhere and the method went to its leader (the channel answered later); False:
        this node serves it, the queue is exclusive (on this node only) or no group holds
        it yet (``check_queue`` decides as before)."""
        declarations = self.declarations
        if declarations is None:
            return False
        vhost = channel.vhost
        local = vhost.queues.get(name)
        if local is not None and local.exclusive_owner is not None:
            return False
        exclusive = isinstance(method, commands.Queue.Declare) and method.exclusive
        arguments = local.arguments if local is not None else \
            getattr(method, "arguments", None) if isinstance(method, commands.Queue.Declare) \
            else None
        if exclusive and not method.passive:
            return False
        try:
            group = self.group_of_queue(vhost.name, name, arguments, False)
        except NotLeader:
            return False
        member = self.member.groups.get(group) if group is not None else None
        if group is None or (member is not None and member.clients.term() is not None
                             and not self._listed(method)):
            return False
        declarations.queue_method(channel, group, method, name)
        return True

    def _listed(self, method: Any) -> bool:
        """Whether a queue method on its partition's leader goes through the leader's own
        declaration host, so that its answer waits for the queue directory to hold what it
        changed (``partition/directory.py``): a declare (not passive; a server-named one
        with the name this node drew), bind, unbind or delete, while the node keeps a
        directory."""
        if self.directory is None:
            return False
        if isinstance(method, commands.Queue.Declare):
            return not method.passive
        return isinstance(method, commands.Queue.Bind | commands.Queue.Unbind
                          | commands.Queue.Delete)

    def queue_request(self, vhost: str, name: str, arguments: Mapping[str, Any] | None,
                      op: str, args: list[Any]) -> Awaitable[list[Any]] | None:
        """The management API's ``op`` (``partition/declarations.py``'s ``QUEUE_OPS``) of
        the queue ``name``: if its partition is served elsewhere, asked of its leader (the
        awaitable's result is the leader's, or it raises ``LeaderRefused``); None: served
        here, exclusive, or no table yet (``check_queue`` decides as before)."""
        declarations = self.declarations
        if declarations is None:
            return None
        host = self.member.broker.vhosts.get(vhost)
        local = None if host is None else host.queues.get(name)
        if local is not None:
            if local.exclusive_owner is not None:
                return None
            arguments = local.arguments
        try:
            group = self.group_of_queue(vhost, name, arguments, False)
        except NotLeader:
            return None
        if group is None or (self._serves(group) and (
                self.directory is None or op not in DIRECTORY_OPS)):
            return None  # (with a directory, its leader's own host answers once it holds it)
        future: Awaitable[list[Any]] = declarations.request(group, op, args)
        return future

    def configuration_remote(self, channel: Any, method: Any) -> bool:
        """exchange.declare (of an exchange this node does not hold), delete, bind or unbind,
        after the channel's permission checks: True if the metadata group is served
        elsewhere and the method went to its leader; False: served here (or no
        ``declarations``: ``check_configuration`` decides as before)."""
        declarations = self.declarations
        if declarations is None:
            return False
        member = self.member.groups.get(METADATA_GROUP)
        if member is not None and member.clients.term() is not None:
            return False
        declarations.exchange_method(channel, method)
        return True

    def queue_home(self, queue: Queue) -> tuple[int | None, str | None]:
        """The queue's partition and its group's leader as this node knows it (the management
        API's ``partition`` and ``leader``): an exclusive queue is in no partition, on this
        node; (None, None) while the node holds no table."""
        try:
            group = self.group_of_queue(queue.vhost, queue.name, queue.arguments,
                                        queue.exclusive_owner is not None)
        except NotLeader:
            return None, None
        if group is None:
            return None, self.member.me
        member = self.member.groups.get(group)
        if member is not None:
            return group - 1, member.election.primary
        leader = None if self.declarations is None else self.declarations.leader_of(group)
        return group - 1, None if leader is None else leader[0]

    def channel_closed(self, channel: Any) -> None:
        if self.consuming is not None:
            self.consuming.channel_closed(channel)

    def serves_queue(self, vhost: str, name: str, arguments: Mapping[str, Any] | None,
                     exclusive: bool) -> bool:
        try:
            group = self.group_of_queue(vhost, name, arguments, exclusive)
        except NotLeader:
            return False
        member = None if group is None else self.member.groups.get(group)
        return group is None or (member is not None and member.clients.term() is not None)

    def check_configuration(self, client: object, what: str) -> None:
        self._join(client, METADATA_GROUP, lambda: f"cannot {what}: the exchanges are the "
                                                   "metadata group's")

    def check_transactions(self, client: object) -> NodeXa:
        """XA (dtx.*, the DTX control exchange) of ``client``'s channels: a branch in one
        group served here is today's local XA, another goes across partitions
        (``partition/xa.py``, docs/ha.md "XA over partitions"); refused (540) on a node
        with no coordinator."""
        if self.transactions is None:
            raise NotImplementedByBroker("XA transactions (dtx) on this node running "
                                         "partition groups: it has no transaction coordinator")
        return NodeXa(self, client)

    def serves_group(self, group: int) -> bool:
        """Whether this node serves partition group ``group`` now."""
        return self._serves(group)

    def tx_commit(self, client: object, tx: Transaction,
                  answer: Callable[[bool, str], None], *,
                  xa: str | None = None) -> Transaction | None:
        """tx.commit of ``tx`` (docs/ha.md "Transactions across partitions"): the
        transaction to commit here as today's local TX -- every queue it touches is of
        one group this node serves (or of none) -- or None: it spans partitions (or its
        partition is led elsewhere) and the node's coordinator commits it, ``answer
        (committed, reason)`` once every partition committed durably (or none did).
        Its acknowledgements, rejects and nacks of messages of groups served here go to
        those partitions' branches (``XDequeue``), and so do those of a remote consumer's
        (or get's) deliveries, handed by the primary that delivered them to its branch
        (``NodeConsuming.hand_over``); a transaction holding any of those goes through the
        coordinator. Refused (540) before anything is done: one of a message of this node's
        copy of a queue led elsewhere, an exclusive queue beside other partitions' queues,
        a publish to another node's exclusive queue (its stand-in here).
        ``xa``: an XA branch's prepare across
        partitions (the TM's xid key, ``partition/xa.py``): held for the TM, not committed."""
        for queues, message in tx.publishes:  # before anything is committed
            self.check_route(queues[0].vhost if queues else "", message.exchange, queues)
        published = [q for queues, _ in tx.publishes for q in queues]
        for elsewhere in published:  # (its owner is in no partition: no branch holds it)
            owner = elsewhere.exclusive_owner
            if not isinstance(owner, Owner):
                continue
            raise NotImplementedByBroker(
                f"a transaction publishing to exclusive queue '{elsewhere.name}' in vhost "
                f"'{elsewhere.vhost}' of a connection on node {owner.node}, not "
                f"{self.member.me}: "
                "it cannot be committed atomically there; publish it outside the "
                "transaction (with publisher confirms), or through the owner's node")
        consuming = self.consuming
        remote, accepts, rejects = NodeConsuming.remote_settles(tx.accepts, tx.rejects)
        acked = [q for q, _ in accepts] + [q for q, _, _ in rejects]
        groups: dict[int | None, list[Queue]] = {}
        for queue in published + acked:
            group = self.group_of_queue(queue.vhost, queue.name, queue.arguments,
                                        queue.exclusive_owner is not None)
            groups.setdefault(group, []).append(queue)
        for r in remote:
            groups.setdefault(r.delivery.group, [])
        partitioned = [g for g in groups if g is not None]
        forwarding = self.forwarding
        # a lane under way to a group served here: its publishes go that way too (their
        # order kept), but acknowledgements can only be committed here
        if not remote and len(partitioned) <= 1 and all(self._serves(g) and (
                forwarding is None or acked or not forwarding.under_way(g))
                for g in partitioned):
            for group in partitioned:
                for queue in groups[group]:
                    self.check_queue(client, queue.vhost, queue.name, queue.arguments, False)
            return tx if not partitioned else self._with_observer(tx, partitioned[0])
        transactions = self.transactions
        if transactions is None:
            raise NotImplementedByBroker("a transaction across partitions on this node (no "
                                         "coordinator)")
        handed: dict[int, list[tuple[Queue, Entry]]] = {}
        rejected: dict[int, list[tuple[Queue, Entry, bool]]] = {}
        for queue, entry, requeue in [(q, e, None) for q, e in accepts] + rejects:
            group = self.group_of_queue(queue.vhost, queue.name, queue.arguments,
                                        queue.exclusive_owner is not None)
            host = self.member.broker.vhosts.get(queue.vhost)
            if group is None or not self._serves(group) or host is None \
                    or host.queues.get(queue.name) is not queue:
                raise NotImplementedByBroker(
                    f"a transaction settling a message of queue '{queue.name}' (in "
                    f"partition {'none' if group is None else group - 1}, not led by this "
                    "node) whose commit goes to other partitions' leaders: settle it "
                    "outside the transaction, or in one on the leader of its partition")
            if requeue is None:
                handed.setdefault(group, []).append((queue, entry))
            else:
                rejected.setdefault(group, []).append((queue, entry, requeue))
        for queue in {id(q): q for q in acked}.values():
            self.check_queue(client, queue.vhost, queue.name, queue.arguments, False)
        if None in groups:
            raise NotImplementedByBroker("a transaction publishing to an exclusive queue and "
                                         "to queues of partitions led elsewhere")
        branches: dict[int, list[XOp]] = {}
        size = 0
        for queues, message in tx.publishes:
            by_group: dict[int, list[str]] = {}
            for queue in queues:
                group = self.group_of_queue(queue.vhost, queue.name, queue.arguments, False)
                assert group is not None
                ha_id = queue.arguments.get(HA_ID)
                if ha_id is None:
                    raise NotLeader(f"queue '{queue.name}' in vhost '{queue.vhost}' is in "
                                    f"partition {group - 1}, {self._leader_text(group)}; its "
                                    "copy here has no x-ha-id to name it to its leader")
                by_group.setdefault(group, []).append(str(ha_id))
            for group, ids in by_group.items():
                size += message.size
                branches.setdefault(group - 1, []).append(ForwardMessage(
                    queues[0].vhost, tuple(ids), message.exchange, message.routing_key,
                    message.header, message.body))
        if size > XTX_MAX_BYTES:
            raise PreconditionFailed(f"a transaction of {size} bytes across partitions (at "
                                     f"most {XTX_MAX_BYTES}: one packet carries a partition's "
                                     "share): commit it in smaller transactions")
        # a remote delivery's ack or reject: its partition's branch settles it, by position
        by_queue: dict[tuple[int, str, str, str], list[int]] = {}
        for r in remote:
            d = r.delivery
            by_queue.setdefault((d.group - 1, d.vhost, r.stand_in.queue.name, r.how),
                                []).append(d.position)
        for (partition, vhost, name, how), positions in by_queue.items():
            branches.setdefault(partition, []).append(
                XDequeue(vhost, name, tuple(positions), how))
        # nothing of it is applied here: the partitions' leaders apply it; the entries it
        # acknowledged stay acquired, handed to their partitions' branches
        tx.rollback()
        if not remote or consuming is None:
            transactions.commit(branches, answer, handed, xa=xa, rejected=rejected)
            return None
        holding = consuming

        def answered(committed: bool, reason: str) -> None:
            # committed: settled durably by the branches (an XA prepare is only held)
            holding.handed_answered(remote, committed and xa is None)
            answer(committed, reason)

        transactions.commit(branches, answered, handed, xa=xa, rejected=rejected,
                            hand_over=lambda gtxid: holding.hand_over(gtxid, remote))
        return None

    def _serves(self, group: int) -> bool:
        member = self.member.groups.get(group)
        return member is not None and member.clients.term() is not None

    def _with_observer(self, tx: Transaction, group: int) -> Transaction:
        """``tx``, or its copy made now if the group's primary attached no observer to it
        (made before this node led the group: its commit would reach no backup)."""
        primary = self.member.groups[group].primary
        if primary is None or any(getattr(o, "primary", None) is primary
                                  for o in tx.observers):
            return tx
        fresh = copy_work(tx, self.member.broker.new_transaction())
        tx.rollback()
        return fresh

    def _join(self, client: object, group: int, what: Callable[[], str]) -> None:
        """The client is served for ``group`` now (it becomes that group's client), or
        NotLeader says who leads it. ``client`` None: a request of the management API
        (admin/management.py), served at once, no connection to close later."""
        member = self.member.groups.get(group)
        link = None if client is None else self._by_id.get(getattr(client, "conn_id", -1))
        term = member.clients.term() if member is not None else None
        if member is not None and term is not None and (client is None or link is not None):
            if link is not None:
                member.clients.connections[link] = term
            return
        raise NotLeader(f"{what()}, {self._leader_text(group)}; a queue is declared, bound, "
                        "purged and deleted on its partition's leader only (publishes, "
                        "consumes and gets of it are carried there from any node)")

    def _leader_text(self, group: int) -> str:
        me = self.member.me
        member = self.member.groups.get(group)
        if member is None:
            table = self.member.table
            cells = table.voting(group - 1) if table is not None and group else []
            return f"whose cells are {', '.join(cells)}, not {me}"
        leader = member.election.primary
        if leader is None:
            return f"which has no leader now (election under way); not served by {me}"
        if leader == me:
            return f"whose leader {me} is not serving it now (verifying, or its lease lapsed)"
        return (f"led by {leader} (epoch {member.election.epoch}, {self.url_of(leader)}), "
                f"not by {me}")

    def after_durable(self, queues: Sequence[Queue], callback: Callable[[], None]) -> None:
        callback = self._owned_listed(queues, callback)
        placement = self.member.placement
        groups = sorted({group_of(p) for q in queues
                         if placement is not None
                         and (p := placement.partition(q)) is not None})
        if not groups:  # no group's data: whichever group this node serves now answers
            groups = self.serving_groups()[:1]
        self._after_durable_in(groups, callback)

    def after_durable_served(self, callback: Callable[[], None]) -> None:
        """``callback`` once everything done so far in every group this node serves now
        is durable (each group's gate and barriers, one after the other); never when it
        serves none (fail closed: counted in ``durable_refused``)."""
        self._after_durable_in(self.serving_groups(), callback)

    def _after_durable_in(self, groups: Sequence[int], callback: Callable[[], None]) -> None:
        """``callback`` through each of ``groups``' gate and barriers in turn; never (counted
        in ``durable_refused``) if there is none, or one is not a group of this node's."""
        members = [m for g in groups if (m := self.member.groups.get(g)) is not None]
        if not members or len(members) != len(groups):
            self.member.broker.durable_refused += 1
            return
        chain = callback
        for member in reversed(members):
            chain = self._through(member, chain)
        chain()

    def after_bound(self, queue: Queue, callback: Callable[[], None]) -> None:
        self._owned_listed([queue], callback, changed=True)()

    def _owned_listed(self, queues: Sequence[Queue], callback: Callable[[], None], *,
                      changed: bool = False) -> Callable[[], None]:
        """``callback`` once the queue directory holds the exclusive queues among ``queues``
        (their owner entries: another node answers 405 for them, docs/ha.md "Exclusive
        queues on a partitioned cluster"; ``changed``: their entries again, their
        bindings changed); never if that failed (fail closed: counted in
        ``durable_refused``, the owner's connection closed 320 CONNECTION_FORCED, so
        its exclusive queues go)."""
        directory = self.owners
        if directory is None:
            return callback
        # (a confirm or a purge of an exclusive queue the directory names already: at once)
        held, me = directory.layer.directory.entries, self.member.me
        keys = [(q.vhost, q.name) for q in queues if q.exclusive_owner is not None
                and not isinstance(q.exclusive_owner, Owner)
                and (changed or (e := held.get((q.vhost, q.name))) is None or e.ha_id != me)]
        if not keys:
            return callback
        if directory.layer.unsafe.answer_exclusive_before_directory:  # (unsafe) not waited
            directory.writer.record(OWNERS_LANE, keys, lambda position: None)
            return callback
        broker = self.member.broker
        owners = [q.exclusive_owner for q in queues if q.exclusive_owner is not None
                  and (q.vhost, q.name) in keys]

        def record() -> None:
            def done(position: list[int] | None) -> None:
                if position is None:  # whether another node says 405 is unknown: 320
                    from brokerha.amqp.errors import AMQPError

                    broker.durable_refused += 1
                    log.warning("exclusive queue %s: not in the queue directory (the "
                                "metadata leader did not take it); not answered", keys)
                    for conn in owners:
                        fail = getattr(conn, "fail", None)
                        if fail is not None:
                            fail(None, AMQPError(320, "CONNECTION_FORCED - the queue "
                                                 "directory did not take exclusive queue "
                                                 f"'{keys[0][1]}'; try again", 0, 0))
                    return
                callback()
            directory.writer.record(OWNERS_LANE, keys, done)

        return record

    def _through(self, member: HAMember, then: Callable[[], None]) -> Callable[[], None]:
        broker = self.member.broker

        def ask() -> None:
            broker.after_durable_in(member.durability_gate, then, member.barriers())

        return ask


class _Both:
    """A publish's confirm that waits for its local part and its forwards: a nack if
    either refused it."""

    __slots__ = ("settle", "waiting", "refused")

    def __init__(self, settle: Callable[[bool], None]) -> None:
        self.settle = settle
        self.waiting = 2
        self.refused = False

    def local_done(self) -> None:
        self._one(True)

    def remote_done(self, ack: bool) -> None:
        self._one(ack)

    def _one(self, ack: bool) -> None:
        self.refused = self.refused or not ack
        self.waiting -= 1
        if self.waiting == 0:
            self.settle(not self.refused)
