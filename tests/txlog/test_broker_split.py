"""A split between datacenters with global queues, and its recovery, under None, Simple and Smart.

Three standalone broker nodes (dc1, dc2, dc3) as real processes, their TxLog
links through the fault-injecting proxy (tests/netfaults.py). Clients publish
and consume in every DC before the split, on both sides during it (dc3 alone
is the minority), and the split heals:

* the majority (dc1, dc2) has the longer history and wins the vote; dc3's
  post-split transactions are renegotiated as new ones;
* Simple: every DC restores its backup of the global queues and replays;
  Smart: only dc3 (whose log is not a prefix of the winner's) does; after
  either, every DC's global queue holds the same messages in the same order;
* None (seed 000: no backup, no restore): dc3 keeps what it did during the
  split and applies the majority's transactions on top; the queues hold the
  same messages (enqueues and dequeues go by global id), but dc3's own split
  messages stay *ahead* of the majority's, so the order differs.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from brokerha.testing import NodeProcess, free_port, get_json
from tests.netfaults import Partition
from tests.txlog.test_broker_txlog import DC, peer_entries, publish_confirmed, wait_for

pytestmark = pytest.mark.timeout(90)

DCS = ["dc1", "dc2", "dc3"]
WAN_ONE_WAY_MS = 15  # injected on every link between the DCs (each direction)
Q = "orders"


def status(dc: DC) -> dict[str, Any]:
    return dict(get_json(f"{dc.admin}/api/txlog", 5))


@contextmanager
def datacenters(root: Path, strategy: str, max_peer_lag: int = 1500,
                wan_ms: float = WAN_ONE_WAY_MS) -> Iterator[tuple[dict[str, DC], Partition]]:
    listen = {n: free_port() for n in DCS}
    dialed = {n: free_port() for n in DCS}  # the proxy in front of each master
    wan = Partition({n: (dialed[n], listen[n]) for n in DCS}, one_way_ms=wan_ms)
    nodes: dict[str, DC] = {}
    try:
        for name in DCS:
            admin = free_port()
            peers = peer_entries({p: f"txlog://127.0.0.1:{dialed[p]}" for p in DCS if p != name})
            cfg = root / f"{name}.toml"
            cfg.write_text(
                f'[node]\nadmin = "127.0.0.1:{admin}"\n\n'
                f'[txlog]\nnode-id = "{name}"\nmaster-url = "txlog://127.0.0.1:{dialed[name]}"\n'
                f'listen = "127.0.0.1:{listen[name]}"\ngroup = "split-test"\nsecret = "s"\n'
                f'split-recovery = "{strategy}"\nround-timeout = 100\nidle-interval = 200\n'
                f'MaxPeerLag = {max_peer_lag}\n{peers}')
            node = NodeProcess(name, data_dir=root / name, extra_args=["--config", str(cfg)])
            nodes[name] = DC(name, node, f"http://127.0.0.1:{admin}")
        starters = [threading.Thread(target=dc.node.start) for dc in nodes.values()]
        for t in starters:
            t.start()
        for t in starters:
            t.join(30)
        for dc in nodes.values():
            wait_for(lambda dc=dc: all(p["connected"] for p in status(dc)["peers"]),
                     what=f"{dc.name}'s TxLog links")
            with dc.connect() as conn:
                conn.channel().queue_declare(Q, durable=True, arguments={"x-global": True})
        # a DC that started late can make the others' first vote a split and a rejoin at
        # position 0 (a backup and a restore of nothing): the scenario starts once settled
        wait_for(lambda: settled(nodes), what="one generation, no split, before the scenario")
        time.sleep(1.0)  # and still so a second later (the late vote comes within ~0.2 s)
        wait_for(lambda: settled(nodes), what="one generation, no split, before the scenario")
        yield nodes, wan
    except BaseException:
        for dc in nodes.values():
            sys.stderr.write(f"---- {dc.name} ----\n" + "\n".join(list(dc.node.log)[-80:]) + "\n")
        raise
    finally:
        for dc in nodes.values():
            dc.node.close()
        wan.close()


def ack(dc: DC, wanted: str) -> None:
    """Consume the queue's messages in one DC until ``wanted``; ack it, leave the rest."""
    with dc.connect() as conn:
        ch = conn.channel()
        seen = []
        while True:
            method, props, _ = ch.basic_get(Q, auto_ack=False)
            assert method is not None, f"{wanted} not in {dc.name}'s queue ({seen})"
            if props.message_id == wanted:
                dequeued = counters(dc)["dequeued"]
                ch.basic_ack(method.delivery_tag)
                break
            seen.append(props.message_id)
        # the ack leaves when its dequeue is ordered (a round or so): the connection stays
        # until this DC applied it from the log (no other ack of this DC runs meanwhile),
        # at most 2.5 s
        deadline = time.monotonic() + 2.5
        while counters(dc)["dequeued"] == dequeued and time.monotonic() < deadline:
            conn.process_data_events(0.05)


