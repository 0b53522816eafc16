"""In-process primary and backups joined by a pump instead of sockets.

Every packet goes through msgpack on its way (as the cluster link would carry
it), so a field that cannot cross the wire fails here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from brokerha.backup.backup import Backup
from brokerha.broker.broker import Broker
from brokerha.broker.message import Message
from brokerha.broker.policy_effects import PolicyEffects
from brokerha.broker.queue import Queue
from brokerha.broker.storage import MemoryStore, Store
from brokerha.cluster.messages import Message as Packet
from brokerha.ha.simulation.world import message, wire
from brokerha.primary.catch_up import Pace
from brokerha.primary.primary import Primary
from tests.clock import Clock


def publish(broker: Broker, body: bytes, rk: str = "q", exchange: str = "", vhost: str = "/",
            **kw: Any) -> list[Queue]:
    """Route and enqueue as the AMQP channel does."""
    vh = broker.vhosts[vhost]
    msg = message(body, rk, exchange, **kw)
    queues = vh.route(vh.exchange(exchange), msg)
    for q in queues:
        q.enqueue(msg)
    return queues


def consume(q: Queue, n: int | None = None) -> list[bytes]:
    """basic.get + ack, ``n`` times or until empty."""
    out = []
    while n is None or len(out) < n:
        entry = q.get()
        if entry is None:
            break
        out.append(entry.message.body)
        q.settle(entry)
    return out


class Node:
    def __init__(self, name: str, clock: Clock, store: Store | None = None,
                 broker: Broker | None = None) -> None:
        self.name = name
        self.broker = broker or Broker(name, clock=clock, store=store or MemoryStore())
        self.broker.add_vhost("/")
        self.backup: Backup | None = None


def carry(primary: Primary, backup: Backup, *, ack: bool = True,
          check: Any = None) -> int:
    """Move one batch of a backup's packets and (optionally) its acknowledgement back.

    ``check(backup)``, when given, runs after every single event is applied.
    """
    packets = primary.take_outbox(backup.me)
    count = 0
    for packet in packets:
        events = wire(packet)
        count += len(events.events)  # type: ignore[attr-defined]
        if check is None:
            backup.receive(events)  # type: ignore[arg-type]
            while backup.busy:  # a commit in slices: HACore runs one a loop turn
                backup.step()
            if backup.rejoin_requested:  # the primary's rj: join again, as HACore.on_events does
                primary.backup_joined(wire(backup.join_message()))  # type: ignore[arg-type]
                return count
            continue
        for one in split(events):
            backup.receive(one)  # type: ignore[arg-type]
            while backup.busy:
                backup.step()
            if backup.rejoin_requested:
                break
            check(backup)
        if backup.rejoin_requested:  # the primary's rj: join again, as HACore.on_events does
            primary.backup_joined(wire(backup.join_message()))  # type: ignore[arg-type]
            return count
    for vote in backup.take_votes():
        vote = wire(vote)
        primary.tx_vote(vote.node, vote.txid, vote.ok, vote.reason)  # type: ignore[attr-defined]
    if packets and ack:
        primary.backup_acked(backup.me, wire(backup.ack_message()).seq)  # type: ignore[attr-defined]
    return count


class Cluster:
    """A primary and its backups; ``pump`` carries packets both ways until quiet."""

    def __init__(self, members: int = 2, *, epoch: int = 1, timeout: float = 5.0,
                 replicate: str = "all", stores: dict[str, Store] | None = None,
                 pace: Pace | None = None, policies: bool = False) -> None:
        self.clock = Clock()
        stores = stores or {}
        names = [f"n{i}" for i in range(1, members + 1)]
        self.nodes = {n: Node(n, self.clock, stores.get(n)) for n in names}
        if policies:  # each broker acts on its policies, as a node's (before its Primary)
            for node in self.nodes.values():
                PolicyEffects(node.broker)
        self.primary_node = self.nodes[names[0]]
        self.primary = Primary(self.primary_node.broker, me=names[0], members=members,
                               epoch=epoch, start_seq=0, clock=self.clock,
                               backup_timeout=timeout, replicate=replicate, pace=pace)
        self.epoch = epoch
        self.silent: set[str] = set()     # receive nothing, acknowledge nothing
        self.no_ack: set[str] = set()     # receive but do not acknowledge
        self.sent_events: dict[str, int] = {}
        self.check: Any = None            # called with the backup after every event

    @property
    def broker(self) -> Broker:
        return self.primary_node.broker

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def follow(self, name: str, position: Any = (-1, -1)) -> Backup:
        """Make ``name`` a backup of the primary and send its join."""
        node = self.nodes[name]
        node.backup = Backup(node.broker, me=name, epoch=self.epoch, position=position)
        self.join(name)
        return node.backup

    def join(self, name: str) -> None:
        backup = self.nodes[name].backup
        assert backup is not None
        self.primary.backup_joined(wire(backup.join_message()))  # type: ignore[arg-type]

    def pump(self) -> None:
        moving = True
        while moving:
            moving = False
            for name in list(self.primary.sessions):
                if name in self.silent:
                    continue
                backup = self.nodes[name].backup
                assert backup is not None
                count = carry(self.primary, backup, ack=name not in self.no_ack,
                              check=self.check)
                self.sent_events[name] = self.sent_events.get(name, 0) + count
                moving = moving or count > 0


# -- transactions ------------------------------------------------------------------------

def route(broker: Broker, body: bytes, rk: str = "q", exchange: str = "", vhost: str = "/",
          **kw: Any) -> tuple[list[Queue], Message]:
    """A message routed as a channel would, not yet enqueued (for a transaction)."""
    vh = broker.vhosts[vhost]
    msg = message(body, rk, exchange, **kw)
    return vh.route(vh.exchange(exchange), msg), msg


async def settle(c: Cluster, work: Any, *, rounds: int = 200, tick: bool = False) -> Any:
    """Run ``work`` (a coroutine) while the pump carries packets; return its result."""
    task = asyncio.ensure_future(work)
    for _ in range(rounds):
        await asyncio.sleep(0)
        c.pump()
        if tick:
            c.primary.tick(c.clock.now)
        if task.done():
            break
    result = await task
    c.pump()
    return result


def split(packet: Packet) -> list[Packet]:
    """One Events packet per event: the finest seq boundaries a crash could cut at."""
    from brokerha.cluster.replication import Events

    assert isinstance(packet, Events)
    return [Events(packet.epoch, packet.first_seq + i, [event])
            for i, event in enumerate(packet.events)]
