"""--signals-to-handle means what it means to torchrun: each listed signal (default SIGTERM,
SIGINT, SIGHUP, SIGQUIT) stops the job, the workers getting that very signal, the agent exiting
128+N; SIGUSR1/SIGUSR2 left out of the list are forwarded while the job runs on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = """import os, signal, sys, time
out = sys.argv[1]
rank = os.environ["RANK"]
def got(signum, _frame):
    with open(os.path.join(out, f"got-{rank}"), "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    if signum != signal.SIGUSR2 or os.environ.get("STOP_ON_USR2"):
        sys.exit(0)
for s in (signal.SIGQUIT, signal.SIGUSR2):
    signal.signal(s, got)
open(os.path.join(out, f"ready-{rank}"), "w").close()
deadline = time.monotonic() + 600  # a hang guard: the test says when (its finish file)
while time.monotonic() < deadline and not os.path.exists(os.path.join(out, "finish")):
    time.sleep(0.05)
"""


def _run(tmp_path: Path, sig: signal.Signals, flags: list[str], stop_on_usr2: bool) -> tuple[int, str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ELASTICTK_", "TORCHELASTIC_"))}
    if stop_on_usr2:
        env["STOP_ON_USR2"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "elastictk.run", "--standalone", "--nproc-per-node", "2",
                             "--shutdown-timeout", "5", *flags, str(script), str(tmp_path)],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240  # far past a loaded host's start of two workers
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        proc.send_signal(sig)
        if not stop_on_usr2:  # forwarded: once both workers got it, the job ends on its own
            while not all((tmp_path / f"got-{r}").exists() for r in (0, 1)):
                assert proc.poll() is None and time.monotonic() < deadline, "the signal was not forwarded"
                time.sleep(0.05)
            (tmp_path / "finish").touch()
        err = proc.communicate(timeout=240)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.parametrize("sig,flags", [(signal.SIGQUIT, []),
                                       (signal.SIGUSR2, ["--signals-to-handle", "SIGUSR2,SIGTERM"])],
                         ids=["SIGQUIT-by-default", "SIGUSR2-listed"])
def test_a_listed_signal_stops_the_job_and_reaches_every_worker(
        tmp_path: Path, sig: signal.Signals, flags: list[str]) -> None:
    code, err = _run(tmp_path, sig, flags, stop_on_usr2=True)
    assert code == 128 + sig, err[-3000:]
    for r in (0, 1):  # each worker got the signal itself, before any SIGKILL
        assert (tmp_path / f"got-{r}").read_text() == f"{sig.name}\n", err[-3000:]
    assert "Traceback" not in err


def test_sigusr2_left_out_of_the_list_is_forwarded_and_the_job_runs_on(tmp_path: Path) -> None:
    code, err = _run(tmp_path, signal.SIGUSR2, [], stop_on_usr2=False)
    assert code == 0, err[-3000:]
    for r in (0, 1):
        assert (tmp_path / f"got-{r}").read_text() == "SIGUSR2\n"
