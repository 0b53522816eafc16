"""A backup applies a big transaction's commit in slices, in order, and acks it after.

Issue 33: the ``tc`` of a TX of 100,000 messages (whose ``te`` events came
ahead) was applied in one step of the backup's loop, 0.2-0.45 s under load.
Now it is applied ``COMMIT_SLICE`` entries a loop turn: nothing of the stream
after it is applied before its last slice, its seq is acknowledged only after
that, and the backup's stored position is invalid while it is half applied (a
crash then leaves a node that catches up, not one holding part of a
transaction at a valid position).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from brokerha.backup.transaction_replicator import COMMIT_SLICE
from brokerha.broker.storage import MemoryStore
from brokerha.cluster import replication as R
from brokerha.cluster.election import Position
from brokerha.cluster.replication import Ack, Events, Join
from brokerha.cluster.state import NodeState
from brokerha.ha.core import POSITION_KEY, HACore, PrimarySettings
from brokerha.primary import tx_observer
from tests.ha.harness import Cluster, publish, route, wire
from tests.ha.test_transactions import bodies, joined, same

N = 2 * COMMIT_SLICE + 100  # three slices


@pytest.fixture(autouse=True)
def te_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TX's content goes as ``te`` events as it is published; the tc refers to them."""
    monkeypatch.setattr(tx_observer, "TC_CONTENT_BYTES", 1000)


def big_tx(c: Cluster) -> Any:
    """A TX of N messages on q3, its te events carried; the commit started, its tc emitted."""
    tx = c.broker.new_transaction()
    for i in range(N):
        queues, msg = route(c.broker, b"%d" % i, rk="q3", persistent=True)
        tx.publish(queues, msg)
    c.pump()
    return asyncio.ensure_future(tx.commit())


async def tc_packets(c: Cluster, node: str) -> list[Events]:
    """The packets up to the one carrying the tc (the loop turns the commit takes)."""
    packets: list[Events] = []
    for _ in range(20):
        await asyncio.sleep(0)
        packets += c.primary.take_outbox(node)
        if any(e.kind == R.TX_COMMIT for p in packets for e in p.events):
            return packets
    raise AssertionError("no tc sent")


def test_a_big_commit_is_applied_in_slices_and_what_follows_waits_behind_it() -> None:
    async def scenario() -> None:
        c = joined(2, "n2")
        backup = c.node("n2").backup
        assert backup is not None
        commit = big_tx(c)
        packets = await tc_packets(c, "n2")
        publish(c.broker, b"after", rk="q3", persistent=True)  # a later event of the stream
        later = c.primary.take_outbox("n2")
        tc_seq = c.primary.seq - 1
        q3 = c.node("n2").broker.vhosts["/"].queues["q3"]
        for packet in packets:
            backup.receive(wire(packet))  # type: ignore[arg-type]
        for packet in later:  # received while the commit is applied: held
            backup.receive(wire(packet))  # type: ignore[arg-type]
        slices = 1
        while backup.busy:
            # the commit's seq is not applied (so not acknowledged) before its last slice
            assert backup.applied_seq == tc_seq - 1
            assert wire(backup.ack_message()).seq < tc_seq  # type: ignore[attr-defined]
            assert len(q3.ready) == slices * COMMIT_SLICE  # bounded: one slice a step
            assert b"after" not in bodies(c.node("n2").broker, "q3")
            backup.step()
            slices += 1
        assert slices == 3
        assert backup.applied_seq == tc_seq + 1  # the commit, then the held publish
        assert bodies(c.node("n2").broker, "q3")[-1] == b"after"
        c.primary.backup_acked("n2", wire(backup.ack_message()).seq)  # type: ignore[attr-defined]
        await commit
        same(c)

    asyncio.run(scenario())


def test_settle_applies_the_rest_of_a_commit_at_once_and_drops_what_waited() -> None:
    """Joining again or changing role mid-commit: never a transaction half applied."""
    async def scenario() -> None:
        c = joined(2, "n2")
        backup = c.node("n2").backup
        assert backup is not None
        big_tx(c)
        for packet in await tc_packets(c, "n2"):
            backup.receive(wire(packet))  # type: ignore[arg-type]
        publish(c.broker, b"after", rk="q3", persistent=True)
        for packet in c.primary.take_outbox("n2"):
            backup.receive(wire(packet))  # type: ignore[arg-type]
        assert backup.busy
        backup.settle()
        assert not backup.busy
        assert len(c.node("n2").broker.vhosts["/"].queues["q3"].ready) == N
        assert backup.applied_seq == c.primary.seq - 1  # the tc's: "after" was dropped

    asyncio.run(scenario())


