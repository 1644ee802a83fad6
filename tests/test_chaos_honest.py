"""elastictk-chaos on scripts that know nothing of elastictk, and a chaos run that can fail:
faults that did not fire fail the run with the reason, in-place recoveries count as restarts,
and the runner owns every process of its job (signals, its timeout, its own SIGKILL)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from elastictk.chaos import checks as cchecks
from elastictk.chaos import rows as crows
from elastictk.chaos.cli import parse
from elastictk.chaos.jobplan import build_plan
from elastictk.chaos.record import RunRecord
from elastictk.faults import Fault, generate_plan, plan_of
from tests.helpers.chaosrun import chaos, report

ROOT = Path(__file__).resolve().parent.parent
PLAIN = str(ROOT / "tests" / "helpers" / "plain_allreduce.py")
DDP = str(ROOT / "tests" / "helpers" / "ddp_save.py")
INPLACE = str(ROOT / "examples" / "train_inplace.py")
JOB = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]


def fired_in_log(tmp: Path) -> list[dict]:
    lines = (tmp / "r" / "chaos-faults.jsonl").read_text().splitlines()
    return [d for d in map(json.loads, lines) if "fault" in d]


# -- bullet 4: unmodified torchrun-style scripts --------------------------------------------------

def test_sigkill_step_faults_fire_in_a_plain_all_reduce_loop(tmp_path: Path) -> None:
    r = chaos(tmp_path, "--seed", "3", "--faults", "3", "--kinds", "sigkill", "--at-steps", "2:10",
              *JOB, "--", PLAIN, "--steps", "14", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "3 fault(s) planned, 3 fired" in r.stdout
    assert sorted(d["fault"] for d in fired_in_log(tmp_path)) == [0, 1, 2]
    assert {d["source"] for d in fired_in_log(tmp_path)} == {"auto"}  # optimizer steps
    d = report(tmp_path)
    assert d["totals"]["restarts"] == 3 and all(f["fired"] for f in d["faults"])
    assert all(c["ok"] for c in d["checks"]), d["checks"]


def test_sigkill_step_faults_fire_in_a_ddp_script(tmp_path: Path) -> None:
    r = chaos(tmp_path, "--seed", "3", "--faults", "2", "--kinds", "sigkill", "--at-steps", "2:6",
              *JOB, "--", DDP, "--epochs", "3", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert sorted(d["fault"] for d in fired_in_log(tmp_path)) == [0, 1]
    d = report(tmp_path)
    assert d["totals"]["restarts"] == 2 and d["totals"]["faults_fired"] == 2


def test_subprocess_workers_count_steps_through_the_sitecustomize(tmp_path: Path) -> None:
    plan = plan_of([Fault.of("sigkill", "rank:1", at_step=3)])
    plan.save(tmp_path / "p.json")
    r = chaos(tmp_path, "--plan", "p.json", "--start-method", "spawn", *JOB, "--", PLAIN,
              "--steps", "8", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert [d["fault"] for d in fired_in_log(tmp_path)] == [0]


# -- bullet 2: a fault that did not fire fails the run, saying why --------------------------------

def test_step_faults_that_cannot_fire_fail_the_run_naming_why(tmp_path: Path) -> None:
    r = chaos(tmp_path, "--seed", "3", "--faults", "2", "--kinds", "sigkill", "--at-steps", "30:40",
              *JOB, "--", PLAIN, "--steps", "5", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "2 fault(s) planned, 0 fired, 2 did not fire" in r.stdout
    why = [x for x in r.stderr.splitlines() if x.startswith("elastictk-chaos: error: fault #")]
    assert len(why) == 2 and all("the step was never reached" in x for x in why), r.stderr
    assert "got to step 5 in attempt 0" in r.stderr
    assert "invariant broken: every planned fault fired" in r.stderr

    r = chaos(tmp_path, "--seed", "3", "--faults", "2", "--kinds", "sigkill", "--at-steps", "30:40",
              "--allow-unfired", *JOB, "--", PLAIN, "--steps", "5", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert r.stderr.count("warning: fault #") == 2


def test_a_script_that_reports_no_steps_is_named(tmp_path: Path) -> None:
    r = chaos(tmp_path, "--seed", "3", "--faults", "1", "--kinds", "sigkill", "--no-auto-steps",
              *JOB, "--", PLAIN, "--steps", "5", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "did not fire: the script reports no steps" in r.stderr


def test_time_faults_after_the_job_ended_fail_the_run(tmp_path: Path) -> None:
    r = chaos(tmp_path, "--seed", "3", "--faults", "2", "--kinds", "sigkill", "--at-seconds", "100:200",
              *JOB, "--", PLAIN, "--steps", "5", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert r.stderr.count("did not fire: the job ended first") == 2, r.stderr


def test_why_a_fault_did_not_fire_from_the_record() -> None:
    """The reasons the runs above cannot reach: a rank that never existed, an attempt never run."""
    rec = RunRecord(argv=[], started=0.0, ended=10.0, ranks_seen={0, 1},
                    progress=[{"progress": "first", "source": "auto", "step": 1, "rank": 0, "node": 0,
                               "attempt": 0}])
    assert crows.why_unfired(Fault.of("sigkill", "rank:5", at_step=3), 0, rec).startswith(
        "the target rank never existed: the job ran ranks 0..1")
    later = plan_of([Fault.of("sigkill", "rank:0", at_step=3), Fault.of("sigkill", "rank:1", at_step=6)])
    assert "planned in attempt 1, and the job ended in attempt 0" in crows.why_unfired(later.faults[1], 1, rec)
    assert crows.why_unfired(Fault.of("sigkill", "rank:0", at_s=30), 0, rec).startswith("the job ended first")
    rows = crows.fault_rows(later, rec)
    assert [r.why is not None for r in rows] == [True, True]
    assert not cchecks._fired(rows, False).ok and cchecks._fired(rows, True).ok


def test_an_explicit_straggler_duration_is_used_as_given() -> None:
    ns, _, _ = parse(["--kinds", "slow:0.5", "--faults", "2", "--", "x.py"])
    plan = build_plan(ns, 2, 3.0)
    assert {f.param for f in plan.faults} == {0.5}
    ns, _, _ = parse(["--kinds", "slow:4", "--faults", "1", "--", "x.py"])
    with pytest.raises(Exception, match="not shorter than watchdog_s 3s"):
        build_plan(ns, 2, 3.0)
    with pytest.raises(Exception, match="slow_s upper bound"):  # a drawn one still has to fit
        generate_plan(1, 1, 2, kinds=["slow"], steps=(2, 9), watchdog_s=3.0)


# -- bullet 1: in-place jobs get step faults, and their recoveries are restarts -------------------

def test_step_faults_hit_an_in_place_job_and_its_recoveries_count_as_restarts(tmp_path: Path) -> None:
    r = chaos(tmp_path, "--seed", "2", "--faults", "2", "--kinds", "sigkill", "--at-steps", "5:25",
              *JOB, "--recovery", "in-place", "--", INPLACE, "--steps", "30")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    fired = fired_in_log(tmp_path)
    assert sorted(d["fault"] for d in fired) == [0, 1] and {d["source"] for d in fired} == {"loop"}
    d = report(tmp_path)
    assert d["totals"]["restarts"] == 2 and [f["restarts_used"] for f in d["faults"]] == [1, 2]
    names = {c["name"]: c["ok"] for c in d["checks"]}
    assert names["restarts counted == failures that needed one"], d["checks"]


def test_time_faults_on_an_in_place_job_keep_the_restart_count(tmp_path: Path) -> None:
    plan = plan_of([Fault.of("sigkill", "rank:1", at_s=8.0)])
    plan.save(tmp_path / "p.json")
    r = chaos(tmp_path, "--plan", "p.json", *JOB, "--recovery", "in-place", "--", INPLACE,
              "--steps", "400", "--step-time", "0.03")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert report(tmp_path)["totals"]["restarts"] == 1


def test_a_time_fault_due_while_its_target_restarts_fires_once_it_runs_again(tmp_path: Path) -> None:
    # The second kill is due 0.1 s after the first, while the job is restarting from it: the
    # runner hits the restarted rank (within its grace) instead of calling the fault unfired.
    plan = plan_of([Fault.of("sigkill", "rank:1", at_s=1.0), Fault.of("sigkill", "rank:1", at_s=1.1)])
    plan.save(tmp_path / "p.json")
    r = chaos(tmp_path, "--plan", "p.json", *JOB, "--", PLAIN, "--steps", "200", "--ckpt-dir", "{run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = report(tmp_path)
    assert [f["fired"] for f in d["faults"]] == [True, True] and d["totals"]["restarts"] == 2, d["faults"]
    assert d["faults"][1]["injected_at"] > d["faults"][0]["injected_at"] + 0.1


# -- bullet 3: the runner owns its job -------------------------------------------------------------

def _start(tmp: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp / "r"), *args],
                            cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _tree_when_running(proc: subprocess.Popen[str], tmp: Path, nodes: int) -> list[psutil.Process]:
    """Every process under the chaos run, once workers run on every node (event logs)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        started = sum("workers_started" in p.read_text() for p in (tmp / "r").glob("*events.jsonl"))
        if started >= nodes:
            time.sleep(1.0)  # the workers' own start (torch, init_process_group)
            return psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.2)
    raise AssertionError("no workers started")


