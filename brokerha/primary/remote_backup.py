"""RemoteBackup: the primary's view of one joined backup (Qpid's name).

It holds what is still to be sent (the outbox), what the backup acknowledged,
the QueueGuards and ReplicatingSubscriptions of its join, and whether it has
gone silent. Acknowledgements below the join's seq only report catch-up
progress: until the backup acknowledged the CaughtUp marker it holds no
consistent copy, so it neither counts for a majority nor is ready.

A backup that joined while transactions were prepared holds them as
prepared, not yet their effects: its TxTrackers (``primary.tx_tracker``) keep
it from being *ready* (promotable) until their outcomes reached it. It
counts for the majority as soon as it caught up.

Asked to join again (``rejoining``: a queue's ``ha-replicate`` became ``all``,
``Primary.replicate_changed``) it leaves the guarded set at once, as if it
timed out, until its new session replaces this one.

Guarded (confirms wait for it) only once *admitted*: it caught up and holds
everything that may have been confirmed meanwhile (``Primary._readmit``).
While it catches up, confirms do not wait for it -- the majority decides
alone, as for a backup that timed out -- so a catch-up of minutes does not
hold the clients' confirms for minutes; and it is not ready (promotable)
before it is admitted, so a ready backup still holds everything confirmed.
Its catch-up (``catch_up.py``) is made as it is sent, a slice per flush,
behind a window of unacknowledged bytes; live events wait behind it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from brokerha.cluster.replication import Events
from brokerha.primary.catch_up import CatchUp, Pace
from brokerha.primary.events import Event, event_size, event_work
from brokerha.primary.queue_guard import QueueGuard
from brokerha.primary.replicating_subscription import ReplicatingSubscription
from brokerha.primary.tx_tracker import TxTracker

EVENTS_PER_PACKET = 2048
BYTES_PER_PACKET = 1 << 20
# entries a packet touches at most (dequeue positions count one each): a backup applies a
# packet in one step, and a packet of 1 MiB of dequeue events was ~110,000 positions,
# a quarter to half a second (issue 33); 16,384 still made 0.1-0.35 s steps on a loaded
# backup (a purge of 1,000,000, from source): one dequeue event's worth
WORK_PER_PACKET = 4096
# bytes of live events taken per flush (one a loop turn), the rest the next turns in order:
# packing and writing are the loop's, and one 50 MiB message to two backups in one flush
# held it 0.1-0.4 s (issue 33); a large body comes in parts (``events.BODY_PART_BYTES``)
FLUSH_BYTES = 4 << 20


class RemoteBackup:
    def __init__(self, node: str, catch_up: CatchUp, now: float,
                 events_per_packet: int = EVENTS_PER_PACKET, pace: Pace | None = None,
                 flush_bytes: int = FLUSH_BYTES) -> None:
        self.node = node
        self.events_per_packet = events_per_packet
        self.flush_bytes = flush_bytes  # live events taken per flush (smaller in simulations)
        self.pace = pace or Pace()
        self.catch_up: CatchUp | None = catch_up  # None once its last event is sent
        self.join_seq = catch_up.join_seq    # the CaughtUp marker's seq
        self.valid_at: int | None = None     # from the marker: a consistent copy from there
        self.first_seq = catch_up.first_seq  # the catch-up's first seq (acks below: progress)
        self.outbox: deque[tuple[int, Event]] = deque()  # live events (after the join)
        self.sent_seq = self.first_seq - 1
        self.progress = self.first_seq - 1  # highest acknowledged seq, catch-up included
        self._in_flight: deque[tuple[int, int]] = deque()  # catch-up packets: (last seq, bytes)
        self._in_flight_bytes = 0
        self._live_sent: deque[tuple[int, float]] = deque()  # live takes: (last seq, when)
        self.guards: list[QueueGuard] = []
        self.subscriptions: list[ReplicatingSubscription] = []
        self.tx_trackers: list[TxTracker] = []
        self.admitted = False  # caught up and holding everything confirmed: Primary._readmit
        self.timed_out = False
        # the primary's count of ha-replicate changes when it joined: a later change that
        # made a queue replicated whole reaches it only by joining again (Primary.replicate)
        self.replicate_gen = 0
        # asked to join again (an ``rj`` sent): out of the guarded set until its new session
        self.rejoining = False
        self.waiting_since: float | None = None  # sent but unacknowledged since
        self.heard_at = now  # the last packet of any kind from it (heartbeat acks too)
        self.joined_at = now

    # -- state -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Holds a consistent copy, every TxTracker clear: may be promoted."""
        return self.holds_copy and not self.tx_trackers

    @property
    def holds_copy(self) -> bool:
        """Acknowledged the marker, admitted and not timed out: guarded."""
        return self.caught_up and self.guarded

    @property
    def caught_up(self) -> bool:
        """It acknowledged everything up to the marker's ``valid_at``: it holds a copy."""
        return self.valid_at is not None and self.progress >= self.valid_at

    @property
    def acked(self) -> int | None:
        """The acknowledgement that counts for the quorum (None while catching up)."""
        return self.progress if self.caught_up else None

    @property
    def guarded(self) -> bool:
        """Confirms and transactions wait for it."""
        return self.admitted and not self.timed_out and not self.rejoining

    @property
    def more_to_send(self) -> bool:
        """Live events left for the next flush (past ``flush_bytes``): flush again soon."""
        return self.catch_up is None and bool(self.outbox)

    @property
    def wants_catch_up_slice(self) -> bool:
        """More of its catch-up is to be made and its window is open: flush again soon."""
        return self.catch_up is not None and self._in_flight_bytes < self.pace.window_bytes

    # -- sending -----------------------------------------------------------------------

    def queue(self, seq: int, event: Event) -> None:
        self.outbox.append((seq, event))

    def take_outbox(self, epoch: int, now: float,
                    shared: dict[tuple[int, int, int, int], Events]) -> list[Events]:
        """The queued events as packets of consecutive seqs, bounded in count and bytes;
        at most ``flush_bytes`` of them a flush (``more_to_send``: the rest the next).

        ``shared``: the packets other sessions took of the same events. A packet
        of the same seqs holding the same event objects is taken from there, so
        that the link packs it once for all backups (``Events.ENCODE_ONCE``).
        Catch-up events are objects of their own: a catching-up backup never
        shares them.
        """
        packets: list[Events] = []
        if self.catch_up is not None:
            self._take_catch_up(epoch, packets)
            if self.catch_up is not None:  # live events wait behind it
                if packets and self.waiting_since is None:
                    self.waiting_since = now
                return packets
        outbox = self.outbox
        live = bool(outbox)
        taken = 0
        while outbox and taken < self.flush_bytes:
            first = outbox[0][0]
            batch: list[Any] = []
            size = work = 0
            while (outbox and len(batch) < self.events_per_packet and size < BYTES_PER_PACKET
                   and work < WORK_PER_PACKET):
                _, event = outbox.popleft()
                batch.append(event)
                size += event_size(event)
                work += event_work(event)
            key = (first, len(batch), id(batch[0]), id(batch[-1]))
            packet = shared.get(key)
            if packet is None:
                packet = shared[key] = Events(epoch, first, batch)
            packets.append(packet)
            self.sent_seq = first + len(batch) - 1
            taken += size
        if live:
            self._live_sent.append((self.sent_seq, now))
        if packets and self.waiting_since is None:
            self.waiting_since = now
        return packets

    # -- acknowledgements and silence --------------------------------------------------

    def ack(self, seq: int, now: float) -> bool:
        """Record a cumulative acknowledgement; True if it moved forward."""
        if seq <= self.progress or seq > self.sent_seq:
            return False
        self.progress = seq
        in_flight = self._in_flight
        while in_flight and in_flight[0][0] <= seq:
            self._in_flight_bytes -= in_flight.popleft()[1]
        live = self._live_sent
        while live and live[0][0] <= seq:
            live.popleft()
        if self.tx_trackers:
            self.tx_trackers = [t for t in self.tx_trackers if not t.cleared(seq)]
        idle = seq >= self.sent_seq and not self.outbox and self.catch_up is None
        self.waiting_since = None if idle else now
        return True

    def _take_catch_up(self, epoch: int, packets: list[Events]) -> None:
        """One slice of the catch-up, within the window; the marker ends it."""
        catch_up = self.catch_up
        assert catch_up is not None
        pace = self.pace
        budget = min(pace.slice_bytes, pace.window_bytes - self._in_flight_bytes)
        work = pace.slice_work
        while budget > 0 and work > 0 and not catch_up.done:
            first = catch_up.next_seq
            events, used = catch_up.take(min(budget, BYTES_PER_PACKET), self.events_per_packet,
                                         work)
            work -= used
            if not events:
                continue
            size = sum(event_size(e) for e in events)
            budget -= size
            packets.append(Events(epoch, first, events))
            self.sent_seq = first + len(events) - 1
            self._in_flight.append((self.sent_seq, size))
            self._in_flight_bytes += size
        if catch_up.done:
            self.valid_at = catch_up.valid_at
            self.catch_up = None
            self.sent_seq = self.join_seq  # the marker's: the backup's applied seq moves to it

    def ack_lag(self, now: float) -> float:
        """How long ago the oldest live event it has not acknowledged was sent (0: none)."""
        return now - self._live_sent[0][1] if self._live_sent else 0.0

    def silent_for(self, now: float) -> float:
        """Seconds it has owed an acknowledgement (0 when it owes none)."""
        return 0.0 if self.waiting_since is None else now - self.waiting_since

    def status(self, seq: int) -> dict[str, Any]:
        acked = self.acked
        return {
            "ready": self.ready,
            "caught_up": self.caught_up,
            "timed_out": self.timed_out,
            "rejoining": self.rejoining,
            "guarded": self.guarded,
            "acked": acked,
            "lag": None if acked is None else seq - acked,
            "join_seq": self.join_seq,
            "queues": len(self.guards),
            "tx_trackers": len(self.tx_trackers),
            "queues_caught_up": sum(1 for g in self.guards if g.passed(self.progress)),
            "catch_up": {"sent": sum(s.sent for s in self.subscriptions),
                         "skipped": sum(s.skipped for s in self.subscriptions),
                         "dropped": sum(s.dropped for s in self.subscriptions),
                         "gone": sum(s.gone for s in self.subscriptions),
                         "bytes": sum(s.bytes for s in self.subscriptions),
                         "streaming": self.catch_up is not None,
                         "in_flight_bytes": self._in_flight_bytes},
        }
