"""Partition groups on three real nodes (issue 35 stage 2, ``[cluster] partition_groups``).

P = 3 over 3 nodes (NR = 2: every node a cell of every partition). Every group (the
metadata group and one per partition) elects exactly one primary, each partition its
preferred leader (the placement spreads them, one per node); a client on a partition's
leader declares, publishes with confirms and consumes a queue of that partition, and
declares a queue of another through its leader (stage 3). SIGKILL of a
partition's leader elects in the groups it led only: every other group keeps its
epoch and leader (``ctl status --json`` before and after), through the restart of the
killed node from its data directory, which rejoins every group; nothing confirmed is
lost (each queue drained on its leader and counted).
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request

import pika
import pika.exceptions
import pytest

from brokerha.cluster.partition_table import hash_partition
from brokerha.partition.group_simulation import queue_names
from brokerha.testing import LocalCluster
from tests.failover.groups import (
    GROUPS,
    OPTIONS,
    ctl_status,
    drained,
    led,
    name_in,
    one_leader_each,
    promote,
    ready_everywhere,
    until,
)

pytestmark = pytest.mark.timeout(120)

PUBLISHED = 150
CONSUMED = 20


def publish(cluster: LocalCluster, node: str, queue: str, first: int) -> set[int]:
    """Declare ``queue`` on ``node``, publish PUBLISHED confirmed messages, consume and
    ack CONSUMED of them: the ids consumed."""
    conn = pika.BlockingConnection(pika.URLParameters(cluster.url(node)))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queue, durable=True)
        for i in range(first, first + PUBLISHED):  # each confirmed (BlockingChannel waits)
            ch.basic_publish("", queue, b"%d" % i, pika.BasicProperties(delivery_mode=2),
                             mandatory=True)
        consumed = set()
        ch.basic_qos(prefetch_count=5)
        for method, _props, body in ch.consume(queue, inactivity_timeout=10):
            assert method is not None, "no delivery within 10 s"
            ch.basic_ack(method.delivery_tag)
            consumed.add(int(body))
            if len(consumed) == CONSUMED:
                break
        ch.cancel()  # what it held unacknowledged goes back to the queue
        return consumed
    finally:
        conn.close()


def put_queue(cluster: LocalCluster, node: str, name: str) -> tuple[int, str]:
    """``PUT /api/queues/%2F/<name>`` on ``node``'s admin listener: (status, reason)."""
    request = urllib.request.Request(
        f"{cluster.admin_url(node)}/api/queues/%2F/{name}", data=b'{"durable": true}',
        method="PUT", headers={"content-type": "application/json",
                               "authorization": "Basic " + base64.b64encode(
                                   b"guest:guest").decode()})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, str(json.loads(exc.read()).get("reason"))


def drain_bodies(cluster: LocalCluster, node: str, queue: str) -> list[bytes]:
    return [body for _, body in drained(cluster, node, queue)]


def drain(cluster: LocalCluster, node: str, queue: str) -> list[int]:
    return [int(body) for body in drain_bodies(cluster, node, queue)]


