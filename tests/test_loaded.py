"""``make test-loaded``'s wrapper (tests/helpers/loaded.py): one busy process per asked core
runs beside the command, and none outlives it, when the command fails or the wrapper is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The command: lists its siblings (the hogs, children of the wrapper), then fails with 3.
SIBLINGS = """\
import os, sys
parent = os.getppid()
kids = open(f"/proc/{parent}/task/{parent}/children").read().split()
open(sys.argv[1] + ".me", "w").write(str(os.getpid()))
open(sys.argv[1], "w").write(" ".join(k for k in kids if int(k) != os.getpid()))
sys.exit(3)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids: list[int], limit: float = 60) -> list[int]:
    deadline = time.monotonic() + limit  # far past a loaded machine's; a death signal is at once
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _running(p)]


def test_hogs_run_beside_a_failing_command_and_are_killed_after_it(tmp_path: Path) -> None:
    seen = tmp_path / "hogs"
    r = subprocess.run([sys.executable, "-m", "tests.helpers.loaded", "--hogs", "2", "--", sys.executable,
                        "-c", SIBLINGS, str(seen)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr  # the command's own exit
    hogs = [int(p) for p in seen.read_text().split()]
    assert len(hogs) == 2, hogs
    left = [p for p in hogs if _running(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "a hog outlived the run"
    assert "exit 3 in" in r.stderr and "beside 2 busy process(es)" in r.stderr, r.stderr


def test_a_killed_wrapper_leaves_no_hog(tmp_path: Path) -> None:
    seen = tmp_path / "hogs"
    waiter = f"import os, time\n{SIBLINGS.split('sys.exit')[0]}time.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.loaded", "--hogs", "1", "--", sys.executable,
                             "-c", waiter, str(seen)], cwd=ROOT, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (seen.exists() and seen.read_text()) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    command = int(Path(f"{seen}.me").read_text())
    hogs = [int(p) for p in seen.read_text().split()]
    proc.kill()
    proc.wait()
    left = _wait_gone(hogs)
    for pid in [command, *left]:  # the command is the caller's to end (as pytest is make's)
        os.kill(pid, signal.SIGKILL)
    assert len(hogs) == 1 and not left, "the hog outlived its killed wrapper"
