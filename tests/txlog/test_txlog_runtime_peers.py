"""TxLog changes at runtime on broker nodes: ``brokerha ctl txlog add-peer|remove-peer|split-recovery``.

In process: the backup side writes the peers file the primary replicates
(``lp``), a joining backup's catch-up carries it, a master started on a
backup's directory (a promotion) runs with the runtime peers and strategy, and
the admin routes refuse bad input and refuse on a node that does not run the
master. As processes: two standalone DCs, dc2 added to dc1 with ``brokerha
ctl`` and global queues flowing after it; and an HA dc1 whose runtime peer
survives the SIGKILL of its primary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from brokerha.admin.api import AdminAPI
from brokerha.cluster import replication as R
from brokerha.cluster.replication import ReplicationError
from brokerha.httpapi.server import HTTPError, Request
from brokerha.primary.events import event_size
from brokerha.testing import NodeProcess, free_port
from brokerha.txlog.bridge.replica import TxLogReplica
from brokerha.txlog.engine.config import ConfigError, Peer, SplitRecovery
from brokerha.txlog.master.driver import (
    PEERS_FILE,
    TxLogDriver,
    decode_peers,
    encode_peers,
    read_peers_file,
)
from brokerha.txlog.master.journal import decode_record
from tests.txlog.test_broker_bridge import in_loop, started
from tests.txlog.test_broker_txlog import (
    DC,
    GLOBAL,
    peer_entries,
    publish_confirmed,
    publish_tx,
    same_everywhere,
    wait_for,
)
from tests.txlog.test_txlog_replication import DC1, settings

pytestmark = pytest.mark.timeout(60)

DC2_URL = "txlog://127.0.0.1:1"


class FakePrimary:
    """What the bridge needs of an HA ``Primary``: the log (``emit``) and its barrier."""

    def __init__(self) -> None:
        self.emitted: list[list[Any]] = []
        self.catch_up_providers: list[Any] = []
        self.hold = False  # True: nothing reaches the quorum (no backup acknowledges)

    def emit(self, event: list[Any]) -> None:
        self.emitted.append(event)

    def barrier(self, callback: Any) -> None:
        if not self.hold:
            callback()


# ---- in process: the backup side ------------------------------------------------------


def test_a_backup_writes_the_peers_its_primary_replicates(tmp_path: Path) -> None:
    replica = TxLogReplica(tmp_path / "n2", settings("dc1", tmp_path, {}).txlog,
                           on_applied=lambda _: None, fsync=False)
    data = encode_peers([Peer("dc2", "txlog://10.0.2.5:7100, txlog://10.0.2.6:7100")])
    replica.apply([R.TXLOG_PEERS, data])
    assert (tmp_path / "n2" / PEERS_FILE).read_bytes() == data
    assert decode_peers(read_peers_file(tmp_path / "n2") or b"")[0].node_id == "dc2"
    assert not (tmp_path / "n2" / "txlog-peers.json.tmp").exists()  # written atomically
    replica.apply([R.TXLOG_PEERS, None])  # the primary runs on the configuration's peers
    assert read_peers_file(tmp_path / "n2") is None
    with pytest.raises(ReplicationError, match="peers unreadable"):
        replica.apply([R.TXLOG_PEERS, b'{"not": "a list"}'])
    assert read_peers_file(tmp_path / "n2") is None  # a bad file is never written
    assert replica.counters["peer_changes"] == 2
    assert event_size([R.TXLOG_PEERS, data]) == 64 + len(data)
    assert event_size([R.TXLOG_PEERS, None]) == 64
    replica.suspend()  # the master runs here now: never acknowledge what was not written
    with pytest.raises(ReplicationError):
        replica.apply([R.TXLOG_PEERS, data])


@in_loop
async def test_peers_reach_the_backups_and_a_joiners_catch_up_through_the_ha_log(
        tmp_path: Path) -> None:
    """The real Primary/Backup pair (tests/ha/harness.py): ``lp`` in the log and in a catch-up."""
    dc1 = DC1(tmp_path, 3, {"dc2": free_port()})
    primary_dir = tmp_path / "n1"
    dc1.cluster.primary.catch_up_providers.append(
        lambda: [[R.TXLOG_PEERS, read_peers_file(primary_dir)]])
    dc1.follow("n2")
    dc1.cluster.pump()
    peers = (*dc1.settings.txlog.peers, Peer("dc3", "txlog://127.0.0.1:2"))
    data = encode_peers(peers)
    (primary_dir / PEERS_FILE).write_bytes(data)
    dc1.cluster.primary.emit([R.TXLOG_PEERS, data])
    dc1.cluster.pump()
    assert read_peers_file(tmp_path / "n2") == data
    dc1.follow("n3")  # joins after the change: its catch-up carries the file
    dc1.cluster.pump()
    assert read_peers_file(tmp_path / "n3") == data
    # n3 promoted: its master dials and accepts the runtime peers, not the configuration's
    dc1.replicas["n3"].suspend()
    promoted = TxLogDriver(settings("dc1", tmp_path / "n3", {"dc2": 1}), fsync=False)
    try:
        assert [p.node_id for p in promoted.engine.config.peers] == ["dc2", "dc3"]
    finally:
        promoted.journal.close()
        dc1.driver.journal.close()


# ---- in process: a crash between the journal record and the peers file ---------------


@in_loop
async def test_a_crash_before_the_peers_file_is_written_keeps_the_journals_peers(
        tmp_path: Path) -> None:
    """The journal record of a runtime change is what counts, not the file beside it.

    A removal persists the new view and the new peers in one record; the
    file follows once that record is on disk. Here the crash comes between
    the two (the file is put back as it was): the restarted master takes the
    peers from the journal, so its view and its peers agree, and the file is
    written again.
    """
    master = settings("dc1", tmp_path, {"dc2": 1, "dc3": 2})
    driver = TxLogDriver(master, fsync=False)
    await driver.links.start()
    try:
        await driver.add_peer("dc4", "txlog://127.0.0.1:3")
        before = read_peers_file(tmp_path)
        assert before is not None and [p.node_id for p in decode_peers(before)] == [
            "dc2", "dc3", "dc4"]
        await driver.remove_peer("dc3")
    finally:
        await driver.close()
    (tmp_path / PEERS_FILE).write_bytes(before)  # the crash: the file never caught up

    again = TxLogDriver(master, fsync=False)
    try:
        assert [p.node_id for p in again.engine.config.peers] == ["dc2", "dc4"]
        # dc3 is gone from both (dc4 becomes a member through the next vote)
        assert again.engine.durable.members == frozenset({"dc1", "dc2"})
        assert again.engine.durable.members <= again.engine.config.masters
        assert [p.node_id for p in decode_peers(read_peers_file(tmp_path) or b"")] == [
            "dc2", "dc4"]
    finally:
        again.journal.close()

    (tmp_path / PEERS_FILE).unlink()  # nor does a lost file bring the configuration's back
    third = TxLogDriver(master, fsync=False)
    try:
        assert [p.node_id for p in third.engine.config.peers] == ["dc2", "dc4"]
    finally:
        third.journal.close()


@in_loop
async def test_the_peers_file_is_written_only_once_the_journal_record_is_on_disk(
        tmp_path: Path) -> None:
    from brokerha.txlog.master import driver as driver_module

    driver = TxLogDriver(settings("dc1", tmp_path, {"dc2": 1}), fsync=True)
    await driver.start()
    record = driver.journal.seq + 1  # the change's record
    written: list[int] = []
    write = driver_module.write_peers_file

    def write_peers_file(data_dir: Path, data: bytes | None) -> None:
        written.append(driver._synced_seq)
        write(data_dir, data)

    driver_module.write_peers_file = write_peers_file  # type: ignore[assignment]
    try:
        await driver.add_peer("dc3", "txlog://127.0.0.1:2")
        assert written and written[0] >= record, "the file went ahead of its record"
        assert [p.node_id for p in decode_peers(read_peers_file(tmp_path) or b"")] == [
            "dc2", "dc3"]
    finally:
        driver_module.write_peers_file = write  # type: ignore[assignment]
        await driver.close()


@in_loop
async def test_a_peer_change_whose_journal_record_never_syncs_answers_503(tmp_path: Path) -> None:
    """The answer waits for the record's fsync; a stalled journal is a 503, never a silent yes."""
    from brokerha.admin.api import _change
    from brokerha.txlog.master.node import MasterAPI

    driver = TxLogDriver(settings("dc1", tmp_path, {"dc2": 1}), fsync=True)
    await driver.links.start()
    driver._after_fsync = lambda callback: None  # type: ignore[method-assign]  # never synced
    api = MasterAPI(driver)
    try:
        with pytest.raises(TimeoutError):
            await driver._peers_recorded(timeout=0.05)
        driver._peers_recorded = (  # type: ignore[method-assign]
            lambda timeout=0.05, recorded=driver._peers_recorded: recorded(timeout))
        await refused(api.add_peer(post({"id": "dc3", "url": "txlog://127.0.0.1:2"})), 503,
                      "not on disk yet")
        await refused(_change(driver.remove_peer("dc3")), 503, "fsync stalled")
        assert read_peers_file(tmp_path) is None, "no file ahead of its record"
    finally:
        api.close()
        await driver.close()


