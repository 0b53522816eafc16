"""Publisher confirms: tags settle (possibly out of order), output is coalesced.

A confirm goes out only when its message is settled (durable on the primary
and on every ready backup — the durability barrier decides when). Settled tags
are released in tag order; a run of acks becomes one ``basic.ack(multiple)``,
a nack goes out alone, and a tag still waiting holds back the ones after it.
"""

from __future__ import annotations

from collections import deque


class ConfirmTracker:
    __slots__ = ("next_tag", "_order", "_outcome")

    def __init__(self) -> None:
        self.next_tag = 1
        self._order: deque[int] = deque()
        self._outcome: dict[int, bool] = {}

    def issue(self) -> int:
        tag = self.next_tag
        self.next_tag += 1
        self._order.append(tag)
        return tag

    def settle(self, tag: int, ok: bool) -> None:
        self._outcome[tag] = ok

    @property
    def waiting(self) -> int:
        return len(self._order)

    def drain(self) -> list[tuple[int, bool, bool]]:
        """(tag, multiple, ack) to send now, in order."""
        order, outcome = self._order, self._outcome
        out: list[tuple[int, bool, bool]] = []
        run_end = 0
        run_len = 0
        while order and order[0] in outcome:
            tag = order.popleft()
            if outcome.pop(tag):
                run_end = tag
                run_len += 1
                continue
            if run_len:
                out.append((run_end, run_len > 1, True))
                run_len = 0
            out.append((tag, False, False))
        if run_len:
            out.append((run_end, run_len > 1, True))
        return out
