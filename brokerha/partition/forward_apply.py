"""A group primary's forwards applied to its ``Broker``: the ``ForwardLog`` of
``partition/forward.py`` (docs/ha.md "Clients on any node").

The mark of an origin must travel in the group's log *with* the enqueues it
covers: a cell whose position holds a forward's enqueues but not its mark
would take the sender's resend after a failover as new (a duplicate), one
holding the mark without the enqueues would drop it (a loss). The log's one
unit that holds several enqueues and a name atomically is a transaction's
``tc`` (``cluster/replication.py``): every backup applies it whole, and its
position is never inside it (a commit applied in slices keeps the position
invalid until its last). So a batch is applied as a local TX
(``ForwardBatch``) whose client id is its mark (``forward.mark_name``:
``fw:<group>:<upto>:<refused>:<origin>``); the TX's ``tc`` carries the
enqueues (``e`` ops) and the client id, every backup records it with the
outcome (``TxOutcomes``) in the same store batch, a joining backup gets it in
its catch-up's ``to``, and a new primary reads the marks back (``recover_marks``).
No new event kind, no new field: the wire is today's.

Where the marks are kept: ``TxOutcomes`` keeps a mark's record apart from the
clients' (``TxOutcomes.marks``, ``broker/tx_outcomes.py``): the newest per
(group, origin) only -- the one before is deleted from the store in the same
callback, so the store holds one row per origin, in the outcomes' table, no
schema change --, not counted against ``MAX_RECORDS``/``MAX_AGE`` (a sustained
forwarding would otherwise evict the clients' records, and a mark evicted
while its sender still resends would let a duplicate in). The newest mark
names every refused fseq above ``upto - REFUSED_KEPT`` (the marks before it
are gone: ``ForwardBatch`` carries their refused ones on), enough for any
resend (a sender's unanswered messages are contiguous and at most its
window). Origins not heard for ``MARK_MAX_AGE``, and beyond
``MARK_MAX_ORIGINS`` in a group (the least recently heard), are dropped: an
origin is a start of a node, and a live sender with something unanswered
resends it every few seconds. A group's catch-up replaces that group's marks
only (``TransactionReplicator`` with its group's scope; ``keep_only`` goes by
the group the mark's name says): another group's marks on the joining node
stay (tests/partition/test_forward_marks.py).

A node's own exclusive queues (``OwnedForwardLog``, the receiver of group
``OWNER_GROUP``) are in no group's log: their messages are enqueued as a publish of
the owner's own clients is, and the marks are the receiver's, in memory (an
exclusive queue does not outlive its node's start, nor a sender's lane the link).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from brokerha.broker.broker import Broker
from brokerha.broker.message import Message
from brokerha.broker.queue import Queue
from brokerha.broker.transaction import Transaction, TransactionObserverFactory
from brokerha.broker.tx_outcomes import COMMITTED
from brokerha.cluster.replication import HA_ID
from brokerha.partition.directory import Owner
from brokerha.partition.forward import ForwardMessage, Mark, mark_name, marks_from

# (origin, fseq, queue, position): where an applied message went (simulations check it)
Placed = Callable[[str, int, Queue, int], None]


class ForwardBatch(Transaction):
    """One forward's new messages as a TX: enqueued message by message (a refusal is
    known per message), its client id the mark once applied."""

    def __init__(self, tx_id: str, factories: list[TransactionObserverFactory], *,
                 group: int, origin: str, upto: int, broker: Broker,
                 placed: Placed | None = None, refused_before: Iterable[int] = ()) -> None:
        super().__init__(tx_id, factories, on_outcome=self._record)
        self.group = group
        self.origin = origin
        self.upto = upto
        self.broker = broker
        self.placed = placed
        self.fseqs: list[int] = []
        self.refused: list[int] = []
        # the origin's refused fseqs the mark before named: the new mark names them too (the
        # outcomes keep the newest mark only)
        self.refused_before = list(refused_before)

    def add(self, fseq: int, queues: list[Queue], message: Message) -> None:
        self.fseqs.append(fseq)
        self.publish(queues, message)

    def apply(self) -> None:
        for fseq, (queues, message) in zip(self.fseqs, self.publishes, strict=True):
            refused = False
            for queue in queues:
                if queue.deleted:
                    continue
                before = queue.next_position
                if not queue.enqueue(message):
                    refused = True
                elif self.placed is not None and queue.next_position > before:
                    self.placed(self.origin, fseq, queue, before)
            if refused:
                self.refused.append(fseq)
        # the mark: recorded with the outcome, sent in the tc (read at the observers' commit)
        self.client_id = mark_name(self.group, self.origin, self.upto,
                                   [*self.refused_before, *self.refused])

    def _record(self, tx: Transaction, outcome: str) -> None:
        if outcome == COMMITTED:  # as Broker's recorder: in the commit's loop callback
            self.broker.outcomes.record(tx.replication_id or tx.id, tx.client_id, outcome)


class BrokerForwardLog:
    """``forward.ForwardLog`` over a group primary's ``Broker``."""

    def __init__(self, broker: Broker, group: int, in_group: Callable[[Queue], bool], *,
                 placed: Placed | None = None) -> None:
        """``in_group``: whether a queue is the group's (``PartitionScope.of``): an
        ``x-ha-id`` is its group log's ``<epoch>.<seq>``, unique within the group only."""
        self.broker = broker
        self.group = group
        self.in_group = in_group
        self.placed = placed
        self._queues: dict[tuple[str, str], Queue] = {}
        self._batches = 0
        self.unknown_queues = 0  # queue names not held (deleted, or another incarnation)

    def queue(self, vhost: str, ha_id: str) -> Queue | None:
        """The queue whose incarnation is ``ha_id`` (its ``x-ha-id``), if held."""
        queue = self._queues.get((vhost, ha_id))
        if queue is not None and not queue.deleted:
            return queue
        host = self.broker.vhosts.get(vhost)
        if host is None:
            return None
        self._queues = {k: q for k, q in self._queues.items() if k[0] != vhost}
        for q in host.queues.values():
            qid = q.arguments.get(HA_ID)
            if qid is not None and self.in_group(q):
                self._queues[(vhost, str(qid))] = q
        return self._queues.get((vhost, ha_id))

    def apply(self, origin: str, upto: int,
              messages: Sequence[tuple[int, ForwardMessage]]) -> list[int]:
        self._batches += 1
        held = self.broker.outcomes.marks.get((self.group, origin))
        before = marks_from(self.group, [held[1]]).get(origin) if held is not None else None
        batch = ForwardBatch(f"{self.broker.node_name}:fw:{self.group}:{self._batches}",
                             self.broker.observers.transactions, group=self.group,
                             origin=origin, upto=upto, broker=self.broker, placed=self.placed,
                             refused_before=() if before is None else before.refused)
        for fseq, m in messages:
            queues = []
            for ha_id in m.queues:
                queue = self.queue(m.vhost, ha_id)
                if queue is None:
                    self.unknown_queues += 1
                else:
                    queues.append(queue)
            batch.add(fseq, queues, Message(m.exchange, m.routing_key, m.header, m.body))
        if batch.needs_prepare():
            raise RuntimeError("a forward's transaction cannot wait for a prepare round")
        batch.commit_prepared()
        return batch.refused