# ---- in process: the bridge (the primary side) ----------------------------------------


@in_loop
async def test_the_bridge_replicates_a_runtime_change_and_a_promoted_master_keeps_it(
        tmp_path: Path) -> None:
    broker, bridge = await started(tmp_path / "n1")
    bridge.driver_factory = lambda s, **kw: TxLogDriver(s, fsync=False, **kw)
    primary = FakePrimary()
    bridge.attach_primary(primary)
    await bridge.start()
    try:
        # a master starting on a new primary: its state, then its peers (none at runtime)
        kinds = [e[0] for e in primary.emitted]
        assert kinds[0] == R.TXLOG_SNAPSHOT and R.TxLogPeers(R.TXLOG_PEERS, None) in primary.emitted
        assert [e for e in bridge.catch_up_events() if e[0] == R.TXLOG_PEERS] == [
            R.TxLogPeers(R.TXLOG_PEERS, None)]

        assert await bridge.add_peer("dc2", DC2_URL) is True
        data = [e[1] for e in primary.emitted if e[0] == R.TXLOG_PEERS][-1]
        assert decode_peers(data) == (Peer("dc2", DC2_URL),)
        assert [e[1] for e in bridge.catch_up_events() if e[0] == R.TXLOG_PEERS] == [data]
        for bad, text in ((lambda: bridge.add_peer("dc2", DC2_URL), "already configured"),
                          (lambda: bridge.add_peer("dc1", DC2_URL), "already configured"),
                          (lambda: bridge.remove_peer("dc9"), "not a configured peer"),
                          (lambda: bridge.set_split_recovery("sometimes"), "not one of")):
            with pytest.raises(ConfigError, match=text):
                await bad()

        # the strategy is durable engine state: a journal record (lr) carries it
        before = len(primary.emitted)
        assert await bridge.set_split_recovery("SIMPLE") is True
        records = [decode_record(e[2])[1] for e in primary.emitted[before:]
                   if e[0] == R.TXLOG_RECORD]
        assert ("strategy", SplitRecovery.SIMPLE) in [c for changes in records for c in changes]

        # a backup fed this log, promoted, runs with the runtime peer and strategy
        replica = TxLogReplica(tmp_path / "n2", bridge.config.settings.txlog,
                               on_applied=lambda _: None, fsync=False)
        for event in primary.emitted:
            replica.apply(event)
        replica.suspend()
        promoted = TxLogDriver(replace(bridge.config.settings, data_dir=tmp_path / "n2"),
                               fsync=False)
        try:
            assert promoted.engine.config.peers == (Peer("dc2", DC2_URL),)
            assert promoted.engine.durable.strategy is SplitRecovery.SIMPLE
        finally:
            promoted.journal.close()

        # no backup acknowledges: the change is made, the answer says it is not replicated
        primary.hold = True
        assert await bridge._on_quorum(timeout=0.05) is False
    finally:
        await bridge.stop()


