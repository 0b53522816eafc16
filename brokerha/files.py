"""Small files replaced durably: the one way brokerha writes a whole file it must not tear.

A crash leaves the old file or the new one, never a mix: the new bytes go to
a temporary file beside it, which is fsynced, renamed over the old one, and
the directory is fsynced so the rename itself survives. Used for the HA
state file, the TxLog snapshot, runtime peers and split backups.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cached(path: Path | str) -> None:
    """Drop a written and synced file's pages from the page cache (``POSIX_FADV_DONTNEED``).

    For a file kept on disk but read back only now and then (a stored message
    run's log file: recovery, paging). A clean page is dropped, a dirty one
    only starts its write-back; nothing is lost either way. A no-op where there
    is no ``posix_fadvise``, or the file is gone.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_and_close(fd: int) -> None:
    """fsync a descriptor (a duplicate, in a worker thread: off the event loop), then close it."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_off_loop(fd: int, done: Callable[[BaseException | None], None], *,
                   sync: bool = True) -> None:
    """fsync and close ``fd`` (a duplicate) in a worker thread; ``done(error)`` on the loop after.

    ``sync=False`` only closes it (a store run without fsync). The TxLog's
    journals take this as their ``fsync`` (a simulation passes its own, which
    completes on its virtual clock and decides what a crash keeps).
    """
    work = fsync_and_close if sync else os.close
    future = asyncio.get_running_loop().run_in_executor(None, work, fd)
    future.add_done_callback(lambda f: done(f.exception()))


def replace_durably(path: Path | str, data: bytes | None) -> None:
    """Make ``path`` hold ``data`` (``None``: remove it), durably (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if data is None:
        path.unlink(missing_ok=True)
    else:
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)