def _gone(procs: list[psutil.Process], within: float = 15) -> list[psutil.Process]:
    """The processes of ``procs`` still alive ``within`` seconds from now."""
    _, alive = psutil.wait_procs(procs, timeout=within)
    out = []
    for p in alive:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _reap(procs: list[psutil.Process]) -> None:
    """Kill what a broken runner left behind (the test still fails), one known PID at a time."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


# Silent: a job that prints would die of SIGPIPE once its reader is gone, hiding a leak.
LONG = ["--", PLAIN, "--steps", "100000", "--step-time", "0.05", "--print-every", "100000"]
PLAN_NEVER = Fault.of("sigkill", "rank:1", at_step=10**6)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_a_signal_to_elastictk_chaos_ends_every_process_of_the_run(tmp_path: Path, sig: int) -> None:
    plan_of([PLAN_NEVER]).save(tmp_path / "p.json")
    proc = _start(tmp_path, "--plan", "p.json", *JOB, *LONG)
    tree = _tree_when_running(proc, tmp_path, 1)
    assert len(tree) >= 3, tree  # agent, fork server / death watch, workers
    os.kill(proc.pid, sig)
    code = proc.wait(60)
    left = _gone(tree)
    _reap(left)
    assert not left, left
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig), proc.stderr.read() if proc.stderr else ""


def test_the_runs_timeout_ends_every_process_of_the_run(tmp_path: Path) -> None:
    """The timeout must strike while workers run; a loaded host may take longer than one to
    start them (the runner then says "before any worker reported a step"): that run is no
    evidence, and the next one gets four times the time (8 s idle, up to 128 s)."""
    plan_of([PLAN_NEVER]).save(tmp_path / "p.json")
    for timeout in (8, 32, 128):
        shutil.rmtree(tmp_path / "r", ignore_errors=True)
        proc = _start(tmp_path, "--plan", "p.json", "--timeout", str(timeout), *JOB, *LONG)
        try:
            tree = _tree_when_running(proc, tmp_path, 1)
            break
        except AssertionError as e:
            proc.wait(60)
            if "before any worker reported a step" not in str(e) or timeout == 128:
                raise
    proc.wait(90 + timeout)
    left = _gone(tree)
    _reap(left)
    assert not left, left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_ends_every_process_of_a_multi_node_run(tmp_path: Path, sig: int) -> None:
    plan_of([PLAN_NEVER]).save(tmp_path / "p.json")
    proc = _start(tmp_path, "--plan", "p.json", "--nodes", "2", "--nproc-per-node", "1",
                  "--max-restarts", "1", *LONG)
    tree = _tree_when_running(proc, tmp_path, 2)
    os.kill(proc.pid, sig)
    code = proc.wait(60)
    left = _gone(tree)
    _reap(left)
    assert not left, left
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig)


# -- a hang in a DDP script: caught by the progress watchdog, its rank named, recovered ----------

def test_a_hang_in_a_ddp_script_is_caught_named_and_recovered(tmp_path: Path) -> None:
    plan = plan_of([Fault.of("hang", "rank:1", at_step=3)], watchdog_s=2.0)
    plan.save(tmp_path / "p.json")
    r = chaos(tmp_path, "--plan", "p.json", *JOB, "--collective-timeout", "2", "--", DDP, "--epochs", "2",
              "--ckpt-dir", "{run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = report(tmp_path)
    assert "--progress-timeout" in d["launcher_flags"], "chaos turns the progress watchdog on for hangs"
    checks = {c["name"]: c for c in d["checks"]}
    assert checks["every hang caught, its rank named"]["ok"], checks
    assert d["totals"]["faults_fired"] == 1 and d["totals"]["restarts"] == 1


def test_an_in_place_recovery_that_falls_back_to_restart_all_is_one_restart() -> None:
    from elastictk.chaos.rows import restarts_of
    from elastictk.chaos.record import RunRecord
    from elastictk.metrics.events import Event

    rec = RunRecord(argv=[], started=0.0)
    rec.events = [Event("inplace_recovery", {"restart_count": 1}, mono=1.0),
                  Event("inplace_fallback", {}, mono=31.0), Event("restart", {"restart_count": 1}, mono=31.1),
                  Event("restart", {"restart_count": 2}, mono=40.0)]
    assert restarts_of(rec) == 2


def test_a_hang_no_watchdog_caught_or_one_blaming_another_rank_breaks_the_check() -> None:
    from elastictk.chaos.checks import _hangs_caught
    from elastictk.chaos.rows import FaultRow
    from elastictk.chaos.record import RunRecord
    from elastictk.metrics.events import Event

    row = FaultRow(0, "hang", "rank:1", "step 3", True, True, injected_at=1.0)
    rec = RunRecord(argv=[], started=100.0)
    assert not _hangs_caught([row], rec, several_nodes=False).ok, "never caught"
    rec.events = [Event("hang_detected", {"rank": 0, "culprits": [0], "blocked": [1]}, mono=102.0)]
    check = _hangs_caught([row], rec, several_nodes=False)
    assert not check.ok and "blamed [0]" in check.detail
    rec.events = [Event("hang_detected", {"rank": 1, "culprits": [1], "blocked": [0]}, mono=102.0)]
    assert _hangs_caught([row], rec, several_nodes=False).ok
    rec.events = [Event("timer_expired", {"rank": 1}, mono=100.5)]  # before the hang: not its catch
    assert not _hangs_caught([row], rec, several_nodes=False).ok
    # Both ranks' timers expire in the same incident, the waiting rank's logged first: caught.
    rec.events = [Event("timer_expired", {"rank": 0}, mono=103.0), Event("timer_expired", {"rank": 1}, mono=103.1),
                  Event("workers_started", {}, mono=104.0)]
    assert _hangs_caught([row], rec, several_nodes=False).ok
    # ... but a naming after the workers ran again belongs to another incident.
    rec.events = [Event("timer_expired", {"rank": 0}, mono=103.0), Event("workers_started", {}, mono=104.0),
                  Event("timer_expired", {"rank": 1}, mono=109.0)]
    assert not _hangs_caught([row], rec, several_nodes=False).ok
