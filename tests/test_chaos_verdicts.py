"""Chaos goes red only for the job's reasons, and says what it could not judge.

In-process verdicts over hand-made records (the end-to-end sides run in test_chaos.py and the
quickstart test of test_docs.py): an interrupted run names the interruption, not the script;
a fault planned past the restart budget fails "every planned fault fired"; the second of two
kill-agent faults 0.7 s apart is a victim, not a survivor that never noticed; a plan that
leaves fewer nodes than --nnodes MIN says what the job waits for; unknown losses and unjudged
data are one line each.
"""
from __future__ import annotations

import dataclasses
from typing import Any
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from elastictk.chaos import checks as cchecks
from elastictk.chaos import report as creport
from elastictk.chaos import rows as crows
from elastictk.chaos.expect import Shape, short_of_nodes
from elastictk.chaos.record import Injection, RunRecord
from elastictk.faults import Fault, plan_of
from elastictk.metrics.events import Event


def test_an_interrupted_run_says_interrupted_not_that_the_script_reports_no_steps() -> None:
    step = Fault.of("sigkill", "rank:0", at_step=30)
    rec = RunRecord(argv=[], started=0.0, ended=3.0, stopped="SIGINT", clock=1.0)
    why = crows.why_unfired(step, 0, rec)
    assert why.startswith("the run was interrupted (SIGINT) 2.0s in, before any worker reported a step"), why
    rec.progress = [{"progress": "first", "source": "auto", "step": 4, "rank": 0, "attempt": 0}]
    assert "at step 4" in crows.why_unfired(step, 0, rec)
    timed = Fault.of("sigkill", "rank:0", at_s=10)
    assert "interrupted (its --timeout)" in crows.why_unfired(
        timed, 0, RunRecord(argv=[], started=0.0, ended=5.0, stopped="timeout"))
    # not stopped: the script's own reason, as before
    assert "reports no steps" in crows.why_unfired(step, 0, RunRecord(argv=[], started=0.0, ended=3.0))


def _rows(fired: list[bool], attempts: list[int]) -> list[crows.FaultRow]:
    return [crows.FaultRow(i, "sigkill", "rank:1", f"step {3 * i}", f, True, attempt=a,
                             why=None if f else f"the step was never reached: planned in attempt {a}")
            for i, (f, a) in enumerate(zip(fired, attempts))]


def test_a_fault_planned_past_the_budget_fails_the_fired_check_naming_the_budget() -> None:
    rows = _rows([True, True, False], [0, 1, 2])
    got = cchecks._fired(rows, False, {2}, max_restarts=1)
    assert not got.ok and "past --max-restarts 1" in got.detail and "plan at most 2" in got.detail
    assert cchecks._fired(rows, True, {2}, max_restarts=1).ok  # --allow-unfired
    assert cchecks._fired(_rows([True, True], [0, 1]), False, set(), max_restarts=1).ok


def _three_nodes(second_kill: float) -> tuple[RunRecord, Shape, object]:
    """Three nodes over etcd; node 1's agent killed at 10.0 s, node 2's at ``second_kill``;
    node 0 re-forms alone at 12.0 s and finishes."""
    plan = plan_of([Fault.of("kill-agent", "node:1", at_s=9), Fault.of("kill-agent", "node:2", at_s=9.7)])
    ev = [Event("workers_started", {"node": n, "restart_count": 0, "world_size": 3}, mono=1.0) for n in range(3)]
    ev += [Event("membership_changed", {"node": 0}, mono=12.0),
           Event("workers_started", {"node": 0, "restart_count": 0, "world_size": 1}, mono=13.0),
           Event("job_finished", {"node": 0}, mono=20.0)]
    rec = RunRecord(argv=[], started=0.0, ended=21.0, exit_code=0, events=ev, nodes=3, backend="etcd",
                    injections=[Injection(0, "kill-agent", "node:1", 10.0, 101),
                                Injection(1, "kill-agent", "node:2", second_kill, 102)])
    return rec, Shape(3, 1, "etcd", 3, 5.0), plan


SEEN = "each lost node is seen by every survivor, and they re-form without it"


def test_the_second_of_two_close_agent_kills_is_a_victim_not_a_deaf_survivor() -> None:
    rec, shape, plan = _three_nodes(10.7)
    rows = crows.fault_rows(plan, rec, shape)  # type: ignore[arg-type]
    checks = {c.name: c for c in creport.check(plan, rec, rows, max_restarts=3, shape=shape)}  # type: ignore[arg-type]
    assert checks[SEEN].ok, checks[SEEN].detail
    # killed long after it had to notice (first reaction 12.0 + heartbeat timeout 5): deaf, named
    rec, shape, plan = _three_nodes(30.0)
    rec.events.insert(3, Event("workers_stopped", {"node": 2}, mono=29.0))
    rows = crows.fault_rows(plan, rec, shape)  # type: ignore[arg-type]
    checks = {c.name: c for c in creport.check(plan, rec, rows, max_restarts=3, shape=shape)}  # type: ignore[arg-type]
    assert not checks[SEEN].ok and "node(s) 2 never noticed" in checks[SEEN].detail, checks[SEEN].detail


