"""Watchdog timers end to end: real worker processes, a real reaper, real signals.

Each worker is a small script in ``tmp_path`` started with the environment a ``TimerServer``
gives its workers; the test plays the agent (registers the PID, waits for the exit).
"""
from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator, Optional

import psutil
import pytest

from elastictk import timer
from elastictk.timer import Expiry, TimerError, TimerServer
from elastictk.lifetime.handle import ProcessHandle
from elastictk.lifetime.procfs import start_time

PRELUDE = "import os, sys, time\nfrom elastictk import timer\n"


@pytest.fixture
def server() -> Iterator[TimerServer]:
    srv = TimerServer(2)
    try:
        yield srv
    finally:
        srv.close()


class Worker:
    """A worker script started with the timer environment of ``server`` for ``local_rank``."""

    def __init__(self, tmp: Path, name: str, body: str, server: TimerServer, local_rank: int = 0,
                 extra_env: Optional[dict[str, str]] = None) -> None:
        self.source = PRELUDE + textwrap.dedent(body)
        self.path = tmp / f"{name}.py"
        self.path.write_text(self.source)
        env = {**os.environ, **server.worker_env(), "LOCAL_RANK": str(local_rank),
               **(extra_env or {})}
        self.proc = subprocess.Popen([sys.executable, "-u", str(self.path)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._buf = b""

    def line_of(self, marker: str) -> int:
        """The 1-based line number of the script line containing ``marker``."""
        return next(i for i, text in enumerate(self.source.splitlines(), 1) if marker in text)

    def read_line(self, timeout: float = 60.0) -> str:
        """The next line the worker prints (waits for it)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                self.kill()
                pytest.fail(f"{self.path.name} printed nothing for {timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                pytest.fail(f"{self.path.name} exited early: {self.stderr()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.path.name} did not exit within {timeout} s")

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def close(self) -> None:
        self.kill()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.close()


def start(workers: list[Worker], *args: object, **kwargs: object) -> Worker:
    w = Worker(*args, **kwargs)  # type: ignore[arg-type]
    workers.append(w)
    return w


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    """Test-side wait for the reaper thread to have acted (it reports no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def only_expiry(server: TimerServer) -> Expiry:
    wait_until(lambda: server.stats["expired"] >= 1, what="an expiry")
    found = server.expiries()
    assert len(found) == 1, found
    return found[0]


# -- reaping -----------------------------------------------------------------------------------
STUCK = """
def main():
    with timer.expires(after=0.2, scope="sleepy"):
        print("armed", flush=True)
        time.sleep(60)  # STUCK HERE
main()
"""


def test_stuck_worker_is_dumped_then_killed_with_scope_and_line(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    w = start(workers, tmp_path, "stuck", STUCK, server)
    server.watch({0: w.proc.pid}, ranks={0: 3}, report_dir=tmp_path / "attempt_0")
    assert w.read_line() == "armed"
    assert w.wait() == -signal.SIGKILL
    e = only_expiry(server)
    assert (e.rank, e.local_rank, e.pid, e.scope) == (3, 0, w.proc.pid, "sleepy")
    line = w.line_of("STUCK HERE")
    assert e.where == f"stuck.py:{line} (main)"
    assert e.headline() == f"rank 3 stuck in sleepy at stuck.py:{line} (main)"
    assert f'stuck.py", line {line} in main' in e.stacks
    assert 0 <= e.late_s < 5.0  # the contract is ~10 ms; a loaded machine gets slack
    assert e.deadline <= e.detected_at
    report = tmp_path / "attempt_0" / "0" / "timer_expired.txt"
    assert e.report_path == str(report)
    wait_until(report.exists, what="the report file")
    assert e.headline() in report.read_text() and "faulthandler" in report.read_text()
    data = json.loads((report.parent / "timer_expired.json").read_text())
    assert Expiry.from_json(data) == e and data["reason"] == "timer_expired"
    assert server.stats["killed"] == 1


def test_nested_scopes_report_the_expired_inner_one_exactly_once(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    body = """
    with timer.expires(after=60, scope="step"):
        with timer.expires(after=0.2, scope="inner"):
            with timer.expires(after=0.3, scope="innermost"):
                print("armed", flush=True)
                time.sleep(60)  # STUCK HERE
    """
    w = start(workers, tmp_path, "nested", body, server)
    server.watch({0: w.proc.pid})
    w.read_line()
    assert w.wait() == -signal.SIGKILL
    e = only_expiry(server)
    assert e.scope == "inner" and e.where == f"nested.py:{w.line_of('STUCK HERE')} (<module>)"
    held = dict(e.held)
    assert set(held) == {"step", "inner", "innermost"}
    assert held["step"] < 0 < held["inner"]  # step still had time left; inner was overdue
    assert [s for s, _ in e.held][0] == "inner"  # most overdue first
    time.sleep(0.1)  # more scans of the dead worker's armed slots report nothing new
    assert server.expiries() == [] and server.stats["expired"] == 1


def test_timers_released_in_time_never_kill(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    body = """
    @timer.expires(after=0.5)
    def step(i):
        return i + 1

    reused = timer.expires(0.5, "reused")
    total = 0
    for i in range(2000):
        with timer.expires(after=0.5, scope="with"):
            total = step(total)
        t = timer.acquire(0.5, "explicit")
        timer.release(t)
        with reused:
            pass
    with timer.expires(after=2.0, scope="slow but in time"):
        time.sleep(0.3)
    time.sleep(0.7)  # every deadline above has now passed, with nothing held
    print(total, timer.status()["held"], timer.status()["attached"] is not None, flush=True)
    """
    w = start(workers, tmp_path, "in_time", body, server)
    server.watch({0: w.proc.pid})
    assert w.read_line() == "2000 0 True"
    assert w.wait() == 0
    assert server.stats["expired"] == 0 and server.expiries() == []


def test_hundreds_of_thousands_of_back_to_back_pairs_never_fail(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    body = """
    n = 0
    for _ in range(100_000):
        with timer.expires(after=30, scope="a"):
            with timer.expires(after=30, scope="b"):
                n += 2
        timer.release(timer.acquire(30, "c"))
        n += 1
    print(n, timer.status()["held"], flush=True)
    """
    w = start(workers, tmp_path, "load", body, server)
    server.watch({0: w.proc.pid})
    assert w.read_line(timeout=120) == "300000 0"
    assert w.wait() == 0
    assert server.stats["expired"] == 0


def test_a_stopped_worker_is_continued_to_dump_then_killed(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    body = """
    import signal
    with timer.expires(after=0.2, scope="frozen"):
        print("armed", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # STUCK HERE
        time.sleep(60)
    """
    w = start(workers, tmp_path, "stopped", body, server)
    server.watch({0: w.proc.pid})
    w.read_line()
    assert w.wait() == -signal.SIGKILL
    e = only_expiry(server)
    assert e.scope == "frozen"
    assert e.where is not None and e.where.startswith("stopped.py:")
    assert e.stacks  # SIGCONT let the handler run before the kill


# -- never the wrong process -------------------------------------------------------------------
def test_a_reused_pid_is_never_signalled(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    body = """
    t = timer.acquire(0.1, "old")
    print("armed", flush=True)
    time.sleep(60)
    """
    w = start(workers, tmp_path, "stranger", body, server)
    w.read_line()
    real = start_time(w.proc.pid)
    assert real is not None
    # What the agent would hold after the worker it registered died and its PID was reused:
    # the PID of a live process with another start time.
    server.watch_worker(0, w.proc.pid, start_time=real - 100)
    wait_until(lambda: server.stats["dropped_stale"] == 1, what="the stale worker to be dropped")
    time.sleep(0.2)
    assert w.proc.poll() is None and psutil.Process(w.proc.pid).status() != psutil.STATUS_STOPPED
    assert server.stats["killed"] == 0 and server.expiries() == []


def test_timers_of_an_exited_worker_are_dropped(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    body = """
    t = timer.acquire(0.1, "left armed")
    print("armed", flush=True)
    os._exit(0)  # no release: the slot stays armed in the region
    """
    w = start(workers, tmp_path, "quitter", body, server)
    w.read_line()
    server.watch({0: w.proc.pid})  # a zombie until we wait(): the pidfd already says it exited
    wait_until(lambda: server.stats["dropped_exited"] == 1, what="the exited worker to be dropped")
    assert w.wait() == 0
    assert server.stats["killed"] == 0 and server.expiries() == []


def test_the_agent_itself_is_never_signalled(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the agent"):
        server.watch_worker(0, os.getpid())
    with pytest.raises(ValueError):
        ProcessHandle(1)
    bystander = start(workers, tmp_path, "bystander", 'print("up", flush=True)\ntime.sleep(60)\n',
                      server, local_rank=1)
    bystander.read_line()
    # This process claims the bystander's region and lets a timer expire in it.
    timer.detach()
    timer.attach(server.path, 1)
    t = timer.acquire(0, "agent's own")
    try:
        server.watch_worker(1, bystander.proc.pid)
        wait_until(lambda: server.stats["refused_owner"] == 1, what="the foreign owner refused")
        time.sleep(0.1)
        assert bystander.proc.poll() is None
        assert server.stats["expired"] == 0 and server.expiries() == []
    finally:
        timer.release(t)
        timer.detach()


# -- the client inside the worker --------------------------------------------------------------
def test_a_script_that_uses_no_timer_maps_nothing(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    body = """
    def mapped():
        with open("/proc/self/maps") as f:
            return "elastictk-timer" in f.read()
    before = mapped()
    with timer.expires(5, "first"):
        inside = mapped()
    print(before, inside, timer.ENV_REGIONS in os.environ, flush=True)
    """
    w = start(workers, tmp_path, "lazy", body, server)
    # Attached on first use; the variable is then consumed so children cannot share the region.
    assert w.read_line() == "False True False"
    assert w.wait() == 0


def test_two_processes_never_share_a_region(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    first = start(workers, tmp_path, "first", """
    with timer.expires(30, "mine"):
        print("claimed", flush=True)
        time.sleep(60)
    """, server)
    assert first.read_line() == "claimed"
    second = start(workers, tmp_path, "second", """
    with timer.expires(0.01, "would expire"):
        time.sleep(0.3)
    print(timer.status()["inert_reason"], flush=True)
    """, server)  # same LOCAL_RANK: its region is taken
    assert "already used by another process" in second.read_line()
    assert second.wait() == 0  # inert timers: not watched, not killed
    assert "timers in this process are inert" in second.stderr()


def test_a_forked_child_does_not_write_its_parents_region(
        server: TimerServer, workers: list[Worker], tmp_path: Path) -> None:
    body = """
    def child():
        with timer.expires(0.05, "child"):  # private, inert slots in the child
            time.sleep(0.4)
        os._exit(7 if timer.status()["attached"] is None else 1)

    def fork_and_wait():
        pid = os.fork()
        if pid == 0:
            child()
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    before = fork_and_wait()  # like a DataLoader worker forked before the first collective
    with timer.expires(30, "parent"):
        after = fork_and_wait()
    print(before, after, timer.status()["attached"] is not None, flush=True)
    """
    w = start(workers, tmp_path, "forker", body, server)
    server.watch({0: w.proc.pid})
    assert w.read_line() == "7 7 True"
    assert w.wait() == 0
    assert server.stats["expired"] == 0


def test_bad_input_is_one_clear_error(server: TimerServer, tmp_path: Path) -> None:
    for after in (-1, math.nan, math.inf, 2e9):
        with pytest.raises(TimerError, match="after="):
            timer.expires(after, "x")
    t = timer.expires(1, "x")
    with pytest.raises(TimerError, match="not running"):
        t.release()
    with t:
        with pytest.raises(TimerError, match="already running"):
            t.__enter__()
    assert not t.running
    with pytest.raises(TimerError, match="cannot open timer regions") as missing:
        timer.attach(str(tmp_path / "missing"), 0)
    with pytest.raises(TimerError, match="local ranks 0..1, not 5") as rank:
        timer.attach(server.path, 5)
    assert "\n" not in str(missing.value) + str(rank.value)
    with pytest.raises(ValueError, match="local_world_size"):
        TimerServer(0)
    with pytest.raises(ValueError, match="dump signal"):
        TimerServer(1, dump_signal=signal.SIGKILL)
    with pytest.raises(ValueError, match="collective timeout"):
        server.worker_env(collective_timeout=0)
    with pytest.raises(ValueError, match="outside 0..1"):
        server.watch_worker(2, 12345)


def test_server_close_is_idempotent_and_final() -> None:
    srv = TimerServer(1)
    path = srv.path
    assert os.readlink(path).startswith("/memfd:elastictk-timer")  # nothing in /dev/shm
    srv.close()
    srv.close()
    with pytest.raises(RuntimeError, match="closed"):
        srv.watch_worker(0, 12345)
    try:
        assert not os.readlink(path).startswith("/memfd:elastictk-timer")
    except FileNotFoundError:
        pass  # the fd number is free again
