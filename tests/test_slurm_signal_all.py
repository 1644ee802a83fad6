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


def _mask(sigs: tuple[int, ...]) -> int:
    return sum(1 << (s - 1) for s in sigs)


def _wait_started(pid: int, timeout: float = 120) -> None:
    """Until the death watch runs its own code: it ignores SIGINT (it always did) and then the
    job's other signals, one call each; a signal sent after the first and before the last (a
    loaded host can stop it in between) would meet a starting process, not its choice. So the
    event is SIGINT's bit, and then every bit the watch sets or the check below judges."""
    deadline = time.monotonic() + timeout
    while not _ignored(pid) & _mask((signal.SIGINT,)):
        assert time.monotonic() < deadline, "the helper never started"
        time.sleep(0.01)
    settled = time.monotonic() + 5  # past the SIGINT bit, the rest is five calls away
    while _ignored(pid) & _mask(JOB_SIGNALS) != _mask(JOB_SIGNALS) and time.monotonic() < settled:
        time.sleep(0.01)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _pending(pid: int) -> int:
    """Signals sent to ``pid`` and not yet delivered (an ignored one is never pending)."""
    with open(f"/proc/{pid}/status") as f:
        return sum(int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:")))


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
        deadline = time.monotonic() + 60  # a loaded host may run the helper seconds later
        while time.monotonic() < deadline and _state(pid) not in "ZX" and _pending(pid) & _mask(JOB_SIGNALS):
            time.sleep(0.01)  # delivered (its action taken) once no longer pending
        time.sleep(0.3)  # a default action (termination) is under way by now
        assert _state(pid) not in ("Z", "X"), f"the {helper} died of a signal meant for the job"
    finally:
        owner.close()
