"""``RecoveryWatch``: one recovery timed from the failure to the first step, as a ``recovery`` event.

The agent marks the moments it lives through (it acted on a failure, stopped the workers,
joined the new round, started the new attempt; in place: replaced a worker, the group formed);
the moments the workers live through come from the steps block, which holds each process's
first and second counted step on the same monotonic clock (``FIRST_STEP_MONO``), so reading it
late (on the monitor's next wake-up, or at the job's end) loses no precision and the workers'
hot path only writes two words. The phases are :func:`elastictk.metrics.recovery.phases_ms`.

A recovery is emitted once its last phase is known; one cut short (the next failure, the job's
end) is emitted with the phases known by then. A failure that ends the job is no recovery.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..metrics.kinds import Emit, EventKind
from ..metrics.layout import SlotSnapshot
from ..metrics.recovery import phases_ms, steps_redone, summary_line
from ..metrics.steps import WorkerStepsBlock

RESTART_ALL, IN_PLACE = "restart-all", "in-place"
UNKNOWN = "unknown"  # steps_redone where no checkpoint was reported: never a guessed number
POLL_S = 0.25  # the monitor's wake-up while a first step is awaited (its time is read exactly)


@dataclass
class _Recovery:
    path: str
    marks: dict[str, float]
    failed_pids: set[int]  # the processes whose unsaved steps are redone
    pids: set[int] = field(default_factory=set)  # the processes whose first step ends it
    confirmed: bool = False  # restart-all: charged as a restart (not the job's end)
    restart_count: Optional[int] = None
    redone: Optional[int] = None


class RecoveryWatch:
    """Times the agent's recoveries; ``emit`` gets one ``recovery`` event per recovery."""

    def __init__(self, emit: Emit, steps: Optional[WorkerStepsBlock],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._emit, self._steps, self._clock = emit, steps, clock
        self._now: Optional[_Recovery] = None
        self.done: list[dict[str, float]] = []  # each emitted recovery's phases

    # -- restart-all ----------------------------------------------------------------------------
    def failed(self, at: Optional[float], acted: float, pids: set[int]) -> None:
        """A failure the agent acts on (at ``acted``; it happened at ``at``, None when not on
        this host): a recovery still awaiting its first step ends here, a new one begins."""
        self._end()
        marks = {"acted": acted} if at is None else {"failed": min(at, acted), "acted": acted}
        self._now = _Recovery(RESTART_ALL, marks, set(pids))

    def stopped(self) -> None:
        """The failed attempt's workers are stopped: its counts are final, so the steps it will
        redo are known."""
        rec = self._now
        if rec is None or "stopped" in rec.marks:
            return
        rec.marks["stopped"] = self._clock()
        slots = [s for s in self._slots() if s.owner in rec.failed_pids]
        # Known only where the script tells elastictk its checkpoints (``etm.checkpoint()``): a
        # torch.save the agent never sees would make every step look redone.
        if slots and all(s.checkpoints > 0 for s in slots):
            rec.redone = max(steps_redone(s.proc_steps, s.ckpt_steps) for s in slots)

    def restarting(self, restart_count: int) -> None:
        """The failure was charged as a restart: a recovery, emitted even if cut short."""
        if self._now is not None:
            self._now.confirmed, self._now.restart_count = True, restart_count

    def joined(self) -> None:
        self._mark("joined")

    def started(self, pids: set[int]) -> None:
        """Every worker of the new attempt started; their first steps end the recovery."""
        rec = self._now
        if rec is not None and rec.confirmed and rec.path == RESTART_ALL:
            rec.marks["started"] = self._clock()
            rec.pids = set(pids)
            for later in ("resumed", "stepped"):  # a re-rendezvous before the first step
                rec.marks.pop(later, None)

    # -- in place -------------------------------------------------------------------------------
    def replaced(self, at: float, spawn_s: float, pids: set[int], restart_count: int) -> None:
        """Failed workers (the first exited at ``at``) were replaced in place; starting the
        replacements took ``spawn_s`` up to now."""
        self._end()
        started = self._clock()
        acted = started - max(0.0, spawn_s)
        self._now = _Recovery(IN_PLACE, {"failed": min(at, acted), "acted": acted, "started": started},
                              set(), pids=set(pids), confirmed=True, restart_count=restart_count)

    def inplace_event(self, kind: EventKind, fields: dict[str, Any], replaced_at: float | None) -> None:
        """An in-place round's event, read for its recovery's moments: the replacements
        started (``replaced_at``: when the failures being replaced exited), then re-formed."""
        if kind == EventKind.INPLACE_RECOVERY:
            replaced = fields.get("replaced") or {}
            at = replaced_at if replaced_at is not None else time.monotonic()
            self.replaced(at, float(fields.get("spawn_ms") or 0.0) / 1000, set(replaced.values()),
                          int(fields.get("restart_count") or 0))
        elif kind == EventKind.INPLACE_RECOVERED:
            self.reformed(float(fields.get("took_ms") or 0.0) / 1000)

    def reformed(self, took_s: float) -> None:
        """The generation formed and synced, ``took_s`` after the replacements began to start."""
        rec = self._now
        if rec is not None and rec.path == IN_PLACE and "resumed" not in rec.marks:
            rec.marks["resumed"] = rec.marks["acted"] + max(0.0, took_s)

    # -- the monitor ----------------------------------------------------------------------------
    def wait(self, default: float) -> float:
        """How long the monitor may sleep: shorter while a first step is awaited."""
        rec = self._now
        waiting = rec is not None and "started" in rec.marks and self._steps is not None
        return min(default, POLL_S) if waiting else default

    def poll(self) -> None:
        """Read the first steps of the new processes; emit the recovery once they are in."""
        rec = self._now
        if rec is not None:
            self._read_steps(rec)
            if "stepped" in rec.marks:
                self._end()

    def finish(self) -> None:
        """The job ends: a recovery in flight is emitted with the phases known so far."""
        self._end()

    def summary(self) -> Optional[str]:
        """The end-of-job line: where recovery time went (None without a recovery)."""
        return summary_line(self.done)

    # -- helpers --------------------------------------------------------------------------------
    def _mark(self, name: str) -> None:
        rec = self._now
        if rec is not None and rec.confirmed and "started" not in rec.marks:
            rec.marks[name] = self._clock()

    def _slots(self) -> list[SlotSnapshot]:
        return self._steps.snapshot() if self._steps is not None else []

    def _read_steps(self, rec: _Recovery) -> None:
        """Mark ``resumed`` and ``stepped`` from the slots of the recovery's new processes."""
        if "started" not in rec.marks or not rec.pids:
            return
        mine = [s for s in self._slots() if s.owner in rec.pids and s.first_step_mono > 0]
        if rec.path == IN_PLACE:
            if "resumed" in rec.marks and mine:
                rec.marks["stepped"] = min(s.first_step_mono for s in mine)
        elif mine:
            first = min(mine, key=lambda s: s.first_step_mono)
            rec.marks["resumed"] = first.first_step_mono
            if first.second_step_mono > 0:
                rec.marks["stepped"] = first.second_step_mono

    def _end(self) -> None:
        """Emit the recovery in flight (a last look at the steps first), if it was one."""
        rec, self._now = self._now, None
        if rec is None or not rec.confirmed:
            return
        self._read_steps(rec)
        phases = phases_ms(rec.marks)
        self.done.append(phases)
        redone: object = rec.redone if rec.redone is not None else UNKNOWN
        extra = {"steps_redone": redone} if rec.path == RESTART_ALL else {}
        self._emit(EventKind.RECOVERY, path=rec.path, restart_count=rec.restart_count, phases_ms=phases,
                   total_ms=round(sum(phases.values()), 1), **extra)