# ---- in process: the admin routes ------------------------------------------------------


def post(body: Any) -> Request:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Request("POST", "/", {}, {}, raw, "127.0.0.1")


async def refused(call: Any, status: int, text: str) -> None:
    with pytest.raises(HTTPError) as info:
        await call
    assert info.value.status == status and text in str(info.value), (info.value.status,
                                                                     str(info.value))


@in_loop
async def test_the_admin_routes_refuse_bad_input_and_nodes_without_the_master(
        tmp_path: Path) -> None:
    broker, bridge = await started(tmp_path)
    node = SimpleNamespace(config=SimpleNamespace(name="n2"), txlog=bridge, ha=None)
    api = AdminAPI(node)
    # not running: a cluster member that is not the primary says which node is
    node.ha = SimpleNamespace(election=SimpleNamespace(primary="n1"), cluster=SimpleNamespace(
        members=[SimpleNamespace(name="n1", admin_url="http://10.0.1.5:15672")]))
    await refused(api.txlog_add_peer(post({"id": "dc2", "url": DC2_URL})), 409,
                  "the DC's serving primary is n1 (http://10.0.1.5:15672)")
    node.ha.election.primary = None
    await refused(api.txlog_split_recovery(post({"value": "simple"})), 409,
                  "no primary is serving")
    node.txlog = None
    await refused(api.txlog_remove_peer(post({"id": "dc2"})), 409, "no [txlog] section")

    node.txlog, node.ha = bridge, None
    await bridge.start()
    try:
        for call, text in (
                (api.txlog_add_peer(post({"url": DC2_URL})), "id:"),
                (api.txlog_add_peer(post({"id": "dc2"})), "url:"),
                (api.txlog_add_peer(post({"id": "dc2", "url": "http://x:1"})), "url of peer dc2"),
                (api.txlog_add_peer(post({"id": "dc2", "url": "txlog://a:1,"})), "url of peer"),
                (api.txlog_add_peer(post([1])), "a JSON object"),
                (api.txlog_add_peer(post(b"{")), "not JSON"),
                (api.txlog_remove_peer(post({"id": ""})), "id:"),
                (api.txlog_split_recovery(post({"value": "maybe"})), "None, Simple, Smart"),
                (api.txlog_split_recovery(post({})), "value:")):
            await refused(call, 400, text)
        await refused(api.txlog_remove_peer(post({"id": "dc9"})), 409, "not a configured peer")
        assert bridge.driver is not None and bridge.driver.engine.config.peers == ()
        answer = json.loads((await api.txlog_add_peer(post({"id": "dc2", "url": DC2_URL}))).body)
        assert answer["replicated"] and "peer dc2 added" in answer["message"]
        assert [p["id"] for p in answer["peers"]] == ["dc2"]
        await refused(api.txlog_add_peer(post({"id": "dc2", "url": DC2_URL})), 409,
                      "already configured")
        answer = json.loads((await api.txlog_split_recovery(post({"value": "None"}))).body)
        assert answer["split_recovery"] == "none"
        answer = json.loads((await api.txlog_remove_peer(post({"id": "dc2"}))).body)
        assert answer["peers"] == [] and decode_peers(read_peers_file(tmp_path / "txlog")
                                                      or b"") == ()
    finally:
        await bridge.stop()

    routes: dict[tuple[str, str], bool] = {}
    from brokerha.admin import api as api_module

    api_module.install(SimpleNamespace(admin=SimpleNamespace(
        route=lambda m, p, h, admin=False: routes.__setitem__((m, p), admin))))
    assert all(routes[("POST", p)] for p in ("/api/txlog/peers", "/api/txlog/peers/remove",
                                             "/api/txlog/split-recovery"))


