"""The learned hang judge (``--hang-detection learned``): pure decisions over one look at a
node's ranks, so what is killed and what is only reported is property-testable.

A rank is *due* when its latest progress of any kind (a step, a completed collective, a
``fault_point``, a section's edge) is older than its learned deadline (``pace.py``): the
``progress`` gap deadline, or inside a user section the larger of that and the section's own.
Then, in order:

- a due rank that is **stopped** (state T) is hung: it will never progress;
- a due rank that is **not inside a collective and not using CPU**, while a peer waits inside a
  collective, is hung: the peer waits for a collective it has not entered (a frozen rank, a
  deadlock, a rank blocked in a collective its peer never joins);
- **every** rank due, none of them hung: the job stalled together (a long phase outside any
  collective, or all waiting on a rank of another node). Reported (an event, a metric, one
  line with their stacks), never killed by the learned deadline; only an explicit
  ``--progress-timeout`` the stall outlasts kills (``ProgressWatch`` decides that);
- anything else (a due rank that computes, a due rank in a collective while a peer computes)
  is looked at again soon: nothing the job's pace cannot explain yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .pace import Pace

RECHECK = 1.0  # seconds until the next look when some rank is due but nothing is decided


@dataclass(frozen=True)
class RankView:
    """One rank at one look."""

    local_rank: int
    rank: int
    last: float  # time.monotonic() of its latest progress (or its start, before any)
    coll_since: float  # inside a collective since (0: not)
    section: str  # the user section it is inside ("" for none)
    state: str  # /proc state: R, S, D, T ...
    busy: bool  # used CPU since the look before (computing, not blocked)
    finished: bool  # its script has ended, or it made no progress since its start: not judged


@dataclass(frozen=True)
class Verdict:
    kind: str  # "hung" (kill these) or "stalled" (report all)
    local_ranks: tuple[int, ...]
    reason: str
    deadline: float  # the learned deadline the ranks are past (the largest of theirs)


def deadline_of(view: RankView, pace: Pace) -> float:
    base = pace.deadline("progress")
    return max(base, pace.deadline(f"section:{view.section}")) if view.section else base


def judge(now: float, views: Sequence[RankView], pace: Pace) -> tuple[Optional[Verdict], float]:
    """The verdict of this look (None: nothing to do), and the seconds until the next look
    could decide something (the earliest deadline, or :data:`RECHECK`)."""
    live = [v for v in views if not v.finished]
    if not live:
        return None, pace.ceiling
    deadlines = {v.local_rank: deadline_of(v, pace) for v in live}
    left = {v.local_rank: v.last + deadlines[v.local_rank] - now for v in live}
    due = [v for v in live if left[v.local_rank] <= 0]
    if not due:
        return None, max(0.01, min(left.values()) + 0.01)
    worst = max(deadlines[v.local_rank] for v in due)
    stopped = [v for v in due if v.state in ("T", "t")]
    if stopped:
        return Verdict("hung", _lrs(stopped), "stopped by a signal (state T)", worst), RECHECK
    waiting = [v for v in live if v.coll_since > 0]
    idle = [v for v in due if v.coll_since == 0 and not v.busy]
    if waiting and idle:
        who = ", ".join(str(v.rank) for v in waiting)
        return Verdict("hung", _lrs(idle), f"no progress past its learned deadline while rank(s) "
                       f"{who} wait in a collective it has not entered", worst), RECHECK
    if len(due) == len(live):
        if len(waiting) == len(live):
            why = "all waiting in collectives (on a rank of another node?)"
        elif waiting:
            why = (f"rank(s) {', '.join(str(v.rank) for v in waiting)} wait in a collective while "
                   "the others still compute")
        else:
            why = "all stalled together outside a collective"
        return Verdict("stalled", _lrs(live), why, worst), RECHECK
    return None, RECHECK


def _lrs(views: Sequence[RankView]) -> tuple[int, ...]:
    return tuple(sorted(v.local_rank for v in views))


__all__ = ["RankView", "Verdict", "deadline_of", "judge"]