def equal(dcs: dict[str, DC], names: list[str], expected: list[str] | None = None,
          ordered: bool = True) -> list[list[str]] | None:
    views = [dcs[n].contents(Q) for n in names]
    if expected is not None:
        match = (all(v == expected for v in views) if ordered
                 else all(sorted(v) == sorted(expected) for v in views))
        return views if match else None
    return views if all(v == views[0] for v in views) else None


def split_and_rejoin(dcs: dict[str, DC], wan: Partition) -> dict[str, list[str]]:
    """The scenario of the module docstring; returns each DC's queue after the rejoin."""
    publish_confirmed(dcs["dc1"], ["p1", "p2", "p3", "p4"])
    wait_for(lambda: equal(dcs, DCS, ["p1", "p2", "p3", "p4"]), what="equal before the split")

    wan.isolate("dc3")
    wait_for(lambda: all(status(dcs[n])["split"] for n in DCS), timeout=15,
             what="the split acknowledged on both sides")
    threads = [
        threading.Thread(target=publish_confirmed, args=(dcs["dc1"], ["maj-1", "maj-2"])),
        threading.Thread(target=publish_confirmed, args=(dcs["dc3"], ["min-1", "min-2"])),
        threading.Thread(target=ack, args=(dcs["dc1"], "p1")),
        threading.Thread(target=ack, args=(dcs["dc3"], "p2")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    publish_confirmed(dcs["dc2"], ["maj-3"])
    ack(dcs["dc2"], "p3")  # dc3 consumes p3 too: two sides, one message
    ack(dcs["dc3"], "p3")
    majority = wait_for(lambda: equal(dcs, ["dc1", "dc2"], ["p2", "p4", "maj-1", "maj-2", "maj-3"],
                                      ordered=False), what="the majority's side settled")[0]
    wait_for(lambda: equal(dcs, ["dc3"], ["p1", "p4", "min-1", "min-2"]),
             what="the minority's side settled")

    generation = status(dcs["dc1"])["generation"]
    wan.heal()
    wait_for(lambda: all(status(dcs[n])["generation"] > generation
                         and not status(dcs[n])["split"] for n in DCS),
             timeout=20, what="the rejoin vote decided everywhere")
    final = {"p4", "maj-1", "maj-2", "maj-3", "min-1", "min-2"}
    views = wait_for(lambda: (v := {n: dcs[n].contents(Q) for n in DCS})
                     and all(sorted(x) == sorted(final) for x in v.values()) and v,
                     timeout=20, what="the same messages everywhere after the rejoin")
    assert views["dc1"][:4] == majority[1:]  # the winner's order first, p2 dequeued by dc3's replay
    return views


def counters(dc: DC) -> dict[str, int]:
    return status(dc)["bridge"]


def settled(dcs: dict[str, DC]) -> bool:
    views = [status(dc) for dc in dcs.values()]
    return (len({v["generation"] for v in views}) == 1 and not any(v["split"] for v in views)
            and all(p["connected"] for v in views for p in v["peers"]))


def since(dcs: dict[str, DC], before: dict[str, dict[str, int]], key: str) -> dict[str, int]:
    """How much each DC's bridge counter ``key`` grew since ``before``."""
    return {n: counters(dcs[n])[key] - before[n][key] for n in before}


def event_kinds(dc: DC) -> list[str]:
    return [e["kind"] for e in status(dc)["events"]]


@pytest.mark.parametrize("strategy", ["Simple", "Smart"])
def test_after_a_split_every_dc_holds_the_same_global_queue(strategy: str, tmp_path: Path) -> None:
    with datacenters(tmp_path, strategy) as (dcs, wan):
        before = {n: counters(dcs[n]) for n in DCS}
        views = split_and_rejoin(dcs, wan)
        order = wait_for(lambda: equal(dcs, DCS), timeout=10, what="equal order")[0]
        assert order[-2:] == ["min-1", "min-2"]  # renegotiated: after the majority's
        assert views["dc1"] == order
        restored = since(dcs, before, "restores")
        assert since(dcs, before, "backups") == dict.fromkeys(DCS, 1)
        if strategy == "Simple":
            assert restored == dict.fromkeys(DCS, 1)
        else:
            assert restored == {"dc1": 0, "dc2": 0, "dc3": 1}
        dc3 = {key: since(dcs, before, key)["dc3"] for key in ("replayed", "restore_removed")}
        assert dc3["replayed"] > 0 and dc3["restore_removed"] >= 2  # min-1, min-2 went back out
        assert {"restore", "replay", "renegotiate", "rejoin"} <= set(event_kinds(dcs["dc3"]))
        recovery = status(dcs["dc3"])["recovery"]
        assert recovery["last_restore"]["position"] == recovery["last_backup"]["position"]
        out = subprocess.run([sys.executable, "-m", "brokerha.cli", "ctl", "--node",
                              dcs["dc3"].admin, "txlog", "status"],
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 0 and "split recovery: restored" in out.stdout, out


def test_under_none_the_minority_keeps_its_split_order(tmp_path: Path) -> None:
    with datacenters(tmp_path, "None") as (dcs, wan):
        before = {n: counters(dcs[n]) for n in DCS}
        views = split_and_rejoin(dcs, wan)
        assert views["dc1"] == views["dc2"]
        assert views["dc1"][-2:] == ["min-1", "min-2"]
        # dc3 applied its own split messages during the split and the majority's after
        # the rejoin: same messages, another order (seed 000: "DCs may then differ")
        assert views["dc3"][:3] == ["p4", "min-1", "min-2"]
        assert views["dc3"] != views["dc1"]
        assert since(dcs, before, "backups") == since(dcs, before, "restores") == \
            dict.fromkeys(DCS, 0)
        assert since(dcs, before, "replayed")["dc3"] > 0  # the winner's tail, on the current state



def consume_some(dc: DC, count: int) -> list[str]:
    """A consumer acking ``count`` messages outside transactions (each ack ordered)."""
    got: list[str] = []
    with dc.connect() as conn:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=10)
        for method, props, _ in ch.consume(Q, inactivity_timeout=2.0):
            if method is None:
                break
            got.append(props.message_id)
            ch.basic_ack(method.delivery_tag)
            if len(got) == count:
                break
        ch.cancel()
        for _ in range(40):
            conn.process_data_events(0.05)
    return got


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["Simple", "Smart"])
def test_a_longer_split_with_consumers_on_both_sides_ends_equal(strategy: str,
                                                                tmp_path: Path) -> None:
    """Hundreds of messages, consumers on both sides of a 6 s split, two splits in a row."""
    with datacenters(tmp_path, strategy) as (dcs, wan):
        publish_confirmed(dcs["dc1"], [f"pre-{i}" for i in range(200)])
        wait_for(lambda: equal(dcs, DCS) and len(dcs["dc1"].contents(Q)) == 200, timeout=30,
                 what="equal before the split")
        for round_ in range(2):
            wan.isolate("dc3")
            wait_for(lambda: all(status(dcs[n])["split"] for n in DCS), timeout=15,
                     what="split")
            work = [
                threading.Thread(target=publish_confirmed,
                                 args=(dcs["dc1"], [f"a{round_}-{i}" for i in range(60)])),
                threading.Thread(target=publish_confirmed,
                                 args=(dcs["dc3"], [f"c{round_}-{i}" for i in range(60)])),
                threading.Thread(target=consume_some, args=(dcs["dc2"], 30)),
                threading.Thread(target=consume_some, args=(dcs["dc3"], 30)),
            ]
            for t in work:
                t.start()
            for t in work:
                t.join(60)
            time.sleep(2)
            generation = status(dcs["dc1"])["generation"]
            wan.heal()
            wait_for(lambda: all(status(dcs[n])["generation"] > generation  # noqa: B023
                                 and not status(dcs[n])["split"] for n in DCS),
                     timeout=30, what="rejoin")
            order = wait_for(lambda: equal(dcs, DCS), timeout=30, what="equal after the rejoin")[0]
            assert len(order) == len(set(order))