@pytest.mark.parametrize("victim_kind", ["partition-leader", "metadata-primary"])
def test_each_partition_elects_on_its_own_and_a_leader_s_sigkill_moves_only_its_groups(
        victim_kind: str) -> None:
    """``partition-leader``: the killed node leads one partition and follows the metadata
    group; ``metadata-primary``: it leads the metadata group and its own partition."""
    queues = queue_names(3)  # q<p>-<i>: a name hashing into partition p
    with LocalCluster(3, options=OPTIONS) as cluster:
        names = cluster.names
        leaders = until("one serving primary per group", lambda: one_leader_each(cluster, names))
        until("every node ready in every group", lambda: ready_everywhere(cluster, names))
        before = ctl_status(cluster, names[0])
        table = before["partitions"]
        preferred = [row["preferred_leader"] for row in table["rows"]]
        assert table["partitions"] == 3 and sorted(preferred) == names
        # each partition elected its preferred cell, one a node (the preferred cells stand
        # first at a start, node/ha_groups.py PREFERRED_FIRST); at the least not all on one
        chosen = [leaders[str(p + 1)] for p in range(3)]
        print(f"partition leaders {chosen}, preferred {preferred}")
        assert len(set(chosen)) >= 2
        for group, g in before["groups"].items():
            roles = sorted(n["role"] for n in g["nodes"].values())
            assert roles == ["backup", "backup", "primary"], (group, g)
            assert g["leader"] == leaders[group]

        metadata = leaders["0"]
        confirmed: dict[int, set[int]] = {}
        consumed: dict[int, set[int]] = {}
        for p, queue in enumerate(queues):
            first = 1000 * (p + 1)
            consumed[p] = publish(cluster, leaders[str(p + 1)], queue, first)
            confirmed[p] = set(range(first, first + PUBLISHED))
        # on a partition leader off the metadata primary: a queue of another partition and
        # a new exchange are declared through their groups' leaders (stage 3's declarations,
        # tests/failover/test_partition_declarations.py); a mismatch is still the leader's 406
        follower = next(leaders[str(p + 1)] for p in range(3)
                        if leaders[str(p + 1)] != metadata)
        mine = next(p for p in range(3) if leaders[str(p + 1)] == follower)
        other = (mine + 1) % 3
        conn = pika.BlockingConnection(pika.URLParameters(cluster.url(follower)))
        try:
            ch = conn.channel()
            ok = ch.queue_declare(queues[other], durable=True).method
            assert ok.queue == queues[other] and ok.message_count == PUBLISHED - len(
                consumed[other]), ok
            ch.exchange_declare("groups-x", "direct")
        finally:
            conn.close()
        # a server-named queue is named into a partition its node leads
        conn = pika.BlockingConnection(pika.URLParameters(cluster.url(follower)))
        try:
            named = conn.channel().queue_declare("", durable=True).method.queue
        finally:
            conn.close()
        assert leaders[str(hash_partition("/", named, 3) + 1)] == follower, named
        # the management API (answered by the metadata primary): a queue of the follower's
        # partition declared through its leader (stage 3's declarations)
        status, reason = put_queue(cluster, follower, name_in(mine, "api"))
        assert status == 201, (status, reason)

        victim = follower if victim_kind == "partition-leader" else metadata
        epochs = {g: v["epoch"] for g, v in before["groups"].items()}
        victim_led = sorted(g for g, node in leaders.items() if node == victim)
        assert len(victim_led) == (1 if victim_kind == "partition-leader" else 2), victim_led
        killed_at = time.monotonic()
        cluster.kill(victim)
        survivors = [n for n in names if n != victim]

        def moved() -> dict[str, str] | None:
            now = one_leader_each(cluster, survivors)
            return now if now is not None and all(now[g] != victim for g in victim_led) \
                else None

        after_kill = until("the victim's groups elect among the survivors", moved)
        gap = time.monotonic() - killed_at
        after = ctl_status(cluster, survivors[0])
        for group in GROUPS:
            g = after["groups"][group]
            if group in victim_led:
                assert g["epoch"] > epochs[group] and g["leader"] in survivors, (group, g)
            else:  # a group the victim did not lead never noticed
                assert (g["epoch"], g["leader"]) == (epochs[group], leaders[group]), (group, g)
        assert (after_kill["0"] == metadata) == (victim_kind == "partition-leader")
        print(f"epochs before {epochs}, after the kill of {victim} "
              f"{ {g: v['epoch'] for g, v in after['groups'].items()} }")

        cluster.restart(victim)
        until("the restarted node rejoins every group", lambda: ready_everywhere(cluster, names),
              timeout=30)
        rejoined = ctl_status(cluster, names[0])
        for group in GROUPS:
            g = rejoined["groups"][group]
            assert g["nodes"][victim]["role"] == "backup", (group, g)
            want = after["groups"][group]
            assert (g["epoch"], g["leader"]) == (want["epoch"], want["leader"]), (group, g)

        # its partition handed back to it by hand (ctl promote --partition: the group's
        # TransferPrimary; stage 5's balance would do it): that group alone elects again
        back = next(int(g) - 1 for g in victim_led if g != "0")
        until("the leader takes the hand-over (it hears the rejoined node ready a heartbeat "
              "after the node says so)", lambda: promote(cluster, survivors[0], victim, back))
        until("the partition handed back", lambda: led(cluster, names)[str(back + 1)] == [victim])
        handed = ctl_status(cluster, names[0])
        for group in GROUPS:
            g, was = handed["groups"][group], rejoined["groups"][group]
            if group == str(back + 1):
                assert g["leader"] == victim and g["epoch"] > was["epoch"], (group, g)
            else:
                assert (g["epoch"], g["leader"]) == (was["epoch"], was["leader"]), (group, g)

        for p, queue in enumerate(queues):
            got = drain(cluster, handed["groups"][str(p + 1)]["leader"], queue)
            lost = confirmed[p] - consumed[p] - set(got)
            assert not lost, f"partition {p}: confirmed messages lost: {sorted(lost)[:10]}"
            assert len(got) == PUBLISHED - CONSUMED and set(got) <= confirmed[p]
        print(f"failover of group {victim_led} seen in {gap:.2f}s (poll included)")


