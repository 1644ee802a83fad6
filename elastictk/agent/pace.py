"""Learned hang deadlines: how long a job may go without progress, judged by its own pace.

A fixed watchdog timeout is wrong in both directions: long enough for a job's slowest normal
phase (an eval, a checkpoint save) it finds a frozen rank of a fast job minutes late; short
enough to find that rank in seconds it kills the eval. :class:`Pace` learns one deadline per
kind of progress (the gap between two progress marks of a rank, a step's duration, a named
section's duration) from the intervals the job itself shows:

    deadline = clamp(quantile(window, q) * factor, floor, ceiling)

- **Warm-up excluded**: the first ``warmup`` samples of a kind (first steps, compilation, the
  first run of a section) are not learned from; until ``min_samples`` more have been seen the
  kind is *unlearned* and its deadline is the ceiling (the fixed ``--progress-timeout``).
- **Outliers do not drag it up**: a high quantile (99th) of a sliding window, not the maximum,
  so one stray long gap beyond the quantile leaves the deadline where it was.
- **A slowing job is followed**: the window holds the most recent samples only, and a quantile
  times ``factor`` (3) leaves room for a pace that slows by a few per cent a sample; a job that
  slows 3x gradually is never past its deadline.
- **Floor and ceiling**: never under ``floor`` seconds (a loaded host descheduling a rank for a
  second is not a hang), never over the fixed ceiling the user chose.

Pure (no clock, no I/O), so its promises are property-tested (tests/test_pace.py); the agent
keeps one :class:`Pace` per job for its whole life, so a restarted attempt is protected by what
the attempts before it learned.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

FLOOR = 5.0  # seconds: never judge a rank hung sooner
FACTOR = 3.0  # safety factor over the quantile
QUANTILE = 0.99
WINDOW = 512  # most recent samples a deadline is learned from
WARMUP = 5  # first samples of a kind that are never learned from
MIN_SAMPLES = 20  # learned samples before a kind's deadline leaves the ceiling
DEFAULT_CEILING = 300.0  # the fixed --progress-timeout's default


@dataclass
class Estimator:
    """One kind's learned deadline (see the module docstring)."""

    ceiling: float = DEFAULT_CEILING
    floor: float = FLOOR
    factor: float = FACTOR
    quantile: float = QUANTILE
    warmup: int = WARMUP
    min_samples: int = MIN_SAMPLES
    seen: int = 0  # every sample offered, warm-up included
    window: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, seconds: float) -> None:
        """One observed interval; warm-up samples, NaN and negative values are ignored."""
        self.seen += 1
        if self.seen <= self.warmup or not seconds >= 0:
            return
        self.window.append(min(float(seconds), 1e12))

    def extend(self, samples: Iterable[float]) -> None:
        for s in samples:
            self.add(s)

    @property
    def learned(self) -> bool:
        return len(self.window) >= self.min_samples

    def deadline(self) -> float:
        """Seconds without this kind of progress that the job's pace does not explain."""
        floor = min(self.floor, self.ceiling)
        if not self.learned:
            return self.ceiling
        q = quantile(self.window, self.quantile)
        return min(self.ceiling, max(floor, q * self.factor))


def quantile(samples: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` quantile: the smallest sample with at least ``q`` of all samples
    at or below it (so with 100+ samples, a single largest one is never the 99th)."""
    ordered = sorted(samples)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class Pace:
    """A job's learned deadlines, one :class:`Estimator` per kind (``progress``, ``step``,
    ``section:<name>``), created on first sample with the same ceiling and floor."""

    def __init__(self, ceiling: Optional[float] = None, floor: float = FLOOR) -> None:
        self.ceiling = DEFAULT_CEILING if ceiling is None else float(ceiling)
        self.floor = floor
        self.kinds: dict[str, Estimator] = {}
        self._reported: dict[str, float] = {}

    def add(self, kind: str, samples: Iterable[float]) -> None:
        est = self.kinds.get(kind)
        if est is None:
            est = self.kinds[kind] = Estimator(ceiling=self.ceiling, floor=self.floor)
        est.extend(samples)

    def deadline(self, kind: str) -> float:
        est = self.kinds.get(kind)
        return self.ceiling if est is None else est.deadline()

    def learned(self, kind: str) -> bool:
        est = self.kinds.get(kind)
        return est is not None and est.learned

    def changed(self, rel: float = 0.2) -> dict[str, float]:
        """Learned deadlines that moved by more than ``rel`` since they were last returned
        (a kind's first learned value included): what the agent writes to its event log."""
        out: dict[str, float] = {}
        for kind, est in sorted(self.kinds.items()):
            if not est.learned:
                continue
            d, old = est.deadline(), self._reported.get(kind)
            if old is None or abs(d - old) > rel * old:
                out[kind] = self._reported[kind] = d
        return out

    def snapshot(self) -> dict[str, float]:
        """Every learned kind's deadline now (for metrics)."""
        return {k: e.deadline() for k, e in sorted(self.kinds.items()) if e.learned}


__all__ = ["DEFAULT_CEILING", "Estimator", "FLOOR", "Pace", "quantile"]
