"""A deadline counted in an idle host's seconds, so that a busy host stretches it.

A bound such as "the survivors re-form within 30 s" is there to catch a wedge: a process
blocked for good stays blocked however idle the host is. A host whose cores are all taken
(data loaders at 100 %, other jobs) makes the same healthy work take several times as long,
and a wall-clock bound tuned to an idle host then calls the slow-but-healthy work wedged and
takes the expensive path (restart everything). So the clock here counts each wall second at
the share of a core a runnable task gets: ``cores / load`` of a second while the 1-minute load
average exceeds the core count, a whole second otherwise, and never less than
``1 / MAX_STRETCH`` of one, so a wedge is still caught on the busiest host, at worst
``MAX_STRETCH`` times later.

The load average lags a sudden burst by up to a minute; sustained load (the case that broke
idle-tuned bounds) is what it measures well.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

MAX_STRETCH = 4.0


def stretch(load: float, cores: int) -> float:
    """How many wall seconds one idle-host second takes at this load: in [1, MAX_STRETCH]."""
    if not load > 0 or cores < 1:  # NaN, negative or no load: idle
        return 1.0
    return min(MAX_STRETCH, max(1.0, load / cores))


def host_load() -> tuple[float, int]:
    """This host's 1-minute load average and core count (0 load where the kernel has none)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return load, os.cpu_count() or 1


class BusyDeadline:
    """``timeout`` idle-host seconds from now; :meth:`expired` and :meth:`remaining` advance it.

    Each call counts the wall time since the previous one at the stretch measured now, so a
    caller that polls (an agent's monitor loop, every second or less) integrates the load over
    the wait.
    """

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic,
                 load: Callable[[], tuple[float, int]] = host_load) -> None:
        self.timeout = timeout
        self._clock = clock
        self._load = load
        self._start = self._last = clock()
        self._counted = 0.0  # idle-host seconds so far
        self._stretch = 1.0

    def _advance(self) -> None:
        now = self._clock()
        self._stretch = stretch(*self._load())
        self._counted += max(0.0, now - self._last) / self._stretch
        self._last = now

    def expired(self) -> bool:
        self._advance()
        return self._counted >= self.timeout

    def remaining(self) -> float:
        """Wall seconds left at the present stretch (what to wait before asking again)."""
        self._advance()
        return max(0.0, (self.timeout - self._counted) * self._stretch)

    def describe(self, wall: Optional[float] = None) -> str:
        """``30s``, or on a host that stretched it, how long that took by the wall clock."""
        waited = (self._last - self._start) if wall is None else wall
        if waited <= self.timeout + 0.5:
            return f"{self.timeout:g}s"
        load, cores = self._load()
        return (f"{self.timeout:g}s of an idle host's time ({waited:.0f}s by the clock: load average "
                f"{load:.1f} on {cores} cores)")
