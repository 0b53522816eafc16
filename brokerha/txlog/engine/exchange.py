"""Transaction exchange: MERGE of listed transactions and fetching their bodies.

Rounds carry only records; a master posts (and so lets others ADD) only
transactions it has *acquired*, body included (seed 000, "Acquired
transactions only").  A body travels with the origin's first post; one that
did not arrive is fetched from the master that listed it - not only from the
origin, which a single lost link may hide - and asked for again after a
round timeout.
"""

from __future__ import annotations

from collections.abc import Iterable

from brokerha.txlog.engine.engine import Engine
from brokerha.txlog.engine.messages import Bodies, FetchBodies
from brokerha.txlog.engine.records import TxBody, TxRecord


class ExchangeMixin:
    def _merge(self: Engine, records: Iterable[TxRecord], bodies: Iterable[TxBody], lister: str, now: int) -> None:
        for body in bodies:
            if self._body(body.tx_id) is None:
                self.foreign_bodies[body.tx_id] = body
        news = False
        wanted: list[str] = []
        for record in records:
            if record.tx_id in self.incoming or self.sync.contains(record.tx_id):
                continue
            if self._body(record.tx_id) is not None:
                self.incoming.add(record)
                self.acquired_ms[record.tx_id] = self.wall
                self.pending.pop(record.tx_id, None)
                self.asked.pop(record.tx_id, None)
                news = True
            else:
                self.pending[record.tx_id] = (record, lister)
                if record.tx_id not in self.asked:
                    wanted.append(record.tx_id)
        self._fetch(lister, wanted, now)
        if news:
            self._post_soon(now, news=True)

    def _fetch(self: Engine, peer: str, tx_ids: list[str], now: int) -> None:
        if tx_ids:
            for tx_id in tx_ids:
                self.asked[tx_id] = now
            self._send(peer, FetchBodies(self.me, tuple(tx_ids)))

    def _refetch(self: Engine, now: int) -> None:
        """Ask again for bodies not received within a round timeout."""
        due = [t for t, at in self.asked.items() if now - at >= self.config.round_timeout_ms]
        by_peer: dict[str, list[str]] = {}
        for tx_id in due:
            lister = self.pending[tx_id][1] if tx_id in self.pending else self._lister_of(tx_id)
            if lister == self.me:
                self.asked.pop(tx_id, None)
                continue
            by_peer.setdefault(lister, []).append(tx_id)
        for peer, ids in by_peer.items():
            self._fetch(peer, ids, now)

    def _lister_of(self: Engine, tx_id: str) -> str:
        """Who to ask for a synchronised body: the master whose tail carried it, else its origin."""
        record = self.sync.record(tx_id)
        origin = record.origin if record is not None else self.me
        return self.synced_from.get(tx_id, origin)

    def _on_fetchbodies(self: Engine, message: FetchBodies, now: int) -> None:
        found = [(self._record(t), self._body(t)) for t in message.tx_ids]
        pairs = [(r, b) for r, b in found if r is not None and b is not None]
        if pairs:
            self._send(
                message.sender,
                Bodies(self.me, tuple(r for r, _ in pairs), tuple(b for _, b in pairs)),
            )

    def _record(self: Engine, tx_id: str) -> TxRecord | None:
        return self.incoming.get(tx_id) or self.sync.record(tx_id)

    def _on_bodies(self: Engine, message: Bodies, now: int) -> None:
        """Take only bodies still wanted: a late reply must not bring back a record.

        After a recovery vote, foreign incoming entries are dropped and a
        renegotiated transaction lives on under a new id; a reply to a fetch
        sent before the vote would otherwise reintroduce the old one.
        """
        in_sync = [b for b in message.bodies if self.sync.contains(b.tx_id) and b.tx_id not in self.durable.bodies]
        if in_sync:
            self._persist("bodies", in_sync)
        wanted = {r.tx_id for r in message.records if r.tx_id in self.pending}
        for tx_id in wanted | {b.tx_id for b in in_sync}:
            self.asked.pop(tx_id, None)
        if wanted and not self.voting:
            records = [r for r in message.records if r.tx_id in wanted]
            self._merge(records, [b for b in message.bodies if b.tx_id in wanted], message.sender, now)
            self._add(timed_out=False, now=now)