# ---- processes -------------------------------------------------------------------------


def ctl(admin: str, *argv: str, password: str = "guest") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node", admin,
                           "--password", password, "txlog", *argv],
                          capture_output=True, text=True, timeout=30)


def section(me: str, peers: dict[str, str], listen: int | None) -> str:
    lines = peer_entries(peers)
    where = f'listen = "127.0.0.1:{listen}"\n' if listen is not None else ""
    return (f'\n[txlog]\nnode-id = "{me}"\n{where}group = "runtime-peers"\nsecret = "s"\n'
            f'split-recovery = "Smart"\nidle-interval = 300\nMaxPeerLag = 15000\n{lines}')


def standalone(tmp_path: Path, me: str, peers: dict[str, str], port: int) -> DC:
    admin = free_port()
    cfg = tmp_path / f"{me}.toml"
    cfg.write_text(f'[node]\nadmin = "127.0.0.1:{admin}"\n' + section(me, peers, port))
    node = NodeProcess(me, data_dir=tmp_path / me, extra_args=["--config", str(cfg)])
    return DC(me, node.start(), f"http://127.0.0.1:{admin}")


def declare(dc: DC) -> None:
    with dc.connect() as conn:
        conn.channel().queue_declare(GLOBAL, durable=True, arguments={"x-global": True})


