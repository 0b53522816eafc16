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

from collections.abc import Callable
from dataclasses import dataclass

from brokerha.broker.queue import Queue

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
