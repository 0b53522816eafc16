"""Delay packets by NFQUEUE, in pure Python: WAN latency where the kernel has no ``netem``.

Run inside a network namespace of the test's own (``ip netns exec NS python
-m tests.nfqdelay --queue N --delay 0.15 --jitter 0.05``) with an iptables
rule that sends packets to queue ``N`` (``-j NFQUEUE --queue-num N
--queue-bypass``: if this process is gone, packets pass). It binds the queue
over netlink (``nfnetlink_queue``: no payload is copied, only the packet
id), and gives each packet its ``NF_ACCEPT`` verdict ``delay`` +- ``jitter``
seconds after it arrived (uniformly drawn, seeded): packets of one TCP
stream may overtake each other, as on a real WAN with jitter. It stops on
SIGTERM, releasing what it holds.

Why not a delaying proxy: the partition faults are iptables DROPs on the
nodes' own addresses inside their namespaces; a proxy would make every link
come from the proxy's address and hide them.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
NFGEN_HDR = struct.Struct("!BBH")    # family, version, res_id (big-endian)


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


class Queue:
    def __init__(self, num: int) -> None:
        self.num = num
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.seq = 0
        self._send(NFQNL_MSG_CONFIG, socket.AF_UNSPEC,
                   _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)))
        self._send(NFQNL_MSG_CONFIG, socket.AF_UNSPEC,
                   _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))

    def _send(self, msg: int, family: int, attrs: bytes) -> None:
        self.seq += 1
        body = NFGEN_HDR.pack(family, 0, self.num) + attrs
        header = NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg,
                                NLM_F_REQUEST, self.seq, 0)
        self.sock.send(header + body)

    def packets(self) -> list[int]:
        """The ids of the packets one read brought (errors of our requests raise)."""
        data = self.sock.recv(1 << 16)
        ids = []
        offset = 0
        while offset + NLMSG_HDR.size <= len(data):
            length, kind, _flags, _seq, _pid = NLMSG_HDR.unpack_from(data, offset)
            if length < NLMSG_HDR.size:
                break
            if kind == NLMSG_ERROR:
                (errno,) = struct.unpack_from("=i", data, offset + NLMSG_HDR.size)
                if errno:
                    raise OSError(-errno, "nfnetlink_queue refused a request")
            elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                pos = offset + NLMSG_HDR.size + NFGEN_HDR.size
                end = offset + length
                while pos + 4 <= end:
                    alen, akind = struct.unpack_from("=HH", data, pos)
                    if alen < 4:
                        break
                    if akind & 0x7FFF == NFQA_PACKET_HDR:
                        (pid,) = struct.unpack_from("!I", data, pos + 4)
                        ids.append(pid)
                    pos += (alen + 3) & ~3
            offset += (length + 3) & ~3
        return ids

    def accept(self, packet_id: int) -> None:
        self._send(NFQNL_MSG_VERDICT, socket.AF_UNSPEC,
                   _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)))


def run(num: int, delay: float, jitter: float, seed: int) -> None:
    rng = random.Random(seed)
    queue = Queue(num)
    held: list[tuple[float, int]] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"nfqdelay: queue {num}, delay {delay:.3f}s +- {jitter:.3f}s", flush=True)
    while not stopping:
        now = time.monotonic()
        while held and held[0][0] <= now:
            queue.accept(heapq.heappop(held)[1])
        timeout = max(0.0, held[0][0] - now) if held else 0.2
        try:
            ready, _, _ = select.select([queue.sock], [], [], timeout)
        except InterruptedError:
            continue
        if ready:
            arrived = time.monotonic()
            for pid in queue.packets():
                due = arrived + delay + rng.uniform(-jitter, jitter)
                heapq.heappush(held, (due, pid))
    for _, pid in held:
        queue.accept(pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.15)
    parser.add_argument("--jitter", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run(args.queue, args.delay, args.jitter, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
