"""The chaos report's assembly: which invariants apply to this run, the run's totals, and the
report as JSON (``chaos-report.json``) and as the table printed at the end.

Everything is derived from the run's record (the agent's event log, the workers' fault log, the
job's output), so a report can be rebuilt from the files it was made from. The rows it is built
from are ``rows.py``'s, the invariants ``checks.py``'s, reading a report back ``replay.py``'s.

Goodput here is ``(share of wall time with workers running) x (steps kept / steps run)``:
steps past the last checkpoint before a failure are run twice, and time spent detecting,
restarting and re-forming runs none.
"""
from __future__ import annotations

import statistics
from typing import Any, Optional

from ..faults import FaultPlan
from . import nodereport, phases, samples
from .checks import (
    Check, _common, _detected, _fired, _hangs_caught, _snapshot_check, _stragglers, _unknown_losses, label,
)
from .expect import Shape, expect
from .rows import FAILURE_EVENTS, RUNNING_EVENTS, FaultRow, episodes, restarts_of, watched
from .record import RunRecord

SCHEMA = "elastictk.chaos-report/1"


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
        "store_retries": rec.store_retries,
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
        out += [f"  {line}" for line in tot.get("store_retries", [])]
    elif tot.get("faults_clock_s") is not None:
        out.append(f"planned times count from {tot['faults_clock_s']:.1f}s, when the workers first ran")
    out += [f"  #{r.index} did not fire: {r.why}" for r in rows if not r.fired]
    out += not_judged(tot)
    out.append("")
    out += [f"  [{label(c)}] {c.name}: {c.detail}" for c in checks]
    return "\n".join(out)