def test_a_paused_partition_leader_confirms_nothing_more_and_closes_its_clients() -> None:
    """SIGSTOP of a partition's leader (not the metadata primary): its group elects among
    the others, no other group does; a publish its client sent meanwhile is never
    confirmed once it runs again (its lease lapsed: the channel or the connection is
    closed, 404 or 320), and every message it confirmed before is on the new leader."""
    queues = queue_names(3)
    with LocalCluster(3, options=OPTIONS) as cluster:
        names = cluster.names
        leaders = until("one serving primary per group", lambda: one_leader_each(cluster, names))
        until("every node ready in every group", lambda: ready_everywhere(cluster, names))
        metadata = leaders["0"]
        mine = next(p for p in range(3) if leaders[str(p + 1)] != metadata)
        paused = leaders[str(mine + 1)]
        group = str(mine + 1)
        before = ctl_status(cluster, metadata)["groups"]

        conn = pika.BlockingConnection(pika.URLParameters(cluster.url(paused)))
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(queues[mine], durable=True)
        for i in range(20):
            ch.basic_publish("", queues[mine], b"%d" % i, pika.BasicProperties(delivery_mode=2))
        cluster.pause(paused)
        try:
            others = [n for n in names if n != paused]
            until("the paused leader's group elects among the others",
                  lambda: (one_leader_each(cluster, others) or {}).get(group) in others)
            outcome: list[BaseException | None] = []

            def late_publish() -> None:
                try:
                    ch.basic_publish("", queues[mine], b"late",
                                     pika.BasicProperties(delivery_mode=2))
                    outcome.append(None)
                except (pika.exceptions.AMQPError, OSError) as exc:
                    outcome.append(exc)

            sender = threading.Thread(target=late_publish)
            sender.start()
            time.sleep(0.3)  # the publish is on the socket, the leader still stopped
        finally:
            cluster.resume(paused)
        sender.join(15)
        assert outcome and outcome[0] is not None, "a deposed leader confirmed a publish"
        assert isinstance(outcome[0], pika.exceptions.ChannelClosedByBroker
                          | pika.exceptions.ConnectionClosedByBroker
                          | pika.exceptions.StreamLostError), repr(outcome[0])
        after = ctl_status(cluster, metadata)["groups"]
        for g in GROUPS:
            if g == group:
                assert after[g]["epoch"] > before[g]["epoch"] and after[g]["leader"] != paused
            else:
                assert (after[g]["epoch"], after[g]["leader"]) == \
                    (before[g]["epoch"], before[g]["leader"]), (g, after[g])
        got = drain_bodies(cluster, after[group]["leader"], queues[mine])
        assert {b"%d" % i for i in range(20)} <= set(got), got
        print(f"the paused leader's late publish: {outcome[0]!r}")
