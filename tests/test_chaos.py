"""elastictk-chaos end to end: real jobs (examples/train.py, 2 gloo workers), real faults."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastictk.faults import Fault, FaultPlan, plan_of
from tests.helpers.chaosrun import chaos, report

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")
JOB = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
CMD = ["--", TRAIN, "--steps", "10", "--ckpt-every", "3", "--step-time", "0.01", "--ckpt-dir", "{run_dir}"]


def test_a_planned_run_keeps_every_invariant_and_replays(tmp_path: Path) -> None:
    plan = plan_of([Fault.of("sigsegv", "rank:1", at_step=3), Fault.of("exit:3", "rank:0", at_step=7)])
    plan.save(tmp_path / "plan.json")
    # Left in the report directory: modules where the workers' sitecustomize used to live (the
    # venv's .pth imports _distutils_hack at every interpreter start) and symlinks at the
    # report's names. Nothing there is ever imported, and no link is followed.
    site, victim, ran = tmp_path / "r" / "elastictk-site", tmp_path / "victim", tmp_path / "ran"
    site.mkdir(parents=True)
    for module in ("_distutils_hack.py", "sitecustomize.py"):
        (site / module).write_text(f"open({str(ran)!r}, 'a').write('{module}\\n')\n")
    victim.write_text("kept\n")
    for name in ("chaos-report.json", "job-stdout.log", "job-stderr.log", "chaos-plan.json"):
        (tmp_path / "r" / name).symlink_to(victim)
    # A temp dir of this run's own: other tests' runs (pytest-xdist) make theirs meanwhile.
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    r = chaos(tmp_path, "--plan", "plan.json", "--ckpt-every", "3", "--compare-fault-free", *JOB, *CMD,
              env={**os.environ, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert not ran.exists() and victim.read_text() == "kept\n"
    assert not list(tmp.glob("elastictk-site-*"))  # made there for the workers, and removed
    d = report(tmp_path)
    assert [f["fired"] for f in d["faults"]] == [True, True]
    assert all(c["ok"] for c in d["checks"]) and len(d["checks"]) == 8, d["checks"]
    assert d["totals"]["restarts"] == 2 and d["totals"]["exit_code"] == 0
    assert [f["restarts_used"] for f in d["faults"]] == [1, 2]
    assert all(f["detected_after"] is not None and f["running_after"] >= f["detected_after"] for f in d["faults"])
    assert "sigsegv" in r.stdout and "[ok] result equals the fault-free run's" in r.stdout
    png = (tmp_path / "r" / "chaos-timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 500

    (tmp_path / "first.json").write_text(json.dumps(d))
    again = chaos(tmp_path, "--replay", "first.json")
    assert again.returncode == 0, again.stderr[-3000:]
    d2 = report(tmp_path)
    assert FaultPlan.from_json(d2["plan"]) == FaultPlan.from_json(d["plan"])
    assert d2["command"] == d["command"] and d2["totals"]["restarts"] == 2


def test_more_faults_than_the_budget_fail_the_job_with_the_budget_message(tmp_path: Path) -> None:
    r = chaos(tmp_path, "--seed", "5", "--faults", "3", "--kinds", "sigkill", "--at-steps", "2:9",
              "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *CMD)
    d = report(tmp_path)
    assert d["totals"]["exit_code"] == 1 and d["totals"]["restarts"] == 1
    names = {c["name"]: c["ok"] for c in d["checks"]}
    assert names["fails with the budget message"] and names["finishes iff faults <= max-restarts"]
    # failing was the right outcome, but fault #2 (attempt 2) could never fire: not all [ok]
    fired = next(c for c in d["checks"] if c["name"] == "every planned fault fired")
    assert not fired["ok"] and "past --max-restarts 1" in fired["detail"], fired
    assert r.returncode == 1 and "[BROKEN] every planned fault fired" in r.stdout, r.stdout + r.stderr[-3000:]


def test_a_broken_invariant_is_named_and_exits_1(tmp_path: Path) -> None:
    r = chaos(tmp_path, "--seed", "1", "--faults", "1", "--kinds", "exception", "--expect-checksum",
              "0000000000000000", *JOB, *CMD)
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "invariant broken: result equals the fault-free run's: checksum" in r.stderr


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for args, text in [
        (["--kinds", "explode", *JOB, *CMD], "unknown fault kind 'explode'"),
        ([*JOB], "no training command"),
        (["--at-steps", "9", *JOB, *CMD], "--at-steps '9': write LO:HI"),
        (["--nnodes", "1:2", "--nproc-per-node", "2", *CMD], "pass --nodes N for a job of several nodes"),
        (["--replay", "nope.json"], "cannot read the chaos report"),
    ]:
        r = chaos(tmp_path, *args, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], (args, r.stderr)
    plan = plan_of([Fault.of("kill-agent", "node:0", at_s=1)])
    plan.save(tmp_path / "p.json")
    r = chaos(tmp_path, "--plan", "p.json", *JOB, *CMD, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "kill-agent needs a job of several nodes; pass --nodes N" in lines[0]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), count=st.integers(1, 3),
       kinds=st.lists(st.sampled_from(["sigkill", "sigterm", "sigsegv", "exception", "exit:4"]),
                      min_size=1, max_size=3, unique=True))
def test_random_plans_keep_the_invariants(tmp_path: Path, seed: int, count: int, kinds: list[str]) -> None:
    out = tmp_path / f"s{seed}"
    out.mkdir(exist_ok=True)
    r = chaos(out, "--seed", str(seed), "--faults", str(count), "--kinds", ",".join(kinds),
              "--at-steps", "2:9", "--ckpt-every", "3", *JOB, *CMD)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
