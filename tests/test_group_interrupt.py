"""A terminating signal during the start of a large group is acted on before the next worker
starts, not after the last: ``WorkerGroup.interrupt`` (what the agent's SIGTERM handler calls)."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from elastictk.supervisor.env import Assignment
from elastictk.supervisor.group import StartInterrupted, WorkerGroup
from elastictk.supervisor.spec import WorkerSpec
from tests.helpers.procs import cmdline

WORKERS = 24


def _spec(n: int) -> WorkerSpec:
    return WorkerSpec([sys.executable, "-c", "import time; time.sleep(60)"], local_world_size=n,
                      start_method="subprocess")


def _assignment(n: int) -> Assignment:
    return Assignment.homogeneous(0, 1, n, master_addr="127.0.0.1", master_port=29512, run_id="job",
                                  max_restarts=0)


def test_an_interrupt_during_start_stops_it_before_the_next_worker(tmp_path: Path) -> None:
    started: list[int] = []
    with WorkerGroup(_spec(WORKERS), tmp_path) as g:
        def interrupt_after_two() -> None:
            deadline = time.monotonic() + 60
            while len(g.pids()) < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            started.extend(g.pids().values())
            g.interrupt()

        t = threading.Thread(target=interrupt_after_two)
        t.start()
        with pytest.raises(StartInterrupted, match=f"of {WORKERS} workers had started"):
            g.start(0, _assignment(WORKERS))
        t.join(60)
        assert len(started) >= 2
        assert len(g.results) < WORKERS, "every worker started: the interrupt was not acted on"
        assert g.running == []
    for pid in started:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_group_interrupted_before_start_starts_nothing(tmp_path: Path) -> None:
    me = psutil.Process()
    with WorkerGroup(_spec(2), tmp_path) as g:
        g.interrupt()
        with pytest.raises(StartInterrupted, match="after 0 of 2"):
            g.start(0, _assignment(2))
        assert g.pids() == {} and g.running == []
    assert not [c for c in me.children() if "time.sleep(60)" in cmdline(c)]


def test_without_an_interrupt_every_worker_starts(tmp_path: Path) -> None:
    with WorkerGroup(_spec(3), tmp_path) as g:
        g.start(0, _assignment(3))
        assert len(g.pids()) == 3
        g.stop(grace=0)
