"""The pieces of a real master below the processes: wire codec, journal, settings, refusals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest

from brokerha.cluster.messages import REGISTRY
from brokerha.txlog.engine.config import ConfigError, SplitRecovery
from brokerha.txlog.engine.messages import Ballot, Bodies, CatchUp, FetchBodies, Persist, Post, Vote
from brokerha.txlog.engine.queues import GENESIS, MergeBase
from brokerha.txlog.engine.records import Operation, TxBody, TxRecord
from brokerha.txlog.engine.rounds import RoundEngine
from brokerha.txlog.master.driver import TxLogDriver
from brokerha.txlog.master.journal import JOURNAL, Journal
from brokerha.txlog.master.settings import flatten, from_properties
from brokerha.txlog.master.wire import TxLogPacket, WireError, decode, encode
from tests.txlog.conftest import make_config

REC = TxRecord("0001.dc1", 17, "dc1", 1_700_000_000_000, None)
REPLAY = TxRecord("0002.dc2", 18, "dc2", 1_700_000_000_001, "0000.dc2")
BODY = TxBody("0001.dc1", (Operation("enqueue", "/q", "m1"), Operation("dequeue", "/q", "m0")))
BASE = MergeBase(3, "00ff00ff00ff00ff", "x.dc3")


@pytest.mark.parametrize("message", [
    Post("dc1", 2, frozenset({"dc1", "dc2"}), BASE, 99, (REC, REPLAY), (BODY,)),
    Post("dc1", 0, frozenset({"dc1"}), GENESIS, 0, (), ()),
    CatchUp("dc2", 1, frozenset({"dc1", "dc2", "dc3"}), BASE, (REC,), (BODY,)),
    FetchBodies("dc3", ("a", "b")),
    Bodies("dc1", (REC,), (BODY,)),
    Vote("dc2", 4, (Ballot("dc1", 4, GENESIS, (REC, REPLAY)), Ballot("dc2", 4, BASE, ()))),
])
def test_every_txlog_message_survives_the_wire(message: object) -> None:
    pkt = encode(message)  # type: ignore[arg-type]
    assert REGISTRY[80] is TxLogPacket and isinstance(pkt.payload, bytes)
    assert decode(TxLogPacket(pkt.payload)) == message


@pytest.mark.parametrize("payload", [
    [2, "fetch", "dc1", []],                       # unknown wire version
    [1, "gossip", "dc1"],                           # unknown kind
    [1, "fetch", "dc1", [3]],                       # tx id not a string
    [1, "post", "dc1", True, [], [0, "", None], 1, [], []],  # a bool is not a generation
    [1, "bodies", "dc1", [], [["t", [["steal", "/q", "m"]]]]],  # unknown operation
])
def test_a_malformed_payload_is_a_wire_error_not_a_crash(payload: list[object]) -> None:
    with pytest.raises(WireError):
        decode(TxLogPacket(msgpack.packb(payload)))
    with pytest.raises(WireError):
        decode(TxLogPacket(b"\xc1 not msgpack"))


def engine_with_history(tmp_path: Path) -> tuple[RoundEngine, Journal]:
    config = make_config("dc1", ["dc1"])  # a lone master orders its own transactions
    journal = Journal(tmp_path, fsync=False)
    engine = RoundEngine(config, 1_000, journal.load(config))
    for i in range(5):
        _, actions = engine.local_tx([Operation("enqueue", "/q", f"m{i}")], 1_000 + i)
        journal.write([a for a in actions if isinstance(a, Persist)], engine.durable)
        actions = engine.tick(1_000 + i + engine.wakeup_after())
        journal.write([a for a in actions if isinstance(a, Persist)], engine.durable)
    return engine, journal


def test_the_journal_rebuilds_the_durable_state(tmp_path: Path) -> None:
    engine, journal = engine_with_history(tmp_path)
    journal.close()
    assert len(engine.sync) == 5
    again = Journal(tmp_path).load(engine.config)
    assert again.sync.ids() == engine.sync.ids()
    assert again.counter_reserved == engine.durable.counter_reserved
    assert again.id_last == engine.durable.id_last
    assert again.model.queues == engine.durable.model.queues


def test_a_torn_journal_tail_is_cut_and_earlier_batches_kept(tmp_path: Path) -> None:
    engine, journal = engine_with_history(tmp_path)
    journal.close()
    path = tmp_path / JOURNAL
    whole = path.read_bytes()
    path.write_bytes(whole + whole[:30])  # a crash in the middle of the next write
    reloaded = Journal(tmp_path)
    assert reloaded.load(engine.config).sync.ids() == engine.sync.ids()
    assert path.stat().st_size == len(whole)


def test_a_snapshot_never_applies_a_journal_record_twice(tmp_path: Path) -> None:
    engine, journal = engine_with_history(tmp_path)
    old_journal = (tmp_path / JOURNAL).read_bytes()
    journal.snapshot(engine.durable)
    journal.close()
    (tmp_path / JOURNAL).write_bytes(old_journal)  # crash after the rename, before truncation
    assert Journal(tmp_path).load(engine.config).sync.ids() == engine.sync.ids()


def test_settings_use_the_seed_keys_and_refuse_mistakes(tmp_path: Path) -> None:
    doc = {"node-id": "dc1", "master-url": "txlog://127.0.0.1:7001", "group": "g",
           "secret": "s", "data-dir": "d", "split-recovery": "SIMPLE",
           "peer": {"1": {"id": "dc2", "url": "txlog://127.0.0.1:7002"}}}
    settings = from_properties(flatten(doc), tmp_path)
    assert settings.txlog.split_recovery is SplitRecovery.SIMPLE
    assert settings.peer_addresses() == {"dc2": [("127.0.0.1", 7002)]}
    assert settings.listen == ("127.0.0.1", 7001) and settings.data_dir == tmp_path / "d"
    # a peer datacenter of several nodes: its URLs, comma-separated, tried in turn
    listed = {**doc, "peer": {"1": {"id": "dc2", "url": "txlog://127.0.0.1:35672, "
                                    "txlog://127.0.0.1:35673,txlog://10.0.0.3:35674"}}}
    assert from_properties(flatten(listed), tmp_path).peer_addresses() == {
        "dc2": [("127.0.0.1", 35672), ("127.0.0.1", 35673), ("10.0.0.3", 35674)]}
    for bad, key in (({"peer-1-id": "x"}, "unknown"), ({"admin": "10.0.0.1:80"}, "loopback"),
                     ({"peer": {"1": {"id": "dc2", "url": "http://h:1"}}}, "txlog://"),
                     ({"peer": {"1": {"id": "dc2", "url": "txlog://h:1,"}}}, "peer.1.url"),
                     ({"peer": {"1": {"id": "dc2", "url": "txlog://h:1, http://h:2"}}},
                      "peer.1.url"),
                     ({"peer": {"1": {"id": "dc2", "url": "txlog://h:1, txlog://h:1"}}},
                      "peer.1.url.*twice"),
                     ({"peer": {"1": {"id": "dc2"}}}, "url required"),
                     ({"group": ""}, "group")):
        with pytest.raises(ConfigError, match=key):
            from_properties(flatten({**doc, **bad}), tmp_path)


def test_a_message_whose_sender_is_not_the_link_peer_is_refused(tmp_path: Path) -> None:
    doc = {"node-id": "dc1", "listen": "127.0.0.1:0", "group": "g", "secret": "s",
           "data-dir": str(tmp_path), "peer": {"1": {"id": "dc2", "url": "txlog://127.0.0.1:1"},
                                               "2": {"id": "dc3", "url": "txlog://127.0.0.1:2"}}}
    driver = TxLogDriver(from_properties(flatten(doc)), fsync=False)

    async def scenario() -> None:
        post = Post("dc3", 0, frozenset({"dc1", "dc2", "dc3"}), GENESIS, 5, (), ())
        driver._on_packet("dc2", 1, encode(post))  # dc2's authenticated link speaks for dc3
        driver._on_packet("dc2", 2, TxLogPacket(b"junk"))
        await driver.close()

    asyncio.run(scenario())
    assert driver.counters["refused"] == 1 and driver.counters["wire_errors"] == 1
    assert driver.counters["received"] == 0
    assert driver.events[-1]["kind"] == "refused"
