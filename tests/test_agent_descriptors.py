"""Restarts must not cost the agent descriptors: a job that restarts for weeks would run out
(each round cloned two store connections that were never closed: ~4 sockets per restart)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROBE = str(Path(__file__).resolve().parent / "helpers" / "fd_probe.py")
# elastictk-run in this process, with its own PID put where the probe's argv says {agent}
LAUNCH = ("import os, sys; from elastictk.run import console_main; "
          "sys.argv = ['elastictk-run', *[a.replace('{agent}', str(os.getpid())) for a in sys.argv[1:]]]; "
          "console_main()")


def test_the_agent_holds_as_many_sockets_after_twelve_restarts_as_after_two(tmp_path: Path) -> None:
    out, until = tmp_path / "sockets.txt", 12
    r = subprocess.run([sys.executable, "-c", LAUNCH, "--standalone", "--nproc-per-node", "2",
                        "--max-restarts", str(until), PROBE, "--agent", "{agent}", "--until", str(until),
                        "--out", str(out)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    counts = dict(tuple(map(int, line.split())) for line in out.read_text().splitlines())
    assert set(counts) == {2, until}, counts
    assert counts[until] <= counts[2] + 1, f"the agent's sockets at restart 2 and {until}: {counts}"
