"""The chaos report: per fault, when it hit, when the agent saw it, when training resumed; and
the invariants a correct elastic job keeps under that plan.

Everything is derived from the run's record (the agent's event log, the workers' fault log, the
job's output), so a report can be rebuilt from the files it was made from.

Goodput here is ``(share of wall time with workers running) x (steps kept / steps run)``:
steps past the last checkpoint before a failure are run twice, and time spent detecting,
restarting and re-forming runs none.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..faults import FaultPlan
from . import nodereport, phases, samples
from .lost import Lost, lost_steps
from .expect import Shape, expect
from .runner import RunRecord

SCHEMA = "elastictk.chaos-report/1"
# A watchdog's verdict is the failure's detection: the kill (worker_failed) follows it.
FAILURE_EVENTS = ("worker_failed", "peer_failed", "timer_expired", "hang_detected")
RESTART_EVENTS = ("restart", "inplace_recovery")  # both spend one restart of the budget
RUNNING_EVENTS = ("workers_started", "inplace_recovered")
FIRED = "every planned fault fired"


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


@dataclass(frozen=True)
class Check:
    """One invariant. ``unknown``: not judged, the records cannot tell (a loss no record shows,
    data no loader recorded); it does not pass (``ok`` is False) and reads ``[UNKNOWN]``, not
    ``[BROKEN]``: the job may be right, the run proved nothing about it."""

    name: str
    ok: bool
    detail: str
    unknown: bool = False


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


def snapshot_bound(kind: str, tiers: tuple[str, ...], every: int, overlap: bool = False) -> Optional[int]:
    """The most steps a fault may cost a job committing every step with these snapshot tiers:
    one (the step in flight) while the local tier survives it, ``every`` when only the disk
    tier does (a killed agent takes its node's memory), None when no tier survives it.
    ``overlap`` (pipelined commits): one more, for a fault while the last commit is copied."""
    extra = 1 if overlap else 0
    if "local" in tiers and kind != "kill-agent":
        return 1 + extra
    return every + extra if "disk" in tiers else None


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


def totals(rec: RunRecord, rows: list[FaultRow]) -> dict[str, Any]:
    recov = [r.running_after for r in rows if r.running_after is not None]
    wall = max(1e-9, rec.ended - rec.started)
    running, since = 0.0, None
    for e in rec.events:
        if e.kind in RUNNING_EVENTS and since is None:
            since = e.mono
        elif e.kind in FAILURE_EVENTS + ("workers_stopped", "job_finished", "job_failed") and since is not None:
            running += e.mono - since
            since = None
    if since is not None:
        running += rec.ended - since
    lost = sum(r.lost_steps or 0 for r in rows)
    final = max((int(p["step"]) for p in rec.progress if p.get("progress") == "exit"
                 and isinstance(p.get("step"), int)), default=0)
    kept = final / (final + lost) if final + lost else 1.0
    return {
        "wall_s": wall,
        "exit_code": rec.exit_code,
        "restarts": restarts_of(rec),
        "faults_fired": sum(1 for r in rows if r.fired),
        "faults_planned": len(rows),
        "recovery_mean_s": statistics.fmean(recov) if recov else None,
        "recovery_max_s": max(recov) if recov else None,
        "recovery_phases_ms": phases.medians(rec.events),  # median per phase, of every recovery
        "recoveries_timed": len(phases.of_run(rec.events)),
        "steps_lost": lost,
        "steps_lost_unknown": len(_unknown_losses(rows)),
        "steps_lost_why": next((r.lost_why for r in rows if r.lost_why and r.fired and r.needs_restart
                                and r.lost_steps is None and r.running_after is not None), None),
        "data_judged": bool(rec.data),
        "running_share": min(1.0, running / wall),
        "goodput": min(1.0, running / wall) * kept,
        "checksum": rec.checksum,
        "nodes": rec.nodes,
        "backend": rec.backend,
        "agents": rec.agents,
        "faults_clock_s": None if rec.clock is None else rec.clock - rec.started,
        "stopped": rec.stopped or None,  # "timeout" or a signal name: the job did not end by itself
    }


def check(plan: FaultPlan, rec: RunRecord, rows: list[FaultRow], *, max_restarts: int,
          ckpt_every: Optional[int] = None, expect_checksum: Optional[str] = None,
          shape: Optional[Shape] = None, nproc: int = 1, allow_unfired: bool = False,
          snapshot: tuple[str, ...] = (), snapshot_every: int = 10,
          snapshot_overlap: bool = False) -> list[Check]:
    """The invariants; each names what it found when it fails. The first: every planned fault
    fired (``allow_unfired`` keeps the check but lets it pass; the reasons are still named).
    ``snapshot``/``snapshot_every``: the job's ``--snapshot`` tiers and ``--snapshot-every``."""
    plan = watched(plan, rec)
    beyond = {r.index for r in rows if not r.fired and r.attempt is not None and r.attempt > max_restarts}
    out = [_fired(rows, allow_unfired, beyond, max_restarts)] + _invariants(plan, rec, rows, max_restarts=max_restarts,
                                                      ckpt_every=ckpt_every, expect_checksum=expect_checksum,
                                                      shape=shape, nproc=nproc)
    if snapshot:
        out.append(_snapshot_check(rows, snapshot, snapshot_every, snapshot_overlap))
    if rec.data:  # the job's DataLoader recorded its batches (elastictk/data/record.py)
        verdict = samples.judge(rec.data)
        out.append(Check(samples.NAME, verdict.ok is True, verdict.detail, unknown=verdict.ok is None))
    return out


def _snapshot_check(rows: list[FaultRow], tiers: tuple[str, ...], every: int, overlap: bool = False) -> Check:
    """Steps lost per fault <= the interval of the snapshot tier that survives the fault."""
    unknown = _unknown_losses(rows)
    over: list[str] = []
    for r in rows:
        if r.lost_steps is None:
            continue
        bound = snapshot_bound(r.kind, tiers, every, overlap)
        if bound is None:
            over.append(f"#{r.index} {r.kind} lost {r.lost_steps} step(s): no tier of --snapshot "
                        f"{','.join(tiers)} survives it (the local tier dies with its agent; add disk)")
        elif r.lost_steps > bound:
            over.append(f"#{r.index} {r.kind} lost {r.lost_steps} step(s), more than {bound}: "
                        "was the snapshot restored (state.restore())?")
    worst = max((r.lost_steps or 0 for r in rows), default=0)
    extra = 1 if overlap else 0
    bounds = f"{1 + extra} step(s) (local memory{', pipelined' if overlap else ''})" if "local" in tiers else ""
    if "disk" in tiers:
        bounds += (", " if bounds else "") + f"{every + extra} steps (disk{', a lost agent' if bounds else ''})"
    return Check("steps lost per fault <= the snapshot interval", not (over or unknown),
                 "; ".join(unknown + over) or f"at most {worst} step(s) lost, interval {bounds}",
                 unknown=bool(unknown) and not over)


def _unknown_losses(rows: list[FaultRow]) -> list[str]:
    """Faults that cost a restart and whose lost steps the records cannot tell: a check on
    lost steps does not pass on them (it has no evidence), it names each and why."""
    return [f"#{r.index} {r.kind} lost an unknown number of step(s): {r.lost_why or 'not recorded'}"
            for r in rows if r.fired and r.needs_restart and r.lost_steps is None and r.running_after is not None]


def _fired(rows: list[FaultRow], allow: bool, beyond: Optional[set[int]] = None,
           max_restarts: Optional[int] = None) -> Check:
    """Every planned fault fired. One planned past the restart budget cannot (the job gives up
    before its attempt): it fails the check all the same, naming the budget, since a plan that
    cannot run whole proves less than it says (``--allow-unfired`` lets it pass)."""
    beyond = beyond or set()
    missed = [r for r in rows if not r.fired]
    if not missed:
        return Check(FIRED, True, f"{len(rows)} of {len(rows)} fired")

    def why(r: FaultRow) -> str:
        if r.index not in beyond or max_restarts is None:
            return str(r.why)
        return (f"planned in attempt {r.attempt}, past --max-restarts {max_restarts}: the job gives up "
                f"after {max_restarts + 1} failure(s), so it can never fire; plan at most "
                f"{max_restarts + 1} fault(s) that need a restart, or raise --max-restarts")
    said = "; ".join(f"#{r.index} {r.kind} on {r.target} at {r.planned}: {why(r)}" for r in missed)
    return Check(FIRED, allow, f"{len(missed)} of {len(rows)} did not fire"
                 + (" (allowed by --allow-unfired)" if allow else "") + f": {said}")


def _invariants(plan: FaultPlan, rec: RunRecord, rows: list[FaultRow], *, max_restarts: int,
                ckpt_every: Optional[int], expect_checksum: Optional[str],
                shape: Optional[Shape], nproc: int) -> list[Check]:
    needed = episodes(rows)
    finished = rec.exit_code == 0
    if shape is not None and shape.nodes > 1:
        killed = [int(r.target.split(":")[1]) for r in rows if r.fired and r.kind == "kill-agent"]
        outages = [float(r.kind.split(":", 1)[1]) for r in rows if r.fired and r.kind.startswith("store-outage")]
        exp = expect(shape, needed, killed, outages)
        out = [Check(*c) for c in nodereport.checks(rows, rec, shape, exp, nproc, restarts_of(rec), needed)]
        out.insert(min(2, len(out)), _detected(rows))
        if any(r.fired and r.kind == "hang" for r in rows):
            out.append(_hangs_caught(rows, rec, several_nodes=True))
        return out + _stragglers(rows, rec) + _common(rec, rows, finished, ckpt_every, expect_checksum)
    should = needed <= max_restarts
    out = [Check("finishes iff faults <= max-restarts", finished == should,
                 f"{needed} failure(s) needed a restart, --max-restarts {max_restarts}: the job "
                 f"{'finished' if finished else f'failed (exit {rec.exit_code})'}, expected it to "
                 f"{'finish' if should else 'fail'}")]
    if not finished and not should:
        ok = "restart budget spent" in rec.stderr
        out.append(Check("fails with the budget message", ok,
                         "stderr names the spent budget" if ok else "no 'restart budget spent' in stderr"))
    out.append(_detected(rows))
    restarts = restarts_of(rec)
    want = needed if should else max_restarts
    out.append(Check("restarts counted == failures that needed one", restarts == want,
                     f"{restarts} restart(s) for {want} expected"))
    if any(r.fired and r.kind == "hang" for r in rows):
        out.append(_hangs_caught(rows, rec, several_nodes=False))
    return out + _stragglers(rows, rec) + _common(rec, rows, finished, ckpt_every, expect_checksum)


def _detected(rows: list[FaultRow]) -> Check:
    missed = [f"#{r.index} {r.kind}" for r in rows if r.fired and r.needs_restart and r.detected_after is None]
    return Check("every fault that needed a restart was detected", not missed,
                 ", ".join(missed) + " never seen by the agent" if missed else "all seen")


HANG_CAUGHT = ("timer_expired", "hang_detected")


def _names(event: Any, rank: int) -> bool:
    """Whether a watchdog's event blames ``rank``: a timer names the rank whose collective it
    timed; the progress watchdog names its culprits apart from the ranks blocked on them."""
    if event.kind == "timer_expired":
        return event.fields.get("rank") == rank
    return rank in (event.fields.get("culprits") or [event.fields.get("rank")])


def _hangs_caught(rows: list[FaultRow], rec: RunRecord, several_nodes: bool) -> Check:
    """Every fired ``hang`` was caught by a watchdog (a collective timer or the progress
    watchdog) that named the frozen rank as the culprit. On several nodes each agent judges
    its own ranks, so another node may blame its waiting rank first; there a catch counts."""
    bad, times = [], []
    for r in rows:
        if not (r.fired and r.kind == "hang" and r.injected_at is not None):
            continue
        rank = int(r.target.split(":")[1])
        at = rec.started + r.injected_at
        caught = [e for e in rec.events if e.kind in HANG_CAUGHT and e.mono >= at]
        if not caught:
            bad.append(f"#{r.index} hang of {r.target} never caught by a watchdog")
            continue
        # how long the catch took beside the deadline it was judged against (the learned one
        # under --hang-detection learned, else the timer's or --progress-timeout)
        deadline = caught[0].fields.get("timeout_s")
        times.append(f"#{r.index} in {caught[0].mono - at:.1f}s" + (
            f" ({caught[0].fields.get('trigger')} deadline {float(deadline):.1f}s)"
            if isinstance(deadline, (int, float)) and deadline > 0 else ""))
        # Every catch of this incident counts, up to the workers running again: a frozen rank
        # blocks its peers inside the same collective, so their timers expire together and the
        # waiting rank's may be logged first.
        back = _first(rec, RUNNING_EVENTS, caught[0].mono)
        incident = [e for e in caught if back is None or e.mono <= back]
        if not several_nodes and not any(_names(e, rank) for e in incident):
            bad.append(f"#{r.index} hang of {r.target}: the watchdog blamed "
                       f"{caught[0].fields.get('culprits', caught[0].fields.get('rank'))}")
    return Check("every hang caught, its rank named", not bad,
                 "; ".join(bad) or "all caught: " + ", ".join(times))


def straggler_settings(argv: list[str]) -> Optional[tuple[float, int]]:
    """``(interval, windows)`` of a run launched with ``--straggler-action report``; None when
    the run did not look for stragglers (the launcher's defaults otherwise: 5 s, 3)."""
    def value(flag: str) -> Optional[str]:
        return launcher_flag(argv, flag)
    if value("--straggler-action") != "report":
        return None
    try:
        return float(value("--straggler-interval") or 5), int(value("--straggler-windows") or 3)
    except ValueError:
        return None


def _stragglers(rows: list[FaultRow], rec: RunRecord) -> list[Check]:
    """With ``--straggler-action report``: every fired ``slow:<s>`` of a rank is named (a
    ``straggler`` event for that rank) within ``s + (windows + 2) x interval`` of the fault,
    and no rank that no ``slow`` fault hit is ever named (a fault-free run names none). A fault
    whose bound reaches past the job's end is not judged (its window never closed), and says so."""
    settings = straggler_settings(rec.argv)
    if settings is None:
        return []
    interval, windows = settings
    named = [e for e in rec.events if e.kind == "straggler"]
    slowed: set[int] = set()
    bad: list[str] = []
    unjudged: list[str] = []
    for r in rows:
        if not (r.fired and r.kind.startswith("slow") and r.target.startswith("rank:")
                and r.injected_at is not None):
            continue
        rank = int(r.target.split(":")[1])
        slowed.add(rank)
        at = rec.started + r.injected_at
        bound = float(r.kind.partition(":")[2] or 0) + (windows + 2) * interval
        hit = [e for e in named if e.fields.get("rank") == rank and at <= e.mono <= at + bound]
        if hit:
            continue
        if at + bound > rec.ended:  # the job ended inside the bound: its last window never closed
            unjudged.append(f"#{r.index}")
        else:
            bad.append(f"#{r.index} {r.kind} of {r.target} not named a straggler within {bound:g}s")
    wrong = sorted({e.fields.get("rank") for e in named} - slowed, key=str)
    if wrong:
        bad.append(f"rank(s) {', '.join(map(str, wrong))} named a straggler but no slow fault hit them")
    late = f" ({', '.join(unjudged)} not judged: the job ended within its bound)" if unjudged else ""
    return [Check("every slow rank named a straggler, no other", not bad,
                  ("; ".join(bad) or f"{len(slowed)} slow rank(s) named, no other") + late)]


def _common(rec: RunRecord, rows: list[FaultRow], finished: bool, ckpt_every: Optional[int],
            expect_checksum: Optional[str]) -> list[Check]:
    out: list[Check] = []
    out.append(Check("no process of the job outlives the run", not rec.leaked_processes,
                     "; ".join(rec.leaked_processes) or f"{len(rec.pids)} process(es) checked"))
    out.append(Check("no leaked shared memory or listening port", not rec.leaked_shm and not rec.leaked_ports,
                     ", ".join(rec.leaked_shm + rec.leaked_ports) or "/dev/shm and listening ports as before"))
    if ckpt_every is not None:
        worst = max((r.lost_steps or 0 for r in rows), default=0)
        unknown = _unknown_losses(rows)
        over = [f"#{r.index} {r.kind} lost {r.lost_steps} step(s)" for r in rows
                if r.lost_steps is not None and r.lost_steps > ckpt_every]
        bad = unknown + over
        out.append(Check("progress lost per fault <= checkpoint interval", not bad,
                         ("; ".join(bad) + f" (interval {ckpt_every})") if bad else
                         f"at most {worst} step(s) lost, interval {ckpt_every}",
                         unknown=bool(unknown) and not over))
    if expect_checksum is not None and finished:
        out.append(Check("result equals the fault-free run's", rec.checksum == expect_checksum,
                         f"checksum {rec.checksum} vs fault-free {expect_checksum}"))
    return out


def to_json(plan: FaultPlan, rec: RunRecord, rows: list[FaultRow], checks: list[Check],
            launcher_flags: list[str], command: list[str],
            multinode: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The report as JSON; ``multinode`` (nodes, backend, rejoin_s) is what ``--replay`` needs
    to start the same cluster again, and ``agents`` what each agent process did."""
    d = {
        "schema": SCHEMA, "plan": plan.to_json(), "launcher_flags": launcher_flags,
        "command": command, "faults": [r.__dict__ for r in rows],
        "injections": [i.to_json() for i in rec.injections],
        "totals": totals(rec, rows), "checks": [c.__dict__ for c in checks],
    }
    if multinode is not None:
        d["multinode"] = multinode
        d["agents"] = rec.agents
        d["rejoins"] = [{"at": t - rec.started, "node": n} for t, n in rec.rejoins]
    return d


def replay_multinode(path: str, max_nodes: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The multi-node options of an earlier report, or None for a single-node one.

    ``nodes`` comes back an int >= 1 (and <= ``max_nodes``) and ``rejoin_s`` None or seconds >= 0;
    a report that holds anything else raises :class:`~elastictk.faults.PlanError` naming the
    field (call :func:`load_replay` first: it reports a missing or unreadable file)."""
    from ..faults import PlanError

    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    m = d.get("multinode") if isinstance(d, dict) else None
    if m is None:
        return None
    fix = "pass the chaos-report.json an elastictk-chaos run wrote, or fix that field"
    if not isinstance(m, dict):
        raise PlanError(f"{path}: multinode is {_kind(m)}, not an object; {fix}")
    nodes = m.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise PlanError(f"{path}: multinode.nodes is {_shown(nodes)}, not a whole number >= 1; {fix}")
    if max_nodes is not None and nodes > max_nodes:
        raise PlanError(f"{path}: multinode.nodes is {nodes}, more than {max_nodes} (each node is an agent "
                        f"process on this machine); {fix}")
    rejoin = m.get("rejoin_s")
    if rejoin is not None and (isinstance(rejoin, bool) or not isinstance(rejoin, (int, float))
                               or not 0 <= rejoin < float("inf")):
        raise PlanError(f"{path}: multinode.rejoin_s is {_shown(rejoin)}, not null or seconds >= 0; {fix}")
    return {**m, "nodes": nodes, "rejoin_s": None if rejoin is None else float(rejoin)}


def _kind(x: Any) -> str:
    """How a report field's JSON type is named in an error line."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(x), type(x).__name__)


def _shown(x: Any) -> str:
    """A report field's value for an error line: short, on one line."""
    text = json.dumps(x)
    return f"{_kind(x)} {text if len(text) <= 40 else text[:37] + '...'}"


def _strings(d: dict[str, Any], key: str, path: str) -> list[str]:
    """``d[key]``, a list of strings (absent: empty), or a PlanError naming the field."""
    from ..faults import PlanError

    value = d.get(key, [])
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        bad = value if not isinstance(value, list) else next(x for x in value if not isinstance(x, str))
        what = f"is {_shown(value)}" if not isinstance(value, list) else f"holds {_shown(bad)}"
        raise PlanError(f"{path}: {key} {what}, not a list of strings; pass the chaos-report.json an "
                        "elastictk-chaos run wrote, or fix that field")
    return value


def load_replay(path: str) -> tuple[FaultPlan, list[str], list[str]]:
    """The plan, launcher flags and command of an earlier report (``--replay``)."""
    from ..faults import PlanError

    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except OSError as e:
        raise PlanError(f"{path}: cannot read the chaos report: {e.strerror or e}") from None
    except ValueError as e:
        raise PlanError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise PlanError(f"{path}: not an elastictk chaos report (schema {SCHEMA!r}); pass the "
                        "chaos-report.json an elastictk-chaos run wrote")
    return (FaultPlan.from_json(d.get("plan"), f"{path}: plan"),
            _strings(d, "launcher_flags", path), _strings(d, "command", path))


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}s"


def _lost_cell(r: FaultRow) -> str:
    if r.lost_steps is not None:
        return str(r.lost_steps)
    return "unknown" if r.fired and r.needs_restart and r.running_after is not None else "-"


DATA_NOT_JUDGED = ("exactly-once data not judged: no worker recorded the batches it trained (only "
                   "elastictk.data.DataLoader over an ElasticSampler or DistributedSampler records "
                   "them, docs/data.md)")


def not_judged(tot: dict[str, Any]) -> list[str]:
    """One line each for what the records cannot judge, and why: steps lost (a script that keeps
    no elastictk.State), the data (no recording loader). No check passes on them; a check asked
    for on them fails with the same reason."""
    out = []
    if tot.get("steps_lost_unknown"):
        out.append(f"  steps lost not judged for {tot['steps_lost_unknown']} fault(s): "
                   f"{tot.get('steps_lost_why') or 'not recorded'}")
    if tot.get("data_judged") is False:
        out.append(f"  {DATA_NOT_JUDGED}")
    return out


def label(c: Check) -> str:
    """``ok``, ``UNKNOWN`` (not judged, does not pass) or ``BROKEN``."""
    return "ok" if c.ok else "UNKNOWN" if c.unknown else "BROKEN"


def render(rows: list[FaultRow], tot: dict[str, Any], checks: list[Check]) -> str:
    # "fault to ...": from the injection, on the runner's clock; not the recovery's "detect"
    # phase (the worker's exit to the agent acting on it), which has its own column.
    head: tuple[str, ...] = ("#", "kind", "target", "planned", "injected at", "fault to detection",
                             "fault to running", "restarts used", "steps lost")
    body: list[tuple[str, ...]] = [(str(r.index), r.kind, r.target, r.planned,
             _s(r.injected_at) if r.fired else "never fired", _s(r.detected_after),
             _s(r.running_after), "-" if r.restarts_used is None else str(r.restarts_used),
             _lost_cell(r)) for r in rows]
    if any(r.outcome is not None for r in rows):
        head += ("outcome",)
        body = [b + ((r.outcome or "-") if r.fired else "-",) for b, r in zip(body, rows)]
    extra, cells = phases.columns([r.phases_ms for r in rows])
    head, body = head + extra, [b + c for b, c in zip(body, cells)]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    planned, fired = tot.get("faults_planned", len(rows)), tot["faults_fired"]
    out = [f"{planned} fault(s) planned, {fired} fired" + ("" if fired == planned else
           f", {planned - fired} did not fire"), "",
           line(head), line(tuple("-" * w for w in widths)), *(line(b) for b in body), ""]
    mean, mx = tot["recovery_mean_s"], tot["recovery_max_s"]
    unknown = f", {tot['steps_lost_unknown']} fault(s) unknown" if tot.get("steps_lost_unknown") else ""
    out.append(f"exit {tot['exit_code']} after {tot['wall_s']:.1f}s; {tot['faults_fired']} fault(s) fired, "
               f"{tot['restarts']} restart(s); recovery mean {_s(mean)}, max {_s(mx)}; "
               f"goodput {tot['goodput']:.2f} (workers running {tot['running_share']:.0%} of the time, "
               f"{tot['steps_lost']} step(s) redone{unknown})"
               + (f"; checksum {tot['checksum']}" if tot["checksum"] else ""))
    timed = phases.line(tot)
    if timed is not None:
        out.append(timed)
    if tot.get("nodes", 1) > 1:
        out.append(f"{tot['nodes']} node(s) over {tot['backend']}: " + "; ".join(
            f"node {a['node']}" + (f" (rejoined, agent {a['agent']})" if a["agent"] else "") +
            f" pid {a['pid']} " + ("killed" if a["killed"] else f"exit {a['exit']}") for a in tot["agents"])
            + ("" if tot["faults_clock_s"] is None else
               f"; planned times count from {tot['faults_clock_s']:.1f}s, when every node ran workers"))
    elif tot.get("faults_clock_s") is not None:
        out.append(f"planned times count from {tot['faults_clock_s']:.1f}s, when the workers first ran")
    out += [f"  #{r.index} did not fire: {r.why}" for r in rows if not r.fired]
    out += not_judged(tot)
    out.append("")
    out += [f"  [{label(c)}] {c.name}: {c.detail}" for c in checks]
    return "\n".join(out)
