"""The progress watchdog's learned mode (``--hang-detection learned``): what one look reads.

:class:`Learned` turns the steps block's progress words into what ``hangjudge.judge`` decides
on: it feeds the job's :class:`~elastictk.agent.pace.Pace` with the intervals the workers
recorded since the look before (the gap histogram, the step histogram, completed sections),
samples each rank's CPU time (a rank that computes is not waiting), and keeps the learned
deadlines that changed and the stalls seen, for the agent's events. One instance lives as
long as the agent, so what a job learned protects its restarted attempts at once.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Mapping, Optional

from ..lifetime.procfs import cpu_seconds, read_stat
from ..metrics.layout import GAP_BOUNDS, STEP_BUCKETS, SlotSnapshot
from .hangjudge import RankView, Verdict, judge
from .pace import WINDOW, Pace

BUSY_CPU = 0.3  # cores a rank used since the look before that make it "computing"


def _bound(bounds: tuple[float, ...], i: int) -> float:
    """A histogram bucket's upper bound (twice the last finite one for +Inf): the interval
    learned for every count in it, which errs long, never short."""
    return bounds[i] if i < len(bounds) else 2 * bounds[-1]


def _samples(bounds: tuple[float, ...], new: tuple[int, ...], old: tuple[int, ...]) -> list[float]:
    """The intervals a histogram gained since ``old``, each as its bucket's bound; more than
    a window's worth are thinned in proportion per bucket, rounding up, so a rare long interval
    is never thinned away (the deadline errs long)."""
    counts = [max(0, int(a) - int(b)) for a, b in zip(new, old)]
    total = sum(counts)
    if total > WINDOW:
        counts = [math.ceil(c * WINDOW / total) for c in counts]
    return [_bound(bounds, i) for i, c in enumerate(counts) for _ in range(c)]


@dataclass(frozen=True)
class Stall:
    """All of a node's ranks without progress past their learned deadline, none killed."""

    local_ranks: tuple[int, ...]
    ranks: tuple[int, ...]
    idle_s: float
    deadline_s: float
    reason: str
    where: tuple[Optional[str], ...]
    report: Optional[str]
    killed: bool  # an explicit --progress-timeout it outlasted: judged as a progress hang

    def line(self, host: str) -> str:
        at = ", ".join(f"rank {r} at {w or '?'}" for r, w in zip(self.ranks, self.where))
        then = "killed: past --progress-timeout" if self.killed else \
            "not killed (a stall together is killed only past an explicit --progress-timeout)"
        stacks = f"stacks in {self.report}" if self.report else "no stacks written"
        return (f"progress stalled on {host}: {self.reason} for {self.idle_s:.1f}s, past the learned "
                f"deadline {self.deadline_s:.1f}s: {at}; {then}; {stacks}")

    def fields(self) -> dict[str, object]:
        return {"ranks": list(self.ranks), "idle_s": round(self.idle_s, 2),
                "deadline_s": round(self.deadline_s, 2), "reason": self.reason,
                "where": list(self.where), "report": self.report, "killed": self.killed}


class Learned:
    """The learned judge's state across looks and attempts (see the module docstring)."""

    def __init__(self, ceiling: Optional[float]) -> None:
        self.pace = Pace(ceiling)
        self._prev: dict[int, SlotSnapshot] = {}
        self._cpu: dict[int, tuple[int, float, float]] = {}  # lr -> (pid, mono, cpu seconds)
        self._lock = threading.Lock()
        self._changed: list[dict[str, float]] = []
        self._stalls: list[Stall] = []
        self.stalled_since: Optional[float] = None  # the stall reported (its ranks' last progress)

    def learn(self, slots: list[SlotSnapshot]) -> None:
        """Feed the pace with what every slot recorded since the look before."""
        for s in slots:
            old = self._prev.get(s.local_rank)
            self._prev[s.local_rank] = s
            if old is None:
                old = SlotSnapshot(s.local_rank)
            gaps = _samples(GAP_BOUNDS, s.gaps, old.gaps)
            if gaps:
                self.pace.add("progress", gaps)
            steps = _samples(STEP_BUCKETS, s.buckets, old.buckets)
            if steps:
                self.pace.add("step", steps)
            if s.sections_done > old.sections_done and s.section_last:
                self.pace.add(f"section:{s.section_last}", [s.section_last_s])
        changed = self.pace.changed()
        if changed:
            with self._lock:
                self._changed.append(changed)

    def views(self, now: float, ranks: Mapping[int, tuple[int, int, float]],
              slots: list[SlotSnapshot]) -> list[RankView]:
        """``ranks``: local rank -> (rank, pid, watched since)."""
        out = []
        for lr, (rank, pid, started) in ranks.items():
            s = slots[lr] if lr < len(slots) else SlotSnapshot(lr)
            finished = s.last_step_mono == math.inf
            last = max(started, s.progress_mono, 0.0 if finished else s.last_step_mono)
            # no progress since it was (re)started: a start-up (--startup-timeout's), not a hang
            fresh = last <= started
            cpu = cpu_seconds(pid)
            prev = self._cpu.get(lr)
            busy = False
            if cpu is not None:
                if prev is not None and prev[0] == pid and now - prev[1] > 0.2:
                    busy = (cpu - prev[2]) / (now - prev[1]) >= BUSY_CPU
                self._cpu[lr] = (pid, now, cpu)
            st = read_stat(pid)
            # Runnable (R) is computing too, however little CPU it got: on a host whose cores
            # are all busy (data loaders at 100 %) a rank in a long step may get under
            # BUSY_CPU of a core, and it must not read as idle. In disk I/O (D: a checkpoint
            # written to slow storage while the peers wait in the next collective) it works
            # too. Idle is asleep (S) with no CPU: a lock, a wait, a frozen loop.
            busy = busy or (st is not None and st.state in ("R", "D"))
            out.append(RankView(lr, rank, last, s.coll_since,
                                s.section if s.section_since else "",
                                "?" if st is None else st.state, busy, finished or fresh))
        return out

    def look(self, now: float, ranks: Mapping[int, tuple[int, int, float]],
             slots: list[SlotSnapshot]) -> tuple[Optional[Verdict], float, list[RankView]]:
        self.learn(slots)
        views = self.views(now, ranks, slots)
        verdict, wait = judge(now, views, self.pace)
        if verdict is None or verdict.kind != "stalled":
            self.stalled_since = None
        return verdict, min(wait, 5.0), views

    def add_stall(self, stall: Stall) -> None:
        with self._lock:
            self._stalls.append(stall)

    def take(self) -> tuple[list[dict[str, float]], list[Stall]]:
        """Deadlines that changed and stalls, since the last call (for the agent's events)."""
        with self._lock:
            out = (self._changed, self._stalls)
            self._changed, self._stalls = [], []
        return out


__all__ = ["Learned", "Stall"]
