"""The process's hook for objects made in bulk (issue 33): a lower floor's way to
reach the node's GC governor (``node/gc_governor.py``) without importing it.

A backup applying a catch-up packet makes an ``Entry`` and a ``Message`` per
message caught up, objects that live long; it calls ``bulk_made`` after each
such packet. The node's governor, once installed, sets the hook
(``set_bulk_hook``) to its ``freeze_bulk``; without one (tests, tools) the call
does nothing.
"""

from __future__ import annotations

from collections.abc import Callable

_hook: Callable[[], None] | None = None


def set_bulk_hook(hook: Callable[[], None]) -> None:
    """Install what ``bulk_made`` calls (the last one installed wins)."""
    global _hook
    _hook = hook


def clear_bulk_hook(hook: Callable[[], None]) -> None:
    """Remove ``hook`` if it is the one installed (another installed since stays)."""
    global _hook
    if _hook == hook:
        _hook = None


def bulk_made() -> None:
    """Long-lived objects were just made in bulk: tell the installed hook, if any."""
    hook = _hook
    if hook is not None:
        hook()
