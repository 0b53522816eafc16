"""The store's threads hand the GIL over during long folds, compiled or not.

Compiled by mypyc (brokerha/_native.json), ``store/batch.py`` never runs CPython's
eval loop, so without an explicit release it kept the GIL through a whole fold: a
backup folding a purge's 200,000 dequeues held the event loop ~0.14 s.
"""

from __future__ import annotations

import threading
import time

from brokerha.store.batch import DEQUEUED, ENQUEUED, Batch, Unit, fold
from tests.store.harness import body, message


def _ran_beside(work: threading.Thread) -> tuple[int, float, float]:
    """(times this thread ran, longest wait between two runs, seconds) while ``work`` ran."""
    runs, longest = 0, 0.0
    started = time.perf_counter()
    work.start()
    last = time.perf_counter()
    while work.is_alive():
        time.sleep(0.0005)
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        runs += 1
    work.join()
    return runs, longest, time.perf_counter() - started


def test_a_long_fold_lets_another_thread_run() -> None:
    ops = [(ENQUEUED, "/", "q", p, message(body(p))) for p in range(150_000)]
    ops += [(DEQUEUED, "/", "q", p) for p in range(150_000)]
    done: list[Batch] = []
    work = threading.Thread(target=lambda: done.append(fold([Unit(ops, [])])))
    runs, longest, seconds = _ran_beside(work)
    assert done and not done[0].messages["/", "q"] and done[0].cancelled == 150_000
    # with a 5 ms switch interval the waiting thread gets the GIL every few ms, not once
    # the fold is over (a loaded machine may delay it: only "many times" is asserted)
    assert runs >= 10, (runs, longest, seconds)
