"""What a partitioned node's group primaries cost per message, in one process (issue 35).

A node of a partitioned cluster runs one ``Primary`` per group it leads over
one broker, and each of them sees every queue event of the broker (enqueue,
acquire, dequeue), its own group's and the others' (the copies this node holds
as a backup of other partitions). Each asks whether the queue is its group's
(``GroupScope.queues``, ``PartitionScope``). This measures, per message
(published, fetched, acknowledged) and median of ``--rounds`` rounds of
``--batch`` messages over ``--queues`` queues spread over ``--partitions``
partitions, the process CPU of:

- ``broker``: the broker alone (no primary): the reference;
- ``asking``: the node's primaries (the metadata group's and ``--leads``
  partitions') asking their scope on every event, as before the cache (the
  old ``Primary._policy`` and ``acquired``, kept here as ``AskingPrimary``,
  over the old ``of_name``, ``OldScope``,
  whose ``enqueued`` and ``dequeued`` go through that ``_policy`` first, as
  before);
- ``cached``: today's ``Primary`` (the answer remembered per queue,
  ``Primary._policies``' ``OTHER_GROUP``).

The primaries have no backups (events are counted, not sent). Prints each
layout's us/message, the primaries' part (minus ``broker``) and the ratio
asking / cached, then ``PartitionScope.of_name`` (asked twice a publish by
``GroupClients.publish``) as it was (``OldScope``) and as it is, with the
load average. Run it: ``.venv/bin/python benchmarks/scope_cost.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from brokerha.broker.arguments import REPLICATE_NONE
from brokerha.broker.broker import Broker
from brokerha.broker.message import Entry
from brokerha.broker.placement import GroupScope, no_queues
from brokerha.broker.policy_effects import PolicyEffects
from brokerha.broker.queue import Queue
from brokerha.broker.storage import MemoryStore
from brokerha.cluster.partition_table import PartitionTable, hash_partition
from brokerha.ha.simulation.world import message
from brokerha.partition.member import PIN, PartitionScope
from brokerha.primary.policy import queue_policy
from brokerha.primary.primary import Primary


class AskingPrimary(Primary):
    """The reference: ``Primary`` as it was before the cache, asking the scope every time."""

    def _policy(self, q: Queue) -> str:
        scope = self.scope
        if scope is not None and not scope.queues(q):
            return REPLICATE_NONE
        policy = self._policies.get(q)
        if policy is None:
            policy = self._policies[q] = queue_policy(q, self.default_policy, self.policies,
                                                      PolicyEffects.of(self.broker))
        return policy

    def acquired(self, queue: Queue, entry: Entry) -> None:
        scope = self.scope
        if queue.exclusive_owner is None and (scope is None or scope.queues(queue)):
            self._acquired.setdefault(queue, {})[entry.position] = entry

    def enqueued(self, queue: Queue, entry: Entry) -> None:
        if self._messages_replicated(queue):  # as before: through _policy, asking
            super().enqueued(queue, entry)

    def dequeued(self, queue: Queue, entry: Entry) -> None:
        held = self._acquired.get(queue)
        if held:
            held.pop(entry.position, None)
        if not queue.deleted and self._messages_replicated(queue):
            super().dequeued(queue, entry)


class OldScope(PartitionScope):
    """The reference for ``of_name`` (asked twice a publish by ``GroupClients.publish``): as
    it was, an ``isinstance`` and a tuple before its lookup."""

    def of_name(self, vhost: str, name: str, pin: object) -> int:
        if not isinstance(pin, int | float | str | bytes | None):
            return hash_partition(vhost, name, self.table.partitions)
        key = (vhost, name, pin)
        p = self._old.get(key)
        if p is None:
            p = self._old[key] = self.table.partition_of(vhost, name, pin)
        return p

    def __init__(self, table: PartitionTable) -> None:
        super().__init__(table)
        self._old: dict[tuple[str, str, object], int] = {}


def of_name_round(scope: PartitionScope, names: list[str], n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        for name in names:
            scope.of_name("/", name, None)
    return (time.process_time() - start) / n / len(names) * 1e6


def build(kind: str, args: argparse.Namespace) -> tuple[Broker, list[Queue], list[Primary]]:
    broker = Broker("n1", clock=time.monotonic, store=MemoryStore())
    broker.add_vhost("/")
    vhost = broker.vhosts["/"]
    queues = [vhost.declare_queue(f"q{i}", owner=None, durable=True,
                                  arguments={PIN: i % args.partitions})
              for i in range(args.queues)]
    primaries: list[Primary] = []
    if kind != "broker":
        factory = AskingPrimary if kind == "asking" else Primary
        table = PartitionTable.empty(args.partitions, 1)
        placement = OldScope(table) if kind == "asking" else PartitionScope(table)
        scopes = [GroupScope(0, no_queues, True)]
        scopes += [GroupScope(p + 1, placement.of(p), False) for p in range(args.leads)]
        primaries = [factory(broker, me="n1", members=3, epoch=1, start_seq=0,
                             clock=time.monotonic, backup_timeout=5.0, scope=s)
                     for s in scopes]
    return broker, queues, primaries


def one_round(broker: Broker, queues: list[Queue], batch: int) -> float:
    msgs = [message(b"x" * 100, q.name) for q in queues]
    start = time.process_time()
    for i in range(batch):
        q = queues[i % len(queues)]
        q.enqueue(msgs[i % len(queues)])
    for q in queues:
        while (entry := q.get()) is not None:
            q.settle(entry)
    return (time.process_time() - start) / batch * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--batch", type=int, default=20_000)
    p.add_argument("--queues", type=int, default=36)
    p.add_argument("--partitions", type=int, default=9)
    p.add_argument("--leads", type=int, default=3, help="partitions this node leads")
    args = p.parse_args()
    kinds = ("broker", "asking", "cached")
    built = {k: build(k, args) for k in kinds}
    figures: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):  # interleaved: the same load for each
        for k in kinds:
            broker, queues, _primaries = built[k]
            figures[k].append(one_round(broker, queues, args.batch))
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"P = {args.partitions}, {args.leads} partitions led + the metadata group, "
          f"{args.queues} queues, {args.rounds} rounds of {args.batch} messages "
          f"(enqueue, get, ack), CPU us/message, median")
    for k in kinds:
        extra = "" if k == "broker" else f"  (primaries {med[k] - med['broker']:.2f})"
        print(f"  {k:7s} {med[k]:6.2f}{extra}")
    asking, cached = med["asking"] - med["broker"], med["cached"] - med["broker"]
    print(f"primaries' part asking / cached = {asking / cached:.2f}x "
          f"({asking - cached:.2f} us/message saved)")
    table = PartitionTable.empty(args.partitions, 1)
    scopes = {"old": OldScope(table), "new": PartitionScope(table)}
    names = [q.name for q in built["broker"][1]]
    calls: dict[str, list[float]] = {k: [] for k in scopes}
    for _ in range(args.rounds):
        for k, scope in scopes.items():
            calls[k].append(of_name_round(scope, names, 5000))
    old, new = statistics.median(calls["old"]), statistics.median(calls["new"])
    print(f"PartitionScope.of_name us/call: old {old:.3f}, new {new:.3f}: {old / new:.2f}x")
    print(f"load: {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}")


if __name__ == "__main__":
    main()
