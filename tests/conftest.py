"""Suite-wide guards: every test must leave no process, shared-memory segment or port behind."""
from __future__ import annotations

import os
import time
from typing import Iterator

import psutil
import pytest

# Python's own multiprocessing helper lives for the whole session by design.
_EXEMPT = ("multiprocessing.resource_tracker",)
# Servers owned by session-scoped fixtures (reaped at session end, not per test).
SESSION_PIDS: set[int] = set()


def _children() -> dict[int, str]:
    out: dict[int, str] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if p.pid not in SESSION_PIDS and not any(e in cmd for e in _EXEMPT):
            out[p.pid] = cmd
    return out


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a child process or a /dev/shm segment behind (and reap them)."""
    before_procs, before_shm = set(_children()), _shm()
    yield
    deadline = time.monotonic() + 5
    leaked = {}
    while time.monotonic() < deadline:
        leaked = {pid: cmd for pid, cmd in _children().items() if pid not in before_procs}
        if not leaked:
            break
        time.sleep(0.05)
    for pid in leaked:  # only processes this test started, by PID
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    new_shm = {s for s in _shm() - before_shm if s.startswith(("elastictk", "etk", "faketime_shm", "sem.faketime"))}
    for name in new_shm:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
    problems = [f"leaked process {pid}: {cmd[:200]}" for pid, cmd in leaked.items()]
    problems += [f"leaked shared memory /dev/shm/{n}" for n in sorted(new_shm)]
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


from elastictk.store.etcd_server import EtcdNotInstalled, EtcdServer  # noqa: E402


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the whole session (skipped, with the install hint, when etcd is missing).

    Tests share it safely by using a fresh key prefix each; a test that stops or restarts etcd
    starts its own EtcdServer instead.
    """
    try:
        server = EtcdServer(base_dir=tmp_path_factory.mktemp("etcd"))
    except EtcdNotInstalled as e:
        pytest.skip(str(e))
    with server:
        if server.pid is not None:
            SESSION_PIDS.add(server.pid)
        yield server
