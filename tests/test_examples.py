"""The examples users copy from must keep working: make demo's driver and the custom launcher."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_survives_two_worker_deaths_with_the_fault_free_checksum() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--workers", "2", "--steps", "30"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "demo passed" in r.stdout and "2 restarts" in r.stdout
    assert "SIGKILL rank 1" in r.stdout, "the second fault came from outside the worker"


def test_custom_launcher_restarts_function_workers() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_launcher.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "succeeded after 1 restart(s)" in r.stdout
    for rank in range(3):
        assert f"hello from rank {rank} of 3 (restart 1)" in r.stdout