@given(nodes=st.integers(1, 8), min_nodes=st.integers(1, 8), killed=st.lists(st.integers(0, 7), max_size=8),
       rejoin=st.booleans(), join=st.floats(1, 1e4))
def test_a_plan_short_of_nodes_says_what_the_job_waits_for(nodes: int, min_nodes: int, killed: list[int],
                                                            rejoin: bool, join: float) -> None:
    killed = [k for k in killed if k < nodes]
    line = short_of_nodes(Shape(nodes, min_nodes, "etcd", 3, 5.0, rejoin), killed, join)
    short = not rejoin and bool(killed) and nodes - len(set(killed)) < min_nodes
    assert (line is not None) == short
    if line is not None:
        assert f"join timeout ({join:g}s)" in line and f"--nnodes min {min_nodes}" in line
        assert "\n" not in line


def test_what_could_not_be_judged_is_one_line_each() -> None:
    row = crows.FaultRow(0, "sigkill", "rank:1", "step 2", True, True, injected_at=1.0, detected_after=0.1,
                           running_after=0.2, lost_why="rank 1 recorded no State.restore() in attempt 1")
    tot = {"faults_planned": 1, "faults_fired": 1, "exit_code": 0, "wall_s": 3.0, "restarts": 1,
           "recovery_mean_s": 0.2, "recovery_max_s": 0.2, "goodput": 0.5, "running_share": 0.5,
           "steps_lost": 0, "steps_lost_unknown": 1, "checksum": None,
           "steps_lost_why": row.lost_why, "data_judged": False}
    text = creport.render([row], tot, [])
    lines = [x for x in text.splitlines() if "not judged" in x]
    assert lines == ["  steps lost not judged for 1 fault(s): rank 1 recorded no State.restore() in attempt 1",
                     f"  {creport.DATA_NOT_JUDGED}"], text
    tot.update(steps_lost_unknown=0, data_judged=True)
    assert "not judged" not in creport.render([row], tot, [])


class _Ran(Exception):
    """Raised by the stand-in runner: the run would have started here."""


def test_chaos_says_before_the_run_that_the_job_will_wait_for_nodes(tmp_path: Path, monkeypatch: Any,
                                                                    capsys: Any) -> None:
    """The line is printed before any agent starts (the runner is replaced: nothing runs);
    a plan that leaves enough nodes prints none."""
    from elastictk.chaos import cli

    def not_run(*args: object, **kwargs: object) -> None:
        raise _Ran()

    monkeypatch.setattr(cli, "run_nodes", not_run)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for killed, said in (([1, 2], True), ([2], False)):
        plan_of([Fault.of("kill-agent", f"node:{n}", at_s=1 + n) for n in killed]).save(tmp_path / "p.json")
        try:
            cli._main(["--report-dir", str(tmp_path / "r"), "--plan", "p.json", "--nodes", "3", "--nnodes", "2:3",
                       "--nproc-per-node", "1", "--rdzv-conf", "join_timeout=45", "--", "train.py"])
        except _Ran:
            pass
        err = capsys.readouterr().err
        line = [x for x in err.splitlines() if "fewer than --nnodes min" in x]
        assert len(line) == int(said), err
        if said:
            assert "kills node(s) 1, 2 with no --rejoin: 1 node(s) will be left" in line[0]
            assert "join timeout (45s)" in line[0], line[0]


def test_a_check_the_records_cannot_judge_reads_unknown_and_does_not_pass() -> None:
    """An unknown loss fails the checkpoint check as [UNKNOWN]; a loss over the interval beside
    it is [BROKEN] (a real failure outranks not knowing)."""
    plan = plan_of([Fault.of("sigkill", "rank:1", at_step=2), Fault.of("sigkill", "rank:1", at_step=5)])
    rows = [crows.FaultRow(i, "sigkill", "rank:1", f"step {s}", True, True, injected_at=1.0 + i,
                             detected_after=0.1, running_after=0.2, lost_steps=lost, lost_why=why)
            for i, (s, lost, why) in enumerate([(2, None, "no State.restore()"), (5, 1, None)])]
    rec = RunRecord(argv=[], started=0.0, ended=9.0, exit_code=0)
    ckpt = next(c for c in creport.check(plan, rec, rows, max_restarts=3, ckpt_every=1)
                if c.name.startswith("progress lost"))
    assert not ckpt.ok and ckpt.unknown and cchecks.label(ckpt) == "UNKNOWN", ckpt
    rows[1] = dataclasses.replace(rows[1], lost_steps=4)
    ckpt = next(c for c in creport.check(plan, rec, rows, max_restarts=3, ckpt_every=1)
                if c.name.startswith("progress lost"))
    assert not ckpt.ok and not ckpt.unknown and cchecks.label(ckpt) == "BROKEN", ckpt
    snap = cchecks._snapshot_check(rows[:1], ("local",), 10)
    assert not snap.ok and snap.unknown and "no State.restore()" in snap.detail
