"""Where every second of a recovery goes: its phases, from marks on one monotonic clock.

A recovery is a run of *marks*, each the moment one phase ended: ``failed`` (a worker exited,
or a hang was declared), ``acted`` (the agent acted on it), ``stopped`` (the other workers were
stopped), ``joined`` (the new rendezvous round), ``started`` (every worker of the new attempt
started), ``resumed`` (the step counter of the new attempt first moved), ``stepped`` (that rank
finished its next step: the first whole step of resumed training). A phase lasts from the
latest mark before it that is known to its own mark; a phase whose mark is unknown, or that
does not apply (in place, nothing is stopped and no round is held), is omitted, never zero.
So the phases never overlap and add up to at most the time from the failure to the first step.

Pure functions over plain numbers, shared by the agent (the ``recovery`` event and the
end-of-job line), :class:`~elastictk.metrics.agent_metrics.AgentMetrics` (a histogram per
phase) and ``elastictk.chaos`` (the report's columns); see docs/metrics.md.
"""
from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping, Sequence

# (phase, the mark that ends it), in order; the first mark, "failed", ends no phase.
PHASES: tuple[tuple[str, str], ...] = (
    ("detect", "acted"), ("stop", "stopped"), ("rendezvous", "joined"), ("start", "started"),
    ("restore", "resumed"), ("first_step", "stepped"),
)
MARKS = ("failed",) + tuple(mark for _, mark in PHASES)
NAMES = tuple(phase for phase, _ in PHASES)
WORDS = {"first_step": "first step"}  # how a phase reads in a sentence


def phases_ms(marks: Mapping[str, float | None]) -> dict[str, float]:
    """Each phase's milliseconds from ``marks`` (monotonic seconds; absent or None: unknown).

    A phase is present when its own mark and some earlier mark are known, and lasts from the
    latest earlier known mark; a mark earlier than that one (clocks read on two threads) counts
    as no time, never as negative time."""
    out: dict[str, float] = {}
    last = marks.get("failed")
    for phase, mark in PHASES:
        at = marks.get(mark)
        if at is None:
            continue
        if last is not None:
            out[phase] = round(max(0.0, at - last) * 1000, 1)
        last = at if last is None else max(last, at)
    return out


def valid_phases(value: Any) -> dict[str, float]:
    """The known phases of a ``recovery`` event's ``phases_ms`` field; anything else (a forged
    or foreign log line) is dropped, so readers never fail on it."""
    if not isinstance(value, Mapping):
        return {}
    return {k: float(v) for k, v in value.items() if k in NAMES and isinstance(v, (int, float))
            and not isinstance(v, bool) and 0 <= v < float("inf")}


def median_phases(recoveries: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The median of each phase over the recoveries that have it, in phase order."""
    seen: dict[str, list[float]] = {}
    for phases in recoveries:
        for name, ms in valid_phases(phases).items():
            seen.setdefault(name, []).append(ms)
    return {name: statistics.median(seen[name]) for name in NAMES if name in seen}


def describe(phases: Mapping[str, float]) -> str:
    """``detect 12 ms, stop 40 ms, ...``: each phase present, in order."""
    return ", ".join(f"{WORDS.get(n, n)} {_ms(ms)}" for n, ms in valid_phases(phases).items())


def summary_line(recoveries: Sequence[Mapping[str, float]]) -> str | None:
    """The end-of-job line that says where recovery time went (None without a recovery)."""
    if not recoveries:
        return None
    medians = median_phases(recoveries)
    n = len(recoveries)
    what = f"{n} recover{'y' if n == 1 else 'ies'}" + (", medians" if n > 1 else "")
    return f"recovery time: {describe(medians) or 'no phase measured'} ({what})"


def steps_redone(last_done: int, resumed_from: int) -> int:
    """Steps a job runs twice: those after the step it resumed from up to the last one it had
    completed before the failure (a job that resumed from step 50 after completing 57 redoes 7)."""
    return max(0, last_done - resumed_from)


def _ms(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 10_000 else f"{ms / 1000:.1f} s"
