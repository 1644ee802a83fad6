"""What a node says about its own worker's failure: which worker, why, when, and the report.

Apart from the failure path, which decides what the job does (report it first, stop the
workers, wait for or make the decision), because this part only reads: the exits, the
watchdog's expiries and hangs, the steps block. Pure over what it is given, so a reader who
asks "why did the agent call it a hang?" finds it here and nothing else.
"""
from __future__ import annotations

from typing import Any

from ..supervisor.report import FailureReport
from ..supervisor.spec import WorkerResult
from .watchdog import Watchdog


def first_failed(failed: list[WorkerResult]) -> WorkerResult:
    """The worker that failed first (the earliest exit)."""
    return min(failed, key=lambda r: r.ended_at)


def failed_at(failed: list[WorkerResult], watchdog: Watchdog | None) -> float | None:
    """When this node's first failure happened: its worker's exit, or earlier, the moment a
    watchdog declared it hung (a timer's expiry, the progress watchdog's verdict)."""
    if not failed:
        return None
    first = first_failed(failed)
    at = first.ended_at
    if watchdog is not None:
        expiry, hang = watchdog.expiry_of(first.pid), watchdog.hang_of(first.pid)
        if expiry is not None:
            at = min(at, expiry.detected_at)
        if hang is not None and hang.declared_at > 0:
            at = min(at, hang.declared_at)
    return at


def why_failed(first: WorkerResult, watchdog: Watchdog | None) -> tuple[str, dict[str, Any]]:
    """The failure's headline (a timer's expiry, a detected hang, else the exit) and the
    ``cause`` fields of its WORKER_FAILED event."""
    hang = watchdog.expiry_of(first.pid) if watchdog is not None else None
    stall = watchdog.hang_of(first.pid) if watchdog is not None else None
    headline = hang.headline() + " (watchdog timer expired)" if hang is not None else \
        stall.headline() if stall is not None else first.describe()
    extra: dict[str, Any] = {"cause": "timer_expired", "timer_scope": hang.scope} if hang else \
        {"cause": "hang_detected"} if stall else {}
    return headline, extra


def failure_report(results: list[WorkerResult], restarts: int, watchdog: Watchdog | None) -> FailureReport:
    """The failure report over this attempt's results, with the hangs the watchdog saw."""
    return FailureReport.collect(results, stopped=[r.local_rank for r in results if r.stopped],
                                 restart_count=restarts,
                                 hangs=watchdog.hangs() if watchdog is not None else None)


def root_cause(rep: FailureReport, first: WorkerResult, progressed: bool | None) -> str:
    """The cause a decision names: the report's root cause, else the first exit; marked a
    start-up failure when no rank had made its first step."""
    root = rep.root_cause
    cause = root.cause() if root is not None else first.describe()
    if progressed is False:
        cause += " (a start-up failure: before any rank's first step)"
    return cause
