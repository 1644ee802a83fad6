"""``elastictk-chaos`` as the tests run it: a subprocess with its report in ``<tmp>/r``."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def chaos(tmp: Path, *args: str, timeout: float = 240,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "elastictk.chaos", "--report-dir", str(tmp / "r"), *args],
                       cwd=tmp, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        # Shown with a failing test only (captured output): the agents' own lines, which the
        # chaos output does not carry, and which go with the temporary directory.
        logs = tmp / "r" / "job-stderr.log"
        if logs.exists():
            print(f"--- tail of {logs} ---\n" + logs.read_text(errors="replace")[-6000:])
    return r


def report(tmp: Path) -> dict:
    return json.loads((tmp / "r" / "chaos-report.json").read_text())
