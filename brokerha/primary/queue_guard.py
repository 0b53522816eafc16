"""QueueGuard (seed 002): where one queue stood when one backup joined.

The catch-up carries the queue as it was at the join, every later change goes
out live, numbered after the join's seq; so everything enqueued past the
guard's ``position`` is confirmed only once this backup acknowledged it too
(``Primary.replicated`` holds confirms after ``seq`` until then). The queue is
caught up on that backup once the backup acknowledged ``ready_seq``, the seq
of the queue's last catch-up event.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QueueGuard:
    vhost: str
    queue: str
    position: int   # the queue's next position at the join: the first one sent live
    seq: int        # the primary's seq at the join (the CaughtUp marker's)
    ready_seq: int  # the seq of this queue's last catch-up event

    def passed(self, acked: int) -> bool:
        """The backup acknowledged this queue's catch-up."""
        return acked >= self.ready_seq
