"""Agreement latency and ordering throughput: TxLog vs a fixed sequencer vs Skeen/TOA.

Three DCs, 40 ms one way (80 ms RTT), the same simulated network
(:class:`brokerha.txlog.simulation.network.Network`, seeded jitter) and the same Poisson
arrivals for all three orderings, in one run.  Agreement latency is the time
from a transaction's creation to the moment it is in the agreed order at
*every* DC, in round trips.  "virtual tx/s" is what each ordering sustained at
the offered load; "CPU tx/s" is how many transactions per second of this
machine's CPU the Python implementation orders (the simulated network is free).

    .venv/bin/python benchmarks/txlog_agreement.py [--seconds 20] [--rate 30]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from brokerha.txlog.simulation.network import Network
from brokerha.txlog.simulation.simulation import SimParams, Simulation

DCS = ("dc1", "dc2", "dc3")
ONE_WAY = 40
RTT = 2 * ONE_WAY


@dataclass
class Figures:
    name: str
    latencies_ms: list[float]
    virtual_seconds: float
    cpu_seconds: float

    def row(self) -> str:
        lat = sorted(self.latencies_ms)
        p50 = statistics.median(lat) / RTT
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] / RTT
        virtual = len(lat) / self.virtual_seconds
        cpu = len(lat) / self.cpu_seconds if self.cpu_seconds else float("inf")
        return f"| {self.name:<22} | {len(lat):>6} | {p50:>8.2f} | {p99:>8.2f} | {virtual:>11.1f} | {cpu:>9.0f} |"


def arrivals(seed: int, seconds: float, rate: float) -> list[tuple[int, str]]:
    """Poisson arrivals per DC: (ms, dc)."""
    rng = random.Random(f"arrivals-{seed}")
    out = []
    for dc in DCS:
        t = rng.expovariate(rate) * 1000
        while t < seconds * 1000:
            out.append((int(t), dc))
            t += rng.expovariate(rate) * 1000
    return sorted(out)


def txlog(load: list[tuple[int, str]], seconds: float, seed: int) -> Figures:
    params = SimParams(masters=3, one_way_ms=ONE_WAY, jitter_ms=4, heal_at_ms=10**9, check_invariants=False)
    sim = Simulation(seed, params)
    created: dict[str, int] = {}
    for at, dc in load:
        def create(dc: str = dc) -> None:
            sim.transaction(dc)
            created[sim.created[-1]] = sim.now
        sim.at(at, create)
    started = time.process_time()
    problem = sim.run(int(seconds * 1000) + 5_000)
    cpu = time.process_time() - started
    assert problem is None, problem
    done: dict[str, int] = {}
    for master in sim.masters.values():
        for entry in master.durable.sync.entries:
            tx = entry.record.tx_id
            done[tx] = max(done.get(tx, 0), entry.ordered_ms)
    complete = [tx for tx in created if all(m.durable.sync.contains(tx) for m in sim.masters.values())]
    return Figures("TxLog (all five rules)", [done[tx] - created[tx] for tx in complete], seconds, cpu)


class EventLoop:
    """The minimal discrete-event loop the two baselines run on."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self.now = 0
        self.queue: list[tuple[int, int, Callable[[], None]]] = []
        self.seq = itertools.count()

    def at(self, when: int, action: Callable[[], None]) -> None:
        heapq.heappush(self.queue, (when, next(self.seq), action))

    def send(self, src: str, dst: str, action: Callable[[], None]) -> None:
        delays = [0] if src == dst else self.net.delays(src, dst)
        for delay in delays:
            self.at(self.now + delay, action)

    def run(self) -> None:
        while self.queue:
            self.now, _, action = heapq.heappop(self.queue)
            action()


