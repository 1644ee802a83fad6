"""Steps lost per fault, judged from the runtime's records (elastictk/chaos/lost.py), never from
what the script prints: a script that logs ``iter N`` and never reloads is never judged ok, and
one that logs ``step N`` gets the same verdict; a resuming script is judged by its numbers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from elastictk.chaos import checks as cchecks
from elastictk.chaos import report as creport
from elastictk.chaos import rows as crows
from elastictk.chaos.lost import lost_steps
from elastictk.chaos.record import Injection, RunRecord
from elastictk.faults import Fault, plan_of
from elastictk.faults.env import ENV_LOG
from elastictk.inplace import state as state_mod
from elastictk.metrics.events import Event

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")
CHECK = "progress lost per fault <= checkpoint interval"

# A plain script: optimizer steps only, never reloads anything; what it prints is the parameter.
NO_RELOAD = r'''
import sys, torch
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(40):
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    print(f"{sys.argv[1]} {i + 1}", flush=True)
'''


def _record(first_next: dict[str, Any], fault: dict[str, Any], stdout_word: str,
            restored: list[dict[str, Any]] = ()) -> tuple[RunRecord, list[crows.FaultRow]]:
    """One sigkill of rank 0 at step 16 in attempt 0, the job restarted once; ``steps`` (what
    the script printed) says the job went back to 1 when it printed "step N" lines."""
    plan = plan_of([Fault.of("sigkill", "rank:0", at_step=16)])
    ev = [Event("workers_started", {"restart_count": 0}, mono=1.0),
          Event("worker_failed", {"rank": 0}, mono=3.1),
          Event("restart", {"restart_count": 1}, mono=3.2),
          Event("workers_started", {"restart_count": 1}, mono=4.0)]
    printed = [(2.0, 15), (2.9, 16), (4.5, 1), (5.0, 2)] if stdout_word == "step" else []
    line = {"fault": 0, "kind": "sigkill", "target": "rank:0", "rank": 0, "attempt": 0, "pid": 11,
            "monotonic": 3.0, **fault}
    rec = RunRecord(argv=[], started=0.0, ended=9.0, exit_code=0, events=ev, steps=printed,
                    injections=[Injection(0, "sigkill", "rank:0", 3.0, 11, fault.get("step"))],
                    fault_lines=[line], restored=list(restored),
                    progress=[{"progress": "first", "rank": 0, "attempt": 0, "pid": 11, **first_next,
                               "step": 1 if first_next.get("source") == "auto" else 0},
                              {"progress": "first", "rank": 0, "attempt": 1, "pid": 12, **first_next}])
    return rec, crows.fault_rows(plan, rec)


def _verdict(rec: RunRecord, rows: list[crows.FaultRow]) -> cchecks.Check:
    checks = creport.check(plan_of([Fault.of("sigkill", "rank:0", at_step=16)]), rec, rows,
                           max_restarts=3, ckpt_every=5)
    return next(c for c in checks if c.name == CHECK)


def test_a_script_that_never_reloads_is_never_judged_ok_whatever_it_prints() -> None:
    verdicts = []
    for word in ("iter", "step"):
        rec, rows = _record({"source": "auto", "step": 1}, {"source": "auto", "step": 16}, word)
        assert rows[0].lost_steps is None and "restore" in (rows[0].lost_why or "")
        verdicts.append(_verdict(rec, rows))
    assert verdicts[0] == verdicts[1]  # what the script printed changes nothing
    assert not verdicts[0].ok and "#0 sigkill lost an unknown number of step(s)" in verdicts[0].detail
    text = creport.render(rows, creport.totals(rec, rows), verdicts)
    assert verdicts[0].unknown and "[UNKNOWN] " + CHECK in text  # not judged: it does not pass
    assert "unknown" in text.split("steps lost")[1].splitlines()[2]


def test_numbered_steps_judge_a_resuming_script_ok_and_a_restart_from_zero_broken() -> None:
    # the failed process was about to run step 16; its successor first reported step 11
    rec, rows = _record({"source": "checkpoint", "step": 11}, {"source": "checkpoint", "step": 16}, "iter")
    assert rows[0].lost_steps == 5 and _verdict(rec, rows).ok
    rec, rows = _record({"source": "checkpoint", "step": 1}, {"source": "checkpoint", "step": 16}, "step")
    assert rows[0].lost_steps == 15
    v = _verdict(rec, rows)
    assert not v.ok and "#0 sigkill lost 15 step(s)" in v.detail


def test_optimizer_counts_are_judged_from_the_step_state_restored() -> None:
    restored = [{"restored": 14, "rank": 0, "attempt": 1, "pid": 12}]
    rec, rows = _record({"source": "auto", "step": 1}, {"source": "auto", "step": 16}, "iter", restored)
    assert rows[0].lost_steps == 2 and _verdict(rec, rows).ok
    nothing = [{"restored": None, "rank": 0, "attempt": 1, "pid": 12}]  # restore() found no snapshot
    rec, rows = _record({"source": "auto", "step": 1}, {"source": "auto", "step": 16}, "iter", nothing)
    assert rows[0].lost_steps == 16 and not _verdict(rec, rows).ok


def test_state_restore_records_the_step_for_chaos(tmp_path: Path, monkeypatch: Any) -> None:
    assert state_mod.ENV_LOG == ENV_LOG
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv(ENV_LOG, str(log))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    for name in ("ELASTICTK_SNAPSHOT", "ELASTICTK_SNAPSHOT_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert state_mod.State(step=0).restore() is None
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert line["restored"] is None and (line["rank"], line["attempt"]) == (1, 2)


junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=12)
line_of = st.dictionaries(st.sampled_from(["rank", "attempt", "step", "source", "pid", "progress", "restored"]),
                          junk | st.sampled_from(["auto", "checkpoint", "loop", "first"]) | st.integers(-3, 40))


@given(line_of, st.lists(line_of, max_size=5), st.lists(line_of, max_size=5))
def test_lost_steps_never_fails_on_garbage_records(fault: dict, progress: list, restored: list) -> None:
    got = lost_steps(fault, progress, restored)
    assert (got.steps is None and got.why) or (isinstance(got.steps, int) and got.steps >= 0)


def _chaos(tmp: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    plan_of([Fault.of("sigkill", "rank:0", at_step=8)]).save(tmp / "plan.json")
    r = subprocess.run([sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp / "r"), "--plan",
                        "plan.json", "--ckpt-every", "4", "--standalone", "--nproc-per-node", "1",
                        "--max-restarts", "1", "--", *command], cwd=tmp, capture_output=True, text=True,
                       timeout=240)
    return r, json.loads((tmp / "r" / "chaos-report.json").read_text())


def test_end_to_end_a_script_printing_iter_lines_that_never_reloads_fails_the_check(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(NO_RELOAD)
    r, data = _chaos(tmp_path, str(script), "iter")
    verdict = next(c for c in data["checks"] if c["name"] == CHECK)
    assert not verdict["ok"] and "unknown" in verdict["detail"], r.stdout + r.stderr[-2000:]
    assert r.returncode == 1 and f"[UNKNOWN] {CHECK}" in r.stdout
    assert f"invariant not judged (it does not pass): {CHECK}" in r.stderr


def test_end_to_end_a_resuming_script_passes_the_check(tmp_path: Path) -> None:
    r, data = _chaos(tmp_path, TRAIN, "--steps", "12", "--ckpt-every", "4", "--step-time", "0.01",
                     "--ckpt-dir", "{run_dir}")
    (fault,) = data["faults"]
    verdict = next(c for c in data["checks"] if c["name"] == CHECK)
    assert fault["lost_steps"] is not None and fault["lost_steps"] <= 4 and verdict["ok"], \
        r.stdout + r.stderr[-2000:]
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_a_fault_in_a_restored_process_counts_from_its_restore_point() -> None:
    """Attempt 1's process restored step 10 and ran 8 optimizer steps before the fault, which
    it records at the job's step 18 (the count goes on from the restored step); its successor
    restored 10 again: 8 steps are run again (with the count read as from 0, 8 - 10 -> 0)."""
    fault = {"fault": 0, "kind": "sigkill", "target": "rank:0", "rank": 0, "attempt": 1, "pid": 21,
             "step": 18, "source": "auto"}
    restored = [{"restored": 10, "rank": 0, "attempt": 1, "pid": 21},
                {"restored": 10, "rank": 0, "attempt": 2, "pid": 22}]
    progress = [{"progress": "first", "rank": 0, "attempt": a, "pid": p, "source": "auto", "step": 1}
                for a, p in ((1, 21), (2, 22))]
    assert lost_steps(fault, progress, restored).steps == 8
    plan = plan_of([Fault.of("sigkill", "rank:0", at_step=18)])
    ev = [Event("workers_started", {"restart_count": 1}, mono=1.0),
          Event("worker_failed", {"rank": 0}, mono=3.1),
          Event("restart", {"restart_count": 2}, mono=3.2),
          Event("workers_started", {"restart_count": 2}, mono=4.0)]
    rec = RunRecord(argv=[], started=0.0, ended=9.0, exit_code=0, events=ev,
                    injections=[Injection(0, "sigkill", "rank:0", 3.0, 21, 18)],
                    fault_lines=[{**fault, "monotonic": 3.0}], restored=restored, progress=progress)
    rows = crows.fault_rows(plan, rec)
    assert rows[0].lost_steps == 8
    verdict = next(c for c in creport.check(plan, rec, rows, max_restarts=3, ckpt_every=5) if c.name == CHECK)
    assert not verdict.ok and "#0 sigkill lost 8 step(s)" in verdict.detail
