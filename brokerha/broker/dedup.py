"""Per-queue deduplication window: a client's resend after failover is dropped, not delivered twice.

pika, aio-pika and kombu resend what was not confirmed when they reconnect; a
message that was stored (and replicated) but whose confirm was lost in the
failover then arrives a second time. A queue declared with the argument
``x-deduplication-window`` (N > 0) remembers the ids of the last N messages it
took in and drops a message whose id it remembers, still accepting the publish
(a publisher confirm acks it: the first copy was stored already).

The id of a message is its ``x-deduplication-id`` header when that is a
non-empty string, bytes or integer, else its ``message_id`` property; ids are
compared as text. A message without an id is never deduplicated.

Where ids are remembered (``Queue.add_entry`` and ``Queue.restore_entry``):

* every entry added to the queue, on the primary and on a backup alike (backups
  receive replicated entries through ``add_entry``), so a backup that followed
  the queue holds the same window as its primary and drops the resend once
  promoted;
* every entry restored from the store at start-up. The store holds only
  messages still on the queue, so after a restart the window knows the ids of
  the messages still queued, not of those consumed before the restart; the same
  holds for a backup that joins later (the catch-up sends the queued messages).

Only ``Queue.enqueue`` checks the window; a message the broker republishes itself
(dead-lettering) is not checked, so a DLX retry loop back into the queue works.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from brokerha.broker.content import read_message_id

if TYPE_CHECKING:
    from brokerha.broker.message import Message

log = logging.getLogger(__name__)

WINDOW_ARG = "x-deduplication-window"
ID_HEADER = "x-deduplication-id"
MAX_WINDOW = 1_000_000


def deduplication_id(message: Message) -> str | None:
    """The id a deduplicating queue keys a message by, or None (never deduplicated)."""
    if message._headers_at >= 0:
        value = message.headers.get(ID_HEADER)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "surrogateescape")
        elif isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value:
            return value
    return read_message_id(message.header) or None


class DedupWindow:
    """The ids of the last ``size`` messages a queue took in, oldest first.

    ``dropped`` counts the messages dropped as duplicates (for metrics).
    """

    __slots__ = ("size", "owner", "dropped", "_ids", "_last")

    def __init__(self, size: int, owner: str = "queue") -> None:
        self.size = size
        self.owner = owner  # for log lines: "queue 'q' in vhost '/'"
        self.dropped = 0
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._last: tuple[Message, str] | None = None  # the id drops() just read

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, key: object) -> bool:
        return key in self._ids

    def ids(self) -> list[str]:
        """The remembered ids, oldest first."""
        return list(self._ids)

    def drops(self, message: Message) -> bool:
        """Whether the queue must drop this published message: its id is in the window."""
        key = deduplication_id(message)
        if key is None:
            return False
        if key in self._ids:
            self.dropped += 1
            log.debug("%s: dropped a duplicate of message id %r", self.owner, key)
            return True
        self._last = (message, key)  # remember() usually follows: read the id once
        return False

    def remember(self, message: Message) -> None:
        """Note a message the queue took in; a full window forgets its oldest id."""
        last, self._last = self._last, None
        key = last[1] if last is not None and last[0] is message else deduplication_id(message)
        if key is None:
            return
        ids = self._ids
        if key in ids:
            ids.move_to_end(key)
            return
        ids[key] = None
        if len(ids) > self.size:
            ids.popitem(last=False)
