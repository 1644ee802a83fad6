"""Expiring watchdog timers: a deadline on any region of worker code, enforced by the agent.

Worker side (``client``, ``collectives``, ``boot``; standard library only, nothing mapped until
the first timer)::

    from elastictk import timer

    with timer.expires(after=30, scope="all_reduce"):
        dist.all_reduce(t)

    timer.watch_collectives(300)   # or: elastictk-run --collective-timeout 300

Agent side (``server``): :class:`TimerServer` scans the workers' shared-memory regions and, when
a deadline passes, dumps the stuck worker's stacks, writes a hang report, hands the agent an
:class:`Expiry` and kills the worker.
"""
from __future__ import annotations

from typing import Any

from .boot import SITE_DIR, activate_from_env
from .client import (
    Timer, TimerError, acquire, attach, detach, expires, release, scope_id, status, timed,
)
from .collectives import unwatch_collectives, watch_collectives, watching
from .layout import DEFAULT_DUMP_SIGNAL, ENV_COLLECTIVE_TIMEOUT, ENV_REGIONS

__all__ = [
    "expires", "Timer", "acquire", "release", "timed", "attach", "detach", "status", "scope_id",
    "TimerError",
    "watch_collectives", "unwatch_collectives", "watching", "activate_from_env", "SITE_DIR",
    "ENV_REGIONS", "ENV_COLLECTIVE_TIMEOUT", "DEFAULT_DUMP_SIGNAL",
    "TimerServer", "Expiry", "ProcessHandle",
]

_LAZY = {"TimerServer": ".server", "Expiry": ".expiry", "ProcessHandle": "..lifetime.handle"}


def __getattr__(name: str) -> Any:
    """Agent-side names load on first use, so a worker importing timers pays only for its side."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
