"""The chaos report's recovery phases: per fault, where its recovery's time went, and the run's
medians, from the agent's ``recovery`` events (see ``elastictk/metrics/recovery.py``).

Apart from ``report.py`` so the table's columns and the per-phase arithmetic change together;
the report only asks for a row's phases, the run's medians and the extra columns.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..metrics.recovery import NAMES, describe, median_phases, valid_phases

KIND = "recovery"
HEADS = {"detect": "detect phase", "stop": "stop", "rendezvous": "rdzv", "start": "start",
         "restore": "restore", "first_step": "1st step"}


def of_restart(events: Sequence[Any], restart_count: Optional[int]) -> Optional[dict[str, float]]:
    """The phases of the recovery that restart ``restart_count`` began (None: no such recovery).
    Matched by the count, not by time: a recovery is logged once its first step is seen, which
    may be after the next fault has fired."""
    if restart_count is None:
        return None
    found = next((e for e in events if e.kind == KIND and e.fields.get("restart_count") == restart_count), None)
    return None if found is None else valid_phases(found.fields.get("phases_ms"))


def of_run(events: Sequence[Any]) -> list[dict[str, float]]:
    """Every recovery's phases, in log order."""
    return [valid_phases(e.fields.get("phases_ms")) for e in events if e.kind == KIND]


def medians(events: Sequence[Any]) -> dict[str, float]:
    """The median of each phase over the run's recoveries."""
    return median_phases(of_run(events))


def columns(phases: Sequence[Optional[dict[str, float]]]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """The table's extra columns (heads, then one row of cells per fault): one column per phase
    that any recovery has, in milliseconds; none when no fault has a timed recovery."""
    names = [n for n in NAMES if any(p and n in p for p in phases)]
    heads = tuple(f"{HEADS[n]} ms" for n in names)
    cells = [tuple("-" if not p or n not in p else f"{p[n]:.0f}" for n in names) for p in phases]
    return heads, cells


def line(tot: dict[str, Any]) -> Optional[str]:
    """The report's line on the run's recoveries: median per phase (None without any)."""
    med, n = tot.get("recovery_phases_ms"), tot.get("recoveries_timed") or 0
    if not med or not n:
        return None
    return f"recovery phases ({'median of ' + str(n) if n > 1 else '1 recovery'}): {describe(med)}"
