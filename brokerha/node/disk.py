"""The disk alarm: free space where the node writes, checked on the timer sweep.

RabbitMQ's ``disk_free_limit``: when the file system holding the data
directory (and the store's database or operation log, where they live
elsewhere) has less free space than the limit, the node raises the ``disk``
resource alarm, exactly as the memory alarm: clients that asked for it get
connection.blocked, publishing connections are no longer read, consumers,
acks and management go on. Once the free space is back above the limit plus a
hysteresis, the alarm clears. The limit is absolute ("50MB", the default as in
RabbitMQ) or relative to the machine's memory (``mem_relative:1.0``), 0 = off.

The alarm keeps a full disk from stopping the node; a disk filled anyway by
another process is handled by the store (``brokerha.store.writer.DiskFull``:
the write is retried, the ``disk:store`` alarm blocks publishers meanwhile).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from brokerha.node.config import DiskFreeLimit

log = logging.getLogger(__name__)

CHECK_INTERVAL = 0.5  # seconds between two looks (statvfs is a cheap system call)
MIN_HYSTERESIS = 1 << 20


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class DiskMonitor:
    """Raises and clears the ``disk`` alarm from the free space under ``paths``."""

    def __init__(self, paths: list[Path], limit: DiskFreeLimit,
                 set_alarm: Callable[[str, str | None], None],
                 interval: float = CHECK_INTERVAL) -> None:
        self.paths = list(dict.fromkeys(p for p in paths))  # distinct, in order
        self.limit = limit
        self.limit_bytes = limit.bytes()
        self.hysteresis = max(self.limit_bytes // 10, MIN_HYSTERESIS)
        self.set_alarm = set_alarm
        self.interval = interval
        self.alarm = False
        self.free: dict[str, int | None] = {str(p): None for p in self.paths}
        self._next = 0.0

    def check(self, now: float) -> None:
        """On the sweep: look again once ``interval`` has passed."""
        if not self.limit_bytes or now < self._next:
            return
        self._next = now + self.interval
        lowest: tuple[int, Path] | None = None
        for path in self.paths:
            try:
                free = free_bytes(path)
            except OSError as exc:
                log.warning("disk alarm: cannot read the free space of %s: %s", path, exc)
                continue
            self.free[str(path)] = free
            if lowest is None or free < lowest[0]:
                lowest = (free, path)
        if lowest is None:
            return
        free, path = lowest
        if free < self.limit_bytes:
            self.alarm = True
            self.set_alarm("disk", f"free disk space on {path} is {fmt_bytes(free)}, below "
                                   f"disk_free_limit {fmt_bytes(self.limit_bytes)}")
        elif self.alarm and free >= self.limit_bytes + self.hysteresis:
            self.alarm = False
            self.set_alarm("disk", None)

    def status(self) -> dict[str, Any]:
        return {"disk_free_limit": self.limit_bytes, "limit": str(self.limit),
                "hysteresis": self.hysteresis, "free": dict(self.free), "alarm": self.alarm}
