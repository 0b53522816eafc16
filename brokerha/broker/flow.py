"""Publisher flow control: publishing connections are not read while a hold is in force.

A hold is internal back-pressure, not a resource alarm: clients are not told
(no ``connection.blocked``), their sockets are simply not read for a while,
as RabbitMQ's credit flow does (its connections show the ``flow`` state). The
HA primary holds publishers while a backup holding a copy is behind by more
than ``flow_lag`` (``primary/primary.py``): otherwise publishers without
confirms outrun the backups, the replication link fills up, and the
heartbeats queued behind it arrive after the lease ran out.

Operators see the holds (``/metrics``, ``ctl status --json``, the UI): how
many episodes, how long publishers were held in all, and what held them (the
``cause`` a holder names, e.g. the backup whose lag started it). An episode
starts and ends with an INFO line (the end says how long it lasted); one
still in force after ``HELD_WARNING`` seconds is a WARNING naming its cause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# seconds: a hold in force longer than this is logged at WARNING. A hold lasts a fraction
# of flow_lag while the backups keep up; one backup holds publishers at most until it is
# cut out (backup_unheard_timeout, 0.5 s, when silent) or times out (backup_timeout, 5 s,
# when heard but not acknowledging) -- so a bound of 5 s would never be reached.
HELD_WARNING = 1.0
# what ``PublishFlow.status`` gives (in the HA primary's replication status)
STATUS_KEYS = ("publishers_held", "publisher_holds", "publishers_held_seconds",
               "publishers_held_by", "publisher_holds_by")


class PublishFlow:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.holds: dict[str, str] = {}  # who holds publishers -> why
        self.listeners: list[Callable[[bool], None]] = []  # called with ``held`` on a change
        self.episodes = 0  # times publishers were held (metrics)
        self.episodes_by_cause: dict[str, int] = {}  # the same, by the cause that started each
        self.cause: str | None = None  # what holds them now, as its holder names it
        self.held_since: float | None = None
        self._started_by = ""  # the reason the hold in force started with
        self._held_before = 0.0  # seconds held in the episodes that ended
        self._warned = False

    @property
    def held(self) -> bool:
        return bool(self.holds)

    def hold(self, name: str, reason: str, cause: str | None = None) -> None:
        """Hold publishers for ``name`` (or go on holding them: the reason and cause are
        updated, and a hold past ``HELD_WARNING`` is logged once)."""
        was = self.held
        self.holds[name] = reason
        if cause is not None:
            self.cause = cause
        if not was:
            self.episodes += 1
            if cause is not None:
                self.episodes_by_cause[cause] = self.episodes_by_cause.get(cause, 0) + 1
            self.held_since, self._warned, self._started_by = self.clock(), False, reason
            log.info("publishers held (flow): %s", reason)
            self._notify(True)
        elif not self._warned and self.held_since is not None:
            held_for = self.clock() - self.held_since
            if held_for > HELD_WARNING:
                self._warned = True
                log.warning("publishers held (flow) for %.1fs: %s", held_for, reason)

    def release(self, name: str) -> None:
        if self.holds.pop(name, None) is not None and not self.holds:
            held_for = self.clock() - self.held_since if self.held_since is not None else 0.0
            self._held_before += held_for
            self.held_since, self.cause = None, None
            log.info("publishers released (flow) after %.2fs (held: %s)", held_for,
                     self._started_by)
            self._notify(False)

    def held_seconds(self) -> float:
        """Seconds publishers were held since this broker started, the hold in force included."""
        now = self.clock()
        return self._held_before + (now - self.held_since if self.held_since is not None
                                    else 0.0)

    def status(self) -> dict[str, Any]:
        """For the HA primary's replication status (``ctl status --json``) and the UI."""
        values = (self.held, self.episodes, round(self.held_seconds(), 3), self.cause,
                  dict(sorted(self.episodes_by_cause.items())))
        return dict(zip(STATUS_KEYS, values, strict=True))

    def _notify(self, held: bool) -> None:
        for listener in list(self.listeners):
            listener(held)
