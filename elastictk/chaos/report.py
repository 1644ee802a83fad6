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
from dataclasses import dataclass
from typing import Any, Optional

from ..faults import FaultPlan
from . import nodereport
from .expect import Shape, expect
from .runner import RunRecord

SCHEMA = "elastictk.chaos-report/1"
FAILURE_EVENTS = ("worker_failed", "peer_failed", "timer_expired")


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


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def fault_rows(plan: FaultPlan, rec: RunRecord, shape: Optional[Shape] = None) -> list[FaultRow]:
    rows = []
    for i, f in enumerate(plan.faults):
        inj = next((x for x in rec.injections if x.fault == i), None)
        planned = f"step {f.at_step}" if f.at_step is not None else f"{f.at_s:g}s"
        if inj is None:
            rows.append(FaultRow(i, f.spec, str(f.target), planned, False, plan.needs_restart(f)))
            continue
        if f.kind in ("kill-agent", "store-outage") and shape is not None:
            rows.append(FaultRow(i, f.spec, str(f.target), planned, True,
                                 **nodereport.node_fault(f, inj, rec, shape)))
            continue
        if not plan.needs_restart(f):  # a straggler: the failures after it are not its doing
            rows.append(FaultRow(i, f.spec, str(f.target), planned, True, False,
                                 injected_at=inj.mono - rec.started))
            continue
        detected = _first(rec, FAILURE_EVENTS, inj.mono)
        running = _first(rec, ("workers_started",), detected) if detected is not None else None
        restarted = _first_event(rec, "restart", inj.mono)
        lost = None
        if detected is not None and running is not None:
            before = [s for t, s in rec.steps if t <= detected]
            after = [s for t, s in rec.steps if t >= running]
            if before and after:
                lost = max(0, max(before) - (min(after) - 1))
        rows.append(FaultRow(
            i, f.spec, str(f.target), planned, True, plan.needs_restart(f),
            injected_at=inj.mono - rec.started,
            detected_after=None if detected is None else detected - inj.mono,
            running_after=None if running is None else running - inj.mono,
            restarts_used=None if restarted is None else int(restarted.fields.get("restart_count", 0)),
            lost_steps=lost, outcome=None if shape is None else "restart"))
    return rows


def restarts_of(rec: RunRecord) -> int:
    """Restarts of the job: every agent of a multi-node job logs the same restart, so distinct
    restart counts are counted, not events."""
    found = [e.fields.get("restart_count") for e in rec.events if e.kind == "restart"]
    return len(set(found)) if rec.nodes > 1 else len(found)


def _first(rec: RunRecord, kinds: tuple[str, ...], after: float) -> Optional[float]:
    return next((e.mono for e in rec.events if e.kind in kinds and e.mono >= after), None)


def _first_event(rec: RunRecord, kind: str, after: float) -> Any:
    return next((e for e in rec.events if e.kind == kind and e.mono >= after), None)


def episodes(rows: list[FaultRow]) -> int:
    """Failures the job had to restart from: faults that needed a restart, where one that hits
    while the job is still recovering from the previous one (before its workers run again) is
    absorbed by the same restart."""
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
        if e.kind == "workers_started" and since is None:
            since = e.mono
        elif e.kind in FAILURE_EVENTS + ("workers_stopped", "job_finished", "job_failed") and since is not None:
            running += e.mono - since
            since = None
    if since is not None:
        running += rec.ended - since
    lost = sum(r.lost_steps or 0 for r in rows)
    final = max((s for _, s in rec.steps), default=0)
    kept = final / (final + lost) if final + lost else 1.0
    return {
        "wall_s": wall,
        "exit_code": rec.exit_code,
        "restarts": restarts_of(rec),
        "faults_fired": sum(1 for r in rows if r.fired),
        "recovery_mean_s": statistics.fmean(recov) if recov else None,
        "recovery_max_s": max(recov) if recov else None,
        "steps_lost": lost,
        "running_share": min(1.0, running / wall),
        "goodput": min(1.0, running / wall) * kept,
        "checksum": rec.checksum,
        "nodes": rec.nodes,
        "backend": rec.backend,
        "agents": rec.agents,
        "faults_clock_s": None if rec.clock is None else rec.clock - rec.started,
    }


