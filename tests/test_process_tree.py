"""Stopping reaches whole process trees, honours the grace period, and nothing outlives the agent.

Real processes, real signals: workers start grandchildren (same session, own process group,
orphaned), ignore SIGTERM, or clean up on it; an agent process is SIGKILLed.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable

import psutil
import pytest

from elastictk.supervisor.env import Assignment
from elastictk.supervisor.forkserver import PreloadServer
from elastictk.supervisor.group import WorkerGroup
from elastictk.lifetime.reaper import is_child_subreaper
from elastictk.supervisor.spec import WorkerSpec, python_script_argv
from tests.helpers.supervisor_workers import STUBBORN_GRANDCHILD_SCRIPT, TERM_SCRIPT, TREE_SCRIPT

REPO = Path(__file__).resolve().parent.parent
ASSIGN = Assignment.homogeneous(0, 1, 2, master_addr="127.0.0.1", master_port=29500, run_id="tree")


def wait_for_files(paths: Iterable[Path], timeout: float = 60.0) -> None:
    """Test-side wait for workers to report readiness through files."""
    deadline = time.monotonic() + timeout
    missing = list(paths)
    while missing:
        missing = [p for p in missing if not p.exists()]
        if missing and time.monotonic() > deadline:
            pytest.fail(f"workers never wrote {missing}")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Running and not a zombie; a zombie child of this process is reaped on the way."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return True
    except psutil.NoSuchProcess:
        return False
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return False


def survivors(pids: Iterable[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def tree_pids(d: Path, ranks: int) -> list[int]:
    wait_for_files([d / f"tree.{lr}" for lr in range(ranks)])
    return [int(p) for lr in range(ranks) for p in (d / f"tree.{lr}").read_text().split()]


def script_spec(tmp_path: Path, text: str, *args: str, **kw: object) -> WorkerSpec:
    script = tmp_path / "worker.py"
    script.write_text(text)
    return WorkerSpec(python_script_argv(str(script), *args), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["subprocess", "preload"])
def test_stop_kills_grandchildren_in_the_session_in_other_groups_and_orphaned(
        tmp_path: Path, method: str) -> None:
    spec = script_spec(tmp_path, TREE_SCRIPT, str(tmp_path), local_world_size=2,
                       start_method=method)
    was_subreaper = is_child_subreaper()
    with PreloadServer(preload=[]) as server, \
            WorkerGroup(spec, tmp_path / "logs", preload_server=server) as g:
        g.start(0, ASSIGN)
        pids = tree_pids(tmp_path, 2)
        assert is_child_subreaper()
        # the orphan (4th pid of each rank) was reparented to this process, the subreaper
        assert psutil.Process(pids[3]).ppid() == os.getpid()
        assert all(alive(p) for p in pids)
        results = g.stop(grace=10)
        assert not [p for p in pids if psutil.pid_exists(p)], "stop() returned before reaping"
    assert is_child_subreaper() == was_subreaper, "close() must restore the subreaper flag"
    assert {r.signal_name for r in results.values()} == {"SIGTERM"}
    assert all(r.stopped for r in results.values())


def test_sigterm_ignoring_worker_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, TERM_SCRIPT, str(tmp_path), "ignore", local_world_size=1)
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, Assignment.homogeneous(0, 1, 1, master_addr="h", master_port=1, run_id="ign"))
        wait_for_files([tmp_path / "ready.0"])
        t0 = time.monotonic()
        results = g.stop(grace=1.0)
        elapsed = time.monotonic() - t0
    assert results[0].signal_name == "SIGKILL"
    assert elapsed >= 1.0, "SIGKILL came before the grace period ended"
    assert elapsed < 30


def test_sigterm_ignoring_grandchild_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, STUBBORN_GRANDCHILD_SCRIPT, str(tmp_path), local_world_size=1)
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, Assignment.homogeneous(0, 1, 1, master_addr="h", master_port=1, run_id="gc"))
        wait_for_files([tmp_path / "grandchild.pid"])
        grandchild = int((tmp_path / "grandchild.pid").read_text())
        t0 = time.monotonic()
        results = g.stop(grace=1.0)
        elapsed = time.monotonic() - t0
        assert not psutil.pid_exists(grandchild)
    assert results[0].signal_name == "SIGTERM"  # the worker itself went at once
    assert 1.0 <= elapsed < 30, "the grandchild was not given the grace period, or waited past it"


def test_grace_period_lets_a_worker_finish_its_sigterm_cleanup(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, TERM_SCRIPT, str(tmp_path), "cleanup", local_world_size=2,
                       env={"CLEANUP": "1.0"})
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, ASSIGN)
        wait_for_files([tmp_path / "ready.0", tmp_path / "ready.1"])
        t0 = time.monotonic()
        results = g.stop(grace=60)
        elapsed = time.monotonic() - t0
    assert [results[lr].exitcode for lr in (0, 1)] == [0, 0]
    assert (tmp_path / "cleaned.0").exists() and (tmp_path / "cleaned.1").exists()
    assert 1.0 <= elapsed < 60, "stop() returned before the cleanup or waited out the grace"


def test_grace_zero_kills_at_once(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, TERM_SCRIPT, str(tmp_path), "cleanup", local_world_size=1)
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, Assignment.homogeneous(0, 1, 1, master_addr="h", master_port=1, run_id="z"))
        wait_for_files([tmp_path / "ready.0"])
        assert g.stop(grace=0)[0].signal_name == "SIGKILL"
    assert not (tmp_path / "cleaned.0").exists()


def test_forwarded_signal_reaches_every_worker(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, TERM_SCRIPT, str(tmp_path), "ignore", local_world_size=2)
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, ASSIGN)
        wait_for_files([tmp_path / "ready.0", tmp_path / "ready.1"])
        g.signal_all(signal.SIGUSR1)
        results = g.wait(timeout=60)
        assert [results[lr].exitcode for lr in (0, 1)] == [7, 7]
        assert not any(r.stopped for r in results.values())


def test_wake_interrupts_a_blocked_wait(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, TERM_SCRIPT, str(tmp_path), "cleanup", local_world_size=1,
                       env={"CLEANUP": "0"})
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, Assignment.homogeneous(0, 1, 1, master_addr="h", master_port=1, run_id="w"))
        timer = threading.Timer(0.2, g.wake)
        timer.start()
        t0 = time.monotonic()
        assert g.wait_any(timeout=120) == []
        assert time.monotonic() - t0 < 60
        assert g.running == [0]
        timer.join()


@pytest.mark.parametrize("method", ["subprocess", "preload", "spawn"])
def test_sigkilled_agent_leaves_no_worker_or_grandchild(tmp_path: Path, method: str) -> None:
    agent = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.supervisor_agent", method, str(tmp_path / "logs"), str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert agent.stdout is not None
        ready, _, _ = select.select([agent.stdout], [], [], 120)
        assert ready and agent.stdout.readline() == b"started\n", "agent did not start its group"
        pids = tree_pids(tmp_path, 2)
        helpers = [int(p) for p in (tmp_path / "helpers").read_text().split()]
        assert len(helpers) == (2 if method == "preload" else 1)
        assert all(alive(p) for p in pids + helpers)
    finally:
        agent.kill()
        agent.wait(30)
        agent.stdout.close()  # type: ignore[union-attr]
    left = survivors(pids + helpers, timeout=15)
    assert not left, f"processes outlived their SIGKILLed agent: {left}"


def test_death_signal_is_delivered_at_once_if_the_parent_is_already_gone() -> None:
    # die_with_parent() names a parent that is not ours, as after a race with its death.
    child = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, time\n"
         "from elastictk.lifetime.reaper import die_with_parent\n"
         f"die_with_parent({os.getpid() + 10**7}, signal.SIGKILL)\n"
         "time.sleep(60)"], cwd=REPO)
    assert child.wait(60) == -signal.SIGKILL


def test_death_signal_fires_when_the_parent_dies(tmp_path: Path) -> None:
    # parent starts a child with die_with_parent(), reports its pid, then is SIGKILLed.
    code = (
        "import os, signal, subprocess, sys, time\n"
        "from functools import partial\n"
        "from elastictk.lifetime.reaper import die_with_parent\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "    preexec_fn=partial(die_with_parent, os.getpid(), signal.SIGKILL))\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE)
    assert parent.stdout is not None
    ready, _, _ = select.select([parent.stdout], [], [], 60)
    assert ready
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait(30)
    parent.stdout.close()
    assert not survivors([child], timeout=15)


def test_procfs_finds_every_descendant_and_its_command_line() -> None:
    """The chaos runner's view of a run's processes: a child and its grandchild, by /proc alone,
    and nothing once they are gone."""
    from elastictk.lifetime import procfs

    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys; p = subprocess.Popen(['sleep', '30']); "
                              "print(p.pid, flush=True); sys.stdin.read(); p.kill(); p.wait()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        below = procfs.descendants(os.getpid())
        assert {child.pid, grandchild} <= below
        # The child may print the pid while the grandchild is still inside execve (a vfork'ed
        # child wakes its parent before the new program's arguments are mapped): its command
        # line reads empty until then.
        until = time.monotonic() + 30
        while procfs.cmdline(grandchild) == "" and time.monotonic() < until:
            time.sleep(0.01)
        assert procfs.cmdline(grandchild) == "sleep 30"
        assert procfs.descendants(grandchild) == set()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    deadline = time.monotonic() + 10
    while grandchild in procfs.descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not {child.pid, grandchild} & procfs.descendants(os.getpid())
    assert procfs.cmdline(child.pid) is None
