"""The node's cyclic GC: survivors of a middle or full collection frozen, thawed when cheap."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import pytest

from brokerha import gc_hooks
from brokerha.node import gc_governor
from brokerha.node.gc_governor import GCGovernor
from tests.clock import Clock


@pytest.fixture
def governor() -> GCGovernor:
    clock = Clock(0.0)
    g = GCGovernor(clock)
    g.install()
    yield g  # type: ignore[misc]
    g.uninstall()
    gc.unfreeze()


def frozen_counts(governor: GCGovernor) -> tuple[int, int, int]:
    """(the governor's count of frozen objects, gc's, the governor's ``stats``), read with
    automatic collection off and again until gc's count held still around them: a
    collection and the governor's freeze after it came between two such reads in full
    suites' runs (330,206 against 330,205; 306,804 against 306,803), and another thread
    of the session freeing frozen objects did once with collection off (328,121 against
    328,119)."""
    gc.disable()
    try:
        for _ in range(50):
            before = gc.get_freeze_count()
            counted, told = governor.count_frozen(), governor.stats()["frozen"]
            frozen = gc.get_freeze_count()
            if before == frozen:
                break
        return counted, frozen, told
    finally:
        gc.enable()


def test_a_full_collection_freezes_its_survivors(governor: GCGovernor) -> None:
    gc.unfreeze()
    kept = [[i] for i in range(10_000)]  # tracked objects that survive
    gc.collect()
    assert governor.collections[2] >= 1 and gc.get_freeze_count() >= len(kept)
    before = sum(gc.get_count())
    gc.collect(2)  # walks only what is not frozen: the survivors are not walked again
    assert sum(gc.get_count()) <= before
    counted, frozen, told = frozen_counts(governor)
    assert counted == frozen == told


def test_a_middle_collection_freezes_its_survivors_too(governor: GCGovernor) -> None:
    """Generation 1 walks survivors of young collections: a filling queue's messages and
    what is in flight for them; frozen after it, they are not walked again (issue 33)."""
    gc.unfreeze()
    kept = [[i] for i in range(10_000)]
    gc.collect(1)
    assert governor.collections[1] >= 1 and gc.get_freeze_count() >= len(kept)


def test_the_node_collects_its_middle_generation_often_enough_to_stay_short() -> None:
    from brokerha.node.server import GC_THRESHOLDS

    young, middle, _ = GC_THRESHOLDS
    assert young * (middle + 1) <= 60_000  # objects walked by one middle collection, at most


def test_frozen_objects_are_still_freed_by_reference_counting(governor: GCGovernor) -> None:
    import weakref

    class Thing:
        pass

    thing = Thing()
    ref = weakref.ref(thing)
    gc.collect()  # frozen now
    del thing
    assert ref() is None


def test_the_thaw_collects_cycles_once_the_frozen_set_is_small(
        governor: GCGovernor, monkeypatch: pytest.MonkeyPatch) -> None:
    import weakref

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    ref = weakref.ref(a)
    gc.collect()  # the cycle is alive: frozen
    del a, b
    gc.collect()
    assert ref() is not None  # garbage, but frozen: not collected yet
    clock = governor.clock
    clock.now += gc_governor.THAW_INTERVAL - 1  # type: ignore[attr-defined]
    governor.tick()
    assert ref() is not None and governor.thaws == 0  # not yet due
    monkeypatch.setattr(gc_governor, "THAW_MAX_OBJECTS", 0)
    clock.now += 2  # type: ignore[attr-defined]
    governor.tick()
    assert ref() is not None and governor.skipped_thaws == 1  # too many frozen: waits
    monkeypatch.setattr(gc_governor, "THAW_MAX_OBJECTS", 10**9)
    clock.now += gc_governor.THAW_INTERVAL  # type: ignore[attr-defined]
    governor.tick()
    assert ref() is None and governor.thaws == 1


def test_a_long_collection_is_logged(governor: GCGovernor, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(gc_governor, "STALL_WARNING", -1.0)
    with caplog.at_level(logging.WARNING, logger="brokerha.node"):
        gc.collect()
    assert any("cyclic GC (generation 2) paused the node" in r.getMessage()
               for r in caplog.records)


def test_status_and_metrics_never_walk_the_frozen_objects(
        governor: GCGovernor, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc.get_freeze_count walks every frozen object: with a deep backlog each /metrics
    scrape held the node 0.1-0.4 s (issue 33). Only the thaw check counts, when few."""
    governor.count_frozen()
    counted = governor.stats()["frozen"]

    def walk() -> int:
        raise AssertionError("walked the frozen objects")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    gc.collect()
    stats = governor.stats()
    assert stats["frozen"] == counted and stats["frozen_age"] is not None
    # a deep backlog: the thaw check skips without counting
    governor.backlog = lambda: gc_governor.THAW_MAX_OBJECTS  # messages: 3 objects each
    governor.clock.now += gc_governor.THAW_INTERVAL + 1  # type: ignore[attr-defined]
    governor.tick()
    assert governor.skipped_thaws == 1 and governor.thaws == 0


def test_a_small_backlog_lets_the_thaw_count_and_collect(governor: GCGovernor) -> None:
    governor.backlog = lambda: 10
    governor.clock.now += gc_governor.THAW_INTERVAL + 1  # type: ignore[attr-defined]
    governor.tick()
    _, frozen, told = frozen_counts(governor)
    assert governor.thaws == 1 and told == frozen


def test_a_bulk_of_objects_is_frozen_without_a_collection(governor: GCGovernor) -> None:
    """A backup's catch-up packet (``bulk_made``): what it made is frozen at once, never
    walked by a young or middle collection (issue 33)."""
    gc.unfreeze()
    gc.collect()
    frozen = gc.get_freeze_count()
    kept = [[i] for i in range(5_000)]
    collections = list(governor.collections)
    gc_hooks.bulk_made()
    assert gc.get_freeze_count() >= frozen + len(kept)
    assert gc.get_count()[0] < 100 and governor.collections == collections
    assert governor.stats()["bulk_freezes"] == 1


def test_bulk_made_does_nothing_without_an_installed_governor() -> None:
    gc.unfreeze()
    kept = [[i] for i in range(1_000)]
    gc_hooks.bulk_made()
    assert gc.get_freeze_count() < len(kept)


def test_a_catch_up_packet_leaves_no_cyclic_garbage_on_the_backup() -> None:
    """What freezing after each catch-up packet gives up is cyclic garbage made meanwhile:
    applying a catch-up's packets (decode, runs, entries, the store's hooks) makes none."""
    from brokerha.backup.backup import Backup
    from brokerha.ha.simulation.world import wire
    from tests.ha.harness import Cluster, publish

    c = Cluster(2)
    c.broker.vhosts["/"].declare_queue("q", owner=None, durable=True)
    for i in range(3_000):
        publish(c.broker, b"%d" % i + b"x" * 1000, persistent=True, rk="q")
    node = c.nodes["n2"]
    node.backup = backup = Backup(node.broker, me="n2", epoch=1, position=(-1, -1))
    c.join("n2")
    packets = found = 0
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        while not backup.caught_up:
            out = c.primary.take_outbox("n2")
            assert out
            for packet in out:
                backup.receive(wire(packet))  # type: ignore[arg-type]
                packets += 1
                found += gc.collect()
            c.primary.backup_acked("n2", wire(backup.ack_message()).seq)  # type: ignore[attr-defined]
    finally:
        if collecting:
            gc.enable()
    assert packets >= 3 and len(node.broker.vhosts["/"].queues["q"].ready) == 3_000
    assert found == 0


def test_the_c_heap_is_tuned_unless_the_operator_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc's malloc keeps catch-up buffers' memory (issue 33); an operator's own MALLOC_*_
    or GLIBC_TUNABLES win (the call changes nothing then)."""
    import ctypes.util
    import platform

    for name in [k for k in __import__("os").environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    glibc = platform.libc_ver()[0] == "glibc" and ctypes.util.find_library("c") is not None
    assert gc_governor.tune_malloc() is glibc
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.check=0")
    assert gc_governor.tune_malloc() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert gc_governor.tune_malloc() is False


def _collections_by_thread(allocate_seconds: float) -> tuple[dict[str, int], int, bool]:
    """A node's loop with the governor installed on it, and a "store" thread making cyclic
    garbage past the young threshold many times over for ``allocate_seconds``: the threads
    each collection ran on (gc.callbacks' own thread), the governor's loop collections, and
    whether the garbage was collected by the end."""
    import asyncio
    import threading
    import weakref

    class Cycle:
        other: object = None

    ran_on: dict[str, int] = {}

    def record(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            name = threading.current_thread().name
            ran_on[name] = ran_on.get(name, 0) + 1

    first: list[weakref.ref[Cycle]] = []

    def store_thread() -> None:
        end = time.monotonic() + allocate_seconds
        while time.monotonic() < end:
            for _ in range(2_000):
                a, b = Cycle(), Cycle()
                a.other, b.other = b, a
                if not first:
                    first.append(weakref.ref(a))
            time.sleep(0.001)

    async def node() -> int:
        governor = GCGovernor()
        governor.install(asyncio.get_running_loop())
        gc.callbacks.append(record)
        try:
            thread = threading.Thread(target=store_thread, name="brokerha-store-writer")
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.005)
            thread.join()
            await asyncio.sleep(3 * gc_governor.POLL_INTERVAL)  # the loop's last check
            return governor.loop_collections
        finally:
            gc.callbacks.remove(record)
            governor.uninstall()

    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(2_000, 2, 5)
    gc.enable()
    try:
        loop_collections = asyncio.run(node())
        assert gc.isenabled()  # uninstall gives CPython's automatic collection back
        collected = first[0]() is None if first else False
    finally:
        gc.set_threshold(*thresholds)
        if not enabled:
            gc.disable()
        gc.unfreeze()
    return ran_on, loop_collections, collected


def test_a_store_thread_allocating_cycles_never_runs_a_collection() -> None:
    """A collection holds the GIL for all of it, on the thread whose allocation started it:
    a store thread's held the loop 0.09-0.18 s (issue 33). The governor installed on the
    loop turns automatic collection off and collects on the loop, between its steps."""
    ran_on, loop_collections, collected = _collections_by_thread(0.3)
    assert ran_on.get("brokerha-store-writer", 0) == 0, ran_on
    assert ran_on.get("MainThread", 0) >= 5 and loop_collections >= 5, (ran_on, loop_collections)
    assert collected  # the store thread's cyclic garbage, collected by the loop


def test_without_collections_on_the_loop_a_store_thread_runs_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above catches the old way: CPython's automatic collection on the store's
    thread (``COLLECT_ON_LOOP`` off)."""
    monkeypatch.setattr(gc_governor, "COLLECT_ON_LOOP", False)
    ran_on, loop_collections, _ = _collections_by_thread(0.3)
    assert ran_on.get("brokerha-store-writer", 0) >= 5 and loop_collections == 0, ran_on


def test_the_loop_collects_the_generation_cpython_would() -> None:
    """``_due`` is CPython's choice (``collect_generations``): nothing until the young count
    passes its threshold, then the oldest generation whose count passed its own."""
    thresholds = (20_000, 2, 50)
    assert gc_governor._due((20_000, 0, 0), thresholds) is None  # noqa: SLF001
    assert gc_governor._due((20_001, 0, 0), thresholds) == 0  # noqa: SLF001
    assert gc_governor._due((20_001, 2, 50), thresholds) == 0  # noqa: SLF001
    assert gc_governor._due((20_001, 3, 50), thresholds) == 1  # noqa: SLF001
    assert gc_governor._due((20_001, 3, 51), thresholds) == 2  # noqa: SLF001
    assert gc_governor._due((20_001, 0, 51), thresholds) == 2  # noqa: SLF001
    assert gc_governor._due((10**6, 9, 9), (0, 2, 50)) is None  # noqa: SLF001  threshold 0: off


def _polled(steps: list[Any]) -> tuple[GCGovernor, list[int], int]:
    """A governor collecting on a loop (the node's young threshold scaled down to 2,000);
    each of ``steps`` runs, then the loop's check (``_poll``) as after a loop step. The
    governor, the generations of the collections that ran and the objects frozen since
    the first step."""
    import asyncio

    ran: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            ran.append(int(info["generation"]))

    async def node() -> tuple[GCGovernor, list[int], int]:
        governor = GCGovernor()
        governor.install(asyncio.get_running_loop())
        gc.callbacks.append(record)
        try:
            frozen = gc.get_freeze_count()
            for step in steps:
                step()
                governor._poll()  # noqa: SLF001  the check after a loop step
            return governor, ran, gc.get_freeze_count() - frozen
        finally:
            gc.callbacks.remove(record)
            governor.uninstall()

    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    gc.set_threshold(2_000, 2, 50)
    try:
        return asyncio.run(node())
    finally:
        gc.set_threshold(*thresholds)
        if not enabled:
            gc.disable()
        gc.unfreeze()


def test_a_middle_collection_due_over_a_bulk_walks_only_the_young_and_freezes_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A TX's loop steps make more than the young threshold; the middle collection due
    after two young ones walked 60,000-170,000 of its objects, 28-44 ms of the loop (issue
    33). Past ``BULK_WALK`` the loop collects the young generation only and freezes what
    survived; cyclic garbage among the young is collected as always."""
    import weakref

    class Cycle:
        other: object = None

    monkeypatch.setattr(gc_governor, "BULK_WALK", 5_000)
    kept: list[list[list[int]]] = []
    dead: list[weakref.ref[Cycle]] = []

    def made() -> None:
        kept.append([[i] for i in range(4_000)])  # a step's long-lived objects

    def made_with_garbage() -> None:
        made()
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        dead.append(weakref.ref(a))

    governor, ran, frozen = _polled([made, made, made, made_with_garbage])
    assert ran == [0, 0, 0, 0]  # three young collections, then the middle one due: young only
    assert governor.bulk_walks_frozen == 1 and governor.stats()["bulk_walks_frozen"] == 1
    assert frozen >= 4 * 4_000
    assert dead[0]() is None


def test_a_middle_collection_due_under_the_bulk_walk_runs_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above catches a middle collection over a bulk: with ``BULK_WALK`` out of
    reach it walks them, then freezes its survivors (``_callback``)."""
    monkeypatch.setattr(gc_governor, "BULK_WALK", 10**9)
    kept: list[list[list[int]]] = []
    governor, ran, _ = _polled([lambda: kept.append([[i] for i in range(4_000)])] * 4)
    assert ran == [0, 0, 0, 1] and governor.bulk_walks_frozen == 0


def test_a_big_commit_freezes_what_it_made_and_leaves_no_cyclic_garbage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A TX of 100,000 messages made ~115,000 objects in its commit's step, walked by the
    young collection after it (7-12 ms, issue 33): a commit of ``BULK_COMMIT`` messages or
    more says it made them in bulk (``gc_hooks.bulk_made``). What the freeze gives up is
    the cyclic garbage made meanwhile: the commit, its tc and its capture make none."""
    import asyncio

    from brokerha.broker import transaction
    from tests.ha.harness import route
    from tests.ha.test_transactions import joined

    monkeypatch.setattr(transaction, "BULK_COMMIT", 500)
    c = joined(3, "n2", "n3")
    bulks: list[int] = []
    hook = lambda: bulks.append(1)  # noqa: E731
    small, big = c.broker.new_transaction(), c.broker.new_transaction()
    for tx, count in ((small, 499), (big, 500)):
        for i in range(count):
            queues, msg = route(c.broker, b"%d" % i, rk="q3", persistent=True)
            tx.publish(queues, msg)
    c.pump()
    collecting = gc.isenabled()
    gc_hooks.set_bulk_hook(hook)
    gc.collect()
    gc.disable()
    try:
        asyncio.run(small.commit())
        assert bulks == []
        asyncio.run(big.commit())
        assert bulks == [1]
        c.pump()
        found = gc.collect()
    finally:
        gc_hooks.clear_bulk_hook(hook)
        if collecting:
            gc.enable()
    assert len(c.broker.vhosts["/"].queues["q3"].ready) == 999
    assert found == 0