def sequencer(load: list[tuple[int, str]], seconds: float, seed: int) -> Figures:
    """dc1 numbers every transaction and broadcasts it; a DC delivers in number order."""
    loop = EventLoop(Network(random.Random(seed), ONE_WAY, 4))
    counter = itertools.count()
    delivered = {dc: 0 for dc in DCS}
    pending: dict[str, dict[int, int]] = {dc: {} for dc in DCS}
    created: dict[int, int] = {}
    agreed: dict[int, int] = {}

    def deliver(dc: str, number: int, tx: int) -> None:
        pending[dc][number] = tx
        while delivered[dc] in pending[dc]:
            done = pending[dc].pop(delivered[dc])
            delivered[dc] += 1
            agreed[done] = max(agreed.get(done, 0), loop.now)

    def order(tx: int) -> None:
        number = next(counter)
        for dc in DCS:
            loop.send("dc1", dc, lambda dc=dc, number=number: deliver(dc, number, tx))

    for i, (at, dc) in enumerate(load):
        created[i] = at
        loop.at(at, lambda dc=dc, i=i: loop.send(dc, "dc1", lambda: order(i)))
    started = time.process_time()
    loop.run()
    cpu = time.process_time() - started
    return Figures("fixed sequencer (dc1)", [agreed[i] - created[i] for i in created], seconds, cpu)


def skeen(load: list[tuple[int, str]], seconds: float, seed: int) -> Figures:
    """Skeen / TOA: every DC proposes its clock, the sender sends the max as final, deliver in order."""
    loop = EventLoop(Network(random.Random(seed), ONE_WAY, 4))
    clocks = dict.fromkeys(DCS, 0)
    queues: dict[str, dict[int, tuple[int, str, bool]]] = {dc: {} for dc in DCS}
    proposals: dict[int, list[int]] = {}
    created: dict[int, int] = {}
    agreed: dict[int, int] = {}

    def flush(dc: str) -> None:
        queue = queues[dc]
        while queue:
            tx, (number, origin, final) = min(queue.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
            if not final:
                return
            del queue[tx]
            agreed[tx] = max(agreed.get(tx, 0), loop.now)

    def receive(dc: str, tx: int, origin: str) -> None:
        clocks[dc] += 1
        queues[dc][tx] = (clocks[dc], origin, False)
        proposal = clocks[dc]
        loop.send(dc, origin, lambda: collect(origin, tx, proposal))

    def collect(origin: str, tx: int, proposal: int) -> None:
        proposals[tx].append(proposal)
        if len(proposals[tx]) == len(DCS):
            final = max(proposals[tx])
            for dc in DCS:
                loop.send(origin, dc, lambda dc=dc: finalize(dc, tx, final, origin))

    def finalize(dc: str, tx: int, final: int, origin: str) -> None:
        clocks[dc] = max(clocks[dc], final)
        queues[dc][tx] = (final, origin, True)
        flush(dc)

    for i, (at, origin) in enumerate(load):
        created[i] = at
        proposals[i] = []
        for dc in DCS:
            loop.at(at, lambda dc=dc, i=i, origin=origin: loop.send(origin, dc, lambda: receive(dc, i, origin)))
    started = time.process_time()
    loop.run()
    cpu = time.process_time() - started
    return Figures("Skeen / TOA (seed 003)", [agreed[i] - created[i] for i in created], seconds, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="virtual seconds of load")
    parser.add_argument("--rate", type=float, default=30.0, help="transactions per second per DC")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    load = arrivals(args.seed, args.seconds, args.rate)
    print(f"3 DCs, {ONE_WAY} ms one way (RTT {RTT} ms), {args.rate:g} tx/s per DC, {args.seconds:g} s, seed {args.seed}")
    print("| ordering               |     tx | p50 RTT  | p99 RTT  | virtual tx/s |  CPU tx/s |")
    print("|------------------------|--------|----------|----------|--------------|-----------|")
    for run in (txlog, sequencer, skeen):
        print(run(load, args.seconds, args.seed).row())


if __name__ == "__main__":
    main()
