"""The soak's counting (``bench/_soak_tally.py``) on canned chaos reports, and its process handling
on real runs: one tiny elastictk-chaos run, and one run that leaves an orphan behind."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench._soak_matrix import PLAIN, SCENARIOS, Scenario
from bench._soak_tally import (
    FIRED, LEAKS, MIN_FIRED, MIN_RUNS, ORPHANS, RunResult, Totals, markdown, passed, read_run, verdict,
)
from bench.soak import Soak

ROOT = Path(__file__).resolve().parent.parent
OTHER_CHECKS = ("finishes iff faults <= max-restarts", "restarts counted == failures that needed one")


def canned(tmp: Path, name: str, *, planned: int = 3, fired: int = 3, broken: tuple[str, ...] = (),
           orphans: str = "", leaks: str = "", stopped: Any = None, beyond: int = 0) -> Path:
    """A chaos-report.json as elastictk-chaos writes it (the fields the soak reads)."""
    d = tmp / name
    d.mkdir()
    faults = [{"index": i, "kind": "sigkill", "target": "rank:1", "planned": f"step {i + 2}", "fired": i < fired,
               "why": None if i < fired else "the step was never reached"} for i in range(planned)]
    missed = planned - fired
    checks = [{"name": FIRED, "ok": missed <= beyond,
               "detail": f"{fired} of {planned} fired" + (f"; {beyond} planned past --max-restarts, not expected to"
                                                          if beyond else "")}]
    checks += [{"name": n, "ok": n not in broken, "detail": "x"} for n in OTHER_CHECKS]
    checks += [{"name": ORPHANS, "ok": not orphans, "detail": orphans or "7 process(es) checked"},
               {"name": LEAKS, "ok": not leaks, "detail": leaks or "/dev/shm and listening ports as before"}]
    (d / "chaos-report.json").write_text(json.dumps({
        "schema": "elastictk.chaos-report/1", "faults": faults, "checks": checks,
        "totals": {"faults_planned": planned, "faults_fired": fired, "restarts": fired, "exit_code": 0,
                   "stopped": stopped}}))
    return d


def result(d: Path, index: int = 0, exit_code: int = 0, **kw: Any) -> RunResult:
    return read_run(d, index=index, scenario="s", mode="restart-all", script="x.py", seed=index,
                    exit_code=exit_code, wall_s=2.0, **kw)


def test_counts_come_from_the_reports_and_every_kind_of_failure_turns_the_verdict_red(tmp_path: Path) -> None:
    good = [result(canned(tmp_path, f"ok{i}"), i) for i in range(3)]
    past = result(canned(tmp_path, "past", planned=4, fired=3, beyond=1), 3)  # past --max-restarts: fine
    assert all(r.ok for r in good) and past.ok and not past.unfired
    clean = good + [past]
    t = Totals.of(clean)
    assert (t.runs, t.passed, t.planned, t.fired, t.unfired, t.broken, t.orphans, t.leaks, t.timeouts) == \
        (4, 4, 13, 12, 0, 0, 0, 0, 0)
    assert passed(verdict(clean, full=False))

    bad = {
        "unfired": result(canned(tmp_path, "unfired", planned=3, fired=2), 10, exit_code=1),
        "broken": result(canned(tmp_path, "broken", broken=(OTHER_CHECKS[1],)), 11, exit_code=1),
        "orphan": result(canned(tmp_path, "orphan", orphans="pid 4242 (python worker.py); pid 4243 (x)"), 12,
                         exit_code=1, orphans=["pid 4242 (python worker.py)", "pid 999 (etcd)"]),
        "leak": result(canned(tmp_path, "leak", leaks="/dev/shm/elastictk_a, 127.0.0.1:5 (pid 3)"), 13, exit_code=1),
        "timeout": result(canned(tmp_path, "timeout", stopped="timeout"), 14),
        "killed": result(canned(tmp_path, "killed"), 15, killed=True),
        "missing": result(tmp_path, 16, exit_code=2),  # no chaos-report.json there
        "exit": result(canned(tmp_path, "exit"), 17, exit_code=1),
    }
    assert bad["unfired"].unfired == ["#2 sigkill on rank:1 at step 4: the step was never reached"]
    assert [b.split(":")[0] for b in bad["broken"].broken] == [OTHER_CHECKS[1]]
    assert bad["orphan"].orphans == ["pid 999 (etcd)", "pid 4242 (python worker.py)", "pid 4243"]
    assert bad["leak"].leaks == ["/dev/shm/elastictk_a", "127.0.0.1:5 (pid 3)"]
    assert bad["timeout"].timeout and bad["killed"].timeout
    assert bad["missing"].error == "no chaos-report.json (elastictk-chaos exit 2)"
    failing = {
        "unfired": "every planned fault fired", "broken": "no broken invariant", "orphan": "no orphan process",
        "leak": "no leaked shared memory or port", "timeout": "no timeout", "killed": "no timeout",
        "missing": "every run reported", "exit": "every elastictk-chaos run exit 0",
    }
    for what, r in bad.items():
        assert not r.ok, what
        checks = verdict(clean + [r], full=False)
        red = [c for c in checks if not c.ok]
        assert failing[what] in [c.name for c in red], (what, red)
        assert f"#{r.index} s seed {r.seed}" in next(c.detail for c in red if c.name == failing[what])
    t = Totals.of(clean + list(bad.values()))
    assert (t.unfired, t.broken, t.orphans, t.leaks, t.timeouts, t.errors) == (1, 3, 3, 2, 2, 1)
    assert t.planned == 13 + 3 * 7 and t.fired == 12 + 2 + 3 * 6


def test_a_full_soak_needs_its_size_and_the_report_shows_the_failing_side(tmp_path: Path) -> None:
    one = result(canned(tmp_path, "one", planned=10, fired=10))
    many = [RunResult(**{**one.__dict__, "index": i}) for i in range(MIN_RUNS)]
    assert passed(verdict(many, full=True))  # 100 runs x 10 fired = 1000
    assert not passed(verdict(many[:-1], full=True))  # 99 runs, 990 fired
    assert passed(verdict(many[:-1], full=False))  # a quick soak has no size target
    assert Totals.of(many).fired == MIN_FIRED
    bad = result(canned(tmp_path, "bad", planned=3, fired=2), 7, exit_code=1)
    bad.command = "python -m elastictk.chaos --seed 7 -- x.py"
    text = markdown([one, bad], verdict([one, bad], full=False), title="t", header=["h"])
    assert "**FAIL**" in text and "- [FAILED] every planned fault fired: 1 (run #7 s seed 7)" in text
    assert "`python -m elastictk.chaos --seed 7 -- x.py`" in text and "the step was never reached" in text
    assert "| 7 | s | 7 | 1 | 0 | 3 | 2 |" in text  # the per-run row: planned 3, fired 2
    assert "**PASS**" in markdown([one], verdict([one], full=False), title="t", header=["h"])


def test_the_matrix_covers_every_kind_mode_and_two_script_shapes() -> None:
    from elastictk.faults.kinds import KINDS

    kinds = {k.split(":")[0] for s in SCENARIOS for k in s.kinds.split(",")}
    assert kinds == set(KINDS), set(KINDS) - kinds
    modes = " ".join(s.mode for s in SCENARIOS)
    assert {"restart-all", "in-place", "c10d", "etcd"} <= set(modes.split())
    assert any("--rejoin" in s.chaos for s in SCENARIOS)
    assert {"examples/train_ddp.py", "examples/train.py"} <= {s.script for s in SCENARIOS}


def test_a_real_run_is_counted_from_its_report(tmp_path: Path) -> None:
    tiny = Scenario("tiny", "restart-all", PLAIN, "step", ("--faults", "1", "--kinds", "sigkill", "--at-steps", "2:4"),
                    ("--standalone", "--nproc-per-node", "2", "--max-restarts", "1"),
                    (PLAIN, "--steps", "6", "--ckpt-dir", "{run_dir}"), timeout=120)
    r = Soak(tmp_path, keep=True).one(0, tiny, 5)
    assert r is not None and r.ok, r
    assert (r.planned, r.fired, r.restarts, r.exit_code, r.job_exit) == (1, 1, 1, 0, 0)
    assert "--seed 5" in r.command


@dataclass(frozen=True)
class Leaver(Scenario):
    """Not a chaos run: a process that starts a detached child and exits without a report."""

    def argv(self, seed: int, out: Path) -> list[str]:
        child = "import time; time.sleep(60)"
        return [sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                f"{child!r}], start_new_session=True)"]


def test_a_process_left_behind_is_an_orphan_and_is_killed(tmp_path: Path) -> None:
    soak = Soak(tmp_path, keep=False, orphan_grace=1.0)
    r = soak.one(3, Leaver("leaver", "restart-all", "x.py", "time", (), (), ()), 1)
    assert r is not None and not r.ok
    assert r.error == "no chaos-report.json (elastictk-chaos exit 0)"
    assert len(r.orphans) == 1 and "time.sleep(60)" in r.orphans[0]
    pid = int(r.orphans[0].split()[1])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "run003-leaver-seed1").is_dir()  # a failed run's directory is kept


def test_bad_input_is_one_line_and_exit_2() -> None:
    for args, says in ((["soak", "--parallel", "3"], "--parallel 3: give 1..2"),
                       (["soak", "--only", "nope"], "no scenario nope"),
                       (["store", "soak"], "soak runs on its own")):
        r = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
