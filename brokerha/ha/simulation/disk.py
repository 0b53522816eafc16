"""The disk of a simulated node: a store whose writes survive a crash only once synced.

A ``DiskStore`` is the broker's ``MemoryStore`` with a disk image beside it:
``sync()`` is one group commit (the ``before_batch`` hooks first, as a real
store runs them before it hands a batch to its writer, then everything
recorded so far becomes the image, then the ``after_sync`` callbacks run);
a crash keeps the image only. The simulation decides when a sync happens,
and ``sync_latency`` how long it takes: mostly a few milliseconds, now and
then (``slow_p``) up to half a second, as a disk busy with another writer or
a filesystem's journal commit makes an fsync. A slow sync holds what waits
for it (confirms, a backup's acknowledgements) but not the node's event
loop: the store's writer runs beside it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from brokerha.broker.storage import MemoryStore, Recovered, StoredMessage, stored_definitions


def sync_latency(rng: random.Random, fast: tuple[float, float], slow_p: float = 0.0,
                 slow: tuple[float, float] = (0.05, 0.5)) -> float:
    """How long one store sync takes: uniform in ``fast``, or with chance ``slow_p`` in
    ``slow`` (no second draw when ``slow_p`` is 0: seeds without slow syncs keep their
    traces)."""
    if slow_p and rng.random() < slow_p:
        return slow[0] + (slow[1] - slow[0]) * rng.random()
    return fast[0] + (fast[1] - fast[0]) * rng.random()


@dataclass
class Image:
    """What a DiskStore holds on disk: its records as of the last completed sync."""

    exchanges: dict[Any, Any] = field(default_factory=dict)
    queues: dict[Any, Any] = field(default_factory=dict)
    bindings: dict[Any, Any] = field(default_factory=dict)
    messages: dict[Any, StoredMessage] = field(default_factory=dict)
    prepared: dict[str, Any] = field(default_factory=dict)
    ha_transactions: dict[str, bytes] = field(default_factory=dict)
    outcomes: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)
    definitions: dict[Any, Any] = field(default_factory=dict)  # vhosts, users, policies...

    def copy(self) -> Image:
        # records are shared, not copied: only ``delivered`` ever changes in one (the
        # redelivered flag after a restart), which no check reads
        return Image(dict(self.exchanges), dict(self.queues), dict(self.bindings),
                     dict(self.messages), dict(self.prepared), dict(self.ha_transactions), dict(self.outcomes),
                     dict(self.meta), dict(self.definitions))


class DiskStore(MemoryStore):
    """A MemoryStore whose ``after_sync`` completes only when the simulation syncs it.

    ``sync()`` makes everything recorded so far durable (one group commit) and
    then runs the callbacks waiting for it; a crash keeps ``disk`` only.
    """

    def __init__(self, disk: Image | None = None,
                 on_wait: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.disk = disk or Image()
        self._apply(self.disk.copy())
        self.waiting: list[Callable[[], None]] = []
        self.hooks: list[Callable[[], None]] = []
        self.on_wait = on_wait  # a callback now waits: the simulation schedules a sync

    def _apply(self, image: Image) -> None:
        self.exchanges, self.queues, self.bindings = image.exchanges, image.queues, image.bindings
        self.messages, self.prepared = image.messages, image.prepared
        self.ha_transactions, self.outcomes, self.meta = (image.ha_transactions, image.outcomes,
                                                          image.meta)
        self.definitions = image.definitions

    def image(self) -> Image:
        return Image(self.exchanges, self.queues, self.bindings, self.messages, self.prepared,
                     self.ha_transactions, self.outcomes, self.meta, self.definitions).copy()

    def after_sync(self, callback: Callable[[], None]) -> None:
        self.waiting.append(callback)
        if self.on_wait is not None:
            self.on_wait()

    def before_batch(self, hook: Callable[[], None]) -> None:
        self.hooks.append(hook)

    def ha_tx_prepared(self, txid: str, payload: bytes, done: Callable[[], None]) -> None:
        self.ha_transactions[txid] = payload
        self.after_sync(done)

    def dtx_prepared(self, record: Any, done: Callable[[], None]) -> None:
        self.prepared[record.xid] = record
        self.after_sync(done)

    def sync(self) -> None:
        for hook in self.hooks:
            hook()
        self.disk = self.image()
        callbacks, self.waiting = self.waiting, []
        for callback in callbacks:
            callback()

    def load(self) -> Recovered:
        disk = self.disk
        return Recovered(list(disk.exchanges.values()), list(disk.queues.values()),
                           list(disk.bindings.values()),
                           sorted(disk.messages.values(),
                                  key=lambda m: (m.vhost, m.queue, m.position)),
                           list(disk.prepared.values()), list(disk.ha_transactions.items()),
                           list(disk.outcomes.values()),
                           stored_definitions(disk.definitions.values()))
