"""The CPU priority of a node's background threads (issue 33): the event loop first.

Linux's scheduler shares a core fairly between *threads* of equal nice value,
so on a loaded machine a node's event loop competes for a core with its own
store threads (the operation log's appender and fsync, the SQL writer) as
much as with other processes: beside two CPU burners on two cores the loop's
thread spent most of its stalls runnable and waiting for a core. The node
sets ``[node] background_nice`` (``set_background_nice``) before its store
starts; each background thread calls ``lower_this_thread`` first thing and
raises its own nice value by that much (to at most 19): allowed without any
privilege (only lowering a nice value needs one). The loop's thread keeps the
process's nice value. 0 (the default): unchanged. Off by default because it
was not shown to help (docs/benchmarks.md, issue 33, "The store threads' nice
value"): the threads share the GIL, and a lowered thread that is preempted
while it holds it holds up the loop as well.

A lower floor than the store and the node (both import it), so the store's
threads need not know the node's configuration.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger("brokerha.node")

NICE_MAX = 19
_background_nice = 0


def set_background_nice(nice: int) -> None:
    """How much background threads started from now on lower their priority (0: not)."""
    global _background_nice
    _background_nice = max(0, min(NICE_MAX, int(nice)))


def background_nice() -> int:
    return _background_nice


def lower_this_thread() -> int | None:
    """Raise the calling thread's nice value by ``background_nice`` (its own, relative to
    the one it inherited from the thread that started it). The nice value it has then;
    None if unchanged (0 configured, or the system does not allow it)."""
    step = _background_nice
    if step <= 0 or sys.platform != "linux":  # elsewhere PRIO_PROCESS takes a PID, not a tid
        return None
    tid = threading.get_native_id()
    try:
        nice = min(NICE_MAX, os.getpriority(os.PRIO_PROCESS, tid) + step)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError) as exc:  # not Linux (a tid is no PID there), or refused
        log.debug("thread %s: nice value not changed: %s", threading.current_thread().name, exc)
        return None
    return nice