def check(plan: FaultPlan, rec: RunRecord, rows: list[FaultRow], *, max_restarts: int,
          ckpt_every: Optional[int] = None, expect_checksum: Optional[str] = None,
          shape: Optional[Shape] = None, nproc: int = 1) -> list[Check]:
    """The invariants; each names what it found when it fails."""
    needed = episodes(rows)
    finished = rec.exit_code == 0
    if shape is not None and shape.nodes > 1:
        killed = [int(r.target.split(":")[1]) for r in rows if r.fired and r.kind == "kill-agent"]
        outages = [float(r.kind.split(":", 1)[1]) for r in rows if r.fired and r.kind.startswith("store-outage")]
        exp = expect(shape, needed, killed, outages)
        out = [Check(*c) for c in nodereport.checks(rows, rec, shape, exp, nproc, restarts_of(rec), needed)]
        out.insert(min(2, len(out)), _detected(rows))
        return out + _common(rec, rows, finished, ckpt_every, expect_checksum)
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
    return out + _common(rec, rows, finished, ckpt_every, expect_checksum)


def _detected(rows: list[FaultRow]) -> Check:
    missed = [f"#{r.index} {r.kind}" for r in rows if r.fired and r.needs_restart and r.detected_after is None]
    return Check("every fault that needed a restart was detected", not missed,
                 ", ".join(missed) + " never seen by the agent" if missed else "all seen")


def _common(rec: RunRecord, rows: list[FaultRow], finished: bool, ckpt_every: Optional[int],
            expect_checksum: Optional[str]) -> list[Check]:
    out: list[Check] = []
    out.append(Check("no process of the job outlives the run", not rec.leaked_processes,
                     "; ".join(rec.leaked_processes) or f"{len(rec.pids)} process(es) checked"))
    out.append(Check("no leaked shared memory or listening port", not rec.leaked_shm and not rec.leaked_ports,
                     ", ".join(rec.leaked_shm + rec.leaked_ports) or "/dev/shm and listening ports as before"))
    if ckpt_every is not None:
        worst = max((r.lost_steps or 0 for r in rows), default=0)
        out.append(Check("progress lost per fault <= checkpoint interval", worst <= ckpt_every,
                         f"at most {worst} step(s) lost, interval {ckpt_every}"))
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


def replay_multinode(path: str) -> Optional[dict[str, Any]]:
    """The multi-node options of an earlier report, or None for a single-node one."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    m = d.get("multinode") if isinstance(d, dict) else None
    return m if isinstance(m, dict) else None


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
            [str(x) for x in d.get("launcher_flags", [])], [str(x) for x in d.get("command", [])])


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}s"


def render(rows: list[FaultRow], tot: dict[str, Any], checks: list[Check]) -> str:
    head: tuple[str, ...] = ("#", "kind", "target", "planned", "injected at", "detected after",
                             "running again after", "restarts used", "steps lost")
    body = [(str(r.index), r.kind, r.target, r.planned,
             _s(r.injected_at) if r.fired else "never fired", _s(r.detected_after),
             _s(r.running_after), "-" if r.restarts_used is None else str(r.restarts_used),
             "-" if r.lost_steps is None else str(r.lost_steps)) for r in rows]
    if any(r.outcome is not None for r in rows):
        head += ("outcome",)
        body = [b + ((r.outcome or "-") if r.fired else "-",) for b, r in zip(body, rows)]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(tuple("-" * w for w in widths)), *(line(b) for b in body), ""]
    mean, mx = tot["recovery_mean_s"], tot["recovery_max_s"]
    out.append(f"exit {tot['exit_code']} after {tot['wall_s']:.1f}s; {tot['faults_fired']} fault(s) fired, "
               f"{tot['restarts']} restart(s); recovery mean {_s(mean)}, max {_s(mx)}; "
               f"goodput {tot['goodput']:.2f} (workers running {tot['running_share']:.0%} of the time, "
               f"{tot['steps_lost']} step(s) redone)" + (f"; checksum {tot['checksum']}" if tot["checksum"] else ""))
    if tot.get("nodes", 1) > 1:
        out.append(f"{tot['nodes']} node(s) over {tot['backend']}: " + "; ".join(
            f"node {a['node']}" + (f" (rejoined, agent {a['agent']})" if a["agent"] else "") +
            f" pid {a['pid']} " + ("killed" if a["killed"] else f"exit {a['exit']}") for a in tot["agents"])
            + ("" if tot["faults_clock_s"] is None else
               f"; planned times count from {tot['faults_clock_s']:.1f}s, when every node ran workers"))
    out.append("")
    out += [f"  [{'ok' if c.ok else 'BROKEN'}] {c.name}: {c.detail}" for c in checks]
    return "\n".join(out)
