"""QueueGuard (seed 002): where one queue stood when one backup joined.

The catch-up carries the queue below the guard's ``position`` (the queue's
next position at the join); every later change goes out live, numbered after
the join's ``seq``. The queue is caught up on that backup once the backup
acknowledged ``ready_seq``, the seq of the queue's last catch-up event, known
once the streamed catch-up (``catch_up.py``) has made it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class QueueGuard:
    vhost: str
    queue: str
    position: int   # the queue's next position at the join: the first one sent live
    seq: int        # the primary's seq at the join (the CaughtUp marker's)
    ready_seq: int | None = None  # the seq of this queue's last catch-up event, once made

    def passed(self, acked: int) -> bool:
        """The backup acknowledged this queue's catch-up."""
        return self.ready_seq is not None and acked >= self.ready_seq
