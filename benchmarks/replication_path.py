"""The replication path's CPU per message, in one process: no sockets, no disk, no event loop.

A primary broker and two backups (in-memory stores), joined as the node joins
them; per round, ``--batch`` persistent 1 KiB messages are published to a
durable queue, their events travel to each backup through the cluster
link's codec (``PacketCodec``: msgpack framing, ``Events.from_args`` on the
way in) and are applied, the backups acknowledge, then the messages are
consumed and acknowledged on the primary and those dequeues travel the same
way. Printed: microseconds per message in the primary's replication work
(events built, packets cut and encoded), in the backups' (decoded, applied;
both backups together), and the whole loop, median of ``--rounds``.

This isolates what issue 22 ("replication cheaper than brokering") weighs:
the per-message cost of replication itself, against which the end-to-end
``ha_cluster.py`` figures (where clients, sockets and disks share 2 cores)
can be read. Run it at two commits to compare a change of the path.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import time

from brokerha.backup.backup import Backup
from brokerha.broker.broker import Broker
from brokerha.cluster.protocol import PacketCodec
from brokerha.ha.simulation.world import message
from brokerha.primary.primary import Primary

BODY = b"x" * 1024


class Path:
    def __init__(self) -> None:
        self.now = 1000.0
        self.primary_broker = Broker("n1", clock=self.clock)
        self.primary_broker.add_vhost("/").declare_queue("q", owner=None, durable=True)
        self.primary = Primary(self.primary_broker, me="n1", members=3, epoch=1, start_seq=0,
                               clock=self.clock, backup_timeout=5.0)
        self.codec = PacketCodec()
        self.backups = {}
        for name in ("n2", "n3"):
            broker = Broker(name, clock=self.clock)
            broker.add_vhost("/")
            backup = Backup(broker, me=name, epoch=1, position=(-1, -1))
            self.backups[name] = backup
            self.primary.backup_joined(backup.join_message())
        self.primary_us = self.backup_us = self.carry_us = 0.0
        self.carry()

    def clock(self) -> float:
        return self.now

    def carry(self) -> None:
        """Every backup's packets through the codec, applied, then its acknowledgement."""
        started = time.perf_counter()
        outboxes = self.primary.take_outboxes()  # the same packets for both: packed once
        for name, backup in self.backups.items():
            wire = b"".join(self.codec.encode(0, packet) for packet in outboxes.get(name, ()))
            middle = time.perf_counter()
            for _, packet in PacketCodec().feed(wire):
                backup.receive(packet)  # type: ignore[arg-type]
            ack = backup.ack_message()
            votes = backup.take_votes()
            done = time.perf_counter()
            for vote in votes:
                self.primary.tx_vote(name, vote.txid, vote.ok, vote.reason)
            self.primary.backup_acked(name, ack.seq)
            self.primary_us += (middle - started) * 1e6
            self.backup_us += (done - middle) * 1e6
            self.carry_us += (done - started) * 1e6
            started = time.perf_counter()

    async def round(self, batch: int, tx: int = 0) -> tuple[float, float, float]:
        self.primary_us = self.backup_us = 0.0
        if tx:
            batch -= batch % tx  # whole transactions
        q = self.primary_broker.vhosts["/"].queues["q"]
        started = time.perf_counter()
        t, carried = time.perf_counter(), self.carry_us
        if tx:  # the commits wait for the backups' votes: carry() runs meanwhile
            await self.transactions(q, batch, tx)
        else:
            for _ in range(batch):
                q.enqueue(message(BODY, "q", persistent=True))
        self.primary_us += (time.perf_counter() - t) * 1e6 - (self.carry_us - carried)
        self.carry()
        t = time.perf_counter()
        for _ in range(batch):
            entry = q.get()
            assert entry is not None
            q.settle(entry)
        self.primary_us += (time.perf_counter() - t) * 1e6
        self.carry()
        total = (time.perf_counter() - started) * 1e6
        return self.primary_us / batch, self.backup_us / batch, total / batch


    async def transactions(self, q: object, batch: int, size: int) -> None:
        """``batch`` messages as transactions of ``size`` publishes (tx.select, tx.commit);
        the backups' votes travel while a commit waits for them."""
        for _ in range(batch // size):
            transaction = self.primary_broker.new_transaction()
            for _ in range(size):
                transaction.publish([q], message(BODY, "q", persistent=True))
            commit = asyncio.ensure_future(transaction.commit())
            while not commit.done():
                await asyncio.sleep(0)
                self.carry()
            commit.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="messages per round")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--tx", type=int, default=0,
                        help="publish in transactions of this many messages (default: plain)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N functions with the most own time")
    args = parser.parse_args()
    path = Path()
    profiler = cProfile.Profile() if args.profile else None

    async def measure() -> list[tuple[float, float, float]]:
        for _ in range(20):  # warm up
            await path.round(args.batch, args.tx)
        if profiler is not None:
            profiler.enable()
        results = [await path.round(args.batch, args.tx) for _ in range(args.rounds)]
        if profiler is not None:
            profiler.disable()
        return results

    results = asyncio.run(measure())
    primary, backups, total = (statistics.median(r[i] for r in results) for i in range(3))
    how = f"in transactions of {args.tx}" if args.tx else "plain publishes"
    print(f"replication path, {args.rounds} rounds of {args.batch} messages ({how}, then "
          "consume and ack), 2 backups, in one process:")
    print(f"  primary (broker work + events + packets{', event loop' if args.tx else ''}): "
          f"{primary:6.2f} us/msg")
    print(f"  backups (decode + apply, both):           {backups:6.2f} us/msg")
    print(f"  whole loop:                               {total:6.2f} us/msg")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
