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
- **A queue** (declare, bind, publish, consume, get, purge, delete) is served
  only while this node serves the queue's group (``check_queue``): otherwise
  the channel is closed with 404, RabbitMQ's answer for a queue whose home
  node is down or inaccessible, naming the partition and its leader as this
  node knows it. Never on a copy: a declare is checked before the queue
  exists, a publish before anything is enqueued into any routed queue.
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
  serves now. Transactions (TX and XA) are refused (540): their
  cross-group commit is stage 4's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from brokerha.broker.errors import NotImplementedByBroker
from brokerha.broker.placement import METADATA_GROUP, NotLeader
from brokerha.broker.queue import Queue
from brokerha.ha.admission import Admission, ClientLink
from brokerha.ha.member import HAMember
from brokerha.partition.member import PartitionedMember, group_of


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
        self._join(client, group, lambda: f"queue '{name}' in vhost '{vhost}' is in "
                                          f"partition {group - 1}")

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

    def check_transactions(self) -> None:
        raise NotImplementedByBroker("transactions on a node running partition groups (a "
                                     "commit across groups is issue 35 stage 4's)")

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
        raise NotLeader(f"{what()}, {self._leader_text(group)}; stage 2 of partitioning "
                        "serves a queue on its partition's leader only")

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
        placement = self.member.placement
        groups = sorted({group_of(p) for q in queues
                         if placement is not None
                         and (p := placement.partition(q)) is not None})
        if not groups:  # no group's data: whichever group this node serves now answers
            serving = self.serving_groups()
            if not serving:
                self.member.broker.durable_refused += 1
                return
            groups = serving[:1]
        members = [self.member.groups.get(g) for g in groups]
        chain = callback
        for member in reversed(members):
            if member is None:  # not a group of ours (checked before): never confirmed
                self.member.broker.durable_refused += 1
                return
            chain = self._through(member, chain)
        chain()

    def _through(self, member: HAMember, then: Callable[[], None]) -> Callable[[], None]:
        broker = self.member.broker

        def ask() -> None:
            broker.after_durable_in(member.durability_gate, then, member.barriers())

        return ask
