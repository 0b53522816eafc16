"""A queue whose enqueues and dequeues are ordered by another layer (a TxLog global queue).

The layer that orders a queue installs a ``QueueOrdering`` on it
(``Queue.ordering``; the TxLog bridge's ``GlobalQueuePolicy`` in
``txlog/bridge/global_queues.py``) and removes it when it stops ordering.
The broker and the AMQP layer never know that layer; they ask the queue:

- ``Queue.ordered``: its publishes and acknowledgements outside a transaction
  become one-operation transactions (the transaction's observers order them:
  ``amqp/methods/basic.py``, ``amqp/channel.py``, the management API);
- ``publish``: an enqueue the broker makes itself (a dead letter) goes to the
  ordering layer instead of ``Queue.enqueue``;
- ``refuse_*``: the operations that would change this broker's copy alone
  (a purge, deleting a non-empty queue, a no-ack consumer, a management
  ``get``) are refused with the reason the client sees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from brokerha.broker.message import Message
    from brokerha.broker.queue import Queue


class QueueOrdering:
    """The base: what an ordering layer answers for the queues it orders."""

    def publish(self, queues: list[Queue], message: Message) -> None:
        """An enqueue the broker makes itself (a dead letter) into these ordered queues."""
        raise NotImplementedError

    def refuse_purge(self, queue: Queue) -> str:
        """Why ``queue.purge`` is refused on this queue."""
        raise NotImplementedError

    def refuse_delete(self, queue: Queue) -> str | None:
        """Why deleting the queue now is refused (None: it may be deleted)."""
        raise NotImplementedError

    def refuse_no_ack(self, queue: Queue, method: str) -> str:
        """Why ``method`` with no-ack is refused on this queue."""
        raise NotImplementedError

    def refuse_get(self, queue: Queue) -> str:
        """Why the management API's ``get`` (a dequeue outside AMQP) is refused."""
        raise NotImplementedError
