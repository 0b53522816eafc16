"""Which replication group holds what of a broker: a group's scope (docs/ha.md "Partitions").

A node of a partitioned cluster (issue 35) runs several replication groups
over one ``Broker``: the metadata group (group 0: definitions, exchanges, the
exchange-to-exchange bindings) and one group per partition cell it holds
(group p + 1: the queues of partition p, their bindings and messages). Each
group's ``Primary`` observes, and each group's ``Backup`` applies, only what
its ``GroupScope`` says is its own; two scopes of one node never overlap, so
a node may be the primary of one group and a backup of another at once.

With one group (P = 1) there is no scope (``None`` wherever one is taken):
the one group holds the whole broker, as it always did.

Lives in ``broker/`` because both ``primary/`` and ``backup/`` (floors above)
read it and the broker model is what it describes; it imports nothing of HA.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from brokerha.broker.errors import NotFound
from brokerha.broker.message import Message
from brokerha.broker.queue import Queue

if TYPE_CHECKING:
    from brokerha.broker.dtx import XaResource
    from brokerha.broker.transaction import Transaction

METADATA_GROUP = 0


@dataclass(frozen=True)
class GroupScope:
    """What replication group ``group`` holds of a node's broker.

    ``queues``: whether a queue (its declaration, bindings to it, messages) is the
    group's; ``configuration``: whether the definitions, exchanges and
    exchange-to-exchange bindings are (the metadata group's only).
    """

    group: int
    queues: Callable[[Queue], bool]
    configuration: bool

    def overlaps(self, other: GroupScope | None) -> bool:
        """Whether two groups would replicate the same things (a node may not be the
        primary of one and a backup of the other): the same group, or ``None`` (the
        whole broker)."""
        return other is None or other.group == self.group

    def holds_binding_to(self, destination: object) -> bool:
        """A binding is the group of its destination: a queue's, or the metadata group's
        for an exchange."""
        if isinstance(destination, Queue):
            return self.queues(destination)
        return self.configuration

    def __str__(self) -> str:
        return "metadata group" if self.group == METADATA_GROUP else f"group {self.group}"


def scope_of(observer: object) -> GroupScope | None:
    """The scope an HA observer of a broker replicates (``None``: the whole broker)."""
    scope = getattr(observer, "scope", None)
    return scope if isinstance(scope, GroupScope) else None


def no_queues(queue: Queue) -> bool:
    """The metadata group's ``queues``: none (stage 3 adds the queue directory)."""
    return False


QueuePredicate = Callable[[Queue], bool]


class NotLeader(NotFound):
    """A client asked a node for a queue (or a configuration change) of a replication group
    this node does not lead now: 404, RabbitMQ's answer for a queue whose home node is
    down or unreachable from the client's node ("home node ... is down or inaccessible").
    A partitioned node of stage 2 serves a queue only on its partition's leader; stage 3
    forwards instead (docs/ha.md "Partitions")."""


class GroupGuard(Protocol):
    """What the AMQP methods ask the node before they act, on a node running partition
    groups (``Broker.groups``; None everywhere else, and every method is today's).

    ``client`` is the AMQP connection asking (``ServerConnection``): once a check
    passes, the connection is among the clients of that group, closed (320) in the
    step that ends the group's role, as a primary's clients are today. None: the
    management API's request (answered at once: no connection to close later).
    """

    def check_queue(self, client: object, vhost: str, name: str,
                    arguments: Mapping[str, Any] | None, exclusive: bool) -> None:
        """Raise ``NotLeader`` unless this node serves the group holding the queue now."""

    def routable(self, queues: list[Queue]) -> list[Queue]:
        """The routed ``queues`` a publish on this node reaches: a stand-in of another
        node's exclusive queue too while the node forwards (``publish`` carries it to the
        owner node); without forwarding not (a publish only it took is unroutable: a
        ``mandatory`` one is returned)."""
        ...

    def after_bound(self, queue: Queue, callback: Callable[[], None]) -> None:
        """The bindings of ``queue``, an exclusive queue of this node's connection, changed:
        ``callback`` once the queue directory names them (another node's stand-in routes
        by them); never if that failed (the owner's connection is closed 320)."""

    def publish(self, client: object, vhost: str, queues: Sequence[Queue], message: Message,
                settle: Callable[[bool], None] | None) -> None:
        """A publish routed to ``queues``: enqueue it on those of groups this node serves,
        forward it to the leaders of the others' (stage 3), or raise ``NotLeader`` before
        anything is enqueued -- or ``NotImplementedByBroker`` (540) if this node holds no
        cell of some partition and cannot route it completely (no queue directory:
        anything but the default exchange naming a queue it holds); ``settle(ack)`` once
        every target answered (None: no confirm asked)."""

    def consume_remote(self, channel: Any, queue: Queue, tag: str, no_ack: bool,
                       exclusive: bool, nowait: bool) -> bool:
        """basic.consume of ``queue``: True if its group is served elsewhere and the consumer
        went to its leader (stage 3's remote consumers, ``channel.consumers[tag]`` set);
        False: this node serves it (``check_queue`` decides as before)."""

    def get_remote(self, channel: Any, queue: Queue, no_ack: bool) -> bool:
        """basic.get of ``queue``: True if asked of its group's leader elsewhere (the
        channel answered later), False as ``consume_remote``."""

    def cancel_remote(self, channel: Any, tag: str) -> None:
        """basic.cancel of a consumer ``tag`` (a remote one's goes to its leader)."""

    def channel_closed(self, channel: Any) -> None:
        """The channel is released: its remote consumers closed, before its unacked are
        requeued."""

    def serves_queue(self, vhost: str, name: str, arguments: Mapping[str, Any] | None,
                     exclusive: bool) -> bool:
        """Whether this node serves the group of such a queue now (``check_queue`` would
        pass): a server-named queue is given a name this node serves."""

    def queue_remote(self, channel: Any, method: Any, name: str) -> bool:
        """A queue method (declare, bind, unbind, purge, delete) of ``name``: True if its
        group is served elsewhere and it went to that group's leader (the channel answered
        later, partition/declarations.py); False: decided here as before."""

    def queue_request(self, vhost: str, name: str, arguments: Mapping[str, Any] | None,
                      op: str, args: list[Any]) -> Awaitable[list[Any]] | None:
        """The management API's queue method: an awaitable of its group's leader's answer if
        that group is served elsewhere (partition/declarations.py), else None."""

    def configuration_remote(self, channel: Any, method: Any) -> bool:
        """An exchange method changing the configuration: True if it went to the metadata
        group's leader (the channel answered later); False: decided here as before."""

    def queue_home(self, queue: Queue) -> tuple[int | None, str | None]:
        """The queue's partition (None: exclusive, in none) and its group's leader as this
        node knows it (the management API's queue objects)."""

    def check_configuration(self, client: object, what: str) -> None:
        """Raise ``NotLeader`` unless this node serves the metadata group now."""

    def check_transactions(self, client: object) -> XaResource:
        """The XA resource manager of ``client``'s channels on this node (``partition/xa.py``:
        a branch across partitions, docs/ha.md "XA over partitions"), or raise (540)."""

    def tx_commit(self, client: object, tx: Transaction,
                  answer: Callable[[bool, str], None]) -> Transaction | None:
        """tx.commit of ``tx``: the transaction to commit here as a local TX (its queues'
        groups' gates answer it: ``after_durable``), or None: committed across partitions
        by the node's coordinator, ``answer(committed, reason)`` later; raises (540) for
        what such a commit does not take."""

    def after_durable(self, queues: Sequence[Queue], callback: Callable[[], None]) -> None:
        """``Broker.after_durable`` for data of these queues: through the gate and barriers
        of every group holding one of them (``Broker.after_durable_in``)."""
