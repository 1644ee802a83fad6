"""Process hygiene (issue #17): signals reach only processes still the workers', orphans of any
session are reaped, and no read from a worker can stall the agent loop.

Every process signalled or killed here is one this test started, by PID.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest

from elastictk.lifetime.handle import ProcessHandle
from elastictk.supervisor.env import Assignment
from elastictk.supervisor.forkserver import PreloadServer
from elastictk.supervisor.group import WorkerGroup
from elastictk.supervisor.spec import WorkerSpec, python_script_argv
from tests.helpers import supervisor_workers as sw


def assign(lws: int) -> Assignment:
    return Assignment.homogeneous(0, 1, lws, master_addr="127.0.0.1", master_port=29533,
                                  run_id="hygiene")


@pytest.fixture(scope="module")
def server() -> Iterator[PreloadServer]:
    with PreloadServer(preload=["json"]) as s:
        yield s


def script_spec(tmp_path: Path, text: str, lws: int, **kw: Any) -> WorkerSpec:
    path = tmp_path / "worker.py"
    path.write_text(text)
    return WorkerSpec(python_script_argv(str(path), str(tmp_path)), local_world_size=lws, **kw)


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def status(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


def in_thread(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """Run ``fn`` in a daemon thread; (returned in time, its value)."""
    out: dict[str, Any] = {}

    def run() -> None:
        out["value"] = fn()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), out.get("value")


def kill_if_ours(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- no signal to a session id that may have been reused ------------------------------------------

def test_stop_never_signals_a_stale_session_id_now_held_by_a_stranger(tmp_path: Path) -> None:
    """A replaced worker's session id is recorded; then the bookkeeping is pointed at a live
    process group of this test's own (what PID reuse would do). stop() must leave it alone."""
    spec = script_spec(tmp_path, sw.FIRST_RUN_FAILS_SCRIPT, 1, start_method="subprocess")
    stranger_code = ("import subprocess, sys, time\n"
                     "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                     "print(c.pid, flush=True)\n"
                     "time.sleep(600)\n")
    stranger = subprocess.Popen([sys.executable, "-c", stranger_code], start_new_session=True,
                                stdout=subprocess.PIPE)
    assert stranger.stdout is not None
    stranger_child = int(stranger.stdout.readline())
    try:
        with WorkerGroup(spec, tmp_path / "logs") as g:
            g.start(0, assign(1))
            (first,) = g.wait_any(timeout=60)
            assert first.exitcode == 3
            old_sid = first.pid
            g.respawn(0, restart_count=1, tag="replacement")
            # The replaced worker is gone; its id now "belongs" to the stranger's group.
            assert os.getpgid(stranger.pid) == stranger.pid != old_sid
            g.replaced[0] = dataclasses.replace(g.replaced[0], pid=stranger.pid)
            for session in g._sessions.all():
                if session.sid == old_sid:
                    session.sid = stranger.pid
            results = g.stop(grace=1)
            assert results[0].stopped and results[0].signal_name == "SIGTERM"
            assert stranger.poll() is None, "stop() signalled a process group that is not a worker's"
            assert status(stranger_child) not in (None, psutil.STATUS_ZOMBIE)
    finally:
        kill_if_ours(stranger_child)
        stranger.kill()
        stranger.wait(30)
        stranger.stdout.close()


def test_session_decision_only_held_leaders_or_pinned_members(tmp_path: Path) -> None:
    """The decision itself: a session whose leader has exited and was reaped is signalled only
    through members pinned while it was provably the worker's; a live leader's group is."""
    from elastictk.lifetime.reaper import TrackedSession, Tree, signal_trees

    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    leader = subprocess.Popen(sleep, start_new_session=True)
    stranger = subprocess.Popen(sleep, start_new_session=True)
    try:
        live = TrackedSession(ProcessHandle(leader.pid))
        dead_proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
        dead = TrackedSession(ProcessHandle(dead_proc.pid))
        dead_proc.wait(30)  # reaped: its id is free for anyone
        dead.release_leader()
        dead.sid = stranger.pid  # ... and given to the stranger
        dead.refresh(Tree())
        assert not dead.leader_held() and not dead.proven() and dead.members == {}
        signal_trees([dead], signal.SIGKILL)
        assert stranger.poll() is None
        signal_trees([live], signal.SIGKILL)
        assert leader.wait(30) == -signal.SIGKILL
        live.release_leader()
        live.close()
        dead.close()
    finally:
        for p in (leader, stranger):
            p.kill()
            p.wait(30)


