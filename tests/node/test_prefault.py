"""The heap's new pages faulted in by a thread of their own (node/prefault.py, issue 33)."""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import brokerha
from brokerha.node.gc_governor import TOP_PAD, tune_malloc
from brokerha.node.prefault import GROWING_TOP_PAD, POPULATE_CHUNK, HeapPrefault


def in_fresh_process(check: Callable[[], None]) -> None:
    """Run ``check`` (a function of this module) in a process of its own: what it measures
    (the heap's top, page faults, ``mallopt``) depends on what the process did before --
    in a test session that had run other tests, the heap reused their freed memory and
    the fault counts meant nothing -- and ``tune_malloc`` would change the session's."""
    here = str(Path(brokerha.__file__).resolve().parents[1])  # the brokerha under test
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [here, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, __file__, check.__name__], capture_output=True,
                          text=True, timeout=120, check=False, env=env)
    if done.returncode == SKIP:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr


SKIP = 3  # the exit status of a check that does not apply here


def needs_tuned_malloc() -> None:
    if not tune_malloc():
        print("glibc's malloc settings are the operator's here")
        raise SystemExit(SKIP)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sbrk and madvise of Linux")
def test_the_heap_the_loop_grows_is_faulted_in_by_the_thread_not_the_loop() -> None:
    in_fresh_process(check_faults_taken_by_the_thread)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sbrk and mallopt of glibc")
def test_while_the_heap_grows_it_grows_in_bigger_steps_then_back() -> None:
    in_fresh_process(check_bigger_steps_while_growing)


def check_faults_taken_by_the_thread() -> None:
    """A thread keeping 64 MiB of 1 KiB bodies, with pauses as a loop has between packets:
    with the prefault thread it takes a small part of the page faults it takes without.

    Each pause lasts until the thread has faulted in the heap up to its top (bounded), not a
    fixed time: on a loaded machine (CI runs two test sessions at once) the thread may wait
    for a core longer than a fixed pause, which measured the scheduler, not the thread."""
    needs_tuned_malloc()
    sbrk = ctypes.CDLL(None).sbrk
    sbrk.argtypes, sbrk.restype = [ctypes.c_ssize_t], ctypes.c_void_p

    def pause(prefault: HeapPrefault | None) -> None:
        time.sleep(0.01)
        deadline = time.monotonic() + 2.0
        while prefault is not None and prefault.covered < (sbrk(0) or 0):
            assert time.monotonic() < deadline, "the prefault thread did not reach the top"
            time.sleep(0.002)

    def faults_keeping(prefault: HeapPrefault | None) -> tuple[int, list[bytes]]:
        if prefault is not None:
            prefault.start()
            pause(prefault)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        kept: list[bytes] = []
        for i in range(64):
            kept.extend(bytes(1024) + b"%d" % j for j in range(1000 * i, 1000 * (i + 1)))
            pause(prefault)
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


def check_bigger_steps_while_growing() -> None:
    """Once the thread has seen the heap grow, the heap's next step is GROWING_TOP_PAD
    (fewer steps, fewer races with the loop over a step's first pages), faulted in
    POPULATE_CHUNK a call; once it has not grown for idle_after, TOP_PAD again."""
    needs_tuned_malloc()
    sbrk = ctypes.CDLL(None).sbrk
    sbrk.argtypes, sbrk.restype = [ctypes.c_ssize_t], ctypes.c_void_p
    kept: list[bytes] = []

    def next_step() -> int:
        """Allocate (64 KiB at a time, from the heap) until the heap grows: by how much."""
        top = sbrk(0) or 0
        while (sbrk(0) or 0) == top:
            kept.append(bytes(65536))
        return (sbrk(0) or 0) - top

    def until(done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 5.0
        while not done():
            assert time.monotonic() < deadline
            time.sleep(0.002)

    prefault = HeapPrefault(poll=0.002, idle_poll=0.002, idle_after=0.05)
    prefault.start()
    try:
        until(lambda: prefault.covered > 0)
        next_step()  # a first step, as the heap grew before: the thread sees it grow
        until(lambda: prefault.growing)
        until(lambda: prefault.covered >= (sbrk(0) or 0))
        rounds = prefault.rounds
        step = next_step()
        assert step >= GROWING_TOP_PAD - (1 << 20)
        # faulted in a chunk a call (each call holds the mmap lock a loop's brk waits for)
        until(lambda: prefault.covered >= (sbrk(0) or 0))
        assert prefault.rounds - rounds >= step // POPULATE_CHUNK
        until(lambda: not prefault.growing)  # no growth for idle_after
        assert TOP_PAD <= next_step() < GROWING_TOP_PAD - (1 << 20)
    finally:
        prefault.stop()
        prefault.join(5)
    assert not prefault.growing and not prefault.is_alive()
    kept.clear()


if __name__ == "__main__":  # in_fresh_process
    globals()[sys.argv[1]]()
