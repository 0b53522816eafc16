"""Publisher flow control: publishing connections are not read while a hold is in force.

A hold is internal back-pressure, not a resource alarm: clients are not told
(no ``connection.blocked``), their sockets are simply not read for a while,
as RabbitMQ's credit flow does (its connections show the ``flow`` state). The
HA primary holds publishers while a backup holding a copy is behind by more
than ``flow_lag`` (``primary/primary.py``): otherwise publishers without
confirms outrun the backups, the replication link fills up, and the
heartbeats queued behind it arrive after the lease ran out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class PublishFlow:
    def __init__(self) -> None:
        self.holds: dict[str, str] = {}  # who holds publishers -> why
        self.listeners: list[Callable[[bool], None]] = []  # called with ``held`` on a change
        self.episodes = 0  # times publishers were held (metrics)

    @property
    def held(self) -> bool:
        return bool(self.holds)

    def hold(self, name: str, reason: str) -> None:
        was = self.held
        self.holds[name] = reason
        if not was:
            self.episodes += 1
            log.info("publishers held (flow): %s", reason)
            self._notify(True)

    def release(self, name: str) -> None:
        if self.holds.pop(name, None) is not None and not self.holds:
            self._notify(False)

    def _notify(self, held: bool) -> None:
        for listener in list(self.listeners):
            listener(held)
