"""The chaos report's rows: per planned fault, when it hit, when the agent saw it, when training
resumed, the restart it spent and the steps it cost; or, for one that never fired, why not.

Apart from the invariants (``checks.py``) and the report's assembly (``report.py``): a row is
what the run's records say happened to one fault, read from the agent's event log and the
workers' fault log; judging it is another module's business. The event kinds that mark a
failure, a restart and running workers live here, where rows and checks both read them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from ..faults import FaultPlan
from . import nodereport, phases
from .expect import Shape
from .lost import Lost, lost_steps
from .record import RunRecord

# A watchdog's verdict is the failure's detection: the kill (worker_failed) follows it.
FAILURE_EVENTS = ("worker_failed", "peer_failed", "timer_expired", "hang_detected")
RESTART_EVENTS = ("restart", "inplace_recovery")  # both spend one restart of the budget
RUNNING_EVENTS = ("workers_started", "inplace_recovered")


@dataclass(frozen=True)
class FaultRow:
    index: int
    kind: str
    target: str
    planned: str
    fired: bool
    needs_restart: bool
    injected_at: Optional[float] = None
    detected_after: Optional[float] = None
    running_after: Optional[float] = None
    restarts_used: Optional[int] = None
    lost_steps: Optional[int] = None
    outcome: Optional[str] = None  # multi-node: restart | membership change | ridden through | ...
    why: Optional[str] = None  # a fault that did not fire: why not
    attempt: Optional[int] = None  # a step fault: the attempt it fires in
    phases_ms: Optional[dict[str, float]] = None  # its recovery's phases (the agent's recovery event)
    lost_why: Optional[str] = None  # lost_steps is None: why the records cannot tell


def launcher_flag(argv: list[str], flag: str) -> Optional[str]:
    """The value of ``flag`` (or its underscore spelling) on the launcher's command line."""
    for i, a in enumerate(argv):
        name, _, given = a.partition("=")
        if name in (flag, flag.replace("-", "_").replace("__", "--")):
            return given or (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def watched(plan: FaultPlan, rec: RunRecord) -> FaultPlan:
    """The plan as the job was watched: with no collective timeout (``watchdog_s``) but the
    progress watchdog on (``--progress-timeout T``), a hang is caught all the same (T seconds
    without a step), so it needs a restart like any failure, and a pause of T or more is a hang."""
    if plan.watchdog_s is not None:
        return plan
    try:
        t = float(launcher_flag(rec.argv, "--progress-timeout") or 0)
    except ValueError:
        return plan
    return replace(plan, watchdog_s=t) if 0 < t <= 1e9 else plan


def fault_rows(plan: FaultPlan, rec: RunRecord, shape: Optional[Shape] = None) -> list[FaultRow]:
    plan = watched(plan, rec)
    rows = []
    for i, f in enumerate(plan.faults):
        inj = next((x for x in rec.injections if x.fault == i), None)
        planned = f"step {f.at_step}" if f.at_step is not None else f"{f.at_s:g}s"
        if inj is None:
            rows.append(FaultRow(i, f.spec, str(f.target), planned, False, plan.needs_restart(f),
                                 why=why_unfired(f, i, rec), attempt=f.attempt))
            continue
        if f.kind in ("kill-agent", "store-outage") and shape is not None:
            fields = nodereport.node_fault(f, inj, rec, shape)
            if fields.get("detected_after") is not None and fields.get("running_after") is not None:
                fields["lost_why"] = ("a killed agent's workers record no step at their end"
                                      if f.kind == "kill-agent" else "no worker records the step it hit")
            rows.append(FaultRow(i, f.spec, str(f.target), planned, True, **fields))
            continue
        if not plan.needs_restart(f):  # a straggler: the failures after it are not its doing
            named = next((e.mono for e in rec.events if e.kind == "straggler" and e.mono >= inj.mono
                          and f.target.kind == "rank" and e.fields.get("rank") == f.target.index), None)
            rows.append(FaultRow(i, f.spec, str(f.target), planned, True, False,
                                 injected_at=inj.mono - rec.started,
                                 detected_after=None if named is None else named - inj.mono))
            continue
        detected = _first(rec, FAILURE_EVENTS, inj.mono)
        running = _first(rec, RUNNING_EVENTS, detected) if detected is not None else None
        restarted = _first_event(rec, RESTART_EVENTS, inj.mono)
        # a failure the job never ran again after (it ended the job) redoes no step
        lost = _lost(rec, i, inj) if running is not None else Lost(None)
        rows.append(FaultRow(
            i, f.spec, str(f.target), planned, True, plan.needs_restart(f), attempt=f.attempt,
            injected_at=inj.mono - rec.started,
            detected_after=None if detected is None else detected - inj.mono,
            running_after=None if running is None else running - inj.mono,
            restarts_used=None if restarted is None else int(restarted.fields.get("restart_count", 0)),
            lost_steps=lost.steps, lost_why=lost.why or None, outcome=None if shape is None else "restart",
            phases_ms=phases.of_restart(rec.events, None if restarted is None else
                                        int(restarted.fields.get("restart_count", 0)))))
    return rows


def _lost(rec: RunRecord, index: int, inj: Any) -> Lost:
    """Steps run again because of fault ``index``, from the workers' records (chaos/lost.py);
    a signal sent from outside hits no recorded step, so its loss is unknown."""
    line = next((d for d in rec.fault_lines if d.get("fault") == index), None)
    if line is None:
        return Lost(None, "a signal from outside: no worker records the step it hit"
                    if inj.how == "outside" else "the fault's record is missing")
    return lost_steps(line, rec.progress, rec.restored)


def restarts_of(rec: RunRecord) -> int:
    """Restarts of the job, restart-all (``restart``) and in-place (``inplace_recovery``) alike:
    both are charged to the budget. Distinct restart counts are counted, not events: every
    agent of a multi-node job logs the same restart, and an in-place recovery that falls back
    to a restart-all logs both under the one charge."""
    return len({e.fields.get("restart_count") for e in rec.events if e.kind in RESTART_EVENTS})


def _first(rec: RunRecord, kinds: tuple[str, ...], after: float) -> Optional[float]:
    return next((e.mono for e in rec.events if e.kind in kinds and e.mono >= after), None)


def _first_event(rec: RunRecord, kinds: tuple[str, ...], after: float) -> Any:
    return next((e for e in rec.events if e.kind in kinds and e.mono >= after), None)


def _attempts(rec: RunRecord) -> int:
    """The highest attempt (restart count) the job reached."""
    counts = [int(e.fields.get("restart_count") or 0) for e in rec.events if e.kind in RESTART_EVENTS]
    counts += [int(p["attempt"]) for p in rec.progress if isinstance(p.get("attempt"), int)]
    return max(counts, default=0)


def why_unfired(f: Any, index: int, rec: RunRecord) -> str:
    """Why fault ``index`` never fired, in a few words, from what the run recorded."""
    stopped = _stopped_before(f, rec)
    if stopped is not None:
        return stopped
    if f.at_s is not None:
        clock = rec.clock if rec.clock is not None else rec.started
        if rec.ended - clock < float(f.at_s):
            return (f"the job ended first: it ended {rec.ended - clock:.1f}s in, the fault was "
                    f"due at {f.at_s:g}s")
        return rec.unfired.get(index) or f"its target {f.target} was not running when it was due"
    target = f.target
    if target.kind == "rank" and rec.ranks_seen and target.index not in rec.ranks_seen:
        return (f"the target rank never existed: the job ran ranks "
                f"{_ranges(sorted(rec.ranks_seen))}")
    if not rec.progress:
        return ("the script reports no steps: no worker called elastictk.faults.fault_point(step), "
                "stepped a torch optimizer or ran run_elastic")
    attempts = _attempts(rec)
    if (f.attempt or 0) > attempts:
        return (f"the step was never reached: it was planned in attempt {f.attempt}, and the job "
                f"ended in attempt {attempts}")
    mine = [p for p in rec.progress if isinstance(p.get("rank"), int) and target.hits(p["rank"], p.get("node"))
            and p.get("attempt") == (f.attempt or 0)]
    if not mine:
        return (f"the step was never reached: no worker of {target} reported a step in attempt "
                f"{f.attempt or 0}")
    last = max((int(p["step"]) for p in mine if isinstance(p.get("step"), int)), default=None)
    sources = sorted({str(p.get("source")) for p in mine})
    return (f"the step was never reached: {target} got to step {last} in attempt "
            f"{f.attempt or 0} (steps counted by {', '.join(sources)})")


def _stopped_before(f: Any, rec: RunRecord) -> Optional[str]:
    """The run was stopped from outside (a signal to elastictk-chaos, or its ``--timeout``)
    before the fault's time or step came: that is why, not the script (which may simply not
    have reached its first step yet)."""
    if not rec.stopped:
        return None
    by = "its --timeout" if rec.stopped == "timeout" else rec.stopped
    clock = rec.clock if rec.clock is not None else rec.started
    where = f"{max(0.0, rec.ended - clock):.1f}s in"
    if f.at_s is not None and rec.ended - clock >= float(f.at_s):
        return None  # due before the stop: its own reason holds
    steps = [int(p["step"]) for p in rec.progress if isinstance(p.get("step"), int)]
    reached = f", at step {max(steps)}" if steps else ", before any worker reported a step"
    return f"the run was interrupted ({by}) {where}{reached}, before the fault was due"


def _ranges(xs: list[int]) -> str:
    return f"{xs[0]}..{xs[-1]}" if xs and xs == list(range(xs[0], xs[-1] + 1)) else \
        ", ".join(map(str, xs))


def episodes(rows: list[FaultRow]) -> int:
    """Failures the job had to restart from: faults that needed a restart, where one that hits
    while the job is still recovering from the previous one (before its workers run again) is
    absorbed by the same restart. Step faults fire only in their own attempt, so each distinct
    attempt among them is one failure (under in-place recovery the next can fire a moment after
    the group re-formed, before the agent logged it)."""
    spent = [r for r in rows if r.fired and r.needs_restart and r.injected_at is not None]
    if spent and all(r.attempt is not None for r in spent):
        return len({r.attempt for r in spent})
    hits = sorted((r.injected_at, None if r.running_after is None else r.injected_at + r.running_after)
                  for r in rows if r.fired and r.needs_restart and r.injected_at is not None)
    count, recovered = 0, None
    for at, back in hits:
        if count and (recovered is None or at <= recovered):
            recovered = back if back is not None and (recovered is None or back > recovered) else recovered
            continue
        count, recovered = count + 1, back
    return count
