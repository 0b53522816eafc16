"""The heap's new pages faulted in by a thread of their own (node/prefault.py, issue 33)."""

from __future__ import annotations

import resource
import sys
import time

import pytest

from brokerha.node.gc_governor import tune_malloc
from brokerha.node.prefault import HeapPrefault


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sbrk and madvise of Linux")
def test_the_heap_the_loop_grows_is_faulted_in_by_the_thread_not_the_loop() -> None:
    """A thread keeping 64 MiB of 1 KiB bodies, with pauses as a loop has between packets:
    with the prefault thread it takes a small part of the page faults it takes without."""
    if not tune_malloc():
        pytest.skip("glibc's malloc settings are the operator's here")

    def faults_keeping(prefault: HeapPrefault | None) -> tuple[int, list[bytes]]:
        if prefault is not None:
            prefault.start()
            time.sleep(0.05)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        kept: list[bytes] = []
        for i in range(64):
            kept.extend(bytes(1024) + b"%d" % j for j in range(1000 * i, 1000 * (i + 1)))
            time.sleep(0.01)
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before, kept

    prefault = HeapPrefault(poll=0.002, idle_poll=0.002)
    try:
        with_thread, kept = faults_keeping(prefault)
    finally:
        prefault.stop()
        prefault.join(5)
    assert not prefault.is_alive()
    assert prefault.rounds > 0 and prefault.populated >= 32 << 20
    without, kept2 = faults_keeping(None)
    assert with_thread < without / 2, (with_thread, without)
    assert len(kept) == len(kept2) == 64_000 and kept[-1] == bytes(1024) + b"63999"