def test_ctl_adds_a_peer_to_a_running_broker_node_and_changes_its_split_recovery(
        tmp_path: Path) -> None:
    """dc1 starts alone (no peer configured); dc2 knows dc1 and is refused until dc1 adds it."""
    ports = {"dc1": free_port(), "dc2": free_port()}
    dcs: dict[str, DC] = {}
    try:
        dcs["dc1"] = standalone(tmp_path, "dc1", {}, ports["dc1"])
        dcs["dc2"] = standalone(tmp_path, "dc2", {"dc1": f"txlog://127.0.0.1:{ports['dc1']}"},
                                ports["dc2"])
        for dc in dcs.values():
            declare(dc)
        dc1 = dcs["dc1"].admin
        url2 = f"txlog://127.0.0.1:{ports['dc2']}"
        denied = ctl(dc1, "add-peer", "dc2", url2, password="wrong")
        assert denied.returncode == 1 and "401" in denied.stderr
        bad = ctl(dc1, "add-peer", "dc2", "dc2:7100")
        assert bad.returncode == 1 and "400" in bad.stderr and "url of peer dc2" in bad.stderr
        unknown = ctl(dc1, "remove-peer", "dc2")
        assert unknown.returncode == 1 and "not a configured peer" in unknown.stderr
        assert dcs["dc1"].txlog()["members"] == ["dc1"]

        done = ctl(dc1, "add-peer", "dc2", url2, "--json")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["replicated"] and [p["id"] for p in answer["peers"]] == ["dc2"]
        again = ctl(dc1, "add-peer", "dc2", url2)
        assert again.returncode == 1 and "already configured" in again.stderr
        for dc in dcs.values():
            wait_for(lambda dc=dc: dc.txlog()["members"] == ["dc1", "dc2"], timeout=20,
                     what=f"dc2 a member in {dc.name}'s view")

        publish_confirmed(dcs["dc1"], ["after-add-1"])
        publish_tx(dcs["dc2"], ["after-add-2"])
        order = wait_for(lambda: same_everywhere(dcs, GLOBAL, 2), what="both DCs equal")
        assert sorted(order) == ["after-add-1", "after-add-2"]

        shown = ctl(dc1, "split-recovery")
        assert shown.returncode == 0 and "split-recovery smart" in shown.stdout, shown
        invalid = ctl(dc1, "split-recovery", "sometimes")
        assert invalid.returncode == 1 and "None, Simple, Smart" in invalid.stderr
        changed = ctl(dc1, "split-recovery", "SIMPLE")
        assert changed.returncode == 0 and "split-recovery simple" in changed.stdout, changed
        shown = json.loads(ctl(dc1, "split-recovery", "--json").stdout)
        assert shown["split_recovery"] == "simple" and shown["master"] == "dc1"
        assert dcs["dc2"].txlog()["split_recovery"] == "smart"  # each DC's own setting
        gone = ctl(f"http://127.0.0.1:{free_port()}", "split-recovery")
        assert gone.returncode == 2 and "cannot reach" in gone.stderr
    finally:
        for dc in dcs.values():
            dc.node.close()