def test_a_replaced_workers_leftover_processes_still_die_with_the_attempt(tmp_path: Path) -> None:
    """What a replaced worker left in its session is pinned at its exit and stopped later."""
    code = ("import os, subprocess, sys, time\n"
            "marker = os.path.join(sys.argv[1], 'ran')\n"
            "if not os.path.exists(marker):\n"
            "    open(marker, 'w').close()\n"
            "    c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "    open(os.path.join(sys.argv[1], 'left.pid'), 'w').write(str(c.pid))\n"
            "    sys.exit(3)\n"
            "time.sleep(600)\n")
    spec = script_spec(tmp_path, code, 1, start_method="subprocess")
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, assign(1))
        (first,) = g.wait_any(timeout=60)
        left = int((tmp_path / "left.pid").read_text())
        try:
            assert first.exitcode == 3 and status(left) not in (None, psutil.STATUS_ZOMBIE)
            g.respawn(0, restart_count=1, tag="replacement")
            g.wait_any(timeout=2.5)  # sweeps run; the pinned leftover keeps its session tracked
            g.stop(grace=5)
            assert status(left) is None, "a replaced worker's leftover survived stop()"
        finally:
            kill_if_ours(left)


# -- orphans of any session are reaped ---------------------------------------------------------

def test_an_orphan_that_called_setsid_is_reaped_and_exit_statuses_stay_right(tmp_path: Path) -> None:
    spec = script_spec(tmp_path, sw.SETSID_ORPHAN_SCRIPT, 2, start_method="subprocess",
                       env={"EXIT_AFTER": "2"})
    orphan = None
    with WorkerGroup(spec, tmp_path / "logs") as g:
        g.start(0, assign(2))
        try:
            wait_for(lambda: (tmp_path / "orphan.pid").exists(), 60, "the orphan's pid")
            orphan = int((tmp_path / "orphan.pid").read_text())
            assert os.getsid(orphan) == orphan  # its own session, no worker's
            results = {}
            deadline = time.monotonic() + 10
            while (status(orphan) is not None or 1 not in results) and time.monotonic() < deadline:
                for r in g.wait_any(timeout=0.2):
                    results[r.local_rank] = r
            assert status(orphan) is None, "the orphan is still a zombie under the agent"
            assert results[1].exitcode == 3 and not results[1].stopped
            final = g.stop(grace=5)
            assert final[0].signal_name == "SIGTERM" and final[1].exitcode == 3
        finally:
            if orphan is not None and status(orphan) == psutil.STATUS_ZOMBIE:
                os.waitpid(orphan, os.WNOHANG)


# -- no blocking read from a worker ------------------------------------------------------------

@pytest.mark.parametrize("method", ["fork", "preload"])
def test_a_worker_frozen_mid_send_stalls_neither_wait_any_nor_stop(
        tmp_path: Path, method: str, server: PreloadServer) -> None:
    spec = WorkerSpec(sw.freeze_mid_send, args=(1_000_000, 30_000), local_world_size=1,
                      start_method=method)
    with WorkerGroup(spec, tmp_path / "logs", preload_server=server) as g:
        g.start(0, assign(1))
        pid = g.pids()[0]
        try:
            wait_for(lambda: status(pid) == psutil.STATUS_STOPPED, 60, "the worker to freeze")
            t0 = time.monotonic()
            done, got = in_thread(lambda: g.wait_any(timeout=1.0), timeout=20)
            assert done, "wait_any blocked reading a frozen worker's half-sent return value"
            assert got == [] and time.monotonic() - t0 < 20
            assert g.running == [0]
            done, results = in_thread(lambda: g.stop(grace=1), timeout=60)
            assert done, "stop() blocked on a frozen worker's half-sent return value"
            assert results[0].stopped and results[0].return_value is None
        finally:
            if status(pid) is not None:
                kill_if_ours(pid)
