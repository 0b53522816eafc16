"""The forward path's CPU per message, in one process: no sockets, no disk, no event loop.

Issue 35 stage 3 (docs/ha.md "Clients on any node"): a publish on a node that
does not lead the queue's partition is forwarded to its primary
(``partition/forward.py``), which applies each ``Forward`` as a local TX
(``partition/forward_apply.py``: its ``tc`` carries the enqueues and the
mark). Against ``replication_path.py``'s plain publishes on the primary, this
prints, per message and median of ``--rounds`` rounds of ``--batch`` persistent
1 KiB messages to one durable queue with two backups:

- the **sender**: ``ForwardSender.publish`` of each message, the turn's
  ``flush`` (one ``Forward``) and the link codec's encode;
- the **receiver**: the codec's decode, ``ForwardReceiver.receive``
  (``BrokerForwardLog``: the TX), the answer's encode, the primary's events
  and packets (as ``replication_path.py`` counts a primary's);
- the **backups** (decode and apply, both), and the same three for plain
  publishes made on the primary itself (``--batch`` enqueues, no TX).

The messages are consumed and acknowledged after each round (not counted),
so the queue stays short. Run it at two commits to compare a change of the
path.
"""

from __future__ import annotations

import argparse
import statistics
import time

from brokerha.backup.backup import Backup
from brokerha.broker.broker import Broker
from brokerha.cluster.protocol import PacketCodec
from brokerha.cluster.replication import HA_ID
from brokerha.ha.simulation.world import message
from brokerha.partition.forward import (
    Forward,
    ForwardMessage,
    ForwardReceiver,
    ForwardSender,
    LeaderNotice,
    ToNode,
    WhenDurable,
)
from brokerha.partition.forward_apply import BrokerForwardLog
from brokerha.primary.primary import Primary

BODY = b"x" * 1024


class Path:
    def __init__(self) -> None:
        self.now = 1000.0
        self.broker = Broker("n1", clock=self.clock)
        self.queue = self.broker.add_vhost("/").declare_queue("q", owner=None, durable=True)
        self.primary = Primary(self.broker, me="n1", members=3, epoch=1, start_seq=0,
                               clock=self.clock, backup_timeout=5.0)
        self.backups = {}
        for name in ("n2", "n3"):
            broker = Broker(name, clock=self.clock)
            broker.add_vhost("/")
            backup = Backup(broker, me=name, epoch=1, position=(-1, -1))
            self.backups[name] = backup
            self.primary.backup_joined(backup.join_message())
        self.carry()
        self.ha_id = str(self.queue.arguments[HA_ID])
        self.sender = ForwardSender("n2.1", window=1 << 30, batch=1 << 30)
        self.sender.leader(self.now, LeaderNotice(1, 1, "n1"))
        self.receiver = ForwardReceiver(1, 1, BrokerForwardLog(self.broker, 1, lambda q: True))
        self.publish_id = 0
        self.header = message(BODY, "q", persistent=True).header

    def clock(self) -> float:
        return self.now

    def carry(self) -> float:
        """The primary's packets to both backups, applied; their acks back: the backups'
        microseconds."""
        codec = PacketCodec()
        spent = 0.0
        outboxes = self.primary.take_outboxes()
        for name, backup in self.backups.items():
            wire = b"".join(codec.encode(0, packet) for packet in outboxes.get(name, ()))
            started = time.perf_counter()
            for _, packet in PacketCodec().feed(wire):
                backup.receive(packet)  # type: ignore[arg-type]
            ack = backup.ack_message()
            spent += time.perf_counter() - started
            self.primary.backup_acked(name, ack.seq)
        return spent * 1e6

    def packets(self) -> float:
        """The primary's packets cut and encoded (its share of replication): microseconds;
        then, not counted, applied by the backups and acknowledged."""
        started = time.perf_counter()
        codec = PacketCodec()
        outboxes = self.primary.take_outboxes()
        wires = {name: b"".join(codec.encode(0, p) for p in packets)
                 for name, packets in outboxes.items()}
        spent = (time.perf_counter() - started) * 1e6
        for name, wire in wires.items():
            backup = self.backups[name]
            for _, packet in PacketCodec().feed(wire):
                backup.receive(packet)  # type: ignore[arg-type]
            self.primary.backup_acked(name, backup.ack_message().seq)
        return spent

    def drain(self) -> None:
        while (entry := self.queue.get()) is not None:
            self.queue.settle(entry)
        self.carry()

    def forwarded(self, batch: int) -> tuple[float, float]:
        codec = PacketCodec()
        started = time.perf_counter()
        for _ in range(batch):
            self.publish_id += 1
            self.sender.publish(self.publish_id, {1: ForwardMessage(
                "/", (self.ha_id,), "", "q", self.header, BODY)})
        (send,) = [e for e in self.sender.flush(self.now) if isinstance(e, ToNode)]
        wire = codec.encode(0, send.packet)
        middle = time.perf_counter()
        ((_, forward),) = list(PacketCodec().feed(wire))
        assert isinstance(forward, Forward)
        (answer,) = self.receiver.receive("n2", forward)
        assert isinstance(answer, WhenDurable)
        codec.encode(0, answer.send.packet)
        receiver = (time.perf_counter() - middle) * 1e6 + self.packets()
        sender = (middle - started) * 1e6
        return sender / batch, receiver / batch

    def plain(self, batch: int) -> tuple[float, float]:
        started = time.perf_counter()
        for _ in range(batch):
            self.queue.enqueue(message(BODY, "q", persistent=True))
        primary = (time.perf_counter() - started) * 1e6 + self.packets()
        return 0.0, primary / batch


def measure(how: str, batch: int, rounds: int) -> tuple[float, float]:
    """The sender's and the primary's microseconds per message, median of ``rounds``
    (the primary's packets are encoded and dropped: the backups are measured apart)."""
    path = Path()
    work = path.forwarded if how == "forwarded" else path.plain
    results = []
    for i in range(rounds + 20):  # 20 rounds of warm-up
        sender, primary = work(batch)
        path.drain()
        if i >= 20:
            results.append((sender, primary))
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results)


def backups_cost(how: str, batch: int, rounds: int) -> float:
    """The backups' microseconds per message (decode + apply, both), median of rounds."""
    path = Path()
    spent = []
    for i in range(rounds + 20):
        if how == "forwarded":
            for _ in range(batch):
                path.publish_id += 1
                path.sender.publish(path.publish_id, {1: ForwardMessage(
                    "/", (path.ha_id,), "", "q", path.header, BODY)})
            (send,) = [e for e in path.sender.flush(path.now) if isinstance(e, ToNode)]
            assert isinstance(send.packet, Forward)
            path.receiver.receive("n2", send.packet)
        else:
            for _ in range(batch):
                path.queue.enqueue(message(BODY, "q", persistent=True))
        cost = path.carry()
        path.drain()
        if i >= 20:
            spent.append(cost / batch)
    return statistics.median(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="messages per round (a turn's)")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print(f"forward path, {args.rounds} rounds of {args.batch} persistent 1 KiB messages, "
          "2 backups, in one process (us/msg, median):")
    for how in ("plain", "forwarded"):
        sender, primary = measure(how, args.batch, args.rounds)
        backups = backups_cost(how, args.batch, args.rounds)
        print(f"  {how:9}  sender {sender:6.2f}  primary {primary:6.2f}  "
              f"backups (both) {backups:6.2f}")


if __name__ == "__main__":
    main()
