"""The agent's side of the watchdog timers: one :class:`TimerServer` per agent, re-armed per attempt.

The agent always owns one, so a script that uses ``elastictk.timer.expires`` is covered under
``elastictk-run`` without a flag, and ``--collective-timeout`` only adds the variable that puts
every collective under a timer. The reaper kills a stuck worker on its own thread; the agent
then sees an ordinary exit by SIGKILL, and this class is where it learns why: the expiry,
matched by PID, becomes the failure's headline ("rank 3 stuck in all_reduce at train.py:57")
instead of "SIGKILL".

With ``progress_timeout``/``startup_timeout`` it also owns a :class:`ProgressWatch` (see
``progress.py``) over the workers' steps block, the one the caller passes (``--metrics-port``
made one) or its own; its hangs reach the agent the same way: a killed worker, and here why.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Mapping, Optional

from ..metrics.kinds import Emit, EventKind
from ..metrics.steps import WorkerStepsBlock
from ..metrics.marks import ENV_MARKS
from ..metrics.worker import ENV_HOOKS
from ..timer import Expiry, TimerServer
from ..supervisor.env import Assignment
from .learned import Stall
from .hang import Hang
from .progress import ProgressWatch, worker_env as progress_env


class Watchdog:
    """Arms the workers of each attempt and keeps the expiries of the current one."""

    def __init__(self, local_world_size: int, *, collective_timeout: Optional[float] = None,
                 on_expiry: Optional[Callable[[], None]] = None,
                 progress_timeout: Optional[float] = None, startup_timeout: Optional[float] = None,
                 steps: Optional[WorkerStepsBlock] = None, hang_detection: str = "fixed") -> None:
        self._wake = on_expiry
        self.server = TimerServer(local_world_size, on_expiry=self._expired)
        self.collective_timeout = collective_timeout
        self._lock = threading.Lock()
        self._by_pid: dict[int, Expiry] = {}
        self._unseen: list[Expiry] = []
        self._own_block: Optional[WorkerStepsBlock] = None
        self.progress: Optional[ProgressWatch] = None
        learned = hang_detection == "learned"
        if hang_detection == "off":
            progress_timeout = None
        if progress_timeout or startup_timeout or learned:
            try:
                if steps is None:
                    steps = self._own_block = WorkerStepsBlock(local_world_size)
                self.progress = ProgressWatch(
                    steps, progress_timeout=progress_timeout, startup_timeout=startup_timeout,
                    stacks=self.server.dump_stacks, on_hang=lambda _h: self._wake and self._wake(),
                    learned=learned)
            except BaseException:
                self.close()
                raise

    def steps_block(self) -> Optional[WorkerStepsBlock]:
        """The steps block the progress watchdog reads (None when progress is not watched)."""
        return self.progress.block if self.progress is not None else None

    def worker_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` (the spec's env) plus what workers need to reach this agent's timers (and
        its steps block, when progress is watched)."""
        env = dict(base)
        if self.progress is not None:
            block = self.progress.block.env()
            if self.progress.learned is not None:
                block[ENV_MARKS] = "1"
            names = [n for n in (base.get(ENV_HOOKS) or os.environ.get(ENV_HOOKS, "")).split(",") if n.strip()]
            names += [n for n in block[ENV_HOOKS].split(",") if n not in names]
            env.update({**block, ENV_HOOKS: ",".join(names), **progress_env(True)})
        return {**env, **self.server.worker_env(collective_timeout=self.collective_timeout,
                                                base_env={**os.environ, **env})}

    def reset(self) -> None:
        """Clear every region before an attempt's workers start: no worker of the previous
        attempt is alive to write them any more (the group stopped it), and a new worker may
        attach at once (the progress watchdog's stack dumps attach at start), so the reset must
        not come after the start."""
        self.server.unwatch()

    def arm(self, pids: Mapping[int, int], assignment: Assignment, report_dir: object) -> None:
        """Watch a freshly started attempt (its regions were :meth:`reset` before it started)."""
        with self._lock:
            self._by_pid.clear()
            self._unseen.clear()
        ranks = {lr: assignment.global_rank(lr) for lr in pids}
        self.server.watch(pids, ranks=ranks, report_dir=report_dir)
        if self.progress is not None:
            self.progress.arm(pids, ranks, report_dir)

    def pause_progress(self) -> None:
        """Kept workers wait for the next round (in place): no progress is expected until
        :meth:`rearm_progress`."""
        if self.progress is not None:
            self.progress.pause()

    def rearm_progress(self, pids: Mapping[int, int], assignment: Assignment, report_dir: object) -> None:
        """The kept workers run on in a new round: their progress clocks start now."""
        if self.progress is not None:
            self.progress.arm(pids, {lr: assignment.global_rank(lr) for lr in pids}, report_dir)

    def replace(self, local_rank: int, pid: int, assignment: Assignment, report_dir: object) -> None:
        """Watch the replacement of a worker that died (in-place recovery) in its slot."""
        self.server.watch_worker(local_rank, pid, rank=assignment.global_rank(local_rank),
                                 report_dir=report_dir)
        if self.progress is not None:
            self.progress.replace(local_rank, pid, assignment.global_rank(local_rank))

    def forget(self, local_rank: int) -> None:
        """The worker of ``local_rank`` has exited: clear its region before anything replaces it."""
        self.server.unwatch(local_rank)
        if self.progress is not None:
            self.progress.forget(local_rank)

    def take_new(self) -> list[Expiry]:
        """Expiries not handed out yet (for events and metrics), oldest first."""
        with self._lock:
            out, self._unseen = self._unseen, []
        return out

    def emit_news(self, emit: Emit) -> None:
        """Events for what was caught since the last look (the reaper and the progress watch run
        on threads of their own): expired timers, detected hangs, learned deadlines, stalls."""
        for e in self.take_new():
            emit(EventKind.TIMER_EXPIRED, rank=e.rank, local_rank=e.local_rank, pid=e.pid, scope=e.scope,
                 where=e.where, late_ms=round(e.late_s * 1e3, 1), report=e.report_path)
        for h in self.take_hangs():
            emit(EventKind.HANG_DETECTED, **h.fields())
        changed, stalls = self.take_learned()
        for deadlines in changed:
            emit(EventKind.HANG_DEADLINE, deadlines={k: round(v, 2) for k, v in deadlines.items()})
        for s in stalls:
            emit(EventKind.PROGRESS_STALLED, **s.fields())

    def expiry_of(self, pid: int) -> Optional[Expiry]:
        """Why the reaper killed the worker with this PID in the current attempt, if it did."""
        with self._lock:
            return self._by_pid.get(pid)

    def take_hangs(self) -> list[Hang]:
        """Progress hangs not handed out yet (for events), oldest first."""
        return self.progress.take_new() if self.progress is not None else []

    def take_learned(self) -> tuple[list[dict[str, float]], list[Stall]]:
        """Learned deadlines that changed and stalls reported (not killed) since the last call."""
        if self.progress is None or self.progress.learned is None:
            return [], []
        return self.progress.learned.take()

    def blame_stopped(self, failed: list[int]) -> Optional[Hang]:
        """Workers failed while a sibling is stopped: that sibling is the culprit (see
        :meth:`ProgressWatch.blame_stopped`); None without a progress watch or a stopped one."""
        return self.progress.blame_stopped(failed) if self.progress is not None else None

    def hang_of(self, pid: int) -> Optional[Hang]:
        """The progress hang the worker with this PID was killed for, if it was."""
        return self.progress.hang_of(pid) if self.progress is not None else None

    def hangs(self) -> dict[int, tuple[str, str]]:
        """PID → (headline, description) of each worker it killed, for the failure report."""
        with self._lock:
            out = {pid: (e.headline(), e.describe()) for pid, e in self._by_pid.items()}
        if self.progress is not None:
            for pid, h in self.progress.killed().items():
                out.setdefault(pid, (h.headline(), h.describe()))
        return out

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.server.close()
        if self._own_block is not None:
            self._own_block.close()

    def _expired(self, e: Expiry) -> None:
        """On the reaper's thread, before the kill: record it, then wake the agent's loop."""
        with self._lock:
            self._by_pid[e.pid] = e
            self._unseen.append(e)
        if self._wake is not None:
            self._wake()
