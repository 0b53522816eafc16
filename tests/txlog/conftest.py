"""A hand-driven mesh of round engines for scenario tests (etcd-raft style).

Messages are queued, not delivered, until the test says so, so each test
builds its scenario explicitly: who posts, what arrives, what is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from brokerha.txlog.engine.config import Peer, SplitRecovery, TxLogConfig
from brokerha.txlog.engine.messages import Action, Message, Send
from brokerha.txlog.engine.records import Operation
from brokerha.txlog.engine.rounds import RoundEngine
from brokerha.txlog.engine.rules import Rules


def make_config(me: str, ids: list[str], **kw: object) -> TxLogConfig:
    peers = tuple(Peer(p, f"brokerha://{p}") for p in ids if p != me)
    return TxLogConfig(node_id=me, master_url=f"brokerha://{me}", peers=peers, **kw)  # type: ignore[arg-type]


@dataclass
class Mesh:
    engines: dict[str, RoundEngine]
    inflight: list[tuple[str, str, Message]] = field(default_factory=list)
    actions: dict[str, list[Action]] = field(default_factory=dict)
    now: int = 0

    def take(self, m: str, actions: list[Action]) -> list[Action]:
        self.actions.setdefault(m, []).extend(actions)
        for a in actions:
            if isinstance(a, Send):
                self.inflight.append((m, a.peer, a.message))
        return actions

    def tick(self, *ms: str, dt: int = 0) -> None:
        self.now += dt
        for m in ms or sorted(self.engines):
            self.take(m, self.engines[m].tick(self.now))

    def tx(self, m: str, *ops: Operation) -> str:
        ops = ops or (Operation("enqueue", "/q", f"msg-{len(self.inflight)}-{self.now}"),)
        record, actions = self.engines[m].local_tx(ops, self.now)
        self.take(m, actions)
        return record.tx_id

    def deliver(self, src: str | None = None, dst: str | None = None, kind: type | None = None) -> int:
        """Deliver (in order) every queued message matching the filters; returns how many."""
        keep, go = [], []
        for item in self.inflight:
            s, d, msg = item
            match = (src in (None, s)) and (dst in (None, d)) and (kind is None or isinstance(msg, kind))
            (go if match else keep).append(item)
        self.inflight = keep
        for _src, d, msg in go:
            self.take(d, self.engines[d].received(msg, self.now))
        return len(go)

    def drop(self, src: str | None = None, dst: str | None = None) -> None:
        self.inflight = [i for i in self.inflight if not ((src in (None, i[0])) and (dst in (None, i[1])))]

    def settle(self, rounds: int = 20, dt: int = 10) -> None:
        for _ in range(rounds):
            while self.deliver():
                pass
            self.tick(dt=dt)

    def sync_ids(self, m: str) -> list[str]:
        return self.engines[m].sync.ids()


@pytest.fixture
def mesh_factory():
    def build(n: int = 3, rules: Rules | None = None, **kw: object) -> Mesh:
        ids = [f"dc{i + 1}" for i in range(n)]
        kw.setdefault("split_recovery", SplitRecovery.SMART)
        engines = {m: RoundEngine(make_config(m, ids, **kw), 0, rules=rules) for m in ids}
        mesh = Mesh(engines)
        mesh.tick()
        return mesh

    return build