class OwnedForwardLog:
    """``forward.ForwardLog`` of a node's own exclusive queues (docs/ha.md "Exclusive queues
    on a partitioned cluster"): a message names them by name, each enqueued as a local
    publish to it is (``GroupClients.publish``); one this node does not hold as an
    exclusive queue of one of its connections now (its connection closed, the queue
    deleted) is left out, as a publish routed to a queue deleted meanwhile."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.applied = 0
        self.unknown_queues = 0  # queue names not held (gone since the sender routed)

    def queue(self, vhost: str, name: str) -> Queue | None:
        host = self.broker.vhosts.get(vhost)
        queue = None if host is None else host.queues.get(name)
        if queue is None or queue.exclusive_owner is None \
                or isinstance(queue.exclusive_owner, Owner) or queue.deleted:
            return None
        return queue

    def apply(self, origin: str, upto: int,
              messages: Sequence[tuple[int, ForwardMessage]]) -> list[int]:
        refused: list[int] = []
        for fseq, m in messages:
            message = Message(m.exchange, m.routing_key, m.header, m.body)
            accepted = True
            for name in m.queues:
                queue = self.queue(m.vhost, name)
                if queue is None:
                    self.unknown_queues += 1
                else:
                    accepted = queue.enqueue(message) and accepted
            if not accepted:
                refused.append(fseq)
            self.applied += 1
        return refused


def recover_marks(broker: Broker, group: int) -> dict[str, Mark]:
    """The marks of ``group`` this node's store holds (a new primary's receiver starts so)."""
    return marks_from(group, (record[1] for record in broker.outcomes.marks_of(group)))
