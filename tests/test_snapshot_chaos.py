"""elastictk-chaos judges runs with ``--snapshot``: steps lost per fault <= the snapshot interval.

A real chaos run (2 gloo workers, a State script that restores, rank 1 SIGKILLed) keeps the
invariant with the local tier; the same run with a script that ignores ``restore()`` breaks it,
naming the fault and the steps. Multi-node ``kill-agent`` faults are judged against the tier
that survives a lost agent (disk), from a run record built here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from elastictk.chaos import checks as cchecks
from elastictk.chaos import rows as crows
from elastictk.chaos.expect import Shape
from elastictk.chaos.record import Injection, RunRecord
from elastictk.faults import Fault, plan_of
from elastictk.metrics.events import Event

JOB = r'''
import os
import torch, torch.distributed as dist
from elastictk import State

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = State(model=model, optimizer=opt, step=0)
if not os.environ.get("NO_RESTORE"):               # the control: a script that ignores restore()
    state.restore()
while state.step < 10:
    opt.zero_grad()
    model(torch.ones(2, 4) * state.step).pow(2).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    state.step += 1
    state.commit()
    print(f"[rank {rank}] step {state.step}", flush=True)
'''
NAME = "steps lost per fault <= the snapshot interval"


def chaos(tmp: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], dict]:
    script = tmp / "job.py"
    script.write_text(JOB)
    plan_of([Fault.of("sigkill", "rank:1", at_step=5)]).save(tmp / "plan.json")
    r = subprocess.run([sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp / "r"),
                        "--plan", "plan.json", "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", "1", "--snapshot", "local", "--", str(script)],
                       cwd=tmp, capture_output=True, text=True, timeout=180, env={**os.environ, **env})
    return r, json.loads((tmp / "r" / "chaos-report.json").read_text())


def verdict(data: dict) -> dict:
    return next(c for c in data["checks"] if c["name"] == NAME)


@pytest.mark.parametrize("restores", [True, False], ids=["restores", "ignores-restore"])
def test_a_chaos_run_with_snapshots_judges_steps_lost_against_the_interval(
        tmp_path: Path, restores: bool) -> None:
    r, data = chaos(tmp_path, {} if restores else {"NO_RESTORE": "1"})
    (fault,) = data["faults"]
    assert fault["fired"], r.stdout + r.stderr[-3000:]
    if restores:
        assert fault["lost_steps"] is not None, r.stdout + r.stderr[-3000:]
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        assert fault["lost_steps"] <= 1 and verdict(data)["ok"], data["checks"]
        assert f"[ok] {NAME}" in r.stdout
    else:
        assert r.returncode == 1, r.stdout + r.stderr[-3000:]
        # No restore() recorded where the new process resumed, and optimizer counts start at 0
        # in every process: the loss is unknown, and an unknown loss turns the check red.
        assert fault["lost_steps"] is None and not verdict(data)["ok"], (fault, data["checks"])
        assert "#0 sigkill lost an unknown number of step(s)" in verdict(data)["detail"]


def test_the_bound_is_that_of_the_tier_that_survives_the_fault() -> None:
    assert cchecks.snapshot_bound("sigkill", ("local",), 10) == 1
    assert cchecks.snapshot_bound("sigkill", ("disk",), 10) == 10
    assert cchecks.snapshot_bound("kill-agent", ("local", "disk"), 5) == 5  # memory died with it
    assert cchecks.snapshot_bound("kill-agent", ("local",), 5) is None
    assert cchecks.snapshot_bound("sigkill", ("local",), 10, overlap=True) == 2  # a fault mid-copy
    assert cchecks.snapshot_bound("kill-agent", ("local", "disk"), 5, overlap=True) == 6


def _kill_agent_run(resumed_at: int) -> tuple[RunRecord, list[crows.FaultRow]]:
    """Two nodes; node 1's agent killed at t=3 after step 8; node 0's workers fail in a collective
    and every worker starts again at t=5, printing ``resumed_at + 1`` first."""
    plan = plan_of([Fault.of("kill-agent", "node:1", at_s=3.0)])
    ev = [Event("workers_started", {"node": 0, "restart_count": 0}, mono=1.0),
          Event("workers_started", {"node": 1, "restart_count": 0}, mono=1.0),
          Event("worker_failed", {"node": 0}, mono=3.5),
          Event("restart", {"node": 0, "restart_count": 1}, mono=3.6),
          Event("workers_started", {"node": 0, "restart_count": 1}, mono=5.0)]
    rec = RunRecord(argv=[], started=0.0, ended=9.0, exit_code=0, events=ev, nodes=2,
                    injections=[Injection(0, "kill-agent", "node:1", 3.0, None, how="outside")],
                    steps=[(2.0, 7), (2.9, 8), (5.5, resumed_at + 1), (6.0, resumed_at + 2)])
    rows = crows.fault_rows(plan, rec, Shape(2, 1, "c10d", 3, 10.0, rejoin=True))
    return rec, rows


def test_kill_agent_faults_lose_an_unknown_number_of_steps_and_fail_the_check() -> None:
    """A killed agent's workers die with it and record no step: what the job printed ("step N"
    lines) is no evidence, so the loss is unknown and the check does not pass on it."""
    for resumed_at in (5, 0):
        rec, rows = _kill_agent_run(resumed_at=resumed_at)
        assert rows[0].outcome == "restart" and rows[0].lost_steps is None
        bad = cchecks._snapshot_check(rows, ("local", "disk"), 5)
        assert not bad.ok and "#0 kill-agent lost an unknown number of step(s)" in bad.detail
