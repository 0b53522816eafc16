"""One link per node pair for every replication group of a partitioned node: ``GroupMux``.

Sans-I/O. A node of a partitioned cluster (docs/ha.md "Partitions") runs one
``HAMember`` per group it is a member of -- the metadata group (0) and one
per partition cell it holds (partition p is group p + 1) -- and each speaks
today's packets (``Election``'s, ``Events``, ``Join``, ``Ack``...), none of
which names a group. The mux puts them all on the one cluster link each node
pair has:

- every packet goes as ``Grouped(group, code, args)``: the group, then the
  packet as the codec would frame it alone (``code``, its ``to_args``);
  ``unwrap`` gives the receiving side the group's own packet back, through
  the same ``from_args`` (an ``Events``' records included);
- heartbeats are **bundled**: the ``Heartbeat`` of every group one node
  leads, sent to one peer in one turn of its loop (``flush``, scheduled at
  the first one), go as one ``Heartbeats`` packet, and the acknowledgements a
  peer sends back in one turn as one ``HeartbeatAcks``; each ``Election``
  still sends and receives its own ``Heartbeat``/``HeartbeatAck``. So a pair
  of nodes exchanges at most one heartbeat packet each way per loop turn that
  sends any, whatever P is (per tick: ``ha.member.TICK``).

A bundle entry carries its own stamp: the elections of one node became
primaries at different instants, so their heartbeats fall due on different
ticks; each echoes its own stamp, which its lease is computed from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from brokerha.cluster.election import Heartbeat, HeartbeatAck
from brokerha.cluster.messages import REGISTRY, Message, packet


@packet(20)
class Grouped(Message):
    """One replication group's packet (``code``, ``args``: as it is framed alone)."""

    group: int
    code: int
    args: list[Any]


@packet(21)
class Heartbeats(Message):
    """The sender's heartbeats of every group it leads, this loop turn: ``[[group, epoch,
    stamp], ...]`` (each a ``Heartbeat(epoch, sender, stamp)`` of its group)."""

    beats: list[Any]


@packet(22)
class HeartbeatAcks(Message):
    """The sender's acknowledgements of heartbeats, this loop turn: ``[[group, epoch,
    stamp, pos_epoch, pos_seq, ready], ...]`` (each a ``HeartbeatAck`` of its group)."""

    acks: list[Any]


class MuxError(ValueError):
    """A packet that is no mux packet, or names a packet code nobody registered."""


def wrap(group: int, message: Message) -> Grouped:
    return Grouped(group, message.CODE, message.to_args())


def unwrap(peer: str, packet: Message) -> list[tuple[int, Message]]:
    """The groups' own packets in a mux packet from ``peer``, in the order sent."""
    if isinstance(packet, Grouped):
        kind = REGISTRY.get(packet.code)
        if kind is None or kind in (Grouped, Heartbeats, HeartbeatAcks):
            raise MuxError(f"group {packet.group}: packet code {packet.code} cannot be grouped")
        return [(packet.group, kind.from_args(list(packet.args)))]
    if isinstance(packet, Heartbeats):
        return [(int(g), Heartbeat(int(epoch), peer, float(stamp)))
                for g, epoch, stamp in packet.beats]
    if isinstance(packet, HeartbeatAcks):
        return [(int(g), HeartbeatAck(int(epoch), peer, float(stamp), int(pe), int(ps),
                                      bool(ready)))
                for g, epoch, stamp, pe, ps, ready in packet.acks]
    raise MuxError(f"{type(packet).__name__} from {peer} is not a mux packet")


class GroupMux:
    """The sending side: a group's packet to a peer goes out wrapped, its heartbeats and
    heartbeat acknowledgements bundled per peer until ``flush``.

    ``send(peer, packet)`` puts a packet on the link; ``soon(callback)`` runs
    ``callback`` once the current input is handled (the loop's next turn): the
    bundles go then, unless the driver flushed first.
    """

    def __init__(self, send: Callable[[str, Message], None],
                 soon: Callable[[Callable[[], None]], None]) -> None:
        self._send = send
        self._soon = soon
        self._beats: dict[str, list[list[Any]]] = {}
        self._acks: dict[str, list[list[Any]]] = {}
        self._flush_scheduled = False
        self.sent: Counter[str] = Counter()  # packets put on the link, by kind (status, tests)
        self.bundled = 0  # heartbeats and acks that went in a bundle

    def send(self, group: int, peer: str, message: Message) -> None:
        if type(message) is Heartbeat:
            self._hold(self._beats, peer, [group, message.epoch, message.stamp])
        elif type(message) is HeartbeatAck:
            self._hold(self._acks, peer, [group, message.epoch, message.stamp,
                                          message.pos_epoch, message.pos_seq, message.ready])
        else:
            self.sent["grouped"] += 1
            self._send(peer, wrap(group, message))

    def _hold(self, held: dict[str, list[list[Any]]], peer: str, entry: list[Any]) -> None:
        held.setdefault(peer, []).append(entry)
        self.bundled += 1
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._soon(self.flush)

    def flush(self) -> None:
        """Send the bundles held (peers in name order: the same input, the same packets)."""
        self._flush_scheduled = False
        beats, self._beats = self._beats, {}
        acks, self._acks = self._acks, {}
        for peer in sorted(beats):
            self.sent["heartbeats"] += 1
            self._send(peer, Heartbeats(beats[peer]))
        for peer in sorted(acks):
            self.sent["heartbeat_acks"] += 1
            self._send(peer, HeartbeatAcks(acks[peer]))
