"""An error reading ``/proc`` that is not ENOENT/ESRCH (out of file descriptors, say) never makes
a live process look gone: the agent keeps tracking its worker and can still stop it."""
from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
from typing import Any, Iterator

import pytest

from elastictk.lifetime import procfs
from elastictk.lifetime.handle import ProcessHandle
from elastictk.supervisor.sessions import WorkerSessions


def _failing_open(code: int) -> Any:
    def fake(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))
    return fake


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.EACCES, errno.ENOMEM])
def test_an_fd_error_reading_proc_is_unreadable_not_gone(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    monkeypatch.setattr(procfs, "open", _failing_open(code), raising=False)
    with pytest.raises(procfs.ProcUnreadable):
        procfs.stat(os.getpid())


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ESRCH])
def test_only_enoent_and_esrch_mean_gone(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    monkeypatch.setattr(procfs, "open", _failing_open(code), raising=False)
    assert procfs.stat(os.getpid()) is None


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_live_handle_with_proc_unreadable_is_held_and_not_exited(monkeypatch: pytest.MonkeyPatch,
                                                                   worker: subprocess.Popen[bytes]) -> None:
    h = ProcessHandle(worker.pid)
    try:
        monkeypatch.setattr(procfs, "open", _failing_open(errno.EMFILE), raising=False)
        assert h.held() and h.same_process() and not h.exited()
        assert h.send(0)
    finally:
        h.close()


def _exhaust_fds() -> tuple[list[int], tuple[int, int]]:
    """Lower this process's fd limit to a few past what it holds and fill it: /proc cannot be
    opened (EMFILE) until :func:`_release` runs."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 16, old[1]))
    filler: list[int] = []
    try:
        while True:
            filler.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as e:
        assert e.errno == errno.EMFILE
    return filler, old


def _release(filler: list[int], old: tuple[int, int]) -> None:
    for fd in filler:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, old)


def test_the_session_sweep_keeps_a_live_worker_while_proc_reads_fail_with_emfile(
        worker: subprocess.Popen[bytes]) -> None:
    sessions = WorkerSessions(death_watch=False)
    sessions.add(worker.pid)
    filler, old = _exhaust_fds()
    try:
        with pytest.raises(OSError):
            open(f"/proc/{worker.pid}/stat", "rb")  # /proc really is unreadable now
        sessions.sweep(force=True)
        tracked = [s.sid for s in sessions.all()]
        stopped = sessions.signal_group(worker.pid, signal.SIGTERM)
    finally:
        _release(filler, old)
    try:
        assert tracked == [worker.pid], "the sweep forgot a live worker on EMFILE"
        assert stopped, "the worker could not be signalled while /proc was unreadable"
        assert worker.wait(timeout=10) == -signal.SIGTERM
    finally:
        sessions.end_attempt()
        sessions.close()


def test_listing_proc_out_of_fds_is_unreadable_and_a_tree_is_empty_with_one_line(
        worker: subprocess.Popen[bytes], capfd: pytest.CaptureFixture[str]) -> None:
    """``os.listdir("/proc")`` under EMFILE once crashed the agent in ``WorkerGroup.close()``
    (issue 36): now the listing is :class:`ProcUnreadable`, a tree is empty (nothing pinned on a
    guess) and one line says so, however often it happens; the worker is still stopped."""
    from elastictk.lifetime import reaper

    sessions = WorkerSessions(death_watch=False)
    sessions.add(worker.pid)
    reaper._said_at.clear()
    filler, old = _exhaust_fds()
    try:
        with pytest.raises(procfs.ProcUnreadable, match="/proc cannot be listed now"):
            procfs.pids()
        trees = [reaper.Tree() for _ in range(3)]
        sessions.pin(worker.pid)
        found = reaper.signal_trees(sessions.all(), signal.SIGTERM)
    finally:
        _release(filler, old)
    try:
        assert all(t.stats == {} for t in trees) and found == []
        assert worker.wait(timeout=10) == -signal.SIGTERM, "the worker was not stopped"
        lines = [ln for ln in capfd.readouterr().err.splitlines() if "/proc cannot be listed" in ln]
        assert len(lines) == 1 and "ulimit -n" in lines[0], lines
    finally:
        sessions.end_attempt()
        sessions.close()
