"""A node that arrives after its job ended exits with that job's outcome and one line saying it
ran nothing: 0 only if the job succeeded. A relaunch of an ended job id on a store that keeps
state (file, etcd) is the same case: it never silently reports success for a failed job, and
the line names the id and the fix (a fresh --rdzv-id)."""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from elastictk.testing.etcd import EtcdServer

ROOT = Path(__file__).resolve().parent.parent


def launch(backend: str, endpoint: str, job: str, script: Path, logs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastictk.run", "--nnodes", "1", "--nproc-per-node", "1",
         "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", job,
         "--max-restarts", "0", "--log-dir", str(logs), str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(params=["file", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    if request.param == "file":
        return "file", str(tmp_path / "rdzv")
    server: EtcdServer = request.getfixturevalue("etcd_server")
    return "etcd", server.endpoint


@pytest.mark.parametrize("code,first_exit,second_exit", [(0, 0, 0), (3, 1, 1)],
                         ids=["finished", "failed"])
def test_a_relaunch_of_an_ended_job_reports_its_outcome_and_runs_nothing(
        tmp_path: Path, store: tuple[str, str], code: int, first_exit: int, second_exit: int) -> None:
    backend, endpoint = store
    runs = tmp_path / "runs"
    runs.mkdir()
    script = tmp_path / "w.py"
    script.write_text(f"import os, sys\nopen(os.path.join({str(runs)!r}, str(os.getpid())), 'w').close()\n"
                      f"sys.exit({code})\n")
    job = f"rerun-{uuid.uuid4().hex[:8]}"
    first = launch(backend, endpoint, job, script, tmp_path / "logs1")
    assert first.returncode == first_exit, first.stderr
    assert len(list(runs.iterdir())) == 1
    second = launch(backend, endpoint, job, script, tmp_path / "logs2")
    assert second.returncode == second_exit, second.stderr
    assert len(list(runs.iterdir())) == 1, "the relaunch ran the workers again"
    last = second.stderr.strip().splitlines()[-1]
    assert "ran nothing" in last and job in last and "fresh --rdzv-id" in last, second.stderr
