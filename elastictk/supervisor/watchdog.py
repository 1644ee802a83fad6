"""The agent's side of the watchdog timers: one :class:`TimerServer` per agent, re-armed per attempt.

The agent always owns one, so a script that uses ``elastictk.timer.expires`` is covered under
``elastictk-run`` without a flag, and ``--collective-timeout`` only adds the variable that puts
every collective under a timer. The reaper kills a stuck worker on its own thread; the agent
then sees an ordinary exit by SIGKILL, and this class is where it learns why: the expiry,
matched by PID, becomes the failure's headline ("rank 3 stuck in all_reduce at train.py:57")
instead of "SIGKILL".
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Mapping, Optional

from ..timer import Expiry, TimerServer
from .env import Assignment


class Watchdog:
    """Arms the workers of each attempt and keeps the expiries of the current one."""

    def __init__(self, local_world_size: int, *, collective_timeout: Optional[float] = None,
                 on_expiry: Optional[Callable[[], None]] = None) -> None:
        self._wake = on_expiry
        self.server = TimerServer(local_world_size, on_expiry=self._expired)
        self.collective_timeout = collective_timeout
        self._lock = threading.Lock()
        self._by_pid: dict[int, Expiry] = {}
        self._unseen: list[Expiry] = []

    def worker_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` (the spec's env) plus what workers need to reach this agent's timers."""
        return {**base, **self.server.worker_env(collective_timeout=self.collective_timeout,
                                                 base_env={**os.environ, **base})}

    def arm(self, pids: Mapping[int, int], assignment: Assignment, report_dir: object) -> None:
        """Watch a freshly started attempt. Regions are reset first: no worker of the previous
        attempt is alive to write them any more (the group stopped it)."""
        self.server.unwatch()
        with self._lock:
            self._by_pid.clear()
            self._unseen.clear()
        self.server.watch(pids, ranks={lr: assignment.global_rank(lr) for lr in pids},
                          report_dir=report_dir)  # type: ignore[arg-type]

    def replace(self, local_rank: int, pid: int, assignment: Assignment, report_dir: object) -> None:
        """Watch the replacement of a worker that died (in-place recovery) in its slot."""
        self.server.watch_worker(local_rank, pid, rank=assignment.global_rank(local_rank),
                                 report_dir=report_dir)  # type: ignore[arg-type]

    def forget(self, local_rank: int) -> None:
        """The worker of ``local_rank`` has exited: clear its region before anything replaces it."""
        self.server.unwatch(local_rank)

    def take_new(self) -> list[Expiry]:
        """Expiries not handed out yet (for events and metrics), oldest first."""
        with self._lock:
            out, self._unseen = self._unseen, []
        return out

    def expiry_of(self, pid: int) -> Optional[Expiry]:
        """Why the reaper killed the worker with this PID in the current attempt, if it did."""
        with self._lock:
            return self._by_pid.get(pid)

    def hangs(self) -> dict[int, tuple[str, str]]:
        """PID → (headline, description) of each worker it killed, for the failure report."""
        with self._lock:
            return {pid: (e.headline(), e.describe()) for pid, e in self._by_pid.items()}

    def close(self) -> None:
        self.server.close()

    def _expired(self, e: Expiry) -> None:
        """On the reaper's thread, before the kill: record it, then wake the agent's loop."""
        with self._lock:
            self._by_pid[e.pid] = e
            self._unseen.append(e)
        if self._wake is not None:
            self._wake()
