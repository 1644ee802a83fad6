"""Slurm signals every process of a job step (``scancel --signal``, ``--signal=USR1@T``: its
process tracking reaches all of them), not only the task: elastictk-run's own helper processes
must live through the signals meant for the job, or the workers die with them (the preload
server is their parent, with a death signal) before they can commit their step."""
from __future__ import annotations

import os
import signal
import time

import pytest

from elastictk.lifetime.deathwatch import DeathWatch
from elastictk.supervisor.forkserver import PreloadServer

JOB_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _ignored(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))


def _wait_started(pid: int, timeout: float = 30) -> None:
    """Until the death watch runs its own code: it ignores SIGINT (it always did), so a
    signal sent now meets the dispositions it chose, not those of a starting interpreter."""
    deadline = time.monotonic() + timeout
    while not _ignored(pid) & (1 << (signal.SIGINT - 1)):
        assert time.monotonic() < deadline, "the helper never started"
        time.sleep(0.01)


@pytest.mark.parametrize("helper", ["preload server", "death watch"])
def test_the_agents_helpers_live_through_the_signals_of_a_job(helper: str) -> None:
    owner: PreloadServer | DeathWatch = PreloadServer(preload=[]) if helper == "preload server" else DeathWatch()
    owner.start()
    try:
        pid = owner.pid
        assert pid is not None
        if isinstance(owner, PreloadServer):
            owner.wait_ready()
        else:
            _wait_started(pid)
        for sig in JOB_SIGNALS:
            os.kill(pid, sig)
        time.sleep(0.3)  # a default action (termination) would have happened by now
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        assert state not in ("Z", "X"), f"the {helper} died of a signal meant for the job"
    finally:
        owner.close()