def test_in_an_ha_datacenter_a_runtime_peer_survives_a_failover(tmp_path: Path) -> None:
    """dc1 (3 nodes, no peer configured) gets dc2 through ``ctl`` on its primary; SIGKILL.

    The backups hold the peers file (``lp``), so the new primary's master
    dials and accepts dc2: without it, it would start with no peer and the
    DCs would stay apart.
    """
    from brokerha.cluster.ports import loopback_txlog_urls
    from brokerha.testing import LocalCluster

    cluster = LocalCluster(3, data_dir=tmp_path / "dc1")
    port2 = free_port()
    cluster.config.write_text(cluster.config.read_text() + section("dc1", {}, None))
    dc2: DC | None = None
    try:
        dc2 = standalone(tmp_path, "dc2", {"dc1": loopback_txlog_urls(3, cluster.base_port)},
                         port2)
        cluster.start()
        first = cluster.wait_primary()

        def dc1(name: str) -> DC:
            return DC("dc1", cluster.nodes[name], cluster.admin_url(name))

        backup = next(n for n in cluster.names if n != first)
        elsewhere = ctl(dc1(backup).admin, "add-peer", "dc2", f"txlog://127.0.0.1:{port2}")
        assert elsewhere.returncode == 1, elsewhere
        assert f"serving primary is {first}" in elsewhere.stderr
        done = ctl(dc1(first).admin, "add-peer", "dc2", f"txlog://127.0.0.1:{port2}", "--json")
        assert done.returncode == 0 and json.loads(done.stdout)["replicated"], done
        def held(name: str) -> list[str] | None:
            data = read_peers_file(tmp_path / "dc1" / name / "txlog")
            return None if data is None else [p.node_id for p in decode_peers(data)]

        # every node of dc1 holds the runtime peers (a backup still joining: by its catch-up)
        wait_for(lambda: all(held(n) == ["dc2"] for n in cluster.names), what="peers replicated")
        pair = {"dc1": dc1(first), "dc2": dc2}
        for dc in pair.values():
            declare(dc)
        publish_confirmed(pair["dc1"], ["a1"])
        publish_tx(dc2, ["b1"])
        wait_for(lambda: same_everywhere(pair, GLOBAL, 2), timeout=20, what="equal before")

        cluster.kill(first)
        second = cluster.wait_primary(other_than=first)
        pair["dc1"] = dc1(second)
        status = wait_for(lambda: (s := dc1(second).txlog())["running"] and s,
                          what="master on the new primary")
        assert [p["id"] for p in status["peers"]] == ["dc2"]
        publish_confirmed(pair["dc1"], ["a2"])
        order = wait_for(lambda: same_everywhere(pair, GLOBAL, 3), timeout=20,
                         what="equal after the failover")
        assert sorted(order) == ["a1", "a2", "b1"]
    finally:
        cluster.close()
        if dc2 is not None:
            dc2.node.close()
