"""examples/slurm/train.sbatch runs as written, with a fake srun: two tasks on this host
(SLURM_* as srun sets them, localhost as the node), each an elastictk-run agent, the store's
host started a second after the other: the other waits for it, the job forms from Slurm's
defaults alone, trains and ends 0 with its newest step on disk."""
from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

from elastictk.agent.preempt import newest_complete_step
from elastictk.slurm.wait import wait_for_store
from elastictk.store.endpoint import Endpoint
from tests.test_slurm_defaults import _free_job_id, slurm_env

ROOT = Path(__file__).resolve().parent.parent
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for t in 1 0; do  # the store's host last: the other task must wait for it, not fail
  SLURM_STEP_ID=0 SLURM_NNODES=2 SLURM_JOB_NODELIST=localhost,localhost SLURMD_NODENAME=localhost \\
    SLURM_PROCID=$t SLURM_LOCALID=$t "$@" &
  pids+=($!)
  sleep 1
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def test_the_sbatch_example_trains_under_a_fake_srun(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    job = _free_job_id()
    env = slurm_env(SLURM_JOB_ID=job, SLURM_STEP_ID="-", SLURM_NNODES="-", SLURM_JOB_NODELIST="-",
                    SLURMD_NODENAME="-", SLURM_PROCID="-", SLURM_LOCALID="-",
                    PATH=f"{bin_dir}:{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
                    ELASTICTK_RDZV_TOKEN="t0ken-for-the-test", CKPT=str(tmp_path / "ckpt"), NPROC="1",
                    STEPS="6", PET_RDZV_CONF="last_call_timeout=1")
    done = subprocess.run(["bash", str(ROOT / "examples" / "slurm" / "train.sbatch")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert out.count(f"under Slurm job {job} step 0 (2 node(s)") == 2, out
    assert out.count("waiting up to 600s for the store at localhost:") == 1, out
    assert "finished at step 6" in out and newest_complete_step(str(tmp_path / "ckpt")) == 6, out
    assert (tmp_path / "logs" / job / "localhost").is_dir()


def test_waiting_for_the_store_host_ends_at_its_deadline() -> None:
    said: list[str] = []
    t0 = time.monotonic()
    assert not wait_for_store(Endpoint("node01", 1), 0.5, said.append, ping=lambda e, t: "connection refused")
    assert 0.5 <= time.monotonic() - t0 < 5 and len(said) == 1 and "node01:1" in said[0]
    answers = iter(["connection refused", None])
    assert wait_for_store(Endpoint("node01", 1), 30, said.append, ping=lambda e, t: next(answers))
