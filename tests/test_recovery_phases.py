"""Where every second of recovery goes (issue #21): the ``recovery`` event's phases, their
histogram, the chaos report's columns, the end-of-job line, and the steps redone."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from elastictk.chaos import report as chaos_report
from elastictk.chaos import rows as crows
from elastictk.faults import Fault, plan_of
from elastictk.metrics import AgentMetrics, read_events
from elastictk.metrics.recovery import MARKS, NAMES, phases_ms, steps_redone, summary_line
from elastictk.metrics.steps import WorkerStepsBlock, goodput, totals
from elastictk.metrics import worker as worker_mod

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(ROOT / "examples" / "train.py")

marks = st.dictionaries(st.sampled_from(MARKS), st.floats(0, 1e6, allow_nan=False), max_size=len(MARKS))


@given(marks)
def test_phases_are_non_negative_omitted_when_unknown_and_never_more_than_the_span(m: dict[str, float]) -> None:
    p = phases_ms(m)
    assert all(v >= 0 for v in p.values())
    ends = dict(zip(NAMES, MARKS[1:]))
    assert all(ends[name] in m for name in p)  # a phase without its mark is omitted, not zero
    if m:
        assert sum(p.values()) <= (max(m.values()) - min(m.values())) * 1000 + 0.05 * len(p)


def test_phases_in_order_are_the_differences_of_their_marks() -> None:
    m = {"failed": 10.0, "acted": 10.012, "stopped": 10.052, "joined": 10.352, "started": 11.252,
         "resumed": 11.272, "stepped": 11.422}
    assert phases_ms(m) == {"detect": 12.0, "stop": 40.0, "rendezvous": 300.0, "start": 900.0,
                            "restore": 20.0, "first_step": 150.0}
    # in place: nothing stopped, no round; start runs from the act
    assert list(phases_ms({"failed": 1.0, "acted": 1.5, "started": 2.0, "resumed": 3.0})) == \
        ["detect", "start", "restore"]


@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_steps_redone_counts_the_steps_between_the_resume_point_and_the_last_done(last: int, resumed: int) -> None:
    n = steps_redone(last, resumed)
    assert n == len(range(resumed + 1, last + 1))  # steps resumed+1 .. last run twice
    assert n >= 0 and (n == 0) == (last <= resumed)


def test_the_summary_line_names_each_phase_with_medians() -> None:
    line = summary_line([{"detect": 10.0, "stop": 40.0}, {"detect": 14.0, "stop": 20.0, "first_step": 150.0},
                         {"detect": 12.0, "stop": 60.0}])
    assert line == "recovery time: detect 12 ms, stop 40 ms, first step 150 ms (3 recoveries, medians)"
    assert summary_line([]) is None


def test_the_histogram_and_the_redone_counter_in_the_exporters_text() -> None:
    reg = CollectorRegistry()
    m = AgentMetrics(reg, job="j", node="n")
    m("recovery", path="restart-all", phases_ms={"detect": 12.0, "stop": 40.0, "rendezvous": 300.0,
                                                  "start": 900.0, "restore": 20.0, "first_step": 150.0},
      steps_redone=2)
    m("recovery", path="in-place", phases_ms={"detect": 5.0, "start": 30.0}, steps_redone=1)
    text = generate_latest(reg).decode()
    labels = 'node="n",phase="{}",role="default",run_id="j"'
    for phase, count in (("detect", 2), ("stop", 1), ("rendezvous", 1), ("start", 2), ("restore", 1),
                         ("first_step", 1)):
        assert f"elastictk_recovery_phase_seconds_count{{{labels.format(phase)}}} {count}.0" in text, phase
    assert f'elastictk_recovery_phase_seconds_sum{{{labels.format("rendezvous")}}} 0.3' in text
    assert 'elastictk_steps_redone_total{node="n",role="default",run_id="j"} 3.0' in text


def test_goodput_does_not_count_redone_steps_as_useful() -> None:
    with WorkerStepsBlock(1) as block:
        w = worker_mod._Slot(block.path, 0)
        for _ in range(4):
            w.record(0.5)
        w.checkpoint()
        for _ in range(2):
            w.record(0.5)  # run, then redone after the failure
        kept = goodput(totals(block.snapshot(), block.epoch), 3.0)
        block.end_attempt()
        after = goodput(totals(block.snapshot(), block.epoch), 3.0)
        del w
    assert kept == 1.0 and after == 2.0 / 3.0


def test_the_chaos_table_has_a_column_per_phase_and_a_median_line() -> None:
    row = crows.FaultRow(0, "sigkill", "rank:1", "step 3", True, True, injected_at=1.0,
                                phases_ms={"detect": 1.0, "stop": 12.0, "rendezvous": 4.0, "start": 15.0,
                                           "restore": 49.0, "first_step": 12.0})
    plain = crows.FaultRow(1, "exit:3", "rank:0", "step 7", True, True, injected_at=2.0)
    tot = {"exit_code": 0, "wall_s": 3.0, "faults_fired": 2, "faults_planned": 2, "restarts": 1,
           "recovery_mean_s": 0.1, "recovery_max_s": 0.1, "goodput": 0.5, "running_share": 0.9,
           "steps_lost": 0, "checksum": None, "recovery_phases_ms": {"detect": 1.0, "restore": 49.0},
           "recoveries_timed": 3}
    text = chaos_report.render([row, plain], tot, [])
    head = next(x for x in text.splitlines() if x.startswith("#"))
    assert "fault to detection" in head and "detected after" not in head
    assert head.split("steps lost")[1].split() == ["detect", "phase", "ms", "stop", "ms", "rdzv", "ms", "start", "ms",
                                                   "restore", "ms", "1st", "step", "ms"]
    first = next(x for x in text.splitlines() if x.startswith("0 "))
    assert first.split()[-6:] == ["1", "12", "4", "15", "49", "12"]
    assert next(x for x in text.splitlines() if x.startswith("1 ")).split()[-6:] == ["-"] * 6
    assert "recovery phases (median of 3): detect 1 ms, restore 49 ms" in text


def test_an_injected_fault_gets_a_recovery_event_with_every_phase(tmp_path: Path) -> None:
    """A real job (2 gloo workers) under elastictk-chaos: rank 1 is killed at step 4, so the job
    restarts once; rank 0 exits 3 at step 8, past the budget, so the job then fails."""
    plan = plan_of([Fault.of("sigkill", "rank:1", at_step=4), Fault.of("exit:3", "rank:0", at_step=8)])
    plan.save(tmp_path / "plan.json")
    r = subprocess.run(
        [sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp_path / "r"), "--plan", "plan.json",
         "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--metrics-port", "0",
         "--", TRAIN, "--steps", "10", "--ckpt-every", "2", "--step-time", "0.01", "--ckpt-dir", "{run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    d = json.loads((tmp_path / "r" / "chaos-report.json").read_text())
    (rec,) = read_events(tmp_path / "r" / "chaos-events.jsonl", {"recovery"})
    phases = rec.fields["phases_ms"]
    assert list(phases) == list(NAMES), phases  # detect, stop, rendezvous, start, restore, first step
    assert all(v >= 0 for v in phases.values())
    injected = next(i["mono"] for i in d["injections"] if i["fault"] == 0)
    assert sum(phases.values()) <= (rec.mono - injected) * 1000  # within the failure .. first step
    # steps 1..3 ran, the checkpoint after step 2 covers two: step 3 is redone, as the output shows
    out = (tmp_path / "r" / "job-stdout.log").read_text().split("resumed at step ", 1)
    last, resumed = max(int(m) for m in re.findall(r"\] step (\d+) loss", out[0])), int(out[1].split()[0])
    assert rec.fields["steps_redone"] == steps_redone(last, resumed) == 1
    assert d["faults"][0]["phases_ms"] == phases and d["faults"][1]["phases_ms"] is None
    assert d["totals"]["recovery_phases_ms"] == phases and d["totals"]["recoveries_timed"] == 1
    assert "1st step ms" in r.stdout and "recovery phases (1 recovery): detect" in r.stdout
    stderr = (tmp_path / "r" / "job-stderr.log").read_text()
    line = next(x for x in stderr.splitlines() if "recovery time:" in x)
    assert line.endswith("(1 recovery)") and all(f"{w} " in line for w in ("detect", "stop", "rendezvous",
                                                                          "start", "restore", "first step"))
    assert stderr.index("Root cause") < stderr.index("recovery time:")  # the failed job's summary


def test_an_in_place_recovery_has_only_the_phases_that_apply(tmp_path: Path) -> None:
    """Under --recovery in-place nothing is stopped and no round is held: detect, start (the
    replacement), restore (the group re-formed) and first step, nothing else."""
    events = tmp_path / "events.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--recovery", "in-place", "--metrics-port", "0", "--event-log", str(events),
         str(ROOT / "examples" / "train_inplace.py"), "--steps", "20", "--crash", "6:1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = read_events(events, {"recovery"})
    (took,) = read_events(events, {"inplace_recovered"})
    (spawn,) = read_events(events, {"inplace_recovery"})
    phases = rec.fields["phases_ms"]
    assert rec.fields["path"] == "in-place" and list(phases) == ["detect", "start", "restore", "first_step"]
    assert phases["start"] == spawn.fields["spawn_ms"] and all(v >= 0 for v in phases.values())
    assert abs(phases["start"] + phases["restore"] - took.fields["took_ms"]) <= 0.2  # rounding
    assert "recovery time: detect" in r.stderr


def _redone_after(checkpoint_at: int | None, steps: int = 17) -> object:
    """The ``steps_redone`` of a restart-all recovery whose failed process ran ``steps`` steps and
    reported a checkpoint after ``checkpoint_at`` of them (None: it never reported one)."""
    from elastictk.agent.recovery import RecoveryWatch

    got: list[dict[str, object]] = []
    with WorkerStepsBlock(1) as block:
        w = worker_mod._Slot(block.path, 0)
        for i in range(1, steps + 1):
            w.record(0.01)
            if i == checkpoint_at:
                w.checkpoint()
        watch = RecoveryWatch(lambda kind, **f: got.append(f), block)
        watch.failed(None, 1.0, {os.getpid()})
        watch.stopped()
        watch.restarting(1)
        watch.finish()
        del w
    (event,) = got
    return event.get("steps_redone", "absent")


def test_steps_redone_is_unknown_when_the_script_never_reported_a_checkpoint() -> None:
    """A script that saves with torch.save and never calls etm.checkpoint(): the agent cannot
    know where it resumes, so it says unknown instead of counting every step as redone."""
    assert _redone_after(None) == "unknown"
    assert _redone_after(10) == 7  # resumed from step 10 after completing 17
