"""``elastictk-chaos --compare-fault-free`` for a newcomer's script: ``{run_dir}`` exists before
the script runs, the fault-free run's output is kept where the error points, and a script that
prints no ``final checksum <hex>`` line is told in one line what to print.

Plain scripts (no torch import, one worker), so each run takes seconds; the comparison with a
real training job is in test_chaos.py.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Writes into {run_dir} before anything else (as a checkpoint would), then prints its line.
SCRIPT = """
import os, sys
run_dir, line = sys.argv[1], sys.argv[2]
with open(os.path.join(run_dir, "ckpt"), "w") as f:
    f.write("0")
print("training done", flush=True)
if line:
    print(line, flush=True)
"""
FLAGS = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "--faults", "0", "--timeout", "120"]


def chaos(tmp: Path, line: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "job.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp / "r"),
                           "--compare-fault-free", *FLAGS, "--", str(script), "{run_dir}", line],
                          cwd=tmp, capture_output=True, text=True, timeout=240)


def errors(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [x for x in r.stderr.splitlines() if x.startswith("elastictk-chaos: error")]


def test_run_dir_exists_and_the_fault_free_output_is_kept(tmp_path: Path) -> None:
    r = chaos(tmp_path, "final checksum 00c0ffee")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[ok] result equals the fault-free run's: checksum 00c0ffee vs fault-free 00c0ffee" in r.stdout
    out = tmp_path / "r"
    assert (out / "fault-free-run" / "ckpt").read_text() == "0"
    assert (out / "chaos-run" / "ckpt").read_text() == "0"
    kept = (out / "fault-free-logs" / "job-stdout.log").read_text()
    assert "training done" in kept and "final checksum 00c0ffee" in kept
    assert (out / "fault-free-logs" / "job-stderr.log").exists()


def test_no_checksum_line_says_what_to_print(tmp_path: Path) -> None:
    r = chaos(tmp_path, "")
    assert r.returncode == 1
    (line,) = errors(r)
    stdout = tmp_path / "r" / "fault-free-logs" / "job-stdout.log"
    assert "printed no 'final checksum <hex>' line" in line and "must print one" in line
    assert line.endswith(f"its output is in {stdout}")
    assert "training done" in stdout.read_text()  # the error points at a file that holds it


def test_a_failed_fault_free_run_points_at_its_kept_output(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import sys; print('boom', file=sys.stderr); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp_path / "r"),
                        "--compare-fault-free", *FLAGS, "--", str(script)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1
    (line,) = errors(r)
    logs = tmp_path / "r" / "fault-free-logs"
    assert "the fault-free run failed (exit 1)" in line and str(logs) in line
    assert "boom" in (logs / "job-stderr.log").read_text()
