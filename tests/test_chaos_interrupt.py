"""An interrupted ``elastictk-chaos`` writes the partial report and exits 128+N; piped into a
log, its progress is a line per fault or restart and one every few seconds, not one per step."""
from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elastictk.chaos.progress import Progress
from elastictk.chaos.record import Injection, RunRecord
from elastictk.faults import Fault, plan_of

# Counts steps forever (the chaos run must be interrupted to end), printing each one.
FOREVER = """
import time
import elastictk.faults as faults
step = 0
while True:
    faults.fault_point(step)
    print(f"step {step}", flush=True)
    step += 1
    time.sleep(0.05)
"""


@pytest.mark.parametrize("sig,burst", [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGTERM, 5)],
                         ids=["SIGINT", "SIGTERM", "SIGTERM-x5"])
def test_an_interrupted_run_writes_the_partial_report(tmp_path: Path, sig: signal.Signals, burst: int) -> None:
    """A burst (``timeout`` and a shell both signalling, an impatient operator) ends the run as one
    signal does: the handler only raises a flag, so a second one arriving inside the first cannot
    deadlock the process (it did with a ``threading.Event``: a run hung 11 minutes)."""
    (tmp_path / "job.py").write_text(FOREVER)
    plan_of([Fault.of("exit:3", "rank:0", at_step=3)]).save(tmp_path / "plan.json")
    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "elastictk.chaos", "--report-dir", str(out), "--plan",
                             "plan.json", "--standalone", "--nproc-per-node", "1", "--max-restarts", "3",
                             "--timeout", "200", "--", str(tmp_path / "job.py")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        fired = out / "chaos-faults.jsonl"
        while not (fired.exists() and '"fault"' in fired.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the fault never fired"
            time.sleep(0.1)
        launcher = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        time.sleep(0.5)  # the restart under way
        for _ in range(burst):
            proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    d = json.loads((out / "chaos-report.json").read_text())
    assert d["interrupted"] == sig.name and d["totals"]["stopped"] == sig.name
    assert [i["fault"] for i in d["injections"]][:1] == [0] and d["faults"][0]["fired"]
    assert f"interrupted by {sig.name}: a partial report" in stderr
    assert "chaos-report.json" in stderr and "exit:3" in stdout  # the table printed too
    assert (out / "job-stdout.log").exists() and (out / "chaos-timeline.png").exists()
    assert not [pid for pid in launcher if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_off_a_terminal_is_throttled() -> None:
    """200 steps over 30 s with one fault: a handful of lines, the fault's among them, the last
    state at the end; before, one line per step."""
    clock, stream = Clock(), io.StringIO()
    plan = plan_of([Fault.of("exit:3", "rank:0", at_step=100)])
    prog = Progress(plan, 3, stream=stream, every=10.0, clock=clock)
    rec = RunRecord(argv=[], started=0.0)
    for step in range(200):
        clock.now = step * 0.15
        rec.steps.append((clock.now, step))
        if step == 100:
            rec.injections.append(Injection(0, "exit:3", "rank:0", clock.now, 1, step=100))
        prog(rec)
    prog.done()
    lines = stream.getvalue().splitlines()
    assert 3 <= len(lines) <= 8, lines
    assert any("step 100  faults 1/1" in x for x in lines)  # the fault, when it fired
    assert "step 199  faults 1/1" in lines[-1]
    assert all(x.startswith("elastictk-chaos: ") for x in lines)


def test_progress_on_a_terminal_updates_one_line() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    clock, stream = Clock(), Tty()
    prog = Progress(plan_of([]), 0, stream=stream, clock=clock)
    rec = RunRecord(argv=[], started=0.0)
    for step in range(5):
        rec.steps.append((0.0, step))
        prog(rec)
    prog.done()
    assert stream.getvalue().count("\r") == 5 and stream.getvalue().endswith("\n")