class Effects:
    """HACore's effects, recorded: ``soon`` callbacks are the next loop turns."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.positions: list[Position] = []
        self.soon_calls: list[Callable[[], None]] = []

    def send(self, peer: str, message: Any) -> None:
        self.sent.append(wire(message))

    def send_many(self, peer: str, messages: Any) -> None:
        self.sent += [wire(m) for m in messages]

    def connected(self, peer: str) -> bool:
        return True

    def position(self, pos: Position) -> None:
        self.positions.append(pos)

    def soon(self, callback: Callable[[], None]) -> None:
        self.soon_calls.append(callback)

    def later(self, delay: float, callback: Callable[[], None]) -> Any:
        return asyncio.get_event_loop().call_later(delay, callback)

    def replication_failed(self, reason: str) -> None:
        raise AssertionError(reason)

    def joined(self, primary: str, epoch: int) -> None:
        pass

    def turn(self) -> int:
        """One loop turn: the callbacks scheduled so far; how many ran."""
        calls, self.soon_calls = self.soon_calls, []
        for call in calls:
            call()
        return len(calls)


def stored_position(store: MemoryStore) -> tuple[int, int]:
    pos_epoch, pos_seq, _, _ = json.loads(store.meta[POSITION_KEY])
    return pos_epoch, pos_seq


def test_the_backups_core_acks_the_commit_after_its_last_slice_its_stored_position_invalid_until() -> None:
    async def scenario() -> None:
        c = joined(2)
        broker = c.node("n2").broker
        store = broker.store
        assert isinstance(store, MemoryStore)
        effects = Effects()
        core = HACore(broker, "n2", NodeState(), effects, PrimarySettings(members=2), c.clock)
        core.become_backup(1, "n1")
        [join] = effects.sent
        assert isinstance(join, Join)
        c.primary.backup_joined(join)

        def deliver(packets: list[Events]) -> None:
            for packet in packets:
                core.on_events("n1", wire(packet))  # type: ignore[arg-type]
            effects.turn()
            for ack in [m for m in effects.sent if isinstance(m, Ack)]:
                c.primary.backup_acked("n2", ack.seq)
            effects.sent.clear()

        while out := c.primary.take_outbox("n2"):
            deliver(out)
        assert core.backup is not None and core.backup.caught_up
        c.node("n2").backup = core.backup  # the harness's pump carries the te events
        commit = big_tx(c)
        packets = await tc_packets(c, "n2")
        tc_seq = c.primary.seq
        effects.positions.clear()
        for packet in packets:
            core.on_events("n1", wire(packet))  # type: ignore[arg-type]
        assert core.backup.busy
        assert stored_position(store) == (-1, -1)  # with the first slice's changes
        assert Position.INVALID not in effects.positions  # the election's is unchanged
        turns = 0
        while core.backup.busy:
            assert not [m for m in effects.sent if isinstance(m, Ack) and m.seq >= tc_seq]
            assert stored_position(store) == (-1, -1)
            assert effects.turn() == 1  # one slice a turn, scheduled with ``soon``
            turns += 1
        assert turns == 2
        acks = [m.seq for m in effects.sent if isinstance(m, Ack)]
        assert acks[-1] == tc_seq
        assert stored_position(store) == (1, tc_seq)
        c.primary.backup_acked("n2", tc_seq)
        await commit
        same(c)

    asyncio.run(scenario())


def test_a_backup_promoted_mid_commit_applies_the_rest_first() -> None:
    """The election saw the position before the tc; the new primary holds all of it."""
    async def scenario() -> None:
        c = joined(2)
        broker = c.node("n2").broker
        effects = Effects()
        core = HACore(broker, "n2", NodeState(), effects, PrimarySettings(members=2), c.clock)
        core.become_backup(1, "n1")
        [join] = effects.sent
        c.primary.backup_joined(join)
        while out := c.primary.take_outbox("n2"):
            for packet in out:
                core.on_events("n1", wire(packet))  # type: ignore[arg-type]
        assert core.backup is not None
        c.node("n2").backup = core.backup
        big_tx(c)
        for packet in await tc_packets(c, "n2"):
            core.on_events("n1", wire(packet))  # type: ignore[arg-type]
        assert core.backup.busy
        core.become_primary(2)  # before the next slice's turn
        assert len(broker.vhosts["/"].queues["q3"].ready) == N
        effects.turn()  # the slice that was scheduled finds nothing to do

    asyncio.run(scenario())


def test_an_acknowledgement_sent_mid_commit_raises_the_stored_vote_floor() -> None:
    """Events before a big tc, in its packet, are acknowledged while the commit is applied
    in slices: the stored position stays invalid, and the stored floor covers the ack (a
    backup that crashed then voted for a primary without what it had acknowledged: a
    transaction answered commit-ok was lost; the simulation with small bounds, seed 1512)."""
    async def scenario() -> None:
        c = joined(2)
        broker = c.node("n2").broker
        store = broker.store
        assert isinstance(store, MemoryStore)
        effects = Effects()
        state = NodeState()
        core = HACore(broker, "n2", state, effects, PrimarySettings(members=2), c.clock)
        core.become_backup(1, "n1")
        [join] = effects.sent
        c.primary.backup_joined(join)
        while out := c.primary.take_outbox("n2"):
            for packet in out:
                core.on_events("n1", wire(packet))  # type: ignore[arg-type]
            effects.turn()
        assert core.backup is not None and core.backup.caught_up
        c.node("n2").backup = core.backup
        effects.sent.clear()
        publish(c.broker, b"before", rk="q3", persistent=True)
        big_tx(c)
        packets = await tc_packets(c, "n2")
        tc_seq = c.primary.seq
        events = [e for p in packets for e in p.events]
        first = packets[0].first_seq
        core.on_events("n1", wire(Events(1, first, events)))  # type: ignore[arg-type]
        assert core.backup.busy
        acks = [m.seq for m in effects.sent if isinstance(m, Ack)]
        assert acks == [tc_seq - 1]  # what came before the tc, acknowledged mid-commit
        pos_epoch, pos_seq, floor_epoch, floor_seq = json.loads(store.meta[POSITION_KEY])
        assert (pos_epoch, pos_seq) == (-1, -1)
        assert (floor_epoch, floor_seq) >= (1, tc_seq - 1)
        assert (state.floor_epoch, state.floor_seq) >= (1, tc_seq - 1)

    asyncio.run(scenario())
